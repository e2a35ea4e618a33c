"""``CacheBlendQueryEngine``: retrieve from a corpus and answer with the chunks' KV reused by id."""

from __future__ import annotations

from pathlib import Path

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.llms.cacheblend import CacheBlendLLM, CacheBlendSynthesizer

from .base import CacheBlendRetriever


class CacheBlendQueryEngine(RetrieverQueryEngine):
    """A ``RetrieverQueryEngine`` whose synthesizer hands the retrieved nodes to the LLM as segments."""

    @classmethod
    def from_corpus(
        cls,
        corpus_dir: str | Path,
        llm: CacheBlendLLM | None = None,
        similarity_top_k: int | None = None,
        streaming: bool = False,
        text_qa_template: BasePromptTemplate | None = None,
        node_postprocessors: list[BaseNodePostprocessor] | None = None,
    ) -> CacheBlendQueryEngine:
        """Retriever, LLM (default: ``CacheBlendLLM`` over the same corpus) and synthesizer in one call."""
        llm = llm or CacheBlendLLM(corpus_dir=str(corpus_dir))
        return cls(
            retriever=CacheBlendRetriever(corpus_dir, similarity_top_k),
            response_synthesizer=CacheBlendSynthesizer(llm, text_qa_template, streaming),
            node_postprocessors=node_postprocessors,
        )
