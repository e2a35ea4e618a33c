"""What the vLLM engine tells its connector, and the errors it gives before vLLM starts. No vLLM needed."""

from __future__ import annotations

import json
import sys

import pytest

from cacheblend_rag.engine import create_engine
from cacheblend_rag.engine.vllm.protocol import BlendRequest
from cacheblend_rag.errors import CacheBlendError, UnsupportedModelError


def request(lengths, cached, method="cacheblend", options=None) -> BlendRequest:
    return BlendRequest("k", tuple(lengths), tuple(cached), method, options or {})


def test_the_claim_is_every_token_but_the_last_question_included():
    # template, chunk, separator, chunk, question: the fusor computes the question with exact attention
    # over the fused KV, so vLLM computes only the last token (once, to sample), not the question again
    assert request([30, 100, 1, 100, 25], [0, 1, 0, 1, 0]).claim_end == 255


def test_the_last_prompt_token_is_never_claimed():
    assert request([30, 100], [0, 1]).claim_end == 129  # a prompt that ends in a cached chunk
    assert request([100], [1]).claim_end == 99


def test_nothing_is_claimed_without_a_cached_chunk_before_the_last_token():
    assert request([30, 25], [0, 0]).claim_end == 0
    assert request([30, 100], [0, 0]).claim_end == 0
    assert request([30, 1], [0, 1]).claim_end == 0  # the only cached token is the last one


def test_params_survive_json_and_split_the_prompt():
    sent = request([2, 3, 1], [0, 1, 0], options={"ratio": 0.15, "schedule": [[1, 1.0]]})
    received = BlendRequest.from_params(json.loads(json.dumps(sent.to_params())))
    assert received == sent
    assert received.split([1, 2, 3, 4, 5, 6]) == [([1, 2], False), ([3, 4, 5], True), ([6], False)]
    with pytest.raises(ValueError, match="prompt has 5 tokens, the blend request describes 6"):
        received.split([1, 2, 3, 4, 5])


def test_requests_without_blend_params_carry_none_and_malformed_ones_are_refused():
    assert BlendRequest.from_params(None) is None
    assert BlendRequest.from_params({"other_connector": {}}) is None
    with pytest.raises(ValueError, match="malformed blend request"):
        BlendRequest.from_params({"cacheblend": {"version": 1, "segment_lengths": [3]}})
    with pytest.raises(ValueError, match="version 99"):
        BlendRequest.from_params({"cacheblend": {"version": 99}})
    with pytest.raises(ValueError, match="one cached flag per segment"):
        request([3, 4], [1])


def test_the_cache_salt_separates_methods_and_layouts():
    ids = list(range(6))
    base = request([2, 3, 1], [0, 1, 0], options={"ratio": 0.15})
    assert base.cache_salt(ids) == request([2, 3, 1], [0, 1, 0], options={"ratio": 0.15}).cache_salt(ids)
    assert base.cache_salt(ids) != request([2, 3, 1], [0, 1, 0], options={"ratio": 0.2}).cache_salt(ids)
    assert base.cache_salt(ids) != request([3, 2, 1], [0, 1, 0], options={"ratio": 0.15}).cache_salt(ids)


def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees where it is not installed
    with pytest.raises(CacheBlendError, match=r"\[vllm\] extra"):
        create_engine("vllm")


def test_unsupported_model_family_is_refused_before_vllm_starts(tmp_path):
    pytest.importorskip("vllm", reason="the family check runs after the vLLM import check")
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(vocab_size=100, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*supported: llama, mistral, qwen2, qwen3"):
        create_engine("vllm", model=tmp_path)


def test_unknown_engine_kind_is_refused():
    with pytest.raises(ValueError, match=r"unknown engine 'tensorrt'.*torch, vllm"):
        create_engine("tensorrt")
