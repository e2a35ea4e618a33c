"""Fixtures for the LangChain and LlamaIndex integration tests: one writable store, one engine per process."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def corpus_dir(shared_rag_store) -> str:
    """The sample store every integration test shares (so they share one engine and its chunk KV); a test
    that changes a corpus makes its own."""
    return str(shared_rag_store)


@pytest.fixture(scope="session")
def question(sample_questions) -> str:
    return sample_questions[0]["question"]


@pytest.fixture
def llm_reports():
    """The engine reports (``response.raw``) of LlamaIndex LLM calls made during a test, in order, as seen
    through LlamaIndex's instrumentation."""
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent

    reports: list[dict[str, Any]] = []

    class Reports(BaseEventHandler):
        @classmethod
        def class_name(cls) -> str:
            return "Reports"

        def handle(self, event: Any, **kwargs: Any) -> None:
            ended = isinstance(event, LLMChatEndEvent | LLMCompletionEndEvent)
            if ended and event.response is not None and event.response.raw:
                reports.append(event.response.raw)

    dispatcher = get_dispatcher()
    handler = Reports()
    dispatcher.add_event_handler(handler)
    yield reports
    dispatcher.event_handlers.remove(handler)
