"""The accelerator check's output: a row as it is measured, and a saved run as BENCHMARKS.md's tables."""

from __future__ import annotations


def time_cell(seconds: float, speedup: float, width: int = 0) -> str:
    """A path's time in ms and its speed-up over full prefill, as every table here shows it."""
    return f"{seconds * 1e3:>{width}.1f} ({speedup:.2f}x)"


def print_row(row: dict, tiers: list[str], labels: list[str]) -> None:
    cells = [
        f"{row['config']:<13}",
        f"{row['workload']:>7}",
        f"{row['prompt_tokens']:>6}",
        f"{row['full_prefill_s'] * 1e3:>9.1f}",
    ]
    for tier in tiers:
        for label in labels:
            if f"{label}_{tier}_s" not in row:
                cells.append(f"{'FAILED' if f'{label}_{tier}_error' in row else '-':>16}")
                continue
            cells.append(time_cell(row[f"{label}_{tier}_s"], row[f"{label}_{tier}_speedup"], width=8))
    cells.append(f"{row['r1_relative_error']:.1e}{'' if row['r1_ok'] else ' FAIL'}")
    print(" | ".join(cells), flush=True)


TIER_NAMES = {
    "hbm": "in float16, in device memory",
    "host": "in float16, in pinned host RAM",
    "ram": "in float16, in RAM",
    "int8_hbm": "in int8 (the default codec), in device memory",
    "int8_host": "in int8 (the default codec), in pinned host RAM",
    "int8_ram": "in int8 (the default codec), in RAM",
}


def render_markdown(results: dict) -> str:
    """A saved run (``--json``) as markdown: one table per tier of chunk KV (per config and workload, full
    prefill and each path's time and speed-up; r = 1's relative error in the first), then the batches and
    the dispatch profile when they ran."""
    known = ("hbm", "host", "ram", "int8_hbm", "int8_host", "int8_ram")
    tiers = [t for t in known if any(f"cacheblend_{t}_s" in r for r in results["rows"])]
    lines: list[str] = []
    for index, tier in enumerate(tiers):
        head = ["config", "workload", "prompt tokens", "full prefill ms"]
        head += [f"{label} ms" for label in results["methods"]] + (["r = 1 rel. error"] if index == 0 else [])
        if lines:
            lines.append("")
        lines += [f"Chunk KV {TIER_NAMES.get(tier, tier)} (`{tier}`):", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in results["rows"]:
            cells = [
                row["config"],
                row["workload"],
                str(row["prompt_tokens"]),
                f"{row['full_prefill_s'] * 1e3:.1f}",
            ]
            for label in results["methods"]:
                seconds = row.get(f"{label}_{tier}_s")
                if seconds is None:  # failed, or a path that does not take this tier
                    cells.append("FAILED" if f"{label}_{tier}_error" in row else "-")
                else:
                    cells.append(time_cell(seconds, row[f"{label}_{tier}_speedup"]))
            if index == 0:
                cells.append(f"{row['r1_relative_error']:.1e}")
            lines.append("| " + " | ".join(cells) + " |")
    for found in results.get("batches", []):
        batched = [label for label in results["methods"] if f"{label}_s" in found]
        lines += [
            "",
            f"{found['batch']} prompts at once, {found['config']} {found['workload']} (chunk KV on the "
            "device): full prefill of all in one forward against fusing all together (Fusor.fuse_many)",
            "",
            "| full prefill ms | " + " | ".join(f"{label} ms" for label in batched) + " |",
            "|---|" + "---|" * len(batched),
            f"| {found['full_prefill_s'] * 1e3:.1f} | "
            + " | ".join(time_cell(found[f"{label}_s"], found[f"{label}_speedup"]) for label in batched)
            + " |",
        ]
    for found in results.get("profiles", []):
        lines += [
            "",
            f"Where the time goes, {found['config']} {found['workload']} (chunk KV on the device): time "
            "until the device finished, the device kernels' own time and count, the host's time inside "
            "torch ops",
            "",
            "| path | finish ms | device kernels ms | kernels | host in torch ops ms |",
            "|---|---|---|---|---|",
        ]
        for run in found["runs"]:
            lines.append(
                f"| {run['label']} | {run['finish_s'] * 1e3:.1f} | {run['device_kernel_s'] * 1e3:.1f} | "
                f"{run['kernels']} | {run['host_op_s'] * 1e3:.1f} |"
            )
    return "\n".join(lines)
