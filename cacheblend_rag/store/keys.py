"""Chunk KV keys and the storage layout's arithmetic.

A key is a sha256 over everything that makes two KV caches interchangeable: the model fingerprint
(architecture, config, tokenizer and weights), the storage dtype, the on-disk layout version and the
chunk's token ids. The same text under another model, dtype or layout never hits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from ..models.runtime import ModelShape

# Bump when the file layout or the meaning of stored K/V changes (e.g. keys stored rotated differently);
# entries of another version are treated as foreign and recomputed.
LAYOUT_VERSION = 1

KV_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
_KEY_CHARS = frozenset("0123456789abcdef")
_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


def resolve_kv_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The storage dtype named by ``dtype`` (a torch dtype or float16/bfloat16/float32 and short aliases)."""
    if isinstance(dtype, torch.dtype):
        if dtype in KV_DTYPES.values():
            return dtype
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        name = _ALIASES.get(name, name)
        if name in KV_DTYPES:
            return KV_DTYPES[name]
    raise ValueError(f"unsupported KV storage dtype {dtype!r}: use float16, bfloat16 or float32")


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name of a storage dtype ('float16', 'bfloat16', 'float32')."""
    return str(resolve_kv_dtype(dtype)).removeprefix("torch.")


def chunk_key(
    model_fingerprint: str, kv_dtype: torch.dtype | str, token_ids: Sequence[int], context: str = ""
) -> str:
    """Hex sha256 identifying one chunk's KV for one model, storage dtype, layout version and the
    context the chunk was prefilled behind (``ChunkContext.key``; '' for a chunk prefilled alone)."""
    if not model_fingerprint:
        raise ValueError("chunk_key needs a non-empty model fingerprint")
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("chunk_key needs a non-empty flat sequence of token ids")
    # no silent casts: 1.5 or "1" must not share the key of token 1
    if ids.dtype.kind not in "iu" or (ids.dtype.kind == "u" and ids.max() > np.iinfo(np.int64).max):
        raise ValueError(f"token ids must be integers that fit in int64, got {ids.dtype} values")
    if (ids < 0).any():
        raise ValueError("token ids must be non-negative")
    digest = hashlib.sha256()
    fields = ("cacheblend-kv", model_fingerprint, dtype_name(kv_dtype), f"v{LAYOUT_VERSION}", f"n={ids.size}")
    if context:  # keys of chunks prefilled alone are unchanged, so KV stored before contexts still hits
        fields += (f"ctx={context}",)
    header = "\0".join(fields) + "\0"
    digest.update(header.encode())
    digest.update(ids.astype("<i8").tobytes())
    return digest.hexdigest()


def is_chunk_key(key: object) -> bool:
    """Whether ``key`` has the form of a chunk key (64 lowercase hex characters)."""
    return isinstance(key, str) and len(key) == 64 and _KEY_CHARS.issuperset(key)


def check_key(key: object) -> None:
    """Raise ValueError unless ``key`` has the form of a chunk key."""
    if not is_chunk_key(key):
        raise ValueError(f"invalid KV key {key!r}: expected the 64 hex characters of KVStore.key_for()")


def kv_bytes_per_token(shape: ModelShape, kv_dtype: torch.dtype | str) -> int:
    """Bytes of K and V of one token over all layers (23,040 for SmolLM2-135M in fp16)."""
    return kv_bytes_per_token_per_layer(shape, kv_dtype) * shape.num_layers


def kv_bytes_per_token_per_layer(shape: ModelShape, kv_dtype: torch.dtype | str) -> int:
    """Bytes of K and V of one token in one layer."""
    itemsize = torch.empty((), dtype=resolve_kv_dtype(kv_dtype)).element_size()
    return 2 * shape.num_kv_heads * shape.head_dim * itemsize


def chunk_payload_bytes(shape: ModelShape, kv_dtype: torch.dtype | str, num_tokens: int = 512) -> int:
    """Tensor bytes of one chunk's KV (a stored file adds a small JSON header on top)."""
    return kv_bytes_per_token(shape, kv_dtype) * num_tokens
