"""Answer-quality and fidelity metrics: :mod:`cacheblend_rag.engine.metrics`, shared with
``CacheBlendRAG.check`` (which sits below eval), re-exported here where eval's users find them."""

from ..engine.metrics import continuation_nll, kl_divergence, normalize_answer, qa_f1, rouge_l, token_f1

__all__ = ["continuation_nll", "kl_divergence", "normalize_answer", "qa_f1", "rouge_l", "token_f1"]
