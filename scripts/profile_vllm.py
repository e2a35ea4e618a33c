"""Where a CacheBlend request's time goes on the vLLM path (and vLLM's full prefill beside it).

    .venv-vllm/bin/python scripts/profile_vllm.py [--chunks 6] [--chunk-tokens 512] [--repeats 3]
        [--ratio 0.15] [--json FILE]

Serves the prompt of ``bench --only vllm`` (a MuSiQue case, ``--chunks`` paragraphs cut to
``--chunk-tokens`` tokens) with vLLM's full prefill and with vLLM + CacheBlend, interleaved, after one
warm-up round, and prints the median of ``--repeats`` per part. vLLM's engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the worker's functions are wrapped with timers here:

* ``store``: chunk KV read from the store (``Engine.chunk_kv``), ``probe.*`` / ``select.*``: the query
  probe and the pass over the selected rows, split into q/k/v projection, placing the cached chunks'
  KV into the fusion's cache (``place``: layers read, keys re-rotated), attention, o-proj + MLP, and
  the rest of the layer (cache writes, per-layer bookkeeping: ``other``);
* ``kv_write``: the fused K/V written into vLLM's paged cache; ``vllm_forward``: vLLM's model forward of
  the tokens it computes itself (``suffix_tokens``: what it was given); ``rest``: TTFT minus all that
  (scheduling, sampling, output processing, the driver's round trips).

A 2-core machine shared with other work gives shares, not results: run it quietly for numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process: patchable
# in this process vLLM would cut torch to 1 thread for its API side; its worker process keeps every core
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
PHASE = ["idle"]


def timed(owner: Any, name: str, label: Callable[..., str] | str) -> None:
    """Wrap ``owner.name`` so its wall time adds to TIMES[label] (a callable gets the call's args)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        key = label(*args, **kwargs) if callable(label) else label
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TIMES[key] += time.perf_counter() - started

    setattr(owner, name, wrapper)


def instrument() -> None:
    from cacheblend_rag.blend import fusor, placement, probe
    from cacheblend_rag.engine import engine as torch_engine
    from cacheblend_rag.engine.vllm import connector, paged, worker
    from cacheblend_rag.models.runtime import LayerwiseModel

    run_layer = fusor.run_layer

    def phased_run_layer(model, layer, passes, finish=True):
        PHASE[0] = "probe" if isinstance(passes[0], probe.ProbePass) else "select"
        started = time.perf_counter()
        try:
            return run_layer(model, layer, passes, finish)
        finally:
            TIMES[PHASE[0] + ".layer"] += time.perf_counter() - started
            PHASE[0] = "idle"

    fusor.run_layer = phased_run_layer
    for name, part in (("project_qkv", "qkv"), ("attend", "attention"), ("finish_layer", "mlp")):
        timed(LayerwiseModel, name, lambda *a, part=part, **k: f"{PHASE[0]}.{part}")
    # vLLM's kernel attends the fused rows (cacheblend_rag/engine/vllm/paged.py), writing each layer first
    timed(paged.PagedLayerwiseModel, "attend", lambda *a, **k: f"{PHASE[0]}.attention")
    timed(paged.PagedLayerwiseModel, "_write", "paged_write")
    timed(probe.ProbePass, "attend", "probe.attention")  # the probe attends from its own probabilities
    timed(probe.ProbePass, "attention_inputs", "probe.attention")  # (its scores are computed here)
    # cached chunks placed into the fusion's cache, keys re-rotated (by the probe, before its scores)
    timed(placement.CachedPlacement, "place", lambda *a, **k: f"{PHASE[0]}.place")
    timed(torch_engine.Engine, "chunk_kv", "store")
    timed(torch_engine.Engine, "fuse", "fuse")
    timed(worker.WorkerBlender, "blend", "blend")
    timed(connector.CacheBlendConnector, "_load", "load")
    timed(connector.CacheBlendConnector, "start_load_kv", "start_load_kv")


def instrument_forward(engine) -> None:
    """Time vLLM's model forward and count the tokens it is given, in this (the worker's) process."""

    def patch(worker) -> str:
        model_cls = type(worker.get_model())
        original = model_cls.forward

        def forward(self, input_ids, positions, *args, **kwargs):
            started = time.perf_counter()
            try:
                return original(self, input_ids, positions, *args, **kwargs)
            finally:
                TIMES["vllm_forward"] += time.perf_counter() - started
                COUNTS["vllm_forward_tokens"] += int(input_ids.numel()) if input_ids is not None else 0
                COUNTS["vllm_forwards"] += 1

        model_cls.forward = forward
        return model_cls.__name__

    print("vLLM model:", engine.llm.collective_rpc(patch)[0])


def rag_prompt(engine, chunks: int, chunk_tokens: int):
    from cacheblend_rag.eval.bench.vllm import rag_prompt as bench_prompt

    config = SimpleNamespace(data="musique", num_chunks=chunks, chunk_tokens=chunk_tokens)
    return bench_prompt(config, engine.model.tokenizer)


def one(engine, question, chunks, method: str, ratio: float) -> tuple[dict[str, float], Any]:
    from cacheblend_rag.blend.spec import parse_method
    from cacheblend_rag.engine import SamplingParams

    TIMES.clear()
    COUNTS.clear()
    spec = parse_method(method).with_ratio(ratio, where_taken=True)
    started = time.perf_counter()
    segments = engine.rag_segments(question, chunks, spec)
    segments_s = time.perf_counter() - started
    result = engine.generate(segments, spec, SamplingParams(max_tokens=1))
    parts = dict(TIMES)
    parts["segments"] = segments_s
    parts["ttft"] = segments_s + result.ttft_s
    parts.update({k: float(v) for k, v in COUNTS.items()})
    return parts, result


def breakdown(parts: dict[str, float]) -> dict[str, float]:
    """The request's parts, disjoint, summing to its TTFT."""
    out: dict[str, float] = {}
    for phase in ("probe", "select"):
        layer = parts.get(f"{phase}.layer", 0.0)
        inner = 0.0
        for part in ("qkv", "place", "attention", "mlp"):
            value = parts.get(f"{phase}.{part}", 0.0)
            out[f"{phase}.{part}"] = value
            inner += value
        out[f"{phase}.other"] = layer - inner
    out["probe.attention"] -= out["probe.place"]  # placing runs inside the probe's attention inputs
    out["probe.other"] += out["probe.place"]
    layers = parts.get("probe.layer", 0.0) + parts.get("select.layer", 0.0)
    out["store"] = parts.get("store", 0.0)
    out["fuse.other"] = parts.get("fuse", 0.0) - layers  # setup, embedding, logits, result
    paged_write = parts.get("paged_write", 0.0)  # inside select.attention: counted as a KV write
    out["select.attention"] -= paged_write
    out["kv_write"] = parts.get("load", 0.0) - parts.get("blend", 0.0) + paged_write
    out["connector.other"] = parts.get("start_load_kv", 0.0) - parts.get("load", 0.0)
    blend_other = parts.get("blend", 0.0) - parts.get("fuse", 0.0) - out["store"]
    out["blend.other"] = blend_other
    out["vllm_forward"] = parts.get("vllm_forward", 0.0)
    out["segments"] = parts["segments"]
    out["rest"] = parts["ttft"] - sum(out.values())
    out["ttft"] = parts["ttft"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=0.15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import tempfile

    from cacheblend_rag.engine.vllm import VLLMEngine
    from cacheblend_rag.settings import get_settings

    print("load at start:", os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        engine = VLLMEngine(
            store=Path(tmp) / "kv",
            enable_prefix_caching=False,
            max_model_len=args.chunks * args.chunk_tokens + 512,
            config=get_settings(),
        )
        try:
            instrument()
            instrument_forward(engine)
            question, chunks = rag_prompt(engine, args.chunks, args.chunk_tokens)
            samples: dict[str, list[dict[str, float]]] = {"full_recompute": [], "cacheblend": []}
            last = {}
            for repeat in range(args.repeats + 1):
                for method in samples:
                    parts, result = one(engine, question, chunks, method, args.ratio)
                    last[method] = result
                    if repeat:
                        samples[method].append(breakdown(parts) | {"raw": parts})
        finally:
            engine.close()
    blend = last["cacheblend"]
    report: dict[str, Any] = {
        "load_at_end": os.getloadavg(),
        "prompt_tokens": blend.prompt_tokens,
        "claimed_tokens": blend.claimed_tokens,
        "reused_tokens": blend.reused_tokens,
        "computed_tokens": blend.prompt_tokens - blend.reused_tokens,
        "paged_layers": blend.paged_layers,
        "same_first_token": last["full_recompute"].token_ids == blend.token_ids,
    }
    for method, rows in samples.items():
        keys = [k for k in rows[0] if k != "raw"]
        medians = {k: statistics.median(r[k] for r in rows) for k in keys}
        raw = rows[-1]["raw"]
        report[method] = {
            "median_s": medians,
            "vllm_forward_tokens": raw.get("vllm_forward_tokens"),
            "vllm_forwards": raw.get("vllm_forwards"),
        }
        print(f"\n{method}: TTFT {medians['ttft']:.3f} s (median of {len(rows)})")
        print(f"  vLLM forwards {raw.get('vllm_forwards')}, tokens {raw.get('vllm_forward_tokens')}")
        for key, value in medians.items():
            if key != "ttft" and abs(value) >= 5e-4:
                print(f"  {key:18s} {value:7.3f} s  {100 * value / medians['ttft']:5.1f} %")
    full, fused = report["full_recompute"]["median_s"]["ttft"], report["cacheblend"]["median_s"]["ttft"]
    report["speedup"] = full / fused
    print(
        f"\nspeed-up full / cacheblend: {full / fused:.2f}x; prompt {report['prompt_tokens']} tokens, "
        f"claimed {report['claimed_tokens']}, reused {report['reused_tokens']}, "
        f"paged layers {report['paged_layers']}, "
        f"same first token: {report['same_first_token']}; load at end {report['load_at_end']}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
