"""The corpus: its chunk database, embeddings and FAISS index, opened for retrieval (:class:`Corpus`)."""

from .chunkdb import CorpusManifest
from .corpus import Corpus, CorpusStats, RetrievedChunk
from .embedder import Embedder, get_embedder

__all__ = ["Corpus", "CorpusManifest", "CorpusStats", "Embedder", "RetrievedChunk", "get_embedder"]
