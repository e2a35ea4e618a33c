"""Readers: every supported format, every kind of bad input, and fuzzed .jsonl / PDF files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheblend_rag.errors import IngestError
from cacheblend_rag.ingest.readers import discover, html_to_text, read_file


def make_pdf(lines: list[str]) -> bytes:
    """A minimal valid one-page PDF showing ``lines`` in Helvetica (ASCII only)."""
    content = "BT /F1 12 Tf 72 720 Td " + " ".join(f"({line}) Tj 0 -16 Td" for line in lines) + " ET"
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        "/Resources << /Font << /F1 5 0 R >> >> >>",
        f"<< /Length {len(content)} >>\nstream\n{content}\nendstream",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = b"%PDF-1.4\n"
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{offset:010d} 00000 n \n".encode() for offset in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


VALID_PDF = make_pdf(["Gotthold Ephraim Lessing wrote Emilia Galotti.", "It is a play in five acts."])


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


# --- each format --------------------------------------------------------------------------------------


def test_txt_keeps_text_and_normalises_newlines(tmp_path):
    path = write(tmp_path, "notes.txt", "First line.\r\nSecond line.\r\n\r\nNew paragraph.\n")
    [doc] = read_file(path)
    assert doc.text == "First line.\nSecond line.\n\nNew paragraph.\n"
    assert doc.title == "notes"
    assert doc.key == doc.source == str(path)


def test_markdown_title_is_first_heading(tmp_path):
    path = write(tmp_path, "doc.md", "Intro text\n\n## The Real Title ##\n\nBody.\n")
    [doc] = read_file(path)
    assert doc.title == "The Real Title"
    assert "Body." in doc.text


def test_utf8_bom_is_dropped(tmp_path):
    [doc] = read_file(write(tmp_path, "bom.txt", "\ufeffcafé".encode()))
    assert doc.text == "café"


def test_html_gives_visible_text_only(tmp_path):
    html = """<!doctype html><html><head><title>  Lessing
      plays </title><style>p { color: red }</style><script>var secret = "hidden";</script></head>
      <body><h1>Emilia&nbsp;Galotti</h1><p>A play in <b>five</b> acts.</p><!-- a comment -->
      <ul><li>first</li><li>second</li></ul><noscript>enable js</noscript>
      <p>Last &amp; final.</p></body></html>"""
    [doc] = read_file(write(tmp_path, "page.html", html))
    assert doc.title == "Lessing plays"
    assert doc.text == "Emilia Galotti\n\nA play in five acts.\n\nfirst\n\nsecond\n\nLast & final."
    for hidden in ("secret", "color", "comment", "enable js"):
        assert hidden not in doc.text


def test_html_to_text_handles_broken_markup():
    title, text = html_to_text("<p>unclosed <b>bold <i>and <div>nested</p> tail")
    assert title is None
    assert "unclosed bold and" in text and "nested" in text and "tail" in text


def test_pdf_text_is_extracted(tmp_path):
    [doc] = read_file(write(tmp_path, "paper.pdf", VALID_PDF))
    assert "Emilia Galotti" in doc.text
    assert "five acts" in doc.text
    assert doc.metadata["pages"] == 1


def test_jsonl_records_with_id_title_and_metadata(tmp_path):
    lines = [
        {"id": "a1", "title": "Lessing", "text": "Emilia Galotti is a play.", "year": 1772, "tags": ["x"]},
        {"text": "No id here."},
        {"id": 7, "text": "Integer id."},
    ]
    path = write(tmp_path, "recs.jsonl", "\n".join(json.dumps(r) for r in lines) + "\n\n")
    docs = read_file(path)
    assert [d.key for d in docs] == [f"{path}#a1", f"{path}#2", f"{path}#7"]
    assert docs[0].title == "Lessing" and docs[1].title is None
    assert docs[0].metadata == {"year": 1772, "tags": ["x"], "id": "a1"}
    assert docs[1].text == "No id here."


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("empty.txt", b"", "empty"),
        ("blank.md", b"   \n\t\n", "empty"),
        ("binary.txt", b"ELF\x00\x01\x02binary", "binary"),
        ("latin1.txt", "line one\nline two\ncaf\xe9\n".encode("latin-1"), "latin1.txt:3: not valid UTF-8"),
        ("empty.html", b"<html><script>x()</script></html>", "no visible text"),
        ("fake.pdf", b"this is not a pdf at all", "not a PDF"),
        ("cut.pdf", VALID_PDF[: len(VALID_PDF) // 3], "PDF"),
        ("notext.pdf", make_pdf([]), "no extractable text"),
        ("bad.jsonl", b'{"text": "ok"}\n{"text": broken}\n', "bad.jsonl:2: invalid JSON"),
        ("notext.jsonl", b'{"text": "ok"}\n\n{"title": "t"}\n', "notext.jsonl:3: record has no 'text'"),
        ("array.jsonl", b'["text"]\n', "array.jsonl:1: expected a JSON object"),
        ("numtext.jsonl", b'{"text": 5}\n', "numtext.jsonl:1: 'text' must be a non-empty string"),
        ("dupid.jsonl", b'{"id": 1, "text": "a"}\n{"id": "1", "text": "b"}\n', "dupid.jsonl:2: duplicate id"),
        ("badid.jsonl", b'{"id": [1], "text": "a"}\n', "badid.jsonl:1: 'id'"),
        ("badtitle.jsonl", b'{"title": 3, "text": "a"}\n', "badtitle.jsonl:1: 'title'"),
        ("unknown.docx", b"PK\x03\x04", "unsupported file type"),
    ],
)
def test_bad_input_raises_ingest_error_naming_file(tmp_path, name, data, message):
    path = write(tmp_path, name, data)
    with pytest.raises(IngestError, match="PDF" if message == "PDF" else None) as info:
        read_file(path)
    assert message in str(info.value)
    assert name in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(IngestError, match="no such file"):
        read_file(tmp_path / "absent.txt")


def test_discover_expands_folders_and_rejects_bad_paths(tmp_path):
    write(tmp_path, "a.txt", "a")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", "b.md", "b")
    write(tmp_path / "sub", "skip.bin", "x")
    (tmp_path / ".hidden").mkdir()
    write(tmp_path / ".hidden", "c.txt", "c")
    assert [p.name for p in discover([tmp_path, tmp_path / "a.txt"])] == ["a.txt", "b.md"]
    with pytest.raises(IngestError, match="no such file or directory"):
        discover([tmp_path / "nope"])
    with pytest.raises(IngestError, match="unsupported file type"):
        discover([tmp_path / "sub" / "skip.bin"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(IngestError, match="no supported files"):
        discover([tmp_path / "empty"])


# --- fuzzing ------------------------------------------------------------------------------------------

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(st.lists(st.one_of(st.binary(max_size=80), st.text(max_size=80).map(str.encode)), max_size=6))
def test_fuzzed_jsonl_parses_or_raises_ingest_error(tmp_path, lines):
    path = write(tmp_path, "fuzz.jsonl", b"\n".join(lines))
    try:
        docs = read_file(path)
    except IngestError as exc:
        assert "fuzz.jsonl" in str(exc)
    else:
        assert docs and all(d.text.strip() for d in docs)


@FUZZ
@given(st.data())
def test_fuzzed_pdf_parses_or_raises_ingest_error(tmp_path, data):
    raw = bytearray(VALID_PDF)
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(raw) - 1))
        raw[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(len(raw) // 2, len(raw)))
    path = write(tmp_path, "fuzz.pdf", bytes(raw[:cut]))
    try:
        [doc] = read_file(path)
    except IngestError as exc:
        assert "fuzz.pdf" in str(exc)
    else:
        assert doc.text.strip()
