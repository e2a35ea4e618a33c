"""Build RAG prompts as segments with the model's own chat template.

The template is rendered with a stand-in where the passages go; the text around it is tokenized as fresh
segments and the chunks' stored token ids are spliced in between, so chunk text is never re-tokenized.
A chat whose messages name chunks (:meth:`PromptBuilder.chat_parts`) is laid out the same way, with a
stand-in for each chunk. Full prefill and every fusion method see exactly the same token ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..blend.methods import Reuse
from ..blend.segments import ChunkKVSource, Segment

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using only the passages provided. Be brief."
)
DEFAULT_USER_TEMPLATE = "Passages:\n{passages}\n\nQuestion: {question}"
CHUNK_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class ChunkRef:
    """A retrieved chunk as the engine needs it: its stored token ids, and optionally its id / KV."""

    token_ids: tuple[int, ...]
    chunk_id: str | None = None
    kv: ChunkKVSource | None = None


# A prompt laid out before any KV is attached: runs of fresh token ids and the chunks between them.
PromptPart = tuple[int, ...] | ChunkRef


def part_ids(part: PromptPart) -> tuple[int, ...]:
    return tuple(part.token_ids) if isinstance(part, ChunkRef) else part


# A chunk's KV by token ids, and whether it was computed for this request (no tier held it).
KVLookup = Callable[[Sequence[int]], tuple[ChunkKVSource, bool]]


def layout_segments(parts: Sequence[PromptPart], reuses: Reuse, kv_for: KVLookup) -> list[Segment]:
    """Segments of a prompt with the KV a method that ``reuses`` it needs, from ``kv_for(token_ids)``
    (each segment says whether its KV was computed for this request, ``Segment.computed``):

    - nothing: every part fresh (chunks keep their ids);
    - chunks: each chunk with its own KV (``ChunkRef.kv`` when given);
    - prefix: the prompt's head through its first chunk (the first part when it has no chunk) as one
      cached segment, its KV computed for exactly those ids as a prefix cache holds it; the rest fresh.
    """
    parts = [p for p in parts if part_ids(p)]
    if reuses is Reuse.PREFIX:
        ids = [t for p in parts for t in part_ids(p)]
        first = next((i for i, p in enumerate(parts) if isinstance(p, ChunkRef)), 0 if len(parts) > 1 else -1)
        end = sum(len(part_ids(p)) for p in parts[: first + 1])
        if end == 0:
            return [Segment.fresh(ids)]
        kv, computed = kv_for(ids[:end])
        return [Segment.cached(ids[:end], kv, computed=computed), Segment.fresh(ids[end:])]
    segments = []
    for part in parts:
        if not isinstance(part, ChunkRef):
            segments.append(Segment.fresh(part))
        elif reuses is Reuse.CHUNKS:
            kv, computed = (part.kv, False) if part.kv is not None else kv_for(part.token_ids)
            segments.append(Segment.cached(part.token_ids, kv, part.chunk_id, computed=computed))
        else:
            segments.append(Segment(tuple(part.token_ids), None, part.chunk_id))
    return segments


class PromptBuilder:
    """Turns (question, chunks) or chat messages into token ids / segments for one tokenizer."""

    def __init__(
        self,
        tokenizer,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        user_template: str = DEFAULT_USER_TEMPLATE,
    ) -> None:
        if "{passages}" not in user_template or "{question}" not in user_template:
            raise ValueError("user_template must contain {passages} and {question}")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.user_template = user_template

    def encode(self, text: str) -> list[int]:
        _check_unicode(text, "prompt text")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a chat (list of {role, content}) with the generation prompt appended."""
        return self.encode(self.render_chat(messages))

    def chat_parts(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[PromptPart]:
        """A chat as prompt parts, in the order the template renders them. Each message's ``content`` is
        text or a list of parts, each text or a :class:`ChunkRef`. The template is rendered once with a
        stand-in character for each chunk; the text between stand-ins is encoded as fresh parts and each
        chunk is its ChunkRef (its stored token ids, never re-tokenized), so no text is searched for.
        Raises ValueError when the template does not render each stand-in exactly once."""
        taken: set[str] = set()
        count = 0
        for message in messages:
            content = message.get("content") or ""
            for part in content if isinstance(content, list | tuple) else [content]:
                if isinstance(part, str):
                    taken.update(part)
                elif isinstance(part, ChunkRef):
                    count += 1
                else:
                    raise ValueError(f"a content part is text or a ChunkRef, not {type(part).__name__}")
        # Private Use Area characters absent from every text: a stand-in can then only clash with a
        # template that repeats or drops a message's content
        free = iter([c for c in map(chr, range(0xE000, 0xF900)) if c not in taken][:count])
        framed: list[dict] = []
        chunks: list[tuple[str, ChunkRef]] = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list | tuple):
                pieces = []
                for part in content:
                    if isinstance(part, ChunkRef):
                        chunks.append((next(free, ""), part))
                        part = chunks[-1][0]
                    pieces.append(part)
                message = {**message, "content": "".join(pieces)}
            framed.append(message)
        if any(not stand_in for stand_in, _ in chunks):
            raise ValueError(f"too many chunks in one chat ({count})")
        rendered = self.render_chat(framed, add_generation_prompt=add_generation_prompt)
        for stand_in, ref in chunks:
            if rendered.count(stand_in) != 1:
                raise ValueError(
                    f"the chat template rendered chunk {ref.chunk_id or '(no id)'} "
                    f"{rendered.count(stand_in)} times: chunk parts need a template that renders each "
                    "message's content exactly once"
                )
        parts: list[PromptPart] = []
        previous = 0
        for at, ref in sorted(((rendered.index(s), ref) for s, ref in chunks), key=lambda place: place[0]):
            parts += [tuple(self.encode(rendered[previous:at])), ref]
            previous = at + 1
        parts.append(tuple(self.encode(rendered[previous:])))
        return [p for p in parts if part_ids(p)]

    def rag_frame(self, question: str) -> tuple[list[int], list[int], list[int]]:
        """(prefix, separator, suffix) token ids around the passages for ``question``."""
        _check_unicode(question, "the question")
        # Two renders with different one-character stand-ins for the passages differ only there: their
        # common prefix and suffix are the text around the passages, whatever the question contains.
        first, second = (self._render_rag(question, stand_in) for stand_in in ("\x00", "\x01"))
        head = _common_prefix_length(first, second)
        tail = _common_prefix_length(first[::-1], second[::-1])
        if head + 1 + tail != len(first):
            raise ValueError("the chat template must render the user message exactly once")
        before, after = first[:head], first[len(first) - tail :]
        return self.encode(before), self.encode(CHUNK_SEPARATOR), self.encode(after)

    def _render_rag(self, question: str, passages: str) -> str:
        content = self.user_template.format(passages=passages, question=question)
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": content}]
        return self.render_chat(messages)

    def rag_parts(self, question: str, chunks: Sequence[ChunkRef]) -> list[PromptPart]:
        """Fresh prefix, then each chunk separated by fresh separators, then the fresh question and
        generation prompt (empty parts dropped)."""
        prefix, separator, suffix = self.rag_frame(question)
        parts: list[PromptPart] = [tuple(prefix)]
        for i, chunk in enumerate(chunks):
            if i:
                parts.append(tuple(separator))
            parts.append(chunk)
        parts.append(tuple(suffix))
        return [p for p in parts if part_ids(p)]

    def rag_segments(self, question: str, chunks: Sequence[ChunkRef]) -> list[Segment]:
        """:meth:`rag_parts` as segments, each chunk cached where it carries KV."""
        return [
            Segment(tuple(p.token_ids), p.kv, p.chunk_id) if isinstance(p, ChunkRef) else Segment.fresh(p)
            for p in self.rag_parts(question, chunks)
        ]


def _check_unicode(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode: lone surrogate at character {exc.start}") from None


def _common_prefix_length(a: str, b: str) -> int:
    shorter = min(len(a), len(b))
    return next((i for i in range(shorter) if a[i] != b[i]), shorter)
