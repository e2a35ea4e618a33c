"""Static fusions replayed as CUDA graphs: the host queues a whole fusion's compute as one launch.

A static fusion's compute (:meth:`~.static.StaticFusion.compute`) reads only tensors its fusion holds and
sizes fixed by the layout's buckets, and never reads back. So it is captured once per bucket key
(:meth:`~.static.StaticFusion.bucket_key`) into a CUDA graph over that first fusion's tensors (its
layout, its inputs, a cache of the bucket's size), and every later fusion of the same key copies its own
values into those tensors, places its chunks' KV into the captured cache and replays. The device then
runs the probe, the selection and every layer back to back while the host waits once, for the logits: the
per-kernel dispatch that leaves an accelerator idle (thousands of small launches per fusion) is paid once,
at capture.

The host's part of a replay is copies: each layer's chunks joined into a staging buffer of the bucket's
size (a request's chunk count and tiers vary within a bucket), the new prompt's tables copied in; the
re-rotation and placing of every layer's cached rows is the graph's first operation. Loading is not
overlapped with the compute here. The cache a fusion returns is copied out of
the captured one (one copy), since the next replay overwrites it.

``capture=False`` replays by running the compute again over the captured fusion's tensors (no graph):
the CPU's way to check that a replay reads nothing but what was copied in.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..models.runtime import KVCache, LayerwiseModel
from .static import StaticFusion, cache_views

log = logging.getLogger(__name__)

GRAPHS = "graphs"  # the Fusor's compile mode that replays static fusions as captured graphs


@dataclass
class _Captured:
    fusion: StaticFusion  # the fusion captured: its tensors are the graph's inputs
    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor | None  # the graph's outputs (None until a replay without a graph)
    rows: torch.Tensor | None
    storage: torch.Tensor  # [L, 2, 1, Hkv, Tb, d]: the captured cache, one tensor


class FusionGraphs:
    """Captured static fusions by bucket key, at most ``max_graphs`` (least recently used dropped)."""

    def __init__(self, model: LayerwiseModel, capture: bool | None = None, max_graphs: int = 16) -> None:
        self.model = model
        self.capture = torch.device(model.device).type == "cuda" if capture is None else capture
        self.max_graphs = max_graphs
        self._captured: OrderedDict[tuple, _Captured] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = 0  # graphs captured so far (each costs a warm-up and a capture)

    def __len__(self) -> int:
        return len(self._captured)

    def run(self, fusion: StaticFusion) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """Fuse ``fusion`` by replaying its bucket's graph (captured now if new): what
        :meth:`~.static.StaticFusion.run` returns."""
        key = fusion.bucket_key()
        captured = self._captured.get(key)
        if captured is None:
            captured = self._capture(fusion)
            self._captured[key] = captured
            while len(self._captured) > self.max_graphs:
                self._captured.popitem(last=False)
        else:
            self._captured.move_to_end(key)
            fusion.cache = cache_views(captured.storage)
            fusion.storage, fusion.staging = captured.storage, captured.fusion.staging
            fusion.prepare()
            fusion.stage()  # this fusion's chunks into the captured staging buffer
            _copy_inputs(captured.fusion, fusion)
        logits, rows = self._replay(captured)
        fusion.scores = captured.fusion.scores
        fusion._hook(-1)
        fusion.account()
        return logits[0].clone(), fusion.recomputed(rows), self._copy_out(captured.storage, fusion)

    def memory_bytes(self) -> int:
        """Device memory the captured caches and staging buffers hold (the graphs' own pool not counted)."""
        tensors = [t for c in self._captured.values() for t in (c.storage, c.fusion.staging)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _capture(self, fusion: StaticFusion) -> _Captured:
        model, layout = self.model, fusion.layout
        shape = model.shape
        storage = torch.zeros(
            (shape.num_layers, 2, 1, shape.num_kv_heads, layout.keys, shape.head_dim),
            dtype=model.dtype,
            device=model.device,
        )
        fusion.cache = cache_views(storage)
        fusion.storage = storage
        fusion.staging = torch.zeros(
            (shape.num_layers, shape.num_kv_heads, 2, layout.cached_index.numel(), shape.head_dim),
            dtype=model.dtype,
            device=model.device,
        )
        fusion.prepare()
        fusion.stage()
        fusion.provider = None  # the captured fusion loads nothing again: its chunks' KV is not kept
        captured = _Captured(fusion, None, None, None, storage)
        if not self.capture:
            return captured
        # A warm-up outside the capture (cuBLAS and the allocator set themselves up); the compute places
        # every cached row again from the staging buffer, so the replay starts from a clean cache. The
        # placing rotates the staged keys in place: the staged rows are put back for the first replay.
        staged = fusion.staging.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fusion.compute()
        torch.cuda.current_stream().wait_stream(stream)
        fusion.staging.copy_(staged)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            captured.logits, captured.rows = fusion.compute()
        captured.graph = graph
        self.captures += 1
        log.debug("captured a fusion graph for %s (%d held)", fusion.bucket_key(), len(self._captured) + 1)
        return captured

    def _replay(self, captured: _Captured) -> tuple[torch.Tensor, torch.Tensor]:
        if captured.graph is None:
            captured.logits, captured.rows = captured.fusion.compute()
        else:
            captured.graph.replay()
        return captured.logits, captured.rows

    def _copy_out(self, storage: torch.Tensor, fusion: StaticFusion) -> KVCache:
        """The fused cache as the caller keeps it: positions 0..T-1 copied out of the captured one, with
        room for ``extra_capacity`` more."""
        n = fusion.plan.num_tokens
        shape = list(storage.shape)
        shape[4] = max(n + fusion.extra_capacity, 1)
        out = storage.new_empty(shape)
        out[:, :, :, :, :n].copy_(storage[:, :, :, :, :n])
        out[:, :, :, :, n:].zero_()  # as a new cache is: a padded batch row may read past its length
        cache = cache_views(out)
        cache.length = n
        return cache


def _copy_inputs(target: StaticFusion, source: StaticFusion) -> None:
    """``source``'s tables and inputs into the captured ``target``'s tensors (same key: same shapes)."""
    for name in target.layout.tensor_fields():
        for dst, src in zip(
            _tensors(getattr(target.layout, name)), _tensors(getattr(source.layout, name)), strict=True
        ):
            dst.copy_(src)
    for name, dst in target.inputs.items():
        dst.copy_(source.inputs[name])


def _tensors(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


__all__ = ["GRAPHS", "FusionGraphs"]
