"""What bounding a round's probe costs in fidelity (issue 21): rounds of 16 agents, probe bound 8 vs none.

    .venv/bin/python scripts/round_probe_bound.py [--cases 2] [--agents 16] [--bound 8]

On ``--cases`` held-out MuSiQue cases (the first of ``select_cases(seed=1)``, so not the bench's rounds),
each case's top-k chunks (retrieved as ``eval`` does) are read by ``--agents`` agents, each in its own role
(bench ``round``'s roles) with its own question: the case's own question first, then the questions of
other held-out cases (agents asking about something else, as in the bench's timing rounds). Each agent's
first-token distribution from the round is compared with its own full prefill: mean KL and agreement,
for the round's probe scoring ``--bound`` questions (``blend.round.PROBE_QUESTIONS``) and scoring every
question. The agent with the case's own question is reported apart. Quiet machine; ~4 min per case.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from cacheblend_rag.blend import round as round_module
from cacheblend_rag.blend.spec import parse_method
from cacheblend_rag.engine.prompt import ChunkRef
from cacheblend_rag.eval.bench.config import BenchConfig
from cacheblend_rag.eval.bench.prompts import eval_corpus
from cacheblend_rag.eval.bench.round import agent_requests
from cacheblend_rag.eval.datasets import load_dataset, select_cases
from cacheblend_rag.eval.engines import qa_engine
from cacheblend_rag.eval.metrics import kl_divergence
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.settings import get_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--cases", type=int, default=2)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--bound", type=int, default=8)
    args = parser.parse_args()

    settings = get_settings()
    config = BenchConfig()
    model = load_model(config=settings)
    # the bench's engine (bench.prompts.eval_engine): eval's KV store and QA prompt
    engine = qa_engine(model, settings)
    blend = parse_method("cacheblend").with_ratio(settings.ratio).build()
    full = parse_method("full_recompute").build()
    dataset = load_dataset("musique-heldout")
    cases = select_cases(dataset.cases, args.cases + args.agents, seed=1)
    rows: dict[str, list[float]] = {}
    print(f"{torch.get_num_threads()} threads; {args.agents} agents; bound {args.bound} vs none")
    try:
        with eval_corpus(engine, dataset, config) as corpus:
            for index, case in enumerate(cases[: args.cases]):
                retrieved, _ = corpus.retrieve(case, config.top_k, "qa")
                refs = [ChunkRef(r.token_ids) for r in retrieved]
                for ref in refs:
                    engine.ensure_chunk_kv(ref.token_ids)
                others = [c.question for c in cases[args.cases :] if c is not case]
                questions = [case.question, *others][: args.agents]
                requests = agent_requests(engine, refs, questions, blend, None, own_order=False)
                fresh = agent_requests(engine, refs, questions, full, None, own_order=False)
                references = [engine.fuse(r.segments, full).logits for r in fresh]
                jobs = [(r.segments, blend) for r in requests]
                for label, bound in (("bounded", args.bound), ("every question", 10**6)):
                    round_module.PROBE_QUESTIONS = bound
                    results = engine.fuse_round(jobs)
                    for agent, (reference, result) in enumerate(zip(references, results, strict=True)):
                        kl = kl_divergence(reference, result.logits)
                        agree = float(int(result.logits.argmax()) == int(reference.argmax()))
                        who = "own question" if agent == 0 else "other questions"
                        rows.setdefault(f"{label}, {who}: KL", []).append(kl)
                        rows.setdefault(f"{label}, {who}: agreement", []).append(agree)
                        rows.setdefault(f"{label}, all agents: KL", []).append(kl)
                        rows.setdefault(f"{label}, all agents: agreement", []).append(agree)
                print(f"case {index + 1}/{args.cases} ({case.case_id}) done")
    finally:
        engine.store.close()
    for key in sorted(rows):
        print(f"{key:45s} {statistics.fmean(rows[key]):.4f}  (n={len(rows[key])})")


if __name__ == "__main__":
    main()
