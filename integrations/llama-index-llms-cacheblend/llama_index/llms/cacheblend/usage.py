"""Reuse through LlamaIndex's instrumentation: :class:`CacheBlendUsageHandler` sums the token accounting
of every CacheBlend LLM call (docs/accounting.md). ``TokenCountingHandler`` cannot show reuse: it counts
prompt and completion tokens only (by tokenizing the texts itself, or from ``usage``'s two totals)."""

from __future__ import annotations

import threading
from typing import Any

from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent
from pydantic import PrivateAttr

COUNTS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cache_read_exact_tokens",
    "cache_read_blended_tokens",
    "recomputed_tokens",
    "kv_computed_tokens",
)


class CacheBlendUsageHandler(BaseEventHandler):
    """Totals of the CacheBlend LLM calls it saw end: ``prompt_tokens``, ``completion_tokens``,
    ``cached_tokens`` (read from a cache), its split, ``recomputed_tokens`` and ``kv_computed_tokens``
    (chunk KV computed for the request), and ``calls``. Add it with
    ``get_dispatcher().add_event_handler(handler)``; ``reset()`` zeroes it. Thread-safe."""

    _totals: dict[str, int] = PrivateAttr(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    _calls: int = PrivateAttr(default=0)
    _lock: Any = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendUsageHandler"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if not isinstance(event, LLMChatEndEvent | LLMCompletionEndEvent) or event.response is None:
            return
        raw = event.response.raw
        usage = raw.get("usage") if isinstance(raw, dict) else None
        if not isinstance(usage, dict) or "prompt_tokens_details" not in usage:
            return  # not a CacheBlend answer (or a streamed piece before the last)
        details = usage["prompt_tokens_details"]
        with self._lock:
            self._calls += 1
            for name in COUNTS:
                self._totals[name] += int(usage.get(name, details.get(name, 0)) or 0)

    @property
    def calls(self) -> int:
        return self._calls

    def totals(self) -> dict[str, int]:
        """The totals so far, by name (``COUNTS``)."""
        with self._lock:
            return dict(self._totals)

    def __getattr__(self, name: str) -> Any:
        if name in COUNTS:
            return self.totals()[name]
        return super().__getattr__(name)

    def reset(self) -> None:
        with self._lock:
            self._totals = dict.fromkeys(COUNTS, 0)
            self._calls = 0
