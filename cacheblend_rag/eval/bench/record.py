"""The records every bench section shares: the checks it decides on its numbers and the frame the bench
adds around each section's own record (:class:`~cacheblend_rag.records.OpenRecord`, whose objects keep
the keys they have no field for, so a section read and written again is the same JSON)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...records import OpenRecord


@dataclass(frozen=True)
class Check(OpenRecord):
    """A claim checked on a run's numbers; ``value`` (the number it was decided on) where there is one."""

    claim: str
    passed: bool
    value: float | None = None


@dataclass(frozen=True)
class LoadAverage(OpenRecord):
    """The 1-, 5- and 15-minute load averages before and after a section ran."""

    before: list[float]
    after: list[float]


@dataclass(frozen=True)
class SectionFrame(OpenRecord):
    """What the bench adds to every section's results beside the section's own record: the seconds it
    took, the load averages around it and the machine it ran on (:func:`..results.machine_info`)."""

    seconds: float
    load_average: LoadAverage
    machine: dict[str, Any]
