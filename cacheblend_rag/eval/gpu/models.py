"""Random-weight models in the shapes of named real ones, in plain torch, for the accelerator check.

Each :class:`Config` is a real model's config.json reduced to what sizes its weights; :func:`build_model`
lays random weights out as a Hugging Face causal LM (``model.embed_tokens / layers / norm``, ``lm_head``),
which is all :class:`LayerwiseModel` drives: nothing is downloaded and ``transformers`` is not needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...models.rope import Rope
from ...models.runtime import LayerwiseModel, ModelShape


@dataclass(frozen=True)
class Config:
    """The shape of a real model (its config.json), enough to build random weights of that size."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    max_context: int
    qkv_bias: bool = False
    tie_embeddings: bool = False
    # Llama 3.1's rope scaling (factor, low_freq_factor, high_freq_factor, original context); None: plain
    llama3_rope: tuple[float, float, float, int] | None = None


CONFIGS = {
    "llama-3.1-8b": Config(
        "llama-3.1-8b",
        32,
        4096,
        32,
        8,
        128,
        14336,
        128256,
        500000.0,
        131072,
        llama3_rope=(8.0, 1.0, 4.0, 8192),
    ),
    "qwen2.5-1.5b": Config(
        "qwen2.5-1.5b",
        28,
        1536,
        12,
        2,
        128,
        8960,
        151936,
        1000000.0,
        32768,
        qkv_bias=True,
        tie_embeddings=True,
    ),
    "tiny": Config("tiny", 3, 64, 4, 2, 16, 128, 512, 10000.0, 8192, qkv_bias=True),
}


class RMSNorm(nn.Module):
    """RMS norm computed in float32, as Llama and Qwen2 compute it."""

    def __init__(self, size: int, device, dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, c: Config, **kw) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **kw)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **kw)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, **kw)
        self.act_fn = nn.SiLU()  # (named as transformers names it: the fused steps look for it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, c: Config, **kw) -> None:
        super().__init__()
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q, bias=c.qkv_bias, **kw)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias, **kw)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=c.qkv_bias, **kw)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=False, **kw)


class Block(nn.Module):
    def __init__(self, c: Config, **kw) -> None:
        super().__init__()
        self.self_attn = Attention(c, **kw)
        self.mlp = SwiGLU(c, **kw)
        self.input_layernorm = RMSNorm(c.hidden_size, **kw)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, **kw)


class Backbone(nn.Module):
    def __init__(self, c: Config, **kw) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **kw)
        self.layers = nn.ModuleList(Block(c, **kw) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, **kw)


class CausalLM(nn.Module):
    """Modules laid out as a Hugging Face causal LM (``model.embed_tokens / layers / norm``, ``lm_head``),
    which is all :class:`LayerwiseModel` drives."""

    def __init__(self, c: Config, **kw) -> None:
        super().__init__()
        self.model = Backbone(c, **kw)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, **kw)
        if c.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def inv_freq(c: Config) -> torch.Tensor:
    """RoPE inverse frequencies of the config, with Llama 3.1's frequency-dependent scaling if it has it."""
    freqs = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    if c.llama3_rope is None:
        return freqs.float()
    factor, low, high, original = c.llama3_rope
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, freqs / factor, freqs)
    mid = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(mid, (1 - smooth) * freqs / factor + smooth * freqs, scaled).float()


def build_model(c: Config, device: torch.device, dtype: torch.dtype, seed: int) -> LayerwiseModel:
    torch.manual_seed(seed)
    with torch.no_grad():
        hf_like = CausalLM(c, device=device, dtype=dtype).eval()
    shape = ModelShape(
        "llama",
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.max_context,
    )
    return LayerwiseModel(
        hf_like,
        shape,
        Rope(inv_freq(c)),
        dtype,
        device,
        fingerprint=f"gpu-check-{c.name}-{seed}",
        name=c.name,
    )
