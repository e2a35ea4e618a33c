"""One settings object for the whole package, read from the environment (prefix ``CACHEBLEND_``).

Every field is typed and bounded: a bad value (``CACHEBLEND_RATIO=15``, ``CACHEBLEND_ENGINE=vlm``) fails
when the settings are loaded, with a :class:`SettingsError` naming the variable, the value and what it
accepts.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
ENV_PREFIX = "CACHEBLEND_"


class Settings(BaseSettings):
    """Runtime configuration. Every field can be set as ``CACHEBLEND_<FIELD>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    home: Path = Field(
        default_factory=lambda: Path(platformdirs.user_cache_dir("cacheblend-rag")),
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
        "float16",
        description="Storage codec of chunk KV: float16, bfloat16, float32, or int8 / int4 (quantized, "
        "decoded to float16; see docs/store.md). A corpus records its own (manifest.json).",
    )
    threads: int = Field(0, ge=0, le=1024, description="Torch intra-op threads; 0 means one per core.")
    # 16: the chunker's floor (a chunk must reach a character boundary); 32768: beyond any context we run
    chunk_tokens: int = Field(512, ge=16, le=32768, description="Maximum tokens per chunk at ingest.")
    top_k: int = Field(6, ge=1, le=1000, description="Chunks retrieved per question.")
    engine: Literal["torch", "vllm"] = Field(
        "torch",
        description="Engine: 'torch' (our PyTorch runtime) or 'vllm' (vLLM with the CacheBlend connector).",
    )
    method: str = Field("cacheblend", min_length=1, description="Default PIC method (checked where parsed).")
    chunk_context: Literal["neutral", "none"] = Field(
        "neutral",
        description="What chunks are prefilled behind when their KV is precomputed: 'neutral' (the chat "
        "template's opening with a generic system message) or 'none' (each chunk alone from position 0). "
        "New corpora record it; see docs/fusor.md.",
    )
    ratio: float = Field(
        0.15, ge=0.0, le=1.0, description="Default CacheBlend recompute ratio (quality floor)."
    )
    batch_max_requests: int = Field(
        8, ge=1, le=4096, description="Most requests the batch scheduler decodes together."
    )
    batch_rounds: bool = Field(
        True,
        description="Batch scheduler: requests fused together that read the same chunks share one blend "
        "of them (a round) instead of blending them once each.",
    )
    batch_kv_budget_bytes: int = Field(
        1024**3,
        gt=0,
        description="Batch scheduler: most bytes of KV (compute dtype) its decode batch may hold.",
    )
    ram_budget_bytes: int = Field(2 * 1024**3, ge=0, description="RAM tier byte budget.")
    disk_budget_bytes: int = Field(50 * 1024**3, ge=0, description="Disk tier byte budget.")
    kv_remote: str | None = Field(
        None,
        pattern=r"^(redis|rediss|unix)://",
        description="Shared remote KV tier under RAM and disk: redis://HOST:PORT/DB, rediss:// or unix:// "
        "(Redis or Valkey).",
    )
    index_type: Literal["flat", "ivf", "hnsw"] = Field(
        "flat", description="Vector index of new corpora: flat (exact), ivf or hnsw."
    )
    embedder: str = Field(
        "all-MiniLM-L6-v2", min_length=1, description="Embedding model name or local directory."
    )

    @property
    def models_dir(self) -> Path:
        return self.home / "models"


class SettingsError(ValueError):
    """A setting (an environment variable ``CACHEBLEND_<FIELD>``) has a value it does not accept."""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings (cached; call ``get_settings.cache_clear()`` after changing the environment).
    Raises :class:`SettingsError` naming every bad variable."""
    try:
        return Settings()
    except ValidationError as exc:
        raise SettingsError(describe_settings_error(exc)) from None


def describe_settings_error(exc: ValidationError) -> str:
    """One line per bad field: the variable, the value given and what it accepts."""
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        problems.append(f"{ENV_PREFIX}{field.upper()}={error.get('input')!r}: {error['msg']}")
    return "invalid setting" + ("s" if len(problems) > 1 else "") + ": " + "; ".join(problems)


def override_settings(**values: Any) -> Settings:
    """Set settings for this process and every process it starts (what a command-line flag such as
    ``--kv-remote`` does): each value is checked by :class:`Settings`, then written to its
    ``CACHEBLEND_<FIELD>`` environment variable, and the cached settings are dropped. The environment is
    the one channel every child inherits: vLLM's engine and worker processes open their own KV store from
    their own settings. Returns the new settings; a bad name or value raises ``ValueError`` and changes
    nothing (a bad value raises :class:`SettingsError`)."""
    unknown = sorted(set(values) - set(Settings.model_fields))
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}")
    if any(value is None for value in values.values()):
        raise ValueError("a setting cannot be overridden with None")
    try:
        Settings(**values)
    except ValidationError as exc:
        raise SettingsError(describe_settings_error(exc)) from None
    for name, value in values.items():
        os.environ[f"{ENV_PREFIX}{name.upper()}"] = str(value)
    get_settings.cache_clear()
    return get_settings()
