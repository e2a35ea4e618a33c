"""Load a local Hugging Face model folder into a :class:`LayerwiseModel`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from ..config import DEFAULTS, Config, default_home
from ..errors import ModelNotFoundError, UnsupportedModelError
from .provision import resolve_model_path
from .rope import Rope
from .runtime import LayerwiseModel, ModelShape

log = logging.getLogger(__name__)

SUPPORTED_FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}
# Rope types whose inv_freq is fixed at load time; "dynamic" rescales with the sequence length and
# "longrope" switches factors past original_max_position_embeddings, either of which would make a chunk's
# cached keys depend on the length of the prompt it is later placed in.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


def pick_device(spec: str = "auto") -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def pick_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        # bf16 matmuls on AVX2-only CPUs are several times slower than fp32
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec]
    except KeyError:
        raise ValueError(f"unknown dtype {spec!r}: use auto, float32, bfloat16 or float16") from None


def configure_threads(threads: int = 0) -> None:
    """Torch's intra-op threads: ``threads`` (0: one per core)."""
    threads = threads or os.cpu_count() or 1
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def check_supported(config, path: Path) -> str:
    """The model family of ``config`` (the model at ``path``), or UnsupportedModelError when our runtime
    cannot run it exactly (family, rope type, partial rotary embeddings)."""
    family = getattr(config, "model_type", "")
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model type {family!r} at {path} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_FAMILIES))}"
        )
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (static types only)")
    if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported (RoPE must span head_dim)")
    return family


def model_shape(config, family: str) -> ModelShape:
    """The dimensions of the model of ``config``."""
    max_context = int(getattr(config, "max_position_embeddings", 4096))
    if getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None):
        max_context = min(max_context, int(config.sliding_window))  # beyond it full attention is not exact
    return ModelShape(
        family=family,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
        max_context=max_context,
    )


def read_shape(model: str | Path, home: Path | None = None) -> ModelShape:
    """The dimensions of ``model`` (a name or local folder; the default model is provisioned under
    ``home``) from its config, without loading weights."""
    from transformers import AutoConfig

    path = resolve_model_path(model, home)
    config = AutoConfig.from_pretrained(path)
    return model_shape(config, check_supported(config, path))


def config_rope(config) -> Rope:
    """The model's RoPE tables, computed from its config by the family's own ``transformers`` rotary
    embedding (which holds no weights), so every runtime over these weights rotates alike."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    family = config.model_type
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]  # e.g. Qwen2ForCausalLM
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary = getattr(modeling, causal_lm.removesuffix("ForCausalLM") + "RotaryEmbedding")(config=config)
    return Rope(rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0))


def load_model(
    model: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    config: Config = DEFAULTS,
) -> LayerwiseModel:
    """Load ``model`` (the default model's name, or a local HF folder) for layer-wise execution on
    ``device`` in ``dtype`` (default: ``config``'s ``device`` and ``compute_dtype``); ``config`` also gives
    the threads and the cache directory (``home``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model, config.home)
    hf_config = AutoConfig.from_pretrained(path)
    family = check_supported(hf_config, path)
    configure_threads(config.threads)
    dev = pick_device(device or config.device)
    compute_dtype = pick_dtype(dtype or config.compute_dtype, dev)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        # transformers' own message blames missing converters, not the missing tokenizer files
        raise ModelNotFoundError(
            f"cannot load the tokenizer from {path} (needs tokenizer.json): {exc}"
        ) from exc
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot load model from {path}: {exc}") from exc
    hf_model.to(dev).eval()
    return LayerwiseModel(
        hf_model,
        model_shape(hf_config, family),
        config_rope(hf_config),
        compute_dtype,
        dev,
        tokenizer=tokenizer,
        fingerprint=model_fingerprint(path, family, config.home),
        name=path.name,
    )


def model_fingerprint(path: Path, family: str, home: Path | None = None) -> str:
    """sha256 over architecture, config, tokenizer files and the full weights, cached per file stat (under
    ``home``, the cache directory)."""
    cache_dir = (default_home() if home is None else home) / "checksums"
    digest = hashlib.sha256(f"family={family}\n".encode())
    for name in sorted(os.listdir(path)):
        file = path / name
        if file.is_file() and (name.endswith((".json", ".safetensors", ".model", ".jinja", ".txt"))):
            digest.update(f"{name}:{_file_sha256(file, cache_dir)}\n".encode())
    return digest.hexdigest()


def _file_sha256(file: Path, cache_dir: Path) -> str:
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    cached = cache_dir / f"{key}.json"
    if cached.is_file():
        try:
            return json.loads(cached.read_text())["sha256"]
        except (ValueError, KeyError):
            pass
    h = hashlib.sha256()
    with open(file, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": str(file), "sha256": h.hexdigest()}))
        os.replace(tmp, cached)
    except OSError:
        log.debug("could not cache checksum of %s", file)
    return h.hexdigest()
