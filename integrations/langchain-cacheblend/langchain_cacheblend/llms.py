"""``CacheBlendLLM``: a LangChain text-in, text-out LLM that answers with blended chunk KV caches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import Field

from cacheblend_rag.engine import GenerationResult

from ._base import CacheBlendParams, response_metadata, usage_metadata


class CacheBlendLLM(CacheBlendParams, BaseLLM):
    """Text completion over the cacheblend-rag engine.

    The prompt is sent as one user turn through the model's chat template (the default model is
    instruction-tuned); set ``apply_chat_template=False`` for a prompt that is already rendered. See
    :class:`CacheBlendParams` for how chunk KV is found. ``generation_info`` of each generation holds
    ``usage_metadata`` (``input_token_details.cache_read`` = prompt tokens whose KV was reused), ``ttft_s``,
    ``method``, ``recompute_ratio`` and ``chunk_ids``.
    """

    _ls_model_type: ClassVar[str] = "llm"
    apply_chat_template: bool = Field(default=True, description="Wrap the prompt in the chat template.")
    system_prompt: str | None = Field(
        default=None, description="System turn before the prompt (default: the template's own, if any)."
    )

    @property
    def _llm_type(self) -> str:
        return "cacheblend"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {**super()._identifying_params, "apply_chat_template": self.apply_chat_template}

    def _render(self, prompt: str) -> str:
        if not self.apply_chat_template:
            return prompt
        turns = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return self.frontend.render_chat([*turns, {"role": "user", "content": prompt}])

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        results = self.answer_batch([self._request(self._render(p), stop, kwargs) for p in prompts])
        return LLMResult(
            generations=[[Generation(text=r.text, generation_info=self._info(r))] for r in results],
            llm_output={"model_name": self.frontend.model_name, "token_usage": _total_usage(results)},
        )

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        handle = self.stream_answer(self._request(self._render(prompt), stop, kwargs))
        try:
            for event in handle:
                chunk = GenerationChunk(text=event.text)
                if run_manager is not None:
                    run_manager.on_llm_new_token(event.text, chunk=chunk)
                yield chunk
            yield GenerationChunk(text="", generation_info=self._info(handle.result()))
        finally:
            handle.cancel()  # a consumer that stopped early: the request stops decoding

    def _info(self, result: GenerationResult) -> dict[str, Any]:
        return {
            **response_metadata(result, self.frontend.model_name),
            "usage_metadata": usage_metadata(result),
        }


def _total_usage(results: list[GenerationResult]) -> dict[str, int]:
    usages = [usage_metadata(r) for r in results]
    return {
        "input_tokens": sum(u["input_tokens"] for u in usages),
        "output_tokens": sum(u["output_tokens"] for u in usages),
        "total_tokens": sum(u["total_tokens"] for u in usages),
        "cache_read": sum(u["input_token_details"]["cache_read"] for u in usages),
        "cache_creation": sum(u["input_token_details"]["cache_creation"] for u in usages),
    }
