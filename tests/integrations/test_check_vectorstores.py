"""``check`` on the LangChain and LlamaIndex vector stores: full prefill against KV reuse over the store's
own documents, through the engine the process shares over the store's corpus."""

from __future__ import annotations

import pytest
from langchain_cacheblend import CacheBlendVectorStore
from langchain_core.embeddings import DeterministicFakeEmbedding
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.schema import TextNode
from llama_index.vector_stores.cacheblend import CacheBlendVectorStore as LlamaVectorStore

from cacheblend_rag.blend.spec import MethodSpec
from cacheblend_rag.config import DEFAULT_METHOD

pytestmark = pytest.mark.slow

TEXTS = [
    "Marie Curie was a physicist and chemist who conducted pioneering research on radioactivity.",
    "Mount Everest is the highest mountain above sea level, on the border of Nepal and China.",
    "The Amazon rainforest is home to millions of species of insects, plants, birds and animals.",
]
QUESTIONS = ["What did Marie Curie research?", "Where is Mount Everest?"]
# check sweeps the default method's ratio: its row is the default at the ratio asked
SWEPT = MethodSpec.parse(DEFAULT_METHOD).with_ratio(0.15).label


def test_langchain_store_check(tmp_path):
    store = CacheBlendVectorStore(tmp_path / "corpus", DeterministicFakeEmbedding(size=16))
    try:
        store.add_texts(TEXTS)
        report = store.check(QUESTIONS, ratios=(0.15,), max_tokens=3, top_k=2)
    finally:
        store.close()
    assert report.questions == QUESTIONS and len(report.cases) == 2
    assert [r.label for r in report.rows] == ["full_recompute", SWEPT]
    assert all(len(case["chunk_ids"]) == 2 for case in report.cases)
    assert report.row("full_recompute").kl_first_token == 0.0


def test_llamaindex_store_check(tmp_path):
    store = LlamaVectorStore(tmp_path / "corpus", MockEmbedding(embed_dim=16))
    try:
        store.add([TextNode(text=text, id_=f"n{i}") for i, text in enumerate(TEXTS)])
        report = store.check(QUESTIONS[:1], ratios=(0.15,), max_tokens=3, top_k=2)
    finally:
        store.close()
    assert report.questions == QUESTIONS[:1]
    assert 0 <= report.row(SWEPT).first_token_agreement <= 1
