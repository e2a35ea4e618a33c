"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling with an optional seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import DEFAULT_MAX_TOKENS

if TYPE_CHECKING:
    from .constraints import JsonConstraint


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. ``temperature == 0`` is greedy; ``stop`` strings end generation (excluded);
    ``constraint`` (a :class:`~cacheblend_rag.engine.constraints.JsonConstraint`) makes the output JSON.
    ``strict``: ``max_tokens`` was asked for outright (an API's ``max_tokens``), so a
    prompt that leaves less room is refused (:class:`~cacheblend_rag.errors.MaxTokensError`) rather than
    the answer cut at the context's end."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    constraint: JsonConstraint | None = None
    strict: bool = False
    # Scoring fidelity (eval, ``check``): ``diagnostics`` fills the result's :class:`~.base.FusionDiagnostics`
    # (the first token's whole distribution, the positions recomputed); ``score_continuations`` are token
    # sequences whose teacher-forced NLL after the prompt it also reports, where the engine can score them.
    diagnostics: bool = False
    score_continuations: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.score_continuations and not self.diagnostics:
            raise ValueError("score_continuations needs diagnostics=True: their NLL is reported there")
        if self.constraint is not None:
            from .constraints import JsonConstraint  # llguidance loads only when a constraint is used

            if not isinstance(self.constraint, JsonConstraint):
                raise TypeError(f"constraint must be a JsonConstraint, got {type(self.constraint).__name__}")


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token id from float32 ``logits`` [vocab]."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p
        keep[0] = True  # the top token always (a top_p that rounds to 0 in float32 would keep none)
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0 or params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed)
