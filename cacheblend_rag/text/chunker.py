"""Split documents into chunks on the LLM tokenizer's token ids.

A document is tokenized once (no special tokens; text that looks like a control token such as
``<|im_end|>`` is tokenized as plain text, so a document cannot smuggle control tokens into a prompt).
The token sequence is then cut into chunks of at most ``max_tokens`` tokens, preferring a paragraph break,
then a sentence or line break, then a word break, that keeps the chunk at least half (a quarter for word
breaks) full.

Invariants, for every document ``text`` and ``chunks = Chunker(tok, n).split(text)``:

1. ``0 < chunk.n_tokens <= n`` for every chunk.
2. ``sum((c.token_ids for c in chunks), ())`` equals the token ids of the whole document.
3. ``"".join(c.text for c in chunks) == text`` and ``chunk.text == text[chunk.start:chunk.end]``: a chunk's
   text is a slice of the original text taken at token offsets, never a decode. (A text made only of
   characters the tokenizer drops, e.g. some control characters, has no tokens and gives no chunks.)
4. Tokenizing ``chunk.text`` alone gives back ``chunk.token_ids`` whenever some cut inside the budget
   allows it: every candidate cut is checked and cuts that break this are skipped. Byte-level BPE
   tokenizers (SmolLM2, Qwen, Llama 3) almost always have such a cut; where none exists (a run of
   ``n`` tokens without a break that tokenizes the same on both sides) the chunk is cut at the best
   cut anyway and ``chunk.retokenizes`` is False.

The chunk id is a content hash of the token ids, so content-identical chunks share one id (and one KV).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import DEFAULT_CHUNK_TOKENS
from ..errors import IngestError, InvalidChunkIdError

CHUNK_ID_HEX_CHARS = 32
_CHUNK_ID_RE = re.compile(rf"[0-9a-f]{{{CHUNK_ID_HEX_CHARS}}}")
MIN_CHUNK_TOKENS = 16  # below this a chunk cannot always reach a character boundary (4 bytes per char)

# Break strengths of a cut, strongest first.
PARAGRAPH, SENTENCE, WORD, ANY = 3, 2, 1, 0
_SENTENCE_END = re.compile(r"[.!?…][\"'”’)\]]*$")
_CJK_SENTENCE_END = re.compile(r"[。！？]$")  # CJK sentences end without a following space
_TAIL = 16  # characters of context enough to classify a cut
_MAX_TRIES = 24  # candidate cuts verified per chunk before giving up on invariant 4
_LOOKAHEAD = 16  # tokens after a cut re-tokenized to check the next chunk starts cleanly


def chunk_id_for(token_ids: Sequence[int]) -> str:
    """Stable content id of a token sequence: blake2b-128 of the ids as little-endian int32, in hex."""
    return hashlib.blake2b(pack_token_ids(token_ids), digest_size=CHUNK_ID_HEX_CHARS // 2).hexdigest()


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as a compact little-endian int32 blob (the on-disk form)."""
    return np.asarray(token_ids, dtype="<i4").tobytes()


def unpack_token_ids(blob: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(blob, dtype="<i4").tolist())


def validate_chunk_id(chunk_id: object) -> str:
    """Return ``chunk_id`` if it is a well-formed chunk id (32 lowercase hex chars), else raise."""
    if not isinstance(chunk_id, str) or not _CHUNK_ID_RE.fullmatch(chunk_id):
        shown = repr(chunk_id) if len(repr(chunk_id)) <= 80 else repr(chunk_id)[:77] + "..."
        raise InvalidChunkIdError(
            f"invalid chunk id {shown}: expected {CHUNK_ID_HEX_CHARS} lowercase hex characters"
        )
    return chunk_id


def _check_encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise IngestError(f"text is not valid Unicode: lone surrogate at character {exc.start}") from None


@dataclass(frozen=True)
class Chunk:
    """A run of a document's tokens with the exact text they came from."""

    token_ids: tuple[int, ...]
    text: str
    start: int  # character offsets of ``text`` in the document
    end: int
    retokenizes: bool  # invariant 4 holds: tokenizing ``text`` alone gives ``token_ids``

    @property
    def chunk_id(self) -> str:
        return chunk_id_for(self.token_ids)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


class Chunker:
    """Token-budgeted splitter bound to one (fast) Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any, max_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        if max_tokens < MIN_CHUNK_TOKENS:
            raise ValueError(f"chunk size must be at least {MIN_CHUNK_TOKENS} tokens, got {max_tokens}")
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("the chunker needs a fast (tokenizers-backed) tokenizer for offset mapping")
        from tokenizers import Tokenizer

        # A private copy: switching on literal encoding of special tokens must not affect the shared one.
        self._tok = Tokenizer.from_str(backend.to_str())
        self._tok.encode_special_tokens = True
        self._tok.no_truncation()
        self._tok.no_padding()
        self.max_tokens = max_tokens

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` exactly as :meth:`split` sees them (no special tokens added or parsed)."""
        _check_encodable(text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def split(self, text: str) -> list[Chunk]:
        """Cut ``text`` into chunks of at most ``max_tokens`` tokens (see the module invariants)."""
        if not text:
            return []
        _check_encodable(text)
        encoding = self._tok.encode(text, add_special_tokens=False)
        ids: list[int] = encoding.ids
        if not ids:
            return []
        cuts = self._clean_cuts(encoding.offsets, len(text))
        chunks: list[Chunk] = []
        start_tok, start_char = 0, 0
        while start_tok < len(ids):
            if len(ids) - start_tok <= self.max_tokens:
                end_tok, end_char = len(ids), len(text)
            else:
                end_tok = self._choose_cut(text, ids, cuts, start_tok, start_char)
                end_char = cuts[end_tok]
            piece = text[start_char:end_char]
            token_ids = tuple(ids[start_tok:end_tok])
            chunks.append(
                Chunk(token_ids, piece, start_char, end_char, self.tokenize(piece) == list(token_ids))
            )
            start_tok, start_char = end_tok, end_char
        return chunks

    @staticmethod
    def _clean_cuts(offsets: Sequence[tuple[int, int]], length: int) -> dict[int, int]:
        """Token index k -> character position where a cut before token k may go.

        A cut is clean when no character is shared by tokens on both sides (byte-level tokenizers split
        one multi-byte character over several tokens with the same offsets)."""
        cuts: dict[int, int] = {}
        covered = offsets[0][1]
        last = 0
        for k in range(1, len(offsets)):
            begin, end = offsets[k]
            if begin >= covered and begin > last:
                cuts[k] = begin
                last = begin
            covered = max(covered, end)
        cuts[len(offsets)] = length
        return cuts

    def _choose_cut(
        self, text: str, ids: list[int], cuts: dict[int, int], start_tok: int, start_char: int
    ) -> int:
        """Token index where the chunk that begins at ``start_tok`` ends."""
        limit = start_tok + self.max_tokens
        ranked: list[tuple[int, int, int]] = []  # (strength, token index, char position)
        for k in range(limit, start_tok, -1):
            char = cuts.get(k)
            if char is None:
                continue
            strength = self._strength(text, char)
            while strength > ANY and k - start_tok < self._min_fill(strength):
                strength -= 1  # a break that leaves the chunk mostly empty counts as a weaker one
            ranked.append((strength, k, char))
        if not ranked:
            raise AssertionError("no clean cut inside the budget")  # impossible: a char is at most 4 tokens
        ranked.sort(key=lambda item: (-item[0], -item[1]))
        for _, k, char in ranked[:_MAX_TRIES]:
            if self._cut_retokenizes(text, ids, cuts, start_tok, start_char, k, char):
                return k
        return ranked[0][1]

    def _cut_retokenizes(
        self,
        text: str,
        ids: list[int],
        cuts: dict[int, int],
        start_tok: int,
        start_char: int,
        k: int,
        char: int,
    ) -> bool:
        if self.tokenize(text[start_char:char]) != ids[start_tok:k]:
            return False
        # the next chunk begins at `char`: check its first tokens come out the same when read alone
        ahead = next((j for j in range(min(k + _LOOKAHEAD, len(ids)), k, -1) if j in cuts), None)
        return ahead is None or self.tokenize(text[char : cuts[ahead]]) == ids[k:ahead]

    def _min_fill(self, strength: int) -> int:
        return self.max_tokens // 2 if strength >= SENTENCE else self.max_tokens // 4

    @staticmethod
    def _strength(text: str, char: int) -> int:
        # classify by the whitespace run around the cut: byte-level tokenizers often only allow a cut
        # inside a blank line ("\n" | "\nNext"), which must still count as a paragraph break
        left = text[max(0, char - _TAIL) : char]
        right = text[char : char + _TAIL]
        before = left.rstrip()
        space = left[len(before) :] + right[: len(right) - len(right.lstrip())]
        if space.count("\n") >= 2:
            return PARAGRAPH
        if "\n" in space or (space and _SENTENCE_END.search(before)) or _CJK_SENTENCE_END.search(before):
            return SENTENCE
        return WORD if space else ANY
