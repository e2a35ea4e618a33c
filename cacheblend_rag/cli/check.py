"""``cacheblend-rag check``: full prefill against KV reuse on your own corpus and questions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from ..config import DECISIVE_MARGIN, DEFAULT_CHECK_MAX_TOKENS
from ..errors import CacheBlendError
from .eval import parse_list
from .output import print_error, shown
from .overrides import KV_REMOTE_OPTION, use_kv_remote
from .progress import ProgressReporter

if TYPE_CHECKING:
    from ..check import CheckReport

console = Console()
err_console = Console(stderr=True)


def read_questions(path: Path) -> list[str]:
    """One question a line, blank lines skipped; a missing or empty file is refused."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"--questions: cannot read {path}: {exc}") from None
    questions = [line.strip() for line in lines if line.strip()]
    if not questions:
        raise typer.BadParameter(f"--questions: {path} holds no questions (one per line)")
    return questions


def check_command(
    corpus: Annotated[Path, typer.Option("--corpus", help="Corpus directory built by `ingest`.")],
    questions: Annotated[
        Path | None,
        typer.Option(
            "--questions",
            help="Questions, one per line (default: --sample questions derived from the corpus's chunks).",
        ),
    ] = None,
    ratios: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated recompute ratios to try, e.g. 0.05,0.15,0.3 (default: the ratio setting)."
        ),
    ] = None,
    method: Annotated[
        str | None,
        typer.Option(help="The KV-reuse method to check (default, or 'default': the method setting)."),
    ] = None,
    target_agreement: Annotated[
        float | None,
        typer.Option(
            "--target-agreement",
            help="Name the lowest ratio whose first-token agreement with full prefill on decisive questions "
            "and whose answer F1 with full prefill's answers both surely reach this (their whole 95% "
            "intervals); with too few questions, how many more are needed.",
        ),
    ] = None,
    decisive_margin: Annotated[
        float,
        typer.Option(
            "--decisive-margin",
            help="Nats by which full prefill's first token must lead its runner-up for a question to be "
            "decisive; the rest are near-ties, reported apart and left out of the verdict.",
        ),
    ] = DECISIVE_MARGIN,
    max_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens",
            help="Most tokens per answer: the answers compared with full prefill's are this long at most.",
        ),
    ] = DEFAULT_CHECK_MAX_TOKENS,
    sample: Annotated[
        int, typer.Option(help="Questions to derive from the corpus when no --questions file is given.")
    ] = 20,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Chunks to retrieve (default 6).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    model: Annotated[str | None, typer.Option("--model", help="Model (default: the corpus's).")] = None,
    kv_remote: Annotated[str | None, KV_REMOTE_OPTION] = None,
) -> None:
    """Answer your questions by full prefill and by KV reuse side by side; print fidelity and speed-up."""
    from ..check import check_options, run_check
    from ..rag import CacheBlendRAG

    ratio_list = parse_list(ratios, float, "--ratios") if ratios is not None else None
    asked = read_questions(questions) if questions is not None else None
    try:
        check_options(ratio_list or [None], target_agreement, max_tokens, sample, decisive_margin)
        settings = use_kv_remote(kv_remote)
    except (CacheBlendError, ValueError) as exc:
        print_error(err_console, exc)
        raise typer.Exit(2) from exc
    try:
        rag = CacheBlendRAG(corpus, model=model, engine_kind="torch", config=settings)
        try:
            # run_check rather than rag.check: the same check, with a progress callback
            with ProgressReporter(err_console, {"questions": "check (questions)"}) as progress:
                report = run_check(
                    rag,
                    asked,
                    ratio_list,
                    method,
                    target_agreement,
                    max_tokens,
                    sample,
                    top_k,
                    decisive_margin,
                    progress=lambda done, total: progress.update("questions", done, total),
                )
        finally:
            rag.close()
    except (CacheBlendError, ValueError) as exc:
        print_error(err_console, exc)
        raise typer.Exit(1) from exc
    if as_json:
        print(json.dumps(report.to_dict(), indent=1))
        return
    print_report(report, f"from {questions}" if questions is not None else "derived from the corpus")


def print_report(report: CheckReport, source: str) -> None:
    """The report as three tables that fit an 80-column terminal (short headers, explained below them):
    first-token agreement on all, decisive and near-tie questions, the whole answer's agreement (the same
    tokens, and F1), then the other fidelity and speed numbers; then the verdict: a ratio only when the
    whole 95 % intervals of the decisive first-token agreement and of the answer F1 clear the target."""
    n = len(report.questions)
    console.print(
        f"{n} question{'s' * (n != 1)} {shown(source)}, answers of at most {report.max_tokens} tokens",
        highlight=False,
    )
    agreement = _table("agree", "95% CI", "decisive", "95% CI", "near-tie")
    for row in report.rows:
        agreement.add_row(
            shown(row.label),
            f"{row.agreeing}/{row.questions}",
            f"{row.agreement_low:.2f}-{row.agreement_high:.2f}",
            f"{row.decisive_agreeing}/{row.decisive_questions}",
            f"{row.decisive_low:.2f}-{row.decisive_high:.2f}" if row.decisive_questions else "-",
            f"{row.near_tie_agreeing}/{row.near_tie_questions}",
        )
    console.print(agreement)
    console.print(
        "agree: questions whose first token equals full prefill's, with its 95% Wilson interval; decisive: "
        f"those where full prefill's first token leads its runner-up by >= {report.decisive_margin:g} nats "
        "(the verdict reads these); near-tie: the rest",
        highlight=False,
    )
    answers = _table("same answer", "95% CI", "F1", "95% CI")
    for row in report.rows:
        answers.add_row(
            shown(row.label),
            f"{row.answers_equal}/{row.questions}",
            f"{row.answer_match_low:.2f}-{row.answer_match_high:.2f}",
            f"{row.agreement_f1:.3f}",
            f"{row.agreement_f1_low:.2f}-{row.agreement_f1_high:.2f}",
        )
    console.print(answers)
    console.print(
        "same answer: questions whose whole answer is full prefill's, token for token; F1: mean token F1 "
        "with full prefill's answer (the verdict reads its interval beside the decisive first tokens)",
        highlight=False,
    )
    fidelity = _table("KL", "TTFT ms", "speed-up", "recomp.")
    for row in report.rows:
        fidelity.add_row(
            shown(row.label),
            f"{row.kl_first_token:.4f}",
            f"{row.ttft_median_s * 1000:.0f}",
            f"{row.speedup_median:.2f}x",
            f"{row.chunk_recompute_ratio:.3f}",
        )
    console.print(fidelity)
    console.print(
        "KL: mean first-token KL; TTFT, speed-up: medians; recomp.: share of chunk tokens recomputed",
        highlight=False,
    )
    for row in report.rows:
        if row.budgets:
            chosen = "; ".join(f"{key} ({count} questions)" for key, count in sorted(row.budgets.items()))
            console.print(f"{shown(row.label)} chose per question: {chosen}", highlight=False)
    if report.target_agreement is None:
        return
    found = report.lowest_ratio_meeting_target
    head = (
        f"verdict: ratio {found:g} meets {report.target_agreement} in decisive first-token agreement and "
        "answer F1"
        if found is not None
        else "no verdict"
    )
    console.print(f"{head} ({shown(report.target_note)})", highlight=False)


def _table(*columns: str) -> Table:
    """A compact table: the method's label (folded when long), then right-aligned number columns."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("method", overflow="fold")
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    return table
