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


def load_model_tokenizer(model: str | Path | None = None, home: Path | None = None) -> ModelTokenizer:
    """Tokenizer and fingerprint of ``model`` (default model name or local HF folder), without its weights.
    ``home``: the cache directory (where the default model is provisioned and checksums are kept)."""
    return _load(str(resolve_model_path(model, home)), home)


@lru_cache(maxsize=4)
def _load(path_str: str, home: Path | None) -> ModelTokenizer:
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path_str)
    try:
        family = AutoConfig.from_pretrained(path).model_type
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load the tokenizer of {path}: {exc}") from exc
    return ModelTokenizer(path.name, path, model_fingerprint(path, family, home), tokenizer)


def generation_config(path: Path) -> Any:
    """The model's ``transformers.GenerationConfig`` (its end-of-sequence ids), or None without one."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        return None


# The system message of the neutral chunk context: generic, so the context suits any RAG prompt template.
NEUTRAL_SYSTEM_MESSAGE = "You are a helpful assistant."
_STAND_IN = "\x00"


def chunk_context_ids(tokenizer: Any, kind: str) -> tuple[int, ...]:
    """Token ids of the context chunks are prefilled behind when their KV is precomputed
    (``blend.segments.ChunkContext``).

    ``neutral``: the model's chat template opened with a generic system message and the start of a user
    turn, where the passages of a RAG prompt go (for SmolLM2: ``<|im_start|>system\nYou are a helpful
    assistant.<|im_end|>\n<|im_start|>user\n``); a tokenizer without a chat template gets its BOS token,
    or nothing. ``none``: no context (each chunk prefilled alone from position 0)."""
    if kind == "none":
        return ()
    if kind != "neutral":
        raise ValueError(f"unknown chunk context {kind!r}: use 'neutral' or 'none'")
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "system", "content": NEUTRAL_SYSTEM_MESSAGE},
            {"role": "user", "content": _STAND_IN},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        head = text[: text.index(_STAND_IN)]
        return tuple(tokenizer(head, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    return (int(bos),) if bos is not None else ()
