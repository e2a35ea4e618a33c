"""The runtime's matrix products on CPU: oneDNN's float32 GEMM where it is faster than torch's default.

``torch.nn.functional.linear`` on a CPU build of torch runs MKL's sgemm. On AMD processors MKL does not
take its fastest paths, and oneDNN's matmul (also in every x86 torch build, the kernel vLLM's CPU backend
uses for its linear layers) runs the same float32 products about 2x faster there
(``scripts/cpu_gemm.py at 929a489`` measures both on this machine's shapes). :class:`Gemm` sends a plain
``nn.Linear`` through oneDNN when that is available, checked at start on a small product against
``F.linear``, and worth it: for a product of at least :data:`MIN_OUTPUTS` values (rows x output
features); otherwise, and for any other module (vLLM's own layers, quantized ones), it calls the module.

The products differ from MKL's in rounding only (float32 sums in another order). ``transformers``' own
forward of the same modules is untouched, so it stays the stock baseline the benchmarks compare with.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# smaller products cost oneDNN more in per-call setup than they save (scripts/cpu_gemm.py at 929a489 on this
# machine: k/v at 16 rows, 3,072 values, 0.75x; q/o at 16 rows, 9,216, 1.34x; 490 rows and more 2.0-2.5x
# for every weight; the LM head at 1 row, 49,152 values, 3.5x)
MIN_OUTPUTS = 8192
# the largest relative difference from F.linear accepted at start (float32 rounding is ~1e-7 per sum)
CHECK_TOLERANCE = 1e-4


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def onednn_works() -> bool:
    """Whether this torch build has oneDNN's float32 linear and it agrees with ``F.linear``."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 96, generator=generator)
    weight, bias = torch.randn(40, 96, generator=generator), torch.randn(40, generator=generator)
    try:
        got = _onednn_linear(x, weight, bias)
    except (AttributeError, RuntimeError) as exc:  # no such op in this build, or no kernel for this CPU
        log.info("oneDNN linear unavailable (%s); matrix products use torch's default", exc)
        return False
    want = F.linear(x, weight, bias)
    error = float((got - want).abs().max() / want.abs().max())
    if got.shape != want.shape or not error <= CHECK_TOLERANCE:
        log.warning("oneDNN linear differs from F.linear (%.2g); matrix products use torch's default", error)
        return False
    return True


class Gemm:
    """Applies a linear module to activations through the faster CPU kernel (see the module docstring)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.onednn = device.type == "cpu" and dtype == torch.float32 and onednn_works()

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if (
            self.onednn
            and type(module) is nn.Linear  # pylint: disable=unidiomatic-typecheck  # subclasses differ
            and x.numel() // x.shape[-1] * module.out_features >= MIN_OUTPUTS
        ):
            return _onednn_linear(x, module.weight, module.bias)
        return module(x)

    def mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A transformers gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Llama, Mistral,
        Qwen2, Qwen3) with its products through :meth:`__call__`; any other MLP module as it is."""
        parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        act = getattr(mlp, "act_fn", None)
        plain = all(type(p) is nn.Linear for p in parts)  # pylint: disable=unidiomatic-typecheck
        if not self.onednn or not plain or act is None:
            return mlp(x)
        gate, up, down = parts
        return self(down, act(self(gate, x)) * self(up, x))
