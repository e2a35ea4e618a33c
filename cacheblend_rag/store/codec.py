"""Chunk KV codecs: one layer's K and V to named parts (tensors) and back.

A float codec (float16, bfloat16, float32) keeps K and V as they are, in that dtype: parts ``keys`` and
``values``, the file layout of version 1. A quantized codec (int8, int4; layout version 2) keeps codes
and float16 scales, after KIVI: keys per channel (each head-dim channel, over groups of
``key_group`` tokens), values per token (over groups of ``value_group`` head-dim channels), because key
outliers sit in fixed channels and value outliers in tokens. int8 is symmetric (a scale per group, codes
offset by 128); int4 is asymmetric (a scale and a minimum per group; two codes per byte along head_dim).
Keys are quantized as stored: rotated to the chunk's own positions 0..n-1 (RoPE applied).

Decoding yields float16 (:attr:`Codec.dtype`), so everything above the store sees ``ChunkKV`` as for a
float16 store; the fusor converts to the compute dtype as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}
SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8"}
SCALE_DTYPE = torch.float16

# Group sizes chosen by measurement on the default model's chunk KV (docs/store.md, "KV codecs").
INT8_KEY_GROUP = 128
INT8_VALUE_GROUP = 64
INT4_KEY_GROUP = 128
INT4_VALUE_GROUP = 64


class UnknownCodecError(ValueError):
    """A codec name this build does not know."""


@dataclass(frozen=True)
class Codec:
    """How one layer's K/V ([Hkv, n, head_dim] each) is stored."""

    name: str
    bits: int = 0  # 0: a float codec
    key_group: int = 0  # tokens per key scale (per channel)
    value_group: int = 0  # head-dim channels per value scale (per token)

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def layout_version(self) -> int:
        return 2 if self.quantized else 1

    @property
    def dtype(self) -> torch.dtype:
        """The dtype decoded tensors come in."""
        return FLOAT_DTYPES.get(self.name, torch.float16)

    @property
    def params(self) -> str:
        """The codec's parameters as recorded in a file's metadata ('' for a float codec)."""
        if not self.quantized:
            return ""
        return json.dumps(
            {
                "bits": self.bits,
                "key_group": self.key_group,
                "value_group": self.value_group,
                "scale_dtype": "float16",
                "keys": "per-channel" + ("" if self.bits == 8 else "-asymmetric"),
                "values": "per-token" + ("" if self.bits == 8 else "-asymmetric"),
            },
            sort_keys=True,
        )

    # -- layout --------------------------------------------------------------------------------------

    def parts(self, heads: int, n: int, head_dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every part of one layer, in the order their bytes are laid out."""
        if not self.quantized:
            return {"keys": ((heads, n, head_dim), self.dtype), "values": ((heads, n, head_dim), self.dtype)}
        packed = head_dim * self.bits // 8
        key_groups = math.ceil(n / self.key_group)
        value_groups = head_dim // self.value_group
        out = {"keys": ((heads, n, packed), torch.uint8)}
        out["keys.scale"] = ((heads, key_groups, head_dim), SCALE_DTYPE)
        if self.bits == 4:
            out["keys.min"] = ((heads, key_groups, head_dim), SCALE_DTYPE)
        out["values"] = ((heads, n, packed), torch.uint8)
        out["values.scale"] = ((heads, n, value_groups), SCALE_DTYPE)
        if self.bits == 4:
            out["values.min"] = ((heads, n, value_groups), SCALE_DTYPE)
        return out

    def layer_nbytes(self, heads: int, n: int, head_dim: int) -> int:
        """Bytes of one layer's parts together."""
        return sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for shape, dtype in self.parts(heads, n, head_dim).values()
        )

    def for_head_dim(self, head_dim: int) -> Codec:
        """This codec for heads of ``head_dim`` channels: value groups no wider than a head."""
        if self.quantized and self.value_group > head_dim:
            return replace(self, value_group=head_dim)
        return self

    def check_shape(self, head_dim: int) -> None:
        """Raise ValueError unless this codec can store heads of ``head_dim`` channels."""
        if self.quantized and (head_dim % self.value_group or head_dim % 2):
            raise ValueError(
                f"codec {self.name} groups values by {self.value_group} channels; head_dim {head_dim} "
                "is not a multiple"
            )

    # -- encoding ------------------------------------------------------------------------------------

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """One layer's parts (contiguous CPU tensors) from its K and V (any float dtype)."""
        if not self.quantized:
            return {
                "keys": torch.empty(keys.shape, dtype=self.dtype).copy_(keys),
                "values": torch.empty(values.shape, dtype=self.dtype).copy_(values),
            }
        self.check_shape(keys.shape[-1])
        k = keys.detach().to("cpu", torch.float32)
        v = values.detach().to("cpu", torch.float32)
        heads, n, dim = k.shape
        # keys: per channel over token groups -> [H, groups, G, D], reduce over G
        pad = -n % self.key_group
        kp = torch.cat([k, k[:, -1:].expand(heads, pad, dim)], 1) if pad else k
        k_groups = kp.view(heads, -1, self.key_group, dim)
        k_codes, k_scale, k_min = self._quantize(k_groups, dim=2)
        # values: per token over channel groups -> [H, n, D/G, G], reduce over G
        v_groups = v.view(heads, n, dim // self.value_group, self.value_group)
        v_codes, v_scale, v_min = self._quantize(v_groups, dim=3)
        out = {"keys": self._pack(k_codes.view(heads, -1, dim)[:, :n]), "keys.scale": k_scale.squeeze(2)}
        if k_min is not None:
            out["keys.min"] = k_min.squeeze(2)
        out["values"] = self._pack(v_codes.view(heads, n, dim))
        out["values.scale"] = v_scale.squeeze(3)
        if v_min is not None:
            out["values.min"] = v_min.squeeze(3)
        return out

    def _quantize(self, x: torch.Tensor, dim: int):
        """Codes (uint8, one per value), scale and minimum (None when symmetric) in the scale dtype."""
        if self.bits == 8:
            scale = (x.abs().amax(dim, keepdim=True) / 127).to(SCALE_DTYPE)
            s = scale.float().clamp_min(1e-8)
            codes = (x / s).round_().clamp_(-127, 127).add_(128)
            return codes.to(torch.uint8), scale, None
        levels = (1 << self.bits) - 1
        low = x.amin(dim, keepdim=True).to(SCALE_DTYPE)
        high = x.amax(dim, keepdim=True)
        scale = ((high - low.float()) / levels).to(SCALE_DTYPE)
        s = scale.float().clamp_min(1e-8)
        codes = ((x - low.float()) / s).round_().clamp_(0, levels)
        return codes.to(torch.uint8), scale, low

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return codes.contiguous()
        return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()

    # -- decoding ------------------------------------------------------------------------------------

    def decode(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (in :attr:`dtype`) from one layer's parts (as :meth:`encode` made them)."""
        if not self.quantized:
            return parts["keys"], parts["values"]
        k_codes, v_codes = self._unpack(parts["keys"]), self._unpack(parts["values"])
        heads, n, dim = k_codes.shape
        keys = torch.empty((heads, n, dim), dtype=torch.float32)
        # keys: one scale per channel and token group; the group's tokens share it by broadcasting
        # (a repeat_interleave of the scales cost as much as the arithmetic itself)
        group, full = self.key_group, n // self.key_group * self.key_group
        k_scale, k_min = parts["keys.scale"], parts.get("keys.min")
        if full:
            shape = (heads, full // group, group, dim)
            self._dequantize(
                k_codes[:, :full].view(shape),
                k_scale[:, : full // group, None],
                None if k_min is None else k_min[:, : full // group, None],
                keys[:, :full].view(shape),
            )
        if full < n:  # the last, partial group
            self._dequantize(
                k_codes[:, full:],
                k_scale[:, -1:],
                None if k_min is None else k_min[:, -1:],
                keys[:, full:],
            )
        values = torch.empty((heads, n, dim), dtype=torch.float32)
        shape = (heads, n, dim // self.value_group, self.value_group)
        v_min = parts.get("values.min")
        self._dequantize(
            v_codes.view(shape),
            parts["values.scale"][..., None],
            None if v_min is None else v_min[..., None],
            values.view(shape),
        )
        return keys.to(self.dtype), values.to(self.dtype)

    def joined_key_rows(self, lengths: Sequence[int]) -> torch.Tensor:
        """For chunks of ``lengths`` tokens decoded together (:meth:`decode_joined`): each token's row in
        their key scales laid end to end (a chunk's last, partial group included)."""
        rows: list[int] = []
        offset = 0
        for n in lengths:
            rows += [offset + t // self.key_group for t in range(n)]
            offset += math.ceil(n / self.key_group)
        return torch.tensor(rows, dtype=torch.long)

    def decode_joined(
        self,
        parts: Sequence[dict[str, torch.Tensor]],
        key_rows: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [H, sum n, d] of one layer of several chunks laid end to end, on ``device`` in
        ``dtype``: each part joined once, moved once and decoded there once, so the operations do not
        grow with the chunk count; the values are :meth:`decode`'s (float codecs, int8; ``key_rows`` from
        :meth:`joined_key_rows`, on ``device``)."""

        def joined(name: str) -> torch.Tensor:
            one = parts[0][name] if len(parts) == 1 else torch.cat([p[name] for p in parts], dim=1)
            return one.to(device, non_blocking=True)

        if not self.quantized:
            return joined("keys").to(dtype), joined("values").to(dtype)
        if self.bits != 8 or key_rows is None:
            raise ValueError(f"codec {self.name} is decoded chunk by chunk")
        # (as decode: codes and scales in float32, the result rounded to the codec's float16)
        keys = (joined("keys").float() - 128) * joined("keys.scale").index_select(1, key_rows).float()
        codes = joined("values")
        heads, n, dim = codes.shape
        grouped = (codes.float() - 128).view(heads, n, dim // self.value_group, self.value_group)
        values = (grouped * joined("values.scale").float()[..., None]).view(heads, n, dim)
        return keys.to(self.dtype).to(dtype), values.to(self.dtype).to(dtype)

    def _dequantize(
        self, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        """``out`` = codes * scale + low (int4) or (codes - 128) * scale (int8), scales broadcast."""
        out.copy_(codes)
        # the scales are small: made float32 first, the full-size products need no mixed-dtype kernel
        if low is None:
            out.sub_(128).mul_(scale.float())
        else:
            out.mul_(scale.float()).add_(low.float())

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return packed
        # low nibble first: stacking the two halves on a new last axis interleaves them in one pass
        return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(*packed.shape[:-1], -1)


CODECS: dict[str, Codec] = {
    **{name: Codec(name) for name in FLOAT_DTYPES},
    "int8": Codec("int8", 8, INT8_KEY_GROUP, INT8_VALUE_GROUP),
    "int4": Codec("int4", 4, INT4_KEY_GROUP, INT4_VALUE_GROUP),
}


def get_codec(name: object) -> Codec:
    """The codec named ``name`` (a codec name, a float alias such as fp16, or a torch float dtype);
    raises :class:`UnknownCodecError` naming it."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    if isinstance(name, str):
        key = ALIASES.get(name.removeprefix("torch."), name.removeprefix("torch."))
        if key in CODECS:
            return CODECS[key]
    raise UnknownCodecError(f"unknown KV codec {name!r}: use one of {', '.join(CODECS)}")
