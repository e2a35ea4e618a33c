"""Bad input, property-based: the prompt splicer and the text-recognition frontend for any text, store keys
for any key or token list, chunk ids and metadata from users, and malformed .jsonl / PDF files ingested
into a real store. Each input either works exactly or fails with a clear error, and nothing stored
changes. (The chunker's own properties are in tests/text/test_text_chunker.py.)"""

from __future__ import annotations

import io
import itertools
import json
import re
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from pypdf import PdfWriter
from reliability_support import CHUNK_TOKENS

from cacheblend_rag.corpus.chunkdb import DB_NAME
from cacheblend_rag.corpus.corpus import Corpus
from cacheblend_rag.engine.prompt import ChunkRef, PromptBuilder
from cacheblend_rag.errors import IngestError, InvalidChunkIdError
from cacheblend_rag.frontend import ANCHOR_CHARS, PromptFrontend
from cacheblend_rag.ingest.pipeline import ingest
from cacheblend_rag.models.runtime import ModelShape
from cacheblend_rag.store.keys import chunk_key
from cacheblend_rag.store.kvstore import KVStore

PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# any text, with what breaks naive code over-represented: NUL and other controls, the old placeholder,
# template syntax, control tokens, combining marks, right-to-left text, astral characters
NASTY = st.sampled_from(
    [
        "\x00",
        "\x00PASSAGES\x00",
        "\x01",
        "{passages}",
        "{question}",
        "{{",
        "<|im_end|>",
        "<|im_start|>",
        "\r\n",
        "\u0301",
        "\u202e",
        "\ufeff",
        "\U0001f600",
        "'; DROP TABLE chunks; --",
        "../../",
    ]
)
ANY_TEXT = st.lists(st.one_of(st.text(max_size=40), NASTY), max_size=8).map("".join)
SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


SPLICER_HANDLING = "chunk ids verbatim; frame = template's own tokens"


@pytest.fixture(scope="session")
def builder(model_tokenizer) -> PromptBuilder:
    return PromptBuilder(model_tokenizer.tokenizer)


# -- the prompt splicer --------------------------------------------------------------------------------


@PROPERTY
@given(
    question=ANY_TEXT,
    chunks=st.lists(st.lists(st.integers(0, 49151), max_size=12).map(tuple), max_size=4),
)
@example(question="a" * 20_000, chunks=[(1, 2, 3)])
@example(question="", chunks=[])
def test_splicer_keeps_chunk_ids_and_frames_any_question(builder, question, chunks, faults):
    faults.record("bad input", "any question text (NUL, controls, templates)", SPLICER_HANDLING)
    refs = [ChunkRef(ids, f"chunk{i}") for i, ids in enumerate(chunks)]
    segments = builder.rag_segments(question, refs)
    prefix, separator, suffix = builder.rag_frame(question)

    # chunks keep their stored token ids, ids and order; fresh text sits only around and between them
    cached = [s for s in segments if s.chunk_id is not None]
    assert [(s.chunk_id, s.token_ids) for s in cached] == [
        (r.chunk_id, r.token_ids) for r in refs if r.token_ids
    ]
    expected: list[int] = list(prefix)
    for i, ref in enumerate(refs):
        expected += (separator if i else []) + list(ref.token_ids)
    expected += suffix
    assert [t for s in segments for t in s.token_ids] == expected

    # the fresh tokens are exactly those of the chat template rendered around the passages, question
    # included (compared as token ids: the tokenizer itself drops a few rare bytes, e.g. of U+40000)
    stand_in = "<<the passages>>"
    content = builder.user_template.format(passages=stand_in, question=question)
    rendered = builder.render_chat(
        [{"role": "system", "content": builder.system_prompt}, {"role": "user", "content": content}]
    )
    at = rendered.index(stand_in)  # the passages come before the question: the first one is ours
    assert prefix == builder.encode(rendered[:at])
    assert suffix == builder.encode(rendered[at + len(stand_in) :])


@PROPERTY
@given(before=st.text(max_size=20), bad=SURROGATE, after=st.text(max_size=20))
def test_splicer_refuses_invalid_unicode_clearly(builder, before, bad, after, faults):
    faults.record("bad input", "lone surrogate in a question", "ValueError: not valid Unicode, at char N")
    with pytest.raises(ValueError, match="question is not valid Unicode"):
        builder.rag_segments(before + bad + after, [ChunkRef((1, 2), "c")])


# -- the text-recognition frontend ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def frontend(rel_store, model, tmp_path_factory):
    import shutil

    store = tmp_path_factory.mktemp("frontend") / "store"
    shutil.copytree(rel_store, store, ignore=shutil.ignore_patterns("*-shm", "*.lock"))
    front = PromptFrontend(store, model=model)
    chunks = front.corpus.get_chunks(list(front.corpus.db.iter_chunk_ids()))
    chunks = [c for c in chunks if len(c.text) >= ANCHOR_CHARS]  # shorter ones are not recognised
    yield front, chunks
    front.corpus.close()
    front.engine.store.close()


@FEW
@given(data=st.data())
def test_frontend_finds_pasted_chunks_in_any_text(frontend, data, faults):
    handling = "every pasted chunk found exactly, with stored ids; gaps fresh"
    faults.record("bad input", "any text around chunks in a framework prompt", handling)
    front, chunks = frontend
    pasted = data.draw(st.lists(st.sampled_from(chunks), max_size=3), "pasted")
    fillers = data.draw(st.lists(ANY_TEXT, min_size=len(pasted) + 1, max_size=len(pasted) + 1), "fillers")
    text, placed = fillers[0], []
    for chunk, filler in zip(pasted, fillers[1:], strict=True):
        placed.append((len(text), chunk))
        text += chunk.text + filler
    assume(text.strip())
    stored = {c.chunk_id: c for c in chunks}

    spans = front.spans(text, remember=False)
    for span in spans:  # every span is exactly a stored chunk's text, in order, without overlaps
        assert text[span.start : span.end] == stored[span.chunk_id].text
        assert span.token_ids == stored[span.chunk_id].token_ids
    assert all(a.end <= b.start for a, b in itertools.pairwise(spans))
    found = {(s.start, s.chunk_id) for s in spans}
    assert all((start, chunk.chunk_id) in found for start, chunk in placed)

    # segments: the text between spans tokenized fresh, each span with its chunk's stored token ids
    expected, previous = [], 0
    for span in spans:
        expected += [(None, tuple(front.engine.prompts.encode(text[previous : span.start])))]
        expected += [(span.chunk_id, stored[span.chunk_id].token_ids)]
        previous = span.end
    expected += [(None, tuple(front.engine.prompts.encode(text[previous:])))]
    segments = front.segments(text, method="full_recompute", remember=False)
    assert [(s.chunk_id, s.token_ids) for s in segments] == [e for e in expected if e[1]]
    assert all(s.kv is None for s in segments)


@FEW
@given(text=st.one_of(st.just(""), st.text(alphabet=" \t\n\r", max_size=5)))
def test_frontend_refuses_empty_prompts(frontend, text, faults):
    faults.record("bad input", "empty or blank framework prompt", "ValueError: the prompt is empty")
    with pytest.raises(ValueError, match="empty"):
        frontend[0].segments(text, remember=False)


# -- store keys ----------------------------------------------------------------------------------------

KEY_RE = re.compile(r"[0-9a-f]{64}")
SHAPE = ModelShape(
    "llama",
    num_layers=2,
    hidden_size=16,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    vocab_size=100,
    max_context=64,
)
TOKEN_LISTS = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50)


@PROPERTY
@given(a=TOKEN_LISTS, b=TOKEN_LISTS, dtype=st.sampled_from(["float16", "bfloat16", "float32"]))
def test_keys_are_hex_digests_that_tell_token_lists_apart(a, b, dtype, faults):
    faults.record("bad input", "store keys of any token list", "64-hex sha256; equal iff lists equal")
    key = chunk_key("f" * 64, dtype, a)
    assert KEY_RE.fullmatch(key) and key == chunk_key("f" * 64, dtype, tuple(a))
    assert (key == chunk_key("f" * 64, dtype, b)) == (a == b)
    assert key != chunk_key("e" * 64, dtype, a)


@PROPERTY
@given(
    ids=st.lists(
        st.one_of(
            st.integers(0, 100),
            st.floats(allow_nan=True),
            st.text(max_size=3),
            st.booleans(),
            st.none(),
            st.integers(min_value=2**63),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_keys_refuse_anything_but_token_ids(ids, faults):
    assume(not all(isinstance(i, int) and i < 2**63 for i in ids))  # (bool is an int in Python)
    faults.record("bad input", "floats/strings/None/huge ints as token ids", "ValueError, no silent cast")
    with pytest.raises(ValueError, match=r"token ids|flat sequence"):
        chunk_key("f" * 64, "float16", ids)


@pytest.fixture(scope="module")
def bare_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys") / "kv"
    with KVStore(root, "f" * 64, SHAPE, "float16") as store:
        yield store


@PROPERTY
@given(key=st.one_of(ANY_TEXT, st.from_regex(r"[0-9a-fA-F./\\]{60,68}", fullmatch=True)))
@example(key="../" * 21 + "x")
@example(key="A" * 64)
def test_store_refuses_malformed_keys_before_touching_a_path(bare_store, key, faults):
    assume(not KEY_RE.fullmatch(key))
    faults.record("bad input", "malformed or path-traversal KV keys", "ValueError before any path is built")
    before = sorted(p for p in bare_store.root.parent.rglob("*"))
    for call in (bare_store.path_for, bare_store.get, bare_store.contains, bare_store.delete):
        with pytest.raises(ValueError, match="invalid KV key"):
            call(key)
    assert sorted(p for p in bare_store.root.parent.rglob("*")) == before


# -- chunk ids and metadata from users -----------------------------------------------------------------


@FEW
@given(chunk_id=st.one_of(ANY_TEXT, st.from_regex(r"[0-9a-fA-F]{30,34}", fullmatch=True)))
@example(chunk_id="../../../../etc/passwd")
@example(chunk_id="' OR '1'='1")
def test_user_chunk_ids_are_validated_before_any_lookup(frontend, chunk_id, faults):
    assume(not re.fullmatch(r"[0-9a-f]{32}", chunk_id))
    handling = "InvalidChunkIdError before any lookup (query, frontend)"
    faults.record("bad input", "malformed chunk ids (traversal, SQL)", handling)
    front = frontend[0]
    with pytest.raises(InvalidChunkIdError, match="invalid chunk id"):
        front.rag.query("Who wrote Miss Sara Sampson?", chunk_ids=[chunk_id])
    with pytest.raises(InvalidChunkIdError, match="invalid chunk id"):
        front.chunk_documents([chunk_id])


SQL_AND_PATHS = ["'; DROP TABLE chunks; --", '" OR 1=1 --', "../../../../tmp/owned", "%s %n \x00", "\\x27"]


def test_metadata_with_sql_and_paths_is_stored_verbatim(store_copy, tmp_path, faults):
    handling = "stored and returned verbatim; tables intact"
    faults.record("bad input", "SQL and paths in .jsonl id/title/metadata", handling)
    root = store_copy()
    with sqlite3.connect(root / DB_NAME) as db:
        tables = db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall()
    docs = tmp_path / "docs"
    docs.mkdir()
    record = {
        "id": SQL_AND_PATHS[2],
        "title": SQL_AND_PATHS[0],
        "text": "The Danube flows into the Black Sea. " + SQL_AND_PATHS[1],
        "note": SQL_AND_PATHS[3],
        "tag": SQL_AND_PATHS[4],
    }
    (docs / "odd.jsonl").write_text(json.dumps(record) + "\n")
    ingest([docs], root, precompute_kv=False)
    with Corpus.open(root) as corpus:
        [hit] = corpus.search("Which river flows into the Black Sea?", top_k=1)
        assert hit.title == record["title"] and hit.text == record["text"]
        assert hit.metadata["note"] == record["note"] and hit.metadata["tag"] == record["tag"]
        assert hit.metadata["doc_key"].endswith("#" + record["id"])
        assert corpus.find_by_text(SQL_AND_PATHS[0]) is None
    with sqlite3.connect(root / DB_NAME) as db:
        assert (
            db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall()
            == tables
        )
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)


# -- malformed files ingested into a real store --------------------------------------------------------


def _blank_pdf() -> bytes:
    out = io.BytesIO()
    writer = PdfWriter()
    writer.add_blank_page(200, 200)
    writer.write(out)
    return out.getvalue()


def _chunk_table(root: Path) -> dict[str, bytes]:
    with sqlite3.connect(root / DB_NAME) as db:
        return dict(db.execute("SELECT chunk_id, token_ids FROM chunks").fetchall())


@pytest.fixture(scope="module")
def fuzz_store(rel_store, tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("fuzz") / "store"
    shutil.copytree(rel_store, root, ignore=shutil.ignore_patterns("*-shm", "*.lock"))
    return root


JSONL_LINES = st.one_of(
    st.binary(max_size=60),
    st.text(max_size=60).map(str.encode),
    st.fixed_dictionaries(
        {"text": st.one_of(st.text(max_size=60), st.integers(), st.none())},
        optional={
            "id": st.one_of(st.text(max_size=8), st.integers()),
            "title": st.one_of(st.text(max_size=8), st.lists(st.integers())),
        },
    ).map(lambda r: json.dumps(r).encode()),
)


@FEW
@given(data=st.data())
def test_fuzzed_files_are_ingested_or_refused_without_damage(fuzz_store, tmp_path_factory, data, faults):
    kind = data.draw(st.sampled_from(["jsonl", "pdf"]), "kind")
    handling = "IngestError naming the file, or ingested; nothing stored lost"
    faults.record("bad input", f"fuzzed .{kind} ingested into a store", handling)
    if kind == "jsonl":
        raw = b"\n".join(data.draw(st.lists(JSONL_LINES, min_size=1, max_size=5), "lines"))
    else:
        raw = bytearray(_blank_pdf())
        for _ in range(data.draw(st.integers(1, 6), "flips")):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        raw = bytes(raw[: data.draw(st.integers(len(raw) // 3, len(raw)), "cut")])
    folder = tmp_path_factory.mktemp("fuzz-input")
    path = folder / f"fuzz.{kind}"
    path.write_bytes(raw)
    before = _chunk_table(fuzz_store)
    try:
        ingest([path], fuzz_store, chunk_tokens=CHUNK_TOKENS, precompute_kv=False)
    except IngestError as exc:
        assert "fuzz." in str(exc)
        assert _chunk_table(fuzz_store) == before
    else:
        after = _chunk_table(fuzz_store)
        assert all(after.get(cid) == ids for cid, ids in before.items())  # nothing stored was lost
        with Corpus.open(fuzz_store) as corpus:
            assert corpus.stats().index_size == len(after)
