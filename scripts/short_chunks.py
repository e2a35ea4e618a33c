"""What short chunks lose (issue 23, item 2): first-token fidelity of selection rules at a chunk size.

    .venv/bin/python scripts/short_chunks.py [--chunk-tokens 128] [--cases 20] [--data musique]
        [--methods cacheblend@0.15,...] [--deviation]

On ``--cases`` cases of ``--data`` (default: the 60 development cases; never the held-out ones when
choosing), each case's top-k chunks at ``--chunk-tokens`` (retrieved as ``eval`` does, from eval's KV
store) are fused with each method and compared with full prefill: first-token KL and agreement, and the
share of cached tokens recomputed. Besides the registered methods, two rules are registered here for the
experiment (they are not part of the package):

- ``lead_query@ratio=R,lead=K``: the query-aware selection, with the first ``K`` tokens of every chunk
  taken first out of the same budget (EPIC's chunk starts, then the tokens the question reads).
- ``query_deviation@ratio=R``: every token computed at layers 0 and 1 (as HKVD), then the ``R`` share
  with the largest product of the question's attention contribution (probe) and the layer-1 K deviation.

``--context-text TEXT`` fuses the methods from chunk KV precomputed behind the neutral chunk context
followed by TEXT (kept in a scratch KV folder; full prefill is the same either way), e.g. a generic
passage and the separator, so a chunk is precomputed as a passage that follows another one.

``--deviation`` also prints where full reuse's cached values are wrong: the mean relative V deviation from
full prefill at the middle and last layer, by a token's place in its chunk and by chunk, beside the
share of the question's attention contribution each place receives; and how concentrated that
contribution is (what the top 15 % of cached tokens cover, how many tokens cover 50 / 70 / 85 % of it).
Quiet machine; about 10 s per case and method at 128-token chunks on two cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from pydantic import Field

from cacheblend_rag.blend.methods import CacheBlend, register_method, share_budget, tokens_covering
from cacheblend_rag.blend.plan import FusionPlan, LayerState
from cacheblend_rag.blend.segments import ChunkContext
from cacheblend_rag.blend.spec import parse_method, split_specs
from cacheblend_rag.engine import Engine
from cacheblend_rag.engine.prompt import ChunkRef
from cacheblend_rag.eval.bench.config import BenchConfig
from cacheblend_rag.eval.bench.prompts import eval_corpus
from cacheblend_rag.eval.datasets import load_dataset, select_cases
from cacheblend_rag.eval.engines import qa_engine
from cacheblend_rag.eval.metrics import kl_divergence
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.settings import get_settings


@register_method
class LeadQuery(CacheBlend):
    """Query-aware selection with each chunk's first ``lead`` tokens taken first from the budget."""

    name = "lead_query"
    lead: int = Field(8, ge=0, le=4096)

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        keep = plan.must_compute.clone()
        cached = plan.candidate_mask.nonzero().squeeze(1)
        budget = min(share_budget(self.ratio, plan), cached.numel())
        leads = torch.zeros_like(plan.must_compute)
        for start, end in plan.chunk_spans():
            leads[start : min(end, start + self.lead)] = True
        leads &= plan.candidate_mask
        lead_positions = leads.nonzero().squeeze(1)[:budget]
        keep[lead_positions] = True
        rest = budget - lead_positions.numel()
        if rest > 0 and plan.query_contribution is not None:
            score = plan.query_contribution.clone()
            score[leads] = -1.0
            keep[cached[torch.sort(score[cached], descending=True).indices[:rest]]] = True
        return keep.nonzero().squeeze(1)


@register_method
class QueryDeviation(CacheBlend):
    """Layers 0-1 in full, then the tokens with the largest question contribution x layer-1 deviation."""

    name = "query_deviation"

    def layer0_positions(self, plan: FusionPlan) -> torch.Tensor:
        return torch.arange(plan.num_tokens)

    def check_layers(self, plan: FusionPlan) -> tuple[int, ...]:
        return (1,)

    def select(self, state: LayerState) -> torch.Tensor:
        plan = state.plan
        must = plan.must_compute[state.candidates]
        cached = (~must).nonzero().squeeze(1)
        budget = min(share_budget(self.ratio, plan), cached.numel())
        deviation = state.deviation(self.signal)[cached]
        contribution = plan.query_contribution[state.candidates][cached]
        score = (deviation / deviation.mean().clamp_min(1e-9)) * (
            contribution / contribution.mean().clamp_min(1e-9)
        )
        top = cached[torch.topk(score, budget).indices] if budget else cached[:0]
        keep = must.clone()
        keep[top] = True
        return state.candidates[keep]


def _deviation_rows(plan: FusionPlan, reference, reused, contribution, rows: dict) -> None:
    """Relative V deviation of full reuse from full prefill per position, grouped by place in chunk."""
    layers = len(reference.values)
    for layer in (layers // 2, layers - 1):
        ref = reference.values[layer][0, :, : plan.num_tokens].float()
        got = reused.values[layer][0, :, : plan.num_tokens].float()
        rel = (got - ref).norm(dim=(0, 2)) / ref.norm(dim=(0, 2)).clamp_min(1e-6)
        total = float(contribution[plan.candidate_mask].sum()) or 1.0
        for index, (start, end) in enumerate(plan.chunk_spans()):
            rows.setdefault(f"L{layer} chunk {index}: V deviation", []).append(float(rel[start:end].mean()))
            for lo, hi, label in ((0, 8, "0-7"), (8, 32, "8-31"), (32, 64, "32-63"), (64, 10**6, "64+")):
                s, e = start + lo, min(end, start + hi)
                if s >= e:
                    continue
                rows.setdefault(f"L{layer} place {label}: V deviation", []).append(float(rel[s:e].mean()))
                if layer == layers - 1:
                    share = float(contribution[s:e].sum()) / total
                    rows.setdefault(f"place {label}: question contribution share", []).append(share)


def _concentration_rows(plan: FusionPlan, contribution: torch.Tensor, rows: dict) -> None:
    """How concentrated the question's attention contribution over the cached tokens is: the share of
    it the top 15 % cover, and the share (and number) of cached tokens that cover 50 / 70 / 85 % of it."""
    ranked = torch.sort(contribution[plan.candidate_mask].double(), descending=True).values
    top = share_budget(0.15, plan)
    share = float(ranked[:top].sum() / ranked.sum())
    rows.setdefault("contribution covered by the top 15 %", []).append(share)
    for target in (0.5, 0.7, 0.85):
        needed = tokens_covering(ranked, target)
        rows.setdefault(f"cached tokens covering {target:.0%}: share", []).append(needed / ranked.numel())
        rows.setdefault(f"cached tokens covering {target:.0%}: number", []).append(float(needed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--data", default="musique")
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument(
        "--methods",
        default="full_reuse,epic,cacheblend@0.15,cacheblend@0.3,lead_query@ratio=0.15,lead=8,"
        "query_deviation@0.15,cacheblend@ratio=0.15,selection=hkvd",
    )
    parser.add_argument("--deviation", action="store_true")
    parser.add_argument("--context-text", default=None)
    parser.add_argument("--json", type=Path, default=None, help="write every per-case value here")
    args = parser.parse_args()

    settings = get_settings()
    config = BenchConfig(chunk_tokens=args.chunk_tokens, top_k=args.top_k, data=args.data)
    model = load_model(config=settings)
    engine = qa_engine(model, settings)
    blender = engine
    if args.context_text is not None:
        extra = model.tokenizer(args.context_text.replace("\\n", "\n"), add_special_tokens=False)["input_ids"]
        context = ChunkContext((*engine.chunk_context.token_ids, *extra))
        scratch = Path(tempfile.mkdtemp(prefix="short-chunks-kv-"))
        blender = Engine(model, scratch, engine.prompts, chunk_context=context, config=settings)
        print(f"chunk context + {len(extra)} tokens: {args.context_text!r}")
    full = parse_method("full_recompute").build()
    reuse = parse_method("full_reuse").build()
    probe = parse_method("cacheblend@0.15").build()
    specs = {text: parse_method(text).build() for text in split_specs(args.methods)}
    dataset = load_dataset(args.data)
    rows: dict[str, list[float]] = {}
    print(f"{args.data}: {args.cases} cases, chunks <= {args.chunk_tokens} tokens, top-k {args.top_k}")
    try:
        with eval_corpus(engine, dataset, config) as corpus:
            for number, case in enumerate(select_cases(dataset.cases, args.cases, seed=0), 1):
                retrieved, _ = corpus.retrieve(case, args.top_k, "qa")
                refs = [ChunkRef(r.token_ids) for r in retrieved]
                parts = engine.prompts.rag_parts(case.question, refs)
                reference = engine.fuse(engine.segments(parts, full), full)
                for label, method in specs.items():
                    result = blender.fuse(blender.segments(parts, method), method)
                    plan = result.plan
                    chosen = torch.zeros(plan.num_tokens, dtype=torch.bool)
                    chosen[result.selected] = True
                    share = float((chosen & plan.candidate_mask).sum()) / max(plan.num_cached, 1)
                    rows.setdefault(f"{label}: KL", []).append(kl_divergence(reference.logits, result.logits))
                    agree = int(result.logits.argmax()) == int(reference.logits.argmax())
                    rows.setdefault(f"{label}: agreement", []).append(float(agree))
                    rows.setdefault(f"{label}: recomputed", []).append(share)
                if args.deviation:
                    reused = blender.fuse(blender.segments(parts, reuse), reuse)
                    scored = blender.fuse(blender.segments(parts, probe), probe)
                    _deviation_rows(
                        scored.plan, reference.cache, reused.cache, scored.plan.query_contribution, rows
                    )
                    _concentration_rows(scored.plan, scored.plan.query_contribution, rows)
                print(f"case {number}/{args.cases} ({case.case_id}, {reference.plan.num_tokens} tokens)")
    finally:
        if blender is not engine:
            blender.close()
            shutil.rmtree(blender.store.root, ignore_errors=True)
        engine.store.close()
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}))
    for key in rows:
        print(f"{key:60s} {statistics.fmean(rows[key]):.4f}  (n={len(rows[key])})")


if __name__ == "__main__":
    main()
