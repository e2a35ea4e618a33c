"""RoPE at arbitrary positions and re-rotation between positions, for the default and scaled rope types."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from cacheblend_rag.models.rope import Rope

SCALED_ROPES = {
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
}


def hf_rotary(rope_parameters: dict) -> LlamaRotaryEmbedding:
    config = LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=32768,
        rope_parameters=rope_parameters,
    )
    return LlamaRotaryEmbedding(config)


@pytest.fixture(scope="module")
def real_keys(model, musique_case):
    """Pre-RoPE keys [1, Hkv, 512, d] of the default model's first layer on real text."""
    ids = model.tokenizer.encode(musique_case["paragraphs"][1])[:512]
    hidden = model.embed(torch.tensor([ids])).to(model.dtype)
    return model.project_qkv(0, hidden, torch.arange(len(ids))).k_prerope


@pytest.fixture(scope="module", params=["model", *SCALED_ROPES])
def rope_pair(request, model) -> tuple[Rope, LlamaRotaryEmbedding]:
    """Our Rope and the transformers rotary embedding it was built from."""
    rotary = (
        model.hf_model.model.rotary_emb
        if request.param == "model"
        else hf_rotary(SCALED_ROPES[request.param])
    )
    rope = model.rope if request.param == "model" else Rope(rotary.inv_freq, rotary.attention_scaling)
    return rope, rotary


def test_apply_matches_transformers(rope_pair, real_keys):
    rope, rotary = rope_pair
    positions = torch.tensor([[0, 1, 2, 100, 1000, 3000, 5000, 8191, 16000, 30000]])
    keys = real_keys[:, :, : positions.shape[1]]
    cos, sin = rotary(keys, positions)
    expected, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
    assert (rope.apply(keys, positions) - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    ("start", "target"),
    [(0, 7), (0, 3000), (3000, 0), (100, 7000), (0, 20000)],
    ids=["small", "0..511->3000..3511", "backwards", "100->7000", "0->20000"],
)
def test_rerotation_equals_rotation_at_target(rope_pair, real_keys, start, target):
    rope, _ = rope_pair
    n = real_keys.shape[2]
    from_positions, to_positions = torch.arange(start, start + n), torch.arange(target, target + n)
    rerotated = rope.rerotate(rope.apply(real_keys, from_positions), from_positions, to_positions)
    assert (rerotated - rope.apply(real_keys, to_positions)).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("start", "target"), [(0, 3000), (0, 20000)], ids=["0->3000", "0->20000"])
def test_float32_rerotation_tables_stay_within_the_bound(rope_pair, real_keys, start, target):
    """The fusor's tables: a float64 angle difference rounded to float32, applied in float32."""
    rope, _ = rope_pair
    n = real_keys.shape[2]
    from_positions, to_positions = torch.arange(start, start + n), torch.arange(target, target + n)
    tables = rope.rerotation(from_positions, to_positions, torch.float32)
    assert tables[0].dtype == torch.float32
    rerotated = rope.apply_rerotation(rope.apply(real_keys, from_positions), tables)
    assert (rerotated - rope.apply(real_keys, to_positions)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rerotation_into_a_cache_slice_equals_rerotation(rope_pair, real_keys, out_dtype):
    """What the fusor places: keys rotated straight into a slice of a larger cache buffer, the rest of
    the buffer untouched; in another dtype than the tables', the same result rounded."""
    rope, _ = rope_pair
    n = real_keys.shape[2]
    from_positions, to_positions = torch.arange(n), torch.arange(3000, 3000 + n)
    tables = rope.rerotation(from_positions, to_positions, torch.float32)
    keys = rope.apply(real_keys, from_positions)[0]  # [Hkv, n, d]
    cache = torch.full((1, keys.shape[0], n + 100, keys.shape[2]), 7.0, dtype=out_dtype)
    rope.apply_rerotation_into(cache[0, :, 50 : 50 + n], keys, tables)
    expected = rope.apply_rerotation(keys, tables).to(out_dtype)
    tolerance = 1e-6 if out_dtype == torch.float32 else 0.0
    assert (cache[0, :, 50 : 50 + n].float() - expected.float()).abs().max().item() <= tolerance
    assert bool((cache[0, :, :50] == 7).all()) and bool((cache[0, :, 50 + n :] == 7).all())


def test_rerotation_per_row_positions(rope_pair, real_keys):
    """Batched [B, S] positions: each row moves by its own offset, scattered positions included."""
    rope, _ = rope_pair
    keys = real_keys.expand(2, -1, -1, -1)
    n = keys.shape[2]
    from_positions = torch.stack([torch.arange(n), torch.arange(n) * 3])
    to_positions = torch.stack(
        [torch.arange(n) + 4096, torch.randperm(n, generator=torch.Generator().manual_seed(1))]
    )
    rerotated = rope.rerotate(rope.apply(keys, from_positions), from_positions, to_positions)
    assert (rerotated - rope.apply(keys, to_positions)).abs().max().item() <= 1e-5
