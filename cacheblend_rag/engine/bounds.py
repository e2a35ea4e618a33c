"""The bounds of a request's options, checked before any model loads and with the same message on every
entry point (``cacheblend-rag query``, :class:`~cacheblend_rag.CacheBlendRAG`, the LangChain and
LlamaIndex integrations, the server): an empty question, ``top_k`` out of range (0 included: it never
means "the default"), an unknown method, an option or ratio the method does not take, ``max_tokens`` <
1, a temperature or top-p out of range. Bounds that depend on the model (the prompt plus ``max_tokens``
within its context, the scheduler's KV budget) are checked once the prompt is built."""

from __future__ import annotations

from ..blend.spec import MethodSpec
from ..corpus.retrieved import check_top_k
from ..errors import InvalidQueryError
from .sampling import SamplingParams


def check_request(
    method: str | MethodSpec,
    *,
    ratio: float | None = None,
    question: str | None = None,
    top_k: int | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
) -> MethodSpec:
    """The method spec a request runs with (``ratio`` applied), once every option given (not None) is
    within bounds; raises a ``ValueError`` (``InvalidQueryError``, ``MethodOptionError``) naming the first
    that is not."""
    if question is not None and not question.strip():
        raise InvalidQueryError("the question is empty")
    if top_k is not None:
        check_top_k(top_k)
    spec = method if isinstance(method, MethodSpec) else MethodSpec.parse(method)
    spec = spec.with_ratio(ratio)
    if max_tokens is not None or temperature is not None or top_p is not None:
        defaults = SamplingParams()
        SamplingParams(  # its own checks, so every entry point words them alike
            max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p if top_p is None else top_p,
        )
    return spec
