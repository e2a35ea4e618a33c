"""The corpus: its chunk database, embeddings and FAISS index, opened for retrieval (:class:`Corpus`), and
its documents managed by key (:class:`DocumentSet`, ``corpus.documents``)."""

from .chunkdb import CorpusManifest, StoredDocument
from .corpus import Corpus, CorpusStats, RetrievedChunk
from .documents import DocumentHit, DocumentSet
from .embedder import Embedder, EmbedderLike, ExternalEmbedder, get_embedder
from .filters import AllOf, AnyOf, Condition, Filter, KeyIn, Not, parse_filter

__all__ = [
    "AllOf",
    "AnyOf",
    "Condition",
    "Corpus",
    "CorpusManifest",
    "CorpusStats",
    "DocumentHit",
    "DocumentSet",
    "Embedder",
    "EmbedderLike",
    "ExternalEmbedder",
    "Filter",
    "KeyIn",
    "Not",
    "RetrievedChunk",
    "StoredDocument",
    "get_embedder",
    "parse_filter",
]
