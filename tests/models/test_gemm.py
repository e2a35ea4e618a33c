"""The runtime's CPU matrix products (models/gemm.py): oneDNN where it is faster, the same function."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cacheblend_rag.models import gemm as gemm_module
from cacheblend_rag.models.gemm import MIN_OUTPUTS, Gemm

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@pytest.fixture
def counted(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the activations sent through oneDNN."""
    calls: list[tuple[int, ...]] = []
    real = gemm_module._onednn_linear

    def counting(x, weight, bias):
        calls.append(tuple(x.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(gemm_module, "_onednn_linear", counting)
    return calls


def test_linear_layers_go_through_onednn_for_large_enough_products(counted):
    gemm = Gemm(torch.device("cpu"), torch.float32)
    assert gemm.onednn
    counted.clear()  # (the check at start sends one product through)
    torch.manual_seed(0)
    layer = nn.Linear(96, 64)
    least = MIN_OUTPUTS // 64  # rows from which a product of this width pays
    for rows in (1, least - 1, least, 300):
        x = torch.randn(1, rows, 96)
        want = F.linear(x, layer.weight, layer.bias)
        assert torch.allclose(gemm(layer, x), want, rtol=1e-5, atol=1e-5)
    assert counted == [(1, least, 96), (1, 300, 96)]  # smaller products stay with torch's kernel
    head = nn.Linear(96, MIN_OUTPUTS, bias=False)
    gemm(head, torch.randn(1, 1, 96))
    assert counted[-1] == (1, 1, 96)  # an LM head's width pays at one row


def test_other_modules_dtypes_and_devices_keep_their_own_forward(counted):
    class Scaled(nn.Linear):  # a subclass may do more than the product
        def forward(self, x):
            return 2 * super().forward(x)

    gemm = Gemm(torch.device("cpu"), torch.float32)
    counted.clear()  # (the check at start sends one product through)
    x, layer = torch.randn(1, 64, 32), Scaled(32, 8)
    assert torch.allclose(gemm(layer, x), 2 * F.linear(x, layer.weight, layer.bias))
    assert counted == []
    assert not Gemm(torch.device("cpu"), torch.bfloat16).onednn
    assert not Gemm(torch.device("meta"), torch.float32).onednn


def test_gated_mlp_equals_the_modules_forward(model, counted):
    block = model.layers[3]
    x = torch.randn(1, 200, model.shape.hidden_size)
    with torch.inference_mode():
        got, want = model.gemm.mlp(block.mlp, x), block.mlp(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert len(counted) == 3  # gate, up, down


def test_an_mlp_of_another_shape_runs_its_own_forward(counted):
    class SwiGLU(nn.Module):  # gate/up/down but no act_fn (the accelerator check's models are such)
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(32, 256), nn.Linear(32, 256)
            self.down_proj = nn.Linear(256, 32)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    gemm = Gemm(torch.device("cpu"), torch.float32)
    counted.clear()
    mlp, x = SwiGLU(), torch.randn(1, 64, 32)
    assert torch.equal(gemm.mlp(mlp, x), mlp(x))
    assert counted == []
