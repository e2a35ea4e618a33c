"""A decoder-only transformer we drive one layer at a time (Llama, Mistral, Qwen2, Qwen3).

The weights are the modules of a loaded ``transformers`` model; the forward is ours, in the style of
gpt-fast: embed -> per layer (norm, q/k/v, RoPE, attention, o-proj, residual, norm, MLP, residual) ->
final norm -> LM head, with an explicit KV cache whose slot index equals the token position.

Each layer is split in two calls so that CacheBlend can look at fresh K/V before deciding which tokens
continue: :meth:`LayerwiseModel.project_qkv` and :meth:`LayerwiseModel.attend_and_mlp`. Both accept any
subset of token positions; attention always runs against the full-length K/V of the layer with an exact
causal mask (a token at position p sees the keys at positions 0..p).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .attention import AttentionMask, attend
from .gemm import Gemm
from .rope import Rope, apply_rotary


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the runtime and the KV store need."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int


@dataclass
class QKV:
    """One layer's projections for a set of tokens: q and k rotated to the tokens' positions."""

    q: torch.Tensor  # [B, H, S, d]
    k_prerope: torch.Tensor  # [B, Hkv, S, d]
    k: torch.Tensor  # [B, Hkv, S, d]
    v: torch.Tensor  # [B, Hkv, S, d]


class KVCache:
    """Per-layer K (rotated) and V buffers of shape [B, Hkv, capacity, d]; slot index == token position."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int = 0) -> None:
        self.keys = keys
        self.values = values
        self.length = length  # positions [0, length) hold valid K/V (rows may be shorter: see lengths)

    @classmethod
    def empty(
        cls,
        shape: ModelShape,
        capacity: int,
        batch: int = 1,
        dtype=torch.float32,
        device="cpu",
        zeroed: bool = True,
    ) -> KVCache:
        """Buffers for ``capacity`` positions. ``zeroed=False`` skips clearing them: only for a caller that
        writes every slot before attention reads it (a fusion fills 0..T-1; decoding writes each slot
        before attending it), since a padded batch row would read whatever is there."""
        dims = (batch, shape.num_kv_heads, capacity, shape.head_dim)
        alloc = torch.zeros if zeroed else torch.empty
        keys = [alloc(dims, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        values = [alloc(dims, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        return cls(keys, values)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [B, Hkv, S, d] at slots ``positions`` ([S] shared by all rows, or [B, S])."""
        if positions.dim() == 1:
            self.keys[layer][:, :, positions] = k
            self.values[layer][:, :, positions] = v
            return
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.keys[layer].scatter_(2, index, k)
        self.values[layer].scatter_(2, index, v)

    def grow(self, capacity: int) -> None:
        """Reallocate the buffers to hold at least ``capacity`` positions, keeping their contents."""
        if capacity <= self.capacity:
            return
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                bigger = buf.new_zeros((*buf.shape[:2], capacity, buf.shape[3]))
                bigger[:, :, : buf.shape[2]] = buf
                store[i] = bigger


class LayerwiseModel:
    """Layer-wise forward over the weights of a loaded Hugging Face causal LM, or over any modules laid
    out as one (``hf_model.model.embed_tokens / layers / norm``, ``hf_model.lm_head``); an attention module
    may project q, k and v in one call (``fused_qkv(x) -> (q, k, v)``) instead of q/k/v_proj."""

    def __init__(
        self,
        hf_model,
        shape: ModelShape,
        rope: Rope,
        dtype: torch.dtype,
        device: torch.device,
        tokenizer=None,
        fingerprint: str = "",
        name: str = "",
    ) -> None:
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint  # identifies weights + tokenizer; part of every chunk KV key
        self.name = name
        self.shape = shape
        self.rope = rope
        self.dtype = dtype
        self.device = device
        backbone = hf_model.model
        self.embed_tokens = backbone.embed_tokens
        self.layers = list(backbone.layers)
        self.norm = backbone.norm
        self.lm_head = hf_model.lm_head
        self.scaling = shape.head_dim**-0.5
        self.gemm = Gemm(device, dtype)  # the linear layers' products, by the fastest CPU kernel
        # Token-layers of q/k/v projection and of attention+MLP actually run, so tests and benchmarks can
        # check the work a method really did.
        self.qkv_token_layers = 0
        self.attention_token_layers = 0
        # One forward at a time over these weights, whichever engine or thread runs it.
        self.forward_lock = threading.RLock()

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    # -- the pieces of one decoder layer -------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids.to(self.device))

    @torch.inference_mode()
    def project_qkv(
        self,
        layer: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> QKV:
        """Input norm and q/k/v projections of ``hidden`` [B, S, D]; q and k rotated to ``positions``.
        ``cos_sin`` (``rope.cos_sin(positions, dtype)``) may be passed to share the tables across layers."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        b, s, _ = x.shape
        # a fused projection (vLLM's qkv_proj, see engine/vllm/weights.py) gives q, k, v in one GEMM
        fused = getattr(attn, "fused_qkv", None)
        if fused is not None:
            q, k, v = fused(x)
        else:
            q, k, v = self.gemm(attn.q_proj, x), self.gemm(attn.k_proj, x), self.gemm(attn.v_proj, x)
        q = q.view(b, s, -1, self.shape.head_dim)
        k = k.view(b, s, -1, self.shape.head_dim)
        v = v.view(b, s, -1, self.shape.head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3 normalises q and k per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos_sin if cos_sin is not None else self.rope.cos_sin(positions, x.dtype)
        self.qkv_token_layers += b * s
        return QKV(q=apply_rotary(q, cos, sin), k_prerope=k, k=apply_rotary(k, cos, sin), v=v)

    @torch.inference_mode()
    def attend_and_mlp(
        self,
        layer: int,
        hidden: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: AttentionMask,
    ) -> torch.Tensor:
        """Attention of ``q`` over the full ``keys``/``values`` [B, Hkv, T, d] under ``mask``, then o-proj,
        residual, post-attention norm, MLP and residual. Returns the layer output [B, S, D]."""
        return self.finish_layer(layer, hidden, self.attend(q, keys, values, mask))

    def prepare_mask(self, mask: AttentionMask, q: torch.Tensor, keys: torch.Tensor) -> None:
        """Build now what :meth:`attend` builds on its first call with ``mask`` (a caller timing the
        attention of a layer keeps that one-off cost out of it)."""
        if mask.blocks and q.device.type == "cpu":
            mask.windows(q.dtype, q.shape[1] // keys.shape[1])
        elif mask.tensor is not None:
            mask.additive(q.dtype)

    @torch.inference_mode()
    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """Attention of ``q`` [B, H, S, d] over ``keys``/``values`` [B, Hkv, T, d] under ``mask``, heads
        concatenated: [B, S, H * d] (the o-proj's input)."""
        b, _, s, _ = q.shape
        self.attention_token_layers += b * s
        return attend(q, keys, values, mask, self.scaling).transpose(1, 2).reshape(b, s, -1)

    @torch.inference_mode()
    def finish_layer(self, layer: int, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of a layer for tokens whose attention output is ``attended`` [B, S, H * d]: o-proj,
        residual, post-attention norm, MLP and residual. Per token, so tokens of several sequences may
        be stacked along S."""
        block = self.layers[layer]
        hidden = hidden + self.gemm(block.self_attn.o_proj, attended)
        return hidden + self.gemm.mlp(block.mlp, block.post_attention_layernorm(hidden))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, in float32."""
        return self.gemm(self.lm_head, self.norm(hidden)).float()

    # -- whole forwards over an explicit cache -------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Run every layer for ``ids`` [B, S] at ``positions`` ([S] or [B, S]), writing their K/V into
        ``cache`` and attending over slots ``0..max(positions)``. Returns logits of the last token per row
        ([B, vocab]) or of every token ([B, S, vocab]) when ``all_logits``.

        Without ``all_logits``, the last layer attends and runs the MLP for the last token only (its K/V
        are every token's, and nothing else reads the other tokens' outputs there)."""
        end = int(positions.max()) + 1
        if end > cache.capacity:
            cache.grow(end)
        hidden = self.embed(ids).to(self.dtype)
        mask = AttentionMask.for_positions(positions, end)
        cos_sin = self.rope.cos_sin(positions, self.dtype)
        one_sequence = positions.dim() == 1 and positions.numel() > 1
        last_only = not all_logits and one_sequence and int(positions[-1]) + 1 == end
        for layer in range(self.num_layers):
            qkv = self.project_qkv(layer, hidden, positions, cos_sin)
            cache.write(layer, positions, qkv.k, qkv.v)
            q = qkv.q
            if last_only and layer == self.num_layers - 1:
                hidden, q = hidden[:, -1:], q[:, :, -1:]
                mask = AttentionMask.for_positions(positions[-1:], end)
            hidden = self.attend_and_mlp(
                layer, hidden, q, cache.keys[layer][:, :, :end], cache.values[layer][:, :, :end], mask
            )
        cache.length = max(cache.length, end)
        return self.logits(hidden if all_logits else hidden[:, -1])

    def new_cache(self, capacity: int, batch: int = 1, zeroed: bool = True) -> KVCache:
        return KVCache.empty(
            self.shape, capacity, batch=batch, dtype=self.dtype, device=self.device, zeroed=zeroed
        )

    @torch.inference_mode()
    def prefill(self, ids: list[int] | torch.Tensor, extra_capacity: int = 0, all_logits: bool = False):
        """Full prefill of one sequence from position 0. Returns (logits, cache)."""
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
        n = ids_t.shape[1]
        cache = self.new_cache(n + extra_capacity)
        logits = self.forward(ids_t, torch.arange(n, device=self.device), cache, all_logits=all_logits)
        return logits, cache
