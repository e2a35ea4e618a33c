"""The evaluation harness behind ``cacheblend-rag eval``.

For each case: chunk every context with the ingest chunker (at most ``chunk_tokens`` tokens), retrieve the
``top_k`` chunks by embedding similarity to the question (summaries have no question: they take the first
``top_k`` chunks in document order), precompute the chunks' KV into a persistent KV store (reused across
runs), then answer with every method. ``full_recompute`` runs first: its answer, first-token logits and
answer tokens are the reference the other methods are scored against.

Per method and case the results file keeps the answer, TTFT (building the segments, which includes the
KV look-ups, plus fusion and the first token), the fusion's recompute ratio and compute fraction, and the
metrics of :mod:`.metrics`: gold score (QA F1 or Rouge-L), agreement with the full_recompute answer
(token F1, and Rouge-L for summaries), first-token agreement, KL of the first-token distribution against
full prefill, and the teacher-forced NLL of the gold answer and of the full_recompute answer under the
method's fused cache. The file is rewritten after every case, and a rerun skips cases already in it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..blend.fusor import FusionResult
from ..blend.methods import Reuse
from ..blend.segments import ChunkContext
from ..blend.spec import reuse_of
from ..config import DEFAULT_CHUNK_TOKENS, DEFAULT_TOP_K
from ..corpus.embedder import Embedder
from ..engine import ChunkRef, Engine, PromptBuilder, SamplingParams
from ..engine.fidelity import (
    MethodRun,
    RecordingEngine,
    compare_methods,
    store_in_ram,
)
from ..errors import EvalDataError
from ..models.runtime import LayerwiseModel, ModelShape
from ..models.tokenizer import chunk_context_ids
from ..settings import get_settings
from ..store.keys import dtype_name
from ..store.kvstore import KVStore
from ..store.shared import KVStoreOptions
from ..text.chunker import Chunker
from .datasets import Dataset, EvalCase, load_dataset, select_cases
from .metrics import continuation_nll, qa_f1, rouge_l
from .results import machine_info, write_json_atomic
from .summary import REFERENCE, summarize
from .variants import Variant, method_variants

log = logging.getLogger(__name__)

RESULTS_FORMAT = "cacheblend-rag-eval/1"
DEFAULT_METHODS = ("full_recompute", "prefix_cache", "full_reuse", "cacheblend", "epic")
DEFAULT_RATIOS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
DEFAULT_MAX_NEW_TOKENS = {"qa": 32, "summary": 64}
# The paper-style short-answer prompt; the model is told to answer in a few words, not a sentence.
QA_SYSTEM = "You are a helpful assistant. Answer the question using only the passages provided."
QA_TEMPLATE = "Passages:\n{passages}\n\nQuestion: {question}\nAnswer with a few words only, no sentence."
SUMMARY_SYSTEM = "You are a helpful assistant that summarizes news articles."
SUMMARY_TEMPLATE = "News articles:\n{passages}\n\n{question}"
SUMMARY_INSTRUCTION = "Write a short summary of the news articles above."
# Settings that change per-case results: a results file can only be resumed when they match.
_RESUME_KEYS = (
    "dataset_sha256",
    "task",
    "top_k",
    "chunk_tokens",
    "max_new_tokens",
    "model_fingerprint",
    "kv_dtype",
    "prompt",
    "chunk_context",
)


def settings_store(
    root: Path, fingerprint: str, shape: ModelShape, codec: str | None = None, **options: Any
) -> KVStore:
    """A chunk KV store for eval and bench at ``root``: in ``codec`` (default: the ``kv_dtype`` setting),
    with the settings' tier budgets and remote tier; ``options`` (:class:`KVStore`'s) override them."""
    settings = get_settings()
    kwargs = {**KVStoreOptions.of(settings).store_kwargs(), **options}
    return KVStore(root, fingerprint, shape, codec or settings.kv_dtype, **kwargs)


def default_kv_dir(model: LayerwiseModel) -> Path:
    """Where eval and bench keep chunk KV across runs: one store per model under the settings' home."""
    return get_settings().home / "eval" / "kv" / model.fingerprint[:16]


def prompt_builder(tokenizer, task: str) -> PromptBuilder:
    if task == "summary":
        return PromptBuilder(tokenizer, SUMMARY_SYSTEM, SUMMARY_TEMPLATE)
    return PromptBuilder(tokenizer, QA_SYSTEM, QA_TEMPLATE)


def task_question(case: EvalCase, task: str) -> str:
    return SUMMARY_INSTRUCTION if task == "summary" else case.question


# -- retrieval ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseChunk:
    """A chunk an eval case's prompt holds: where it was cut from, its tokens and its retrieval score."""

    context: int  # index of the context the chunk was cut from
    chunk: int  # index of the chunk within that context
    token_ids: tuple[int, ...]
    score: float | None  # cosine similarity to the question (None: taken in document order)


def retrieve_chunks(
    case: EvalCase, chunker: Chunker, embedder: Embedder | None, top_k: int, task: str
) -> tuple[list[CaseChunk], int]:
    """The chunks a case's prompt holds, in prompt order, and how many chunks the case has in all.

    QA: the ``top_k`` most similar to the question, best first (the paper's retrieval). Summaries: the
    first ``top_k`` chunks in document order."""
    pieces: list[tuple[int, int, tuple[int, ...], str]] = []
    for i, context in enumerate(case.contexts):
        for j, chunk in enumerate(chunker.split(context.document)):
            pieces.append((i, j, chunk.token_ids, chunk.text))
    if not pieces:
        raise EvalDataError(f"case {case.case_id}: its contexts give no tokens")
    if task == "summary":
        return [CaseChunk(i, j, ids, None) for i, j, ids, _ in pieces[:top_k]], len(pieces)
    if embedder is None:
        raise ValueError("QA retrieval needs an embedder")
    vectors = embedder.embed([text for *_, text in pieces])
    scores = vectors @ embedder.embed_query(case.question)
    order = np.argsort(-scores, kind="stable")[:top_k]
    chosen = [CaseChunk(*pieces[k][:3], float(scores[k])) for k in order]
    return chosen, len(pieces)


# -- the run -----------------------------------------------------------------------------------------


@dataclass
class EvalConfig:
    """What ``cacheblend-rag eval`` runs (see the CLI for the meaning of each option)."""

    data: str
    methods: Sequence[str] = DEFAULT_METHODS
    ratios: Sequence[float] = DEFAULT_RATIOS
    limit: int | None = None
    seed: int = 0
    top_k: int = DEFAULT_TOP_K
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    max_new_tokens: int | None = None  # default per task: DEFAULT_MAX_NEW_TOKENS
    task: str = "auto"
    model: str | None = None
    kv_dir: Path | None = None
    json_path: Path | None = None
    command: str = ""
    skip: int = 0  # cases of the seeded order left out before --limit (a held-out set)
    chunk_context: str | None = None  # the chunk context of variants that name none (default: settings)
    kv_dtypes: Sequence[str] = ()  # chunk KV codecs to compare, the first the run's own (default: settings)


@dataclass
class EvalRun:
    """A loaded model, engine and retrieval set up for one data set."""

    dataset: Dataset
    task: str
    specs: list[Variant]
    engine: RecordingEngine  # the run's chunk context
    engines: dict[str, RecordingEngine]  # by engine_name(): chunk context [/codec], sharing the model
    chunker: Chunker
    embedder: Embedder | None
    sampling: SamplingParams
    config: dict[str, Any] = field(default_factory=dict)


def setup_run(config: EvalConfig, model: LayerwiseModel | None = None) -> EvalRun:
    from ..corpus.embedder import get_embedder
    from ..models.loader import load_model

    dataset = load_dataset(config.data)
    task = dataset.task if config.task == "auto" else config.task
    if task not in ("qa", "summary"):
        raise ValueError(f"unknown task {config.task!r}: use auto, qa or summary")
    if config.top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {config.top_k}")
    codecs = [dtype_name(c) for c in config.kv_dtypes] or [dtype_name(get_settings().kv_dtype)]
    specs = method_variants(config.methods, config.ratios, codecs)
    model = model or load_model(config.model, config=get_settings())
    kv_dir = Path(config.kv_dir) if config.kv_dir is not None else default_kv_dir(model)
    context = config.chunk_context or get_settings().chunk_context
    engines: dict[str, RecordingEngine] = {}
    stores: dict[str, KVStore] = {}  # one per codec, shared by the chunk contexts
    for variant in [Variant(REFERENCE, specs[0].spec), *specs]:
        name = engine_name(variant, context, codecs[0])
        if name in engines:
            continue
        codec = variant.kv_dtype or codecs[0]
        if codec not in stores:
            stores[codec] = settings_store(kv_dir, model.fingerprint, model.shape, codec)
        chunk_context = ChunkContext(chunk_context_ids(model.tokenizer, variant.context or context))
        engines[name] = RecordingEngine(
            model, stores[codec], prompt_builder(model.tokenizer, task), chunk_context, config=get_settings()
        )
    engine = engines[engine_name(Variant(REFERENCE, specs[0].spec), context, codecs[0])]
    max_new = config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS[task]
    builder = engine.prompts
    run_config = {
        "data": str(config.data),
        "dataset": dataset.name,
        "dataset_path": str(dataset.path),
        "dataset_sha256": dataset.sha256,
        "task": task,
        "limit": config.limit,
        "seed": config.seed,
        "top_k": config.top_k,
        "chunk_tokens": config.chunk_tokens,
        "max_new_tokens": max_new,
        "model": model.name,
        "model_fingerprint": model.fingerprint,
        "compute_dtype": str(model.dtype).removeprefix("torch."),
        "kv_dtype": engine.store.kv_dtype_name,
        "kv_dtypes": codecs,
        "chunk_context": context,
        "skip": config.skip,
        "kv_dir": str(kv_dir),
        "retrieval": "top-k by cosine similarity (all-MiniLM-L6-v2)" if task == "qa" else "first k chunks",
        "prompt": {
            "system": builder.system_prompt,
            "user_template": builder.user_template,
            "question": SUMMARY_INSTRUCTION if task == "summary" else "{question}",
        },
    }
    return EvalRun(
        dataset=dataset,
        task=task,
        specs=specs,
        engine=engine,
        engines=engines,
        chunker=Chunker(model.tokenizer, config.chunk_tokens),
        embedder=get_embedder() if task == "qa" else None,
        sampling=SamplingParams(max_new_tokens=max_new),
        config=run_config,
    )


def engine_name(variant: Variant, context: str, codec: str) -> str:
    """The engine a variant runs on: its chunk context, and its codec when not the run's own."""
    chunk_context = variant.context or context
    return chunk_context if variant.kv_dtype in (None, codec) else f"{chunk_context}/{variant.kv_dtype}"


def _encode_once(engines: Sequence[Engine], refs: Sequence[ChunkRef]) -> None:
    """Engines of one chunk context over other codecs take the chunk KV the first of them computes,
    each encoding it in its own codec: a chunk is prefilled once per case, not once per codec."""
    groups: dict[ChunkContext, list[Engine]] = {}
    for engine in engines:
        groups.setdefault(engine.chunk_context, []).append(engine)
    for first, *others in groups.values():
        for ref in refs:
            missing = [e for e in others if not e.store.contains(e.chunk_key(ref.token_ids))]
            if missing:
                kv = first.precompute(ref.token_ids)
                for engine in missing:
                    engine.store.put(engine.chunk_key(ref.token_ids), kv)


def evaluate_case(run: EvalRun, case: EvalCase, specs: Sequence[Variant]) -> dict[str, Any]:
    """Retrieve, precompute and answer ``case`` with each of ``specs`` (the reference must be first)."""
    engine, task = run.engine, run.task
    question = task_question(case, task)
    top_k = run.config["top_k"]
    retrieved, total_chunks = retrieve_chunks(case, run.chunker, run.embedder, top_k, task)
    refs = [ChunkRef(r.token_ids) for r in retrieved]
    started = time.perf_counter()
    context, codec = run.config["chunk_context"], run.config["kv_dtypes"][0]
    needs: dict[str, set[Reuse]] = {}
    for variant in specs:
        needs.setdefault(engine_name(variant, context, codec), set()).add(reuse_of(variant.spec))
    _encode_once([run.engines[name] for name in needs], refs)
    for name, reuses in needs.items():
        if reuses - {Reuse.NOTHING}:
            store_in_ram(run.engines[name], question, refs, sorted(reuses - {Reuse.NOTHING}))
    precompute_s = time.perf_counter() - started

    tokenizer = engine.model.tokenizer
    gold_ids = tokenizer(case.answers[0], add_special_tokens=False)["input_ids"]
    runs = [MethodRun(v.label, v.spec, run.engines[engine_name(v, context, codec)]) for v in specs]

    def gold(method: MethodRun, result, fusion: FusionResult) -> dict[str, Any]:
        return {
            "gold": gold_score(task, result.text, case.answers),
            "nll_gold": continuation_nll(
                engine.model, fusion.cache, fusion.num_tokens, fusion.logits, gold_ids
            ),
        }

    methods, prompt_tokens = compare_methods(runs, question, refs, run.sampling, gold)
    if task == "summary":
        reference = methods[REFERENCE]["answer"]
        for record in methods.values():
            record["agreement_rouge_l"] = rouge_l(record["answer"], [reference])
    return {
        "id": case.case_id,
        "question": case.question,
        "answers": list(case.answers),
        "chunks_total": total_chunks,
        "retrieved": [
            {"context": r.context, "chunk": r.chunk, "tokens": len(r.token_ids), "score": r.score}
            for r in retrieved
        ],
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(len(r.token_ids) for r in retrieved),
        "precompute_s": precompute_s,
        "methods": methods,
    }


def gold_score(task: str, answer: str, answers: Sequence[str]) -> float:
    """Rouge-L for summaries, LongBench QA F1 otherwise."""
    return rouge_l(answer, answers) if task == "summary" else qa_f1(answer, answers)


def run_eval(
    config: EvalConfig,
    model: LayerwiseModel | None = None,
    on_case: Callable[[int, int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) an evaluation; returns the results object, also written to ``config.json_path``
    after every case when given."""
    run = setup_run(config, model)
    cases = select_cases(run.dataset.cases, config.limit, config.seed, config.skip)
    results = _start_results(run, config)
    done = {c["id"]: c for c in results["cases"]}
    labels = [s.label for s in run.specs]
    for position, case in enumerate(cases, start=1):
        previous = done.get(case.case_id)
        missing = [s for s in run.specs if previous is None or s.label not in previous["methods"]]
        if missing:
            if previous is not None and missing[0].label != REFERENCE:
                # the reference's answer and logits are needed again; its rerun is deterministic
                missing.insert(0, next(s for s in run.specs if s.label == REFERENCE))
            record = evaluate_case(run, case, missing)
            log.info("case %d: %s", case.case_id, ", ".join(s.label for s in missing))
            if previous is not None:
                previous["methods"].update(record["methods"])
                record = previous
            done[case.case_id] = record
            results["cases"] = sorted(done.values(), key=lambda c: c["id"])
            results["summary"] = summarize(results, labels)
            if config.json_path is not None:
                save_results(results, config.json_path)
        if on_case is not None:
            on_case(position, len(cases), done[case.case_id])
    selected = {c.case_id for c in cases}
    results["summary"] = summarize(results, labels, selected)
    if config.json_path is not None:
        save_results(results, config.json_path)
    return results


def _start_results(run: EvalRun, config: EvalConfig) -> dict[str, Any]:
    path = config.json_path
    if path is not None and Path(path).is_file():
        results = load_results(path)
        stored = results.get("config", {})
        for key in _RESUME_KEYS:
            if stored.get(key) != run.config.get(key):
                raise EvalDataError(
                    f"{path} was produced with another {key} ({stored.get(key)!r}, now {run.config[key]!r}); "
                    "give a new --json file to start over"
                )
        results["config"] = {**stored, **run.config}
        # the machine line reports the first start's load; each resume is recorded beside it
        results.setdefault("resumes", []).append(machine_info())
        results.setdefault("machine", results["resumes"][-1])
    else:
        results = {"format": RESULTS_FORMAT, "config": run.config, "commands": [], "cases": []}
        results["machine"] = machine_info()
    if config.command:
        results["commands"].append(config.command)
    return results


def load_results(path: str | Path) -> dict[str, Any]:
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise EvalDataError(f"cannot read results file {path}: {exc}") from exc
    if not isinstance(results, dict) or results.get("format") != RESULTS_FORMAT:
        raise EvalDataError(f"{path} is not a cacheblend-rag eval results file (format {RESULTS_FORMAT})")
    return results


def save_results(results: dict[str, Any], path: str | Path) -> None:
    """Write atomically: a crash mid-write leaves the previous file."""
    write_json_atomic(results, path)
