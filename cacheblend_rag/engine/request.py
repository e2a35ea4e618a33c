"""One request, typed once at the edge and passed unchanged down to the scheduler.

Every entry point (``CacheBlendRAG``, the prompt frontend and so the server and the integrations, the
CLI) builds a :class:`GenerationRequest`: what to fuse, the method parsed once, how to sample (one name
for the answer length: ``max_tokens``), when the caller's call began (the time to first token counts from
there) and what that call spent before submitting (:class:`EdgeTimings`). An engine admits it once
(:meth:`AdmittedRequest.of`): the method resolved (a ratio left open chosen by the loading controller)
and the answer length cut to the room the context leaves; the scheduler's entries and the vLLM engine's
requests are built from that, nowhere else.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..blend.controller import LoadingController
from ..blend.methods import RecomputeMethod
from ..blend.segments import Segment
from ..blend.spec import MethodSpec, ResolvedMethod, resolve_method
from ..config import DEFAULT_METHOD
from ..errors import ContextLengthError, FusionInputError, MaxTokensError
from .sampling import SamplingParams

Method = str | MethodSpec | RecomputeMethod

__all__ = ["AdmittedRequest", "EdgeTimings", "GenerationRequest", "Method", "generation_budget"]


@dataclass(frozen=True)
class EdgeTimings:
    """What a call spent before its request reached the engine (parts of its ``ttft_s``): retrieving
    chunks, and laying the prompt out (reading the chunks' KV, computing what no tier held)."""

    retrieval_s: float = 0.0
    prompt_s: float = 0.0


@dataclass(frozen=True)
class GenerationRequest:
    """One request: ``segments`` to fuse and answer from, ``method`` (a name or spec is parsed here, once;
    ``method_options`` fold into it), ``sampling`` and ``arrived_at``, the ``time.perf_counter()`` of the
    caller's call (default: now), from which the result's ``ttft_s`` and ``total_s`` count."""

    segments: list[Segment]
    method: MethodSpec | RecomputeMethod = field(default_factory=lambda: MethodSpec.parse(DEFAULT_METHOD))
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrived_at: float = field(default_factory=time.perf_counter)
    edge: EdgeTimings = field(default_factory=EdgeTimings)

    @classmethod
    def of(
        cls,
        segments: list[Segment],
        method: Method = DEFAULT_METHOD,
        sampling: SamplingParams | None = None,
        method_options: Mapping[str, Any] | None = None,
        arrived_at: float | None = None,
        edge: EdgeTimings | None = None,
    ) -> GenerationRequest:
        """A request from the usual arguments: ``method`` with ``method_options`` (None values count as
        not given) as one spec; bad names and options are refused here."""
        options = {key: value for key, value in (method_options or {}).items() if value is not None}
        return cls(
            list(segments),
            _spec(method, options),
            sampling or SamplingParams(),
            time.perf_counter() if arrived_at is None else arrived_at,
            edge or EdgeTimings(),
        )

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)


def _spec(method: Method, options: dict[str, Any]) -> MethodSpec | RecomputeMethod:
    if isinstance(method, RecomputeMethod):
        if options:
            resolve_method(method, [], None, options)  # refuses options beside a ready method, by name
        return method
    spec = method if isinstance(method, MethodSpec) else MethodSpec.parse(method)
    return spec.with_options(options)


@dataclass(frozen=True)
class AdmittedRequest:
    """A request an engine took: its method resolved and the answer length that fits (``max_tokens``)."""

    request: GenerationRequest
    resolved: ResolvedMethod
    max_tokens: int

    @classmethod
    def of(
        cls,
        request: GenerationRequest,
        controller: LoadingController | None,
        context: int,
        where: str = "the model's context",
    ) -> AdmittedRequest:
        """Resolve ``request``'s method (``controller`` chooses a ratio left open) and its answer length
        within ``context`` tokens (``where`` names that limit in errors). Bad input raises here."""
        resolved = resolve_method(request.method, request.segments, controller)
        max_tokens = generation_budget(request.prompt_tokens, request.sampling, context, where)
        return cls(request, resolved, max_tokens)


def generation_budget(prompt_tokens: int, sampling: SamplingParams, context: int, where: str) -> int:
    """How many tokens a prompt of ``prompt_tokens`` may generate within ``context`` tokens (``where``
    names that limit in the error raised when the prompt leaves no room): ``sampling.max_tokens``, cut
    to what fits, or with ``sampling.strict`` refused (:class:`MaxTokensError`) if more."""
    max_tokens = sampling.max_tokens
    if prompt_tokens == 0:
        raise FusionInputError("nothing to generate from: the prompt has no tokens")
    room = context - prompt_tokens
    if room < 1:
        raise ContextLengthError(
            f"prompt of {prompt_tokens} tokens leaves no room to generate within {where} of {context} tokens"
        )
    if sampling.strict and max_tokens > room:
        raise MaxTokensError(
            f"max_tokens {max_tokens} does not fit: the prompt's {prompt_tokens} tokens leave {room} of "
            f"{where} of {context} tokens; ask for at most {room}"
        )
    return min(max_tokens, room)
