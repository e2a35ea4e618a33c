"""A method registered from outside the package, with an option of its own, works through the CLI, the
LangChain LLM and the eval harness, and bad values of its option are refused everywhere, without any
other file knowing about it."""

from __future__ import annotations

import json

import pytest
import torch
from langchain_cacheblend import CacheBlendLLM, CacheBlendRetriever
from pydantic import Field, ValidationError
from typer.testing import CliRunner

from cacheblend_rag.blend import RecomputeMethod, register_method
from cacheblend_rag.cli import app
from cacheblend_rag.eval import EvalConfig, load_dataset, run_eval


@register_method
class EveryNth(RecomputeMethod):
    """Recomputes one cached token in ``stride`` (plus the fresh text) at every layer."""

    name = "test_every_nth"
    shorthand = "stride"

    stride: int = Field(2, ge=2, le=16, description="one cached token in stride is recomputed")

    def layer0_positions(self, plan) -> torch.Tensor:
        keep = plan.must_compute.clone()
        keep[plan.cached_mask.nonzero().squeeze(1)[:: self.stride]] = True
        return keep.nonzero().squeeze(1)


def share(stride: int) -> float:
    return 1 / stride


def test_through_the_cli(corpus_dir, question):
    args = ["query", question, "--corpus", corpus_dir, "--top-k", "2", "--max-tokens", "3", "--json"]
    result = CliRunner().invoke(app, [*args, "--method", "test_every_nth@3"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["method_options"] == {"method": "test_every_nth", "stride": 3}
    assert answer["recompute_ratio"] == pytest.approx(share(3), abs=0.02)
    assert answer["controller"] is None  # the method has no ratio for the controller to choose

    refused = CliRunner().invoke(app, [*args, "--method", "test_every_nth@stride=40"])
    message = " ".join(refused.stderr.split())
    assert (
        refused.exit_code == 2  # bad input, named before any model loads
        and "'test_every_nth': stride" in message
        and "less than or equal to 16" in message
    )


def test_through_the_langchain_llm(corpus_dir, question):
    (doc,) = CacheBlendRetriever(corpus_dir=corpus_dir, k=1).invoke(question)
    prompt = f"Context:\n{doc.page_content}\n\nQuestion: {question}"
    llm = CacheBlendLLM(corpus_dir=corpus_dir, method="test_every_nth@stride=4", max_tokens=3)
    (generation,) = llm.generate([prompt]).generations[0]
    info = generation.generation_info
    assert info["method_options"] == {"method": "test_every_nth", "stride": 4}
    assert info["usage_metadata"]["input_token_details"]["cache_read"] > 0
    per_call = llm.invoke(prompt, method="test_every_nth@2")  # a per-call override takes the spec too
    assert isinstance(per_call, str)
    with pytest.raises(ValidationError, match="stride"):
        CacheBlendLLM(corpus_dir=corpus_dir, method="test_every_nth@1")


def test_through_the_eval_harness(tmp_path, model):
    cases = []
    for case in load_dataset("musique").cases[:1]:
        ctxs = [{"title": c.title, "text": c.text[:300]} for c in case.contexts[:2]]
        cases.append(
            {"id": case.case_id, "question": case.question, "answers": list(case.answers), "ctxs": ctxs}
        )
    data = tmp_path / "tiny.json"
    data.write_text(json.dumps(cases))
    config = EvalConfig(
        data=str(data),
        methods=("test_every_nth@3",),
        ratios=(),
        top_k=2,
        chunk_tokens=48,
        max_new_tokens=2,
        kv_dir=tmp_path / "kv",
    )
    results = run_eval(config, model=model)
    entry = results.summarized().methods["test_every_nth@3"]
    assert entry.options == {"stride": 3}
    assert entry.chunk_recompute_ratio == pytest.approx(share(3), abs=0.05)
    assert set(results.summarized().methods) == {"full_recompute", "test_every_nth@3"}
