"""Grammar-constrained JSON decoding with the real default model: 20 real MuSiQue questions answered under
a Pydantic schema (single-request decode) and under an enum/list schema (batched decode) all parse and
validate; json_mode; sampling; unsupported schemas; and an unconstrained request in the same batch is
unaffected."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, NotRequired, TypedDict

import pytest
import torch
from pydantic import BaseModel, Field

from cacheblend_rag.engine import (
    BatchScheduler,
    ChunkRef,
    Engine,
    GenerationRequest,
    JsonConstraint,
    SamplingParams,
)
from cacheblend_rag.engine.constraints import schema_of, strict_schema
from cacheblend_rag.errors import StructuredOutputError
from cacheblend_rag.store.kvstore import KVStore

DATA_DIR = Path(__file__).parent.parent / "data"
QUESTIONS = 20
RATIO = 0.15


class Answer(BaseModel):
    answer: str
    confidence: int


class Finding(BaseModel):
    answer: str
    kind: Literal["person", "place", "organisation", "date", "other"]
    evidence: list[str] = Field(max_length=3)


class Scored(TypedDict):
    answer: str
    score: NotRequired[float]


class Scores(TypedDict, total=False):
    best: Scored
    others: list[Scored]


ANSWER_HINT = 'Reply in JSON with the keys "answer" (a few words) and "confidence" (0 to 10).'
FINDING_HINT = 'Reply in JSON with the keys "answer", "kind" and "evidence" (a list of short quotes).'


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    store = KVStore(tmp_path_factory.mktemp("constraints") / "kv", model.fingerprint, model.shape, remote="")
    yield Engine(model, store=store)
    store.close()


@pytest.fixture(scope="module")
def questions(model) -> list[tuple[str, list[ChunkRef]]]:
    """20 real MuSiQue questions, each with its first two paragraphs cut to 100 tokens."""
    cases = json.loads((DATA_DIR / "musique_24.json").read_text())[:QUESTIONS]
    tok = model.tokenizer
    out = []
    for n, case in enumerate(cases):
        refs = [
            ChunkRef(
                tuple(tok(c["title"] + "\n" + c["text"], add_special_tokens=False)["input_ids"][:100]),
                f"{n}-{i}",
            )
            for i, c in enumerate(case["ctxs"][:2])
        ]
        out.append((case["question"], refs))
    return out


def segments_for(engine: Engine, question: str, refs: list[ChunkRef], hint: str = ""):
    return engine.rag_segments(f"{question}\n{hint}" if hint else question, refs, "cacheblend")


def test_twenty_questions_give_valid_json_single_decode(engine, questions):
    sampling = SamplingParams(max_tokens=40, constraint=JsonConstraint(Answer))
    for question, refs in questions:
        result = engine.generate(
            segments_for(engine, question, refs, ANSWER_HINT), "cacheblend", sampling, ratio=RATIO
        )
        parsed = Answer.model_validate_json(result.text)  # raises unless it parses and validates
        assert result.finish_reason == "stop", result.text
        assert set(json.loads(result.text)) == {"answer", "confidence"}  # strict: no keys beyond the schema
        assert parsed.answer == json.loads(result.text)["answer"]


def test_twenty_questions_give_valid_json_batched_with_an_unconstrained_neighbour(engine, questions):
    """The enum/list schema through the batch scheduler, with one unconstrained request in the batch: its
    answer is exactly what it is alone (greedy)."""
    constrained = SamplingParams(max_tokens=56, constraint=JsonConstraint(Finding))
    plain = SamplingParams(max_tokens=24)
    free_question, free_refs = questions[0]
    alone = engine.generate(segments_for(engine, free_question, free_refs), "cacheblend", plain, ratio=RATIO)
    requests = [
        GenerationRequest.of(
            segments_for(engine, q, refs, FINDING_HINT), "cacheblend", constrained, {"ratio": RATIO}
        )
        for q, refs in questions
    ]
    requests.insert(
        3,
        GenerationRequest.of(
            segments_for(engine, free_question, free_refs), "cacheblend", plain, {"ratio": RATIO}
        ),
    )
    with BatchScheduler(engine, max_batch=8) as scheduler:
        results = scheduler.generate_batch(requests)
        assert scheduler.stats.max_rows > 1  # they were really decoded together
    free = results.pop(3)
    assert free.token_ids == alone.token_ids and free.text == alone.text
    for result in results:
        parsed = Finding.model_validate_json(result.text)
        assert result.finish_reason == "stop", result.text
        assert (
            parsed.kind in {"person", "place", "organisation", "date", "other"} and len(parsed.evidence) <= 3
        )


def test_constrained_single_and_batched_decodes_agree(engine, questions):
    """Greedy with the same constraint: the batch scheduler's answer is Engine.generate's."""
    sampling = SamplingParams(max_tokens=40, constraint=JsonConstraint(Answer))
    segments = segments_for(engine, *questions[1], ANSWER_HINT)
    alone = engine.generate(segments, "cacheblend", sampling, ratio=RATIO)
    with BatchScheduler(engine) as scheduler:
        batched = scheduler.submit(
            GenerationRequest.of(
                segments_for(engine, *questions[1], ANSWER_HINT), "cacheblend", sampling, {"ratio": RATIO}
            )
        )
        assert batched.result().text == alone.text


def test_json_mode_and_sampling(engine, questions):
    question, refs = questions[2]
    sampling = SamplingParams(max_tokens=48, constraint=JsonConstraint.json_mode())
    result = engine.generate(
        segments_for(engine, question, refs, "Reply in JSON."), "cacheblend", sampling, ratio=RATIO
    )
    assert isinstance(json.loads(result.text), dict) and result.finish_reason == "stop"
    for seed in (1, 2):
        sampled = SamplingParams(
            max_tokens=40, temperature=0.9, top_p=0.95, seed=seed, constraint=JsonConstraint(Answer)
        )
        text = engine.generate(
            segments_for(engine, question, refs, ANSWER_HINT), "cacheblend", sampled, ratio=RATIO
        ).text
        Answer.model_validate_json(text)


def test_a_tight_budget_still_closes_the_json(engine, questions):
    """With a budget that only just fits, the matcher steers to the shortest end instead of running out."""
    question, refs = questions[5]
    sampling = SamplingParams(max_tokens=20, constraint=JsonConstraint(Finding))
    result = engine.generate(
        segments_for(engine, question, refs, FINDING_HINT), "cacheblend", sampling, ratio=RATIO
    )
    Finding.model_validate_json(result.text)
    assert result.finish_reason == "stop" and len(result.token_ids) <= 20


def test_mask_allows_eos_only_once_the_json_is_complete(model):
    state = JsonConstraint(Answer).start(
        model.tokenizer, {model.tokenizer.eos_token_id}, model.shape.vocab_size
    )
    eos = model.tokenizer.eos_token_id
    logits = torch.zeros(model.shape.vocab_size)
    assert torch.isinf(state.mask(logits)[eos])  # nothing written yet: EOS is not allowed
    ids = model.tokenizer('{"answer": "Lessing", "confidence": 8', add_special_tokens=False)["input_ids"]
    for token in ids:
        assert not state.accept(token)
    assert not state.complete and torch.isinf(state.mask(logits)[eos])
    close = model.tokenizer("}", add_special_tokens=False)["input_ids"]
    assert state.accept(close[-1]) and state.complete and state.finished
    with pytest.raises(StructuredOutputError, match="violates the JSON constraint"):
        JsonConstraint(Answer).start(model.tokenizer, {eos}, model.shape.vocab_size).accept(ids[1])


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "example.com"),
        ({"type": "frob"}, "frob"),
    ],
)
def test_unsupported_schema_is_a_clear_error(schema, message):
    with pytest.raises(StructuredOutputError, match=message):
        JsonConstraint(schema)


def test_schema_of_pydantic_typeddict_and_dict():
    assert schema_of(Answer)["required"] == ["answer", "confidence"]
    typed = schema_of(Scored)
    assert typed["required"] == ["answer"] and set(typed["properties"]) == {"answer", "score"}
    nested = schema_of(Scores)  # typing.TypedDict inside typing.TypedDict, on Python 3.11 too
    assert "required" not in nested and nested["$defs"]["Scored"]["required"] == ["answer"]
    assert nested["properties"]["others"]["items"] == {"$ref": "#/$defs/Scored"}
    JsonConstraint(Scores)
    raw = {"type": "object", "properties": {"x": {"type": "integer"}}}
    copied = schema_of(raw)
    assert copied == raw and copied is not raw
    with pytest.raises(StructuredOutputError, match="Pydantic model class, a TypedDict class"):
        schema_of(42)
    with pytest.raises(TypeError, match="JsonConstraint"):
        SamplingParams(constraint={"type": "object"})
    # strict: objects that list properties get no others; a property named "properties" is no keyword
    strict = strict_schema(
        {"type": "object", "properties": {"properties": {"type": "object", "properties": {}}}}
    )
    assert strict["additionalProperties"] is False
    assert strict["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in strict["properties"]
