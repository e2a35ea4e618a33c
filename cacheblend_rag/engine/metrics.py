"""Answer-quality and fidelity metrics.

- :func:`qa_f1`: LongBench's QA score (SQuAD normalisation: lower case, no punctuation, no articles
  a/an/the, single spaces; token-level F1; the best over the gold answers).
- :func:`rouge_l`: LongBench's Rouge-L (the ``rouge`` package's F), the best over the references.
- :func:`kl_divergence`: KL(P_reference || P) of two next-token distributions given as logits.
- :func:`continuation_nll`: mean teacher-forced negative log-likelihood of a token sequence continuing a
  prompt cache (used on each method's fused cache).
- :func:`log_margin` and :func:`agreement_split`: full prefill's first-token margin (top log-probability
  minus the runner-up's) and first-token agreement apart on decisive cases (margin >= a threshold,
  :data:`~cacheblend_rag.config.DECISIVE_MARGIN` by default) and near-ties, the one place eval and check
  decide which is which.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from ..config import DECISIVE_MARGIN
from ..models.runtime import KVCache, LayerwiseModel

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD/LongBench normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, reference: str) -> float:
    """F1 of the normalised tokens of ``prediction`` against ``reference``."""
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, references: Sequence[str]) -> float:
    """LongBench QA F1: the best :func:`token_f1` over the gold answers."""
    return max((token_f1(prediction, ref) for ref in references), default=0.0)


def rouge_l(prediction: str, references: Sequence[str]) -> float:
    """LongBench's Rouge-L: the ``rouge`` package's ``get_scores(...)["rouge-l"]["f"]``, 0 where it
    refuses the input (empty or punctuation-only text), the best over ``references``."""
    from rouge import Rouge  # the eval extra; LongBench scores summaries with this package

    scorer = Rouge()
    best = 0.0
    for reference in references:
        try:
            score = scorer.get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
        except (ValueError, RecursionError):  # LongBench: any failure scores 0
            score = 0.0
        best = max(best, float(score))
    return best


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(P_ref || P) in nats between the softmax distributions of two logit vectors [vocab]."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    other = torch.log_softmax(logits.double(), dim=-1)
    return float((ref.exp() * (ref - other)).sum().clamp_min(0.0))


def log_margin(logits: torch.Tensor) -> float:
    """A next-token distribution's top log-probability minus the runner-up's, in nats, from logits or
    log-probabilities ([V]; the log-softmax shifts both by the same amount, so the difference is one)."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def check_decisive_margin(margin: float) -> float:
    """``margin`` if it can split cases (a finite number of nats >= 0), else ValueError."""
    if not math.isfinite(margin) or margin < 0:
        raise ValueError(f"the decisive margin must be a number of nats >= 0, got {margin}")
    return margin


def is_decisive(reference_margin: float, margin: float = DECISIVE_MARGIN) -> bool:
    """Whether full prefill's first token leads its runner-up by at least ``margin`` nats: below it full
    prefill is a near-tie itself, and a method that picks the runner-up differs by noise, not by a fault."""
    return reference_margin >= margin


class ScoredRecord(Protocol):
    """What :func:`agreement_split` reads of a record (a :class:`~.fidelity.MethodRecord`)."""

    @property
    def first_token_agreement(self) -> bool: ...

    @property
    def reference_margin(self) -> float | None: ...


def agreement_split(records: Iterable[ScoredRecord], margin: float = DECISIVE_MARGIN) -> dict[str, Any]:
    """First-token agreement apart on decisive cases and near-ties (:func:`is_decisive` on each record's
    ``reference_margin``): per kind its count (``decisive_cases``, ``near_tie_cases``), how many agree
    (``..._agreeing``) and, where any, the share (``first_token_agreement_decisive``, ``..._near_tie``),
    named as :class:`~.fidelity.MethodRow`'s fields. Records without a margin (results from before it was
    recorded) are left out; with none, the split is empty, not zeros."""
    scored = [(r.reference_margin, r.first_token_agreement) for r in records]
    scored = [(lead, agreed) for lead, agreed in scored if lead is not None]
    if not scored:
        return {}
    out: dict[str, Any] = {}
    for kind, decisive in (("decisive", True), ("near_tie", False)):
        chosen = [agreed for lead, agreed in scored if is_decisive(lead, margin) == decisive]
        out[f"{kind}_cases"] = len(chosen)
        out[f"{kind}_agreeing"] = sum(bool(agreed) for agreed in chosen)
        if chosen:
            out[f"first_token_agreement_{kind}"] = out[f"{kind}_agreeing"] / len(chosen)
    return out


@torch.inference_mode()
def continuation_nll(
    model: LayerwiseModel,
    cache: KVCache,
    prompt_length: int,
    next_logits: torch.Tensor,
    token_ids: Sequence[int],
) -> float | None:
    """Mean NLL per token of ``token_ids`` following a prompt whose KV fills ``cache[:prompt_length]`` and
    whose next-token logits are ``next_logits``. The tokens are written into the cache at positions
    ``prompt_length..``, overwriting whatever was there (the prompt's own slots are left as they are).
    Returns None for an empty sequence."""
    if not token_ids:
        return None
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    log_probs = [torch.log_softmax(next_logits.float(), dim=-1)[ids[0]]]
    if len(ids) > 1:
        positions = torch.arange(prompt_length, prompt_length + len(ids) - 1, device=model.device)
        logits = model.forward(ids[None, :-1], positions, cache, all_logits=True)[0]
        log_probs.extend(torch.log_softmax(logits, dim=-1).gather(1, ids[1:, None])[:, 0])
    return float(-torch.stack(log_probs).mean())
