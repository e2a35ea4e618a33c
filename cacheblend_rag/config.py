"""The runtime values every layer takes, and their defaults: one home per concept.

:class:`Config` is plain data (typed and bounded, frozen); nothing here reads the environment. The edges
(the CLI, :class:`~cacheblend_rag.rag.CacheBlendRAG`, the integrations, the server, eval) read
:class:`~cacheblend_rag.settings.Settings` (a :class:`Config` loaded from ``CACHEBLEND_*`` variables) and
pass it, or the values in it, down; the core packages never read settings themselves, and a core
function's default is the constant of its concept below (or :data:`DEFAULTS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import platformdirs
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_METHOD = "cacheblend@budget=adaptive"
# the recompute ratio of CacheBlend when none is given, and the loading controller's quality floor
DEFAULT_RATIO = 0.15
DEFAULT_TOP_K = 6
DEFAULT_CHUNK_TOKENS = 512
DEFAULT_KV_DTYPE = "int8"
DEFAULT_CHUNK_CONTEXT = "neutral"
DEFAULT_ENGINE = "torch"
DEFAULT_INDEX_TYPE = "flat"
DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
# The answer length when a caller names none, at every entry point (CacheBlendRAG, the CLI, the
# LangChain and LlamaIndex models, the server); the ``max_tokens`` setting overrides it.
DEFAULT_MAX_TOKENS = 256
# ``check`` compares answers with full prefill's mostly on their first tokens: a few dozen tokens show
# the answers' drift without making a check of 20 questions take minutes
DEFAULT_CHECK_MAX_TOKENS = 32
# A question's first token is decisive when full prefill's top log-probability leads the runner-up's by at
# least this many nats; below it full prefill is itself a near-tie, and a method that picks the runner-up
# differs by less than any small change of the context could. eval and check report agreement on both.
DECISIVE_MARGIN = 0.5
# `serve` refuses a request body larger than this (413) before reading it: a prompt of a few MB is already
# far beyond any model's context, and parsing a huge body would hold the server for a minute
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024**2
DEFAULT_BATCH_MAX_REQUESTS = 8
DEFAULT_BATCH_KV_BUDGET_BYTES = 1024**3
DEFAULT_RAM_BUDGET_BYTES = 2 * 1024**3
DEFAULT_DISK_BUDGET_BYTES = 50 * 1024**3


def default_home() -> Path:
    """The per-user cache directory (provisioned models, default KV stores, profiles, checksums)."""
    return Path(platformdirs.user_cache_dir("cacheblend-rag"))


class Config(BaseModel):
    """Runtime configuration values (see the module docstring). Every field is also the setting
    ``CACHEBLEND_<FIELD>`` (:class:`~cacheblend_rag.settings.Settings`)."""

    model_config = ConfigDict(frozen=True)

    home: Path = Field(
        default_factory=default_home,
        description="Cache directory for provisioned models and default KV stores.",
    )
    model: str = Field(DEFAULT_MODEL, description="Default model name or local HF directory.")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$",
        description="'auto', 'cpu', 'mps', 'cuda' or 'cuda:N'.",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto' (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16."
    )
    kv_dtype: Literal["float16", "bfloat16", "float32", "int8", "int4"] = Field(
        DEFAULT_KV_DTYPE,
        description="Storage codec of chunk KV of a new corpus: int8 (default) / int4 (quantized, decoded "
        "to float16; see docs/kv_codecs.md), or float16, bfloat16, float32. A corpus records its own "
        "(manifest.json).",
    )
    threads: int = Field(0, ge=0, le=1024, description="Torch intra-op threads; 0 means one per core.")
    fusion: Literal["auto", "static", "layers"] = Field(
        "auto",
        description="How the torch engine fuses a request: 'static' (fixed-shape steps queued without "
        "reading back, blend/static.py), 'layers' (module-by-module layer passes) or 'auto' (static on an "
        "accelerator, layers on the CPU, where they are faster).",
    )
    fusion_compile: Literal["none", "default", "graphs"] = Field(
        "none",
        description="How the static fusion's work reaches the device: 'none' (each step launched as it "
        "is), 'default' (the steps compiled by torch.compile's Inductor: fewer, fused kernels, a compile "
        "per size bucket on first use) or 'graphs' (each fusion replayed as one CUDA graph per size bucket, "
        "blend/static_graph.py). See BENCHMARKS.md, section gpu.",
    )
    # 16: the chunker's floor (a chunk must reach a character boundary); 32768: beyond any context we run
    chunk_tokens: int = Field(
        DEFAULT_CHUNK_TOKENS, ge=16, le=32768, description="Maximum tokens per chunk at ingest."
    )
    top_k: int = Field(DEFAULT_TOP_K, ge=1, le=1000, description="Chunks retrieved per question.")
    engine: Literal["torch", "vllm"] = Field(
        DEFAULT_ENGINE,
        description="Engine: 'torch' (our PyTorch runtime) or 'vllm' (vLLM with the CacheBlend connector).",
    )
    vllm_fusion_attention: Literal["auto", "vllm", "runtime"] = Field(
        "auto",
        description="vLLM engine on CPU: which kernel attends the rows a fusion recomputes at scattered "
        "positions: 'vllm' (vLLM's paged kernel), 'runtime' (our masked SDPA blocks) or 'auto' (the faster "
        "of the two, timed on the first fusions of each size; docs/vllm.md).",
    )
    method: str = Field(
        DEFAULT_METHOD, min_length=1, description="Default PIC method (checked where parsed)."
    )
    chunk_context: Literal["neutral", "none"] = Field(
        DEFAULT_CHUNK_CONTEXT,
        description="What chunks are prefilled behind when their KV is precomputed: 'neutral' (the chat "
        "template's opening with a generic system message) or 'none' (each chunk alone from position 0). "
        "New corpora record it; see docs/fusor.md.",
    )
    ratio: float = Field(
        DEFAULT_RATIO, ge=0.0, le=1.0, description="Default CacheBlend recompute ratio (quality floor)."
    )
    batch_max_requests: int = Field(
        DEFAULT_BATCH_MAX_REQUESTS,
        ge=1,
        le=4096,
        description="Most requests the batch scheduler decodes together.",
    )
    batch_rounds: bool = Field(
        True,
        description="Batch scheduler: requests fused together that read the same chunks share one blend "
        "of them (a round) instead of blending them once each.",
    )
    batch_kv_budget_bytes: int = Field(
        DEFAULT_BATCH_KV_BUDGET_BYTES,
        gt=0,
        description="Batch scheduler: most bytes of KV (compute dtype) its decode batch may hold.",
    )
    ram_budget_bytes: int = Field(DEFAULT_RAM_BUDGET_BYTES, ge=0, description="RAM tier byte budget.")
    disk_budget_bytes: int = Field(DEFAULT_DISK_BUDGET_BYTES, ge=0, description="Disk tier byte budget.")
    kv_remote: str | None = Field(
        None,
        pattern=r"^(redis|rediss|unix)://",
        description="Shared remote KV tier under RAM and disk: redis://HOST:PORT/DB, rediss:// or unix:// "
        "(Redis or Valkey).",
    )
    index_type: Literal["flat", "ivf", "hnsw"] = Field(
        DEFAULT_INDEX_TYPE, description="Vector index of new corpora: flat (exact), ivf or hnsw."
    )
    embedder: str = Field(
        DEFAULT_EMBEDDER, min_length=1, description="Embedding model name or local directory."
    )
    max_tokens: int = Field(
        DEFAULT_MAX_TOKENS,
        ge=1,
        le=1_000_000,
        description="Most tokens per answer when a call names none: CacheBlendRAG, `query`, `serve`, the "
        "LangChain and LlamaIndex models.",
    )
    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES,
        ge=1024,
        description="`serve`: the largest request body accepted; a larger one is refused with 413.",
    )

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    def value_key(self) -> tuple[tuple[str, object], ...]:
        """Every field's value, as a hashable key: equal for equal values, whatever the class (the
        process's :class:`~cacheblend_rag.settings.Settings` and a :class:`Config` with its values share
        a key; pydantic's own equality tells the two classes apart)."""
        return tuple((name, getattr(self, name)) for name in Config.model_fields)


DEFAULTS = Config()
"""Every value at its default: what a core constructor uses when its caller passes no configuration."""
