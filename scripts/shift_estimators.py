"""How well does a chunk's recomputed rows' change predict its kept tokens' change? (issue 23, item 2)

    .venv/bin/python scripts/shift_estimators.py [--chunk-tokens 128] [--top-k 6] [--cases 8]
        [--method cacheblend@0.15] [--variants "mean:mean;ridge1.0:mean;mean:mean:cacheblend@..."]

On ``--cases`` development cases (never the held-out ones), the default fusion runs as usual; at every
layer, before the chunk-shift correction moves the kept tokens, the cached (placed) K/V and the recomputed
rows' fresh K/V are recorded. Each estimator of a kept token's change (full prefill's K/V minus its placed
one; keys in their unrotated frame) is scored by the share of that change's squared norm it leaves: 1.0
is no correction, 0 is full prefill's K/V exactly.

``--variants`` instead replaces the correction by each K:V estimator pair (and, with a third field, the
method) and prints first-token KL and agreement against full prefill: "mean:mean" is the package's own
correction, "zero:zero" none. Estimators: mean (the chunk's mean change), meanfb (the layer's mean for a
chunk with < 2 rows), local8 / local32 (rows weighted by exp(-distance / tau)), linpos (mean plus a shrunk
linear trend in position), ridge1.0 / ridge0.1 (mean plus a per-head ridge map from the cached K or V),
simkernel (half the mean, half a softmax-similarity average of the rows). Results: docs/fusor.md,
"Better estimates of a chunk's change".
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator

import torch

from cacheblend_rag.blend import shift as shift_module
from cacheblend_rag.blend.fusor import FusionResult
from cacheblend_rag.blend.spec import parse_method
from cacheblend_rag.engine import Engine
from cacheblend_rag.engine.prompt import ChunkRef
from cacheblend_rag.eval.bench.config import BenchConfig
from cacheblend_rag.eval.bench.prompts import eval_corpus
from cacheblend_rag.eval.datasets import load_dataset, select_cases
from cacheblend_rag.eval.engines import qa_engine
from cacheblend_rag.eval.metrics import kl_divergence
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.models.rope import apply_rotary
from cacheblend_rag.settings import get_settings

RECORDS: list[dict] = []
_original_apply = shift_module.ChunkShift.apply


def _recording_apply(self, keys, values, rows, fresh_k, fresh_v) -> None:
    RECORDS.append(
        {
            "keys": keys.detach().float().clone(),
            "values": values.detach().float().clone(),
            "rows": rows.detach().cpu().clone(),
            "fresh_k": fresh_k.detach().float().clone(),
            "fresh_v": fresh_v.detach().float().clone(),
            "shift": self,
        }
    )
    _original_apply(self, keys, values, rows, fresh_k, fresh_v)


def _unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """R(-p) x: the rotation by ``cos``/``sin`` undone."""
    return apply_rotary(x, cos, -sin)


def _rows_and_kept(
    chunk_of: torch.Tensor, num_chunks: int, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which of ``rows`` lie in a chunk (mask), those rows, and the chunks' kept positions."""
    inside = chunk_of[rows] < num_chunks
    rows_in = rows[inside]
    kept_mask = chunk_of < num_chunks
    kept_mask[rows_in] = False
    return inside, rows_in, kept_mask.nonzero().squeeze(1)


def _ridge(x: torch.Tensor, y: torch.Tensor, lam: float) -> torch.Tensor:
    """B [H, d, d] with y ~ x B, x/y [H, n, d] centred, ridge ``lam`` x trace/d."""
    gram = x.transpose(1, 2) @ x
    d = gram.shape[-1]
    scale = gram.diagonal(dim1=1, dim2=2).mean(dim=1).clamp_min(1e-9)[:, None, None]
    return torch.linalg.solve(gram + lam * scale * torch.eye(d), x.transpose(1, 2) @ y)


NAMES = ("mean", "meanfb", "local8", "local32", "linpos", "ridge1.0", "ridge0.1", "simkernel", "zero")


def estimate(
    name: str,
    placed: torch.Tensor,
    delta_rows: torch.Tensor,
    rows: torch.Tensor,
    kept: torch.Tensor,
    chunk_rows: torch.Tensor,
    chunk_kept: torch.Tensor,
) -> torch.Tensor:
    """Estimate [H, len(kept), d] of the kept tokens' change by estimator ``name``. ``placed`` [H, T, d]
    (the frame the changes are in), ``delta_rows`` [H, len(rows), d]; chunk_rows / chunk_kept: each row's
    and kept token's chunk."""
    heads, _, dim = placed.shape
    out = torch.zeros(heads, kept.numel(), dim)
    if name == "zero":
        return out
    b = None
    if name.startswith("ridge"):  # one map per head for the layer, fitted on per-chunk centred rows
        xs, ys = [], []
        for c in chunk_kept.unique().tolist():
            r = (chunk_rows == c).nonzero().squeeze(1)
            if r.numel() >= 2:
                x = placed[:, rows[r]]
                xs.append(x - x.mean(1, keepdim=True))
                ys.append(delta_rows[:, r] - delta_rows[:, r].mean(1, keepdim=True))
        if xs:
            b = _ridge(torch.cat(xs, 1), torch.cat(ys, 1), float(name[5:]))
    for c in chunk_kept.unique().tolist():
        r = (chunk_rows == c).nonzero().squeeze(1)
        k = (chunk_kept == c).nonzero().squeeze(1)
        if r.numel() < 2:
            if name == "meanfb" and delta_rows.shape[1]:  # too few rows: the layer's mean change over all
                out[:, k] = delta_rows.mean(1, keepdim=True).expand(-1, k.numel(), -1)
            continue
        d_r = delta_rows[:, r]
        mean = d_r.mean(1, keepdim=True)
        p, q = rows[r].float(), kept[k].float()
        if name in ("mean", "meanfb") or (name.startswith("ridge") and b is None):
            out[:, k] = mean.expand(-1, k.numel(), -1)
        elif name.startswith("local"):
            w = torch.exp(-(q[:, None] - p[None, :]).abs() / float(name[5:]))
            out[:, k] = torch.einsum("kr,hrd->hkd", w / w.sum(1, keepdim=True), d_r)
        elif name == "linpos":
            pc = p - p.mean()
            slope = torch.einsum("r,hrd->hd", pc, d_r - mean) / ((pc * pc).sum() + 64.0 * r.numel())
            out[:, k] = mean + slope[:, None] * (q - p.mean())[None, :, None]
        elif name.startswith("ridge"):
            x_r, x_k = placed[:, rows[r]], placed[:, kept[k]]
            out[:, k] = mean + (x_k - x_r.mean(1, keepdim=True)) @ b
        elif name == "simkernel":
            x_r, x_k = placed[:, rows[r]], placed[:, kept[k]]
            sim = torch.softmax((x_k @ x_r.transpose(1, 2)) / math.sqrt(dim), dim=-1)
            out[:, k] = 0.5 * mean + 0.5 * (sim @ d_r)
        else:
            raise ValueError(f"unknown estimator {name!r}")
    return out


def estimators(placed, delta_rows, rows, kept, chunk_rows, chunk_kept) -> dict[str, torch.Tensor]:
    return {
        name: estimate(name, placed, delta_rows, rows, kept, chunk_rows, chunk_kept)
        for name in NAMES
        if name != "zero"
    }


def _variant_apply(k_name: str, v_name: str):
    """A ChunkShift.apply that moves kept tokens by estimators ``k_name`` / ``v_name`` ("mean" is the
    package's own correction, "zero" none)."""

    def apply(self, keys, values, rows, fresh_k, fresh_v) -> None:
        if not self.num_chunks:
            return
        n = self.chunk_of.numel()
        inside, rows_in, kept = _rows_and_kept(self.chunk_of, self.num_chunks, rows)
        if not rows_in.numel() or not kept.numel():
            return
        cos, sin = self.cos, self.sin
        placed_k = _unrotate(keys[:, :n].float(), cos, sin)
        dk = _unrotate(fresh_k[:, inside].float() - keys[:, rows_in].float(), cos[rows_in], sin[rows_in])
        dv = fresh_v[:, inside].float() - values[:, rows_in].float()
        ck, cr = self.chunk_of[kept], self.chunk_of[rows_in]
        est_k = estimate(k_name, placed_k, dk, rows_in, kept, cr, ck)
        est_v = estimate(v_name, values[:, :n].float(), dv, rows_in, kept, cr, ck)
        keys[:, kept] += apply_rotary(est_k, cos[kept], sin[kept]).to(keys.dtype)  # to each kept position
        values[:, kept] += est_v.to(values.dtype)

    return apply


def _cases(args) -> Iterator[tuple[int, Engine, list, FusionResult]]:
    """Each development case's prompt parts with its full-prefill fusion, on eval's engine and corpus."""
    settings = get_settings()
    config = BenchConfig(chunk_tokens=args.chunk_tokens, top_k=args.top_k, data=args.data)
    engine = qa_engine(load_model(config=settings), settings)
    full = parse_method("full_recompute").build()
    dataset = load_dataset(args.data)
    try:
        with eval_corpus(engine, dataset, config) as corpus:
            for number, case in enumerate(select_cases(dataset.cases, args.cases, seed=0), 1):
                retrieved, _ = corpus.retrieve(case, args.top_k, "qa")
                parts = engine.prompts.rag_parts(case.question, [ChunkRef(r.token_ids) for r in retrieved])
                yield number, engine, parts, engine.fuse(engine.segments(parts, full), full)
    finally:
        engine.store.close()


def kl_main(args) -> None:
    """First-token KL and agreement against full prefill for each ``--variants`` K:V estimator pair."""
    method = parse_method(args.method).build()
    variants = [v.split(":", 2) for v in args.variants.split(";")]
    rows: dict[str, list[float]] = {}
    try:
        for number, engine, parts, reference in _cases(args):
            for variant in variants:
                k_name, v_name = variant[0], variant[1]
                spec = method if len(variant) < 3 else parse_method(variant[2]).build()
                shift_module.ChunkShift.apply = _variant_apply(k_name, v_name)
                result = engine.fuse(engine.segments(parts, spec), spec)
                label = ":".join(variant)
                rows.setdefault(label + " KL", []).append(kl_divergence(reference.logits, result.logits))
                agree = int(result.logits.argmax()) == int(reference.logits.argmax())
                rows.setdefault(label + " agreement", []).append(float(agree))
            print(f"case {number}/{args.cases}", flush=True)
    finally:
        shift_module.ChunkShift.apply = _original_apply
    for key, values in rows.items():
        print(f"{key:40s} {sum(values) / len(values):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--data", default="musique")
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--method", default="cacheblend@0.15")
    parser.add_argument(
        "--variants",
        default=None,
        help="K:V[:method] estimator pairs, ';'-separated, e.g. mean:mean;ridge1.0:mean",
    )
    args = parser.parse_args()
    if args.variants:
        kl_main(args)
        return
    shift_module.ChunkShift.apply = _recording_apply
    method = parse_method(args.method).build()
    totals: dict[tuple[str, str, str], list[float]] = {}
    for number, engine, parts, reference in _cases(args):
        RECORDS.clear()
        result = engine.fuse(engine.segments(parts, method), method)
        for layer, record in enumerate(RECORDS):
            group = ("early", "mid", "late")[min(2, 3 * layer // len(RECORDS))]
            _residuals(record, reference, layer, result.plan.num_tokens, group, totals)
        print(
            f"case {number}/{args.cases}: {result.plan.num_tokens} tokens, {len(RECORDS)} layers", flush=True
        )
    header = " ".join(f"{k}-{g:5s}" for k in ("k", "v") for g in ("early", "mid", "late"))
    print(f"{'estimator':12s} {header}")
    for name in sorted({k[0] for k in totals}, key=lambda s: (s != "none", s)):
        cells = []
        for kind in ("k", "v"):
            for group in ("early", "mid", "late"):
                err, base = totals.get((name, kind, group), [math.nan, 1.0])
                cells.append(f"{err / base:7.3f}")
        print(f"{name:12s} " + " ".join(cells))


def _residuals(record: dict, reference: FusionResult, layer: int, n: int, group: str, totals: dict) -> None:
    """Add one layer's squared change of the kept tokens (``none``) and what each estimator leaves of it."""
    shifter, rows = record["shift"], record["rows"]
    chunk_of = shifter.chunk_of.cpu()  # (one entry per prompt position: n of them)
    inside, rows_in, kept = _rows_and_kept(chunk_of, shifter.num_chunks, rows)
    cos, sin = shifter.cos.cpu(), shifter.sin.cpu()
    for kind in ("k", "v"):
        placed = record["keys" if kind == "k" else "values"][:, :n]
        cache = reference.cache.keys if kind == "k" else reference.cache.values
        delta_rows = record[f"fresh_{kind}"][:, inside] - placed[:, rows_in]
        target = cache[layer][0][:, :n].float()[:, kept] - placed[:, kept]
        frame = placed
        if kind == "k":  # everything in the unrotated frame
            delta_rows = _unrotate(delta_rows, cos[rows_in], sin[rows_in])
            target = _unrotate(target, cos[kept], sin[kept])
            frame = _unrotate(placed, cos[:n], sin[:n])
        base = float((target * target).sum())
        found = estimators(frame, delta_rows, rows_in, kept, chunk_of[rows_in], chunk_of[kept])
        for name, estimate_ in {"none": torch.zeros_like(target), **found}.items():
            cell = totals.setdefault((name, kind, group), [0.0, 0.0])
            cell[0] += float(((target - estimate_) ** 2).sum())
            cell[1] += base


if __name__ == "__main__":
    main()
