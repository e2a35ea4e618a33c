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

import itertools
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

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


# Ascending query positions (a CacheBlend selection) are attended in row blocks. A block's rows all see the
# keys before its first row's position: on CPU that rectangle is one unmasked flash-attention call, and only
# the window from its first row's position to its last row's is masked (two calls merged by log-sum-exp;
# grouped-query heads packed as rows, so each call has many rows per KV head). Elsewhere (CUDA) a block is
# one masked call over the keys up to its last row. At most ATTENTION_ROW_BLOCKS blocks of at least
# ATTENTION_BLOCK_ROWS rows: on this Intel Xeon (2 threads, the default's real selections of 490 / 957 rows
# of 3,132 / 6,210 positions) 6 such blocks attend in 12.4 / 49.2 ms per layer, where 16 masked blocks
# took 14.7 / 61.2 ms (scripts/row_block_attention.py).
ATTENTION_ROW_BLOCKS = 6
ATTENTION_BLOCK_ROWS = 64


class RowBlock(NamedTuple):
    """Rows ``start..end-1`` of a selection: every one sees keys ``0..seen-1`` (the positions before its
    first row), and keys ``seen..key_end-1`` only up to its own position."""

    start: int
    end: int
    seen: int
    key_end: int


def row_blocks(positions: torch.Tensor, count: int) -> tuple[RowBlock, ...]:
    """Ascending ``positions`` cut into ``count`` blocks of (nearly) equal rows."""
    bounds = torch.linspace(0, positions.numel(), count + 1).long().tolist()
    return tuple(
        RowBlock(start, end, int(positions[start]), int(positions[end - 1]) + 1)
        for start, end in itertools.pairwise(bounds)
        if end > start
    )


@dataclass(frozen=True)
class AttentionMask:
    """Exact causal visibility for queries at given positions over keys at slots 0..T-1.

    Built once per forward and shared by all layers. The two common shapes need no mask tensor: a full
    prefill (queries 0..T-1, SDPA's own causal kernel) and queries that all sit at the last slot (decode).
    Ascending positions of one sequence come with ``blocks`` (:class:`RowBlock`).
    """

    tensor: torch.Tensor | None
    is_causal: bool
    blocks: tuple[RowBlock, ...] = ()
    # queries are the contiguous positions suffix_start..T-1 (a prefix-cache hit, a chunk prefilled behind
    # its context): on CPU attended as the keys before them, unmasked, merged with a causal square
    suffix_start: int | None = None
    # ``tensor`` as an additive float mask per dtype (and each block's window of it per dtype and head
    # group), made on first use and kept for every layer (SDPA would otherwise convert the boolean mask
    # again at each call)
    _additive: dict = field(default_factory=dict, compare=False, repr=False)

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """``tensor`` as 0 where visible and -inf elsewhere, in ``dtype``."""
        found = self._additive.get(dtype)
        if found is None:
            found = torch.zeros(self.tensor.shape, dtype=dtype, device=self.tensor.device)
            found.masked_fill_(~self.tensor, float("-inf"))
            self._additive[dtype] = found
        return found

    def windows(self, dtype: torch.dtype, groups: int) -> list[torch.Tensor | None]:
        """Each block's additive mask over its window (keys ``seen..key_end-1``), its rows repeated once
        per query head of a KV group as :func:`_row_block_attention` packs them: [1, 1, groups * rows,
        window]; None for a block with ``seen == 0`` (attended as one grouped-query call, unrepeated)."""
        key = (dtype, groups)
        found = self._additive.get(key)
        if found is None:
            additive = self.additive(dtype)
            found = [
                additive[:, :, b.start : b.end, b.seen : b.key_end].repeat(1, 1, groups, 1).contiguous()
                if b.seen
                else None
                for b in self.blocks
            ]
            self._additive[key] = found
        return found

    @classmethod
    def for_positions(cls, positions: torch.Tensor, key_length: int) -> AttentionMask:
        blocks: tuple[RowBlock, ...] = ()
        if positions.dim() == 1:
            if positions.numel() == key_length and bool(
                (positions == torch.arange(key_length, device=positions.device)).all()
            ):
                return cls(None, True)
            if bool((positions == key_length - 1).all()):
                return cls(None, False)
            start = key_length - positions.numel()
            if (
                positions.device.type == "cpu"
                and positions.numel() > 1
                and bool((positions == torch.arange(start, key_length, device=positions.device)).all())
            ):
                return cls(None, False, suffix_start=start)
            if positions.numel() > 1 and bool((positions[1:] > positions[:-1]).all()):
                count = max(1, min(ATTENTION_ROW_BLOCKS, positions.numel() // ATTENTION_BLOCK_ROWS))
                blocks = row_blocks(positions, count)
            positions = positions[None]
        key_positions = torch.arange(key_length, device=positions.device)
        # [B, 1, S, T]: the query at position p sees the keys at positions 0..p
        return cls(key_positions[None, None, None, :] <= positions[:, None, :, None], False, blocks)


def _suffix_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scaling: float
) -> torch.Tensor:
    """Exact causal attention of queries at positions start..T-1 over keys 0..T-1, as two fast CPU
    kernels: every query sees keys 0..start-1 (no mask), and keys start..T-1 form a causal square; the two
    softmaxes are merged through their log-sum-exps. A boolean mask over the whole rectangle runs the
    masked kernel, about 1.5x slower here."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    seen, seen_lse = flash_with_lse(q, keys[:, :, :start], values[:, :, :start], scaling)
    own, own_lse = flash_with_lse(q, keys[:, :, start:], values[:, :, start:], scaling, causal=True)
    return merge_attention(seen, seen_lse, own, own_lse).to(q.dtype)


def _masked_block_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: AttentionMask,
    block: RowBlock,
    scaling: float,
) -> torch.Tensor:
    """One block's rows in one masked grouped-query SDPA call over the keys up to its last row."""
    return F.scaled_dot_product_attention(
        q[:, :, block.start : block.end],
        keys[:, :, : block.key_end],
        values[:, :, : block.key_end],
        attn_mask=mask.additive(q.dtype)[:, :, block.start : block.end, : block.key_end],
        scale=scaling,
        enable_gqa=True,
    )


def _row_block_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask, scaling: float
) -> torch.Tensor:
    """Exact attention of a selection's rows (``mask.blocks``) on CPU: per block, the keys every row sees
    (an unmasked flash call) and the window after them (a masked one), merged through their log-sum-exps;
    each KV head's query heads packed as rows ([1, Hkv, groups * rows, d]), which the kernel attends faster
    than grouped-query heads (see :data:`ATTENTION_ROW_BLOCKS`). A block no key of which every row sees
    (``seen == 0``) is one masked grouped-query call, whatever its mask. Returns [1, H, S, d]."""
    heads, kv_heads, d = q.shape[1], keys.shape[1], q.shape[3]
    groups = heads // kv_heads
    outs = []
    for block, window in zip(mask.blocks, mask.windows(q.dtype, groups), strict=True):
        if window is None:  # no key every row sees: one masked call (a mask of any shape, e.g. a round's)
            outs.append(_masked_block_attention(q, keys, values, mask, block, scaling))
            continue
        rows = block.end - block.start
        packed = q[:, :, block.start : block.end].reshape(1, kv_heads, groups * rows, d)
        k_window, v_window = keys[:, :, block.seen : block.key_end], values[:, :, block.seen : block.key_end]
        out, lse = flash_with_lse(packed, k_window, v_window, scaling, mask=window)
        seen, seen_lse = flash_with_lse(packed, keys[:, :, : block.seen], values[:, :, : block.seen], scaling)
        out = merge_attention(seen, seen_lse, out, lse).to(q.dtype)
        outs.append(out.reshape(1, heads, rows, d))
    return torch.cat(outs, dim=2)


def flash_with_lse(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention of ``q`` [B, H, S, d] over ``keys``/``values`` with as many heads (the kernel
    has no grouped-query heads): its output [B, H, S, d] and log-sum-exp [B, H, S], which
    :func:`merge_attention` needs and no public SDPA call returns. ``mask``: additive or boolean."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = kernel(q, keys, values, is_causal=causal, attn_mask=mask, scale=scale)[:2]
    return out, lse


def merge_attention(
    first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
) -> torch.Tensor:
    """The attention output over two disjoint sets of keys from each set's own output [B, H, S, d] and
    log-sum-exp [B, H, S]: the softmaxes re-weighted to one (a row must see a key in at least one set)."""
    top = torch.maximum(first_lse, second_lse)
    first_w, second_w = torch.exp(first_lse - top).unsqueeze(-1), torch.exp(second_lse - top).unsqueeze(-1)
    return (first * first_w + second * second_w) / (first_w + second_w)


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
        if mask.is_causal:
            # SDPA's causal CPU kernel is about twice as fast on materialised heads as with enable_gqa
            groups = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=self.scaling)
        elif mask.suffix_start is not None:
            out = _suffix_attention(q, keys, values, mask.suffix_start, self.scaling)
        elif mask.blocks and q.device.type == "cpu":
            out = _row_block_attention(q, keys, values, mask, self.scaling)
        elif mask.blocks:
            out = torch.cat(
                [_masked_block_attention(q, keys, values, mask, b, self.scaling) for b in mask.blocks], dim=2
            )
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask.tensor, scale=self.scaling, enable_gqa=True
            )
        return out.transpose(1, 2).reshape(b, s, -1)

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
