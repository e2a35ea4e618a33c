"""Fused per-layer weights and the tensor-only pieces of a decoder layer, for steps a graph can capture.

The layer-wise runtime (:mod:`.runtime`) calls the model's modules one by one: three q/k/v products, two
for the MLP's gate and up, an RMS norm of several element-wise kernels. On an accelerator each of those is
a kernel launch the host must queue, and a layer of a fusion is small. Here a layer's weights are packed
once per model as vLLM packs them (one q/k/v matrix, one gate/up matrix; the modules' own weights become
views into them, so no memory is added) and the pieces below are plain functions of tensors: no module
calls, no Python state, no reads back to the host. That is what lets :mod:`cacheblend_rag.blend.static`
trace a layer once and replay it for every layer and every prompt of a size bucket.

Supported: Llama-style layers (Llama, Mistral, Qwen2; q/k/v bias allowed) with a SiLU-gated MLP.
:func:`fused_weights` returns None for anything else (Qwen3's per-head q/k norms, a projection that is
not a plain ``nn.Linear``), and callers keep the module-by-module path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .runtime import KVCache, LayerwiseModel

_SILU_NAMES = frozenset({"SiLU", "SiLUActivation"})


class LayerWeights(NamedTuple):
    """One decoder layer's weights as the fused steps read them."""

    input_norm: torch.Tensor  # [D]
    post_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(H + 2 Hkv) d, D]
    qkv_bias: torch.Tensor | None  # [(H + 2 Hkv) d]
    o_t: torch.Tensor  # [H d, D] (o_proj's weight transposed, a view)
    gate_up: torch.Tensor  # [2 I, D]
    down_t: torch.Tensor  # [I, D] (down_proj's weight transposed, a view)


class FusedWeights(NamedTuple):
    """Every layer's :class:`LayerWeights`, the final norm and the shape numbers the steps need."""

    layers: tuple[LayerWeights, ...]
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


def _plain_linear(module: object) -> bool:
    return type(module) is nn.Linear  # pylint: disable=unidiomatic-typecheck  # subclasses differ


def _eps(norm: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    return None


def _pack(modules: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``modules`` stacked by output rows; each module's parameters then become
    views into it, so the model holds the same bytes once."""
    weight = torch.cat([m.weight.detach() for m in modules])
    biases = [m.bias for m in modules]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


def fused_weights(model: LayerwiseModel) -> FusedWeights | None:
    """The model's layers packed for the fused steps (built on first use and kept on the model), or None
    when a layer is of a kind they do not cover (see the module docstring)."""
    found = getattr(model, "_fused_weights", False)
    if found is not False:
        return found
    fused = _build(model)
    model._fused_weights = fused  # pylint: disable=protected-access  # one packing per model
    return fused


def _build(model: LayerwiseModel) -> FusedWeights | None:
    shape = model.shape
    layers, eps = [], None
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        gated = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        act = getattr(mlp, "act_fn", None)
        if (
            not all(_plain_linear(m) for m in (*projections, *gated))
            or getattr(attn, "q_norm", None) is not None
            or getattr(attn, "fused_qkv", None) is not None
            or type(act).__name__ not in _SILU_NAMES
            or projections[3].bias is not None
            or any(m.bias is not None for m in gated)
        ):
            return None
        eps_in, eps_post = _eps(block.input_layernorm), _eps(block.post_attention_layernorm)
        if eps_in is None or eps_in != eps_post or (eps is not None and eps != eps_in):
            return None
        eps = eps_in
        with torch.no_grad():
            qkv, qkv_bias = _pack(projections[:3])
            gate_up, _ = _pack(gated[:2])
        layers.append(
            LayerWeights(
                block.input_layernorm.weight.detach(),
                block.post_attention_layernorm.weight.detach(),
                qkv,
                qkv_bias,
                projections[3].weight.detach().t(),
                gate_up,
                gated[2].weight.detach().t(),
            )
        )
    if eps is None or _eps(model.norm) is None:
        return None
    return FusedWeights(
        tuple(layers),
        eps,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        layers[0].gate_up.shape[0] // 2,
    )


# -- the pieces of a layer, tensors in and out -----------------------------------------------------------


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """RoPE's sin table with rotate_half's sign folded in: ``x * cos + swap_halves(x) * signed_sin(sin)``
    is ``x * cos + rotate_half(x) * sin`` (the table repeats over a head's two halves)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` [..., d] by tables broadcast against it: three kernels (a product, the swapped
    halves, a fused multiply-add)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin_signed)


def project(
    w: LayerWeights, hidden: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, fw: FusedWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, one q/k/v product and RoPE of q and k together, for ``hidden`` [S, D] at the positions
    of ``cos``/``sin_signed`` [S, d]: q [H, S, d], k and v [Hkv, S, d] (views)."""
    rows = hidden.shape[0]
    x = F.rms_norm(hidden, hidden.shape[-1:], w.input_norm, fw.eps)
    qkv = F.linear(x, w.qkv, w.qkv_bias)
    heads, kv_heads, d = fw.heads, fw.kv_heads, fw.head_dim
    qk = qkv[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d)
    rotated = rotate(qk, cos[:, None, :], sin_signed[:, None, :])
    q = rotated[:, :heads].transpose(0, 1)
    k = rotated[:, heads:].transpose(0, 1)
    v = qkv[:, (heads + kv_heads) * d :].view(rows, kv_heads, d).transpose(0, 1)
    return q, k, v


def finish(w: LayerWeights, hidden: torch.Tensor, attended: torch.Tensor, fw: FusedWeights) -> torch.Tensor:
    """o-proj with the residual in one product, post norm, one gate/up product, SiLU gate and the down
    product with the residual: ``hidden`` [S, D], ``attended`` [S, H d] -> [S, D]."""
    hidden = torch.addmm(hidden, attended, w.o_t)
    x = F.rms_norm(hidden, hidden.shape[-1:], w.post_norm, fw.eps)
    gate, up = F.linear(x, w.gate_up).split(fw.intermediate, dim=-1)
    return torch.addmm(hidden, F.silu(gate) * up, w.down_t)


def heads_to_rows(out: torch.Tensor) -> torch.Tensor:
    """Attention output [H, S, d] as the o-proj's input [S, H d]."""
    return out.transpose(0, 1).reshape(out.shape[1], -1)


def prefill_layer(
    w: LayerWeights,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    fw: FusedWeights,
) -> torch.Tensor:
    """A full prefill's layer for positions 0..S-1 (``hidden`` [S, D]): its K/V written into ``keys`` /
    ``values`` [Hkv, >= S, d], causal attention, the rest of the layer."""
    q, k, v = project(w, hidden, cos, sin_signed, fw)
    rows = hidden.shape[0]
    keys[:, :rows].copy_(k)
    values[:, :rows].copy_(v)
    out = F.scaled_dot_product_attention(
        q[None], keys[None, :, :rows], values[None, :, :rows], is_causal=True, enable_gqa=True
    )[0]
    return finish(w, hidden, heads_to_rows(out).to(hidden.dtype), fw)


@torch.inference_mode()
def prefill(
    model: LayerwiseModel, weights: FusedWeights, ids: list[int], extra_capacity: int = 0
) -> tuple[torch.Tensor, KVCache]:
    """A full prefill of ``ids`` from position 0 by :func:`prefill_layer`: the last token's logits [1, V]
    (float32) and the cache. The baseline a static fusion is timed against on an accelerator, beside
    :meth:`LayerwiseModel.prefill`."""
    n = len(ids)
    cache = model.new_cache(n + extra_capacity)
    hidden = model.embed(torch.as_tensor(ids, device=model.device)).to(model.dtype)
    cos, sin = model.rope.cos_sin(torch.arange(n, device=model.device), model.dtype)
    sin_signed = signed_sin(sin)
    for layer, w in enumerate(weights.layers):
        keys, values = cache.keys[layer][0], cache.values[layer][0]
        hidden = prefill_layer(w, hidden, cos, sin_signed, keys, values, weights)
    cache.length = n
    return model.logits(hidden[-1:]), cache
