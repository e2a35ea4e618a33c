"""Layer-wise pipelined loading of a request's chunk KV.

While the fusor computes layer i, a background thread reads layer i+1 of every chunk from its tier and
converts it to the compute dtype and device, so that loading hides behind recompute (where a thread pays:
:func:`worth_prefetching`; otherwise each layer is read when asked for). The loader records
how long each layer took to load and how long the caller waited for it: the part of the load time the
caller did not wait for is the part the pipeline hid.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..blend.segments import ChunkKVSource
from .tier import tier_of

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoadTimings:
    """Per-request totals: seconds spent loading layers, seconds the caller waited for them."""

    load_s: float
    wait_s: float
    layers: int

    @property
    def hidden_fraction(self) -> float:
        """Fraction of the load time the caller did not wait for (0 without prefetch)."""
        if self.load_s <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.wait_s / self.load_s))

    def as_dict(self) -> dict[str, float]:
        return {
            "load_s": self.load_s,
            "wait_s": self.wait_s,
            "layers": self.layers,
            "hidden_fraction": self.hidden_fraction,
        }


def spare_cores() -> int:
    """CPU cores this process may use beyond the compute's own intra-op threads."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, usable - torch.get_num_threads())


def worth_prefetching(
    sources: Sequence[ChunkKVSource], device: torch.device | str, spare: int | None = None
) -> bool:
    """Whether a loader of ``sources`` for ``device`` should prefetch in a thread of its own: when the
    layers cross to an accelerator, when one comes from the remote tier (the thread waits on the network,
    not on a core), or when one comes from disk and a core is left over beside the compute's threads
    (``spare``, default :func:`spare_cores`). On a CPU whose cores all compute, the thread's reading,
    checking and decoding only competes with the compute for them (and for the GIL between its operators):
    the default cacheblend at 6 x 512 tokens, 2 cores, int8 chunk KV on disk with the page cache dropped,
    took 1.04 s with the thread and 0.95 s without (0.89 s from the RAM tier; scripts/prefetch_ttft.py at
    929a489); the disk tier asks the kernel to read a chunk's file ahead instead
    (``store.disk.read_ahead``). KV already in RAM feeding a CPU device is decoded faster than a thread
    hands it over."""
    if torch.device(device).type != "cpu":
        return True
    tiers = {tier_of(source) for source in sources}
    if "remote" in tiers:
        return True
    return "disk" in tiers and (spare_cores() if spare is None else spare) > 0


class PipelinedLayerLoader:
    """Serves ``layer(i)`` -> [(K, V) per source] in ``dtype`` on ``device``, prefetching ahead.

    With ``prefetch`` a background thread stays up to ``depth`` layers ahead of the last layer asked for
    (it starts on layer 0 at construction). Without it each layer is read when asked for (the baseline of
    the pipelining benchmark). Errors raised while loading a layer (e.g. CorruptKVError) are raised by the
    ``layer`` call that asks for it. Call :meth:`close` (or use ``with``) when the request is done.
    When a source already holds ``dtype`` on ``device`` its tensors are served as they are (no copy):
    callers must not modify them in place.
    """

    def __init__(
        self,
        sources: Sequence[ChunkKVSource],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        prefetch: bool = True,
        depth: int = 1,
    ) -> None:
        if depth < 1:
            raise ValueError("prefetch depth must be >= 1")
        self.sources = list(sources)
        layer_counts = {source.num_layers for source in self.sources}
        if len(layer_counts) > 1:
            raise ValueError(f"sources disagree on the number of layers: {sorted(layer_counts)}")
        self.num_layers = layer_counts.pop() if layer_counts else 0
        self.dtype = dtype
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.depth = depth
        self.load_seconds = [0.0] * self.num_layers
        self.wait_seconds = [0.0] * self.num_layers
        self._ready: dict[int, LayerKV | BaseException] = {}
        self._asked = -1  # highest layer the caller has asked for
        self._next = 0  # next layer the prefetch thread will load
        self._closed = False
        self._cond = threading.Condition()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and prefetch else None
        self._events: dict[int, torch.cuda.Event] = {}
        self._thread: threading.Thread | None = None
        if prefetch and self.num_layers and self.sources:
            self._thread = threading.Thread(target=self._run, name="kv-prefetch", daemon=True)
            self._thread.start()

    def layer(self, layer: int) -> LayerKV:
        if not self.sources:
            return []
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layers")
        if self._closed:
            raise RuntimeError("layer() on a closed loader")
        if self._thread is None:
            return self._load_now(layer)
        start = time.perf_counter()
        with self._cond:
            already_served = layer not in self._ready and layer < self._next
            if not already_served:
                self._asked = max(self._asked, layer)
                self._cond.notify_all()
                while layer not in self._ready:
                    if self._closed:
                        raise RuntimeError("loader closed while a layer was awaited")
                    self._cond.wait()
                result = self._ready.pop(layer)
                event = self._events.pop(layer, None)
        if already_served:  # asked for again: the prefetched copy is gone, read it directly
            return self._load_now(layer)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            if not isinstance(result, BaseException):
                for k, v in result:  # memory allocated on the loader's stream is used on this one
                    k.record_stream(current)
                    v.record_stream(current)
        self.wait_seconds[layer] += time.perf_counter() - start
        if isinstance(result, BaseException):
            raise result
        return result

    def _load_now(self, layer: int) -> LayerKV:
        start = time.perf_counter()
        try:
            return self._convert(layer)
        finally:
            elapsed = time.perf_counter() - start
            self.load_seconds[layer] += elapsed
            self.wait_seconds[layer] += elapsed

    def _convert(self, layer: int) -> LayerKV:
        out = []
        for source in self.sources:
            k, v = source.layer(layer)
            if self._stream is not None:
                k, v = k.pin_memory(), v.pin_memory()
            out.append(
                (
                    k.to(self.device, self.dtype, non_blocking=self._stream is not None),
                    v.to(self.device, self.dtype, non_blocking=self._stream is not None),
                )
            )
        return out

    def _run(self) -> None:
        for layer in range(self.num_layers):
            with self._cond:
                while not self._closed and layer > self._asked + self.depth:
                    self._cond.wait()
                if self._closed:
                    return
            start = time.perf_counter()
            event = None
            try:
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        result: LayerKV | BaseException = self._convert(layer)
                        event = torch.cuda.Event()
                        event.record(self._stream)
                else:
                    result = self._convert(layer)
            except BaseException as exc:  # handed to the caller of layer(); the thread stops here
                result = exc
            self.load_seconds[layer] += time.perf_counter() - start
            with self._cond:
                self._ready[layer] = result
                if event is not None:
                    self._events[layer] = event
                self._next = layer + 1
                self._cond.notify_all()
            if isinstance(result, BaseException):
                with self._cond:  # later layers cannot be served: fail them with the same error
                    for later in range(layer + 1, self.num_layers):
                        self._ready[later] = result
                    self._next = self.num_layers
                    self._cond.notify_all()
                return

    def timings(self) -> LoadTimings:
        return LoadTimings(sum(self.load_seconds), sum(self.wait_seconds), self.num_layers)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> PipelinedLayerLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
