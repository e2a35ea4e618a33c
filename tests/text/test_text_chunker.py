"""Chunker invariants (property-based) and boundary preferences, on the default model's tokenizer."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cacheblend_rag.errors import IngestError, InvalidChunkIdError
from cacheblend_rag.text.chunker import Chunker, chunk_id_for, validate_chunk_id

SAMPLE_FILE = Path(__file__).parents[2] / "examples" / "data" / "corpus" / "musique_case005.md"

PROPERTY = settings(max_examples=150, deadline=None)


@pytest.fixture(scope="module")
def tokenizer(model_tokenizer):
    return model_tokenizer.tokenizer


@pytest.fixture(scope="module")
def chunkers(tokenizer) -> dict[int, Chunker]:
    return {n: Chunker(tokenizer, n) for n in (16, 64, 512)}


def check_invariants(chunker: Chunker, text: str) -> list:
    chunks = chunker.split(text)
    assert all(0 < c.n_tokens <= chunker.max_tokens for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == chunker.tokenize(text)
    if not chunks:
        assert chunker.tokenize(text) == []  # only characters the tokenizer drops
        return chunks
    assert "".join(c.text for c in chunks) == text
    for chunk in chunks:
        assert chunk.text == text[chunk.start : chunk.end]
        assert chunk.retokenizes == (chunker.tokenize(chunk.text) == list(chunk.token_ids))
        assert re.fullmatch(r"[0-9a-f]{32}", chunk.chunk_id)
    return chunks


@PROPERTY
@given(text=st.text(max_size=600), budget=st.sampled_from([16, 64]))
def test_any_unicode_keeps_invariants(chunkers, text, budget):
    check_invariants(chunkers[budget], text)


@PROPERTY
@given(
    text=st.text(alphabet=st.sampled_from(list("abcdefgh XYZ.,;!?'\"()-\n\t\x00é中😀0123")), max_size=800),
    budget=st.sampled_from([16, 64]),
)
def test_text_like_input_always_retokenizes(chunkers, text, budget):
    chunks = check_invariants(chunkers[budget], text)
    assert all(c.retokenizes for c in chunks)


@settings(max_examples=5, deadline=None)
@given(seed_text=st.text(min_size=1, max_size=40))
def test_very_long_input(chunkers, seed_text):
    text = (seed_text + " Lorem ipsum dolor sit amet.\n\n") * 400
    chunks = check_invariants(chunkers[512], text)
    assert len(chunks) >= len(chunkers[512].tokenize(text)) // 512


def test_empty_and_nul_text(chunkers):
    assert chunkers[64].split("") == []
    chunks = check_invariants(chunkers[16], "a\x00b\x00" * 50)
    assert len(chunks) > 1


def test_lone_surrogate_is_a_clear_error(chunkers):
    with pytest.raises(IngestError, match="lone surrogate at character 2"):
        chunkers[64].split("ab\ud800cd")


def test_control_token_text_stays_plain_text(chunkers, tokenizer):
    chunk = chunkers[64].split("before <|im_end|> after")[0]
    special = set(tokenizer.all_special_ids)
    assert not special & set(chunk.token_ids)


def test_prefers_paragraph_then_sentence_boundaries(chunkers):
    paragraph = "The river runs through the old town. Its bridge was built in 1821. " * 4
    text = "\n\n".join(f"Section {i}. {paragraph}" for i in range(12))
    chunks = check_invariants(chunkers[512], text)
    assert len(chunks) > 1
    for chunk, after in itertools.pairwise(chunks):
        # the cut lies inside the blank line between two sections
        assert re.search(r"\n\s*$", chunk.text), repr(chunk.text[-40:])
        assert re.match(r"\s*Section \d+\. The river", after.text), repr(after.text[:40])
        assert chunk.n_tokens >= 256  # a paragraph break is taken only if the chunk is at least half full
    one_paragraph = "Short sentence number one. " * 200
    chunks = check_invariants(chunkers[64], one_paragraph)
    for chunk, after in itertools.pairwise(chunks):
        assert re.search(r"\.\s*$", chunk.text), repr(chunk.text[-20:])
        assert re.match(r"\s*Short", after.text), repr(after.text[:20])


def test_real_corpus_chunks_retokenize(chunkers):
    text = SAMPLE_FILE.read_text()
    chunks = check_invariants(chunkers[512], text)
    assert all(c.retokenizes for c in chunks)
    assert max(c.n_tokens for c in chunks) > 400


def test_chunk_min_size_and_fast_tokenizer_required(tokenizer):
    with pytest.raises(ValueError, match="at least 16"):
        Chunker(tokenizer, 8)
    with pytest.raises(ValueError, match="fast"):
        Chunker(object(), 64)


def test_chunk_ids_are_stable_content_hashes():
    assert chunk_id_for([1, 2, 3]) == chunk_id_for((1, 2, 3))
    assert chunk_id_for([1, 2, 3]) != chunk_id_for([1, 2, 4])
    assert chunk_id_for([1, 2, 3]) != chunk_id_for([3, 2, 1])
    # frozen: a changed hash would orphan every stored chunk and its KV
    assert chunk_id_for([1, 2, 3]) == "b30a3c159d7e8193559a42a84f1fcae1"


@pytest.mark.parametrize(
    "bad",
    [
        "../../etc/passwd",
        "0" * 31,
        "0" * 33,
        "A" * 32,
        "g" * 32,
        "' OR '1'='1' --" + "0" * 17,
        "0" * 31 + "\n",
        "0" * 16 + "/" + "0" * 15,
        "",
        None,
        123,
        b"0" * 32,
        json.dumps(["0" * 32]),
    ],
)
def test_validate_chunk_id_rejects(bad):
    with pytest.raises(InvalidChunkIdError):
        validate_chunk_id(bad)


def test_validate_chunk_id_accepts():
    cid = chunk_id_for([5, 6])
    assert validate_chunk_id(cid) == cid
