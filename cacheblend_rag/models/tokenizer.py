"""A model's identity without its weights: its tokenizer, name and fingerprint (what ingest, the corpus and
the vLLM engine's main process need)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import ModelNotFoundError
from .loader import model_fingerprint
from .provision import resolve_model_path


@dataclass(frozen=True)
class ModelTokenizer:
    """A model's tokenizer plus what identifies the model (the same fingerprint ``load_model`` reports)."""

    name: str
    path: Path
    fingerprint: str
    tokenizer: Any  # a fast Hugging Face tokenizer


def load_model_tokenizer(model: str | Path | None = None) -> ModelTokenizer:
    """Tokenizer and fingerprint of ``model`` (default model name or local HF folder), without its weights."""
    return _load(str(resolve_model_path(model)))


@lru_cache(maxsize=4)
def _load(path_str: str) -> ModelTokenizer:
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path_str)
    try:
        family = AutoConfig.from_pretrained(path).model_type
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load the tokenizer of {path}: {exc}") from exc
    return ModelTokenizer(path.name, path, model_fingerprint(path, family), tokenizer)
