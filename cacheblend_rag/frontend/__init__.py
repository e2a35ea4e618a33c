"""Serve prompts that a framework (LangChain, LlamaIndex) has already written out as text: recognise the
stored chunks in them (:mod:`.recognition`), answer them through one shared engine and batch scheduler
(:mod:`.prompt_frontend`; one per corpus and settings, :mod:`.frontends`) over the process's one corpus
per directory (:mod:`.corpora`), with the generation options every integration shares (:mod:`.options`)
and structured output (:mod:`.structured`); and the documents behind the integrations' vector stores
(:mod:`.collection`)."""

from .collection import CollectionOptions, DocumentCollection
from .corpora import acquire_corpus, get_corpus, release_corpus, shared_corpora
from .frontends import acquire_frontend, get_frontend, release_frontend, shared_frontends
from .options import PROVIDER, GenerationOptions, TokenUsage, answer_report
from .prompt_frontend import DocumentRef, PromptFrontend, TextRequest, text_request
from .recognition import ANCHOR_CHARS, ChunkSpan, ChunkTextIndex, chunk_forms
from .structured import STRUCTURED_METHODS, constraint_of, response_format_for

__all__ = [
    "ANCHOR_CHARS",
    "PROVIDER",
    "STRUCTURED_METHODS",
    "ChunkSpan",
    "ChunkTextIndex",
    "CollectionOptions",
    "DocumentCollection",
    "DocumentRef",
    "GenerationOptions",
    "PromptFrontend",
    "TextRequest",
    "TokenUsage",
    "acquire_corpus",
    "acquire_frontend",
    "answer_report",
    "chunk_forms",
    "constraint_of",
    "get_corpus",
    "get_frontend",
    "release_corpus",
    "release_frontend",
    "response_format_for",
    "shared_corpora",
    "shared_frontends",
    "text_request",
]
