"""The bench's ``vllm`` section on tiny prompts through the session's engine: both paths timed, the
CacheBlend request served by vLLM's kernel with one token left to vLLM, first tokens compared, rendered.
Its timings mean nothing here (prefix caching is on in this engine); the lead's bench run measures."""

from __future__ import annotations

import pytest

from cacheblend_rag.eval.bench.config import BenchConfig
from cacheblend_rag.eval.bench.vllm import (
    BLEND,
    FULL,
    VllmResult,
    first_token_agreement,
    rag_prompt,
    ttft_pair,
    vllm_sizes,
)

pytestmark = pytest.mark.vllm


def test_the_vllm_section_times_sizes_and_compares_first_tokens(vllm_engine):
    config = BenchConfig.quick_config(chunk_tokens=64)
    tokenizer = vllm_engine.model.tokenizer
    # 5 chunks of 64 tokens (one case's paragraphs, or joined ones where no case has 5 that long)
    question, chunks = rag_prompt(config, tokenizer, 5)
    assert len(chunks) == 5 and all(len(c.token_ids) == 64 for c in chunks)
    pair = ttft_pair(vllm_engine, question, chunks, config)
    blend = pair.cacheblend
    assert pair.num_chunks == 5 and pair.ttft_s[FULL] > 0 and pair.ttft_s[BLEND] > 0
    assert blend["paged_layers"] == vllm_engine.shape.num_layers
    assert blend["vllm_cached_tokens"] == pair.prompt_tokens - 1
    agreement = first_token_agreement(vllm_engine, config, 2)
    assert agreement["prompts"] == 2 and len(agreement["per_prompt"]) == 2
    assert agreement["same"] == sum(agreement["per_prompt"])
    result = VllmResult(
        vllm_version="test",
        processor={"cpu": "a CPU", "simd": ["avx2"]},
        chunk_tokens=64,
        ratio=config.ratio,
        repeats=config.repeats,
        main=pair,
        by_chunks={"5": pair},
        first_token_agreement=agreement,
        engine_startup_s=0.0,
        chunk_precompute_s=0.0,
    )
    assert VllmResult.from_dict(result.to_dict()) == result
    text = "\n".join(vllm_sizes(result))
    assert f"5 x 64 ({pair.prompt_tokens} tokens)" in text
    assert f"on {agreement['same']} of 2 MuSiQue prompts" in text and "SIMD: avx2" in text
