"""The vLLM backend: :class:`VLLMEngine` and the CacheBlend KV connector it configures vLLM with.

Importing this package does not import vLLM; constructing a :class:`VLLMEngine` does, and raises a
:class:`~cacheblend_rag.errors.CacheBlendError` naming the ``[vllm]`` extra when it is missing.
"""

from ..request import GenerationRequest
from .engine import VLLMEngine, import_vllm
from .requests import VLLMGenerationResult

__all__ = ["GenerationRequest", "VLLMEngine", "VLLMGenerationResult", "import_vllm"]
