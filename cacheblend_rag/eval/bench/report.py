"""The bench section of BENCHMARKS.md: a header per section (command, duration, machine, load) and one
renderer per section."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..markdown import checks_list, fmt, machine_line, relative_link, table
from .codec import render_codec
from .config import ALL_SECTIONS
from .round import render_round
from .vllm import BLEND, FULL

TTFT_LABELS = {
    "transformers": "transformers (full prefill)",
    "full_prefill": "full prefill (ours)",
    "prefix_cache": "prefix_cache",
    "full_reuse": "full_reuse",
    "cacheblend_ram": "cacheblend, RAM tier",
    "cacheblend_disk": "cacheblend, disk tier (cold)",
    "cacheblend_hkvd": "cacheblend with HKVD selection, RAM tier",
    "epic": "epic",
}


@dataclass(frozen=True)
class Page:
    """What every section renderer may refer to: all results, the markdown file, the plots made."""

    results: dict[str, Any]
    markdown: Path
    plots: dict[str, Path]

    def header(self, title: str, name: str) -> list[str]:
        section = self.results["sections"][name]
        load = section["load_average"]
        command = self.results.get("commands", {}).get(name) or "cacheblend-rag bench"
        return [
            "",
            f"### {title}",
            "",
            f"`{command}` (section `{name}`, {section['seconds']:.0f} s). "
            f"Machine: {machine_line(section['machine'])}; 1-min load average "
            f"{load['before'][0]:.1f} before, {load['after'][0]:.1f} after.",
            "",
        ]


def render_bench(results: dict[str, Any], markdown: Path, plots: dict[str, Path]) -> str:
    """The whole bench section: every section the results hold, in the order of :data:`ALL_SECTIONS`."""
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
    page = Page(results, markdown, plots)
    for name in ALL_SECTIONS:
        section = results["sections"].get(name)
        if section is not None:
            title, render = RENDERERS[name]
            parts += page.header(title, name) + render(page, section)
    return "\n".join(parts)


def render_ttft(page: Page, ttft: dict[str, Any]) -> list[str]:
    parts: list[str] = []
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
            table(
                ["method", "TTFT (s)", "full prefill / method", "compute fraction"],
                [
                    [
                        TTFT_LABELS[label],
                        fmt(seconds, 3),
                        fmt(full / seconds, 2),
                        fmt(head["compute_fraction"].get(label), 3),
                    ]
                    for label, seconds in head["ttft_s"].items()
                ],
            ),
            "",
            checks_list(ttft["checks"]),
            f"- compute ceiling of cacheblend at this size (1 / compute fraction): "
            f"{head['speedup']['compute_ceiling_cacheblend']:.2f}x",
        ]
    labels = list(TTFT_LABELS)
    parts += [
        "",
        "Sweeps (TTFT in s):",
        "",
        table(
            ["chunks x tokens", *(TTFT_LABELS[label] for label in labels), "full / cacheblend"],
            [
                [
                    f"{p['num_chunks']} x {p['chunk_tokens']}",
                    *(fmt(p["ttft_s"][label], 3) for label in labels),
                    fmt(p["speedup"]["full_prefill/cacheblend_ram"], 2),
                ]
                for p in ttft["points"]
            ],
        ),
    ]
    if "ttft" in page.plots:
        parts += [
            "",
            f"![TTFT vs chunk count and chunk length]({relative_link(page.plots['ttft'], page.markdown)})",
        ]
    return parts


def render_prefill(page: Page, pre: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    parts += [
        table(
            ["tokens", "ours (s)", "transformers (s)", "ours / transformers", "max |logit diff|"],
            [
                [
                    pre["tokens"],
                    fmt(pre["ours_s"]),
                    fmt(pre["transformers_s"]),
                    fmt(pre["ratio_ours_over_transformers"], 3),
                    f"{pre['max_abs_logit_diff']:.1e}",
                ]
            ],
        ),
        "",
        f"Median of {pre['repeats']} interleaved runs; transformers computes only the last "
        "position's logits.",
        "",
        checks_list(pre["checks"]),
    ]
    return parts


def render_store(page: Page, section: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    loading, storage = section["loading"], section["storage_bytes"]
    loads = loading["load_all_layers_s"]
    parts += [
        f"{loading['num_chunks']} chunks, {loading['tokens']} tokens in all, stored in "
        f"{loading['kv_dtype']}, "
        f"loaded into {loading['compute_dtype']}; fastest of {loading['repeats']} runs.",
        "",
        table(
            ["what", "seconds", "vs full prefill"],
            [["full prefill of the same tokens", fmt(loading["full_prefill_s"]), "1.00"]]
            + [
                [
                    f"load all layers, {tier.replace('_', ' ')}",
                    fmt(s, 4),
                    fmt(s / loading["full_prefill_s"], 4),
                ]
                for tier, s in loads.items()
            ],
        ),
        "",
        f"Layer-wise pipelining (load layer i+1 while recomputing r = {loading['ratio']:g} of layer i):",
        "",
        table(
            ["tier", "prefetch", "wall (s)", "load (s)", "waited (s)", "load hidden"],
            [
                [
                    tier.replace("_", " "),
                    mode.removeprefix("prefetch_"),
                    fmt(r["wall_s"]),
                    fmt(r["load_s"]),
                    fmt(r["wait_s"]),
                    f"{r['hidden_fraction']:.0%}",
                ]
                for tier, modes in loading["pipelined"].items()
                for mode, r in modes.items()
            ],
        ),
        "",
        f"Storage per chunk of {page.results['config']['chunk_tokens']} tokens:",
        "",
        table(
            ["dtype", "bytes/token", "payload bytes", "file bytes"],
            [[d, v["bytes_per_token"], v["payload_bytes"], v["file_bytes"]] for d, v in storage.items()],
        ),
    ]
    return parts


def render_deviation(page: Page, dev: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    parts += [
        f"{dev['prompts']} real RAG prompts (MuSiQue questions with their retrieved chunks). Deviation "
        "against full prefill, averaged over layers then prompts: attention = L2 distance of the "
        "question tokens' attention rows; KV = relative L2 distance of the prompt's K and V. "
        f"`epic@{dev['epic_matched_k']}` recomputes as many tokens per chunk as cacheblend at r = 0.15.",
        "",
        table(
            ["method", "tokens recomputed", "attention deviation", "KV deviation"],
            [
                [f"`{label}`", fmt(e["recompute_ratio"], 3), fmt(e["attention"], 4), fmt(e["kv"], 4)]
                for label, e in dev["summary"].items()
            ],
        ),
        "",
        checks_list(dev["checks"]),
    ]
    if "deviation" in page.plots:
        parts += [
            "",
            f"![attention deviation vs ratio]({relative_link(page.plots['deviation'], page.markdown)})",
        ]
    return parts


def render_ingest(page: Page, ing: dict[str, Any]) -> list[str]:
    parts: list[str] = []
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in ing["stage_seconds"].items())
    parts += [
        table(
            ["files", "chunks", "tokens", "KV bytes", "work (s)", "chunks/s", "tokens/s"],
            [
                [
                    ing["files"],
                    ing["chunks"],
                    ing["tokens"],
                    ing["kv_bytes"],
                    fmt(ing["work_seconds"], 1),
                    fmt(ing["chunks_per_s"], 2),
                    fmt(ing["tokens_per_s"], 0),
                ]
            ],
        ),
        "",
        f"Stages: {stages} (work excludes loading the tokenizer, embedder and model). Query TTFT "
        "(engine TTFT as `query --json` reports it; retrieval excluded), median over the "
        f"{len(next(iter(ing['queries'].values())))} sample questions:",
        "",
        table(
            ["method", "TTFT (s)"],
            [[f"`{m}`", fmt(s)] for m, s in ing["query_ttft_median_s"].items()],
        ),
    ]
    return parts


def render_throughput(page: Page, thr: dict[str, Any]) -> list[str]:
    parts: list[str] = []
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
        table(
            ["runner", "method", "requests", "requests/s", "tokens/s", "TTFT p50 (s)", "TTFT p95 (s)"],
            rows,
        ),
        "",
        checks_list(thr["checks"]),
    ]
    fusion = thr.get("batched_fusion")
    if fusion:
        rows = [
            [f"{tokens}", label.replace("_", " "), *_throughput_cells(r[label])]
            for tokens, r in fusion.items()
            for label in ("together", "one_at_a_time")
        ]
        claims = [
            {
                "claim": f"batched fusion of {thr['requests']} requests with {tokens}-token chunks: "
                f"{r['speedup']:.2f}x one-at-a-time fusion in requests/s "
                f"({'>= 1.3x' if int(tokens) < thr['chunk_tokens'] else 'never slower'})",
                "passed": r["speedup"] >= (1.3 if int(tokens) < thr["chunk_tokens"] else 1.0),
            }
            for tokens, r in fusion.items()
        ]
        parts += [
            "",
            f"Fusing an admission group together (one projection and one MLP per layer over every "
            f"request's selected tokens) vs one request at a time: `cacheblend`, {thr['requests']} "
            "requests submitted at once through the scheduler, median of the interleaved runs.",
            "",
            table(["chunk tokens", "fusion", "requests/s", "tokens/s", "TTFT p50 (s)", "TTFT p95 (s)"], rows),
            "",
            checks_list(claims),
        ]
    return parts


def _throughput_cells(row: dict[str, Any]) -> list[str]:
    return [
        fmt(row["requests_per_s"], 3),
        fmt(row["tokens_per_s"], 2),
        fmt(row["ttft_p50_s"], 2),
        fmt(row["ttft_p95_s"], 2),
    ]


def render_vllm(page: Page, vllm: dict[str, Any]) -> list[str]:
    ttft, blend = vllm["ttft_s"], vllm["cacheblend"]
    return [
        f"vllm {vllm['vllm_version']}, {vllm['num_chunks']} chunks x {vllm['chunk_tokens']} tokens of "
        f"MuSiQue text ({vllm['prompt_tokens']} prompt tokens), r = {vllm['ratio']:g}; TTFT from building "
        f"the segments to the first token, median of {vllm['repeats']} interleaved runs after a warm-up "
        "round; vLLM's prefix cache off.",
        "",
        table(
            ["", "vLLM full prefill", "vLLM + CacheBlend"],
            [
                ["TTFT median (s)", fmt(ttft[FULL]), fmt(ttft[BLEND])],
                ["samples (s)", *(", ".join(fmt(s, 2) for s in vllm["samples_s"][k]) for k in (FULL, BLEND))],
                ["speed-up", "1.00", fmt(vllm["speedup_full_over_cacheblend"], 2)],
            ],
        ),
        "",
        f"Claimed tokens {blend['claimed_tokens']} (vLLM counted {blend['vllm_cached_tokens']} as computed "
        f"externally), {blend['reused_tokens']} reused, recompute ratio {fmt(blend['recompute_ratio'], 3)}; "
        f"same first token: {fmt(vllm['same_first_token'])}; "
        f"engine start {fmt(vllm['engine_startup_s'], 1)} s.",
        *_vllm_sizes(vllm),
        *_vllm_memory(vllm.get("worker_memory")),
    ]


def _vllm_sizes(vllm: dict[str, Any]) -> list[str]:
    """TTFT per prompt size, first-token agreement over many prompts and the processor (older results
    have none of them)."""
    lines = []
    sizes = vllm.get("by_chunks") or {}
    if sizes:
        rows = [
            [
                f"{n} x {vllm['chunk_tokens']} ({run['prompt_tokens']} tokens)",
                fmt(run["ttft_s"][FULL]),
                fmt(run["ttft_s"][BLEND]),
                fmt(run["speedup_full_over_cacheblend"], 2),
                fmt(run["same_first_token"]),
            ]
            for n, run in sorted(sizes.items(), key=lambda item: int(item[0]))
        ]
        header = ["prompt", "vLLM full prefill (s)", "vLLM + CacheBlend (s)", "speed-up", "same first token"]
        lines += ["", table(header, rows)]
    agreement = vllm.get("first_token_agreement")
    if agreement:
        lines += [
            "",
            f"Same first token as vLLM full prefill on {agreement['same']} of {agreement['prompts']} MuSiQue "
            f"prompts ({vllm['num_chunks']} x {vllm['chunk_tokens']} tokens, r = {vllm['ratio']:g}).",
        ]
    processor = vllm.get("processor")
    if processor:
        lines += ["", f"Processor: {processor['cpu']}; SIMD: {' '.join(processor['simd']) or 'unknown'}."]
    return lines


def _vllm_memory(memory: dict[str, Any] | None) -> list[str]:
    """The worker's resident memory, fusor on its own copy of the weights vs on vLLM's (older results
    have no such numbers)."""
    if not memory:
        return []

    def mib(value: int | None) -> str:
        return fmt(None if value is None else value / 2**20, 0)

    rows = []
    for label, m in (("own copy of the weights", memory["copy"]), ("vLLM's weights", memory["shared"])):
        after = m["after_request"]
        rows.append(
            [
                label,
                mib(m["at_start"]["rss_bytes"]),
                mib(after["rss_bytes"]),
                mib(after.get("rss_anon_bytes")),
                mib(after.get("rss_file_bytes")),
                mib(m["own_bytes"]),
            ]
        )
    saved = memory["copy"]["after_request"]["rss_bytes"] - memory["shared"]["after_request"]["rss_bytes"]
    return [
        "",
        "vLLM worker resident memory (MiB; read after `malloc_trim`) by where the fusor's weights come "
        "from, the same work for both: start, precompute the chunks, one CacheBlend request. At start a "
        "copy's weights are memory-mapped from the checkpoint and mostly not resident yet.",
        "",
        table(
            ["fusor weights", "RSS at start", "RSS after", "anon after", "file after", "fusor's own tensors"],
            rows,
        ),
        "",
        f"Saved by fusing on vLLM's weights: {mib(saved)} MiB of RSS after the request.",
    ]


def render_serve(page: Page, serve: dict[str, Any]) -> list[str]:
    rows = []
    for level in serve["levels"]:
        for method, levels in serve["methods"].items():
            r = levels[str(level)]
            rows.append(
                [
                    level,
                    f"`{method}`",
                    r["requests"],
                    fmt(r["requests_per_s"], 3),
                    fmt(r["ttft_p50_s"], 2),
                    fmt(r["ttft_p95_s"], 2),
                    fmt(r["server_ttft_p50_s"], 2),
                    fmt(r["cached_tokens_mean"], 0),
                ]
            )
    speedup = ", ".join(
        f"{level} clients: {x:.2f}x" for level, x in serve["speedup_cacheblend_vs_full"].items()
    )
    ratio = f"r = {serve['ratio']:g}" if serve.get("ratio") is not None else "r chosen by the server"
    return [
        f"A real `serve` process on loopback; each client streams {serve['rounds']} chat completions back "
        f"to back (the engine's RAG prompt with the top {serve['top_k']} chunks of {serve['chunk_tokens']} "
        f"tokens pasted in as text, recognised by the server; {serve['max_tokens']} new tokens, greedy; "
        f"cacheblend at {ratio}). TTFT as the client sees it: from sending the request to the first "
        "streamed token (HTTP, recognition, queueing, fusion); the server's own TTFT beside it. Batch "
        f"scheduler of {serve['max_batch']} slots.",
        "",
        table(
            [
                "clients",
                "method",
                "requests",
                "requests/s",
                "TTFT p50 (s)",
                "TTFT p95 (s)",
                "server TTFT p50 (s)",
                "cached tokens",
            ],
            rows,
        ),
        "",
        f"Requests/s of cacheblend over full prefill: {speedup or '–'}.",
    ]


RENDERERS: dict[str, tuple[str, Callable[[Page, dict[str, Any]], list[str]]]] = {
    "ttft": ("Time to first token", render_ttft),
    "prefill": ("Full prefill: ours vs transformers (issue 2)", render_prefill),
    "store": ("KV store: loading and storage (issue 4)", render_store),
    "deviation": ("Attention deviation vs recompute ratio (issue 3)", render_deviation),
    "ingest": ("Ingest and query on the sample corpus (issue 5)", render_ingest),
    "throughput": ("Throughput: concurrent requests (issue 10)", render_throughput),
    "round": ("Rounds: N agents over the same chunks (issue 21)", render_round),
    "serve": ("Serving: concurrent clients through `cacheblend-rag serve` (issue 17)", render_serve),
    "vllm": ("vLLM backend: full prefill vs CacheBlend inside vLLM (issue 8)", render_vllm),
    "codec": ("Chunk KV codecs: bytes, TTFT, ingest, remote reads (issue 22)", render_codec),
}
