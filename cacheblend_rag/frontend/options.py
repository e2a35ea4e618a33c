"""Generation options shared by the framework integrations (LangChain, LlamaIndex), framework-neutral.

:class:`GenerationOptions` holds the fields every integration model exposes, validates them, maps them
(with per-call overrides) to a :class:`~.text.TextRequest`, and maps an answer back to usage counts and a
report; a framework class only adapts types (its methods are named apart from the frameworks' own
``stream``, ``generate``, ``batch``, since an integration class inherits from both). Every object over
the same corpus, model and engine kind shares one engine in the process (:func:`~.text.get_frontend`);
``engine="vllm"`` serves it with vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import AliasChoices, BaseModel, Field, field_validator

from ..blend.spec import MethodSpec
from ..corpus.chunkdb import CorpusManifest
from ..engine import ENGINE_KINDS, GenerationResult, StreamHandle
from ..settings import get_settings
from .text import DocumentRef, PromptFrontend, TextRequest, get_frontend, text_request

PROVIDER = "cacheblend"


class GenerationOptions(BaseModel):
    """Settings of an integration model.

    How chunk KV is reused: a prompt that contains the exact text of stored chunks (a stock
    ``retriever | format_docs | prompt | llm`` chain) has those spans recognised and their stored KV
    blended in; documents passed with a call (``documents=``) name the chunks in the prompt outright, and
    those the corpus lacks are added to it and their KV computed on first sight.
    """

    # Options a single call may override, besides the documents pasted into its prompt.
    CALL_OPTIONS: ClassVar[frozenset[str]] = frozenset(
        {"documents", "method", "ratio", "max_tokens", "temperature", "top_p", "seed", "stop"}
    )

    corpus_dir: str | None = Field(
        default=None,
        validation_alias=AliasChoices("corpus_dir", "store_dir"),
        description="Corpus directory built by `cacheblend-rag ingest` (also accepted as store_dir); "
        "None: no chunk recognition.",
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
    max_tokens: int = Field(default=256, ge=1, description="Most tokens to generate.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, description="Sampling seed (with temperature > 0).")
    stop: list[str] | None = Field(default=None, description="Stop strings (excluded from the output).")
    recognise_chunks: bool = Field(
        default=True, description="Search prompts for the text of stored chunks to reuse their KV."
    )
    remember_documents: bool = Field(default=True, description="Add passed documents the corpus lacks to it.")

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        MethodSpec.parse(value)  # an unknown method or a bad option is refused here, naming the problem
        return value

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str | None) -> str | None:
        if value is not None and value not in ENGINE_KINDS:
            raise ValueError(f"unknown engine {value!r}; available: {', '.join(ENGINE_KINDS)}")
        return value

    @property
    def store_dir(self) -> str | None:
        """The corpus directory (its former name)."""
        return self.corpus_dir

    @property
    def frontend(self) -> PromptFrontend:
        """The shared frontend for this corpus, model and engine kind (the engine is loaded on first use)."""
        return get_frontend(self.corpus_dir, self.model, self.engine)

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
        """A request for ``text`` with these options, ``overrides`` (one call's options) applied."""
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
        )

    def chunk_documents(self, chunk_ids: Sequence[str]) -> list[DocumentRef]:
        """Stored chunks, by id, as documents to pass with a prompt."""
        return self.frontend.chunk_documents(chunk_ids)

    def stream_answer(self, request: TextRequest) -> StreamHandle[GenerationResult]:
        """The answer's handle: iterate it for tokens, then ``.result()``."""
        return self.frontend.stream(request, self.recognise_chunks, self.remember_documents)

    def answer_batch(self, requests: Sequence[TextRequest]) -> list[GenerationResult]:
        """Answer every request in one submission (batched by the engine); results in order."""
        return self.frontend.generate_batch(requests, self.recognise_chunks, self.remember_documents)


@dataclass(frozen=True)
class TokenUsage:
    """Token counts of one answer; ``cached`` counts the prompt tokens whose KV was reused."""

    input: int
    output: int
    cached: int

    @property
    def total(self) -> int:
        return self.input + self.output

    @classmethod
    def of(cls, result: GenerationResult) -> TokenUsage:
        return cls(result.prompt_tokens, len(result.token_ids), result.reused_tokens)


def answer_report(result: GenerationResult) -> dict[str, Any]:
    """What the engine reports about one answer (time to first token, method and options, recompute
    ratio, reused and computed tokens, chunk ids, the loading controller's decision), without the
    answer's token ids."""
    report = result.to_dict()
    report.pop("token_ids")
    return report
