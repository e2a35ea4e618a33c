"""A round's blended KV as decode rows read it: in place, held once for all of the round's agents.

A round's members (:mod:`.round_members`) are computed in the round's frame: every member's queries sit at
its own positions minus its shift ``delta``, so they meet the round's blended chunk keys where its own
prompt places them, and its own tokens' K/V lie after the round's prompt in the round's cache. Decoding
can go on in that frame: a member's new tokens are projected at ``position - delta`` and attend to the
round's cache under the member's visibility (the round's chunks and its own tokens) plus the tokens it
generated itself. RoPE attention depends on position differences only, so this is the attention of the
member's own prompt, and the round's KV is never copied per agent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class RoundKV:
    """The round's cache (per layer [1, Hkv, length, d], K rotated to the round's frame), shared by every
    member decoding over it."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(frozen=True, eq=False)
class SharedContext:
    """One member's view of a :class:`RoundKV`: the slots it sees (``visible`` [length] bool: the round's
    chunks and its own prompt's tokens) and its shift (its positions minus the round's frame)."""

    kv: RoundKV
    visible: torch.Tensor
    delta: int
