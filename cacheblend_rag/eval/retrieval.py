"""Retrieval for eval, on the product's path: a data set's contexts stored as one corpus.

Each case's contexts are documents of one :class:`~cacheblend_rag.corpus.Corpus` (keyed
``case/<id>/<context>``, metadata ``{"case": id, "context": i}``), added through the document API the
LangChain and LlamaIndex vector stores use, so they are cut by the corpus's chunker and embedded by its
embedder, exactly as a user's documents are. A QA case retrieves its ``top_k`` chunks with the corpus's
search, filtered to the case's own documents (the filter restricts the search before ranking, as a user's
metadata filter does); a summary takes its case's first ``top_k`` chunks in document order.

A context's text is its title on its own line, then its text (:attr:`~.datasets.Context.document`): the
chunk a prompt holds carries the title, and the chunk's embedding is of that same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..corpus.chunkreads import StoredDocument
from ..corpus.corpus import Corpus
from ..corpus.embedder import EmbedderLike
from ..errors import EvalDataError
from ..models.tokenizer import ModelTokenizer
from ..store.kvstore import KVStore
from .datasets import EvalCase


@dataclass(frozen=True)
class CaseChunk:
    """A chunk an eval case's prompt holds: the context it was cut from, its place in that context, its
    tokens, its retrieval score (None: taken in document order) and its id in the eval corpus."""

    context: int
    chunk: int
    token_ids: tuple[int, ...]
    score: float | None
    chunk_id: str = ""


def case_key(case_id: int, context: int) -> str:
    return f"case/{case_id}/{context}"


class EvalCorpus:
    """A data set's contexts as one corpus, added case by case as a run reaches them."""

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus

    @classmethod
    def open(
        cls,
        corpus_dir: Path,
        model: ModelTokenizer,
        embedder: EmbedderLike,
        chunk_tokens: int,
        kv_store: KVStore,
        chunk_context: str,
    ) -> EvalCorpus:
        """The eval corpus at ``corpus_dir`` (created when missing) for ``model`` and ``chunk_tokens``;
        ``kv_store``: the run's chunk KV store, which the corpus uses as its own."""
        corpus = Corpus.create(
            corpus_dir, model, embedder, chunk_tokens, kv_store=kv_store, chunk_context=chunk_context
        )
        return cls(corpus)

    def close(self) -> None:
        self.corpus.close()

    def __enter__(self) -> EvalCorpus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def documents(self, case: EvalCase) -> list[StoredDocument]:
        """``case``'s contexts as stored documents, storing those not stored yet (or stored with another
        text); a context with no text is left out."""
        keys = [case_key(case.case_id, i) for i in range(len(case.contexts))]
        stored = {doc.key: doc for doc in self.corpus.documents.get(keys)}
        missing = [
            i
            for i, key in enumerate(keys)
            if case.contexts[i].document.strip()
            and (key not in stored or stored[key].text != case.contexts[i].document)
        ]
        if not missing:
            return list(stored.values())
        self.corpus.documents.put(
            [case.contexts[i].document for i in missing],
            [keys[i] for i in missing],
            [{"case": case.case_id, "context": i} for i in missing],
        )
        return self.corpus.documents.get(keys)

    def retrieve(self, case: EvalCase, top_k: int, task: str) -> tuple[list[CaseChunk], int]:
        """The chunks ``case``'s prompt holds, in prompt order, and how many chunks the case has in all.
        QA: the ``top_k`` most similar to the question, best first (the corpus's search over the case's
        documents). Summaries: the first ``top_k`` chunks in document order."""
        place: dict[tuple[str, str], tuple[int, int]] = {}
        ordered: list[tuple[int, int, str]] = []
        for doc in self.documents(case):
            context = int(doc.metadata["context"])
            for j, chunk_id in enumerate(doc.chunk_ids):
                place.setdefault((doc.key, chunk_id), (context, j))
                ordered.append((context, j, chunk_id))
        if not ordered:
            raise EvalDataError(f"case {case.case_id}: its contexts give no tokens")
        ordered.sort()
        if task == "summary":
            chosen = ordered[:top_k]
            tokens = self._tokens([c for *_, c in chosen])
            return [CaseChunk(i, j, tokens[c], None, c) for i, j, c in chosen], len(ordered)
        hits = self.corpus.documents.search(case.question, k=top_k, where={"case": case.case_id})
        tokens = self._tokens([hit.chunk_id for hit in hits])
        out = [
            CaseChunk(*place[(hit.key, hit.chunk_id)], tokens[hit.chunk_id], float(hit.score), hit.chunk_id)
            for hit in hits
        ]
        return out, len(ordered)

    def _tokens(self, chunk_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
        unique = list(dict.fromkeys(chunk_ids))
        return {c.chunk_id: c.token_ids for c in self.corpus.get_chunks(unique)}
