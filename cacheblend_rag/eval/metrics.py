"""Answer-quality and fidelity metrics: :mod:`cacheblend_rag.engine.metrics`, shared with
``CacheBlendRAG.check`` (which sits below eval), re-exported here where eval's users find them."""

from ..engine.metrics import (
    agreement_split,
    check_decisive_margin,
    continuation_nll,
    is_decisive,
    kl_divergence,
    log_margin,
    normalize_answer,
    qa_f1,
    rouge_l,
    token_f1,
)

__all__ = [
    "agreement_split",
    "check_decisive_margin",
    "continuation_nll",
    "is_decisive",
    "kl_divergence",
    "log_margin",
    "normalize_answer",
    "qa_f1",
    "rouge_l",
    "token_f1",
]
