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
from .codec import CODECS, Codec, UnknownCodecError, get_codec

# Bump when the file layout or the meaning of stored K/V changes (e.g. keys stored rotated differently);
# entries of another version are treated as foreign and recomputed. Layout 1: float codecs (K/V as they
# are); layout 2: quantized codecs (codes and scales, see :mod:`.codec`). A key names its codec's layout.
LAYOUT_VERSION = 1
LAYOUT_VERSIONS = (1, 2)

KV_DTYPES: dict[str, torch.dtype] = {name: codec.dtype for name, codec in CODECS.items()}
_KEY_CHARS = frozenset("0123456789abcdef")


def resolve_codec(dtype: torch.dtype | str) -> Codec:
    """The storage codec named by ``dtype`` (float16/bfloat16/float32/int8/int4, short aliases, or a
    torch float dtype); raises ValueError naming it."""
    try:
        return get_codec(dtype)
    except UnknownCodecError:
        raise ValueError(
            f"unsupported KV storage dtype {dtype!r}: use float16, bfloat16, float32, int8 or int4"
        ) from None


def resolve_kv_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The dtype chunk KV stored as ``dtype`` is served in (float16 for the quantized codecs)."""
    return resolve_codec(dtype).dtype


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name of a storage codec ('float16', 'bfloat16', 'float32', 'int8', 'int4')."""
    return resolve_codec(dtype).name


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
    codec = resolve_codec(kv_dtype)  # two codecs never share a key (nor two layouts)
    fields = ("cacheblend-kv", model_fingerprint, codec.name, f"v{codec.layout_version}", f"n={ids.size}")
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
        raise ValueError(f"invalid KV key {key!r}: expected the 64 hex characters of KVStore.chunk_key()")


def kv_bytes_per_token(shape: ModelShape, kv_dtype: torch.dtype | str, num_tokens: int = 512) -> int:
    """Bytes of K and V of one token over all layers (23,040 for SmolLM2-135M in fp16; for a quantized
    codec, scales included, averaged over a chunk of ``num_tokens``)."""
    return kv_bytes_per_token_per_layer(shape, kv_dtype, num_tokens) * shape.num_layers


def kv_bytes_per_token_per_layer(
    shape: ModelShape, kv_dtype: torch.dtype | str, num_tokens: int = 512
) -> int:
    """Bytes of K and V of one token in one layer (see :func:`kv_bytes_per_token`)."""
    layer = resolve_codec(kv_dtype).layer_nbytes(shape.num_kv_heads, num_tokens, shape.head_dim)
    return -(-layer // num_tokens)


def chunk_payload_bytes(shape: ModelShape, kv_dtype: torch.dtype | str, num_tokens: int = 512) -> int:
    """Tensor bytes of one chunk's KV (a stored file adds a small JSON header on top)."""
    codec = resolve_codec(kv_dtype)
    return codec.layer_nbytes(shape.num_kv_heads, num_tokens, shape.head_dim) * shape.num_layers
