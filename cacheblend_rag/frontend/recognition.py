"""Recognising stored chunks inside a finished prompt text (see :class:`ChunkTextIndex`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..corpus import Corpus
from ..errors import ChunkNotFoundError

ANCHOR_CHARS = 32  # chunks shorter than this are not recognised: too little to save, too easy to mistake
_ID_BATCH = 500


@dataclass(frozen=True)
class ChunkSpan:
    """``text[start:end]`` of a prompt is the text of a chunk with these token ids."""

    start: int
    end: int
    chunk_id: str
    token_ids: tuple[int, ...]


class ChunkTextIndex:
    """Finds the text of stored chunks inside any text.

    Every chunk is indexed by the hash of the first :data:`ANCHOR_CHARS` characters (its anchor) of each
    of its forms: the exact text, and the forms frameworks turn it into — stripped of surrounding
    whitespace (LlamaIndex's compact synthesizers), and escaped as inside a Python string literal (stock
    ``SimpleSummarize`` in llama-index-core 0.14 pastes ``str(list_of_texts)``). :meth:`find` slides over
    the text once, looks each window up in the anchor table and confirms a hit by comparing the whole form,
    taking the longest match; matches do not overlap. Cost: one dict look-up per character of the prompt
    plus one database look-up per anchor hit, whatever the corpus's size and however the passages are
    separated. An exact match carries the chunk's stored token ids (and so its stored KV); another form is
    tokenized afresh and its KV cached under those ids on first sight, so later prompts reuse it too.

    The table follows the corpus: chunks added or removed since the last call are picked up first.
    """

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus
        # anchor hash -> [(form length, chunk id, form)], longest first
        self._anchors: dict[int, list[tuple[int, str, int]]] = {}
        self._anchors_of: dict[str, list[int]] = {}  # chunk id -> its anchor hashes
        self._version = -1
        self._lock = threading.Lock()

    def find(self, text: str, start: int = 0, end: int | None = None) -> list[ChunkSpan]:
        """Non-overlapping spans of ``text[start:end]`` that are a stored chunk in one of its forms."""
        end = len(text) if end is None else end
        anchors = self._current()
        spans: list[ChunkSpan] = []
        i = start
        while i <= end - ANCHOR_CHARS:
            span = None
            for length, chunk_id, form in anchors.get(hash(text[i : i + ANCHOR_CHARS]), ()):
                if i + length <= end:
                    span = self._confirm(text[i : i + length], chunk_id, form, i)
                    if span is not None:
                        break
            if span is None:
                i += 1
            else:
                spans.append(span)
                i = span.end
        return spans

    def _confirm(self, candidate: str, chunk_id: str, form: int, at: int) -> ChunkSpan | None:
        if form == EXACT:
            found = self.corpus.find_by_text(candidate)
            if found is None:
                return None
            return ChunkSpan(at, at + len(candidate), found.chunk_id, found.token_ids)
        try:
            (chunk,) = self.corpus.get_chunks([chunk_id])
        except ChunkNotFoundError:
            return None  # removed since the table was synced
        if chunk_forms(chunk.text).get(form) != candidate:
            return None
        return ChunkSpan(at, at + len(candidate), chunk_id, tuple(self.corpus.chunker.tokenize(candidate)))

    def _current(self) -> dict[int, list[tuple[int, str, int]]]:
        with self._lock:
            version = self.corpus.db.version()
            if version != self._version:
                self._sync()
                self._version = version
            return self._anchors

    def _sync(self) -> None:
        stored = set(self.corpus.db.iter_chunk_ids())
        for chunk_id in [c for c in self._anchors_of if c not in stored]:
            for key in self._anchors_of.pop(chunk_id):
                entries = self._anchors[key]
                entries[:] = [e for e in entries if e[1] != chunk_id]
        added = [c for c in stored if c not in self._anchors_of]
        for first in range(0, len(added), _ID_BATCH):
            for chunk in self.corpus.get_chunks(added[first : first + _ID_BATCH]):
                keys = []
                for form, text in chunk_forms(chunk.text).items():
                    key = hash(text[:ANCHOR_CHARS])
                    entries = self._anchors.setdefault(key, [])
                    entries.append((len(text), chunk.chunk_id, form))
                    entries.sort(reverse=True)  # longest first: a chunk that extends a shorter one wins
                    keys.append(key)
                self._anchors_of[chunk.chunk_id] = keys


EXACT, STRIPPED, ESCAPED, ESCAPED_QUOTES = range(4)


def chunk_forms(text: str) -> dict[int, str]:
    """The forms of a chunk's text that :class:`ChunkTextIndex` recognises, each at least
    :data:`ANCHOR_CHARS` long and distinct: exact, stripped, and escaped as Python's ``repr`` writes a
    string (with ``'`` left alone, or escaped as in a literal that holds both kinds of quote)."""
    forms: dict[int, str] = {}
    for form, variant in (
        (EXACT, text),
        (STRIPPED, text.strip()),
        (ESCAPED, repr(text)[1:-1]),
        (ESCAPED_QUOTES, repr(text + "'\"")[1:-4]),
    ):
        if len(variant) >= ANCHOR_CHARS and variant not in forms.values():
            forms[form] = variant
    return forms
