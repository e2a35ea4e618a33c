"""torch's default float32 GEMM (``F.linear``: MKL on x86 builds) against oneDNN's (what
``cacheblend_rag.models.gemm.Gemm`` uses) on the default model's linear shapes, by row count.

    .venv/bin/python scripts/cpu_gemm.py [--repeats 30]

Prints milliseconds per product (median of ``--repeats`` after a warm-up) and the speed-up, for the
q/o projections (576 x 576), k/v (192 x 576), MLP up/gate (1536 x 576) and down (576 x 1536) and the LM
head (49152 x 576), at 1 to 3,133 rows (a decode step to a 6 x 512-token prompt). Run it on a quiet
machine; the torch thread count is the settings' (CACHEBLEND_THREADS).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from cacheblend_rag.models.gemm import _onednn_linear, onednn_works
from cacheblend_rag.models.loader import configure_threads
from cacheblend_rag.settings import get_settings

SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "up/gate": (1536, 576), "down": (576, 1536)}
HEAD = (49152, 576)
ROWS = (1, 4, 16, 40, 490, 3133)


def median_ms(call, repeats: int) -> float:
    call()
    walls = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        walls.append(time.perf_counter() - started)
    return 1000 * statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    configure_threads(get_settings().threads)
    if not onednn_works():
        raise SystemExit("this torch build has no working oneDNN linear")
    print(f"{torch.get_num_threads()} threads; ms per product (F.linear / oneDNN = speed-up)")
    print(f"{'weight':>16s} {'rows':>5s} {'F.linear':>9s} {'oneDNN':>8s} {'speed-up':>8s}")
    shapes = [*SHAPES.items(), ("LM head", HEAD)]
    for name, (n_out, n_in) in shapes:
        weight = torch.randn(n_out, n_in)
        for rows in ROWS[:2] if name == "LM head" else ROWS:
            x = torch.randn(1, rows, n_in)
            torch_ms = median_ms(lambda x=x, w=weight: F.linear(x, w), args.repeats)
            onednn_ms = median_ms(lambda x=x, w=weight: _onednn_linear(x, w, None), args.repeats)
            label = f"{name} {n_out}x{n_in}"
            print(f"{label:>16s} {rows:5d} {torch_ms:9.3f} {onednn_ms:8.3f} {torch_ms / onednn_ms:7.2f}x")


if __name__ == "__main__":
    main()
