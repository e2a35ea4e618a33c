"""Section ``store``: the KV store's loading benchmark on real chunks (N chunks x T tokens: load from RAM
/ disk vs full prefill, and how much of the load the layer-wise pipeline hides behind recompute, with
prefetch on and off), and storage bytes per chunk per dtype."""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ...blend.segments import ChunkKVSource, prefill_chunk_kv
from ...models.attention import AttentionMask
from ...models.runtime import LayerwiseModel, ModelShape
from ...records import OpenRecord
from ...settings import get_settings
from ...store.keys import KV_DTYPES, chunk_payload_bytes, kv_bytes_per_token
from ...store.pipeline import LayerKV
from ...store.profile import ComputeLayer, drop_page_cache, load_all_layers, synthetic_chunk
from ..engines import settings_store
from ..markdown import fmt, table
from .config import BenchContext
from .page import Page


@dataclass(frozen=True)
class LoadingResult(OpenRecord):
    """The loading benchmark (:func:`bench_loading`): full prefill of the chunks, loading all their layers
    per tier, and the layer loop with prefetch off and on per tier (its wall, load and wait seconds, and
    the share of the load hidden), fastest of ``repeats`` runs each."""

    num_chunks: int
    tokens: int
    ratio: float
    kv_dtype: str
    compute_dtype: str
    device: str
    threads: int
    repeats: int
    full_prefill_s: float
    load_all_layers_s: dict[str, float]
    pipelined: dict[str, dict[str, dict[str, float]]]


@dataclass(frozen=True)
class StorageCost(OpenRecord):
    """Bytes of one chunk in one storage dtype."""

    bytes_per_token: int
    payload_bytes: int
    file_bytes: int


@dataclass(frozen=True)
class StoreResult(OpenRecord):
    """The loading benchmark on real chunks and the storage cost per dtype."""

    loading: LoadingResult
    storage_bytes: dict[str, StorageCost]


def section_store(ctx: BenchContext) -> StoreResult:
    config = ctx.config
    chunks = ctx.chunk_ids(config.num_chunks, config.chunk_tokens)
    loading = bench_loading(
        ctx.model,
        num_chunks=config.num_chunks,
        tokens=config.chunk_tokens,
        ratio=config.ratio,
        chunk_token_ids=chunks,
        work_dir=ctx.work_dir,
        repeats=config.repeats,
    )
    return StoreResult(loading, storage_cost(ctx.model.shape, config.chunk_tokens))


def storage_cost(shape: ModelShape, num_tokens: int = 512) -> dict[str, StorageCost]:
    """Bytes of one chunk of ``num_tokens`` tokens per storage dtype: per token, tensor payload, and the
    size of the stored file (payload plus its safetensors header with the per-layer checksums)."""
    fingerprint = "0" * 64
    out = {}
    for name, dtype in KV_DTYPES.items():  # codec name -> the dtype it decodes to
        with tempfile.TemporaryDirectory() as root:
            store = settings_store(Path(root), fingerprint, shape, name, ram_budget_bytes=0)
            kv = synthetic_chunk(shape, num_tokens, dtype, fingerprint, seed=0)
            file_bytes = store.put(store.chunk_key(range(num_tokens)), kv)
            store.close()
        out[name] = StorageCost(
            bytes_per_token=kv_bytes_per_token(shape, name, num_tokens),
            payload_bytes=chunk_payload_bytes(shape, name, num_tokens),
            file_bytes=file_bytes,
        )
    return out


class RecomputeWorkload:
    """The per-layer work of CacheBlend's selective recompute: q/k/v of ``ratio`` of the tokens, their
    attention over all loaded keys, o-proj and MLP, on the real model's layer weights.

    It reproduces the cost of the fusor's recompute (to measure how much load hides behind it), not its
    output: the hidden states are fixed random inputs. Pass the real fusor as ``compute_layer`` to time it.
    """

    def __init__(self, model: LayerwiseModel, total_tokens: int, ratio: float, seed: int = 0) -> None:
        self.model = model
        self.total_tokens = total_tokens
        count = max(1, math.ceil(ratio * total_tokens))
        generator = torch.Generator().manual_seed(seed)
        positions = torch.randperm(total_tokens, generator=generator)[:count].sort().values
        self.positions = positions.to(model.device)
        self.hidden = torch.randn(1, count, model.shape.hidden_size, generator=generator).to(
            model.device, model.dtype
        )
        self.mask = AttentionMask.for_positions(self.positions, total_tokens)

    def __call__(self, layer: int, kv: LayerKV) -> None:
        keys = torch.cat([k for k, _ in kv], dim=1)[None]
        values = torch.cat([v for _, v in kv], dim=1)[None]
        if keys.shape[2] != self.total_tokens:
            raise ValueError(f"loaded {keys.shape[2]} tokens of KV; the workload expects {self.total_tokens}")
        qkv = self.model.project_qkv(layer, self.hidden, self.positions)
        self.model.attend_and_mlp(layer, self.hidden, qkv.q, keys, values, self.mask)


def _keep_fastest(best: dict[str, dict[str, float]], name: str, result: dict[str, float]) -> None:
    if name not in best or result["wall_s"] < best[name]["wall_s"]:
        best[name] = result


def bench_loading(
    model: LayerwiseModel,
    num_chunks: int = 6,
    tokens: int = 512,
    ratio: float | None = None,
    kv_dtype: torch.dtype | str | None = None,
    compute_layer: ComputeLayer | None = None,
    chunk_token_ids: Sequence[Sequence[int]] | None = None,
    work_dir: Path | None = None,
    repeats: int = 3,
) -> LoadingResult:
    """The loading benchmark, in one run.

    Prefills ``num_chunks`` chunks of ``tokens`` tokens (random ids unless ``chunk_token_ids``), stores
    them, then times: full prefill of all chunks as one prompt; loading every layer of every chunk from
    RAM, from disk (warm page cache) and from disk (cold); and a layer loop that loads from disk (cold)
    while running ``compute_layer`` (default: :class:`RecomputeWorkload` at ``ratio``), with prefetch on
    and off. Each timing is the fastest of ``repeats`` runs.
    """
    settings = get_settings()
    ratio = settings.ratio if ratio is None else ratio
    if chunk_token_ids is None:
        generator = torch.Generator().manual_seed(0)
        chunk_token_ids = [
            torch.randint(0, model.shape.vocab_size, (tokens,), generator=generator).tolist()
            for _ in range(num_chunks)
        ]
    chunk_token_ids = [list(ids) for ids in chunk_token_ids]
    total = sum(len(ids) for ids in chunk_token_ids)
    chunks = [prefill_chunk_kv(model, ids) for ids in chunk_token_ids]
    all_ids = [t for ids in chunk_token_ids for t in ids]
    start = time.perf_counter()
    model.prefill(all_ids)
    full_prefill_s = time.perf_counter() - start

    work_dir = work_dir if work_dir is not None else settings.home
    work_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-kv-", dir=work_dir))
    compute = compute_layer if compute_layer is not None else RecomputeWorkload(model, total, ratio)
    try:
        store = settings_store(root, model.fingerprint, model.shape, kv_dtype, promote_on_read=False)
        keys = [store.chunk_key(ids) for ids in chunk_token_ids]
        for key, kv in zip(keys, chunks, strict=True):
            store.put(key, kv)

        def sources(tier: str) -> list[ChunkKVSource]:
            if tier != "ram":
                store.evict_ram()
            if tier == "disk_cold":
                for key in keys:
                    drop_page_cache(store.path_for(key))
            found = [store.get(key) for key in keys]
            if tier == "ram":  # put the chunks back into RAM for the next RAM measurement
                for key, kv in zip(keys, chunks, strict=True):
                    store.put(key, kv)
                found = [store.get(key) for key in keys]
            return found

        # Each measurement is repeated and the fastest run kept; prefetch off and on alternate so that
        # load from other processes on the machine weighs on both alike.
        loads: dict[str, dict[str, float]] = {}
        pipelined: dict[str, dict[str, dict[str, float]]] = {"disk_cold": {}, "ram": {}}
        for _ in range(repeats):
            for tier in ("ram", "disk_warm", "disk_cold"):
                _keep_fastest(loads, tier, load_all_layers(sources(tier), model.dtype, model.device))
            for tier, runs in pipelined.items():
                for prefetch in (False, True):
                    result = load_all_layers(
                        sources(tier), model.dtype, model.device, compute, prefetch=prefetch
                    )
                    _keep_fastest(runs, "prefetch_on" if prefetch else "prefetch_off", result)
        kv_dtype_used = store.kv_dtype_name
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return LoadingResult(
        num_chunks=len(chunk_token_ids),
        tokens=total,
        ratio=ratio,
        kv_dtype=kv_dtype_used,
        compute_dtype=str(model.dtype).removeprefix("torch."),
        device=str(model.device),
        threads=torch.get_num_threads(),
        repeats=repeats,
        full_prefill_s=full_prefill_s,
        load_all_layers_s={tier: result["wall_s"] for tier, result in loads.items()},
        pipelined=pipelined,
    )


def render_store(page: Page, section: StoreResult) -> list[str]:
    loading = section.loading
    return [
        f"{loading.num_chunks} chunks, {loading.tokens} tokens in all, stored in {loading.kv_dtype}, "
        f"loaded into {loading.compute_dtype}; fastest of {loading.repeats} runs.",
        "",
        table(
            ["what", "seconds", "vs full prefill"],
            [["full prefill of the same tokens", fmt(loading.full_prefill_s), "1.00"]]
            + [
                [
                    f"load all layers, {tier.replace('_', ' ')}",
                    fmt(s, 4),
                    fmt(s / loading.full_prefill_s, 4),
                ]
                for tier, s in loading.load_all_layers_s.items()
            ],
        ),
        "",
        f"Layer-wise pipelining (load layer i+1 while recomputing r = {loading.ratio:g} of layer i):",
        "",
        table(
            ["tier", "prefetch", "wall (s)", "load (s)", "waited (s)", "load hidden"],
            [
                [
                    tier.replace("_", " "),
                    mode.removeprefix("prefetch_"),
                    fmt(r["wall_s"]),
                    fmt(r["load_s"]),
                    fmt(r["wait_s"]),
                    f"{r['hidden_fraction']:.0%}",
                ]
                for tier, modes in loading.pipelined.items()
                for mode, r in modes.items()
            ],
        ),
        "",
        f"Storage per chunk of {page.results['config']['chunk_tokens']} tokens:",
        "",
        table(
            ["dtype", "bytes/token", "payload bytes", "file bytes"],
            [[d, v.bytes_per_token, v.payload_bytes, v.file_bytes] for d, v in section.storage_bytes.items()],
        ),
    ]
