"""The fusor's model over vLLM's own loaded modules, so the worker holds no second copy of the weights.

vLLM 0.32's decoder models of the families our runtime supports (Llama, Mistral, Qwen2, Qwen3) are laid
out as ``model.embed_tokens``, ``model.layers[i].{input_layernorm, self_attn.{qkv_proj, o_proj, q_norm?,
k_norm?}, post_attention_layernorm, mlp.{gate_up_proj, down_proj}}``, ``model.norm`` and ``lm_head``.
:func:`layerwise_over_vllm` lays those modules out the way :class:`LayerwiseModel` reads a transformers
model, after :func:`layout_problem` has checked that they are what we expect:

* **Matrix products run through vLLM's own linear layers** (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
  ``down_proj``). On CPU, vLLM hands each linear weight to oneDNN in its packed format at load and leaves
  an empty ``weight`` tensor behind, so there are no rows to slice: calling the layer is the only way to
  use those weights without a copy (on CUDA the same call also covers quantized layers). Fused outputs are
  split by column (q | k | v, gate | up): views of the activation, one GEMM instead of three or two.
* **RMSNorm, embedding, LM head and SiLU-gating are ours**, the formulas of transformers that our runtime
  computes from HF weights, applied to vLLM's parameter tensors themselves (the same storage).
* **RoPE** comes from the model's config, computed as :func:`~cacheblend_rag.models.loader.load_model`
  computes it (:func:`~cacheblend_rag.models.loader.config_rope`).

A layout this module does not recognise (another family, a changed vLLM release) makes
:func:`layerwise_over_vllm` raise :class:`UnknownLayoutError` with the reason; the worker then loads its
own copy of the model instead, and logs why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import CacheBlendError
from ...models.loader import check_supported, config_rope, model_shape
from ...models.runtime import LayerwiseModel, ModelShape
from ...models.tokenizer import generation_config, load_model_tokenizer
from .paged import FusionAttention, PagedLayerwiseModel


class UnknownLayoutError(CacheBlendError):
    """vLLM's model is not laid out as this module expects (the reason is the message)."""


def _output(result: Any) -> torch.Tensor:
    """vLLM's linear layers return (output, bias to add later) unless built with return_bias=False."""
    return result[0] if isinstance(result, tuple) else result


class RMSNormView(nn.Module):
    """transformers' RMSNorm (float32 statistics, weight applied in the input dtype) over the weight of a
    vLLM ``RMSNorm``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight  # vLLM's parameter itself
        self.variance_epsilon = float(norm.variance_epsilon)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


class LinearCall(nn.Module):
    """One of vLLM's linear layers, called as it is (its output without the deferred bias)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _output(self.layer(x))


class FusedAttentionView(nn.Module):
    """q, k, v from vLLM's fused ``qkv_proj`` in one call (``fused_qkv``), its ``o_proj`` and per-head
    q/k norms (Qwen3)."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.qkv_proj = attn.qkv_proj
        self.o_proj = LinearCall(attn.o_proj)
        self.sizes = [int(attn.q_size), int(attn.kv_size), int(attn.kv_size)]
        has_norms = getattr(attn, "q_norm", None) is not None
        self.q_norm = RMSNormView(attn.q_norm) if has_norms else None
        self.k_norm = RMSNormView(attn.k_norm) if has_norms else None

    def fused_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _output(self.qkv_proj(x)).split(self.sizes, dim=-1)


class GatedMLPView(nn.Module):
    """``down(silu(gate) * up)`` with gate | up from vLLM's fused ``gate_up_proj``, as transformers'
    ``LlamaMLP`` computes it from separate projections."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = mlp.gate_up_proj
        self.down_proj = LinearCall(mlp.down_proj)
        self.intermediate = int(mlp.gate_up_proj.output_sizes[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _output(self.gate_up_proj(x)).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class EmbeddingView(nn.Module):
    """Token embedding over vLLM's embedding table (padded rows are never looked up)."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.weight = embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHeadView(nn.Module):
    """The LM head over the first ``vocab_size`` rows of vLLM's (possibly padded, possibly tied) table."""

    def __init__(self, lm_head: nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.weight = lm_head.weight
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight[: self.vocab_size])


class DecoderLayerView(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNormView(layer.input_layernorm)
        self.self_attn = FusedAttentionView(layer.self_attn)
        self.post_attention_layernorm = RMSNormView(layer.post_attention_layernorm)
        self.mlp = GatedMLPView(layer.mlp)


class BackboneView(nn.Module):
    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = EmbeddingView(backbone.embed_tokens)
        self.layers = nn.ModuleList(DecoderLayerView(layer) for layer in backbone.layers)
        self.norm = RMSNormView(backbone.norm)


class CausalLMView(nn.Module):
    """vLLM's model laid out as a transformers causal LM (``model.*``, ``lm_head``, ``generation_config``)."""

    def __init__(self, vllm_model: nn.Module, vocab_size: int, generation: Any) -> None:
        super().__init__()
        self.model = BackboneView(vllm_model.model)
        self.lm_head = LMHeadView(vllm_model.lm_head, vocab_size)
        self.generation_config = generation


def _is_rms_norm(module: Any, size: int) -> bool:
    """A plain vLLM RMSNorm of ``size`` with its weight (not Gemma's 1 + w variant, not weightless)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "RMSNorm"
        and getattr(module, "has_weight", True)
        and getattr(module, "variance_size_override", None) is None
        and isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == (size,)
    )


def _table_problem(name: str, module: Any, rows: int, width: int) -> str | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return f"{name} has no dense weight table"
    if weight.shape[0] < rows or weight.shape[1] != width:
        return f"{name} is {tuple(weight.shape)}, expected at least ({rows}, {width})"
    return None


def _layer_problem(layer: Any, shape: ModelShape) -> str | None:
    hidden, head_dim = shape.hidden_size, shape.head_dim
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm")]
    if not all(_is_rms_norm(norm, hidden) for norm in norms):
        return "its norms are not plain RMSNorms"
    if attn is None or getattr(attn, "qkv_proj", None) is None or getattr(attn, "o_proj", None) is None:
        return "attention without qkv_proj / o_proj"
    sizes = (getattr(attn, "q_size", None), getattr(attn, "kv_size", None))
    if sizes != (shape.num_heads * head_dim, shape.num_kv_heads * head_dim):
        return f"q/kv projection sizes {sizes} differ from the config's"
    head_norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
    if (shape.family == "qwen3") != all(n is not None for n in head_norms):
        return f"per-head q/k norms {'missing' if shape.family == 'qwen3' else 'unexpected'}"
    if head_norms[0] is not None and not all(_is_rms_norm(n, head_dim) for n in head_norms):
        return "per-head q/k norms are not plain RMSNorms over head_dim"
    halves = list(getattr(getattr(mlp, "gate_up_proj", None), "output_sizes", []))
    if len(halves) != 2 or halves[0] != halves[1] or getattr(mlp, "down_proj", None) is None:
        return "MLP without a gate_up_proj of two equal halves and a down_proj"
    return None


def layout_problem(vllm_model: nn.Module, config: Any) -> str | None:
    """Why ``vllm_model`` cannot be driven layer-wise by :func:`layerwise_over_vllm` (None: it can)."""
    backbone, lm_head = getattr(vllm_model, "model", None), getattr(vllm_model, "lm_head", None)
    if backbone is None or lm_head is None:
        return f"{type(vllm_model).__name__} has no .model / .lm_head"
    if any(getattr(backbone, name, None) is None for name in ("embed_tokens", "layers", "norm")):
        return f"{type(backbone).__name__} lacks embed_tokens, layers or norm"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only SiLU-gated MLPs are mapped)"
    shape = model_shape(config, config.model_type)
    if len(backbone.layers) != shape.num_layers:
        return f"vLLM's model has {len(backbone.layers)} layers, the config {shape.num_layers}"
    problem = _table_problem("embed_tokens", backbone.embed_tokens, shape.vocab_size, shape.hidden_size)
    problem = problem or _table_problem("lm_head", lm_head, shape.vocab_size, shape.hidden_size)
    if problem:
        return problem
    if not _is_rms_norm(backbone.norm, shape.hidden_size):
        return f"final norm is a {type(backbone.norm).__name__}, not a plain RMSNorm"
    for index, layer in enumerate(backbone.layers):
        problem = _layer_problem(layer, shape)
        if problem:
            return f"layer {index}: {problem}"
    return None


def layerwise_over_vllm(
    vllm_model: nn.Module,
    path: Path,
    dtype: torch.dtype,
    home: Path | None = None,
    attention: FusionAttention = "auto",
) -> LayerwiseModel:
    """A :class:`LayerwiseModel` over ``vllm_model``'s own modules (the model at ``path``, loaded by vLLM
    in ``dtype``; ``home``: the cache directory of its checksums; ``attention``: which kernel attends a
    scattered selection, :class:`~.paged.AttentionChoice`); raises :class:`UnknownLayoutError` when they
    are not laid out as expected."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    family = check_supported(config, path)
    problem = layout_problem(vllm_model, config)
    if problem is not None:
        raise UnknownLayoutError(problem)
    weight = vllm_model.model.embed_tokens.weight
    if weight.dtype != dtype:
        raise UnknownLayoutError(f"vLLM's weights are {weight.dtype}, fusion computes in {dtype}")
    shape = model_shape(config, family)
    identity = load_model_tokenizer(path, home)
    return PagedLayerwiseModel(
        CausalLMView(vllm_model, shape.vocab_size, generation_config(path)).eval(),
        shape,
        config_rope(config),
        dtype,
        weight.device,
        tokenizer=identity.tokenizer,
        fingerprint=identity.fingerprint,
        name=identity.name,
        attention=attention,
    )


def sharing_report(model: LayerwiseModel, vllm_model: nn.Module) -> dict[str, int]:
    """How the tensors the fusor computes with relate to vLLM's: how many share storage with one of vLLM's
    parameters or buffers, and how many (and how many bytes) are the fusor's own, i.e. copies."""

    def tensors(module: nn.Module) -> list[torch.Tensor]:
        unique = {id(t): t for t in (*module.parameters(), *module.buffers())}
        return [t for t in unique.values() if t.numel()]

    vllm_storages = {t.untyped_storage().data_ptr() for t in tensors(vllm_model)}
    shared = own = own_bytes = 0
    for tensor in tensors(model.hf_model):
        if tensor.untyped_storage().data_ptr() in vllm_storages:
            shared += 1
        else:
            own += 1
            own_bytes += tensor.numel() * tensor.element_size()
    return {"shared_tensors": shared, "own_tensors": own, "own_bytes": own_bytes}
