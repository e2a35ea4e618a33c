"""The layer-wise runtime reproduces transformers' forward of the same weights on real text."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.models.attention import AttentionMask

NUM_TOKENS = 1000


@pytest.fixture(scope="module")
def real_text_run(model, musique_case):
    """One ~1,000-token real text through transformers (logits, per-layer hidden states) and through ours."""
    text = "\n\n".join(musique_case["paragraphs"])
    ids = model.tokenizer.encode(text)[:NUM_TOKENS]
    assert len(ids) == NUM_TOKENS
    with torch.inference_mode():
        hf = model.hf_model(torch.tensor([ids]), output_hidden_states=True)
    ours, cache = model.prefill(ids, all_logits=True)
    return ids, hf, ours, cache


def test_full_prefill_matches_transformers_logits(real_text_run):
    _, hf, ours, cache = real_text_run
    assert ours.shape == hf.logits.shape == (1, NUM_TOKENS, 49152)
    assert cache.length == NUM_TOKENS
    # float32 rounding only: our linear layers run oneDNN's GEMM where it is faster (models/gemm.py),
    # transformers' run MKL's, so sums differ in order; over 30 layers that came to 1.4e-5 of the logits'
    # scale (3.4e-4 of ~25). A wrong mask, position or weight moves logits by whole units.
    reference = hf.logits.float()
    assert (ours - reference).abs().max().item() <= 1e-4 * reference.abs().max().item()


def test_layer_for_a_subset_of_positions_matches_full_prefill(model, real_text_run):
    """What CacheBlend does: recompute some scattered tokens of a layer against the layer's full K/V."""
    _, hf, _, cache = real_text_run
    generator = torch.Generator().manual_seed(0)
    subset = torch.randperm(NUM_TOKENS - 1, generator=generator)[:63]
    positions = torch.cat([subset, torch.tensor([NUM_TOKENS - 1])]).sort().values
    mask = AttentionMask.for_positions(positions, NUM_TOKENS)
    assert mask.tensor is not None
    for layer in range(model.num_layers - 1):  # transformers' last hidden state has the final norm applied
        hidden_in = hf.hidden_states[layer][:, positions]
        qkv = model.project_qkv(layer, hidden_in, positions)
        assert torch.allclose(model.rope.apply(qkv.k_prerope, positions), qkv.k, atol=1e-5)
        assert torch.allclose(qkv.k, cache.keys[layer][:, :, positions], atol=1e-4)
        assert torch.allclose(qkv.v, cache.values[layer][:, :, positions], atol=1e-4)
        out = model.attend_and_mlp(
            layer,
            hidden_in,
            qkv.q,
            cache.keys[layer][:, :, :NUM_TOKENS],
            cache.values[layer][:, :, :NUM_TOKENS],
            mask,
        )
        expected = hf.hidden_states[layer + 1][:, positions]
        scale = expected.abs().max().item()
        assert (out - expected).abs().max().item() <= 1e-5 * max(1.0, scale), f"layer {layer}"


def test_decode_step_over_the_cache_matches_a_longer_prefill(model, real_text_run):
    ids, hf, _, _ = real_text_run
    prompt = ids[:200]
    _, cache = model.prefill(prompt, extra_capacity=1)
    step = model.forward(torch.tensor([[ids[200]]]), torch.tensor([200]), cache)
    assert cache.length == 201
    assert (step - hf.logits[:, 200].float()).abs().max().item() <= 1e-4


@pytest.mark.parametrize("spread", ["scattered", "clustered", "tail", "from_zero"])
def test_row_block_attention_equals_one_masked_call(model, spread):
    """Selected rows attended in row blocks (on CPU: the keys before a block's first row unmasked, its
    window masked, merged by log-sum-exp) equal one masked attention over all keys."""
    generator = torch.Generator().manual_seed(1)
    n = 1500
    if spread == "scattered":
        picked = torch.randperm(n - 1, generator=generator)[:300]
    elif spread == "clustered":  # runs of consecutive rows: many a block's first row sees no masked key
        picked = torch.cat([torch.arange(s, s + 40) for s in (10, 400, 410 + 40, 900, 1300)])
    elif spread == "from_zero":  # the first block starts at position 0: no keys before it, one masked call
        picked = torch.cat([torch.arange(0, 90), torch.arange(700, 800)])
    else:
        picked = torch.arange(n - 400, n - 1, 2)  # where query-aware selection tends to go
    positions = torch.cat([picked, torch.tensor([n - 1])]).unique().sort().values
    mask = AttentionMask.for_positions(positions, n)
    assert len(mask.blocks) > 1
    assert all(b.seen == int(positions[b.start]) for b in mask.blocks)
    if spread == "from_zero":
        assert mask.blocks[0].seen == 0
    heads, kv_heads, d = model.shape.num_heads, model.shape.num_kv_heads, model.shape.head_dim
    q = torch.randn(1, heads, positions.numel(), d, generator=generator)
    keys = torch.randn(1, kv_heads, n, d, generator=generator)
    values = torch.randn(1, kv_heads, n, d, generator=generator)
    blocked = model.attend(q, keys, values, mask)
    one_call = model.attend(q, keys, values, AttentionMask(mask.tensor, False))
    assert not blocked.isnan().any()
    assert (blocked - one_call).abs().max().item() <= 1e-5


def test_row_block_attention_in_bfloat16_stays_within_its_precision(model):
    """The row-block path (log-sum-exp merge included) in bfloat16 tracks the float32 result."""
    generator = torch.Generator().manual_seed(2)
    n = 900
    positions = torch.cat([torch.randperm(n - 1, generator=generator)[:200], torch.tensor([n - 1])])
    positions = positions.unique().sort().values
    mask = AttentionMask.for_positions(positions, n)
    heads, kv_heads, d = model.shape.num_heads, model.shape.num_kv_heads, model.shape.head_dim
    q = torch.randn(1, heads, positions.numel(), d, generator=generator)
    keys = torch.randn(1, kv_heads, n, d, generator=generator)
    values = torch.randn(1, kv_heads, n, d, generator=generator)
    exact = model.attend(q, keys, values, AttentionMask(mask.tensor, False))
    low = model.attend(q.bfloat16(), keys.bfloat16(), values.bfloat16(), mask)
    assert low.dtype == torch.bfloat16
    assert (low.float() - exact).abs().max().item() <= 3e-2
