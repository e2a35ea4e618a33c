"""``SamplingParams(diagnostics=True)`` on the vLLM engine: the first token's distribution from vLLM's own
log-probabilities, the fusion's figures from its worker, held to the PyTorch engine's on real MuSiQue RAG
prompts. Six vLLM requests of a few tokens each."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.blend import CacheBlend, register_method
from cacheblend_rag.blend.budget import AdaptiveBudget
from cacheblend_rag.blend.spec import reuse_of
from cacheblend_rag.engine import SamplingParams

pytestmark = pytest.mark.vllm

# one continuation to score: vLLM scores none, so its entry is None
DIAGNOSTICS = SamplingParams(max_tokens=4, diagnostics=True, score_continuations=((1, 2, 3),))
PLAIN = SamplingParams(max_tokens=4)
CASES = (10, 11)  # MuSiQue cases no other vLLM test prompts with: vLLM's prefix cache holds none of them


@pytest.fixture(scope="module")
def prompts(vllm_engine, musique_rag):
    """Segments (chunk KV attached, precomputed by the vLLM worker) of two real RAG prompts."""
    return [vllm_engine.rag_segments(*musique_rag(case), "cacheblend") for case in CASES]


def kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> float:
    """KL(p || q) of two log-probability vectors, in float64."""
    p, q = p_logprobs.double(), q_logprobs.double()
    return float((p.exp() * (p - q)).sum())


def check_distribution(result, vocab_size: int) -> torch.Tensor:
    """The result's first-token log-probabilities, checked to be a whole distribution over the vocabulary
    whose greedy choice is the answer's first token."""
    logprobs = result.diagnostics.first_token_logprobs
    assert logprobs.dtype == torch.float32 and logprobs.device.type == "cpu"
    assert logprobs.shape == (vocab_size,) and not logprobs.isnan().any()
    assert float(logprobs.double().exp().sum()) == pytest.approx(1.0, abs=1e-3)
    assert int(logprobs.argmax()) == result.token_ids[0]
    return logprobs


def test_full_recompute_diagnostics_are_vllms_prefill(vllm_engine, torch_engine, prompts):
    segments = prompts[0]
    prompt_tokens = sum(len(s) for s in segments)
    got = vllm_engine.generate(segments, "full_recompute", DIAGNOSTICS)
    expected = torch_engine.generate(segments, "full_recompute", DIAGNOSTICS)
    logprobs = check_distribution(got, vllm_engine.shape.vocab_size)
    assert got.token_ids == expected.token_ids
    assert kl(expected.diagnostics.first_token_logprobs, logprobs) < 1e-3
    # vLLM prefilled the whole prompt itself: every position computed, no fusion
    assert got.vllm_cached_tokens == 0
    assert got.diagnostics.recomputed_positions == tuple(range(prompt_tokens))
    assert got.diagnostics.compute_fraction == 1.0 and got.diagnostics.fusion_s is None
    assert got.diagnostics.continuation_nll == (None,)
    # raw log-probabilities: sampling at a temperature does not temper them (tempered ones would be far)
    raw = expected.diagnostics.first_token_logprobs
    assert kl(raw, torch.log_softmax(raw / 2.0, dim=-1)) > 0.1
    tempered = SamplingParams(max_tokens=1, temperature=2.0, seed=1, diagnostics=True)
    sampled = vllm_engine.generate(segments, "full_recompute", tempered)
    assert kl(raw, sampled.diagnostics.first_token_logprobs) < 1e-3


def test_cacheblend_diagnostics_are_the_workers_fusion(vllm_engine, torch_engine, prompts):
    segments = prompts[1]
    prompt_tokens = sum(len(s) for s in segments)
    got = vllm_engine.generate(segments, "cacheblend", DIAGNOSTICS, ratio=0.15)
    # the PyTorch engine blends the same stored KV, its opening reused exactly as the worker does
    reference = torch_engine.exact_head(segments, reuse_of("cacheblend"))
    expected = torch_engine.generate(reference, "cacheblend", DIAGNOSTICS, ratio=0.15)
    logprobs = check_distribution(got, vllm_engine.shape.vocab_size)
    assert got.claimed_tokens == prompt_tokens - 1  # the worker fused it
    positions = got.diagnostics.recomputed_positions
    assert positions == tuple(sorted(set(positions)))  # ascending, each once
    assert set(positions) < set(range(prompt_tokens))  # a proper subset
    assert prompt_tokens - 1 in positions  # the last prompt token is always recomputed
    assert len(positions) == got.computed_tokens  # the exact head is reused, not recomputed
    assert 0 < got.diagnostics.compute_fraction < 1
    assert got.diagnostics.fusion_s is not None and got.diagnostics.fusion_s > 0
    assert got.diagnostics.continuation_nll == (None,)
    # the worker's fusion is the PyTorch engine's: same positions, same cost, the same next token
    assert positions == expected.diagnostics.recomputed_positions
    assert got.diagnostics.compute_fraction == pytest.approx(expected.diagnostics.compute_fraction)
    assert kl(expected.diagnostics.first_token_logprobs, logprobs) < 1e-3


def test_without_diagnostics_there_are_none(vllm_engine, prompts):
    segments = prompts[1]
    blended = vllm_engine.generate(segments, "cacheblend", PLAIN, ratio=0.2)
    exact = vllm_engine.generate(prompts[0], "full_recompute", PLAIN)
    assert blended.diagnostics is None and exact.diagnostics is None
    assert blended.claimed_tokens > 0 and len(exact.token_ids) > 0


class _MainProcessOnly(CacheBlend):
    """A method registered only in the test process: vLLM's worker cannot fuse with it."""

    name = "diagnostics_main_process_only"


def test_a_blend_vllm_prefilled_instead_reports_every_position(vllm_engine, prompts):
    register_method(
        _MainProcessOnly.name,
        lambda **options: _MainProcessOnly(ratio=options.get("ratio", 0.15), budget=AdaptiveBudget()),
    )
    segments = prompts[1]
    got = vllm_engine.generate(segments, _MainProcessOnly.name, DIAGNOSTICS)
    assert got.claimed_tokens == 0 and got.reused_tokens == 0  # kv_load_failure_policy="recompute"
    check_distribution(got, vllm_engine.shape.vocab_size)
    assert got.diagnostics.recomputed_positions == tuple(range(sum(len(s) for s in segments)))
    assert got.diagnostics.compute_fraction == 1.0 and got.diagnostics.fusion_s is None
    # vLLM recomputed every position, so no budget chose anything (the method chooses one when it fuses)
    assert got.budget is None
    assert _MainProcessOnly(ratio=0.15, budget=AdaptiveBudget()).request_choice([20, 20]) is not None


def test_diagnostics_refuse_a_vllm_started_without_raw_full_vocabulary_logprobs():
    from cacheblend_rag.engine.vllm.engine import diagnostics_refusal

    assert diagnostics_refusal("raw_logprobs", -1, 100) == ""
    assert diagnostics_refusal("raw_logprobs", 100, 100) == ""
    assert "max_logprobs" in diagnostics_refusal("raw_logprobs", 20, 100)  # vLLM's default cap
    assert "logprobs_mode" in diagnostics_refusal("processed_logprobs", -1, 100)  # tempered
