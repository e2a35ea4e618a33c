"""Chunk KV storage: keys, the tiered store, and layer-wise pipelined loading."""

from .keys import LAYOUT_VERSION, chunk_key, kv_bytes_per_token, resolve_kv_dtype
from .kvstore import DiskChunkKV, KVStore, StoreCounters, VerifyReport, tier_of
from .pipeline import LoadTimings, PipelinedLayerLoader

__all__ = [
    "LAYOUT_VERSION",
    "DiskChunkKV",
    "KVStore",
    "LoadTimings",
    "PipelinedLayerLoader",
    "StoreCounters",
    "VerifyReport",
    "chunk_key",
    "kv_bytes_per_token",
    "resolve_kv_dtype",
    "tier_of",
]
