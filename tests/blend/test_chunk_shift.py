"""Chunk-shift correction (``cacheblend@...,shift=true``): a chunk's kept K/V moved by the mean change its
recomputed tokens show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cacheblend_rag.blend import CacheBlend, Epic, Fusor, Segment
from cacheblend_rag.blend.plan import FusionPlan
from cacheblend_rag.blend.shift import MIN_ROWS, ChunkShift
from cacheblend_rag.blend.spec import parse_method
from cacheblend_rag.errors import MethodOptionError
from cacheblend_rag.eval.metrics import kl_divergence
from cacheblend_rag.models.rope import Rope

from .test_fusor import flat_ids
from .test_query_selection import rag_prompts

DATA_DIR = Path(__file__).parent.parent / "data"


def _rotated(rope: Rope, x: torch.Tensor) -> torch.Tensor:
    """[H, T, d] pre-RoPE -> rotated to positions 0..T-1."""
    return rope.apply(x[None], torch.arange(x.shape[1]))[0]


def test_a_chunk_moves_by_its_recomputed_rows_mean_change_keys_in_their_unrotated_frame():
    rope = Rope(1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)))
    source = object()  # the plan only asks whether a segment is cached
    segments = [
        Segment.fresh([1, 2, 3]),
        Segment.cached([4] * 6, source),  # positions 3..8: three rows recomputed
        Segment.fresh([5]),
        Segment.cached([6] * 5, source),  # 10..14: one row recomputed (too few to say)
        Segment.fresh([7, 8]),
    ]
    plan = FusionPlan.from_segments(segments)
    generator = torch.Generator().manual_seed(0)
    heads, n, dim = 2, plan.num_tokens, 8
    pre_keys, values = (
        torch.randn(heads, n, dim, generator=generator),
        torch.randn(heads, n, dim, generator=generator),
    )
    shift_k, shift_v = torch.zeros_like(pre_keys), torch.zeros_like(values)
    for start, end in plan.chunk_spans():  # one true shift per chunk (a different one per head)
        shift_k[:, start:end] = torch.randn(heads, 1, dim, generator=generator)
        shift_v[:, start:end] = torch.randn(heads, 1, dim, generator=generator)
    cached_k, cached_v = _rotated(rope, pre_keys), values.clone()
    true_k, true_v = _rotated(rope, pre_keys + shift_k), values + shift_v
    rows = torch.tensor([0, 1, 2, 4, 6, 7, 9, 12, 15, 16])  # fresh text, 3 of chunk 1, 1 of chunk 2
    keys, kept_values = cached_k.clone(), cached_v.clone()

    ChunkShift(plan, rope, torch.device("cpu")).apply(
        keys, kept_values, rows, true_k[:, rows], true_v[:, rows]
    )

    kept_first = torch.tensor([3, 5, 8])
    torch.testing.assert_close(keys[:, kept_first], true_k[:, kept_first], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept_values[:, kept_first], true_v[:, kept_first], atol=1e-5, rtol=1e-5)
    assert MIN_ROWS > 1
    assert torch.equal(keys[:, 10:15], cached_k[:, 10:15]) and torch.equal(
        kept_values[:, 10:15], cached_v[:, 10:15]
    )
    for fresh in (slice(0, 3), slice(9, 10), slice(15, 17)):  # not a chunk: never moved
        assert torch.equal(keys[:, fresh], cached_k[:, fresh])
        assert torch.equal(kept_values[:, fresh], cached_v[:, fresh])


def test_the_shift_option_is_cacheblends_and_on_by_default():
    assert CacheBlend().shifts_chunks() and parse_method("cacheblend@0.3").build().shifts_chunks()
    assert not parse_method("cacheblend@ratio=0.1,shift=false").build().shifts_chunks()
    assert not Epic().shifts_chunks()
    assert CacheBlend(shift=True).describe()["shift"] is True
    with pytest.raises(MethodOptionError, match="shift"):
        parse_method("cacheblend@shift=sometimes").build()


@pytest.fixture(scope="module")
def short_prompts(model):
    """Three real RAG prompts of six <= 128-token chunks (the chunk size where kept K/V are most wrong),
    chunk KV in float32, with their full-prefill logits."""
    cases = json.loads((DATA_DIR / "musique_24.json").read_text())[:3]
    return rag_prompts(model, cases, 128, torch.float32)


def test_shift_brings_short_chunk_prompts_closer_to_full_prefill(model, short_prompts):
    fusor = Fusor(model)
    plain, shifted = CacheBlend(ratio=0.15, shift=False), CacheBlend(ratio=0.15, shift=True)
    kl = {"plain": 0.0, "shift": 0.0}
    for segments, reference in short_prompts:
        a, b = fusor.fuse(segments, plain), fusor.fuse(segments, shifted)
        assert torch.equal(a.selected, b.selected)  # the same tokens recomputed: only kept K/V move
        plan, n = b.plan, b.plan.num_tokens
        exact = plan.exact_mask  # the template's opening: its own KV at every layer, never moved
        fixed = ~plan.candidate_mask  # and at layer 0 the fresh text too (nothing moved below it yet)
        for layer in range(model.num_layers):
            for x, y in ((a.cache.keys, b.cache.keys), (a.cache.values, b.cache.values)):
                assert torch.equal(x[layer][0][:, :n][:, exact], y[layer][0][:, :n][:, exact])
                if layer == 0:
                    assert torch.equal(x[0][0][:, :n][:, fixed], y[0][0][:, :n][:, fixed])
        kl["plain"] += kl_divergence(reference, a.logits)
        kl["shift"] += kl_divergence(reference, b.logits)
    # development cases at 128 tokens: 0.213 -> 0.053 on average (docs/notes/fusor-research.md)
    assert kl["shift"] < 0.7 * kl["plain"], kl


def test_shift_with_every_token_recomputed_is_full_prefill(model, short_prompts):
    segments, reference = short_prompts[0]
    fused = Fusor(model).fuse(segments, CacheBlend(ratio=1.0, shift=True))
    logits, _ = model.prefill(flat_ids(segments))
    assert torch.equal(fused.logits.argmax(), reference.argmax())
    torch.testing.assert_close(fused.logits, logits[0], atol=1e-3, rtol=1e-4)
