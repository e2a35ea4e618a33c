"""Serve prompts that a framework (LangChain, LlamaIndex) has already written out as text: recognise the
stored chunks in them (:mod:`.recognition`), answer them through one shared engine and batch scheduler
(:mod:`.text`), with the generation options every integration shares (:mod:`.options`)."""

from .options import PROVIDER, GenerationOptions, TokenUsage, answer_report
from .recognition import ANCHOR_CHARS, ChunkSpan, ChunkTextIndex, chunk_forms
from .text import DocumentRef, PromptFrontend, TextRequest, get_corpus, get_frontend, text_request

__all__ = [
    "ANCHOR_CHARS",
    "PROVIDER",
    "ChunkSpan",
    "ChunkTextIndex",
    "DocumentRef",
    "GenerationOptions",
    "PromptFrontend",
    "TextRequest",
    "TokenUsage",
    "answer_report",
    "chunk_forms",
    "get_corpus",
    "get_frontend",
    "text_request",
]
