"""Does ``torch.compile`` of the layer step's element-wise chains make a fusion faster on this CPU?

    .venv/bin/python scripts/compile_layer_ops.py [--chunks 6] [--chunk-tokens 512] [--repeats 5]

Issue 20 asked whether compiling the per-layer work (RMS norms, RoPE, SiLU x up, the log-sum-exp merge of
the row blocks' attention) removes per-layer overhead. Two measurements, 2 torch threads:

1. each chain alone, eager against ``torch.compile(dynamic=True)`` (one compile serves every row count),
   at a probe's 30 rows and a 6 x 512 selection's 520 rows: median microseconds per call;
2. the default cacheblend fusion of a real 6 x 512 prompt (as scripts/profile_fusion.py builds it) with
   the runtime's chains swapped for their compiled versions, interleaved with the eager fusion, median of
   ``--repeats`` each, and the largest logit difference between the two.

Run it on a quiet machine. The first compile takes seconds (inductor builds C++ kernels with g++).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from profile_fusion import build_prompt  # scripts/ is on sys.path when a script in it runs

from cacheblend_rag.blend import DirectLayerKV, Fusor, parse_method
from cacheblend_rag.blend import shift as shift_module
from cacheblend_rag.blend.segments import kv_sources
from cacheblend_rag.models import attention as attention_module
from cacheblend_rag.models import gemm as gemm_module
from cacheblend_rag.models import runtime as runtime_module
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.models.rope import apply_rotary
from cacheblend_rag.settings import get_settings


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What transformers' Llama RMS norm computes."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def micro_us(fn: Callable, args: tuple, calls: int = 200) -> float:
    for _ in range(10):
        fn(*args)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def micro_table(model) -> None:
    shape = model.shape
    d, heads, kv = shape.head_dim, shape.num_heads, shape.num_kv_heads
    width = shape.hidden_size
    inter = model.layers[0].mlp.gate_proj.out_features
    print("| chain | rows | eager (us) | compiled (us) | first compiled call (s) |")
    print("|---|---|---|---|---|")
    chains = {
        "RMS norm": (rms_norm, lambda s: (torch.randn(1, s, width), torch.randn(width), 1e-5)),
        "RoPE (q)": (
            apply_rotary,
            lambda s: (torch.randn(1, heads, s, d), torch.randn(s, d), torch.randn(s, d)),
        ),
        "SiLU x up": (silu_mul, lambda s: (torch.randn(1, s, inter), torch.randn(1, s, inter))),
        "merge of two attention parts": (
            attention_module.merge_attention,
            lambda s: (
                torch.randn(1, kv, s, d),
                torch.randn(1, kv, s),
                torch.randn(1, kv, s, d),
                torch.randn(1, kv, s),
            ),
        ),
    }
    for name, (fn, make) in chains.items():
        compiled = torch.compile(fn, dynamic=True)
        for rows in (30, 520):
            args = make(rows)
            started = time.perf_counter()
            compiled(*args)
            first = time.perf_counter() - started
            eager_us, compiled_us = micro_us(fn, args), micro_us(compiled, args)
            print(f"| {name} | {rows} | {eager_us:.1f} | {compiled_us:.1f} | {first:.2f} |")


class Swap:
    """The runtime's element-wise chains, eager or compiled (module attributes replaced in place)."""

    def __init__(self, model) -> None:
        self.norms = [model.norm]
        for layer in model.layers:
            self.norms += [layer.input_layernorm, layer.post_attention_layernorm]
        self.merge = attention_module.merge_attention
        self.rope_c = torch.compile(apply_rotary, dynamic=True)
        self.merge_c = torch.compile(self.merge, dynamic=True)
        self.norm_c = torch.compile(rms_norm, dynamic=True)
        self.silu_mul_c = torch.compile(silu_mul, dynamic=True)
        self.eager_mlp = gemm_module.Gemm.mlp

    def compiled(self, on: bool) -> None:
        if on:
            runtime_module.apply_rotary = shift_module.apply_rotary = self.rope_c
            attention_module.merge_attention = self.merge_c
            for norm in self.norms:
                norm.forward = lambda x, norm=norm: self.norm_c(x, norm.weight, norm.variance_epsilon)
            silu_mul_c = self.silu_mul_c

            def mlp(gemm, mlp, x):
                return gemm(mlp.down_proj, silu_mul_c(gemm(mlp.gate_proj, x), gemm(mlp.up_proj, x)))

            gemm_module.Gemm.mlp = mlp
        else:
            runtime_module.apply_rotary = shift_module.apply_rotary = apply_rotary
            attention_module.merge_attention = self.merge
            for norm in self.norms:
                norm.__dict__.pop("forward", None)
            gemm_module.Gemm.mlp = self.eager_mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model = load_model(config=get_settings())
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    micro_table(model)

    segments = build_prompt(model, args.chunks, args.chunk_tokens)
    fusor = Fusor(model)
    method = parse_method("cacheblend").build()
    used = kv_sources(segments)
    swap = Swap(model)

    def fuse():
        return fusor.fuse(segments, method, DirectLayerKV(used))

    swap.compiled(True)
    started = time.perf_counter()
    compiled_logits = fuse().logits
    first = time.perf_counter() - started
    print(f"\nfirst fusion with the compiled chains: {first:.1f} s (compiles included)")
    swap.compiled(False)
    eager_logits = fuse().logits
    walls: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for on in (False, True):
            swap.compiled(on)
            started = time.perf_counter()
            fuse()
            walls[on].append(time.perf_counter() - started)
    swap.compiled(False)
    diff = float((compiled_logits - eager_logits).abs().max())
    eager, compiled = statistics.median(walls[False]), statistics.median(walls[True])
    print(f"{args.chunks} x {args.chunk_tokens}, default cacheblend, median of {args.repeats} interleaved:")
    print(f"  eager {eager:.3f} s ({' '.join(f'{w:.3f}' for w in walls[False])})")
    print(f"  compiled chains {compiled:.3f} s ({' '.join(f'{w:.3f}' for w in walls[True])})")
    print(f"  eager / compiled {eager / compiled:.3f}; largest logit difference {diff:.1e}")


if __name__ == "__main__":
    main()
