"""Single-request TTFT through ``Engine.generate``, to compare two checkouts side by side.

One process answers one prompt (``--chunks`` MuSiQue chunks of ``--chunk-tokens`` tokens and a fixed
question) with ``--method``: a warm-up that computes and stores the chunk KV (float16, a fresh temporary
store) and brings it into the RAM tier, then ``--repeats`` timed requests of one new token each, from
building the segments (the KV look-ups included) to the token; prints the median and every sample as JSON.
It uses only API older checkouts have, so the same file times them (``--pythonpath`` puts a checkout first):

    python tools/ttft_single.py --compare OLD_CHECKOUT --rounds 3

runs this process for the old checkout and for this one in turn, ``--rounds`` times each, and prints the
medians and the ratio of their medians (new / old).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "Which river flows through the city where the author of the book was born?"


def chunks_of(tokenizer, count: int, size: int) -> list[tuple[int, ...]]:
    from cacheblend_rag.eval.datasets import load_dataset

    ids: list[int] = []
    for case in load_dataset("musique").cases:
        for context in case.contexts:
            ids += tokenizer(context.document + "\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= count * size:
            break
    return [tuple(ids[i * size : (i + 1) * size]) for i in range(count)]


def measure(args: argparse.Namespace) -> dict:
    import torch

    from cacheblend_rag.engine import ChunkRef, Engine, SamplingParams

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            from cacheblend_rag.settings import get_settings

            engine = Engine(None, Path(tmp) / "kv", kv_dtype="float16", config=get_settings())
        except TypeError:  # a checkout from before the engine took its settings as a value
            engine = Engine(None, Path(tmp) / "kv", kv_dtype="float16")
        refs = [ChunkRef(ids) for ids in chunks_of(engine.model.tokenizer, args.chunks, args.chunk_tokens)]
        one = SamplingParams(max_tokens=1)
        for _ in range(2):  # computes and stores the chunk KV, then reads it into the RAM tier
            engine.generate(engine.rag_segments(QUESTION, refs, args.method), args.method, one)
        samples = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            engine.generate(engine.rag_segments(QUESTION, refs, args.method), args.method, one)
            samples.append(time.perf_counter() - started)
        engine.close()
    return {"median_s": statistics.median(samples), "samples_s": samples}


def compare(args: argparse.Namespace) -> None:
    here = Path(__file__).resolve()
    runs: dict[str, list[float]] = {"old": [], "new": []}
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in _MEASURE_OPTIONS]
    for _ in range(args.rounds):
        for label, path in (("old", args.compare), ("new", here.parents[1])):
            env = {**os.environ, "PYTHONPATH": str(path)}
            out = subprocess.run(
                [sys.executable, str(here), *forwarded], env=env, check=True, capture_output=True, text=True
            )
            runs[label].append(json.loads(out.stdout)["median_s"])
            print(f"{label}: {runs[label][-1]:.3f} s", file=sys.stderr)
    old, new = statistics.median(runs["old"]), statistics.median(runs["new"])
    print(
        json.dumps({"old_s": runs["old"], "new_s": runs["new"], "old": old, "new": new, "new/old": new / old})
    )


_MEASURE_OPTIONS = ("chunks", "chunk_tokens", "repeats", "method", "threads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--method", default="cacheblend")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare", type=Path, help="an older checkout to time against this one")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.compare is not None:
        compare(args)
    else:
        print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()
