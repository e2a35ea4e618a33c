"""BENCHMARKS.md sections and matplotlib plots from ``eval`` / ``bench`` results.

Each command owns one section of BENCHMARKS.md, delimited by ``<!-- BEGIN name -->`` / ``<!-- END name -->``
and rewritten whole from its results file, so the page only ever shows numbers a command produced.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKDOWN_HEADER = """# Benchmarks

Every number on this page was produced by the command shown with it, on the machine described with it;
`eval` and `bench` rewrite their own sections (between the `BEGIN`/`END` markers) from their JSON results
under `docs/results/`, which keep the raw per-case and per-run numbers. Times are wall-clock seconds.
"""


def update_markdown(path: str | Path, section: str, body: str) -> None:
    """Replace section ``section`` of the markdown file at ``path`` with ``body`` (append it if absent)."""
    path = Path(path)
    text = path.read_text() if path.is_file() else MARKDOWN_HEADER
    begin, end = f"<!-- BEGIN {section} -->", f"<!-- END {section} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")


def _rel(target: Path, markdown: Path) -> str:
    return Path(os.path.relpath(Path(target).resolve(), Path(markdown).resolve().parent)).as_posix()


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.{digits}f}"


def _machine(machine: dict[str, Any]) -> str:
    load = machine.get("load_average") or []
    return (
        f"{machine['cpu']}, {machine['cores']} cores, {machine['threads']} torch threads, torch "
        f"{machine['torch']}, transformers {machine['transformers']}, Python {machine['python']}"
        + (f"; load average at start {load[0]:.1f}" if load else "")
        + f" ({machine['timestamp']})"
    )


def _checks(checks: Sequence[dict[str, Any]]) -> str:
    lines = []
    for check in checks:
        value = check.get("value")
        shown = f" ({value:.2f})" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
        lines.append(f"- {'PASS' if check['passed'] else 'FAIL'}: {check['claim']}{shown}")
    return "\n".join(lines)


# -- eval --------------------------------------------------------------------------------------------


def eval_section_name(results: dict[str, Any]) -> str:
    return f"eval-{results['config']['dataset']}"


def render_eval(results: dict[str, Any], markdown: Path, plot: Path | None = None) -> str:
    config, summary = results["config"], results["summary"]
    summary_task = config["task"] == "summary"
    gold = "Rouge-L" if summary_task else "F1"
    rows = []
    for label, e in summary["methods"].items():
        row = [
            f"`{label}`",
            _f(e.get("chunk_recompute_ratio"), 2),
            _f(e.get("ttft_median_s"), 2),
            _f(e.get("speedup_median"), 2),
            _f(e.get("gold")),
            _f(e.get("agreement_f1")),
        ]
        if summary_task:
            row.append(_f(e.get("agreement_rouge_l")))
        row += [
            _f(e.get("first_token_agreement"), 2),
            _f(e.get("kl_first_token")),
            _f(e.get("nll_gold")),
            _f(e.get("nll_reference")),
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
    header += ["first-token agreement", "KL first token", "NLL gold", "NLL full_recompute answer"]
    curve = [
        (e["options"]["ratio"], e)
        for label, e in summary["methods"].items()
        if label.startswith("cacheblend@") and "options" in e
    ]
    parts = [
        f"## Quality vs TTFT: {config['dataset']} ({summary['cases']} cases, {config['task']})",
        "",
        "Command(s):",
        "",
        "```bash",
        *dict.fromkeys(results.get("commands") or []),
        "```",
        "",
        f"Machine: {_machine(results['machine'])}.",
        "",
        f"Model {config['model']} ({config['compute_dtype']} compute, chunk KV stored in "
        f"{config['kv_dtype']}); "
        f"contexts chunked to <= {config['chunk_tokens']} tokens, {config['top_k']} chunks per prompt "
        f"({config['retrieval']}); greedy, at most {config['max_new_tokens']} new tokens. Data: "
        f"`{Path(config['dataset_path']).name}` (sha256 {config['dataset_sha256'][:12]}…), cases chosen with "
        f"`--limit {config['limit']} --seed {config['seed']}`. Means over cases; TTFT is the median, and the "
        "speed-up is the median over cases of full_recompute's TTFT over the method's. Agreement and "
        "first-token agreement compare each answer with the full_recompute answer; KL is "
        "KL(full prefill || method) of the first-token distribution; NLL is per token, teacher-forced "
        "under the method's fused cache. Raw per-case numbers: the `--json` file.",
        "",
        _table(header, rows),
    ]
    if curve:
        curve.sort(key=lambda item: item[0])
        parts += [
            "",
            "CacheBlend by recompute ratio r:",
            "",
            _table(
                ["r", "agreement F1", "first-token agreement", "KL first token", "NLL full_recompute answer"],
                [
                    [
                        f"{r:g}",
                        _f(e.get("agreement_f1")),
                        _f(e.get("first_token_agreement"), 2),
                        _f(e.get("kl_first_token")),
                        _f(e.get("nll_reference")),
                    ]
                    for r, e in curve
                ],
            ),
        ]
    if summary.get("checks"):
        parts += ["", "Claims of issue 7 on these numbers:", "", _checks(summary["checks"])]
    if plot is not None:
        parts += ["", f"![quality vs TTFT, {config['dataset']}]({_rel(plot, markdown)})"]
    return "\n".join(parts)


def plot_quality_vs_ttft(results: dict[str, Any], path: Path) -> Path:
    """Agreement F1 and NLL of the full_recompute answer against median TTFT, one point per method."""
    plt = _pyplot()
    methods = results["summary"]["methods"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, title in (
        (axes[0], "agreement_f1", "agreement F1 with full_recompute (higher is better)"),
        (axes[1], "nll_reference", "NLL of the full_recompute answer (lower is better)"),
    ):
        blend = sorted(
            (e["options"]["ratio"], e["ttft_median_s"], e[metric])
            for label, e in methods.items()
            if label.startswith("cacheblend@") and metric in e
        )
        if blend:
            ax.plot(
                [b[1] for b in blend], [b[2] for b in blend], "o-", color="tab:blue", label="cacheblend (r)"
            )
            for ratio, x, y in blend:
                ax.annotate(f"{ratio:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        for label, e in methods.items():
            if label.startswith("cacheblend@") or metric not in e:
                continue
            ax.plot(e["ttft_median_s"], e[metric], "s", label=label)
        _log_x(ax)
        ax.set_xlabel("TTFT, median (s, log scale)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Quality vs TTFT: {results['config']['dataset']} ({results['summary']['cases']} cases)")
    return _save(fig, path)


# -- bench -------------------------------------------------------------------------------------------

_TTFT_LABELS = {
    "transformers": "transformers (full prefill)",
    "full_prefill": "full prefill (ours)",
    "prefix_cache": "prefix_cache",
    "full_reuse": "full_reuse",
    "cacheblend_ram": "cacheblend, RAM tier",
    "cacheblend_disk": "cacheblend, disk tier",
    "epic": "epic",
}


def render_bench(results: dict[str, Any], markdown: Path, plots: dict[str, Path]) -> str:
    sections, commands = results["sections"], results.get("commands", {})
    quick = (
        " (quick smoke run: sizes too small for the numbers to mean anything)"
        if results["config"].get("quick")
        else ""
    )
    parts = [
        f"## `cacheblend-rag bench`{quick}",
        "",
        f"Model {results['model']['name']} ({results['model']['dtype']}).",
    ]

    def header(title: str, name: str) -> list[str]:
        section = sections[name]
        load = section["load_average"]
        return [
            "",
            f"### {title}",
            "",
            f"`{commands.get(name) or 'cacheblend-rag bench'}` "
            f"(section `{name}`, {section['seconds']:.0f} s). "
            f"Machine: {_machine(section['machine'])}; 1-min load average {load['before'][0]:.1f} before, "
            f"{load['after'][0]:.1f} after.",
            "",
        ]

    if "ttft" in sections:
        ttft = sections["ttft"]
        parts += header("Time to first token", "ttft")
        parts.append(
            f"Fixed question, real text (MuSiQue paragraphs cut into chunks), chunk KV in "
            f"{ttft['kv_dtype']}; cacheblend at r = {ttft['ratio']:g}. TTFT runs from building the prompt "
            "(KV look-ups included) to the first token; median of "
            f"{ttft['repeats']} interleaved runs, every method's KV in the RAM tier except for the disk "
            "tier column, which evicts the RAM tier before each run (the OS page cache may still hold "
            "the files)."
        )
        head = ttft.get("headline")
        if head:
            full = head["ttft_s"]["full_prefill"]
            parts += [
                "",
                f"At {head['num_chunks']} x {head['chunk_tokens']} tokens "
                f"({head['prompt_tokens']} prompt tokens):",
                "",
                _table(
                    ["method", "TTFT (s)", "full prefill / method", "compute fraction"],
                    [
                        [
                            _TTFT_LABELS[label],
                            _f(seconds, 3),
                            _f(full / seconds, 2),
                            _f(head["compute_fraction"].get(label), 3),
                        ]
                        for label, seconds in head["ttft_s"].items()
                    ],
                ),
                "",
                _checks(ttft["checks"]),
                f"- compute ceiling of cacheblend at this size (1 / compute fraction): "
                f"{head['speedup']['compute_ceiling_cacheblend']:.2f}x",
            ]
        labels = list(_TTFT_LABELS)
        parts += [
            "",
            "Sweeps (TTFT in s):",
            "",
            _table(
                ["chunks x tokens", *(_TTFT_LABELS[label] for label in labels), "full / cacheblend"],
                [
                    [
                        f"{p['num_chunks']} x {p['chunk_tokens']}",
                        *(_f(p["ttft_s"][label], 3) for label in labels),
                        _f(p["speedup"]["full_prefill/cacheblend_ram"], 2),
                    ]
                    for p in ttft["points"]
                ],
            ),
        ]
        if "ttft" in plots:
            parts += ["", f"![TTFT vs chunk count and chunk length]({_rel(plots['ttft'], markdown)})"]

    if "prefill" in sections:
        pre = sections["prefill"]
        parts += header("Full prefill: ours vs transformers (issue 2)", "prefill")
        parts += [
            _table(
                ["tokens", "ours (s)", "transformers (s)", "ours / transformers", "max |logit diff|"],
                [
                    [
                        pre["tokens"],
                        _f(pre["ours_s"]),
                        _f(pre["transformers_s"]),
                        _f(pre["ratio_ours_over_transformers"], 3),
                        f"{pre['max_abs_logit_diff']:.1e}",
                    ]
                ],
            ),
            "",
            f"Median of {pre['repeats']} interleaved runs; transformers computes only the last "
            "position's logits.",
            "",
            _checks(pre["checks"]),
        ]

    if "store" in sections:
        loading, storage = sections["store"]["loading"], sections["store"]["storage_bytes"]
        parts += header("KV store: loading and storage (issue 4)", "store")
        loads = loading["load_all_layers_s"]
        parts += [
            f"{loading['num_chunks']} chunks, {loading['tokens']} tokens in all, stored in "
            f"{loading['kv_dtype']}, "
            f"loaded into {loading['compute_dtype']}; fastest of {loading['repeats']} runs.",
            "",
            _table(
                ["what", "seconds", "vs full prefill"],
                [["full prefill of the same tokens", _f(loading["full_prefill_s"]), "1.00"]]
                + [
                    [
                        f"load all layers, {tier.replace('_', ' ')}",
                        _f(s, 4),
                        _f(s / loading["full_prefill_s"], 4),
                    ]
                    for tier, s in loads.items()
                ],
            ),
            "",
            f"Layer-wise pipelining (load layer i+1 while recomputing r = {loading['ratio']:g} of layer i):",
            "",
            _table(
                ["tier", "prefetch", "wall (s)", "load (s)", "waited (s)", "load hidden"],
                [
                    [
                        tier.replace("_", " "),
                        mode.removeprefix("prefetch_"),
                        _f(r["wall_s"]),
                        _f(r["load_s"]),
                        _f(r["wait_s"]),
                        f"{r['hidden_fraction']:.0%}",
                    ]
                    for tier, modes in loading["pipelined"].items()
                    for mode, r in modes.items()
                ],
            ),
            "",
            f"Storage per chunk of {results['config']['chunk_tokens']} tokens:",
            "",
            _table(
                ["dtype", "bytes/token", "payload bytes", "file bytes"],
                [[d, v["bytes_per_token"], v["payload_bytes"], v["file_bytes"]] for d, v in storage.items()],
            ),
        ]

    if "deviation" in sections:
        dev = sections["deviation"]
        parts += header("Attention deviation vs recompute ratio (issue 3)", "deviation")
        parts += [
            f"{dev['prompts']} real RAG prompts (MuSiQue questions with their retrieved chunks). Deviation "
            "against full prefill, averaged over layers then prompts: attention = L2 distance of the "
            "question tokens' attention rows; KV = relative L2 distance of the prompt's K and V. "
            f"`epic@{dev['epic_matched_k']}` recomputes as many tokens per chunk as cacheblend at r = 0.15.",
            "",
            _table(
                ["method", "tokens recomputed", "attention deviation", "KV deviation"],
                [
                    [f"`{label}`", _f(e["recompute_ratio"], 3), _f(e["attention"], 4), _f(e["kv"], 4)]
                    for label, e in dev["summary"].items()
                ],
            ),
            "",
            _checks(dev["checks"]),
        ]
        if "deviation" in plots:
            parts += ["", f"![attention deviation vs ratio]({_rel(plots['deviation'], markdown)})"]

    if "ingest" in sections:
        ing = sections["ingest"]
        parts += header("Ingest and query on the sample corpus (issue 5)", "ingest")
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in ing["stage_seconds"].items())
        parts += [
            _table(
                ["files", "chunks", "tokens", "KV bytes", "work (s)", "chunks/s", "tokens/s"],
                [
                    [
                        ing["files"],
                        ing["chunks"],
                        ing["tokens"],
                        ing["kv_bytes"],
                        _f(ing["work_seconds"], 1),
                        _f(ing["chunks_per_s"], 2),
                        _f(ing["tokens_per_s"], 0),
                    ]
                ],
            ),
            "",
            f"Stages: {stages} (work excludes loading the tokenizer, embedder and model). Query TTFT "
            "(engine TTFT as `query --json` reports it; retrieval excluded), median over the "
            f"{len(next(iter(ing['queries'].values())))} sample questions:",
            "",
            _table(
                ["method", "TTFT (s)"],
                [[f"`{m}`", _f(s)] for m, s in ing["query_ttft_median_s"].items()],
            ),
        ]

    if "throughput" in sections:
        thr = sections["throughput"]
        parts += header("Throughput: concurrent requests (issue 10)", "throughput")
        rows = []
        for method, levels in thr["runners"]["scheduler"].items():
            for level, r in levels.items():
                rows.append(["batching scheduler", f"`{method}`", level, *_throughput_cells(r)])
        for method, r in thr["runners"]["sequential"].items():
            rows.append(["one at a time", f"`{method}`", r["requests"], *_throughput_cells(r)])
        parts += [
            f"MuSiQue questions with {thr['chunks_per_request']} chunks of {thr['chunk_tokens']} tokens "
            "each, "
            "neighbouring requests sharing half their chunks, all submitted at once; "
            f"{thr['max_new_tokens']} new tokens each (greedy). TTFT counts from submission (queueing "
            "included).",
            "",
            _table(
                ["runner", "method", "requests", "requests/s", "tokens/s", "TTFT p50 (s)", "TTFT p95 (s)"],
                rows,
            ),
            "",
            _checks(thr["checks"]),
        ]
    return "\n".join(parts)


def _throughput_cells(row: dict[str, Any]) -> list[str]:
    return [
        _f(row["requests_per_s"], 3),
        _f(row["tokens_per_s"], 2),
        _f(row["ttft_p50_s"], 2),
        _f(row["ttft_p95_s"], 2),
    ]


def plot_deviation(results: dict[str, Any], path: Path) -> Path:
    """Mean attention deviation against the share of tokens recomputed, cacheblend as a curve."""
    plt = _pyplot()
    summary = results["sections"]["deviation"]["summary"]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    curve = sorted((e["ratio"], e["attention"]) for e in summary.values() if e["ratio"] is not None)
    ax.plot([c[0] for c in curve], [c[1] for c in curve], "o-", label="cacheblend (r)")
    for label, e in summary.items():
        if e["ratio"] is None:
            ax.plot(e["recompute_ratio"], e["attention"], "s", label=label)
    ax.set_xlabel("share of chunk tokens recomputed")
    ax.set_ylabel("attention deviation vs full prefill")
    ax.set_title(
        f"Attention deviation vs recompute ratio ({results['sections']['deviation']['prompts']} prompts)"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_ttft_sweeps(results: dict[str, Any], path: Path) -> Path:
    """TTFT per method against the chunk count (left) and the chunk length (right)."""
    plt = _pyplot()
    ttft = results["sections"]["ttft"]
    config = results["config"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, fixed_key, fixed, xlabel in (
        (axes[0], "num_chunks", "chunk_tokens", config["chunk_tokens"], "chunks"),
        (axes[1], "chunk_tokens", "num_chunks", config["num_chunks"], "tokens per chunk"),
    ):
        points = sorted((p for p in ttft["points"] if p[fixed_key] == fixed), key=lambda p: p[key])
        for label, name in _TTFT_LABELS.items():
            ax.plot([p[key] for p in points], [p["ttft_s"][label] for p in points], "o-", label=name)
        ax.set_xticks([p[key] for p in points])
        ax.set_xlabel(f"{xlabel} ({fixed_key.replace('_', ' ')} = {fixed})")
        ax.set_ylabel("TTFT (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Time to first token")
    return _save(fig, path)


def _log_x(ax) -> None:
    """Log-scale x axis labelled with plain numbers at 1, 2, 5 x 10^k."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    # no timestamp in the PNG metadata: an unchanged plot stays byte-identical
    fig.savefig(path, dpi=110, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
