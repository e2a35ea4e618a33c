"""Greedy answers of N MuSiQue prompts, written to JSON, to show a change leaves every answer as it was.

Each prompt is a bundled MuSiQue case's question over its first six contexts (the title on its own line,
then the text, cut at ``--chunk-tokens``), answered by each method with ``--max-new-tokens`` greedy tokens
through the engine's own API (``rag_segments`` then ``generate``) on ``--engine`` torch or vllm. It uses
only API that predates the change it checks, so the same file runs on an older checkout:

    python tools/greedy_answers.py --out /tmp/after.json
    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before python tools/greedy_answers.py --out /tmp/before.json
    python tools/greedy_answers.py --compare /tmp/before.json /tmp/after.json

Chunk KV goes to a fresh temporary store in float16 (the codec default changed over time).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

METHODS = ("full_recompute", "cacheblend")


def answers(engine_kind: str, prompts: int, chunk_tokens: int, max_new: int) -> dict[str, list[list[int]]]:
    from cacheblend_rag.engine import ChunkRef, SamplingParams, create_engine
    from cacheblend_rag.eval.datasets import load_dataset

    out: dict[str, list[list[int]]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as tmp:
        from cacheblend_rag.settings import get_settings

        engine = create_engine(engine_kind, None, Path(tmp) / "kv", kv_dtype="float16", config=get_settings())
        try:
            tok = engine.model.tokenizer
            for case in load_dataset("musique").cases[:prompts]:
                refs = [
                    ChunkRef(tuple(tok(c.document, add_special_tokens=False)["input_ids"][:chunk_tokens]))
                    for c in case.contexts[:6]
                ]
                for method in METHODS:
                    segments = engine.rag_segments(case.question, refs, method)
                    result = engine.generate(segments, method, SamplingParams(max_tokens=max_new))
                    out[method].append(list(result.token_ids))
                print(f"case {case.case_id}: {out['cacheblend'][-1][:8]}", file=sys.stderr)
        finally:
            engine.close()
    return out


def compare(before: Path, after: Path) -> int:
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    failures = 0
    for method in METHODS:
        pairs = list(zip(old["answers"][method], new["answers"][method], strict=True))
        same = sum(a == b for a, b in pairs)
        print(f"{method}: {same} of {len(pairs)} answers identical")
        failures += len(pairs) - same
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="torch", choices=("torch", "vllm"))
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    result = {
        "engine": args.engine,
        "prompts": args.prompts,
        "chunk_tokens": args.chunk_tokens,
        "max_new_tokens": args.max_new_tokens,
        "answers": answers(args.engine, args.prompts, args.chunk_tokens, args.max_new_tokens),
    }
    text = json.dumps(result)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
