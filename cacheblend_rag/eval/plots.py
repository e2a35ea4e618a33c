"""matplotlib helpers shared by the eval and bench plots."""

from __future__ import annotations

from pathlib import Path


def log_x(ax) -> None:
    """Log-scale x axis labelled with plain numbers at 1, 2, 5 x 10^k."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # no timestamp in the PNG metadata: an unchanged plot stays byte-identical
    fig.savefig(path, dpi=110, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
