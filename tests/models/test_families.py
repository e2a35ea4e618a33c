"""Other model families load and run exactly; unsupported or missing models give clear errors.

Tiny randomly initialised models are built with transformers' config classes and saved in a temp dir with
the default model's tokenizer, so nothing comes from a hub.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from cacheblend_rag.errors import ModelNotFoundError, UnsupportedModelError
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.models.provision import resolve_model_path

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "vocab_size": 49152,  # the default tokenizer's vocabulary
}
FAMILIES = {
    "llama": lambda: LlamaConfig(**TINY),
    "llama-yarn": lambda: LlamaConfig(
        **TINY,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=1024),
    "qwen2": lambda: Qwen2Config(**TINY),  # q/k/v projections with bias
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=32),  # per-head q/k RMSNorm, head_dim != hidden / heads
}


def save_tiny_model(config: PretrainedConfig, folder: Path, tokenizer_from: Path | None = None) -> Path:
    """Randomly initialise a model of ``config`` at scales where a wrong op shows in the logits; save it."""
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.normal_(std=0.5)
            else:
                param.normal_(std=param.shape[-1] ** -0.5 if param.dim() > 1 and "embed" not in name else 1.0)
    hf_model.save_pretrained(folder)
    if tokenizer_from is not None:
        for file in tokenizer_from.iterdir():
            if file.name.startswith("tokenizer") or file.suffix == ".jinja":
                shutil.copy(file, folder / file.name)
    return folder


@pytest.fixture(scope="module")
def default_model_dir(model) -> Path:
    return resolve_model_path()


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_matches_transformers(family, tmp_path, default_model_dir, model, musique_case):
    folder = save_tiny_model(FAMILIES[family](), tmp_path / family, tokenizer_from=default_model_dir)
    tiny = load_model(folder)
    assert tiny.shape.family == family.split("-")[0]
    assert tiny.shape.num_layers == 2 and tiny.shape.num_kv_heads == 2
    assert tiny.fingerprint and tiny.fingerprint != model.fingerprint
    ids = tiny.tokenizer.encode(musique_case["paragraphs"][2])[:200]
    ours, _ = tiny.prefill(ids, all_logits=True)
    with torch.inference_mode():
        theirs = tiny.hf_model(torch.tensor([ids])).logits.float()
    assert theirs.std().item() > 1.0  # the random weights produce logits far from uniform
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_sliding_window_caps_the_context(tmp_path, default_model_dir):
    tiny = load_model(save_tiny_model(FAMILIES["mistral"](), tmp_path, tokenizer_from=default_model_dir))
    assert tiny.shape.max_context == 1024  # beyond the window, full attention would not be exact


def test_unsupported_architecture(tmp_path):
    folder = save_tiny_model(
        GPT2Config(vocab_size=100, n_embd=16, n_layer=1, n_head=2, n_positions=64), tmp_path
    )
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supported: llama, mistral, qwen2, qwen3"):
        load_model(folder)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "factor": 2.0,
            "original_max_position_embeddings": 2048,
        },
    ],
    ids=["dynamic", "longrope"],
)
def test_length_dependent_rope_is_unsupported(tmp_path, rope_parameters):
    config = LlamaConfig(**{**TINY, "vocab_size": 100}, rope_parameters=rope_parameters)
    with pytest.raises(UnsupportedModelError, match=rope_parameters["rope_type"]):
        load_model(save_tiny_model(config, tmp_path))


def test_unknown_path_says_how_to_provide_a_model(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match=r"no-such-model.*--model PATH"):
        load_model(missing)


def test_folder_without_weights(tmp_path):
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"needs config\.json and \*\.safetensors"):
        load_model(tmp_path)


def test_folder_without_tokenizer(tmp_path):
    folder = save_tiny_model(LlamaConfig(**{**TINY, "vocab_size": 100}), tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"cannot load the tokenizer .*needs tokenizer\.json"):
        load_model(folder)
