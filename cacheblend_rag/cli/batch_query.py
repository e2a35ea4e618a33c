"""``cacheblend-rag query --batch FILE``: answer many questions together (the PyTorch engine's batch
scheduler, or vLLM's own batching with ``--engine vllm``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..engine import SamplingParams
from ..errors import CacheBlendError
from ..rag import CacheBlendRAG
from ..settings import Settings
from .output import print_error

console = Console()
err_console = Console(stderr=True)


def read_questions(path: Path) -> list[str]:
    """The questions in ``path``: JSON Lines whose objects carry ``"question"`` (when the first non-blank
    line starts with ``{``), else one question per non-blank line."""
    try:
        lines = [(n, line.strip()) for n, line in enumerate(path.read_text().splitlines(), 1)]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the batch file {path}: {exc}") from None
    lines = [(n, line) for n, line in lines if line]
    if not lines:
        raise ValueError(f"the batch file {path} holds no questions")
    if not lines[0][1].startswith("{"):
        return [line for _, line in lines]
    questions = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not a JSON object ({exc.msg})") from None
        question = record.get("question") if isinstance(record, dict) else None
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f'{path}:{n}: expected an object with a non-empty "question" string')
        questions.append(question)
    return questions


def query_batch_command(
    batch: Path,
    corpus: Path,
    top_k: int | None,
    method: str | None,
    ratio: float | None,
    max_tokens: int,
    temperature: float,
    chunk_ids: list[str] | None,
    as_json: bool,
    model: str | None,
    engine_kind: str | None = None,
    settings: Settings | None = None,
) -> None:
    """What ``query --batch FILE`` does: answer every question of FILE and print the answers (or JSON).
    ``settings``: the command's (default: the process's)."""
    try:
        questions = read_questions(batch)
        rag = CacheBlendRAG(corpus, model=model, engine_kind=engine_kind, config=settings)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        started = time.perf_counter()
        results = rag.query_batch(
            questions, top_k=top_k, method=method, ratio=ratio, chunk_ids=chunk_ids, sampling=sampling
        )
        seconds = time.perf_counter() - started
    except (CacheBlendError, ValueError) as exc:
        print_error(err_console, exc)
        raise typer.Exit(1) from exc
    answered = list(zip(questions, results, strict=True))
    if as_json:
        print(json.dumps([{"question": q, **r.to_dict()} for q, r in answered], indent=2))
        return
    for i, (question, result) in enumerate(answered, 1):
        console.print(f"[bold]{i}. {escape(question)}[/bold]", highlight=False)
        console.print(result.answer, markup=False, highlight=False)
    ttfts = sorted(r.ttft_s * 1000 for r in results)
    table = Table(show_header=False, box=None)
    table.add_row("questions", str(len(results)))
    table.add_row("method", escape(results[0].method))
    table.add_row("total", f"{seconds:.2f} s ({len(results) / seconds:.2f} questions/s)")
    table.add_row("TTFT", f"{ttfts[0]:.0f}–{ttfts[-1]:.0f} ms (queueing included)")
    err_console.print(table)
