"""Small surprises of a first hour, each refused or fixed at its cause: a bad ratio's error is a line, not
a screenful; text with a NUL byte is refused by a vector store; a corpus made under a KV store opened first
(the demo's order) still gets the corpus's 0750; an integration README has no sentence cut off. Real
stores, real LangChain objects."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
from langchain_cacheblend import CacheBlendVectorStore
from typer.testing import CliRunner

from cacheblend_rag.cli import app
from cacheblend_rag.engine.bounds import check_request
from cacheblend_rag.errors import MethodOptionError
from cacheblend_rag.ingest import ingest
from cacheblend_rag.models.loader import read_shape
from cacheblend_rag.settings import get_settings
from cacheblend_rag.store import KVStore

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("bad", [{"ratio": 1.5}, {"ratio": -0.1}])
def test_a_bad_ratio_is_refused_in_one_short_line(bad):
    with pytest.raises(MethodOptionError) as caught:
        check_request("cacheblend", **bad)
    message = str(caught.value)
    assert len(message) < 250, message
    assert "ratio" in message and f"got {bad['ratio']}" in message and "default 0.15" in message
    assert "schedule" not in message  # the other options' descriptions stay out of it


def test_a_bad_ratio_on_the_command_line_is_one_short_line(tmp_path):
    result = CliRunner().invoke(
        app, ["query", "q", "--corpus", str(tmp_path / "c"), "--ratio", "1.5"], env={"COLUMNS": "400"}
    )
    assert result.exit_code == 2
    assert len(result.output.strip()) < 300 and "ratio" in result.output


def test_an_unknown_option_lists_the_options_by_name():
    with pytest.raises(MethodOptionError) as caught:
        check_request("cacheblend@ratio=0.1,rato=2")
    message = str(caught.value)
    assert "no option 'rato'" in message and "ratio (default 0.15)" in message and len(message) < 500


def test_langchain_store_refuses_text_with_a_nul_byte(tmp_path):
    store = CacheBlendVectorStore(tmp_path / "c", precompute_kv=False)
    with pytest.raises(ValueError, match=r"document 'b' holds a NUL character \(\\x00\) at offset 3"):
        store.add_texts(["fine text", "bad\x00text"], ids=["a", "b"])
    assert store.get_by_ids(["a", "b"]) == []  # nothing of the batch stored
    store.close()


def test_a_corpus_made_under_an_open_kv_store_gets_mode_0750(tmp_path, model_tokenizer):
    corpus = tmp_path / "sample"
    # the demo's and quickstart's order: the engine's KV store under the corpus first, then ingest
    KVStore(corpus / "kv", model_tokenizer.fingerprint, read_shape(model_tokenizer.path)).close()
    assert stat.S_IMODE(corpus.stat().st_mode) == 0o755
    doc = tmp_path / "doc.md"
    doc.write_text("The Rhine flows into the North Sea.\n")
    ingest([doc], corpus, precompute_kv=False, config=get_settings())
    assert stat.S_IMODE(corpus.stat().st_mode) == 0o750
    assert stat.S_IMODE((corpus / "kv").stat().st_mode) == 0o755


@pytest.mark.parametrize(
    "readme", sorted((ROOT / "integrations").glob("*/README.md")), ids=lambda p: p.parent.name
)
def test_integration_readmes_have_no_sentence_cut_off(readme):
    text = re.sub(r"```.*?```", "", readme.read_text(), flags=re.DOTALL)
    for paragraph in (p.strip() for p in text.split("\n\n")):
        if paragraph and not paragraph.startswith(("#", "|", "-")):
            assert paragraph[-1] in ".:)", f"{readme}: paragraph ends mid-sentence: ...{paragraph[-80:]!r}"
