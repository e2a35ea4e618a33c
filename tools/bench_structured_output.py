"""Measure grammar-constrained decoding libraries on the default model's tokenizer (CPU, one thread).

For each candidate that imports (xgrammar, llguidance, outlines-core): import time, tokenizer setup time
(once per tokenizer), compile time of two JSON schemas (from Pydantic models), and per token of a valid
JSON answer the time to compute the next-token mask and to advance the matcher; plus the installed size
of the library and the dependencies it would add to this project, and its licence. Then the cost of this
project's own layer (cacheblend_rag.engine.constraints, on llguidance) per request and per token.

    CACHEBLEND_THREADS=1 python tools/bench_structured_output.py [--lib-path DIR ...] [--json OUT]

``--lib-path`` puts a directory first on sys.path: candidates can be measured from ``pip install
--target DIR`` without installing them into the project's environment. The numbers in
docs/structured_output.md come from this script.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# What each candidate adds to this project's environment (dists already there, e.g. torch, not counted).
CANDIDATES: dict[str, list[str]] = {
    "xgrammar": ["xgrammar", "apache-tvm-ffi", "triton"],
    "llguidance": ["llguidance"],
    "outlines": ["outlines", "outlines-core", "genson", "diskcache", "jsonschema", "referencing", "rpds-py"],
}
REPEATS = 20


def schemas() -> dict[str, tuple[dict, str]]:
    """name -> (JSON schema from a Pydantic model, a valid answer used as the decoded token sequence)."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        answer: str = Field(description="The answer, in a few words.")
        confidence: int = Field(description="0 to 10.")

    class Person(BaseModel):
        name: str
        born: int | None = None

    class Report(BaseModel):
        answer: str
        confidence: int = Field(ge=0, le=10)
        kind: Literal["person", "place", "date", "other"]
        evidence: list[str] = Field(max_length=3)
        people: list[Person]

    return {
        "answer": (Answer.model_json_schema(), '{"answer": "Gotthold Ephraim Lessing", "confidence": 8}'),
        "report": (
            Report.model_json_schema(),
            '{"answer": "Lessing", "confidence": 8, "kind": "person", "evidence": ["wrote Miss Sara '
            'Sampson"], "people": [{"name": "Lessing", "born": 1729}]}',
        ),
    }


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _dist_size(name: str) -> tuple[int | None, str | None, str | None]:
    """Installed bytes, licence and version of a distribution, or Nones when it is not installed."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None, None, None
    size = 0
    for file in dist.files or []:
        path = Path(dist.locate_file(file))
        if path.is_file():
            size += path.stat().st_size
    meta = dist.metadata
    licence = meta.get("License-Expression") or meta.get("License") or ""
    if not licence or len(licence) > 40:
        classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if "License" in c]
        licence = ", ".join(classifiers) or licence[:40]
    return size, licence, dist.version


def _per_token(tokens: list[int], mask: Callable[[], None], advance: Callable[[int], None]) -> dict:
    mask_s, advance_s = [], []
    for token in tokens:
        mask_s.append(_timed(mask)[0])
        advance_s.append(_timed(lambda t=token: advance(t))[0])
    mask_s.append(_timed(mask)[0])  # the mask after the last token (EOS only)
    return {"mask": mask_s, "advance": advance_s}


def bench_xgrammar(tokenizer, vocab_size: int, schema: dict, tokens: list[int], allowed_bits) -> dict:
    import_s, xgr = _timed(lambda: importlib.import_module("xgrammar"))
    setup_s, info = _timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
    compiles = []
    for _ in range(3):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        seconds, compiled = _timed(lambda c=compiler: c.compile_json_schema(json.dumps(schema)))
        compiles.append(seconds)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    runs = []
    for _ in range(REPEATS):
        matcher = xgr.GrammarMatcher(compiled)
        runs.append(
            _per_token(tokens, lambda m=matcher: m.fill_next_token_bitmask(bitmask), matcher.accept_token)
        )
        assert matcher.is_terminated() or matcher.accept_token(tokenizer.eos_token_id)
    allowed = allowed_bits(bitmask.numpy())
    return {"import_s": import_s, "tokenizer_setup_s": setup_s, "compile_s": compiles, "runs": runs,
            "final_mask_allows": allowed}  # fmt: skip


def bench_llguidance(tokenizer, vocab_size: int, schema: dict, tokens: list[int], allowed_bits) -> dict:
    import numpy as np

    import_s, llg = _timed(lambda: importlib.import_module("llguidance"))
    importlib.import_module("llguidance.hf")
    setup_s, lltok = _timed(lambda: llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size))
    grammar = llg.LLMatcher.grammar_from_json_schema(schema)
    compiles = []
    for _ in range(3):
        # the matcher compiles its grammar when built; the first mask finishes the lexer setup
        bitmask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)

        def build(bm=bitmask):
            matcher = llg.LLMatcher(lltok, grammar)
            matcher.unsafe_compute_mask_ptr(bm.ctypes.data, bm.nbytes)
            return matcher

        seconds, matcher = _timed(build)
        assert not matcher.is_error(), matcher.get_error()
        compiles.append(seconds)
    runs = []
    for _ in range(REPEATS):
        matcher = llg.LLMatcher(lltok, grammar)

        def mask(m=matcher, bm=bitmask):
            m.unsafe_compute_mask_ptr(bm.ctypes.data, bm.nbytes)

        def advance(token, m=matcher):
            assert m.consume_token(token), m.get_error()

        runs.append(_per_token(tokens, mask, advance))
        assert matcher.is_accepting()
    allowed = allowed_bits(bitmask)
    return {"import_s": import_s, "tokenizer_setup_s": setup_s, "compile_s": compiles, "runs": runs,
            "final_mask_allows": allowed}  # fmt: skip


def bench_outlines(tokenizer, vocab_size: int, schema: dict, tokens: list[int], allowed_bits) -> dict:
    import numpy as np

    import_s, core = _timed(lambda: importlib.import_module("outlines_core"))
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary():
        # as outlines' own backend builds it: token strings, EOS left out
        words: dict[str, list[int]] = {}
        for token, token_id in tokenizer.get_vocab().items():
            if token_id != tokenizer.eos_token_id:
                words.setdefault(tokenizer.convert_tokens_to_string([token]), []).append(token_id)
        return core.Vocabulary(tokenizer.eos_token_id, words)

    setup_s, vocab = _timed(vocabulary)
    compiles = []
    for _ in range(3):
        seconds, index = _timed(lambda: core.Index(build_regex_from_schema(json.dumps(schema)), vocab))
        compiles.append(seconds)
    bitmask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)
    runs = []
    for _ in range(REPEATS):
        guide = core.Guide(index)

        def mask(g=guide):
            g.write_mask_into(bitmask.ctypes.data, bitmask.size, bitmask.itemsize)

        runs.append(_per_token(tokens, mask, lambda t, g=guide: g.advance(t, return_tokens=False)))
        assert guide.is_finished()
    allowed = allowed_bits(bitmask)
    return {"import_s": import_s, "tokenizer_setup_s": setup_s, "compile_s": compiles, "runs": runs,
            "final_mask_allows": allowed}  # fmt: skip


def bench_ours(tokenizer, vocab_size: int, schema: dict, target: str) -> dict:
    """What cacheblend_rag.engine.constraints adds per request and per token on top of the library: the
    matcher, unpacking the bitmask, masking the logits, the closing estimate (a budget 8 tokens above the
    answer's length, so that the end of the answer runs near the budget)."""
    import torch

    from cacheblend_rag.engine.constraints import JsonConstraint

    constraint = JsonConstraint(schema)
    eos = {tokenizer.eos_token_id}
    tokens = tokenizer(target, add_special_tokens=False)["input_ids"]
    budget = len(tokens) + 8  # the closing estimate is refreshed at every step of the last 20 or so
    setup_s, _ = _timed(lambda: constraint.start(tokenizer, eos, vocab_size, budget))
    logits = torch.randn(vocab_size)
    starts, steps = [], []
    for _ in range(REPEATS):
        seconds, state = _timed(lambda: constraint.start(tokenizer, eos, vocab_size, budget))
        starts.append(seconds)
        for token in tokens:
            steps.append(_timed(lambda t=token, st=state: (st.mask(logits), st.accept(t)))[0])
    quantiles = statistics.quantiles(steps, n=20)
    return {
        "first_start_s": round(setup_s, 3),
        "start_ms_median": round(statistics.median(starts) * 1e3, 2),
        "step_us_median": round(statistics.median(steps) * 1e6, 1),
        "step_us_p95": round(quantiles[18] * 1e6, 1),
    }


BENCHES = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance, "outlines": bench_outlines}


def summarize(result: dict) -> dict:
    masks = [s for run in result["runs"] for s in run["mask"]]
    advances = [s for run in result["runs"] for s in run["advance"]]
    first_masks = [run["mask"][0] for run in result["runs"]]
    quantiles = statistics.quantiles(masks, n=20)
    return {
        "import_s": round(result["import_s"], 3),
        "tokenizer_setup_s": round(result["tokenizer_setup_s"], 3),
        "compile_ms_min": round(min(result["compile_s"]) * 1e3, 2),
        "compile_ms_first": round(result["compile_s"][0] * 1e3, 2),
        "mask_us_median": round(statistics.median(masks) * 1e6, 1),
        "mask_us_p95": round(quantiles[18] * 1e6, 1),
        "mask_us_first_token": round(statistics.median(first_masks) * 1e6, 1),
        "advance_us_median": round(statistics.median(advances) * 1e6, 1),
        "final_mask_allows": result["final_mask_allows"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib-path", action="append", default=[], help="extra sys.path entry (first)")
    parser.add_argument("--only", action="append", choices=sorted(BENCHES), help="measure only these")
    parser.add_argument("--json", type=Path, help="write the full results here")
    args = parser.parse_args(argv)
    for path in reversed(args.lib_path):
        sys.path.insert(0, path)

    import numpy as np
    import torch

    from cacheblend_rag.models.loader import configure_threads
    from cacheblend_rag.models.tokenizer import load_model_tokenizer

    configure_threads()
    tokenizer = load_model_tokenizer().tokenizer
    vocab_size = max(len(tokenizer), tokenizer.vocab_size)

    def allowed_bits(bitmask) -> list[int]:
        bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), bitorder="little")[:vocab_size]
        return np.flatnonzero(bits).tolist()[:8]

    cases = schemas()
    report: dict = {
        "tokenizer_vocab": vocab_size,
        "targets": {name: target for name, (_, target) in cases.items()},
        "torch_threads": torch.get_num_threads(),
        "eos_token_id": tokenizer.eos_token_id,
        "libraries": {},
    }
    for name in args.only or BENCHES:
        sizes = {dist: _dist_size(dist) for dist in CANDIDATES[name]}
        entry: dict = {
            "version": sizes[CANDIDATES[name][0]][2],
            "licence": sizes[CANDIDATES[name][0]][1],
            "installed_mib": {dist: round(s[0] / 2**20, 1) for dist, s in sizes.items() if s[0] is not None},
            "not_installed": [dist for dist, s in sizes.items() if s[0] is None],
        }
        for case, (schema, target) in cases.items():
            tokens = tokenizer(target, add_special_tokens=False)["input_ids"]
            try:
                raw = BENCHES[name](tokenizer, vocab_size, schema, tokens, allowed_bits)
            except ImportError as exc:
                entry["error"] = f"not importable: {exc}"
                break
            except Exception as exc:  # a schema the library cannot handle is a result too
                entry[case] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            else:
                entry[case] = summarize(raw)
        report["libraries"][name] = entry
        print(name, json.dumps(entry), flush=True)
    try:
        report["cacheblend_constraints"] = {
            case: bench_ours(tokenizer, vocab_size, schema, target)
            for case, (schema, target) in cases.items()
        }
        print("cacheblend_constraints", json.dumps(report["cacheblend_constraints"]), flush=True)
    except ImportError as exc:
        report["cacheblend_constraints"] = {"error": f"not importable: {exc}"}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
