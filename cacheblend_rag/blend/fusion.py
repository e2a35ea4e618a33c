"""What a fusion takes and gives: one prompt to fuse (:class:`FusionRequest`), how it is fused
(:class:`FusionPath`, chosen once per request: :class:`FusionRoute`) and the fused cache with its costs
(:class:`FusionResult`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import torch

from ..models.attention import AttentionMask
from ..models.runtime import KVCache
from .context import SharedContext
from .methods import RecomputeMethod
from .plan import FusionPlan
from .segments import LayerKVProvider, Segment
from .static_layout import StaticSelection


class FusionPath(StrEnum):
    """How a fusion runs: the static steps (queued without reading back; ``GRAPHS``: replayed as a CUDA
    graph per size bucket) or the module-by-module layer passes."""

    STATIC = "static"
    GRAPHS = "graphs"
    LAYERS = "layers"


# Called at every layer with (layer, query positions, q [1, H, S, d], keys [1, Hkv, T, d], mask): lets
# diagnostics look at attention without a second code path.
AttentionObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask], None]


@dataclass(frozen=True)
class RoundShare:
    """A request's part in a round (:mod:`.round`): its chunks' KV came from one blend made for every
    request of the round, counted here apart from what the request computed itself."""

    requests: int  # requests that share the round's blend
    shared_tokens: int  # this prompt's tokens whose KV is the round's blend
    round_recomputed_tokens: int  # cached tokens the round recomputed, once for all its requests
    recompute_ratio: float  # the round's share of its cached tokens recomputed
    seconds: float  # the round's probe and blend (paid once, before any of its requests)


class PendingKV(Protocol):
    """Part of a prompt's KV not yet in its fusion's buffer (a round's chunks, kept once in the round's
    cache): written, when needed, into whatever holds the prompt's KV."""

    spans: list[tuple[int, int]]  # the prompt positions it writes

    def write(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], row: int) -> None:
        """Write them into row ``row`` of per-layer buffers [rows, Hkv, capacity, d]."""
        ...


@dataclass
class FusionResult:
    """The fused cache (positions 0..T-1 filled), next-token logits and what it cost."""

    buffer: KVCache  # the prompt's KV as the fusion wrote it; read it as ``cache``
    logits: torch.Tensor  # [vocab] float32, for the token after the prompt
    plan: FusionPlan
    selected: torch.Tensor  # positions recomputed at the last layer
    qkv_tokens_per_layer: list[int] = field(default_factory=list)
    attended_tokens_per_layer: list[int] = field(default_factory=list)
    seconds: float = 0.0
    load_wait_s: float = 0.0
    probe_token_layers: int = 0  # fresh-text token-layers of the query probe (0 when none ran)
    # set when the prompt's chunks came blended from a round shared with other requests (blend/round.py)
    round: RoundShare | None = None
    # positions of ``buffer`` still to be written (blend/round_members.py); ``cache`` writes them first
    pending: PendingKV | None = None
    # a round member's prompt as it lies in the round's cache, which its decoding may read in place
    # instead of a copy of it (blend/context.py)
    context: SharedContext | None = None
    path: FusionPath = FusionPath.LAYERS  # how it was fused

    @property
    def cache(self) -> KVCache:
        """The prompt's KV, positions 0..T-1 (a pending part written into the buffer first)."""
        if self.pending is not None:
            self.pending.write(self.buffer.keys, self.buffer.values, 0)
            self.pending = None
        return self.buffer

    def write_into(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], row: int) -> None:
        """Copy the prompt's KV (positions 0..T-1) into row ``row`` of per-layer buffers [rows, Hkv,
        capacity, d] (a decode batch); a pending part goes there straight from where it is kept."""
        n = self.num_tokens
        spans = [(0, n)]
        if self.pending is not None:
            spans, start = [], 0
            for s, e in sorted(self.pending.spans):
                if s > start:
                    spans.append((start, s))
                start = e
            if start < n:
                spans.append((start, n))
        for layer in range(len(keys)):
            for s, e in spans:
                keys[layer][row, :, s:e] = self.buffer.keys[layer][0, :, s:e]
                values[layer][row, :, s:e] = self.buffer.values[layer][0, :, s:e]
        if self.pending is not None:
            self.pending.write(keys, values, row)

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def reused_tokens(self) -> int:
        """Cached-chunk tokens whose KV was kept at the last layer."""
        recomputed = torch.zeros(self.plan.num_tokens, dtype=torch.bool)
        recomputed[self.selected] = True
        return int((self.plan.cached_mask & ~recomputed).sum())

    @property
    def computed_tokens(self) -> int:
        return self.plan.num_tokens - self.reused_tokens

    @property
    def kept_per_segment(self) -> tuple[int, ...]:
        """Per segment, its tokens whose cached KV was kept at the last layer (0 for fresh text)."""
        kept = self.plan.cached_mask.clone()
        kept[self.selected] = False
        return tuple(int(kept[s:e].sum()) for s, e in self.plan.spans)

    @property
    def recompute_ratio(self) -> float:
        """Share of the cached tokens that are worth recomputing (not exact) recomputed at the last layer."""
        blended = self.plan.cached_mask & ~self.plan.exact_mask
        total = int(blended.sum())
        if total == 0:
            # every chunk came blended from a round: the round's share is the one that was applied
            return self.round.recompute_ratio if self.round is not None else 1.0
        return float(blended[self.selected].sum()) / total

    @property
    def compute_fraction(self) -> float:
        """Attention+MLP token-layers done (the query probe's included), relative to a full prefill of
        the same prompt (which, like a fusion, attends only the last token at the last layer)."""
        attended = self.attended_tokens_per_layer
        n = self.plan.num_tokens
        full = n * (len(attended) - 1) + (1 if attended and attended[-1] == 1 else n)
        return (sum(attended) + self.probe_token_layers) / full


@dataclass
class FusionRequest:
    """One prompt to fuse: its segments, the method, where its cached layers come from (default: direct
    reads), decode room to leave in its cache and an optional attention observer."""

    segments: list[Segment]
    method: RecomputeMethod
    kv_provider: LayerKVProvider | None = None
    extra_capacity: int = 0
    observer: AttentionObserver | None = None
    # the question's attention per prompt position ([T] attention, [T] contribution), found elsewhere
    # (a round scores its chunks for all its requests at once): no probe runs, the method gets these
    query_scores: tuple[torch.Tensor, torch.Tensor] | None = None
    # fresh tokens the query probe reads after the prompt, never fused (a round's questions, blend/round.py)
    probe_suffix: tuple[int, ...] = ()
    # False where no one reads the next token's logits (a round's blend: its members compute their own):
    # the last token is then not computed for them (FusionPlan.from_segments), and the result's logits
    # are empty
    logits: bool = True


@dataclass(frozen=True)
class FusionRoute:
    """One request's way through the fusor, decided once on the host (:meth:`Fusor.route`): its plan,
    built once, the path, and for the static steps the method's selection, built once too."""

    request: FusionRequest
    plan: FusionPlan
    path: FusionPath
    selection: StaticSelection | None = None

    @property
    def static(self) -> bool:
        return self.path is not FusionPath.LAYERS
