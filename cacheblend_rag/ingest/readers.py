"""Read input files into :class:`Document` objects: .txt, .md, .html/.htm, .pdf and .jsonl.

Every problem with an input (missing, empty, binary, not UTF-8, malformed) raises :class:`IngestError`
naming the file and, where it applies, the line.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from html.parser import HTMLParser
from pathlib import Path

from ..errors import IngestError
from ..text.document import Document

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".markdown")
HTML_SUFFIXES = (".html", ".htm")
SUPPORTED_SUFFIXES = (*TEXT_SUFFIXES, *HTML_SUFFIXES, ".pdf", ".jsonl")
_BINARY_SNIFF_BYTES = 8192
_MD_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def discover(paths: Iterable[str | Path]) -> list[Path]:
    """Expand files and directories (recursively, skipping hidden entries) into supported files, sorted.

    A path given explicitly must exist and have a supported suffix; unsupported files found inside a
    directory are skipped."""
    found: dict[Path, None] = {}
    for raw in paths:
        path = Path(raw).expanduser()
        if not path.exists():
            raise IngestError(f"{path}: no such file or directory")
        if path.is_dir():
            inside = [
                p
                for p in sorted(path.rglob("*"))
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
                and p.suffix.lower() in SUPPORTED_SUFFIXES
            ]
            if not inside:
                raise IngestError(
                    f"{path}: directory holds no supported files ({', '.join(SUPPORTED_SUFFIXES)})"
                )
            found.update((p.resolve(), None) for p in inside)
        elif path.suffix.lower() in SUPPORTED_SUFFIXES:
            found[path.resolve()] = None
        else:
            raise IngestError(
                f"{path}: unsupported file type {path.suffix or '(none)'!r}; "
                f"supported: {', '.join(SUPPORTED_SUFFIXES)}"
            )
    return list(found)


def read_file(path: str | Path, data: bytes | None = None) -> list[Document]:
    """Parse one file (``data``: its bytes, if already read) into documents."""
    path = Path(path)
    if data is None:
        data = read_bytes(path)
    suffix = path.suffix.lower()
    if not data.strip():
        raise IngestError(f"{path}: file is empty")
    if suffix == ".pdf":
        return [_read_pdf(path, data)]
    if b"\x00" in data[:_BINARY_SNIFF_BYTES]:
        raise IngestError(f"{path}: looks like a binary file (NUL bytes), not {suffix} text")
    text = _decode(path, data)
    if suffix == ".jsonl":
        return _read_jsonl(path, text)
    if suffix in HTML_SUFFIXES:
        title, text = html_to_text(text)
        if not text.strip():
            raise IngestError(f"{path}: HTML has no visible text")
        return [Document(text, str(path), str(path), title or path.stem)]
    if suffix in TEXT_SUFFIXES:
        text = text.replace("\r\n", "\n")
        if not text.strip():
            raise IngestError(f"{path}: file holds only whitespace")
        heading = _MD_HEADING.search(text) if suffix != ".txt" else None
        return [Document(text, str(path), str(path), heading.group(1) if heading else path.stem)]
    raise IngestError(f"{path}: unsupported file type {suffix!r}; supported: {', '.join(SUPPORTED_SUFFIXES)}")


def read_bytes(path: Path) -> bytes:
    """The bytes of ``path``, or an ``IngestError`` saying why they cannot be read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise IngestError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise IngestError(f"{path}: is a directory") from None
    except OSError as exc:
        raise IngestError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise IngestError(
            f"{path}:{line}: not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "convert the file to UTF-8"
        ) from None


def _read_jsonl(path: Path, text: str) -> list[Document]:
    docs: list[Document] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise IngestError(f"{path}:{number}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(record, dict):
            raise IngestError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        body = record.pop("text", None)
        if body is None:
            raise IngestError(f"{path}:{number}: record has no 'text' field")
        if not isinstance(body, str) or not body.strip():
            raise IngestError(f"{path}:{number}: 'text' must be a non-empty string")
        record_id = record.pop("id", None)
        if record_id is None:
            record_id = str(number)
        elif isinstance(record_id, (str, int)) and not isinstance(record_id, bool) and str(record_id):
            record_id = str(record_id)
        else:
            raise IngestError(f"{path}:{number}: 'id' must be a non-empty string or an integer")
        if record_id in seen:
            raise IngestError(f"{path}:{number}: duplicate id {record_id!r}")
        seen.add(record_id)
        title = record.pop("title", None)
        if title is not None and not isinstance(title, str):
            raise IngestError(f"{path}:{number}: 'title' must be a string")
        record["id"] = record_id
        docs.append(Document(body, str(path), f"{path}#{record_id}", title, record))
    if not docs:
        raise IngestError(f"{path}: no records")
    return docs


def _read_pdf(path: Path, data: bytes) -> Document:
    import io

    from pypdf import PdfReader

    if not data.lstrip().startswith(b"%PDF-"):
        raise IngestError(f"{path}: not a PDF file (no %PDF- header)")
    pages: list[str] = []
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise IngestError(f"{path}: PDF is encrypted")
        for page in reader.pages:
            pages.append(page.extract_text() or "")
        title = (reader.metadata.title if reader.metadata else None) or path.stem
    except IngestError:
        raise
    except Exception as exc:  # pypdf raises many types on malformed input; all mean "cannot read this PDF"
        raise IngestError(f"{path}: malformed PDF: {type(exc).__name__}: {exc}") from None
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    if not text:
        raise IngestError(f"{path}: PDF has no extractable text (scanned images need OCR first)")
    return Document(text, str(path), str(path), str(title), {"pages": len(pages)})


class _VisibleText(HTMLParser):
    _HIDDEN = frozenset({"script", "style", "head", "noscript", "template", "svg", "iframe", "object"})
    _BLOCK = frozenset(
        {"address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt", "fieldset", "figcaption"}
        | {
            "figure",
            "footer",
            "form",
            "h1",
            "h2",
            "h3",
            "h4",
            "h5",
            "h6",
            "header",
            "hr",
            "li",
            "main",
            "nav",
        }
        | {"ol", "p", "pre", "section", "table", "td", "th", "tr", "ul"}
    )

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.title_parts: list[str] = []
        self._hidden_depth = 0
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = True
        if tag in self._HIDDEN:
            self._hidden_depth += 1
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        if tag in self._HIDDEN:
            self._hidden_depth = max(0, self._hidden_depth - 1)
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title_parts.append(data)
        elif not self._hidden_depth:
            self.parts.append(data)


def html_to_text(html: str) -> tuple[str | None, str]:
    """(title, visible text) of an HTML page: block elements become paragraphs, whitespace collapsed."""
    parser = _VisibleText()
    parser.feed(html)
    parser.close()
    raw = "".join(parser.parts)
    lines = [" ".join(line.split()) for line in raw.split("\n")]
    paragraphs: list[str] = []
    current: list[str] = []
    for line in lines:
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    title = " ".join("".join(parser.title_parts).split()) or None
    return title, "\n\n".join(paragraphs)
