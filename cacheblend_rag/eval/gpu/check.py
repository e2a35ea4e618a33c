"""The accelerator check's measurements (see the package's docstring): each config and workload timed on
every fusion path and tier, r = 1 checked against full prefill."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from ...blend import DirectLayerKV, Fusor, get_method
from ...blend.fusor import FusionRequest
from ...blend.segments import kv_sources
from ...models.fused import fused_weights
from ...models.fused import prefill as fused_prefill
from ...models.runtime import LayerwiseModel
from ...store.joined import JoinedLayerKV
from . import __doc__ as CHECK_DOC
from .models import CONFIGS, Config, build_model
from .prompts import prompt_segments, tier_segments
from .report import print_row, render_markdown, time_cell

# Modules this path must never need: the GPU machine has none of them.
FORBIDDEN_IMPORTS = (
    "transformers",
    "faiss",
    "sentence_transformers",
    "tokenizers",
    "langchain_core",
    "typer",
    "rich",
    "fastapi",
    "uvicorn",
)


class Timer:
    """Median seconds of ``fn`` over ``repeats`` runs after ``warmup``; CUDA events on CUDA."""

    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.device, self.repeats, self.warmup = device, repeats, warmup

    def median(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
        return statistics.median(times)


def parse_workloads(text: str) -> list[tuple[int, int]]:
    workloads = []
    for item in text.split(","):
        try:
            chunks, tokens = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"bad workload {item!r}: expected NxL, e.g. 6x512") from None
        if chunks < 1 or tokens < 1:
            raise SystemExit(f"bad workload {item!r}: N and L must be positive")
        workloads.append((chunks, tokens))
    return workloads


def host_cpu() -> str:
    """The host processor's model name (where Linux says it): a host-bound fusion's time depends on it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown processor"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# where the chunk KV is kept, on an accelerator / elsewhere (see tier_segments)
TIERS = {True: ["hbm", "host", "int8_hbm", "int8_host"], False: ["ram", "int8_ram"]}

# label -> (method, options): the defaults, and HKVD at the default's ratio
METHODS: dict[str, tuple[str, dict]] = {
    "cacheblend": ("cacheblend", {}),
    "cacheblend_hkvd": ("cacheblend_hkvd", {"shift": False}),  # the paper's rule
    "full_reuse": ("full_reuse", {}),
    "epic": ("epic", {}),
}


def path_labels(path: str) -> list[str]:
    """The row labels of METHODS on one fusion path (the static steps keep the plain labels)."""
    return [label if path == "static" else f"{label}_{path}" for label in METHODS]


def timed_paths(fusors: dict[str, Fusor]) -> list[tuple[str, object, Fusor]]:
    """(label, method, fusor) of every method on every fusion path asked for."""
    return [
        (label, get_method(*METHODS[plain][:1], **METHODS[plain][1]), fusor)
        for path, fusor in fusors.items()
        for label, plain in zip(path_labels(path), METHODS, strict=True)
    ]


def check_config(c: Config, args: argparse.Namespace, device: torch.device, out: dict) -> bool:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv_dtype = torch.float16
    model = build_model(c, device, dtype, args.seed)
    timer = Timer(device, args.repeats, args.warmup)
    # each fusion path asked for, side by side: the static steps (an accelerator's default) under their
    # plain label, the module-by-module layer passes as "<label>_layers"
    fusors = {
        path: Fusor(model, static=path == "static", compile_mode=args.compile if path == "static" else None)
        for path in args.fusion.split(",")
    }
    fusor = next(iter(fusors.values()))
    weights = fused_weights(model)
    tiers = TIERS[device.type == "cuda"]
    # bf16 keeps 8 significant bits: a few rounding steps' worth of difference over the whole network
    bound = 0.05 if dtype == torch.bfloat16 else 1e-4
    ok = True
    generator = torch.Generator().manual_seed(args.seed)
    workloads = parse_workloads(args.workloads)
    for chunks, tokens in workloads:
        segments, ids = prompt_segments(model, chunks, tokens, kv_dtype, generator)
        if len(ids) > c.max_context:
            print(
                f"{c.name} {chunks}x{tokens}: {len(ids)} tokens exceed the context "
                f"of {c.max_context}; skipped"
            )
            continue
        row = {"config": c.name, "workload": f"{chunks}x{tokens}", "prompt_tokens": len(ids)}
        full_logits, _ = model.prefill(ids)
        # two full prefills, the runtime's forward and the fused layer steps: ratios are against the faster
        full_layers_s = timer.median(lambda ids=ids: model.prefill(ids))
        full_static_s = timer.median(lambda ids=ids: fused_prefill(model, weights, ids))
        full_s = min(full_layers_s, full_static_s)
        row.update(full_prefill_layers_s=full_layers_s, full_prefill_static_s=full_static_s)
        exact = fusor.fuse(segments, get_method("cacheblend", ratio=1.0)).logits
        error = relative_error(exact, full_logits[0])
        row.update(full_prefill_s=full_s, r1_relative_error=error, r1_bound=bound, r1_ok=error <= bound)
        ok &= error <= bound
        for tier in tiers:
            placed = tier_segments(segments, tier, device)
            kvs = kv_sources(placed)
            # int8 chunks are served joined per layer, which only the static steps take
            provider = (
                (lambda k=kvs: JoinedLayerKV(k, model.dtype, device))
                if tier.startswith("int8")
                else (lambda k=kvs: DirectLayerKV(k))
            )
            for label, method, path_fusor in timed_paths(fusors):
                if tier.startswith("int8") and not path_fusor.static:
                    continue
                try:
                    result = path_fusor.fuse(placed, method, provider())
                    seconds = timer.median(
                        lambda m=method, p=placed, f=path_fusor, g=provider: f.fuse(p, m, g())
                    )
                except Exception as error:  # one broken path must not cost the others their numbers
                    # (a lent GPU is minutes long: the rest of the table is worth having, the failure named)
                    traceback.print_exc()
                    failure = f"{type(error).__name__}: {error}"
                    row[f"{label}_{tier}_error"] = failure
                    out["failures"].append(f"{c.name} {chunks}x{tokens} {label} {tier}: {failure}")
                    continue
                row[f"{label}_{tier}_s"] = seconds
                row[f"{label}_{tier}_speedup"] = full_s / seconds
                row[f"{label}_compute_fraction"] = result.compute_fraction
        out["rows"].append(row)
        print_row(row, tiers, out["methods"])
        if args.profile and (chunks, tokens) == workloads[0]:
            print(f"where the time goes, {c.name} {chunks}x{tokens} (chunk KV on the device):")
            kvs = kv_sources(segments)
            found = [where_time_goes("full_prefill", lambda ids=ids: model.prefill(ids), device)]
            found.append(
                where_time_goes(
                    "full_prefill_static", lambda ids=ids: fused_prefill(model, weights, ids), device
                )
            )
            for label, method, path_fusor in timed_paths(fusors):
                found.append(
                    where_time_goes(
                        label,
                        lambda m=method, p=segments, k=kvs, f=path_fusor: f.fuse(p, m, DirectLayerKV(k)),
                        device,
                    )
                )
            out["profiles"].append({"config": c.name, "workload": f"{chunks}x{tokens}", "runs": found})
        if args.batch and (chunks, tokens) == workloads[0]:
            try:
                found = time_batch(model, fusor, timer, (chunks, tokens), args.batch, kv_dtype, generator)
                out["batches"].append({"config": c.name, **found})
            except Exception as error:  # (as above: the rest of the run is worth having)
                traceback.print_exc()
                out["failures"].append(f"{c.name} {chunks}x{tokens} batch of {args.batch}: {error}")
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=2))
    return ok


def time_batch(
    model: LayerwiseModel,
    fusor: Fusor,
    timer: Timer,
    workload: tuple[int, int],
    batch: int,
    kv_dtype: torch.dtype,
    generator: torch.Generator,
) -> dict:
    """``batch`` different prompts of one workload at once, as a server batches concurrent requests: full
    prefill of all of them in one forward ([batch, T]) against fusing all of them together
    (:meth:`Fusor.fuse_many`: one projection and one MLP per layer over every request's rows); seconds per
    batch, and per method the speed-up over the batched full prefill."""
    chunks, tokens = workload
    prompts = [prompt_segments(model, chunks, tokens, kv_dtype, generator) for _ in range(batch)]
    ids = torch.tensor([prompt_ids for _, prompt_ids in prompts], device=model.device)
    positions = torch.arange(ids.shape[1], device=model.device)

    def full_prefill() -> torch.Tensor:
        return model.forward(ids, positions, model.new_cache(ids.shape[1], batch=batch, zeroed=False))

    found = {"workload": f"{chunks}x{tokens}", "batch": batch, "full_prefill_s": timer.median(full_prefill)}
    for label, (name, options) in METHODS.items():
        method = get_method(name, **options)

        def fuse_all(method=method) -> list:
            requests = [
                FusionRequest(segments, method, DirectLayerKV(kv_sources(segments)))
                for segments, _ in prompts
            ]
            return fusor.fuse_many(requests)

        found[f"{label}_s"] = timer.median(fuse_all)
        found[f"{label}_speedup"] = found["full_prefill_s"] / found[f"{label}_s"]
    cells = " | ".join(
        f"{label} {time_cell(found[f'{label}_s'], found[f'{label}_speedup'])}" for label in METHODS
    )
    print(
        f"  {batch} prompts at once: full prefill {found['full_prefill_s'] * 1e3:.1f} ms | {cells}",
        flush=True,
    )
    return found


def where_time_goes(label: str, fn: Callable[[], object], device: torch.device) -> dict:
    """Whether ``fn`` keeps the device busy or leaves it waiting on the host: the time until the device
    finished it (median of 3), and from one profiled run the device kernels' own time and count (kernels,
    copies and fills; not the ``fusion::`` ranges the fusor marks) and the host's time inside torch ops.
    Kernel time far below the finish time means the device idled while the host dispatched."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    finish = []
    for _ in range(3):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        finish.append(time.perf_counter() - started)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync()
    events = prof.key_averages()

    def device_us(event) -> float:
        return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0)))

    on_device = [e for e in events if e.device_type == DeviceType.CUDA and not e.key.startswith("fusion::")]
    on_host = [e for e in events if e.device_type == DeviceType.CPU]
    found = {
        "label": label,
        "finish_s": statistics.median(finish),
        "device_kernel_s": sum(device_us(e) for e in on_device) / 1e6,
        "kernels": sum(e.count for e in on_device),
        "host_op_s": sum(e.self_cpu_time_total for e in on_host) / 1e6,
        "top_kernels": [
            {"kernel": e.key[:80], "count": e.count, "device_s": device_us(e) / 1e6}
            for e in sorted(on_device, key=device_us, reverse=True)[:6]
        ],
    }
    print(
        f"  {label:<16} finish {found['finish_s'] * 1e3:7.1f} ms | device kernels "
        f"{found['device_kernel_s'] * 1e3:7.1f} ms ({found['kernels']}) | host in torch ops "
        f"{found['host_op_s'] * 1e3:7.1f} ms",
        flush=True,
    )
    return found


def main(argv: list[str] | None = None, prog: str = "python -m cacheblend_rag.eval.gpu") -> int:
    """Run the check with ``argv`` (default: the command line's); 0 when every path ran and r = 1 held.
    ``prog``: the command its usage and errors name (``cacheblend-rag gpu-check`` from the CLI)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=CHECK_DOC,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--config", default="llama-3.1-8b,qwen2.5-1.5b", help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--workloads", default="6x512,20x512,8x2048", help="NxL: N cached chunks of L tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--profile", action="store_true", help="also time host dispatch vs device work at the first workload"
    )
    parser.add_argument(
        "--batch", type=int, default=0, help="also time N prompts at once at the first workload (fuse_many)"
    )
    parser.add_argument(
        "--render", type=Path, default=None, help="print a saved --json run as markdown; run nothing"
    )
    parser.add_argument(
        "--fusion",
        default="static,layers",
        help="fusion paths to time side by side: static (the steps an accelerator runs by default) and/or "
        "layers (the module-by-module passes)",
    )
    parser.add_argument(
        "--compile",
        default=None,
        help="the static steps under torch.compile in this mode (default, reduce-overhead), or graphs: each "
        "static fusion replayed as one CUDA graph per size bucket (blend/static_graph.py)",
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        print(render_markdown(json.loads(args.render.read_text())))
        return 0
    unknown_paths = set(args.fusion.split(",")) - {"static", "layers"}
    if unknown_paths:
        parser.error(f"unknown fusion path {', '.join(sorted(unknown_paths))}: use static and/or layers")
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians of fewer runs are not reported)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"--device {args.device}, but torch sees no CUDA device: run it where one is, or give "
            "--device cpu to check every path on the CPU (its times say nothing of a GPU's)"
        )
    unknown = [name for name in args.config.split(",") if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown config {', '.join(unknown)}: use {', '.join(CONFIGS)}")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {
        "device": device_name,
        "host_cpu": f"{host_cpu()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
        "methods": [label for path in args.fusion.split(",") for label in path_labels(path)],
        "fusion": args.fusion,
        "compile": args.compile,
        "rows": [],
        "failures": [],
        "profiles": [],
        "batches": [],
    }
    tiers = TIERS[device.type == "cuda"]
    print(
        f"device {device_name}, torch {torch.__version__}, "
        f"median of {args.repeats} after {args.warmup} warm-up"
    )
    print(
        "config | workload | tokens | full ms | "
        + " | ".join(f"{m} {t} ms" for t in tiers for m in out["methods"])
        + " | r=1 rel err"
    )
    ok = True
    for name in args.config.split(","):
        ok &= check_config(CONFIGS[name], args, device, out)
        if device.type == "cuda":  # the last config's weights are gone with its frame: hand back the memory
            torch.cuda.empty_cache()
    out["forbidden_imports"] = sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN_IMPORTS))
    out["r1_ok"] = ok
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    if out["forbidden_imports"]:
        print(f"FAIL: imported {', '.join(out['forbidden_imports'])}, which a GPU machine here does not have")
        return 1
    if out["failures"]:
        print(f"FAIL: {len(out['failures'])} path(s) raised:\n  " + "\n  ".join(out["failures"]))
    print("r = 1 matches full prefill" if ok else "FAIL: r = 1 differs from full prefill beyond the bound")
    return 0 if ok and not out["failures"] else 1
