"""``eval`` on the vLLM engine: the harness scores what the engine returns, so the same run answers on
vLLM, and its records equal the PyTorch engine's on the same cases (answers, first tokens, the chunks
recomputed), with the NLLs vLLM cannot score left out. Two tiny MuSiQue cases, two methods."""

from __future__ import annotations

import json

import pytest

from cacheblend_rag.eval.datasets import load_dataset
from cacheblend_rag.eval.harness import EvalConfig, run_eval

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    items = []
    for case in load_dataset("musique").cases[:2]:
        ctxs = [{"title": c.title, "text": c.text[:300]} for c in case.contexts[:3]]
        items.append(
            {"id": case.case_id, "question": case.question, "answers": list(case.answers), "ctxs": ctxs}
        )
    path = tmp_path_factory.mktemp("eval-vllm") / "cases.json"
    path.write_text(json.dumps(items))
    return path


def run(engine, kind: str, data, tmp_path):
    config = EvalConfig(
        data=str(data),
        methods=("full_recompute", "cacheblend"),
        ratios=(0.15,),
        top_k=3,
        chunk_tokens=128,
        max_new_tokens=3,
        task="qa",
        kv_dtypes=("float16",),
        engine=kind,
        corpus_dir=tmp_path / f"corpus-{kind}",
    )
    return run_eval(config, engine=engine)


def test_eval_runs_on_vllm_and_matches_the_pytorch_engine(vllm_engine, torch_engine, tiny_data, tmp_path):
    on_vllm = run(vllm_engine, "vllm", tiny_data, tmp_path)
    on_torch = run(torch_engine, "torch", tiny_data, tmp_path)
    assert on_vllm.config.engine == "vllm" and on_torch.config.engine == "torch"
    assert len(on_vllm.cases) == len(on_torch.cases) == 2
    for ours, theirs in zip(on_vllm.cases, on_torch.cases, strict=True):
        assert ours.retrieved == theirs.retrieved  # one retrieval: the corpus's
        assert ours.prompt_tokens == theirs.prompt_tokens
        for label in ("full_recompute", "cacheblend@0.15"):
            v, t = ours.methods[label], theirs.methods[label]
            assert v.first_token == t.first_token, label
            assert v.kl_first_token == pytest.approx(t.kl_first_token, abs=2e-3), label
            assert v.chunk_recompute_ratio == pytest.approx(t.chunk_recompute_ratio), label
            # vLLM scores no continuation: the NLLs are left out, not made up
            assert v.nll_gold is None and v.nll_reference is None
            assert t.nll_gold > 0 and t.nll_reference is not None
        assert ours.methods["full_recompute"].answer == theirs.methods["full_recompute"].answer
        assert ours.methods["full_recompute"].chunk_recompute_ratio == 1.0
        assert 0 < ours.methods["cacheblend@0.15"].chunk_recompute_ratio <= 0.2
    summary = on_vllm.summarized().methods
    assert summary["full_recompute"].first_token_agreement == 1.0
    assert summary["cacheblend@0.15"].nll_reference is None
