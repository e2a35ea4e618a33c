"""The bench plots: TTFT against chunk count and length, attention deviation against the ratio."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..plots import pyplot, save_figure
from .deviation import DeviationResult
from .ttft import TTFT_LABELS, TtftResult

PLOT_NAMES = {"ttft": "ttft_vs_chunks.png", "deviation": "attention_deviation_vs_ratio.png"}


def plot_deviation(results: dict[str, Any], path: Path) -> Path:
    """Mean attention deviation against the share of tokens recomputed, cacheblend as a curve."""
    plt = pyplot()
    deviation = DeviationResult.from_dict(results["sections"]["deviation"])
    fig, ax = plt.subplots(figsize=(6, 4.2))
    curve = sorted((e.ratio, e.attention) for e in deviation.summary.values() if e.ratio is not None)
    ax.plot([c[0] for c in curve], [c[1] for c in curve], "o-", label="cacheblend (r)")
    for label, e in deviation.summary.items():
        if e.ratio is None:
            ax.plot(e.recompute_ratio, e.attention, "s", label=label)
    ax.set_xlabel("share of chunk tokens recomputed")
    ax.set_ylabel("attention deviation vs full prefill")
    ax.set_title(f"Attention deviation vs recompute ratio ({deviation.prompts} prompts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_ttft_sweeps(results: dict[str, Any], path: Path) -> Path:
    """TTFT per method against the chunk count (left) and the chunk length (right)."""
    plt = pyplot()
    ttft = TtftResult.from_dict(results["sections"]["ttft"])
    config = results["config"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, fixed_key, fixed, xlabel in (
        (axes[0], "num_chunks", "chunk_tokens", config["chunk_tokens"], "chunks"),
        (axes[1], "chunk_tokens", "num_chunks", config["num_chunks"], "tokens per chunk"),
    ):
        points = sorted(
            (p for p in ttft.points if getattr(p, fixed_key) == fixed), key=lambda p: getattr(p, key)
        )
        xs = [getattr(p, key) for p in points]
        for label, name in TTFT_LABELS.items():
            ax.plot(xs, [p.ttft_s[label] for p in points], "o-", label=name)
        ax.set_xticks(xs)
        ax.set_xlabel(f"{xlabel} ({fixed_key.replace('_', ' ')} = {fixed})")
        ax.set_ylabel("TTFT (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Time to first token")
    return save_figure(fig, path)
