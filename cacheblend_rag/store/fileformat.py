"""The chunk KV file format: one chunk's per-layer K/V as safetensors, with self-describing metadata.

Tensors ``layers.<i>.<part>``, the parts of the chunk's codec (:mod:`.codec`): ``keys`` / ``values``
([Hkv, n, head_dim] in the storage dtype) for a float codec (layout version 1, as every file before
codecs); codes and float16 scales for int8/int4 (layout version 2, with the codec's parameters, the scale
layout, in the metadata). Metadata carries the key, model fingerprint, codec (``kv_dtype``), layout
version, shape, a crc32 per layer (over that layer's encoded parts' bytes, in order) and a crc32 of the
metadata itself. Checking the metadata needs no tensor bytes; each layer is checked against its crc when
read, so one layer can be loaded alone and still be verified. A file of a layout or codec this build does
not know is refused by name, never misread.

:func:`encode` / :func:`decode` work on bytes (for any tier that keeps whole chunks, on disk or remote);
:func:`open_file` / :func:`read_parts` read a memory-mapped file layer by layer. A tier that keeps a chunk's
layers apart (the remote tier: one hash field per layer) stores the same metadata, checked by
:func:`parse_metadata`, beside each layer's :func:`layer_bytes`, read back by :func:`parts_from_bytes`.
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
from .codec import CODECS, SAFETENSORS_DTYPES, Codec, get_codec
from .keys import LAYOUT_VERSIONS

FILE_FORMAT = "cacheblend-kv"
Parts = dict[str, torch.Tensor]


class InvalidKVFile(Exception):
    """Stored chunk KV that must not be used; the message says why."""


@dataclass(frozen=True)
class FileMeta:
    """What a chunk's metadata says (checked against itself and the key it is stored under)."""

    key: str
    model_fingerprint: str
    kv_dtype: str  # the codec's name
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_crc32: tuple[int, ...]
    checksum: str  # crc32 of the metadata, which covers every layer's crc: identifies the content
    codec: Codec = CODECS["float16"]  # as recorded (a quantized file's own group sizes)
    layout_version: int = 1

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's K (and of its V): [Hkv, n, head_dim]."""
        return self.num_kv_heads, self.num_tokens, self.head_dim

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's encoded parts together."""
        return self.codec.layer_nbytes(*self.layer_shape)

    def part_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self.codec.parts(*self.layer_shape)


class EncodedChunk:
    """A chunk in its codec: each layer's parts (what the RAM tier keeps, what files and remote values
    hold) and the metadata. A ``ChunkKVSource``: :meth:`layer` decodes one layer (float codecs: the
    stored tensors as they are). :meth:`data` serialises it (only when a tier writes it)."""

    tier = "ram"

    def __init__(
        self, codec: Codec, layers: list[Parts], fingerprint: str, num_tokens: int, metadata: dict[str, str]
    ) -> None:
        self.codec = codec
        self.layers = layers
        self.fingerprint = fingerprint
        self.num_tokens = num_tokens
        self.num_layers = len(layers)
        self.metadata = metadata

    @property
    def nbytes(self) -> int:
        """Encoded bytes (what a RAM budget counts)."""
        return sum(t.numel() * t.element_size() for parts in self.layers for t in parts.values())

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec.decode(self.layers[layer])

    def decoded(self) -> ChunkKV:
        """Every layer decoded."""
        layers = [self.layer(i) for i in range(self.num_layers)]
        return ChunkKV([k for k, _ in layers], [v for _, v in layers], self.fingerprint)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"layers.{i}.{name}": t for i, parts in enumerate(self.layers) for name, t in parts.items()}

    def data(self) -> bytes:
        return save_safetensors(self.tensors(), metadata=self.metadata)


def layer_tensor_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.keys", f"layers.{layer}.values"


def tensor_crc32(tensor: torch.Tensor, crc: int = 0) -> int:
    """crc32 of a contiguous CPU tensor's bytes, continuing from ``crc``."""
    return zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc)


def parts_crc32(parts: Mapping[str, torch.Tensor], order: Sequence[str]) -> int:
    """crc32 of one layer's parts' bytes in ``order`` (for a float codec: K then V, as in layout 1)."""
    crc = 0
    for name in order:
        crc = tensor_crc32(parts[name], crc)
    return crc


def metadata_crc(fields: Mapping[str, str]) -> str:
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":")).encode()
    return f"{zlib.crc32(canonical):08x}"


def build_metadata(
    key: str, fingerprint: str, codec: Codec | str, shape: ModelShape, n: int, crcs: Sequence[int]
) -> dict[str, str]:
    codec = codec if isinstance(codec, Codec) else get_codec(codec)
    fields = {
        "format": FILE_FORMAT,
        "layout_version": str(codec.layout_version),
        "key": key,
        "model_fingerprint": fingerprint,
        "kv_dtype": codec.name,
        "num_tokens": str(n),
        "num_layers": str(shape.num_layers),
        "num_kv_heads": str(shape.num_kv_heads),
        "head_dim": str(shape.head_dim),
        "layer_crc32": ",".join(f"{c:08x}" for c in crcs),
    }
    if codec.quantized:  # a float codec's metadata stays exactly what layout 1 wrote
        fields["codec_params"] = codec.params
    return {**fields, "meta_crc32": metadata_crc(fields)}


def parse_metadata(meta: Mapping[str, str], key: str) -> FileMeta:
    """Check metadata against its own crc and the key the chunk is stored under (no tensor bytes needed)."""
    if meta.get("format") != FILE_FORMAT:
        raise InvalidKVFile(f"not a cacheblend KV file (format {meta.get('format')!r})")
    fields = {k: v for k, v in meta.items() if k != "meta_crc32"}
    if meta.get("meta_crc32") != metadata_crc(fields):
        raise InvalidKVFile("metadata checksum mismatch")
    known = [str(v) for v in LAYOUT_VERSIONS]
    if meta.get("layout_version") not in known:
        raise InvalidKVFile(
            f"layout version {meta.get('layout_version')} (this build reads {', '.join(known)})"
        )
    if meta.get("key") != key:
        raise InvalidKVFile(f"file holds key {str(meta.get('key'))[:16]}…, not the key it is stored under")
    layout = int(meta["layout_version"])
    codec = _recorded_codec(meta.get("kv_dtype"), layout, meta.get("codec_params"))
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
            codec=codec,
            layout_version=layout,
        )
    except (KeyError, ValueError) as exc:
        raise InvalidKVFile(f"malformed metadata ({exc})") from None
    if len(parsed.layer_crc32) != parsed.num_layers or parsed.num_tokens <= 0:
        raise InvalidKVFile("metadata and layer count disagree")
    try:
        codec.check_shape(parsed.head_dim)
    except ValueError as exc:
        raise InvalidKVFile(str(exc)) from None
    return parsed


def _recorded_codec(name: str | None, layout: int, params: str | None) -> Codec:
    """The codec a file records, with its own parameters; refuses one this build does not know."""
    known = CODECS.get(name or "")
    if known is None or known.layout_version != layout:
        raise InvalidKVFile(
            f"unknown codec {name!r} in layout version {layout} (this build reads {', '.join(CODECS)})"
        )
    if not known.quantized:
        return known
    try:
        recorded = json.loads(params or "")
        codec = Codec(known.name, known.bits, int(recorded["key_group"]), int(recorded["value_group"]))
        same = recorded["bits"] == known.bits and recorded["scale_dtype"] == "float16"
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidKVFile(f"codec {name} with unreadable parameters ({exc})") from None
    if not same or codec.params != params or codec.key_group < 1 or codec.value_group < 1:
        raise InvalidKVFile(f"codec {name} with parameters this build does not read: {params}")
    return codec


def check_metadata(
    meta: Mapping[str, str], tensors: Mapping[str, tuple[list[int], str]], key: str
) -> FileMeta:
    """Check metadata and the tensor table (name -> (shape, safetensors dtype)) against each other and
    the key the chunk is stored under."""
    parsed = parse_metadata(meta, key)
    specs = parsed.part_specs()
    expected = {
        f"layers.{i}.{part}": (list(shape), SAFETENSORS_DTYPES[dtype])
        for i in range(parsed.num_layers)
        for part, (shape, dtype) in specs.items()
    }
    if set(tensors) != set(expected):
        raise InvalidKVFile("tensor table does not match the codec and layer count")
    for name, (want_shape, want_dtype) in expected.items():
        tensor_shape, dtype = tensors[name]
        if list(tensor_shape) != want_shape or dtype != want_dtype:
            raise InvalidKVFile(f"tensor {name} has shape {list(tensor_shape)} {dtype}")
    return parsed


def check_model(
    meta: FileMeta, fingerprint: str, kv_dtype: str, shape: ModelShape, what: str = "file"
) -> None:
    """Raise :class:`InvalidKVFile` unless ``meta`` is of this model, codec and shape (``what``
    names the stored thing in the message: 'file', 'value')."""
    if meta.model_fingerprint != fingerprint:
        raise InvalidKVFile(f"foreign {what} of model {meta.model_fingerprint[:16]}…")
    if meta.kv_dtype != kv_dtype:
        raise InvalidKVFile(f"foreign {what} in {meta.kv_dtype} (store keeps {kv_dtype})")
    got = (meta.num_layers, meta.num_kv_heads, meta.head_dim)
    if got != (shape.num_layers, shape.num_kv_heads, shape.head_dim):
        raise InvalidKVFile(f"foreign {what} of shape {got}")


def encode(
    key: str, kv: ChunkKV, fingerprint: str, shape: ModelShape, codec: Codec | torch.dtype | str
) -> EncodedChunk:
    """``kv`` in ``codec`` (a codec or its name/float dtype) under ``key`` (raises StoreError when it
    does not fit the model)."""
    codec = (codec if isinstance(codec, Codec) else get_codec(codec)).for_head_dim(shape.head_dim)
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
    try:
        codec.check_shape(shape.head_dim)
    except ValueError as exc:
        raise StoreError(str(exc)) from None
    order = list(codec.parts(*want))
    layers, crcs = [], []
    for i in range(shape.num_layers):
        k, v = kv.layer(i)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise StoreError(f"layer {i} K/V shapes {tuple(k.shape)}/{tuple(v.shape)}; expected {want}")
        parts = codec.encode(k, v)
        layers.append(parts)
        crcs.append(parts_crc32(parts, order))
    metadata = build_metadata(key, fingerprint, codec, shape, n, crcs)
    return EncodedChunk(codec, layers, fingerprint, n, metadata)


def decode(data: bytes, key: str) -> tuple[FileMeta, ChunkKV]:
    """The chunk in ``data`` (:meth:`EncodedChunk.data`), its metadata and every layer checked, decoded;
    raises :class:`InvalidKVFile` when anything does not match."""
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
    layers = []
    for i in range(meta.num_layers):
        parts = {name: tensors[f"layers.{i}.{name}"] for name in meta.part_specs()}
        layers.append(meta.codec.decode(_checked(parts, meta, i)))
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


def read_parts(handle, meta: FileMeta, layer: int) -> Parts:
    """One layer's encoded parts from an open file (memory-mapped), checked against the layer's crc32."""
    parts = {name: handle.get_tensor(f"layers.{layer}.{name}") for name in meta.part_specs()}
    return _checked(parts, meta, layer)


def read_layer(handle, meta: FileMeta, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V from an open file, checked and decoded."""
    return meta.codec.decode(read_parts(handle, meta, layer))


def _checked(parts: Parts, meta: FileMeta, layer: int) -> Parts:
    if parts_crc32(parts, list(meta.part_specs())) != meta.layer_crc32[layer]:
        raise InvalidKVFile(f"layer {layer} checksum mismatch")
    return parts


def layer_bytes(parts: Mapping[str, torch.Tensor]) -> bytes:
    """One layer as a record of its own: its parts' bytes in order (for a float codec K then V), whose
    crc32 is the layer's recorded crc."""
    return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in parts.values())


def parts_from_bytes(data: bytes, meta: FileMeta, layer: int) -> Parts:
    """A :func:`layer_bytes` record as the layer's parts, checked against its length and crc; raises
    :class:`InvalidKVFile`. The tensors own their memory."""
    if len(data) != meta.layer_nbytes:
        raise InvalidKVFile(f"layer {layer} holds {len(data)} bytes, metadata says {meta.layer_nbytes}")
    if zlib.crc32(data) != meta.layer_crc32[layer]:
        raise InvalidKVFile(f"layer {layer} checksum mismatch")
    buffer = bytearray(data)
    parts, offset = {}, 0
    for name, (shape, dtype) in meta.part_specs().items():
        count = 1
        for dim in shape:
            count *= dim
        parts[name] = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(shape)
        offset += count * torch.empty((), dtype=dtype).element_size()
    return parts


def decode_layer(data: bytes, meta: FileMeta, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A :func:`layer_bytes` record as (K, V), checked and decoded."""
    return meta.codec.decode(parts_from_bytes(data, meta, layer))
