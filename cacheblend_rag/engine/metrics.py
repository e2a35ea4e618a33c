"""Answer-quality and fidelity metrics.

- :func:`qa_f1`: LongBench's QA score (SQuAD normalisation: lower case, no punctuation, no articles
  a/an/the, single spaces; token-level F1; the best over the gold answers).
- :func:`rouge_l`: LongBench's Rouge-L (the ``rouge`` package's F), the best over the references.
- :func:`kl_divergence`: KL(P_reference || P) of two next-token distributions given as logits.
- :func:`continuation_nll`: mean teacher-forced negative log-likelihood of a token sequence continuing a
  prompt cache (used on each method's fused cache).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import torch

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
