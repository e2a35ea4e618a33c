"""Structured output on the vLLM engine: a request with a JSON constraint is decoded by vLLM's own guided
decoding (its llguidance backend, compiling the constraint's schema to the PyTorch engine's grammar), so on
real MuSiQue RAG prompts blended with CacheBlend the greedy answers are the PyTorch engine's token for
token; json_mode through the framework-neutral path (``response_format`` -> ``TextRequest`` -> vLLM
``stream``). Four vLLM requests in one batch and one stream.
"""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from cacheblend_rag.engine import GenerationRequest, JsonConstraint, SamplingParams
from cacheblend_rag.frontend import PromptFrontend, constraint_of, text_request

pytestmark = pytest.mark.vllm

HINT = 'Reply in JSON with the keys "answer" (a few words) and "confidence" (1 to 5).'
BUDGET = 64
CASES = (0, 3, 4)  # the PyTorch engine's greedy answers close well inside the budget (no steering)


class Answer(BaseModel):
    answer: str
    confidence: int = Field(ge=1, le=5)


def test_constrained_answers_match_the_pytorch_engine(vllm_engine, torch_engine, musique_rag):
    sampling = SamplingParams(max_tokens=BUDGET, constraint=JsonConstraint(Answer))
    prompts = []
    for case in CASES:
        question, chunks = musique_rag(case)
        prompts.append(vllm_engine.rag_segments(f"{question}\n{HINT}", chunks, "cacheblend"))
    plain = SamplingParams(max_tokens=16)
    results = vllm_engine.generate_batch(
        [GenerationRequest.of(s, "cacheblend", sampling, {"ratio": 0.15}) for s in prompts]
        + [
            GenerationRequest.of(prompts[0], "cacheblend", plain, {"ratio": 0.15})
        ]  # an unconstrained neighbour
    )
    free = results.pop()
    assert free.token_ids == torch_engine.generate(prompts[0], "cacheblend", plain, ratio=0.15).token_ids
    for segments, got in zip(prompts, results, strict=True):
        expected = torch_engine.generate(segments, "cacheblend", sampling, ratio=0.15)
        assert expected.finish_reason == "stop" and len(expected.token_ids) < BUDGET - 16
        parsed = Answer.model_validate_json(got.text)  # raises unless it parses and validates
        assert got.finish_reason == "stop" and set(json.loads(got.text)) == {"answer", "confidence"}
        assert got.token_ids == expected.token_ids and got.text == expected.text
        assert parsed.answer and got.claimed_tokens > 0  # blended through the connector, then constrained


def test_json_mode_through_the_frontend(vllm_engine, torch_engine, musique_rag):
    """``response_format={"type": "json_object"}`` as the integrations and the server pass it, streamed by
    vLLM: any JSON object, and the PyTorch engine's answer to the same text."""
    question, chunks = musique_rag(3)
    context = "\n\n".join(vllm_engine.model.tokenizer.decode(c.token_ids) for c in chunks)
    chat = [{"role": "user", "content": f'{context}\n\n{question}\nReply in JSON with the key "answer".'}]
    answers = []
    for engine in (vllm_engine, torch_engine):
        frontend = PromptFrontend(engine=engine)
        request = text_request(
            frontend.render_chat(chat), max_tokens=BUDGET, constraint=constraint_of({"type": "json_object"})
        )
        handle = frontend.stream(request)
        streamed = "".join(event.text for event in handle)
        answers.append(handle.result())
        frontend.close()
        assert streamed == answers[-1].text
    got, expected = answers
    assert isinstance(json.loads(got.text), dict) and got.finish_reason == "stop"
    assert got.token_ids == expected.token_ids
