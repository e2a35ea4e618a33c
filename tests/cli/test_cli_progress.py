"""Progress of the long commands: lines with the count, rate and time left when output is not a terminal
(a log file, a pipe, CI), written while the work runs, not at its end; Rich bars on a terminal."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from cacheblend_rag.cli.progress import ProgressReporter

SAMPLE_CORPUS = Path(__file__).parents[2] / "examples" / "data" / "corpus"
# "[12 s] precompute KV (chunks): 9/31 (29%), 1.36/s, ~16 s left, 6.6 s so far"
PROGRESS_LINE = re.compile(r"^\[[^\]]+\] (?P<stage>[^:]+): (?P<done>\d+)/(?P<total>\d+) \(\d+%\)")


def plain_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_lines_say_the_count_rate_and_time_left_every_tenth_of_a_stage():
    console, out = plain_console()
    with ProgressReporter(console, {"kv": "precompute KV"}, every_s=3600) as progress:
        for done in range(101):
            progress.update("kv", done, 100)
    lines = out.getvalue().splitlines()
    counts = [int(PROGRESS_LINE.match(line)["done"]) for line in lines]
    assert counts == list(range(0, 101, 10)), lines  # the start, each tenth, the end: not every item
    assert all(line.split("] ", 1)[1].startswith("precompute KV: ") for line in lines)
    assert re.search(r"/s, ~[\d.]+ s left", lines[5]) and lines[-1].endswith(" s") and "took" in lines[-1]
    assert "━" not in out.getvalue()


def test_a_stage_with_no_news_still_prints_a_line_every_few_seconds():
    console, out = plain_console()
    with ProgressReporter(console, every_s=0.5) as progress:
        progress.update("section ttft", 0)  # counts nothing: a bench section
        time.sleep(2.6)  # the timer looks every second
        progress.finish("section ttft")
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3, lines
    assert all(line.split("] ", 1)[1].startswith("section ttft: running, ") for line in lines[:-1])
    assert "so far" in lines[1] and lines[-1].split("] ", 1)[1].startswith("section ttft: done, took")


def test_a_terminal_gets_bars_not_lines():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with ProgressReporter(console, {"embed": "embed (new chunks)"}) as progress:
        for done in range(5):
            progress.update("embed", done + 1, 5)
    text = out.getvalue()
    assert "embed (new chunks)" in text and "━" in text and "5/5" in text
    assert not any(PROGRESS_LINE.match(line) for line in text.splitlines())


def test_ingest_into_a_log_file_writes_progress_lines_while_it_runs(tmp_path):
    # `cacheblend-rag ingest DIR --corpus C > log 2>&1`: the log is read while the process runs
    log = tmp_path / "ingest.log"
    argv = [
        sys.executable,
        "-m",
        "cacheblend_rag",
        "ingest",
        str(SAMPLE_CORPUS),
        "--corpus",
        str(tmp_path / "c"),
    ]
    env = {**os.environ, "CACHEBLEND_THREADS": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    seen_while_running: list[str] = []
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 600
            while process.poll() is None and time.monotonic() < deadline:
                lines = log.read_text().splitlines()
                running = [
                    line for line in lines if (m := PROGRESS_LINE.match(line)) and m["done"] != m["total"]
                ]
                if running and process.poll() is None:  # still running after the read: seen before the end
                    seen_while_running = running
                time.sleep(0.2)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
    lines = log.read_text().splitlines()
    assert process.returncode == 0, lines[-30:]
    assert seen_while_running, lines  # progress in the log before the run ended
    summary = next(i for i, line in enumerate(lines) if "ingest into" in line)
    progress = [PROGRESS_LINE.match(line) for line in lines[:summary]]
    assert all(progress), lines[:summary]  # everything before the summary is a progress line
    kv = [line for line, m in zip(lines, progress, strict=False) if m["stage"] == "precompute KV (chunks)"]
    assert len(kv) >= 4 and any(re.search(r"\d/s, ~[\d.]+ (s|min \d+ s) left", line) for line in kv), kv
    assert "━" not in log.read_text()  # no bar drawn into a file
