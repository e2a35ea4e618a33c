"""Decoding, written once: one request's decode state (:class:`DecodeRow`) and the step that advances one
row or a batch of them (:func:`decode_step`).

A row is made when its prompt has been fused: :meth:`DecodeRow.start` takes the fusion's KV and the logits
of the prompt's last token and chooses the first token; each :func:`decode_step` feeds every row's last
token at its own position in one forward and lets each row choose its next one. Choosing is the one place
that samples (greedy or seeded), applies a JSON constraint, streams the token's text and ends the answer
on EOS, a stop string, a complete JSON value or the token budget. The
:class:`~cacheblend_rag.engine.scheduler.BatchScheduler` decodes its rows together over one batch buffer;
a greedy answer is the same token for token whatever else is in the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch

from ..blend.context import RoundKV
from ..blend.fusor import FusionResult
from ..models.runtime import KVCache, LayerwiseModel
from .base import FusionDiagnostics, FusionStats, GenerationResult, TokenEvent, fusion_figures
from .batch_kv import RowContext
from .constraints import ConstraintState, masked, start_constraint
from .metrics import continuation_nll
from .request import AdmittedRequest
from .sampling import make_generator, sample_next
from .textstream import TextStream

__all__ = ["DecodeRow", "decode_step"]


class DecodeRow:
    """One request being decoded: its prompt and method (for its result), sampling and generator, JSON
    constraint, text stream (EOS and stop strings), the token fed next and its position, and its fused
    prompt until a scheduler has moved its KV into the batch buffer (``prompt``).

    ``admitted``: the request (its ``ttft_s`` and ``total_s`` count from its arrival). ``emit`` receives
    each token's text as it is chosen; without one, events wait for :meth:`take_events`.
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_ids: Collection[int],
        admitted: AdmittedRequest,
        emit: Callable[[TokenEvent], None] | None = None,
    ) -> None:
        self.admitted = admitted
        self.sampling = sampling = admitted.request.sampling
        self.max_tokens = max_tokens = admitted.max_tokens
        self.prompt_tokens = admitted.request.prompt_tokens
        self.generator = make_generator(sampling)
        self.text = TextStream(tokenizer, eos_ids, sampling.stop, max_tokens)
        self.constraint: ConstraintState | None = None  # structured output: the request's JSON matcher
        self.prompt: FusionResult | None = None  # the fused prompt, until a scheduler has taken its KV
        self.fusion: FusionStats | None = None
        self.diagnostics: FusionDiagnostics | None = None  # when the sampling params ask for them
        self._answer_logprobs: list[float] = []  # each chosen token's log-probability, with diagnostics
        self.token = 0  # fed at the next step, at ``position``
        self.position = 0
        self.first_token_at: float | None = None
        self._tokenizer = tokenizer
        self._eos_ids = eos_ids
        self._events: list[TokenEvent] = []
        self._emit = emit if emit is not None else self._events.append

    @property
    def finished(self) -> bool:
        return self.text.finished

    def start(self, fusion: FusionResult) -> bool:
        """Take the fused prompt (its KV and the logits of its last token) and choose the first token;
        True when that already ended the answer."""
        self.fusion = FusionStats.of(fusion)
        self.prompt = fusion  # its KV is read when decoding starts (a round's member's is written then)
        self.position = self.prompt_tokens
        vocab = fusion.logits.shape[-1]
        self.constraint = start_constraint(
            self.sampling, self._tokenizer, self._eos_ids, vocab, self.max_tokens
        )
        finished = self._choose(fusion.logits)
        if self.sampling.diagnostics:  # read after the first token is chosen: they cost its TTFT nothing
            self._diagnostics_of(fusion)
        return finished

    def _diagnostics_of(self, fusion: FusionResult) -> None:
        self.diagnostics = FusionDiagnostics(
            first_token_logprobs=torch.log_softmax(fusion.logits.detach().float().cpu(), dim=-1),
            **fusion_figures(fusion),
            # scored once decoding is over (score_continuations), over the prompt's own cache
            continuation_nll=tuple(None for _ in self.sampling.score_continuations),
        )

    def step(self, logits: torch.Tensor) -> bool:
        """The row's last token has been fed: choose the next one from its ``logits`` [vocab]; True when
        the answer has ended."""
        self.position += 1
        return self._choose(logits)

    def _choose(self, logits: torch.Tensor) -> bool:
        token = sample_next(masked(logits, self.constraint), self.sampling, self.generator)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self.sampling.diagnostics:
            self._answer_logprobs.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
        piece = self.text.push(token)
        if piece is not None:
            self._emit(TokenEvent(token, piece))
        if self.constraint is not None and self.constraint.accept(token):
            self.text.finish_reason = "stop"  # the JSON is complete
        self.token = token
        return self.text.finished

    def take_events(self) -> list[TokenEvent]:
        """The events chosen since the last call (rows made without ``emit``)."""
        events = self._events.copy()
        self._events.clear()  # the list ``emit`` appends to
        return events

    def result(self, queue_s: float = 0.0) -> GenerationResult:
        """The finished answer and what producing it cost (``queue_s``: what it waited to be fused)."""
        if self.fusion is None:
            raise RuntimeError("result() of a row that was never started")
        return GenerationResult.build(
            text=self.text.text,
            token_ids=self.text.token_ids,
            finish_reason=self.text.finish_reason or "length",
            admitted=self.admitted,
            fusion=self.fusion,
            first_token_at=self.first_token_at,
            finished_at=time.perf_counter(),
            queue_s=queue_s,
            diagnostics=self._final_diagnostics(),
        )

    def _final_diagnostics(self) -> FusionDiagnostics | None:
        # the answer's own tokens: a stop token chosen last is not part of it
        chosen = self._answer_logprobs[: len(self.text.token_ids)]
        if self.diagnostics is None or not chosen:
            return self.diagnostics
        nll = -sum(chosen) / len(chosen)
        return replace(self.diagnostics, answer_nll=nll)

    def score_continuations(
        self, model: LayerwiseModel, fusion: FusionResult, result: GenerationResult
    ) -> None:
        """Fill ``result``'s diagnostics with the NLLs of the sampling params' continuations over
        ``fusion``'s cache (the prompt's slots are left as they are; the slots past it are overwritten,
        so only once the answer is decoded, and after its times were taken)."""
        if result.diagnostics is None or not self.sampling.score_continuations:
            return
        scores = tuple(
            continuation_nll(model, fusion.cache, fusion.num_tokens, fusion.logits, ids)
            for ids in self.sampling.score_continuations
        )
        result.diagnostics = replace(result.diagnostics, continuation_nll=scores)


def decode_step(
    model: LayerwiseModel,
    forward_lock: AbstractContextManager[Any],
    rows: Sequence[DecodeRow],
    cache: KVCache,
    contexts: Sequence[RowContext | None] = (),
) -> list[int]:
    """Feed every row's last token at its own position in one forward over ``cache`` (row i's KV in
    batch row i; ``contexts[i]``, when given, the round cache row i reads its prompt from) and let each row
    choose its next token; returns the slots of the rows that finished."""
    device = model.device
    ids = torch.tensor([[row.token] for row in rows], device=device)
    if any(context is not None for context in contexts):
        with forward_lock:
            logits = forward_over_rounds(model, ids, rows, cache, contexts)
        return [slot for slot, row in enumerate(rows) if row.step(logits[slot])]
    if len(rows) == 1:  # a row alone: no mask tensor, the same kernels whether or not it is batched
        positions = torch.tensor([rows[0].position], device=device)
    else:
        positions = torch.tensor([[row.position] for row in rows], device=device)
    with forward_lock:
        logits = model.forward(ids, positions, cache)
    return [slot for slot, row in enumerate(rows) if row.step(logits[slot])]


@torch.inference_mode()
def forward_over_rounds(
    model: LayerwiseModel,
    ids: torch.Tensor,
    rows: Sequence[DecodeRow],
    cache: KVCache,
    contexts: Sequence[RowContext | None],
) -> torch.Tensor:
    """One decode forward where some rows read their prompt from a round's cache in place: such a row's
    token is projected in the round's frame (its position minus its shift) and written to its own row's
    slot ``position - start``; it attends to the round's slots it sees and to its own generated tokens, in
    one softmax. Other rows attend to their own row (slot == position) as :meth:`LayerwiseModel.forward`
    does. Returns the logits of every row's token [B, vocab]."""
    device = model.device
    rope, slots = [], []
    for row, context in zip(rows, contexts, strict=True):
        shift, start = (context.shared.delta, context.start) if context is not None else (0, 0)
        rope.append(row.position - shift)
        slots.append(row.position - start)
    positions = torch.tensor(rope, device=device)[:, None]
    slot_index = torch.tensor(slots, device=device)[:, None]
    end = max(slots) + 1
    if end > cache.capacity:
        raise RuntimeError(f"decode row slot {end - 1} is past the batch buffer's {cache.capacity} slots")
    own_visible = torch.arange(end, device=device)[None] <= slot_index  # [B, end]
    by_round: dict[int, list[tuple[int, RowContext]]] = {}  # the rows of each round cache, by its id
    for i, context in enumerate(contexts):
        if context is not None:
            by_round.setdefault(id(context.shared.kv), []).append((i, context))
    groups = [
        (
            rows_of[0][1].shared.kv,
            torch.tensor([i for i, _ in rows_of], device=device),
            torch.stack([c.shared.visible for _, c in rows_of]),
        )
        for rows_of in by_round.values()
    ]
    plain = torch.tensor([i for i, c in enumerate(contexts) if c is None], dtype=torch.long, device=device)
    hidden = model.embed(ids).to(model.dtype)
    cos_sin = model.rope.cos_sin(positions, model.dtype)
    for layer in range(model.num_layers):
        qkv = model.project_qkv(layer, hidden, positions, cos_sin)
        cache.write(layer, slot_index, qkv.k, qkv.v)
        keys, values = cache.keys[layer][:, :, :end], cache.values[layer][:, :, :end]
        attended = _attend_rows(model, layer, qkv.q, keys, values, own_visible, plain, groups)
        hidden = model.finish_layer(layer, hidden, attended)
    cache.length = max(cache.length, end)
    return model.logits(hidden[:, -1])


def _attend_rows(
    model: LayerwiseModel,
    layer: int,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    own_visible: torch.Tensor,
    plain: torch.Tensor,
    groups: Collection[tuple[RoundKV, torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Attention of one query per row ``q`` [B, H, 1, d] over its own row (``own_visible`` [B, T]) and,
    for the rows of each round in ``groups``, the round's slots they see, in one softmax per row; scores
    in float32. Returns [B, 1, H * d]."""
    b, heads, _, d = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(b, kv_heads, heads // kv_heads, d)  # head h reads kv head h // (heads / kv_heads)
    scores = (grouped @ keys.transpose(-1, -2)).float() * model.scaling  # [B, Hkv, g, T]
    scores.masked_fill_(~own_visible[:, None, None, :], float("-inf"))
    out = torch.empty_like(grouped)
    if plain.numel():
        weights = scores[plain].softmax(-1).to(values.dtype)
        out[plain] = weights @ values[plain]
    for kv, members, visible in groups:
        round_keys, round_values = kv.keys[layer], kv.values[layer]  # [1, Hkv, L, d]
        seen = (grouped[members] @ round_keys.transpose(-1, -2)).float() * model.scaling
        seen.masked_fill_(~visible[:, None, None, :], float("-inf"))
        weights = torch.cat([seen, scores[members]], dim=-1).softmax(-1).to(values.dtype)
        length = round_keys.shape[2]
        out[members] = weights[..., :length] @ round_values + weights[..., length:] @ values[members]
    model.attention_token_layers += b
    return out.reshape(b, 1, heads * d)
