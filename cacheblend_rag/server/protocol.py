"""The OpenAI wire format the server speaks: request bodies (validated), the request each becomes for the
engine (:class:`GenerationSpec`), and the response and stream-chunk bodies.

Extension fields (documented in docs/server.md), accepted beside OpenAI's on both endpoints:
``chunk_ids`` (stored chunks the prompt contains), ``documents`` (texts the prompt contains, as strings or
``{"text", "chunk_id"}``), ``method`` and ``ratio``; in a chat message's content list, a
``{"type": "chunk", "chunk_id"}`` part places a stored chunk there (no text is searched for it). Every
response carries a ``cacheblend`` object (time to first token, method, reused and computed tokens, chunks)
beside OpenAI's fields; cached prompt tokens are reported where OpenAI reports them, in
``usage.prompt_tokens_details.cached_tokens``.

Unknown fields are ignored, as new OpenAI clients send fields older servers do not know. Fields that would
change the answer in a way this server cannot honour (``n > 1``, tools, logprobs, penalties, logit bias,
``echo``, ``suffix``, ``best_of``) are refused with a 400 naming the parameter.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..config import DEFAULT_MAX_TOKENS
from .errors import APIError

OPENAI_DEFAULT_TEMPERATURE = 1.0  # what OpenAI uses when a request names none


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Body):
    type: str
    text: str | None = None
    chunk_id: str | None = None  # extension: a "chunk" part names a stored chunk


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class DocumentIn(_Body):
    text: str
    chunk_id: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _GenerationBody(_Body):
    """What both endpoints share: sampling, streaming, and our extension fields."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # -- extension: which stored chunks or documents the prompt contains, and the fusion method
    chunk_ids: list[str] | None = None
    documents: list[str | DocumentIn] | None = None
    method: str | None = None
    ratio: float | None = Field(None, ge=0.0, le=1.0)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError.unsupported("n", "more than one choice per request (n > 1)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError.unsupported(name, name.replace("_", " "))
        if self.logit_bias:
            raise APIError.unsupported("logit_bias", "logit bias")

    def _spec(self, max_tokens: int | None, default_max_tokens: int, **prompt: Any) -> GenerationSpec:
        self._refuse_unsupported()
        if self.chunk_ids is not None and not self.chunk_ids:
            raise APIError.bad_request(
                "chunk_ids is empty: name at least one stored chunk, or leave chunk_ids out to have the "
                "prompt's stored chunks found in its text",
                "chunk_ids",
            )
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        documents = [(d, None) if isinstance(d, str) else (d.text, d.chunk_id) for d in self.documents or []]
        return GenerationSpec(
            documents=documents,
            chunk_ids=list(self.chunk_ids or []),
            method=self.method,
            ratio=self.ratio,
            max_tokens=max_tokens or default_max_tokens,
            strict=max_tokens is not None,
            temperature=OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=[s for s in stops if s],
            **prompt,
        )


class ChatCompletionRequest(_GenerationBody):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None

    def to_spec(self, default_max_tokens: int) -> GenerationSpec:
        if self.tools or self.functions:
            raise APIError.unsupported("tools", "tool calling")
        if self.logprobs or self.top_logprobs:
            raise APIError.unsupported("logprobs", "log probabilities")
        messages = [_chat_message(i, m) for i, m in enumerate(self.messages)]
        if any(isinstance(m["content"], list) for m in messages):
            for name in ("chunk_ids", "documents"):
                if getattr(self, name):
                    raise APIError.bad_request(
                        f"{name} locates chunks in a prompt's text; a chat with chunk content parts names "
                        f"its chunks in place: leave {name} out",
                        name,
                    )
        max_tokens = self.max_completion_tokens or self.max_tokens
        response_format = self.response_format
        fmt = None
        if response_format is not None and response_format.type != "text":
            fmt = response_format.model_dump(exclude_none=True)
        return self._spec(max_tokens, default_max_tokens, messages=messages, response_format=fmt)


class CompletionRequest(_GenerationBody):
    """``POST /v1/completions`` (the prompt is used as it is: no chat template)."""

    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def to_spec(self, default_max_tokens: int) -> GenerationSpec:
        if self.echo:
            raise APIError.unsupported("echo", "echoing the prompt")
        if self.suffix:
            raise APIError.unsupported("suffix", "a suffix (insertion)")
        if self.best_of not in (None, 1):
            raise APIError.unsupported("best_of", "best_of > 1")
        if self.logprobs is not None:
            raise APIError.unsupported("logprobs", "log probabilities")
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if len(prompts) != 1:
            raise APIError.unsupported("prompt", "a list of several prompts (send one request per prompt)")
        return self._spec(self.max_tokens, default_max_tokens, prompt=prompts[0])


@dataclass(frozen=True)
class ChunkPart:
    """A stored chunk named in a message's content (a ``{"type": "chunk", "chunk_id"}`` part); ``where``
    is the part's place in the request, for errors."""

    chunk_id: str
    where: str


def _chat_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template takes it: {role, content}, the content as text, or as a list of texts
    and :class:`ChunkPart` when it names stored chunks."""
    where = f"messages[{index}]"
    if message.role in ("tool", "function") or message.tool_calls:
        raise APIError.unsupported(where, "tool calling (tool messages and tool calls)")
    if message.content is None:  # OpenAI refuses it too: only an assistant's tool call goes without one
        raise APIError.bad_request(
            f"{where}.content is missing or null: give the message's text (a string or a list of parts)",
            f"{where}.content",
        )
    content: Any = message.content
    if isinstance(content, list):
        pieces: list[str | ChunkPart] = []
        for j, part in enumerate(content):
            if part.type == "text":
                pieces.append(part.text or "")
            elif part.type == "chunk":
                at = f"{where}.content[{j}].chunk_id"
                if not part.chunk_id:
                    raise APIError.bad_request(
                        "a chunk content part needs the chunk_id of a stored chunk", at
                    )
                pieces.append(ChunkPart(part.chunk_id, at))
            else:
                what = f"content of type {part.type!r} (text and chunk parts only)"
                raise APIError.unsupported(f"{where}.content[{j}]", what)
        chunked = any(isinstance(p, ChunkPart) for p in pieces)
        content = pieces if chunked else "".join(p for p in pieces if isinstance(p, str))
    role = "system" if message.role == "developer" else message.role  # OpenAI's newer name for system
    return {"role": role, "content": content or ""}


@dataclass(frozen=True)
class GenerationSpec:
    """One request for the engine: a chat (``messages``, the model's template applied; a content that names
    stored chunks is a list of texts and :class:`ChunkPart`) or a raw ``prompt``, and how to generate.
    ``documents`` are (text, chunk id or None)."""

    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    documents: list[tuple[str, str | None]] = field(default_factory=list)
    chunk_ids: list[str] = field(default_factory=list)
    method: str | None = None
    ratio: float | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    strict: bool = False  # asked for outright: more than fits is a 400, not cut short
    temperature: float = OPENAI_DEFAULT_TEMPERATURE
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    response_format: dict[str, Any] | None = None


@dataclass(frozen=True)
class Answer:
    """A finished answer: the text, token counts, and the ``cacheblend`` extension object."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    details: dict[str, Any]


# -- responses ---------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(answer: Answer) -> dict[str, Any]:
    """Token counts as OpenAI reports them; ``prompt_tokens_details.cached_tokens``: prompt tokens whose
    KV was read from a cache and kept, never KV computed for this request (docs/accounting.md)."""
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": answer.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


@dataclass
class ResponseFrame:
    """What every body and chunk of one response shares."""

    kind: Literal["chat", "text"]
    model: str
    fingerprint: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl" if self.kind == "chat" else "cmpl")
        self.created = self.created or int(time.time())

    def _head(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def completion(self, answer: Answer) -> dict[str, Any]:
        """The non-streamed response body."""
        if self.kind == "chat":
            message = {"role": "assistant", "content": answer.text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": answer.finish_reason}
            head = self._head("chat.completion")
        else:
            choice = {
                "index": 0,
                "text": answer.text,
                "logprobs": None,
                "finish_reason": answer.finish_reason,
            }
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage(answer), "cacheblend": answer.details}

    def chunk(
        self, text: str | None = None, answer: Answer | None = None, first: bool = False
    ) -> dict[str, Any]:
        """A stream chunk: new ``text``, or (with ``answer``) the closing chunk with the finish reason and
        the ``cacheblend`` extension. A chat stream's ``first`` chunk announces the assistant role."""
        finish = answer.finish_reason if answer is not None else None
        if self.kind == "chat":
            delta: dict[str, Any] = {} if answer is not None else {"content": text or ""}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            body = {**self._head("text_completion"), "choices": [choice]}
        if answer is not None:
            body["cacheblend"] = answer.details
        return body

    def usage_chunk(self, answer: Answer) -> dict[str, Any]:
        """The last chunk when the client asked for ``stream_options.include_usage``."""
        name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(name), "choices": [], "usage": usage(answer)}


def model_card(model_id: str, created: int, details: dict[str, Any]) -> dict[str, Any]:
    """One entry of ``GET /v1/models``."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "cacheblend-rag",
        "cacheblend": details,
    }
