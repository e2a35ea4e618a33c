"""Measure what the loading controller needs (``cacheblend-rag profile``): one layer's full-prefill time at
several context lengths, and each tier's load throughput into the compute dtype.

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

import torch

from ..blend.controller import DEFAULT_TIER_COST, Profile, measure_prefill_per_layer
from ..blend.segments import ChunkKV, ChunkKVSource
from ..config import DEFAULT_KV_DTYPE, default_home
from ..models.runtime import LayerwiseModel, ModelShape
from .keys import chunk_payload_bytes, dtype_name, kv_bytes_per_token_per_layer
from .kvstore import KVStore
from .pipeline import LayerKV, PipelinedLayerLoader

ComputeLayer = Callable[[int, LayerKV], None]


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


def synthetic_chunk(shape: ModelShape, n: int, dtype: torch.dtype, fingerprint: str, seed: int) -> ChunkKV:
    generator = torch.Generator().manual_seed(seed)
    dims = (shape.num_kv_heads, n, shape.head_dim)
    keys = [torch.randn(dims, generator=generator).to(dtype) for _ in range(shape.num_layers)]
    values = [torch.randn(dims, generator=generator).to(dtype) for _ in range(shape.num_layers)]
    return ChunkKV(keys, values, fingerprint)


def measure_tier_throughput(
    shape: ModelShape,
    compute_dtype: torch.dtype,
    device: torch.device | str,
    kv_dtype: torch.dtype | str = DEFAULT_KV_DTYPE,
    tokens: int = 512,
    chunks: int = 2,
    repeats: int = 3,
    work_dir: Path | None = None,
) -> dict[str, float]:
    """Bytes per second (storage-dtype bytes) of loading chunk KV into ``compute_dtype`` on ``device``:
    from the RAM tier, from disk with a warm page cache, and from disk after dropping the page cache."""
    fingerprint = "0" * 64
    work_dir = work_dir if work_dir is not None else default_home()
    work_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="profile-kv-", dir=work_dir))
    try:
        store = KVStore(root, fingerprint, shape, kv_dtype, promote_on_read=False)
        stored = {
            store.chunk_key([i] * tokens): synthetic_chunk(shape, tokens, store.kv_dtype, fingerprint, i)
            for i in range(chunks)
        }
        keys = list(stored)
        for key, kv in stored.items():
            store.put(key, kv)
        # encoded bytes: what kv_bytes_per_token_per_layer counts for the controller too
        nbytes = chunks * chunk_payload_bytes(shape, store.codec.name, tokens)
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
    kv_dtype: torch.dtype | str = DEFAULT_KV_DTYPE,
    chunk_tokens: int = 512,
    repeats: int = 3,
    work_dir: Path | None = None,
) -> Profile:
    """Measure what the loading controller needs for ``model`` on its device."""
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
