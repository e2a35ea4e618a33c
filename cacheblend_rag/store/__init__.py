"""The chunk KV store: keys, the file format, the RAM, disk and (shared, optional) remote tiers behind
:class:`KVStore`, and layer-wise pipelined loading."""

from .disk import DiskChunkKV, DiskTier
from .fileformat import EncodedChunk, FileMeta, InvalidKVFile, decode, encode
from .keys import LAYOUT_VERSION, chunk_key, kv_bytes_per_token, resolve_kv_dtype
from .kvstore import KVStore, StoreCounters
from .maintenance import VerifyReport
from .pipeline import LoadTimings, PipelinedLayerLoader
from .ram import RamTier
from .remote import RedisKVTier, RemoteChunkKV, RemoteVerifyReport
from .tier import KVTier, tier_of

__all__ = [
    "LAYOUT_VERSION",
    "DiskChunkKV",
    "DiskTier",
    "EncodedChunk",
    "FileMeta",
    "InvalidKVFile",
    "KVStore",
    "KVTier",
    "LoadTimings",
    "PipelinedLayerLoader",
    "RamTier",
    "RedisKVTier",
    "RemoteChunkKV",
    "RemoteVerifyReport",
    "StoreCounters",
    "VerifyReport",
    "chunk_key",
    "decode",
    "encode",
    "kv_bytes_per_token",
    "resolve_kv_dtype",
    "tier_of",
]
