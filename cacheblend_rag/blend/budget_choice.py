"""What a per-request budget chose for one request, as results report it."""

from __future__ import annotations

from dataclasses import dataclass

from ..records import JsonRecord


@dataclass(frozen=True, kw_only=True)
class BudgetChoice(JsonRecord):
    """What a per-request budget chose for one request's chunks (results report it as ``budget``): the
    rule it applied (``kind``, with a cover budget's ``target`` and ``min_ratio``), the largest share of
    the cached tokens that allows, whether the chunks counted as short, their count and mean length."""

    kind: str
    target: float | None = None
    min_ratio: float | None = None
    ratio: float
    short: bool
    chunks: int
    mean_chunk_tokens: float

    def text(self, *, brief: bool = False) -> str:
        """In words. Brief, as ``check`` tallies questions by it: ``short chunks: 0.25``; in full, as
        ``query`` shows it: the share, what bounds it, and the chunks it was chosen for."""
        length = "short" if self.short else "long"
        target = self.target
        if brief:
            return f"{length} chunks: {f'cover {target:g} within ' if target else ''}{self.ratio:g}"
        share = f"{self.ratio:g} of the cached tokens"
        if target:
            share = f"those covering {target:g} of the question's attention, at most {share}"
        return f"{share} ({length} chunks: {self.chunks} averaging {self.mean_chunk_tokens:g} tokens)"
