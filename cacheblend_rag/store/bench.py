"""Measurements of the store: tier load throughput (for the loading controller's profile), storage cost per
chunk, and the loading benchmark (N chunks x T tokens: load from RAM / disk vs full prefill, and how much
of the load the layer-wise pipeline hides behind recompute, with prefetch on and off).

Disk reads are measured twice: with the page cache warm (the file was just written or read) and cold,
after ``posix_fadvise(DONTNEED)`` asked the kernel to drop the file's cached pages. On a virtual disk the
host may still cache the file, so "cold" is an upper bound of what the disk itself would do.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..blend.controller import DEFAULT_TIER_COST, Profile, measure_prefill_per_layer
from ..blend.segments import ChunkKV, ChunkKVSource
from ..models.runtime import AttentionMask, LayerwiseModel, ModelShape
from ..settings import get_settings
from .keys import KV_DTYPES, chunk_payload_bytes, dtype_name, kv_bytes_per_token, kv_bytes_per_token_per_layer
from .kvstore import KVStore
from .pipeline import LayerKV, PipelinedLayerLoader

ComputeLayer = Callable[[int, LayerKV], None]


def storage_cost(shape: ModelShape, num_tokens: int = 512) -> dict[str, dict[str, int]]:
    """Bytes of one chunk of ``num_tokens`` tokens per storage dtype: per token, tensor payload, and the
    size of the stored file (payload plus its safetensors header with the per-layer checksums)."""
    fingerprint = "0" * 64
    out = {}
    for name, dtype in KV_DTYPES.items():
        with tempfile.TemporaryDirectory() as root:
            store = KVStore(root, fingerprint, shape, dtype, ram_budget_bytes=0)
            kv = _synthetic_chunk(shape, num_tokens, dtype, fingerprint, seed=0)
            file_bytes = store.put(store.key_for(range(num_tokens)), kv)
            store.close()
        out[name] = {
            "bytes_per_token": kv_bytes_per_token(shape, dtype),
            "payload_bytes": chunk_payload_bytes(shape, dtype, num_tokens),
            "file_bytes": file_bytes,
        }
    return out


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to evict ``path``'s cached pages so the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_all_layers(
    sources: Sequence[ChunkKVSource],
    dtype: torch.dtype,
    device: torch.device | str,
    compute_layer: ComputeLayer | None = None,
    prefetch: bool = False,
) -> dict[str, float]:
    """Load every layer of ``sources`` into ``dtype`` on ``device`` (running ``compute_layer`` on each
    layer if given, as the fusor would) and return wall, compute, load and wait seconds and the fraction
    of the load time hidden."""
    start = time.perf_counter()
    compute_s = 0.0
    cuda = torch.device(device).type == "cuda"
    with PipelinedLayerLoader(sources, dtype, device, prefetch=prefetch) as loader:
        for layer in range(loader.num_layers):
            kv = loader.layer(layer)
            if compute_layer is not None:
                began = time.perf_counter()
                compute_layer(layer, kv)
                if cuda:
                    torch.cuda.synchronize(device)
                compute_s += time.perf_counter() - began
        if cuda:
            torch.cuda.synchronize(device)
        timings = loader.timings()
    return {"wall_s": time.perf_counter() - start, "compute_s": compute_s, **timings.as_dict()}


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


def prefill_chunk_kv(model: LayerwiseModel, token_ids: Sequence[int]) -> ChunkKV:
    """A chunk's KV as the store keeps it: from a prefill of the chunk alone, at positions 0..n-1."""
    _, cache = model.prefill(list(token_ids))
    n = len(token_ids)
    return ChunkKV([k[0, :, :n] for k in cache.keys], [v[0, :, :n] for v in cache.values], model.fingerprint)


def _keep_fastest(best: dict[str, dict[str, float]], name: str, result: dict[str, float]) -> None:
    if name not in best or result["wall_s"] < best[name]["wall_s"]:
        best[name] = result


def _synthetic_chunk(shape: ModelShape, n: int, dtype: torch.dtype, fingerprint: str, seed: int) -> ChunkKV:
    generator = torch.Generator().manual_seed(seed)
    dims = (shape.num_kv_heads, n, shape.head_dim)
    keys = [torch.randn(dims, generator=generator).to(dtype) for _ in range(shape.num_layers)]
    values = [torch.randn(dims, generator=generator).to(dtype) for _ in range(shape.num_layers)]
    return ChunkKV(keys, values, fingerprint)


def measure_tier_throughput(
    shape: ModelShape,
    compute_dtype: torch.dtype,
    device: torch.device | str,
    kv_dtype: torch.dtype | str | None = None,
    tokens: int = 512,
    chunks: int = 2,
    repeats: int = 3,
    work_dir: Path | None = None,
) -> dict[str, float]:
    """Bytes per second (storage-dtype bytes) of loading chunk KV into ``compute_dtype`` on ``device``:
    from the RAM tier, from disk with a warm page cache, and from disk after dropping the page cache."""
    kv_dtype = kv_dtype if kv_dtype is not None else get_settings().kv_dtype
    fingerprint = "0" * 64
    work_dir = work_dir if work_dir is not None else get_settings().home
    work_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="profile-kv-", dir=work_dir))
    try:
        store = KVStore(root, fingerprint, shape, kv_dtype, promote_on_read=False)
        stored = {
            store.key_for([i] * tokens): _synthetic_chunk(shape, tokens, store.kv_dtype, fingerprint, i)
            for i in range(chunks)
        }
        keys = list(stored)
        for key, kv in stored.items():
            store.put(key, kv)
        nbytes = chunks * chunk_payload_bytes(shape, store.kv_dtype, tokens)
        best = {"ram": math.inf, "disk_warm": math.inf, "disk": math.inf}
        for _ in range(repeats):
            best["ram"] = min(best["ram"], _timed_load(store, keys, compute_dtype, device))
            store.evict_ram()
            best["disk_warm"] = min(best["disk_warm"], _timed_load(store, keys, compute_dtype, device))
            for key in keys:
                drop_page_cache(store.path_for(key))
            best["disk"] = min(best["disk"], _timed_load(store, keys, compute_dtype, device))
            for key, kv in stored.items():  # back into RAM for the next round
                store.put(key, kv)
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {tier: nbytes / seconds for tier, seconds in best.items()}


def _timed_load(store: KVStore, keys: list[str], dtype: torch.dtype, device: torch.device | str) -> float:
    start = time.perf_counter()
    sources = [store.get(key) for key in keys]
    if any(source is None for source in sources):
        raise RuntimeError("a chunk written for the measurement is missing from the store")
    load_all_layers(sources, dtype, device)
    return time.perf_counter() - start


def profile_device(
    model: LayerwiseModel,
    lengths: Sequence[int] = (256, 512, 1024, 2048, 4096),
    kv_dtype: torch.dtype | str | None = None,
    chunk_tokens: int = 512,
    repeats: int = 3,
    work_dir: Path | None = None,
) -> Profile:
    """Measure what the loading controller needs for ``model`` on its device."""
    kv_dtype = kv_dtype if kv_dtype is not None else get_settings().kv_dtype
    lengths = [n for n in lengths if n <= model.shape.max_context]
    prefill = measure_prefill_per_layer(model, lengths, repeats=repeats)
    throughput = measure_tier_throughput(
        model.shape,
        model.dtype,
        model.device,
        kv_dtype,
        tokens=chunk_tokens,
        repeats=repeats,
        work_dir=work_dir,
    )
    return Profile(
        model_fingerprint=model.fingerprint,
        model=model.name,
        device=str(model.device),
        compute_dtype=str(model.dtype).removeprefix("torch."),
        kv_dtype=dtype_name(kv_dtype),
        num_layers=model.num_layers,
        kv_bytes_per_token_per_layer=kv_bytes_per_token_per_layer(model.shape, kv_dtype),
        prefill=prefill,
        tier_bytes_per_s={"ram": throughput["ram"], "disk": throughput["disk"]},
        tier_cost=dict(DEFAULT_TIER_COST),
        threads=torch.get_num_threads(),
        notes={"disk_warm_bytes_per_s": throughput["disk_warm"], "chunk_tokens": chunk_tokens},
    )


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
) -> dict[str, Any]:
    """The loading benchmark of issue 4, in one run.

    Prefills ``num_chunks`` chunks of ``tokens`` tokens (random ids unless ``chunk_token_ids``), stores
    them, then times: full prefill of all chunks as one prompt; loading every layer of every chunk from
    RAM, from disk (warm page cache) and from disk (cold); and a layer loop that loads from disk (cold)
    while running ``compute_layer`` (default: :class:`RecomputeWorkload` at ``ratio``), with prefetch on
    and off. Each timing is the fastest of ``repeats`` runs. Returns a JSON-able dict of seconds and
    fractions.
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
        store = KVStore(root, model.fingerprint, model.shape, kv_dtype, promote_on_read=False)
        keys = [store.key_for(ids) for ids in chunk_token_ids]
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
    return {
        "num_chunks": len(chunk_token_ids),
        "tokens": total,
        "ratio": ratio,
        "kv_dtype": kv_dtype_used,
        "compute_dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "full_prefill_s": full_prefill_s,
        "load_all_layers_s": {tier: result["wall_s"] for tier, result in loads.items()},
        "pipelined": pipelined,
    }
