"""The chunk KV file format: one chunk's per-layer K/V as safetensors, with self-describing metadata.

Tensors ``layers.<i>.keys`` / ``layers.<i>.values`` ([Hkv, n, head_dim] in the storage dtype); metadata
carries the key, model fingerprint, storage dtype, layout version, shape, a crc32 per layer (over that
layer's K then V bytes) and a crc32 of the metadata itself. Checking the metadata needs no tensor bytes;
each layer is checked against its crc when read, so one layer can be loaded alone and still be verified.

:func:`encode` / :func:`decode` work on bytes (for any tier that keeps whole chunks, on disk or remote);
:func:`open_file` / :func:`read_layer` read a memory-mapped file layer by layer. A tier that keeps a chunk's
layers apart (the remote tier: one hash field per layer) stores the same metadata, checked by
:func:`parse_metadata`, beside each layer's :func:`layer_bytes`, read back by :func:`decode_layer`.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..blend.segments import ChunkKV
from ..errors import StoreError
from ..models.runtime import ModelShape
from .keys import KV_DTYPES, LAYOUT_VERSION

FILE_FORMAT = "cacheblend-kv"
SAFETENSORS_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


class InvalidKVFile(Exception):
    """Stored chunk KV that must not be used; the message says why."""


@dataclass(frozen=True)
class FileMeta:
    """What a chunk's metadata says (checked against itself and the key it is stored under)."""

    key: str
    model_fingerprint: str
    kv_dtype: str
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_crc32: tuple[int, ...]
    checksum: str  # crc32 of the metadata, which covers every layer's crc: identifies the content

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's K (and of its V): [Hkv, n, head_dim]."""
        return self.num_kv_heads, self.num_tokens, self.head_dim

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's K and V together in the storage dtype."""
        itemsize = torch.empty((), dtype=KV_DTYPES[self.kv_dtype]).element_size()
        return 2 * self.num_kv_heads * self.num_tokens * self.head_dim * itemsize


@dataclass(frozen=True)
class EncodedChunk:
    """A chunk ready for the file format: its storage-dtype tensors (``kv``, what a RAM tier keeps) and
    metadata; :meth:`data` serialises them (only when a tier writes them)."""

    kv: ChunkKV
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]

    def data(self) -> bytes:
        return save_safetensors(self.tensors, metadata=self.metadata)


def layer_tensor_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.keys", f"layers.{layer}.values"


def tensor_crc32(tensor: torch.Tensor, crc: int = 0) -> int:
    """crc32 of a contiguous CPU tensor's bytes, continuing from ``crc``."""
    return zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc)


def metadata_crc(fields: Mapping[str, str]) -> str:
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":")).encode()
    return f"{zlib.crc32(canonical):08x}"


def build_metadata(
    key: str, fingerprint: str, kv_dtype: str, shape: ModelShape, n: int, crcs: Sequence[int]
) -> dict[str, str]:
    fields = {
        "format": FILE_FORMAT,
        "layout_version": str(LAYOUT_VERSION),
        "key": key,
        "model_fingerprint": fingerprint,
        "kv_dtype": kv_dtype,
        "num_tokens": str(n),
        "num_layers": str(shape.num_layers),
        "num_kv_heads": str(shape.num_kv_heads),
        "head_dim": str(shape.head_dim),
        "layer_crc32": ",".join(f"{c:08x}" for c in crcs),
    }
    return {**fields, "meta_crc32": metadata_crc(fields)}


def parse_metadata(meta: Mapping[str, str], key: str) -> FileMeta:
    """Check metadata against its own crc and the key the chunk is stored under (no tensor bytes needed)."""
    if meta.get("format") != FILE_FORMAT:
        raise InvalidKVFile(f"not a cacheblend KV file (format {meta.get('format')!r})")
    fields = {k: v for k, v in meta.items() if k != "meta_crc32"}
    if meta.get("meta_crc32") != metadata_crc(fields):
        raise InvalidKVFile("metadata checksum mismatch")
    if meta.get("layout_version") != str(LAYOUT_VERSION):
        raise InvalidKVFile(
            f"layout version {meta.get('layout_version')} (this build reads {LAYOUT_VERSION})"
        )
    if meta.get("key") != key:
        raise InvalidKVFile(f"file holds key {str(meta.get('key'))[:16]}…, not the key it is stored under")
    try:
        parsed = FileMeta(
            key=key,
            model_fingerprint=meta["model_fingerprint"],
            kv_dtype=meta["kv_dtype"],
            num_tokens=int(meta["num_tokens"]),
            num_layers=int(meta["num_layers"]),
            num_kv_heads=int(meta["num_kv_heads"]),
            head_dim=int(meta["head_dim"]),
            layer_crc32=tuple(int(c, 16) for c in meta["layer_crc32"].split(",")),
            checksum=meta["meta_crc32"],
        )
    except (KeyError, ValueError) as exc:
        raise InvalidKVFile(f"malformed metadata ({exc})") from None
    if parsed.kv_dtype not in SAFETENSORS_DTYPES:
        raise InvalidKVFile(f"unknown storage dtype {parsed.kv_dtype!r}")
    if len(parsed.layer_crc32) != parsed.num_layers or parsed.num_tokens <= 0:
        raise InvalidKVFile("metadata and layer count disagree")
    return parsed


def check_metadata(
    meta: Mapping[str, str], tensors: Mapping[str, tuple[list[int], str]], key: str
) -> FileMeta:
    """Check metadata and the tensor table (name -> (shape, safetensors dtype)) against each other and
    the key the chunk is stored under."""
    parsed = parse_metadata(meta, key)
    expected_names = {name for i in range(parsed.num_layers) for name in layer_tensor_names(i)}
    if set(tensors) != expected_names:
        raise InvalidKVFile("tensor table does not match the layer count")
    want_shape = list(parsed.layer_shape)
    want_dtype = SAFETENSORS_DTYPES[parsed.kv_dtype]
    for name in expected_names:
        tensor_shape, dtype = tensors[name]
        if list(tensor_shape) != want_shape or dtype != want_dtype:
            raise InvalidKVFile(f"tensor {name} has shape {list(tensor_shape)} {dtype}")
    return parsed


def check_model(
    meta: FileMeta, fingerprint: str, kv_dtype: str, shape: ModelShape, what: str = "file"
) -> None:
    """Raise :class:`InvalidKVFile` unless ``meta`` is of this model, storage dtype and shape (``what``
    names the stored thing in the message: 'file', 'value')."""
    if meta.model_fingerprint != fingerprint:
        raise InvalidKVFile(f"foreign {what} of model {meta.model_fingerprint[:16]}…")
    if meta.kv_dtype != kv_dtype:
        raise InvalidKVFile(f"foreign {what} in {meta.kv_dtype} (store keeps {kv_dtype})")
    got = (meta.num_layers, meta.num_kv_heads, meta.head_dim)
    if got != (shape.num_layers, shape.num_kv_heads, shape.head_dim):
        raise InvalidKVFile(f"foreign {what} of shape {got}")


def storage_tensors(
    kv: ChunkKV, fingerprint: str, shape: ModelShape, kv_dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Validate ``kv`` against the model and copy it into contiguous CPU tensors of the storage dtype;
    returns them by name, and each layer's crc32."""
    if kv.fingerprint != fingerprint:
        raise StoreError(
            f"chunk KV of model {kv.fingerprint[:16]}… cannot go into the store of model {fingerprint[:16]}…"
        )
    if kv.num_layers != shape.num_layers or len(kv.values) != shape.num_layers:
        raise StoreError(f"chunk KV has {kv.num_layers} layers; the model has {shape.num_layers}")
    n = kv.num_tokens
    want = (shape.num_kv_heads, n, shape.head_dim)
    if n <= 0:
        raise StoreError("cannot store the KV of an empty chunk")
    tensors: dict[str, torch.Tensor] = {}
    crcs = []
    for i in range(shape.num_layers):
        k, v = kv.layer(i)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise StoreError(f"layer {i} K/V shapes {tuple(k.shape)}/{tuple(v.shape)}; expected {want}")
        k_out = torch.empty(want, dtype=kv_dtype).copy_(k)
        v_out = torch.empty(want, dtype=kv_dtype).copy_(v)
        k_name, v_name = layer_tensor_names(i)
        tensors[k_name], tensors[v_name] = k_out, v_out
        crcs.append(tensor_crc32(v_out, tensor_crc32(k_out)))
    return tensors, crcs


def encode(key: str, kv: ChunkKV, fingerprint: str, shape: ModelShape, kv_dtype: torch.dtype) -> EncodedChunk:
    """``kv`` in the file format under ``key`` (raises StoreError when it does not fit the model)."""
    tensors, crcs = storage_tensors(kv, fingerprint, shape, kv_dtype)
    dtype = str(kv_dtype).removeprefix("torch.")
    metadata = build_metadata(key, fingerprint, dtype, shape, kv.num_tokens, crcs)
    stored = ChunkKV(
        [tensors[layer_tensor_names(i)[0]] for i in range(shape.num_layers)],
        [tensors[layer_tensor_names(i)[1]] for i in range(shape.num_layers)],
        fingerprint,
    )
    return EncodedChunk(stored, tensors, metadata)


def decode(data: bytes, key: str) -> tuple[FileMeta, ChunkKV]:
    """The chunk in ``data`` (:meth:`EncodedChunk.data`), its metadata and every layer checked; raises
    :class:`InvalidKVFile` when anything does not match."""
    header = _header(data)
    meta = check_metadata(
        header.get("__metadata__") or {},
        {name: (entry["shape"], entry["dtype"]) for name, entry in header.items() if name != "__metadata__"},
        key,
    )
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError) as exc:
        raise InvalidKVFile(f"unreadable ({exc})") from None
    layers = [_checked_layer(tensors, meta, i) for i in range(meta.num_layers)]
    return meta, ChunkKV([k for k, _ in layers], [v for _, v in layers], meta.model_fingerprint)


def _header(data: bytes) -> dict[str, Any]:
    if len(data) < 8:
        raise InvalidKVFile("truncated (no header)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise InvalidKVFile("truncated header")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError:
        raise InvalidKVFile("unreadable header") from None
    if not isinstance(header, dict):
        raise InvalidKVFile("unreadable header")
    return header


def open_file(path: Path, key: str):
    """Open and check a stored file (metadata only). Returns (handle, meta, stat); raises
    FileNotFoundError if absent, :class:`InvalidKVFile` if unusable."""
    stat = path.stat()
    if stat.st_size == 0:
        raise InvalidKVFile("zero-length file")
    try:
        handle = safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, ValueError) as exc:
        raise InvalidKVFile(f"unreadable ({exc})") from None
    tensors = {}
    for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
        view = handle.get_slice(name)
        tensors[name] = (view.get_shape(), view.get_dtype())
    return handle, check_metadata(handle.metadata() or {}, tensors, key), stat


def read_layer(handle, meta: FileMeta, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V from an open file (memory-mapped), checked against the layer's crc32."""
    k_name, v_name = layer_tensor_names(layer)
    return _checked(handle.get_tensor(k_name), handle.get_tensor(v_name), meta, layer)


def _checked_layer(tensors: Mapping[str, torch.Tensor], meta: FileMeta, layer: int):
    k_name, v_name = layer_tensor_names(layer)
    return _checked(tensors[k_name], tensors[v_name], meta, layer)


def _checked(
    k: torch.Tensor, v: torch.Tensor, meta: FileMeta, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if tensor_crc32(v, tensor_crc32(k)) != meta.layer_crc32[layer]:
        raise InvalidKVFile(f"layer {layer} checksum mismatch")
    return k, v


def layer_bytes(keys: torch.Tensor, values: torch.Tensor) -> bytes:
    """One layer as a record of its own: its K bytes then its V bytes (contiguous, storage dtype), whose
    crc32 is the layer's recorded crc."""
    return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in (keys, values))


def decode_layer(data: bytes, meta: FileMeta, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A :func:`layer_bytes` record as (K, V), checked against its length and crc; raises
    :class:`InvalidKVFile`. The tensors own their memory."""
    if len(data) != meta.layer_nbytes:
        raise InvalidKVFile(f"layer {layer} holds {len(data)} bytes, metadata says {meta.layer_nbytes}")
    if zlib.crc32(data) != meta.layer_crc32[layer]:
        raise InvalidKVFile(f"layer {layer} checksum mismatch")
    flat = torch.frombuffer(bytearray(data), dtype=KV_DTYPES[meta.kv_dtype])
    half = flat.numel() // 2
    return flat[:half].view(meta.layer_shape), flat[half:].view(meta.layer_shape)
