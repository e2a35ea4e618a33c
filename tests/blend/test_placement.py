"""Placing cached chunk KV: chunk by chunk (the CPU's way) and all chunks of a layer at once (an
accelerator's) write the same cache, keys re-rotated to where each chunk lands."""

from __future__ import annotations

import itertools

import pytest
import torch

from cacheblend_rag.blend.placement import CachedPlacement
from cacheblend_rag.models.rope import Rope
from cacheblend_rag.models.runtime import KVCache, ModelShape

HEADS, DIM, LAYERS = 2, 16, 2


@pytest.mark.parametrize(
    "spans",
    [[(0, 5), (5, 12), (12, 20)], [(3, 9), (11, 20), (20, 24)], [(4, 30)]],
    ids=["back-to-back-from-0", "apart", "one"],
)
def test_chunk_by_chunk_and_batched_placing_write_the_same_rotated_cache(spans):
    generator = torch.Generator().manual_seed(0)
    rope = Rope(1.0 / (10000 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)))
    shape = ModelShape("llama", LAYERS, 32, 4, HEADS, DIM, 100, 64)
    layers = [
        [
            (
                torch.randn(HEADS, end - start, DIM, generator=generator).half(),
                torch.randn(HEADS, end - start, DIM, generator=generator).half(),
            )
            for start, end in spans
        ]
        for _ in range(LAYERS)
    ]
    caches = []
    for batched in (False, True):
        placement = CachedPlacement.for_spans(rope, spans, torch.device("cpu"), batched=batched)
        assert (placement.index is None) == all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        cache = KVCache.empty(shape, 32)
        for layer in range(LAYERS):
            placement.place(cache, layer, layers[layer])
        caches.append(cache)
    by_chunk, batched = caches
    for layer in range(LAYERS):
        assert torch.equal(by_chunk.keys[layer], batched.keys[layer])
        assert torch.equal(by_chunk.values[layer], batched.values[layer])
        for (k, v), (start, end) in zip(layers[layer], spans, strict=True):
            local = torch.arange(end - start)
            want = rope.rerotate(k.float(), local, local + start)
            assert (batched.keys[layer][0, :, start:end] - want).abs().max().item() <= 1e-5
            assert torch.equal(batched.values[layer][0, :, start:end], v.float())
    # positions outside every span are left as they were (zeros here)
    covered = torch.zeros(32, dtype=torch.bool)
    for start, end in spans:
        covered[start:end] = True
    assert not batched.keys[0][0][:, ~covered].any() and not batched.values[0][0][:, ~covered].any()
