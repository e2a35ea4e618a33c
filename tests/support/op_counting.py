"""Counting a fusion's device operations per layer, and what would make the host wait for the device (the
static fusion's tests: tests/blend/test_static_fusion.py, tests/engine/test_static_engine.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DATA = Path(__file__).parents[1] / "data" / "musique_24.json"

# operations that wait for the device's answer, or whose output size does
SYNCING = {
    "aten._local_scalar_dense.default",
    "aten.item.default",
    "aten.nonzero.default",
    "aten.bincount.default",
    "aten.masked_select.default",
    "aten.equal.default",
    "aten.is_nonzero.default",
    "aten.unique_consecutive.default",
    "aten._unique2.default",
    "aten.repeat_interleave.Tensor",
}


class LayerOps(TorchDispatchMode):
    """Counts the kernel operations (views aside) between the fusion's layer marks, and records any
    operation that reads back to the host while a fusion's layers run."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: list[tuple[int, Counter]] = [(-2, Counter())]
        self.inside = False
        self.syncs: list[str] = []

    def mark(self, layer: int) -> None:
        self.inside = layer >= 0
        self.segments.append((layer, Counter()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if self.inside:
            boolean_index = name.startswith("aten.index") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for a in args
                if isinstance(a, (list, tuple))
                for i in a
            )
            if name in SYNCING or boolean_index:
                self.syncs.append(name)
        if not func.is_view:
            self.segments[-1][1][name] += 1
        return func(*args, **kwargs)

    def per_layer(self) -> list[int]:
        """Operation counts of the marked layers, in the order they ran (probe layers first)."""
        return [sum(ops.values()) for layer, ops in self.segments if layer >= 0]

    def total(self) -> int:
        return sum(sum(ops.values()) for _, ops in self.segments)


def text_ids(model) -> list[int]:
    cases = json.loads(DATA.read_text())
    text = "\n".join(ctx["title"] + ". " + ctx["text"] for case in cases[:6] for ctx in case["ctxs"])
    return model.tokenizer(text, add_special_tokens=False)["input_ids"]
