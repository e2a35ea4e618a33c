"""Rotary position embeddings (RoPE) at arbitrary positions, and re-rotation of keys between positions.

Angles are computed in float32 whatever the compute dtype, exactly as ``transformers`` computes them, so our
keys match a full prefill. Re-rotation works in float64: re-rotating a cached key by thousands of positions
in bf16, or even by a float32 angle offset, would lose the low-order bits that distinguish nearby positions.
"""

from __future__ import annotations

import torch


class Rope:
    """RoPE tables for one model: ``inv_freq`` (already scaled by the model's rope type) and the amplitude
    ``attention_scaling`` that some rope types (yarn, longrope) multiply into cos/sin."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq.detach().to(torch.float32)
        self.attention_scaling = float(attention_scaling)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, scaled: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape ``positions.shape + (head_dim,)`` for integer ``positions`` (any shape)."""
        freqs = self.angles(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        amplitude = self.attention_scaling if scaled else 1.0
        return (emb.cos() * amplitude).to(dtype), (emb.sin() * amplitude).to(dtype)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotation angles ``positions.shape + (head_dim // 2,)`` in float32, as the model computes them."""
        return positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape [B, heads, S, d] to ``positions`` of shape [B, S] (or [S])."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return apply_rotary(x, cos, sin)

    def rerotate(
        self, keys: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor
    ) -> torch.Tensor:
        """Move keys already rotated to ``from_positions`` so they are rotated to ``to_positions``.

        RoPE rotations compose additively, R(a) = R(a - b) R(b), so this is a pure rotation (without the
        amplitude factor, which the keys already carry) by the difference of the float32 angles that
        :meth:`apply` uses at each end. Rotating by ``(q - p) * inv_freq`` instead would differ from a key
        rotated to q directly by the float32 rounding of angles of thousands of radians (~1e-3 on real keys).
        Computed in float64.
        """
        return self.apply_rerotation(keys, self.rerotation(from_positions, to_positions))

    def rerotation(
        self, from_positions: torch.Tensor, to_positions: torch.Tensor, dtype: torch.dtype = torch.float64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables of :meth:`rerotate` (they depend on the positions only, so a caller moving
        the keys of every layer by the same positions computes them once). The angle difference is always
        formed in float64 — that is where precision is lost; the tables may then be rounded to ``dtype``:
        float32 tables turn a key within ~1e-6 of the float64 result (``tests/models/test_rope.py``)."""
        delta = self.angles(to_positions).double() - self.angles(from_positions).double()
        emb = torch.cat((delta, delta), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply_rerotation(keys: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate ``keys`` by tables from :meth:`rerotation`, in the tables' dtype; returns ``keys``'
        dtype."""
        cos, sin = tables
        return apply_rotary(keys.to(cos.dtype), cos, sin).to(keys.dtype)

    @staticmethod
    def apply_rerotation_into(
        out: torch.Tensor, keys: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """Write ``keys`` rotated by tables from :meth:`rerotation` into ``out`` (e.g. a KV cache slice of
        the same shape): when ``out`` has the tables' dtype, with no temporary the size of ``keys``."""
        cos, sin = tables
        if out.dtype != cos.dtype:
            out.copy_(Rope.apply_rerotation(keys, tables))
            return
        x = keys.to(cos.dtype)
        half = x.shape[-1] // 2
        # rotate_half's halves written directly: the tables repeat over the two halves of a head
        c, s = cos[..., :half], sin[..., :half]
        x1, x2, out1, out2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
        torch.mul(x1, c, out=out1).addcmul_(x2, s, value=-1)
        torch.mul(x2, c, out=out2).addcmul_(x1, s)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, heads, S, d] by cos/sin of shape [B, S, d] or [S, d] (broadcast over heads)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin
