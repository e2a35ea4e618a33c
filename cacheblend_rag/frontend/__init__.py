"""Serve prompts that a framework (LangChain, LlamaIndex) has already written out as text: recognise the
stored chunks in them (:mod:`.recognition`), answer them through one shared engine and batch scheduler
(:mod:`.text`), with the generation options every integration shares (:mod:`.options`); and the documents
behind the integrations' vector stores (:mod:`.collection`)."""

from .collection import CollectionOptions, DocumentCollection
from .options import PROVIDER, GenerationOptions, TokenUsage, answer_report
from .recognition import ANCHOR_CHARS, ChunkSpan, ChunkTextIndex, chunk_forms
from .text import (
    DocumentRef,
    PromptFrontend,
    TextRequest,
    acquire_frontend,
    get_corpus,
    get_frontend,
    release_frontend,
    text_request,
)

__all__ = [
    "ANCHOR_CHARS",
    "PROVIDER",
    "ChunkSpan",
    "ChunkTextIndex",
    "CollectionOptions",
    "DocumentCollection",
    "DocumentRef",
    "GenerationOptions",
    "PromptFrontend",
    "TextRequest",
    "TokenUsage",
    "acquire_frontend",
    "answer_report",
    "chunk_forms",
    "get_corpus",
    "get_frontend",
    "release_frontend",
    "text_request",
]
