"""The loading controller: pick the recompute ratio and the KV tier from measured costs.

CacheBlend recomputes a fraction r of the cached tokens at each layer while the next layer's KV loads. The
recompute is free when one layer's recompute takes as long as one layer's load, so the controller picks
``r = max(r_match, r_floor)``: ``r_match`` equalises the two (from a measured profile of this model on this
device), ``r_floor`` (default: the default ratio, 0.15) keeps quality. For a fixed r it can also rank tiers
by storage cost and pick the cheapest one whose load still hides behind the recompute.

A request's tier is where its chunks live (:func:`~.spec.choose_ratio`): the disk for chunks a store keeps,
whichever of its tiers a read hits (the RAM tier holds what ran lately, so a ratio matched to it would
depend on what ran before the request, not on the request), RAM only for KV a caller holds in memory.

The profile (``cacheblend-rag profile``) holds the time of one layer of full prefill at several context
lengths and the load throughput of each tier; it is saved as JSON under the settings home, keyed by model
fingerprint and device.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from ..config import DEFAULT_RATIO, default_home
from ..models.attention import AttentionMask
from ..models.runtime import LayerwiseModel

PROFILE_VERSION = 1
# Relative cost of keeping a byte in each tier; only the order matters (cheapest is tried first).
DEFAULT_TIER_COST = {"disk": 0.05, "ram": 1.0}


def device_tag(device: torch.device | str) -> str:
    """A file-name-safe name for a device: 'cpu', or 'cuda-<gpu name>'."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return "cuda-" + re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
    return device.type


def profile_path(model_fingerprint: str, device: torch.device | str, home: Path | None = None) -> Path:
    """Where the profile of a model on a device is saved."""
    home = default_home() if home is None else home
    return home / "profiles" / f"{model_fingerprint[:16]}-{device_tag(device)}.json"


@dataclass
class Profile:
    """Measured costs of one model on one device (see :func:`cacheblend_rag.store.profile.profile_device`)."""

    model_fingerprint: str
    model: str
    device: str
    compute_dtype: str
    kv_dtype: str
    num_layers: int
    kv_bytes_per_token_per_layer: int  # in the storage dtype
    prefill: list[tuple[int, float]]  # (context tokens, seconds for one layer of full prefill), ascending
    tier_bytes_per_s: dict[str, float]  # load throughput into compute dtype on the device, per tier
    tier_cost: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_COST))
    threads: int = 0
    created: float = field(default_factory=time.time)
    notes: dict[str, Any] = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        self.prefill = sorted((int(n), float(s)) for n, s in self.prefill)
        if not self.prefill or any(n <= 0 or s <= 0 for n, s in self.prefill):
            raise ValueError("a profile needs positive prefill timings")
        if not self.tier_bytes_per_s or any(v <= 0 for v in self.tier_bytes_per_s.values()):
            raise ValueError("a profile needs a positive load throughput for at least one tier")

    def layer_prefill_seconds(self, tokens: int) -> float:
        """One layer of full prefill over ``tokens`` tokens, interpolated (linearly extrapolated)."""
        points = self.prefill
        if tokens <= points[0][0]:
            return points[0][1] * tokens / points[0][0]
        if len(points) == 1:
            return points[0][1] * tokens / points[0][0]
        for (n0, s0), (n1, s1) in pairwise(points):
            if tokens <= n1:
                return s0 + (s1 - s0) * (tokens - n0) / (n1 - n0)
        (n0, s0), (n1, s1) = points[-2], points[-1]
        return s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (tokens - n1)

    def layer_load_seconds(self, tier: str, cached_tokens: int) -> float:
        """One layer of ``cached_tokens`` tokens' KV loaded from ``tier``."""
        if tier not in self.tier_bytes_per_s:
            raise ValueError(
                f"tier {tier!r} is not profiled; profiled tiers: {', '.join(self.tier_bytes_per_s)}"
            )
        return cached_tokens * self.kv_bytes_per_token_per_layer / self.tier_bytes_per_s[tier]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["prefill"] = [list(point) for point in self.prefill]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')} (this build reads {PROFILE_VERSION})")
        return cls(**{**data, "prefill": [tuple(point) for point in data["prefill"]]})

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(f".{os.getpid()}.tmp")
        temp.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(temp, path)
        return path

    @classmethod
    def load(cls, path: Path) -> Profile:
        return cls.from_dict(json.loads(path.read_text()))


@dataclass(frozen=True)
class Decision:
    """What the controller chose and why; :meth:`to_dict` goes into query results and logs."""

    ratio: float
    tier: str
    reason: str
    r_floor: float
    r_match: float | None = None
    load_s_per_layer: float | None = None
    recompute_s_per_layer: float | None = None
    full_prefill_s_per_layer: float | None = None
    load_hidden: bool | None = None
    prefer_full_prefill: bool = False  # loading is slower than recomputing everything
    profiled: bool = False
    alternatives: tuple[dict[str, Any], ...] = ()  # per tier considered: cost, load time, hidden

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["alternatives"] = [dict(a) for a in self.alternatives]
        return data


class LoadingController:
    """Chooses the recompute ratio and the tier from a :class:`Profile` (or falls back to the floor)."""

    def __init__(self, profile: Profile | None, r_floor: float = DEFAULT_RATIO) -> None:
        self.profile = profile
        self.r_floor = r_floor
        if not 0.0 <= self.r_floor <= 1.0:
            raise ValueError(f"r_floor must lie in [0, 1], got {self.r_floor}")

    @classmethod
    def for_model(
        cls, model: LayerwiseModel, r_floor: float = DEFAULT_RATIO, home: Path | None = None
    ) -> LoadingController:
        """The controller for ``model`` on its device, with the saved profile if there is one."""
        return cls.for_fingerprint(model.fingerprint, model.device, r_floor, home)

    @classmethod
    def for_fingerprint(
        cls,
        fingerprint: str,
        device: torch.device | str,
        r_floor: float = DEFAULT_RATIO,
        home: Path | None = None,
    ) -> LoadingController:
        """The controller for the model of ``fingerprint`` on ``device`` (a saved profile if any), for
        engines that hold no :class:`LayerwiseModel` in this process."""
        path = profile_path(fingerprint, device, home)
        profile = Profile.load(path) if path.is_file() else None
        return cls(profile, r_floor)

    def _recompute_seconds(self, ratio: float, cached: int, total: int) -> tuple[float, float]:
        """(one layer's recompute at ``ratio``, one layer's full prefill): the fresh tokens are always
        computed, ``ratio`` of the cached ones on top; cost is taken proportional to tokens computed."""
        full = self.profile.layer_prefill_seconds(total)
        fresh = total - cached
        return full * (fresh + ratio * cached) / total, full

    def choose(self, num_cached_tokens: int, total_tokens: int, tier: str = "disk") -> Decision:
        """The ratio for a prompt of ``total_tokens`` of which ``num_cached_tokens`` load from ``tier``."""
        _check_tokens(num_cached_tokens, total_tokens)
        if self.profile is None:
            return Decision(
                ratio=self.r_floor,
                tier=tier,
                r_floor=self.r_floor,
                reason="no profile for this model and device (run `cacheblend-rag profile`): floor ratio",
            )
        if num_cached_tokens == 0:
            return Decision(
                ratio=self.r_floor, tier=tier, r_floor=self.r_floor, reason="nothing cached", profiled=True
            )
        load = self.profile.layer_load_seconds(tier, num_cached_tokens)
        full = self.profile.layer_prefill_seconds(total_tokens)
        fresh = total_tokens - num_cached_tokens
        r_match = max(0.0, (load / full * total_tokens - fresh) / num_cached_tokens)
        ratio = min(1.0, max(r_match, self.r_floor))
        recompute, _ = self._recompute_seconds(ratio, num_cached_tokens, total_tokens)
        if r_match <= self.r_floor:
            reason = f"{tier} load hides behind recompute at the floor ratio"
        elif r_match <= 1.0:
            reason = f"ratio raised to {ratio:.3f} so recompute matches the {tier} load time"
        else:
            reason = f"{tier} load is slower than full prefill: recompute everything or use a faster tier"
        return Decision(
            ratio=ratio,
            tier=tier,
            reason=reason,
            r_floor=self.r_floor,
            r_match=r_match,
            load_s_per_layer=load,
            recompute_s_per_layer=recompute,
            full_prefill_s_per_layer=full,
            load_hidden=load <= recompute * (1 + 1e-9),
            prefer_full_prefill=r_match > 1.0,
            profiled=True,
        )


def _check_tokens(num_cached_tokens: int, total_tokens: int) -> None:
    if total_tokens <= 0 or not 0 <= num_cached_tokens <= total_tokens:
        raise ValueError(
            f"need 0 <= num_cached_tokens ({num_cached_tokens}) <= total_tokens ({total_tokens}), total > 0"
        )


def measure_prefill_per_layer(
    model: LayerwiseModel, lengths: Sequence[int], layer: int | None = None, repeats: int = 3
) -> list[tuple[int, float]]:
    """Seconds of one decoder layer of full prefill (q/k/v, causal attention, MLP) at each context length,
    the best of ``repeats`` runs after a warm-up. All layers of a model have the same cost."""
    layer = model.num_layers // 2 if layer is None else layer
    generator = torch.Generator().manual_seed(0)
    points = []
    for n in sorted(set(lengths)):
        if not 0 < n <= model.shape.max_context:
            raise ValueError(f"profile length {n} outside 1..{model.shape.max_context}")
        ids = torch.randint(0, model.shape.vocab_size, (1, n), generator=generator)
        hidden = model.embed(ids).to(model.dtype)
        positions = torch.arange(n, device=model.device)
        mask = AttentionMask.for_positions(positions, n)
        best = math.inf
        for _ in range(repeats + 1):
            _sync(model.device)
            start = time.perf_counter()
            qkv = model.project_qkv(layer, hidden, positions)
            model.attend_and_mlp(layer, hidden, qkv.q, qkv.k, qkv.v, mask)
            _sync(model.device)
            best = min(best, time.perf_counter() - start)
        points.append((n, best))
    return points


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
