"""Retrieval over a store directory: embeddings, the FAISS index and the chunk database."""

from .corpus import Corpus, CorpusStats, RetrievedChunk
from .embedder import Embedder, get_embedder

__all__ = ["Corpus", "CorpusStats", "Embedder", "RetrievedChunk", "get_embedder"]
