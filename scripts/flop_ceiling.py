"""The FLOP ceiling of a method's speed-up: full prefill's FLOPs over the method's, from its real selection.

    .venv/bin/python scripts/flop_ceiling.py [--chunks 6] [--chunk-tokens 512] [--methods ...] [--time 3]

Token-layers (the compute fraction) count a recomputed row as 1/T of a full prefill, but a row at
position p attends over p + 1 keys: for this model, attention over a 3K-token context costs about as many
FLOPs per row as the projections and the MLP together, and a selection that picks late tokens (the
question's attention does) recomputes the most expensive rows. This script fuses the prompt of
``scripts/profile_fusion.py`` (``--chunks`` MuSiQue chunks, chunk KV in RAM) with each method, takes the
positions it recomputed and the query probe's rows, and counts matmul FLOPs per layer:

- every computed row: 2 x the layer's linear weights (q, k, v, o projections, gate, up, down);
- its attention: 4 x heads x head_dim x (its position + 1) (scores and weighted values, causal);
- the probe (a method that probes): the same for its fresh rows at the layers it runs.

It prints, per method, the rows computed, the FLOP ratio full prefill / method (the speed-up the method
reaches with kernels as fast per FLOP as full prefill's), and with ``--time N`` the measured wall ratio
(median of N fusions each, after a warm-up) beside it. Norms, RoPE, softmax and copies are not counted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from profile_fusion import build_prompt  # scripts/ is on sys.path when a script in it runs

from cacheblend_rag.blend import DirectLayerKV, Fusor, Segment, parse_method
from cacheblend_rag.blend.segments import kv_sources
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.settings import get_settings


def linear_params_per_layer(model) -> int:
    """Weights of one decoder layer's matmuls (projections and MLP), from the loaded modules."""
    layer = model.hf_model.model.layers[0]
    return sum(p.numel() for p in layer.parameters() if p.dim() == 2)


def row_flops(positions: torch.Tensor, linear: int, heads: int, head_dim: int) -> float:
    """Matmul FLOPs of computing rows at ``positions`` at one layer (causal attention over 0..p)."""
    return float(positions.numel() * 2 * linear + 4 * heads * head_dim * (positions + 1).sum().item())


def method_flops(model, result, linear: int) -> tuple[float, int, int]:
    """(FLOPs over all layers, rows recomputed at the last layer, probe rows) of one fusion."""
    shape = model.shape
    layers = shape.num_layers
    selected = result.selected.cpu()
    flops = layers * row_flops(selected, linear, shape.num_heads, shape.head_dim)
    # the positions are the last layer's; a method that computes more rows at some layers (HKVD's first
    # layer computes every token) is counted by those layers' row counts, at the prompt's mean position
    n = result.plan.num_tokens
    extra = sum(c - selected.numel() for c in result.qkv_tokens_per_layer if c > selected.numel())
    flops += extra * (2 * linear + 4 * shape.num_heads * shape.head_dim * (n + 1) / 2)
    probe_rows = 0
    if result.probe_token_layers:
        fresh = result.plan.must_compute.nonzero().squeeze(1)
        probe_layers = result.probe_token_layers // max(fresh.numel(), 1)
        flops += probe_layers * row_flops(fresh, linear, shape.num_heads, shape.head_dim)
        probe_rows = fresh.numel()
    return flops, selected.numel(), probe_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--methods", nargs="+", default=["cacheblend", "cacheblend@selection=hkvd"])
    parser.add_argument("--time", type=int, default=0, help="also time N fusions per method (median)")
    args = parser.parse_args()

    model = load_model(config=get_settings())
    segments = build_prompt(model, args.chunks, args.chunk_tokens)
    full_prompt = [Segment.fresh(s.token_ids) for s in segments]
    fusor = Fusor(model)
    linear = linear_params_per_layer(model)
    shape = model.shape
    n = sum(len(s) for s in segments)
    full = shape.num_layers * row_flops(torch.arange(n), linear, shape.num_heads, shape.head_dim)
    print(f"prompt: {n} tokens; {linear:,} linear weights per layer; {torch.get_num_threads()} threads")
    print(f"full prefill: {full / 1e9:.1f} GFLOP")

    def timed(prompt, method) -> float:
        used = kv_sources(prompt)
        fusor.fuse(prompt, method, DirectLayerKV(used))  # warm-up
        walls = []
        for _ in range(args.time):
            started = time.perf_counter()
            fusor.fuse(prompt, method, DirectLayerKV(used))
            walls.append(time.perf_counter() - started)
        return statistics.median(walls)

    full_method = parse_method("full_recompute").build()
    full_wall = timed(full_prompt, full_method) if args.time else 0.0
    for name in args.methods:
        method = parse_method(name).build()
        result = fusor.fuse(segments, method, DirectLayerKV(kv_sources(segments)))
        flops, rows, probe_rows = method_flops(model, result, linear)
        line = (
            f"{name}: {rows} rows recomputed ({rows / n:.3f} of the prompt), probe {probe_rows} rows, "
            f"{flops / 1e9:.1f} GFLOP; FLOP ratio full / method {full / flops:.2f}x"
        )
        if args.time:
            wall = timed(segments, method)
            line += f"; wall {full_wall:.3f} / {wall:.3f} s = {full_wall / wall:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
