"""A fusion's cached layers served joined: chunks held in RAM decoded together, one layer at a time.

The pipelined loader (:mod:`.pipeline`) decodes and moves each chunk's layer on its own: a few operations
per chunk per layer, which an accelerator pays as launches and the host as dispatch. For the static fusion
(blend/static.py), whose own operations do not grow with the chunk count, every run of consecutive chunks
kept in the RAM tier in one codec (int8, or a float codec) is joined here part by part, moved to the device
once and decoded there once (:meth:`~.codec.Codec.decode_joined`): int8's four times smaller codes are
what crosses to the device. A chunk held decoded in memory (a template's exact head) is one run of its
own. The fusion places what each layer returns in order, as it would place one pair per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
            if run.codec is not None and run.codec.quantized:
                lengths = [source.num_tokens for source in run.sources]
                run.key_rows = run.codec.joined_key_rows(lengths).to(self.device, non_blocking=True)

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

    def close(self) -> None:
        """Nothing to stop: layers are read when asked for."""
