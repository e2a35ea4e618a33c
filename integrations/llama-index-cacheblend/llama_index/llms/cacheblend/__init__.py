"""LlamaIndex LLM of cacheblend-rag: answer RAG prompts sooner by reusing chunk KV caches."""

from .base import CacheBlendLLM
from .synthesizer import CacheBlendSynthesizer

__all__ = ["CacheBlendLLM", "CacheBlendSynthesizer"]
