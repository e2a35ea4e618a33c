"""Generation options shared by the framework integrations (LangChain, LlamaIndex), framework-neutral.

:class:`GenerationOptions` holds the fields every integration model exposes, validates them, maps them
(with per-call overrides) to a :class:`~.prompt_frontend.TextRequest`, and maps an answer back to usage
counts and a report; a framework class only adapts types (its methods are named apart from the
frameworks' own ``stream``, ``generate``, ``batch``, since an integration class inherits from both).
Every object over the same corpus, model and engine kind shares one engine in the process
(:func:`~.frontends.acquire_frontend`), and every engine the model's weights; ``close()`` gives the
object's hold back. ``engine="vllm"`` serves it with vLLM.

:class:`GenerationOptions` is the integrations' edge: its fields are the integration classes' own, so it
reads the settings (``CACHEBLEND_*``) as they do, and passes them down to the frontend.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from ..blend.spec import MethodSpec
from ..corpus.manifest import CorpusManifest
from ..engine import ENGINE_KINDS, GenerationResult, StreamHandle
from ..engine.bounds import check_request
from ..engine.session import Session
from ..settings import get_settings
from .collection import ensure_corpus
from .frontends import acquire_frontend, release_frontend
from .prompt_frontend import DocumentRef, PromptFrontend, TextRequest, text_request
from .structured import constraint_of

log = logging.getLogger(__name__)

PROVIDER = "cacheblend"


# Field names an earlier release accepted: refused by name (pydantic would otherwise drop them silently).
FORMER_NAMES = {"store_dir": "corpus_dir"}


def refuse_former_names(data: Any) -> None:
    """Raise ValueError naming the new field when ``data`` (a model's keyword arguments) uses a former one."""
    if isinstance(data, Mapping):
        for old, new in FORMER_NAMES.items():
            if old in data:
                raise ValueError(f"{old}= was renamed {new}=; pass {new}={data[old]!r}")


class GenerationOptions(BaseModel):
    """Settings of an integration model.

    How chunk KV is reused: a prompt that contains the exact text of stored chunks (a stock
    ``retriever | format_docs | prompt | llm`` chain) has those spans recognised and their stored KV
    blended in; documents passed with a call (``documents=``) name the chunks in the prompt outright, and
    those the corpus lacks are added to it and their KV computed on first sight.
    """

    # Options a single call may override, besides the documents pasted into its prompt.
    CALL_OPTIONS: ClassVar[frozenset[str]] = frozenset(
        {
            "documents",
            "method",
            "ratio",
            "max_tokens",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "response_format",
        }
    )

    corpus_dir: str | None = Field(
        default=None,
        description="Corpus directory (str or Path) built by `cacheblend-rag ingest` or a "
        "CacheBlendVectorStore; None: no chunk recognition.",
    )
    model: str | None = Field(
        default=None, description="Model name or folder (default: the corpus's model, else the settings')."
    )
    engine: str | None = Field(
        default=None,
        description="Engine: 'torch' (our PyTorch runtime) or 'vllm' (vLLM with the CacheBlend KV "
        "connector, needs the [vllm] extra); default: the engine setting (CACHEBLEND_ENGINE).",
    )
    method: str = Field(
        default_factory=lambda: get_settings().method,
        description="PIC method, with options if any (e.g. cacheblend, cacheblend@0.3, epic@k=32).",
    )
    ratio: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="Recompute ratio of a method that has one (default: the loading controller's choice).",
    )
    max_tokens: int = Field(
        default_factory=lambda: get_settings().max_tokens,
        ge=1,
        description="Most tokens to generate (default: the max_tokens setting, CACHEBLEND_MAX_TOKENS).",
    )
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, description="Sampling seed (with temperature > 0).")
    stop: list[str] | None = Field(default=None, description="Stop strings (excluded from the output).")
    recognise_chunks: bool = Field(
        default=True, description="Search prompts for the text of stored chunks to reuse their KV."
    )
    remember_documents: bool = Field(default=True, description="Add passed documents the corpus lacks to it.")

    _frontend: PromptFrontend | None = PrivateAttr(default=None)
    _warned_no_reuse: bool = PrivateAttr(default=False)

    @field_validator("corpus_dir", "model", mode="before")
    @classmethod
    def _path_as_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        MethodSpec.parse(value)  # an unknown method or a bad option is refused here, naming the problem
        return value

    @model_validator(mode="before")
    @classmethod
    def _no_former_names(cls, data: Any) -> Any:
        refuse_former_names(data)
        return data

    @model_validator(mode="after")
    def _ratio_taken(self) -> GenerationOptions:
        check_request(self.method, ratio=self.ratio)  # a method without a ratio refuses one, by name
        return self

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str | None) -> str | None:
        if value is not None and value not in ENGINE_KINDS:
            raise ValueError(f"unknown engine {value!r}; available: {', '.join(ENGINE_KINDS)}")
        return value

    @property
    def frontend(self) -> PromptFrontend:
        """The shared frontend for this corpus, model and engine kind (the engine is loaded on first use,
        and held until :meth:`close`)."""
        if self._frontend is None or self._frontend.closed:
            settings = get_settings()
            if self.corpus_dir is not None:
                # an empty or missing folder becomes a corpus, as for the vector stores
                ensure_corpus(Path(self.corpus_dir).expanduser(), self.model, config=settings)
            self._frontend = acquire_frontend(self.corpus_dir, self.model, self.engine, settings)
        return self._frontend

    @property
    def session(self) -> Session | None:
        """The corpus and the engine answering over it, checked to belong together (the frontend's; None
        without a corpus). Loads the engine on first use, like :attr:`frontend`."""
        return self.frontend.session

    def close(self) -> None:
        """Give back this object's hold on the shared engine; the last holder's close frees the model.
        The object loads it again if used afterwards."""
        frontend, self._frontend = self._frontend, None
        if frontend is not None:
            release_frontend(frontend)

    def _no_reuse(self) -> None:
        """A prompt held no chunk to reuse: say so, and how to fix it, once per object."""
        if self._warned_no_reuse:
            return
        self._warned_no_reuse = True
        where = f"corpus {self.corpus_dir}" if self.corpus_dir else "no corpus (corpus_dir is not set)"
        log.warning(
            "%s over %s: the prompt holds no stored chunk and no documents= were passed, so no chunk KV is "
            "reused (cache_read 0, full prefill). To reuse KV, retrieve with a CacheBlendVectorStore (or "
            "CacheBlendRetriever) over the corpus this model reads, build the chain with "
            "create_cacheblend_rag_chain, or pass the retrieved documents with documents=. "
            "(Said once per model object.)",
            type(self).__name__,
            where,
        )

    def model_label(self) -> str:
        """The model's name without loading it (for tracing parameters)."""
        if self.model:
            return Path(self.model).name
        manifest = CorpusManifest.load(Path(self.corpus_dir).expanduser()) if self.corpus_dir else None
        return manifest.model if manifest is not None else get_settings().model

    def identifying_params(self) -> dict[str, Any]:
        """What identifies these options in traces and caches."""
        return {
            "corpus_dir": self.corpus_dir,
            "model": self.model,
            "engine": self.engine or get_settings().engine,
            "method": self.method,
            "ratio": self.ratio,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }

    def text_request(
        self, text: str, documents: Sequence[DocumentRef], overrides: Mapping[str, Any]
    ) -> TextRequest:
        """A request for ``text`` with these options, ``overrides`` (one call's options) applied.
        ``response_format`` (a call option only) makes the answer JSON: see :mod:`.structured`."""
        unknown = set(overrides) - self.CALL_OPTIONS
        if unknown:
            supported = ", ".join(sorted(self.CALL_OPTIONS))
            raise TypeError(f"unsupported option(s) {', '.join(sorted(unknown))}; supported: {supported}")
        stop = overrides.get("stop")
        return text_request(
            text,
            documents,
            method=overrides.get("method", self.method),
            ratio=overrides.get("ratio", self.ratio),
            max_tokens=overrides.get("max_tokens", self.max_tokens),
            temperature=overrides.get("temperature", self.temperature),
            top_p=overrides.get("top_p", self.top_p),
            seed=overrides.get("seed", self.seed),
            stop=stop if stop is not None else self.stop,
            constraint=constraint_of(overrides.get("response_format")),
        )

    def chunk_documents(self, chunk_ids: Sequence[str]) -> list[DocumentRef]:
        """Stored chunks, by id, as documents to pass with a prompt."""
        return self.frontend.chunk_documents(chunk_ids)

    def stream_answer(self, request: TextRequest) -> StreamHandle[GenerationResult]:
        """The answer's handle: iterate it for tokens, then ``.result()``."""
        return self.frontend.stream(request, self.recognise_chunks, self.remember_documents, self._no_reuse)

    def answer_batch(self, requests: Sequence[TextRequest]) -> list[GenerationResult]:
        """Answer every request in one submission (batched by the engine); results in order."""
        return self.frontend.generate_batch(
            requests, self.recognise_chunks, self.remember_documents, self._no_reuse
        )


@dataclass(frozen=True)
class TokenUsage:
    """Token counts of one answer (docs/accounting.md): ``cached`` counts the prompt tokens whose KV was
    read from a cache and kept (``cached_exact`` + ``cached_blended``), ``recomputed`` those computed
    while answering, ``kv_computed`` the chunk KV no tier held, computed for this request."""

    input: int
    output: int
    cached: int
    cached_exact: int = 0
    cached_blended: int = 0
    recomputed: int = 0
    kv_computed: int = 0

    @property
    def total(self) -> int:
        return self.input + self.output

    @classmethod
    def of(cls, result: GenerationResult) -> TokenUsage:
        return cls(
            result.prompt_tokens,
            len(result.token_ids),
            result.cached_tokens,
            result.cache_read_exact_tokens,
            result.cache_read_blended_tokens,
            result.computed_tokens,
            result.kv_computed_tokens,
        )

    def details(self) -> dict[str, int]:
        """The split, as the integrations and the server report it beside ``cached_tokens``."""
        return {
            "cache_read_exact_tokens": self.cached_exact,
            "cache_read_blended_tokens": self.cached_blended,
            "recomputed_tokens": self.recomputed,
            "kv_computed_tokens": self.kv_computed,
        }


def answer_report(result: GenerationResult) -> dict[str, Any]:
    """What the engine reports about one answer (time to first token, method and options, recompute
    ratio, reused and computed tokens, chunk ids, the loading controller's decision), without the
    answer's token ids."""
    report = result.to_dict()
    report.pop("token_ids")
    return report
