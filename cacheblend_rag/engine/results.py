"""What an answer reports: the fusion's costs (:class:`FusionStats`), where its prompt's KV came from
(:class:`PromptAccounting`), how it was served (:class:`ServedAs`), what scoring its fidelity reads
(:class:`FusionDiagnostics`) and the answer itself (:class:`GenerationResult`): one set of types for both
engines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Self

import torch

from ..blend.budget_choice import BudgetChoice
from ..blend.fusor import FusionResult
from ..blend.segments import Segment
from ..records import plain
from .request import AdmittedRequest


@dataclass(frozen=True)
class FusionStats:
    """What fusing a prompt cost, as results report it. ``kept_per_segment``: per segment, the tokens
    whose cached KV was kept (empty when the fusion is not known per segment). ``blended``: whether the
    request's method fused it (False where it was prefilled instead, as vLLM does with a request its
    worker could not blend: then no budget of the method chose what was computed)."""

    reused_tokens: int
    computed_tokens: int
    recompute_ratio: float
    load_wait_s: float = 0.0
    kept_per_segment: tuple[int, ...] = ()
    round_requests: int = 0
    round_shared_tokens: int = 0
    round_recomputed_tokens: int = 0
    blended: bool = True
    path: str = "layers"  # how it was fused: "static", "graphs", "layers" (the fusor's), or "vllm"
    seconds: float = 0.0  # the fusion's own time (loading, probe, recompute)

    @classmethod
    def of(cls, fusion: FusionResult) -> FusionStats:
        share = fusion.round
        # a round member's chunks come blended from the round, whose recomputed tokens are recomputed for
        # this request too (once for all members): counted as computed, never as kept or read from cache,
        # so a request reports the same counts in a round as alone
        shared = share.round_recomputed_tokens if share else 0
        return cls(
            fusion.reused_tokens - shared,
            fusion.computed_tokens + shared,
            fusion.recompute_ratio,
            fusion.load_wait_s,
            fusion.kept_per_segment,
            share.requests if share else 0,
            share.shared_tokens if share else 0,
            share.round_recomputed_tokens if share else 0,
            path=str(fusion.path),
            seconds=fusion.seconds,
        )


@dataclass(frozen=True)
class CacheAccounting:
    """Where a prompt's KV came from (docs/accounting.md): read from a cache tier (exact-prefix hits and
    blended chunks, apart), and chunk KV no tier held, computed for this request. Recomputed tokens are
    the result's ``computed_tokens``."""

    read_exact_tokens: int = 0
    read_blended_tokens: int = 0
    kv_computed_tokens: int = 0

    @classmethod
    def of(cls, segments: Sequence[Segment], fusion: FusionStats) -> CacheAccounting:
        """From the segments (which say whose KV was computed for this request) and what the fusion kept
        of each; without per-segment counts, the reused tokens count as exact reads (a prefix cache's)."""
        computed = sum(len(s) for s in segments if s.is_cached and s.computed)
        if len(fusion.kept_per_segment) != len(segments):
            return cls(read_exact_tokens=fusion.reused_tokens, kv_computed_tokens=computed)
        exact = blended = 0
        for segment, kept in zip(segments, fusion.kept_per_segment, strict=True):
            if not segment.is_cached or segment.computed:
                continue
            if segment.exact:
                exact += kept
            else:
                blended += kept
        # a round recomputed some of the chunks' tokens for every member: not read and kept (FusionStats.of)
        return cls(exact, max(0, blended - fusion.round_recomputed_tokens), computed)


# the metadata of a result field that :meth:`PromptAccounting.to_dict` leaves out (not plain data)
NOT_JSON = {"not_json": True}


@dataclass(kw_only=True)
class PromptAccounting:
    """Where a prompt's KV came from (docs/accounting.md) and what a round shared (docs/rounds.md); the
    same fields on every result that reports an answer."""

    cache_read_exact_tokens: int = 0  # exact-prefix KV read from a cache (kept whole)
    cache_read_blended_tokens: int = 0  # chunk KV read from a cache tier and kept by the blend
    kv_computed_tokens: int = 0  # chunk KV no tier held, computed for this request (then stored)
    # A round (several requests reading the same chunks blended once for all of them): how many requests
    # shared it, this prompt's tokens whose KV came from its blend (counted in reused_tokens too), and
    # the cached tokens the round recomputed once for all of them (in no request's computed_tokens).
    round_requests: int = 0
    round_shared_tokens: int = 0
    round_recomputed_tokens: int = 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was read from a cache and kept (what OpenAI's ``cached_tokens`` and
        LangChain's ``cache_read`` report): never KV computed for this request."""
        return self.cache_read_exact_tokens + self.cache_read_blended_tokens

    def accounting(self) -> dict[str, int]:
        """These fields by name (to carry them to another result type)."""
        return {f.name: getattr(self, f.name) for f in fields(PromptAccounting)}

    def to_dict(self) -> dict[str, Any]:
        """The result's fields as plain JSON values (records as their objects) and ``cached_tokens``;
        a field whose metadata says ``NOT_JSON`` is left out."""
        out = {f.name: plain(getattr(self, f.name)) for f in fields(self) if not f.metadata.get("not_json")}
        return {**out, "cached_tokens": self.cached_tokens}


@dataclass(kw_only=True)
class ServedAs:
    """How an answer was served, on every result that reports one (docs/accounting.md): the fusion's path
    and where its ``ttft_s`` went. ``ttft_s`` counts from the caller's call; these are its parts before
    the first token: retrieving chunks, laying the prompt out (reading its chunks' KV and computing what
    no tier held), waiting for the scheduler, and the fusion."""

    fusion_path: str = "layers"  # "static", "graphs" or "layers" (the PyTorch engine's fusor), "vllm"
    retrieval_s: float = 0.0
    prompt_s: float = 0.0
    queue_s: float = 0.0
    fusion_s: float = 0.0

    def served(self) -> dict[str, Any]:
        """These fields by name (to carry them to another result type)."""
        return {f.name: getattr(self, f.name) for f in fields(ServedAs)}


@dataclass(frozen=True)
class FusionDiagnostics:
    """What scoring an answer's fidelity reads of its prompt's fusion (eval, ``check``), filled when the
    request's :class:`SamplingParams` asked for ``diagnostics``. Every engine fills the first token's
    distribution; a field an engine cannot know is None (the vLLM engine scores no continuation)."""

    first_token_logprobs: torch.Tensor  # float32 [vocab]: log-softmax of the first token's logits
    recomputed_positions: tuple[int, ...] | None  # prompt positions recomputed at the last layer, ascending
    compute_fraction: float | None  # the fusion's matmul token-layers over a full prefill's
    fusion_s: float | None  # seconds the fusion took (loading, recompute and the probe)
    # per SamplingParams.score_continuations: mean NLL per token of the sequence after the prompt
    continuation_nll: tuple[float | None, ...] = ()
    answer_nll: float | None = None  # mean NLL per token of the answer itself, from the logits that chose it


def fusion_figures(fusion: FusionResult) -> dict[str, Any]:
    """The :class:`FusionDiagnostics` fields a fusion gives (the engines' one source for them): the
    positions recomputed at the last layer (ascending), its compute fraction and its seconds."""
    return {
        "recomputed_positions": tuple(sorted(int(p) for p in fusion.selected.tolist())),
        "compute_fraction": float(fusion.compute_fraction),
        "fusion_s": float(fusion.seconds),
    }


@dataclass
class GenerationResult(PromptAccounting, ServedAs):
    """One answer and what producing it cost."""

    text: str
    token_ids: list[int]
    method: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    ttft_s: float
    total_s: float
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    recompute_ratio: float
    chunk_ids: list[str] = field(default_factory=list)
    method_options: dict = field(default_factory=dict)
    load_wait_s: float = 0.0
    controller: dict | None = None  # the loading controller's decision, when it chose the ratio
    # what the method chose for this request from its chunks (an adaptive budget's choice), else None
    budget: BudgetChoice | None = None
    # when the sampling params asked for them; not in to_dict (it holds a tensor)
    diagnostics: FusionDiagnostics | None = field(default=None, metadata=NOT_JSON)

    @classmethod
    def build(
        cls,
        *,
        text: str,
        token_ids: Sequence[int],
        finish_reason: str,
        admitted: AdmittedRequest,
        fusion: FusionStats,
        first_token_at: float | None,
        finished_at: float,
        queue_s: float = 0.0,
        **extra: Any,
    ) -> Self:
        """The result of answering ``admitted``; times count from its request's arrival (the caller's
        call), ``first_token_at`` and ``finished_at`` being ``time.perf_counter()`` values. ``extra``
        fills a subclass's fields."""
        request, resolved, segments = admitted.request, admitted.resolved, admitted.request.segments
        accounting = CacheAccounting.of(segments, fusion)
        arrived = request.arrived_at
        return cls(
            text=text,
            token_ids=list(token_ids),
            method=resolved.method.name,
            finish_reason=finish_reason,
            ttft_s=(finished_at if first_token_at is None else first_token_at) - arrived,
            total_s=finished_at - arrived,
            fusion_path=fusion.path,
            retrieval_s=request.edge.retrieval_s,
            prompt_s=request.edge.prompt_s,
            queue_s=queue_s,
            fusion_s=fusion.seconds,
            prompt_tokens=sum(len(s) for s in segments),
            reused_tokens=fusion.reused_tokens,
            computed_tokens=fusion.computed_tokens,
            recompute_ratio=fusion.recompute_ratio,
            chunk_ids=[s.chunk_id for s in segments if s.chunk_id],
            method_options=resolved.method.describe(),
            load_wait_s=fusion.load_wait_s,
            controller=resolved.controller,
            budget=(
                resolved.method.request_choice([len(s) for s in segments if s.is_cached and not s.exact])
                if fusion.blended
                else None
            ),
            cache_read_exact_tokens=accounting.read_exact_tokens,
            cache_read_blended_tokens=accounting.read_blended_tokens,
            kv_computed_tokens=accounting.kv_computed_tokens,
            round_requests=fusion.round_requests,
            round_shared_tokens=fusion.round_shared_tokens,
            round_recomputed_tokens=fusion.round_recomputed_tokens,
            **extra,
        )
