"""The fusor against full prefill on real multi-chunk MuSiQue prompts."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from cacheblend_rag.blend import (
    CacheBlend,
    CacheBlendHKVD,
    ChunkKV,
    Epic,
    FullRecompute,
    FullReuse,
    Fusor,
    PrefixCache,
    RecomputeMethod,
    Segment,
    get_method,
    register_method,
)
from cacheblend_rag.blend.diagnostics import measure_deviation
from cacheblend_rag.engine.prompt import ChunkRef, PromptBuilder
from cacheblend_rag.errors import ContextLengthError, FusionInputError

DATA_DIR = Path(__file__).parent.parent / "data"

CHUNK_TOKENS = 200


def chunk_kv(model, ids, dtype=torch.float32) -> ChunkKV:
    _, cache = model.prefill(list(ids))
    n = len(ids)
    kv = ChunkKV(
        [k[0, :, :n].clone() for k in cache.keys],
        [v[0, :, :n].clone() for v in cache.values],
        model.fingerprint,
    )
    return kv.to(dtype)


def case_segments(model, case, num_chunks=4, dtype=torch.float32) -> list[Segment]:
    tok = model.tokenizer
    chunks = []
    for ctx in case["ctxs"][:num_chunks]:
        ids = tuple(
            tok(ctx["title"] + "\n" + ctx["text"], add_special_tokens=False)["input_ids"][:CHUNK_TOKENS]
        )
        chunks.append(ChunkRef(ids, None, chunk_kv(model, ids, dtype)))
    return PromptBuilder(tok).rag_segments(case["question"], chunks)


def flat_ids(segments) -> list[int]:
    return [t for s in segments for t in s.token_ids]


@pytest.fixture(scope="module")
def cases():
    return json.loads((DATA_DIR / "musique_24.json").read_text())


@pytest.fixture(scope="module")
def prompt(model, cases):
    """A real 4-chunk RAG prompt (fp32 chunk KV) and its full-prefill logits."""
    segments = case_segments(model, cases[0])
    logits, _ = model.prefill(flat_ids(segments))
    return segments, logits[0]


@pytest.mark.parametrize(
    "method", [FullRecompute(), CacheBlend(ratio=1.0)], ids=["full_recompute", "cacheblend_r1"]
)
def test_exact_methods_reproduce_full_prefill(model, prompt, method):
    segments, reference = prompt
    fused = Fusor(model).fuse(segments, method)
    assert (fused.logits - reference).abs().max().item() <= 1e-4
    assert fused.recompute_ratio == 1.0


def test_prefix_cache_is_exact(model, prompt):
    segments, reference = prompt
    ids = flat_ids(segments)
    prefix_len = len(segments[0]) + len(segments[1])
    # a prefix cache holds the KV of the prompt's own prefix: template + first chunk computed together
    fused = Fusor(model).fuse(
        [
            Segment.cached(ids[:prefix_len], chunk_kv(model, ids[:prefix_len])),
            Segment.fresh(ids[prefix_len:]),
        ],
        PrefixCache(),
    )
    assert (fused.logits - reference).abs().max().item() <= 1e-4
    assert fused.reused_tokens == prefix_len


def test_full_reuse_of_single_leading_chunk_is_exact(model, cases):
    tok = model.tokenizer
    chunk = tok(cases[1]["ctxs"][0]["text"], add_special_tokens=False)["input_ids"][:150]
    question = tok("\nQuestion: " + cases[1]["question"], add_special_tokens=False)["input_ids"]
    segments = [Segment.cached(chunk, chunk_kv(model, chunk)), Segment.fresh(question)]
    reference, _ = model.prefill(flat_ids(segments))
    fused = Fusor(model).fuse(segments, FullReuse())
    assert (fused.logits - reference[0]).abs().max().item() <= 1e-4
    assert fused.reused_tokens == len(chunk)


def test_recompute_work_matches_the_selection(model, prompt):
    segments, _ = prompt
    method = CacheBlendHKVD(ratio=0.15, schedule=((1, 2.0), (2, 1.0)))
    qkv_before, attn_before = model.qkv_token_layers, model.attention_token_layers
    fused = Fusor(model).fuse(segments, method)
    n, cached = fused.plan.num_tokens, fused.plan.num_cached
    fresh = n - cached
    budget_l1, budget_final = (
        max(1, math.floor(0.15 * 2.0 * cached + 1e-9)),
        max(1, math.floor(0.15 * cached + 1e-9)),
    )
    # layer 0 full; layer 1 projects all, keeps 2r; layer 2 projects those, keeps r; then r everywhere,
    # but the last layer attends only the last token (the others' outputs are never read)
    assert fused.qkv_tokens_per_layer[:3] == [n, n, fresh + budget_l1]
    assert fused.attended_tokens_per_layer[:3] == [n, fresh + budget_l1, fresh + budget_final]
    assert set(fused.attended_tokens_per_layer[2:-1]) == {fresh + budget_final}
    assert fused.qkv_tokens_per_layer[-1] == fresh + budget_final
    assert fused.attended_tokens_per_layer[-1] == 1
    assert model.qkv_token_layers - qkv_before == sum(fused.qkv_tokens_per_layer)
    assert model.attention_token_layers - attn_before == sum(fused.attended_tokens_per_layer)
    assert fused.compute_fraction < 0.3
    assert fused.reused_tokens == cached - budget_final


def test_deviation_falls_with_ratio_and_cacheblend_beats_baselines(model, cases):
    """Attention deviation from full prefill on real prompts (fp16 chunk KV, as stored)."""
    fusor = Fusor(model)
    ratios = [0.0, 0.05, 0.15, 0.3]
    methods = [CacheBlend(ratio=r) for r in ratios] + [Epic(), FullReuse()]
    totals = torch.zeros(len(methods))
    for case in cases[:4]:
        devs = measure_deviation(fusor, case_segments(model, case, 3, torch.float16), methods)
        totals += torch.tensor([d.mean_attention for d in devs])
    mean = (totals / 4).tolist()
    by_ratio = mean[: len(ratios)]
    cacheblend_15, epic, full_reuse = mean[2], mean[-2], mean[-1]
    assert all(a > b for a, b in itertools.pairwise(by_ratio)), by_ratio
    assert by_ratio[-1] < 0.5 * by_ratio[0], by_ratio
    assert cacheblend_15 < epic < full_reuse, mean
    assert cacheblend_15 < 0.5 * full_reuse, mean


def test_foreign_or_misshapen_kv_is_refused(model, prompt):
    segments, _ = prompt
    real = segments[1].kv
    foreign = ChunkKV(real.keys, real.values, "0" * 64)
    with pytest.raises(FusionInputError, match="another model"):
        Fusor(model).fuse(
            [segments[0], Segment.cached(segments[1].token_ids, foreign), *segments[2:]], FullReuse()
        )
    short = ChunkKV([k[:, :-1] for k in real.keys], [v[:, :-1] for v in real.values], real.fingerprint)
    with pytest.raises(FusionInputError, match="expected"):
        Fusor(model).fuse(
            [segments[0], Segment.cached(segments[1].token_ids, short), *segments[2:]], FullReuse()
        )


def test_empty_and_oversized_prompts_are_refused(model):
    with pytest.raises(FusionInputError, match="no tokens"):
        Fusor(model).fuse([], FullReuse())
    with pytest.raises(ContextLengthError):
        Fusor(model).fuse([Segment.fresh([1] * (model.shape.max_context + 1))], FullReuse())


def test_duplicate_chunks_are_fused_at_each_position(model, prompt):
    """Documented behaviour: the same chunk twice is placed (and re-rotated) at both positions."""
    segments, _ = prompt
    doubled = [*segments[:-1], Segment.fresh([198]), segments[1], segments[-1]]
    reference, _ = model.prefill(flat_ids(doubled))
    fused = Fusor(model).fuse(doubled, CacheBlend(ratio=1.0))
    assert (fused.logits - reference[0]).abs().max().item() <= 1e-4


def test_chunks_are_placed_rerotated_apart_or_back_to_back(model, prompt):
    """Every cached position holds its chunk's KV, keys re-rotated to where the chunk lands, whether fresh
    text separates the chunks (one indexed write) or they lie back to back (one slice)."""
    segments, _ = prompt
    chunks = [s for s in segments if s.kv is not None]
    head, question = segments[0], segments[-1]
    apart = [head, chunks[0], Segment.fresh([198, 198]), *chunks[1:], question]
    together = [head, *chunks, question]
    for layout in (apart, together):
        fused = Fusor(model).fuse(layout, FullReuse())
        start = 0
        for segment in layout:
            n = len(segment)
            if segment.kv is not None:
                local = torch.arange(n)
                for layer in (0, model.num_layers - 1):
                    k, v = segment.kv.layer(layer)
                    want = model.rope.rerotate(k.to(model.dtype), local, local + start)
                    got = fused.cache.keys[layer][0, :, start : start + n]
                    assert (got - want).abs().max().item() <= 1e-5
                    assert torch.equal(fused.cache.values[layer][0, :, start : start + n], v.to(model.dtype))
            start += n


def test_custom_method_can_be_registered(model, prompt):
    class EverySecondToken(RecomputeMethod):
        name = "every_second"

        def layer0_positions(self, plan):
            keep = plan.must_compute.clone()
            keep[::2] = True
            return keep.nonzero().squeeze(1)

    register_method("every_second", lambda **_: EverySecondToken())
    segments, _ = prompt
    fused = Fusor(model).fuse(segments, get_method("every_second"))
    assert 0.4 < fused.recompute_ratio < 0.6


def test_a_method_may_not_drop_fresh_text(model, prompt):
    class DropsQuestion(RecomputeMethod):
        name = "drops_question"

        def layer0_positions(self, plan):
            return torch.tensor([plan.num_tokens - 1])

    segments, _ = prompt
    with pytest.raises(FusionInputError, match="fresh-text"):
        Fusor(model).fuse(segments, DropsQuestion())


def test_fusing_several_prompts_together_equals_fusing_each_alone(model, cases):
    """fuse_many stacks every prompt's tokens for the projections and the MLP; attention stays per prompt."""
    from cacheblend_rag.blend.fusor import FusionRequest

    fusor = Fusor(model)
    jobs = [
        (case_segments(model, cases[1], 3, torch.float16), CacheBlend(ratio=0.15)),
        (case_segments(model, cases[2], 2, torch.float16), CacheBlendHKVD(ratio=0.15)),
        (case_segments(model, cases[3], 3, torch.float16), FullReuse()),
        (case_segments(model, cases[4], 2, torch.float16), Epic()),
    ]
    together = fusor.fuse_many([FusionRequest(segments, method) for segments, method in jobs])
    for (segments, method), fused in zip(jobs, together, strict=True):
        alone = fusor.fuse(segments, method)
        assert torch.equal(fused.selected, alone.selected)
        assert (fused.logits - alone.logits).abs().max().item() <= 1e-4
        n = alone.num_tokens
        for layer in (0, 14, model.num_layers - 1):
            assert torch.allclose(
                fused.cache.keys[layer][:, :, :n], alone.cache.keys[layer][:, :, :n], atol=1e-4
            )
        assert fused.qkv_tokens_per_layer == alone.qkv_tokens_per_layer
