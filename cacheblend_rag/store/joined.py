"""A fusion's cached layers served joined: chunks held in RAM decoded together, one layer at a time.

The pipelined loader (:mod:`.pipeline`) decodes and moves each chunk's layer on its own: a few operations
per chunk per layer, which an accelerator pays as launches and the host as dispatch. For the static fusion
(blend/static.py), whose own operations do not grow with the chunk count, every run of consecutive chunks
kept in the RAM tier in one codec (int8, or a float codec) is joined here part by part, moved to the device
once and decoded there once (:meth:`~.codec.Codec.decode_joined`): int8's four times smaller codes are
what crosses to the device. A chunk held decoded in memory (a template's exact head) is one run of its
own. The fusion places what each layer returns in order, as it would place one pair per chunk.

:meth:`JoinedLayerKV.stage` serves several layers at once into the fusion's staging buffer: every part of
a run joined over its chunks and the layers in one operation and int8 decoded by a few operations for
all of them (the codes' offset by an exclusive or, the products with the float16 scales rounded once, as
:meth:`~.codec.Codec.decode` rounds them), so the kernels per fusion do not grow with the layers either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..blend.segments import ChunkKV, ChunkKVSource
from .codec import Codec
from .fileformat import EncodedChunk

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Run:
    codec: Codec | None  # None: a source decoded in memory, served as it is
    sources: list[ChunkKVSource]
    key_rows: torch.Tensor | None = None
    tokens: int = 0
    groups: int = 0  # key scale rows of one layer, every chunk's together
    whole_groups: bool = False  # every chunk's length a multiple of the key group
    layer_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # key_rows over n joined layers


def _joinable(source: ChunkKVSource) -> bool:
    return isinstance(source, EncodedChunk) and (not source.codec.quantized or source.codec.bits == 8)


class JoinedLayerKV:
    """Serves ``layer(i)`` -> one (K, V) pair per run of sources (see the module docstring), in ``dtype``
    on ``device``. :meth:`serves` says whether every source can be served so."""

    def __init__(self, sources: Sequence[ChunkKVSource], dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, torch.device(device)
        self.runs: list[_Run] = []
        for source in sources:
            codec = source.codec if _joinable(source) else None
            last = self.runs[-1] if self.runs else None
            if codec is not None and last is not None and last.codec == codec:
                last.sources.append(source)
            else:
                self.runs.append(_Run(codec, [source]))
        for run in self.runs:
            lengths = [source.num_tokens for source in run.sources]
            run.tokens = sum(lengths)
            if run.codec is not None and run.codec.quantized:
                rows = run.codec.joined_key_rows(lengths)
                run.key_rows = rows.to(self.device, non_blocking=True)
                run.groups = sum(-(-n // run.codec.key_group) for n in lengths)
                run.whole_groups = all(n % run.codec.key_group == 0 for n in lengths)

    @staticmethod
    def serves(sources: Sequence[ChunkKVSource]) -> bool:
        """Whether every source is in memory: kept encoded in RAM (int8 or a float codec) or decoded."""
        return all(_joinable(s) or isinstance(s, ChunkKV) for s in sources)

    def layer(self, layer: int) -> LayerKV:
        out = []
        for run in self.runs:
            if run.codec is None:
                k, v = run.sources[0].layer(layer)
                out.append((k.to(self.device, self.dtype), v.to(self.device, self.dtype)))
            else:
                parts = [source.layers[layer] for source in run.sources]
                out.append(run.codec.decode_joined(parts, run.key_rows, self.device, self.dtype))
        return out

    def stage(self, start: int, stop: int, out: torch.Tensor) -> None:
        """Layers ``start``..``stop``-1 into ``out`` [stop - start, Hkv, 2, N, d] (K then V of every run's
        rows in order, in ``out``'s dtype): the same values :meth:`layer` serves."""
        offset = 0
        for run in self.runs:
            dst = out[:, :, :, offset : offset + run.tokens]
            offset += run.tokens
            layers = range(start, stop)
            if run.codec is None:
                for i, layer in enumerate(layers):
                    k, v = run.sources[0].layer(layer)
                    dst[i, :, 0].copy_(k)
                    dst[i, :, 1].copy_(v)
                continue
            parts = [[source.layers[layer] for source in run.sources] for layer in layers]
            codes = self._joined(parts, ("keys", "values"))  # [Hkv, L (K, V) n, d]
            shaped = (codes.shape[0], len(layers), 2, run.tokens, codes.shape[-1])
            if not run.codec.quantized:
                dst.copy_(codes.view(shaped).transpose(0, 1))
                continue
            self._decode_int8(run, parts, codes.view(shaped), dst)

    def _joined(self, parts: list[list[dict[str, torch.Tensor]]], names: tuple[str, ...]) -> torch.Tensor:
        """Every layer's ``names`` parts of every chunk, joined along the tokens (layer, name, chunk)."""
        pieces = [p[name] for layer in parts for name in names for p in layer]
        return torch.cat(pieces, dim=1).to(self.device, non_blocking=True)

    def _decode_int8(
        self, run: _Run, parts: list[list[dict[str, torch.Tensor]]], codes: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """:meth:`~.codec.Codec.decode` of int8 ``codes`` [Hkv, L, 2, n, d] of several layers into ``dst``
        [L, Hkv, 2, n, d]: (code - 128) is the code with its top bit flipped read as int8, and an int8
        code times a float16 scale is the exact product rounded once to float16, as decode rounds it."""
        codec, count = run.codec, codes.shape[1]
        heads, _, _, n, dim = codes.shape
        signed = (codes ^ 128).view(torch.int8)
        key_scale = self._joined(parts, ("keys.scale",))  # [Hkv, L groups, d]
        group = codec.key_group
        if run.whole_groups:  # every chunk a whole number of key groups: the scales broadcast
            key_scale = key_scale.view(heads, count, n // group, 1, dim)
            key_codes = signed[:, :, 0].view(heads, count, n // group, group, dim)
        else:
            rows = run.layer_rows.get(count)
            if rows is None:
                shift = torch.arange(count, device=self.device)[:, None] * run.groups
                rows = run.layer_rows[count] = (run.key_rows[None, :] + shift).view(-1)
            key_scale = key_scale.index_select(1, rows).view(heads, count, n, dim)
            key_codes = signed[:, :, 0]
        value_scale = self._joined(parts, ("values.scale",))  # [Hkv, L n, d / group]
        # (into ``dst`` directly: the product is formed in float16 as decode rounds it, then converted;
        # a device kernel may convert its float product once instead, within a bit of the result)
        decoded = dst.transpose(0, 1)
        torch.mul(key_codes, key_scale, out=decoded[:, :, 0].view(key_codes.shape))
        grouped = (heads, count, n, dim // codec.value_group, codec.value_group)
        scale = value_scale.view(*grouped[:-1], 1)
        torch.mul(signed[:, :, 1].view(grouped), scale, out=decoded[:, :, 1].view(grouped))

    def close(self) -> None:
        """Nothing to stop: layers are read when asked for."""
