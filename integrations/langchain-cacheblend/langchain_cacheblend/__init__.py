"""LangChain integration of cacheblend-rag: answer RAG prompts sooner by reusing chunk KV caches."""

from .chains import DEFAULT_RAG_PROMPT, create_cacheblend_rag_chain, format_documents
from .chat_models import MESSAGE_CHUNK_IDS_KEY, ChatCacheBlend
from .llms import CacheBlendLLM
from .retrievers import CacheBlendRetriever, chunk_document
from .structured import ToolCallingNotSupportedError
from .vectorstores import CacheBlendVectorStore

__all__ = [
    "DEFAULT_RAG_PROMPT",
    "MESSAGE_CHUNK_IDS_KEY",
    "CacheBlendLLM",
    "CacheBlendRetriever",
    "CacheBlendVectorStore",
    "ChatCacheBlend",
    "ToolCallingNotSupportedError",
    "chunk_document",
    "create_cacheblend_rag_chain",
    "format_documents",
]
