"""The per-request message from :class:`VLLMEngine` to the connector, carried as vLLM ``kv_transfer_params``.

It is small JSON: segment lengths, which segments are cached chunks, the method and its options, a
request key for the worker's accounting, and whether the request asked for diagnostics (then the worker
reports the positions it recomputed too). Token ids are not repeated: the connector reads them from the
request vLLM already holds, and chunk KV is found in the store by those ids. This module imports neither
vLLM nor torch, so both the engine and the connector (scheduler and worker processes) share it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PARAMS_KEY = "cacheblend"
PARAMS_VERSION = 1


@dataclass(frozen=True)
class BlendRequest:
    """How one prompt splits into segments, and how to fuse them."""

    request_key: str
    segment_lengths: tuple[int, ...]
    cached: tuple[bool, ...]
    method: str
    method_options: dict[str, Any] = field(default_factory=dict)
    # report the fusion's recomputed positions (SamplingParams.diagnostics); changes no KV, so no salt
    diagnostics: bool = False

    def __post_init__(self) -> None:
        if not self.segment_lengths or len(self.segment_lengths) != len(self.cached):
            raise ValueError("a blend request needs one cached flag per segment, and at least one segment")
        if any(n < 1 for n in self.segment_lengths):
            raise ValueError("every segment of a blend request must hold at least one token")

    @property
    def num_tokens(self) -> int:
        return sum(self.segment_lengths)

    @property
    def claim_end(self) -> int:
        """End of the span whose KV the connector provides: every prompt token but the last, which vLLM
        must compute to produce the first output token. The fusor computes the fresh text after the last
        chunk (the question) anyway, with exact attention over the fused KV, so vLLM computes none of it
        again. 0 when no cached chunk comes before the last token (nothing to blend)."""
        end = self.num_tokens - 1
        start = 0
        for length, is_cached in zip(self.segment_lengths, self.cached, strict=True):
            if is_cached and start < end:
                return end
            start += length
        return 0

    def split(self, token_ids: Sequence[int]) -> list[tuple[list[int], bool]]:
        """The prompt's token ids cut into (segment ids, cached) pairs."""
        if len(token_ids) != self.num_tokens:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, the blend request describes {self.num_tokens}"
            )
        pieces, start = [], 0
        for length, is_cached in zip(self.segment_lengths, self.cached, strict=True):
            pieces.append((list(token_ids[start : start + length]), is_cached))
            start += length
        return pieces

    def cache_salt(self, token_ids: Sequence[int]) -> str:
        """Salt for vLLM's prefix cache: blended KV is approximate, so it may only be reused by a request
        with the same tokens, segmentation and method (which would blend to the same KV), never by an
        exact prefill of the same tokens."""
        layout = json.dumps(
            [self.segment_lengths, self.cached, self.method, self.method_options, list(token_ids)],
            sort_keys=True,
            separators=(",", ":"),
        )
        return "cacheblend-" + hashlib.sha256(layout.encode()).hexdigest()[:32]

    def to_params(self) -> dict[str, Any]:
        return {
            PARAMS_KEY: {
                "version": PARAMS_VERSION,
                "request_key": self.request_key,
                "segment_lengths": list(self.segment_lengths),
                "cached": [int(c) for c in self.cached],
                "method": self.method,
                "method_options": self.method_options,
                "diagnostics": int(self.diagnostics),
            }
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> BlendRequest | None:
        """The blend request in a request's ``kv_transfer_params``; None when it carries none.
        Raises ValueError when one is present but malformed."""
        if not params or PARAMS_KEY not in params:
            return None
        body = params[PARAMS_KEY]
        try:
            if body["version"] != PARAMS_VERSION:
                raise ValueError(
                    f"blend request version {body['version']} (this build reads {PARAMS_VERSION})"
                )
            return cls(
                request_key=str(body["request_key"]),
                segment_lengths=tuple(int(n) for n in body["segment_lengths"]),
                cached=tuple(bool(c) for c in body["cached"]),
                method=str(body["method"]),
                method_options=dict(body.get("method_options") or {}),
                diagnostics=bool(body.get("diagnostics", 0)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed blend request in kv_transfer_params: {exc!r}") from exc
