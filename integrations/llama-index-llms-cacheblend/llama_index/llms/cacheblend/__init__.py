"""LlamaIndex LLM of cacheblend-rag: answer RAG prompts sooner by reusing chunk KV caches."""

from .base import CacheBlendLLM
from .synthesizer import CacheBlendSynthesizer
from .usage import CacheBlendUsageHandler

__all__ = ["CacheBlendLLM", "CacheBlendSynthesizer", "CacheBlendUsageHandler"]
