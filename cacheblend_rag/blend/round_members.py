"""A round's members' own text, computed together over the round's one blended cache.

After a round's prompt is fused (:mod:`.round`), each member still computes its own text (before, between
and after the chunks) over the round's blended chunks. Done as a request of its own, every member would
copy and re-rotate the whole blended KV into a cache of its own first, at every layer, before computing a
few dozen tokens over it. Instead all members of a round are one :class:`~.layers.LayerPass` over the
round's cache itself:

- a member whose chunks all sit ``delta`` positions from where the round's prompt has them (the same order
  behind a longer or shorter text of its own) is computed at positions shifted by ``-delta``: RoPE
  attention depends on position differences only, so its queries meet the blended keys exactly as its own
  prompt would place them, and nothing of the blend is moved. Its own cached segments (the template's
  opening, exact) and its fresh text's K/V are written, in that shifted frame, after the round's prompt in
  the same cache. Every member's rows attend to the round's prompt in one call, under a mask that shows
  each member only the round's chunks (not the round's own text), causally, and each member's rows to its
  own slots, causally; the two softmaxes are merged through their log-sum-exps (on CPU; elsewhere, or
  when a member has text before its first chunk, one masked call over every slot);
- projections and MLPs run over every member's tokens at once (and beside any other request fused in the
  same batch);
- each member's result holds its own K/V at its true positions and, as its ``context``, its view of the
  round's cache, over which the batch scheduler decodes it in place (:mod:`.context`: the blend held
  once); its chunks' K/V is copied out of the round's cache, rotated straight to the member's positions,
  only when someone needs the member's whole cache (:attr:`FusionResult.cache`, e.g. decoding it alone)
  or writes it into a buffer of its own (:meth:`FusionResult.write_into`).

A member whose chunks do not share one shift (its own chunk order), whose method would compute some of
its cached tokens, whose last token is a chunk's or that has an attention observer is fused as a request
of its own over its chunks' blend taken out of the round's cache (``round._member``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models.attention import AttentionMask, RowBlock, flash_with_lse, merge_attention
from ..models.rope import Rope
from ..models.runtime import KVCache, LayerwiseModel
from .context import RoundKV, SharedContext
from .fusor import FusionResult, RoundShare
from .methods import RecomputeMethod
from .plan import FusionPlan
from .segments import LayerKVProvider, Segment

# (a chunk's token ids, which occurrence of it in the prompt): how a round matches its members' chunks
ChunkKey = tuple[tuple[int, ...], int]


@dataclass
class MemberLayout:
    """Where one member's tokens go in the round's cache: its plan (round chunks marked exact), the shift of
    its chunks from the round's prompt, its own positions (everything not a round chunk) and their slots."""

    plan: FusionPlan
    method: RecomputeMethod
    provider: LayerKVProvider  # the member's own cached segments (not the round's chunks), in order
    delta: int  # member position - round position of every one of its chunks
    chunk_spans: list[tuple[tuple[int, int], tuple[int, int]]]  # (round span, member span) per chunk
    own_spans: list[tuple[int, int]]  # the member's own cached segments' spans (their KV from provider)
    own_positions: torch.Tensor  # [m] ascending: every position not in a round chunk
    rows: torch.Tensor  # [s] the positions computed (its fresh text), ascending
    extra_capacity: int
    share: RoundShare
    slot: int = 0  # first slot of its own tokens in the round's cache (set by MembersPass)


def layout(
    plan: FusionPlan,
    occurrences: Sequence[ChunkKey | None],
    round_starts: dict[ChunkKey, int],
    method: RecomputeMethod,
) -> tuple[int, list[tuple[tuple[int, int], tuple[int, int]]]] | None:
    """(shift, [(round span, member span)]) when the member can join the round's pass: every round chunk
    at one shift from the round's prompt, the method computing exactly its fresh text, none of it a
    chunk's. None otherwise (it is fused as a request of its own)."""
    deltas, spans = set(), []
    for (start, end), key in zip(plan.spans, occurrences, strict=True):
        if key is None:
            continue
        origin = round_starts[key]
        deltas.add(start - origin)
        spans.append(((origin, origin + end - start), (start, end)))
    if len(deltas) != 1:
        return None
    chunk = torch.zeros(plan.num_tokens, dtype=torch.bool)
    for _, (start, end) in spans:
        chunk[start:end] = True
    if bool(chunk[plan.must_compute].any()):
        return None
    computed = method.layer0_positions(plan).cpu()
    if not torch.equal(computed, plan.must_compute.nonzero().squeeze(1)):
        return None
    return deltas.pop(), spans


class RoundChunksKV:
    """A member's chunks' K/V kept in the round's cache: written, rotated to the member's positions, into
    whatever buffer holds the member's KV (its own cache, a decode batch row)."""

    def __init__(self, model: LayerwiseModel, cache: KVCache, layout: MemberLayout) -> None:
        self.cache = cache
        self.spans = [member for _, member in layout.chunk_spans]
        self.sources = [source for source, _ in layout.chunk_spans]
        self.tables = None
        if layout.delta:
            here = torch.cat([torch.arange(s, e) for s, e in self.sources]).to(model.device)
            self.tables = model.rope.rerotation(here, here + layout.delta, torch.float32)

    def write(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], row: int) -> None:
        """Write the chunks' K/V into row ``row`` of per-layer buffers [rows, Hkv, capacity, d]."""
        for layer in range(len(keys)):
            offset = 0
            for (s, e), (ms, me) in zip(self.sources, self.spans, strict=True):
                source = self.cache.keys[layer][0, :, s:e]
                if self.tables is None:
                    keys[layer][row, :, ms:me].copy_(source)
                else:
                    part = tuple(t[offset : offset + e - s] for t in self.tables)
                    Rope.apply_rerotation_into(keys[layer][row, :, ms:me], source, part)
                values[layer][row, :, ms:me].copy_(self.cache.values[layer][0, :, s:e])
                offset += e - s


class MembersPass:
    """Every joining member of one round as one :class:`~.layers.LayerPass` over the round's cache, whose
    slots past the round's prompt (``length``) take the members' own tokens."""

    def __init__(
        self, model: LayerwiseModel, cache: KVCache, length: int, members: list[MemberLayout]
    ) -> None:
        self.started = time.perf_counter()
        self.model, self.cache, self.length, self.members = model, cache, length, members
        device = model.device
        slot = length
        for member in members:
            member.slot = slot
            slot += member.own_positions.numel()
        self.keys_end = slot
        if slot > cache.capacity:
            raise ValueError(f"the round's cache holds {cache.capacity} slots, its members need {slot}")
        # each member's own cache (its true positions); its chunk slots are written only when needed
        self.own = [model.new_cache(m.plan.num_tokens + m.extra_capacity, zeroed=False) for m in members]
        shifted = torch.cat([m.rows - m.delta for m in members]).to(device)
        self.positions = shifted  # rope at the shifted positions: the round's frame
        self.cos_sin = model.rope.cos_sin(shifted, model.dtype)
        ids = torch.cat([m.plan.token_ids[m.rows] for m in members])
        self.hidden = model.embed(ids[None]).to(model.dtype)
        self.own_tables = [self._own_tables(m) for m in members]
        # per member, the slots of its own positions in the round's cache; every row's slot; the tables
        # that turn the rows' fresh K (projected in the round's frame) to their true positions (none when
        # no member is shifted)
        self.own_slots = []
        for member in members:
            slots = torch.full((member.plan.num_tokens,), -1, dtype=torch.long)
            slots[member.own_positions] = torch.arange(member.own_positions.numel()) + member.slot
            self.own_slots.append(slots)
        self.row_slots = torch.cat([own[m.rows] for own, m in zip(self.own_slots, members, strict=True)])
        self.row_slots = self.row_slots.to(device)
        self.member_rows = [m.rows.to(device) for m in members]
        true = torch.cat(self.member_rows)
        self.to_true = (
            model.rope.rerotation(shifted, true, torch.float32) if any(m.delta for m in members) else None
        )
        self.mask = self._mask(device)
        self.split = self._split(model.dtype) if device.type == "cpu" else None
        self.load_wait = 0.0

    def _own_tables(self, member: MemberLayout) -> list[tuple[tuple, tuple | None]]:
        """Per own cached segment, tables from its stored 0..n-1 to its positions in the round's frame, and
        to its true positions (None when it stays at 0..n-1: a prompt's head)."""
        tables = []
        for start, end in member.own_spans:
            local = torch.arange(end - start, device=self.model.device)
            shifted = self.model.rope.rerotation(local, local + start - member.delta, torch.float32)
            true = self.model.rope.rerotation(local, local + start, torch.float32) if start else None
            tables.append((shifted, true))
        return tables

    def _mask(self, device: torch.device) -> AttentionMask:
        """Each member's rows see the round's chunks (shifted, causally) and their own tokens (causally);
        attended in one call (the slots a row does not see are masked)."""
        rows = sum(m.rows.numel() for m in self.members)
        visible = torch.zeros(rows, self.keys_end, dtype=torch.bool)
        first = 0
        for member in self.members:
            end = first + member.rows.numel()
            chunk_slots = torch.zeros(self.length, dtype=torch.bool)
            for (s, e), _ in member.chunk_spans:
                chunk_slots[s:e] = True
            shifted = (member.rows - member.delta)[:, None]
            visible[first:end, : self.length] = chunk_slots & (torch.arange(self.length)[None] <= shifted)
            own_end = member.slot + member.own_positions.numel()
            visible[first:end, member.slot : own_end] = member.own_positions[None] <= member.rows[:, None]
            first = end
        # one block over every slot, none of them visible to every row (seen = 0): one masked call
        return AttentionMask(visible[None, None].to(device), False, (RowBlock(0, rows, 0, self.keys_end),))

    def _split(self, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The masks of :meth:`attend`'s two parts (additive, ``dtype``): every row over the round's prompt,
        each member's rows over its own slots. None when a row sees none of the round's prompt (its text
        before the first chunk): its part would be empty, and the one call over every slot serves."""
        visible = self.mask.tensor[0, 0].cpu()
        prompt = visible[:, : self.length]
        if not bool(prompt.any(dim=1).all()):
            return None

        def additive(seen: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(seen.shape, dtype=dtype)
            return out.masked_fill_(~seen, float("-inf"))[None, None].to(self.model.device)

        own, first = [], 0
        for member in self.members:
            end = first + member.rows.numel()
            own.append(additive(visible[first:end, member.slot : member.slot + member.own_positions.numel()]))
            first = end
        return additive(prompt), own

    def attention_inputs(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keys[:, :, self.row_slots] = k
        values[:, :, self.row_slots] = v
        true_k = k
        if self.to_true is not None:
            true_k = torch.empty_like(k)
            Rope.apply_rerotation_into(true_k[0], k[0], self.to_true)
        first = 0
        for i, (member, own) in enumerate(zip(self.members, self.own, strict=True)):
            waited = time.perf_counter()
            layer_kv = member.provider.layer(layer)  # providers serve layers in order; always ask
            self.load_wait += time.perf_counter() - waited
            for (ck, cv), (start, end), (shifted, true) in zip(
                layer_kv, member.own_spans, self.own_tables[i], strict=True
            ):
                ck, slot = ck.to(keys.device), int(self.own_slots[i][start])
                Rope.apply_rerotation_into(keys[0, :, slot : slot + end - start], ck, shifted)
                values[0, :, slot : slot + end - start].copy_(cv)
                if true is None:
                    own.keys[layer][0, :, start:end].copy_(ck)
                else:
                    Rope.apply_rerotation_into(own.keys[layer][0, :, start:end], ck, true)
                own.values[layer][0, :, start:end].copy_(cv)
            rows = slice(first, first + member.rows.numel())
            first = rows.stop
            own.write(layer, self.member_rows[i], true_k[:, :, rows], v[:, :, rows])
        end = self.keys_end
        return q, keys[:, :, :end], values[:, :, :end], self.mask

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        if self.split is None:
            return self.model.attend(q, keys, values, mask)
        # every row over the round's prompt (its chunks, masked), then each member's rows over its own
        # slots only, merged through the log-sum-exps: in one call over every slot each row would also
        # score every other member's slots, masked (a third of the keys at 16 agents)
        self.model.attention_token_layers += q.shape[2]
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        prompt_mask, own_masks = self.split

        def part(rows: slice, slots: slice, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q_rows, k_slots, v_slots = q[:, :, rows], keys[:, :, slots], values[:, :, slots]
            return flash_with_lse(q_rows, k_slots, v_slots, self.model.scaling, mask=visible)

        shared, shared_lse = part(slice(None), slice(0, self.length), prompt_mask)
        own, own_lse = torch.empty_like(shared), torch.empty_like(shared_lse)
        first = 0
        for member, own_mask in zip(self.members, own_masks, strict=True):
            rows = slice(first, first + member.rows.numel())
            first = rows.stop
            slots = slice(member.slot, member.slot + member.own_positions.numel())
            own[:, :, rows], own_lse[:, :, rows] = part(rows, slots, own_mask)
        out = merge_attention(shared, shared_lse, own, own_lse).to(q.dtype)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def results(self) -> list[FusionResult]:
        """Each member's result: its logits, its own K/V and its chunks' K/V pending in the round's cache."""
        last, first = [], 0
        for member in self.members:
            first += member.rows.numel()
            last.append(first - 1)
        logits = self.model.logits(self.hidden[0, last])
        seconds = time.perf_counter() - self.started
        layers = self.model.num_layers
        end = self.keys_end
        round_kv = RoundKV(
            [k[:, :, :end] for k in self.cache.keys], [v[:, :, :end] for v in self.cache.values]
        )
        out = []
        for i, (member, own) in enumerate(zip(self.members, self.own, strict=True)):
            own.length = member.plan.num_tokens
            count = member.rows.numel()
            out.append(
                FusionResult(
                    buffer=own,
                    logits=logits[i],
                    plan=member.plan,
                    selected=member.rows.clone(),
                    qkv_tokens_per_layer=[count] * layers,
                    attended_tokens_per_layer=[count] * layers,
                    seconds=seconds,
                    load_wait_s=self.load_wait / len(self.members),
                    round=member.share,
                    pending=RoundChunksKV(self.model, self.cache, member),
                    context=SharedContext(round_kv, self._visible(member), member.delta),
                )
            )
        return out

    def _visible(self, member: MemberLayout) -> torch.Tensor:
        """The round's slots a member's later tokens see: the round's chunks and its own prompt's tokens."""
        visible = torch.zeros(self.keys_end, dtype=torch.bool)
        for (start, end), _ in member.chunk_spans:
            visible[start:end] = True
        visible[member.slot : member.slot + member.own_positions.numel()] = True
        return visible.to(self.model.device)

    def close(self) -> None:
        for member in self.members:
            member.provider.close()


def own_spans(segments: Sequence[Segment], plan: FusionPlan, occurrences: Sequence[ChunkKey | None]):
    """The spans of a member's own cached segments (cached, not a round chunk) and their KV sources."""
    spans, sources = [], []
    for segment, span, key in zip(segments, plan.spans, occurrences, strict=True):
        if segment.kv is not None and key is None:
            spans.append(span)
            sources.append(segment.kv)
    return spans, sources
