"""CacheBlendVectorStore (LangChain): the standard VectorStoreIntegrationTests suite, metadata filters
pushed into the search, the indexing API with a record manager, and a user-built chain over the user's own
splits that reuses chunk KV — all on the real model, real FAISS and real LangChain objects."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from langchain_cacheblend import CacheBlendVectorStore, ChatCacheBlend
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.indexing import InMemoryRecordManager, index
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_tests.integration_tests import VectorStoreIntegrationTests
from langchain_text_splitters import RecursiveCharacterTextSplitter
from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.errors import StoreError
from cacheblend_rag.models.shared import acquire_model, release_model

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).parents[2] / "examples" / "data" / "corpus"
PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer from the context. Be brief."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ]
)


@pytest.fixture(scope="module", autouse=True)
def _model_stays_loaded() -> Iterator[None]:
    """Stores are closed after each test; holding the shared model here keeps it from being reloaded."""
    model = acquire_model()
    yield
    release_model(model)


class TestStandardSuite(VectorStoreIntegrationTests):
    """langchain-tests' own suite, with its small fake embeddings; every test on a fresh corpus folder."""

    @pytest.fixture
    def vectorstore(self, tmp_path) -> Iterator[CacheBlendVectorStore]:
        store = CacheBlendVectorStore(tmp_path / "corpus", self.get_embeddings())
        try:
            yield store
        finally:
            store.close()


def kv_keys(store: CacheBlendVectorStore) -> dict[str, str]:
    """chunk id -> KV key of every chunk the store's corpus holds."""
    corpus = store.collection.corpus
    rows = corpus.db.chunks_by_ids(list(corpus.db.iter_chunk_ids()))
    return {chunk_id: row.kv_key for chunk_id, row in rows.items()}


def assert_consistent(store: CacheBlendVectorStore) -> None:
    """Rows, vectors and KV agree: one vector and one stored KV entry per chunk, nothing else, and the KV
    store verifies clean."""
    corpus = store.collection.corpus
    kv = store.collection.frontend.engine.store
    keys = kv_keys(store)
    assert corpus.sync_index().ntotal == len(keys) == corpus.db.counts()["chunks"]
    assert all(kv.contains(key, remote=False) for key in keys.values())
    assert kv.stats()["disk"]["entries"] == len(keys)
    assert kv.verify().clean


def test_documents_come_back_as_added_and_kv_is_ready(tmp_path):
    store = CacheBlendVectorStore(str(tmp_path / "c"), DeterministicFakeEmbedding(size=8))
    long_text = " ".join(f"Sentence number {i} of a long document about lighthouses." for i in range(120))
    ids = store.add_texts(["short text", long_text], [{"n": 1}, {"n": 2}], ids=["s", "l"])
    assert ids == ["s", "l"]
    docs = {d.id: d for d in store.get_by_ids(["l", "missing", "s"])}
    assert docs["s"].page_content == "short text" and docs["l"].page_content == long_text
    assert docs["l"].metadata == {"n": 2}
    corpus = store.collection.corpus
    (stored,) = corpus.documents.get(["l"])
    chunks = corpus.get_chunks(list(stored.chunk_ids))
    assert len(chunks) > 1 and all(c.n_tokens <= corpus.manifest.chunk_tokens for c in chunks)
    assert "".join(c.text for c in chunks) == long_text  # token-exact chunks of the text as given
    assert corpus.db.counts()["kv_ready"] == len(kv_keys(store))  # precomputed when added
    assert_consistent(store)
    store.close()


def test_delete_removes_rows_vectors_and_kv_of_unshared_chunks(tmp_path):
    store = CacheBlendVectorStore(tmp_path / "c", DeterministicFakeEmbedding(size=8))
    store.add_texts(["alpha text here", "beta text here", "alpha text here"], ids=["a", "b", "a2"])
    before = kv_keys(store)
    assert len(before) == 2  # "alpha" is stored once for a and a2
    assert store.delete(["a", "nope"]) is True
    assert kv_keys(store) == before  # a2 still holds the alpha chunk
    store.delete(["a2"])
    after = kv_keys(store)
    assert len(after) == 1 and set(after.values()) < set(before.values())
    gone = (set(before.values()) - set(after.values())).pop()
    assert not store.collection.frontend.engine.store.contains(gone)
    assert_consistent(store)
    verified = CliRunner().invoke(app, ["store", "verify", "--corpus", str(store.corpus_dir), "--json"])
    assert (
        verified.exit_code == 0 and json.loads(verified.output)["clean"] and '"checked": 1' in verified.output
    )
    store.delete()  # no ids: everything
    assert store.similarity_search("alpha", k=2) == [] and kv_keys(store) == {}
    assert_consistent(store)
    store.close()


def test_filters_are_applied_inside_the_search(tmp_path):
    store = CacheBlendVectorStore(tmp_path / "c")  # the default sentence embedder
    topics = {
        "sea": "The ship sailed across the stormy sea towards the harbour.",
        "cake": "Bake the cake with flour, eggs and sugar for forty minutes.",
        "chess": "The knight moves in an L shape on the chess board.",
    }
    texts, metadatas = [], []
    for topic, text in topics.items():
        for i in range(3):
            texts.append(f"{text} Note {i}.")
            metadatas.append({"topic": topic, "i": i, "tags": [topic, "odd" if i % 2 else "even"]})
    store.add_texts(texts, metadatas)
    unfiltered = store.similarity_search("a boat on the ocean", k=3)
    assert {d.metadata["topic"] for d in unfiltered} == {"sea"}
    # the three nearest are all "sea": a filter applied after the top 3 would leave nothing
    cake = store.similarity_search("a boat on the ocean", k=3, filter={"topic": "cake"})
    assert len(cake) == 3 and {d.metadata["topic"] for d in cake} == {"cake"}
    chosen = store.similarity_search("a boat on the ocean", k=9, filter={"topic": {"$in": ["cake", "chess"]}})
    assert sorted(d.page_content for d in chosen) == sorted(
        t for t, m in zip(texts, metadatas, strict=True) if m["topic"] in ("cake", "chess")
    )
    assert [
        d.metadata["i"] for d in store.similarity_search("ship", k=9, filter={"i": 1, "topic": "sea"})
    ] == [1]
    odd = store.similarity_search("ship", k=9, filter={"tags": {"$contains": "odd"}})
    assert sorted(d.metadata["topic"] for d in odd) == ["cake", "chess", "sea"]
    retriever = store.as_retriever(search_kwargs={"k": 2, "filter": {"topic": "chess"}})
    assert {d.metadata["topic"] for d in retriever.invoke("boat")} == {"chess"}
    # maximal marginal relevance: the nearest "sea" note first, then other topics rather than more of it
    diverse = store.max_marginal_relevance_search("a boat on the ocean", k=3, fetch_k=9, lambda_mult=0.3)
    assert diverse[0].metadata["topic"] == "sea" and len({d.metadata["topic"] for d in diverse}) > 1
    mmr = store.as_retriever(search_type="mmr", search_kwargs={"k": 2, "filter": {"topic": "cake"}})
    assert {d.metadata["topic"] for d in mmr.invoke("boat")} == {"cake"}
    scored = store.similarity_search_with_relevance_scores("stormy sea ship", k=1)
    assert 0.5 < scored[0][1] <= 1.0
    with pytest.raises(ValueError, match=r"unknown filter operator 'regex'"):
        store.similarity_search("ship", filter={"topic": {"$regex": "s.*"}})
    store.close()


def test_reopening_needs_the_same_embeddings(tmp_path):
    folder = tmp_path / "c"
    CacheBlendVectorStore(folder, DeterministicFakeEmbedding(size=8)).close()
    with pytest.raises(StoreError, match="DeterministicFakeEmbedding"):
        CacheBlendVectorStore(folder)
    with pytest.raises(StoreError, match="8-dim"):
        CacheBlendVectorStore(folder, DeterministicFakeEmbedding(size=5))
    CacheBlendVectorStore(folder, DeterministicFakeEmbedding(size=8)).close()


def test_indexing_api_incremental_and_full_cleanup(tmp_path):
    store = CacheBlendVectorStore(tmp_path / "c", DeterministicFakeEmbedding(size=8))
    manager = InMemoryRecordManager(namespace="cacheblend/test")
    manager.create_schema()
    docs = [
        Document(page_content="Kettles boil water for tea.", metadata={"source": "a.txt"}),
        Document(page_content="Teapots keep the tea warm.", metadata={"source": "a.txt"}),
        Document(page_content="Bicycles have two wheels.", metadata={"source": "b.txt"}),
    ]
    first = index(docs, manager, store, cleanup="incremental", source_id_key="source", key_encoder="sha256")
    assert (first["num_added"], first["num_deleted"]) == (3, 0)
    assert (
        index(docs, manager, store, cleanup="incremental", source_id_key="source", key_encoder="sha256")[
            "num_skipped"
        ]
        == 3
    )
    old_keys = kv_keys(store)

    changed = [Document(page_content="Kettles boil water quickly.", metadata={"source": "a.txt"})]
    second = index(
        changed, manager, store, cleanup="incremental", source_id_key="source", key_encoder="sha256"
    )
    assert (second["num_added"], second["num_deleted"]) == (1, 2)
    texts = sorted(d.page_content for d in store.similarity_search("tea", k=10))
    assert texts == ["Bicycles have two wheels.", "Kettles boil water quickly."]
    removed = set(old_keys.values()) - set(kv_keys(store).values())
    assert len(removed) == 2 and not any(store.collection.frontend.engine.store.contains(k) for k in removed)
    assert_consistent(store)

    third = index(docs[2:], manager, store, cleanup="full", key_encoder="sha256")
    assert third["num_deleted"] == 1
    assert [d.page_content for d in store.similarity_search("tea", k=10)] == ["Bicycles have two wheels."]
    assert_consistent(store)
    store.close()


@pytest.fixture(scope="module")
def user_store(tmp_path_factory) -> Iterator[tuple[CacheBlendVectorStore, str]]:
    """The user's own documents, split by a LangChain text splitter, in a store built by from_documents."""
    splitter = RecursiveCharacterTextSplitter(chunk_size=900, chunk_overlap=0)
    documents = [
        Document(page_content=(CORPUS / name).read_text(encoding="utf-8"), metadata={"source": name})
        for name in ("musique_case005.md", "musique_case013.txt")
    ]
    splits = splitter.split_documents(documents)
    folder = tmp_path_factory.mktemp("user") / "my-corpus"
    store = CacheBlendVectorStore.from_documents(splits, corpus_dir=folder)
    yield store, str(folder)
    store.close()


def test_user_built_chain_reuses_chunk_kv(user_store, sample_questions):
    store, folder = user_store
    retriever = store.as_retriever(search_kwargs={"k": 3})

    def format_docs(docs: list[Document]) -> str:
        return "\n\n".join(doc.page_content for doc in docs)

    llm = ChatCacheBlend(corpus_dir=folder, max_tokens=8)
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | PROMPT | llm
    questions = [q["question"] for q in sample_questions[:2]]  # about the two files in the store
    for question in questions:
        message = chain.invoke(question)
        retrieved = retriever.invoke(question)
        usage = message.usage_metadata["input_token_details"]
        stored = [store.collection.corpus.find_by_text(d.page_content) for d in retrieved]
        assert all(stored), "retrieved documents carry the exact stored chunk text"
        assert message.response_metadata["chunk_ids"] == [c.chunk_id for c in stored]
        assert usage["cache_read"] == message.response_metadata["cached_tokens"] > 0
    llm.close()


def test_filtered_retriever_in_a_chain(user_store, sample_questions):
    store, folder = user_store
    question = sample_questions[1]["question"]  # about musique_case013.txt
    retriever = store.as_retriever(search_kwargs={"k": 2, "filter": {"source": "musique_case005.md"}})
    assert {d.metadata["source"] for d in retriever.invoke(question)} == {"musique_case005.md"}
    llm = ChatCacheBlend(corpus_dir=Path(folder), max_tokens=4)
    message = (
        {
            "context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs)),
            "question": RunnablePassthrough(),
        }
        | PROMPT
        | llm
    ).invoke(question)
    assert (
        len(message.response_metadata["chunk_ids"]) == 2
        and message.usage_metadata["input_token_details"]["cache_read"] > 0
    )
    llm.close()
