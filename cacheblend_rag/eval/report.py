"""The eval section of BENCHMARKS.md and the quality-vs-TTFT plot, from ``cacheblend-rag eval`` results."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import DECISIVE_MARGIN, DEFAULT_CHUNK_TOKENS, DEFAULT_TOP_K
from ..engine.fidelity import MethodRow
from .markdown import checks_list, fmt, machine_line, relative_link, table
from .plots import log_x, pyplot, save_figure
from .records import EvalResults, EvalSummary, RunConfig
from .summary import label_spec


def selection(config: RunConfig) -> str:
    """The case-selection options of a run, as given on the command line."""
    skip = f"--skip {config.skip} " if config.skip else ""
    return f"{skip}--limit {config.limit} --seed {config.seed}"


def eval_section_name(results: EvalResults) -> str:
    """BENCHMARKS.md's section of a run: one per data set, chunk size, top-k and codec comparison."""
    config = results.config
    codecs = "-codecs" if len(config.codecs) > 1 else ""  # beside the plain run's section
    return (
        f"eval-{config.dataset}"
        + (f"-{config.chunk_tokens}" if config.chunk_tokens != DEFAULT_CHUNK_TOKENS else "")
        + (f"-top{config.top_k}" if config.top_k != DEFAULT_TOP_K else "")
        + codecs
    )


def _engine(config: RunConfig) -> str:
    """The engine that answered, when not ours."""
    return "" if config.engine_kind == "torch" else f"on the {config.engine_kind} engine, "


def ratio_of(label: str) -> float | None:
    """The recompute ratio a column's label sets (its method's ratio option: cacheblend's and
    cacheblend_hkvd's), or None: the columns of the CacheBlend curve."""
    spec = label_spec(label)
    return spec.ratio if spec is not None else None


def render_eval(results: EvalResults, markdown: Path, plot: Path | None = None) -> str:
    config, summary = results.config, results.summarized()
    summary_task = config.task == "summary"
    gold = "Rouge-L" if summary_task else "F1"
    rows = []
    for label, e in summary.methods.items():
        row = [
            f"`{label}`",
            fmt(e.chunk_recompute_ratio, 2),
            fmt(e.ttft_median_s, 2),
            fmt(e.speedup_median, 2),
            fmt(e.gold),
            fmt(e.agreement_f1),
        ]
        if summary_task:
            row.append(fmt(e.agreement_rouge_l))
        row += [
            fmt(e.first_token_agreement, 2),
            *split_cells(e),
            fmt(e.kl_first_token),
            fmt(e.nll_gold),
            fmt(e.nll_reference),
        ]
        rows.append(row)
    header = [
        "method",
        "chunk tokens recomputed",
        "TTFT median (s)",
        "speed-up",
        f"gold {gold}",
        "agreement F1",
    ]
    if summary_task:
        header.append("agreement Rouge-L")
    header += [
        "first-token agreement",
        *SPLIT_HEADER,
        "KL first token",
        "NLL gold",
        "NLL full_recompute answer",
    ]
    curve = [(r, e) for label, e in summary.methods.items() if (r := ratio_of(label)) is not None]
    codecs = config.codecs
    by_codec = f", chunk KV codecs {' / '.join(codecs)}" if len(codecs) > 1 else ""
    parts = [
        f"## Quality vs TTFT: {config.dataset}{_layout(config)} ({summary.cases} cases, "
        f"{config.task}{by_codec})",
        "",
        "Command(s):",
        "",
        "```bash",
        *dict.fromkeys(results.commands),
        "```",
        "",
        f"Machine: {machine_line(results.machine)}.",
        "",
        f"Model {config.model} ({_engine(config)}{config.compute_dtype} compute, chunk KV stored in "
        f"{config.kv_dtype}); "
        f"contexts chunked to <= {config.chunk_tokens} tokens, {config.top_k} chunks per prompt "
        f"({config.retrieval}); greedy, at most {config.max_new_tokens} new tokens. Data: "
        f"`{Path(config.dataset_path).name}` (sha256 {config.dataset_sha256[:12]}…), cases chosen with "
        f"`{selection(config)}`; chunk KV precomputed behind the {config.chunk_context} chunk "
        "context unless a method's label names another (`none:`). Means over cases; TTFT is the median, "
        "and the speed-up is the median over cases of full_recompute's TTFT over the method's. Agreement and "
        "first-token agreement compare each answer with the full_recompute answer (first-token agreement "
        f"split into {split_note(summary)}); KL is "
        "KL(full prefill || method) of the first-token distribution; NLL is per token, teacher-forced "
        "under the method's fused cache. Raw per-case numbers: the `--json` file.",
        "",
        table(header, rows),
    ]
    if curve:
        curve.sort(key=lambda item: item[0])
        parts += [
            "",
            "CacheBlend by recompute ratio r:",
            "",
            table(
                [
                    "r",
                    "agreement F1",
                    "first-token agreement",
                    *SPLIT_HEADER,
                    "KL first token",
                    "NLL full_recompute answer",
                ],
                [
                    [
                        f"{r:g}",
                        fmt(e.agreement_f1),
                        fmt(e.first_token_agreement, 2),
                        *split_cells(e),
                        fmt(e.kl_first_token),
                        fmt(e.nll_reference),
                    ]
                    for r, e in curve
                ],
            ),
        ]
    if len(codecs) > 1:
        parts += ["", *codec_deltas(summary.methods, codecs)]
    if summary.checks:
        checks = checks_list([c.to_dict() for c in summary.checks])
        parts += ["", "The default's claims on these numbers:", "", checks]
    if plot is not None:
        parts += ["", f"![quality vs TTFT, {config.dataset}]({relative_link(plot, markdown)})"]
    return "\n".join(parts)


SPLIT_HEADER = ("decisive (n)", "near ties (n)")  # the columns of split_cells


def split_cell(agreement: float | None, cases: int | None) -> str:
    """First-token agreement on one kind of case (decisive, near-tie) with the case count, e.g.
    ``0.97 (82)``; ``-`` where the results carry no split (recorded before the margin was)."""
    if cases is None:
        return "-"
    return f"{fmt(agreement, 2)} ({cases})"


def split_cells(entry: MethodRow) -> list[str]:
    """A method's first-token agreement on decisive cases and on near-ties, as :data:`SPLIT_HEADER`."""
    return [
        split_cell(entry.first_token_agreement_decisive, entry.decisive_cases),
        split_cell(entry.first_token_agreement_near_tie, entry.near_tie_cases),
    ]


def split_note(summary: EvalSummary) -> str:
    """What the split columns mean, at the margin the summary was split at (summaries from before it was
    recorded were split at the default, if at all)."""
    margin = summary.decisive_margin if summary.decisive_margin is not None else DECISIVE_MARGIN
    return (
        f"decisive cases, where full prefill's top log-probability leads the runner-up's by >= {margin:g} "
        "nats, and near-ties, each with its count; `-`: results recorded before the split"
    )


def codec_deltas(methods: dict[str, MethodRow], codecs: list[str]) -> list[str]:
    """Per codec and method: first-token KL and agreement F1 against the same method on the baseline
    codec (``codecs[0]``). Variants of codec c are labelled ``c:<method>``."""
    rows = []
    for label, e in methods.items():
        codec, colon, base = label.partition(":")
        if not colon or codec not in codecs[1:] or base not in methods:
            continue
        ref = methods[base]
        rows.append(
            [
                codec,
                f"`{base}`",
                fmt(e.kl_first_token, 4),
                _delta(e.kl_first_token, ref.kl_first_token, 4),
                fmt(e.agreement_f1),
                _delta(e.agreement_f1, ref.agreement_f1, 3),
                fmt(e.first_token_agreement, 2),
                *split_cells(e),
            ]
        )
    return [
        f"Chunk KV codecs against {codecs[0]} (same cases, same full prefill reference):",
        "",
        table(
            [
                "codec",
                "method",
                "KL first token",
                f"Δ KL vs {codecs[0]}",
                "agreement F1",
                "Δ F1",
                "1st token",
                *SPLIT_HEADER,
            ],
            rows,
        ),
    ]


def _delta(value: float | None, reference: float | None, digits: int) -> str:
    if value is None or reference is None:
        return "–"
    return f"{value - reference:+.{digits}f}"


def plot_quality_vs_ttft(results: EvalResults, path: Path) -> Path:
    """Agreement F1 and NLL of the full_recompute answer against median TTFT, one point per method."""
    plt = pyplot()
    summary = results.summarized()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels: tuple[tuple[Any, Callable[[MethodRow], float | None], str], ...] = (
        (axes[0], lambda e: e.agreement_f1, "agreement F1 with full_recompute (higher is better)"),
        (axes[1], lambda e: e.nll_reference, "NLL of the full_recompute answer (lower is better)"),
    )
    for ax, metric, title in panels:
        points = [
            (label, ratio_of(label), e.ttft_median_s, metric(e)) for label, e in summary.methods.items()
        ]
        blend = sorted((ratio, x, y) for _, ratio, x, y in points if ratio is not None and y is not None)
        if blend:
            ax.plot(
                [b[1] for b in blend], [b[2] for b in blend], "o-", color="tab:blue", label="cacheblend (r)"
            )
            for ratio, x, y in blend:
                ax.annotate(f"{ratio:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        for label, ratio, x, y in points:
            if ratio is None and y is not None:
                ax.plot(x, y, "s", label=label)
        log_x(ax)
        ax.set_xlabel("TTFT, median (s, log scale)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Quality vs TTFT: {results.config.dataset} ({summary.cases} cases)")
    return save_figure(fig, path)


def _layout(config: RunConfig) -> str:
    """How the run cut and retrieved its contexts, as the headline names a set."""
    return f", chunks ≤ {config.chunk_tokens} tokens, top {config.top_k}"
