"""LangChain's standard test suites (langchain-tests) for ChatCacheBlend and CacheBlendRetriever.

Structured output is declared supported (``method="json_schema"``: decoding constrained to the schema) and
its tests run on the real model with room for a whole JSON object. Declared unsupported (the suites then
skip those tests; nothing is xfailed): tool calling (``bind_tools`` raises, saying why), image/audio/PDF
inputs, and JSON mode — ``json_mode`` is implemented (any JSON object, parsed with the schema) but the
suite's test needs the model to pick the keys named in the prompt, which the 135M default model does not
do reliably (greedy, it writes only ``"setup"``); tests/integrations/test_langchain_structured.py covers
it. ``cache_read_input`` usage details are declared supported and checked on a prompt that holds a stored
chunk.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_cacheblend import CacheBlendRetriever, ChatCacheBlend
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

# The store the suites run against; properties cannot take fixtures, so an autouse fixture fills it in.
STORE: dict[str, str] = {}
MAX_TOKENS = 8  # the suites make dozens of calls: keep each short
# structured-output tests: room for a whole JSON object (the decoder closes it within the budget)
STRUCTURED_MAX_TOKENS = 40


@pytest.fixture(autouse=True)
def _store(corpus_dir: str) -> None:
    STORE["dir"] = corpus_dir


class _ChatParams:
    @property
    def chat_model_class(self) -> type[ChatCacheBlend]:
        return ChatCacheBlend

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"corpus_dir": STORE["dir"]}

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # test_standard_params passes its own max_tokens with chat_model_params: ours goes here instead
        return {**super().standard_chat_model_params, "max_tokens": MAX_TOKENS}

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine per model: a per-call model switch would load another model

    @property
    def has_tool_calling(self) -> bool:
        return False  # bind_tools is overridden only to raise, saying why

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict[str, Any]:
        return {"method": "json_schema"}

    @property
    def supports_json_mode(self) -> bool:
        return False  # see the module docstring


class TestChatCacheBlendUnit(_ChatParams, ChatModelUnitTests):
    pass


class TestChatCacheBlendIntegration(_ChatParams, ChatModelIntegrationTests):
    @pytest.fixture
    def model(self, request: pytest.FixtureRequest) -> ChatCacheBlend:
        params = {**self.standard_chat_model_params, **self.chat_model_params}
        if "structured_output" in request.node.originalname:
            params["max_tokens"] = STRUCTURED_MAX_TOKENS
        return ChatCacheBlend(**{**params, **(getattr(request, "param", None) or {})})

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A prompt holding one stored chunk, whose KV the answer must reuse. The shared store is ingested
        without KV: the chunk's first use computes it (reported as cache_creation), so it is used once
        first, whichever test ran before this one."""
        retriever = CacheBlendRetriever(corpus_dir=STORE["dir"], k=1)
        (doc,) = retriever.invoke("Who wrote Miss Sara Sampson?")
        model = ChatCacheBlend(**self.chat_model_params, max_tokens=MAX_TOKENS)
        prompt = f"Context:\n{doc.page_content}\n\nWho wrote Miss Sara Sampson?"
        model.invoke(prompt)  # the chunk's KV is stored from here on
        if stream:
            full: AIMessageChunk | None = None
            for chunk in model.stream(prompt):
                full = chunk if full is None else full + chunk
            message: AIMessage = full
        else:
            message = model.invoke(prompt)
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0
        return message


class TestCacheBlendRetriever(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[CacheBlendRetriever]:
        return CacheBlendRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"corpus_dir": STORE["dir"], "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "Who is the lead singer of the band performing Bang Bang Rock & Roll?"
