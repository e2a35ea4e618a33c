"""The accelerator check's prompts: random ids in a real model's shape with their chunk KV precomputed,
and that KV placed where each tier keeps it (device memory, pinned host RAM, int8 parts)."""

from __future__ import annotations

import torch

from ...blend import Segment
from ...blend.segments import ChunkContext, ChunkKV, prefill_chunk_kv, prefill_context
from ...models.runtime import LayerwiseModel
from ...store.codec import CODECS
from ...store.fileformat import EncodedChunk


def prompt_segments(
    model: LayerwiseModel, chunks: int, tokens: int, kv_dtype: torch.dtype, generator: torch.Generator
) -> tuple[list[Segment], list[int]]:
    """A RAG prompt: 24 fresh head tokens, ``chunks`` cached chunks of ``tokens`` random ids (KV precomputed
    behind a 16-token chunk context, stored in ``kv_dtype``), 32 fresh question tokens."""
    vocab = model.shape.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    context = ChunkContext(tuple(ids(16)))
    context_cache = prefill_context(model, context)
    head, question = ids(24), ids(32)
    segments = [Segment.fresh(head)]
    for _ in range(chunks):
        chunk = ids(tokens)
        kv = prefill_chunk_kv(model, chunk, context, context_cache).to(kv_dtype)
        segments.append(Segment.cached(chunk, kv))
    segments.append(Segment.fresh(question))
    return segments, [t for s in segments for t in s.token_ids]


def on_host(kv: ChunkKV) -> ChunkKV:
    """The same chunk KV in pinned host RAM (what a GPU reads from the RAM tier)."""
    return ChunkKV(
        [k.cpu().pin_memory() for k in kv.keys], [v.cpu().pin_memory() for v in kv.values], kv.fingerprint
    )


def int8_chunk(kv: ChunkKV, device: torch.device, on_device: bool) -> EncodedChunk:
    """The same chunk KV in the default codec (int8), as the RAM tier keeps it: its parts in device memory
    (``on_device``) or in pinned host RAM, decoded on the device one joined layer at a time."""
    codec = CODECS["int8"].for_head_dim(kv.keys[0].shape[-1])

    def placed(t: torch.Tensor) -> torch.Tensor:
        if on_device:
            return t.to(device)
        return t.pin_memory() if device.type == "cuda" else t

    layers = [
        {n: placed(t) for n, t in codec.encode(k, v).items()} for k, v in zip(kv.keys, kv.values, strict=True)
    ]
    return EncodedChunk(codec, layers, kv.fingerprint, kv.num_tokens, {})


def tier_segments(segments: list[Segment], tier: str, device: torch.device) -> list[Segment]:
    """``segments`` with their chunk KV where ``tier`` keeps it: ``hbm`` (device memory, as computed),
    ``host`` (pinned RAM), ``int8_hbm`` / ``int8_host`` / ``int8_ram`` (int8 parts there)."""
    if tier in ("hbm", "ram"):
        return segments
    moved = []
    for s in segments:
        if s.kv is None:
            moved.append(s)
        elif tier == "host":
            moved.append(Segment.cached(s.token_ids, on_host(s.kv)))
        else:
            moved.append(Segment.cached(s.token_ids, int8_chunk(s.kv, device, tier == "int8_hbm")))
    return moved
