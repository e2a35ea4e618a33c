"""What the batch scheduler keeps: each request it holds (:class:`QueuedRequest`: its handle, what
admitting it resolved, then its decode state) and its counters (:class:`SchedulerStats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..blend.fusor import FusionResult
from .decode import DecodeRow
from .handles import RequestHandle
from .request import AdmittedRequest


@dataclass
class SchedulerStats:
    """What a :class:`BatchScheduler` has done so far."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0  # requests cancelled before they finished
    groups: int = 0  # admission groups; each reads a shared chunk once
    fusion_passes: int = 0  # fusions run: one per batch fused together, one per request otherwise
    decode_steps: int = 0
    decode_rows: int = 0  # rows summed over decode steps: decode_rows / decode_steps is the mean batch
    max_rows: int = 0  # most rows decoded in one step
    peak_kv_bytes: int = 0  # largest decode-batch KV buffer allocated

    @property
    def mean_batch(self) -> float:
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_batch": self.mean_batch}


@dataclass
class QueuedRequest:
    """A request in the scheduler: its handle and what admitting it resolved, then its decode state."""

    handle: RequestHandle
    admitted: AdmittedRequest
    row: DecodeRow | None = None  # its decode state, once fused
    slots: int = 0  # slots its row takes in the decode batch's buffer, once fused
    queue_s: float = 0.0  # from its submission to its group's fusion
    scored: FusionResult | None = None  # its fused prompt, kept to score continuations over

    @property
    def capacity(self) -> int:
        """KV slots the request's row needs: the prompt and every token it may still feed back."""
        return self.admitted.request.prompt_tokens + self.admitted.max_tokens

    @property
    def scoring_room(self) -> int:
        """Slots past the prompt that scoring its continuations writes (0 when it scores none)."""
        continuations = self.admitted.request.sampling.score_continuations
        return max((len(ids) for ids in continuations), default=0)
