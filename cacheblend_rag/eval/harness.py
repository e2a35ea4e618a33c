"""The evaluation harness behind ``cacheblend-rag eval``.

For each case: store its contexts in the data set's eval corpus (the product's corpus, chunked at most
``chunk_tokens`` tokens and embedded as a user's documents are; :mod:`.retrieval`), retrieve the ``top_k``
chunks with the corpus's search filtered to the case (summaries have no question: they take the first
``top_k`` chunks in document order), precompute the chunks' KV into a persistent KV store (reused across
runs), then answer with every method. ``full_recompute`` runs first: its answer, first-token logits and
answer tokens are the reference the other methods are scored against.

Per method and case the results file keeps the answer, TTFT (building the segments, which includes the
KV look-ups, plus fusion and the first token), the fusion's recompute ratio and compute fraction, and the
metrics of :mod:`.metrics`: gold score (QA F1 or Rouge-L), agreement with the full_recompute answer
(token F1, and Rouge-L for summaries), first-token agreement, KL of the first-token distribution against
full prefill (with full prefill's first-token margin, which splits the summary's first-token agreement
into decisive cases and near-ties), and the teacher-forced NLL of the gold answer and of the
full_recompute answer under the method's fused cache. The file is rewritten after every case, and a
rerun skips cases already in it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..blend.methods import METHODS_REVISION, Reuse
from ..blend.spec import reuse_of
from ..config import DECISIVE_MARGIN, DEFAULT_CHUNK_TOKENS, DEFAULT_TOP_K
from ..engine import ChunkRef, EngineProtocol, SamplingParams
from ..engine.fidelity import MethodRun, compare_methods, store_in_ram
from ..errors import EvalDataError
from ..models.runtime import LayerwiseModel
from ..settings import get_settings
from ..store.keys import dtype_name
from .datasets import Dataset, EvalCase, load_dataset, select_cases
from .engines import (
    SUMMARY_INSTRUCTION,
    default_corpus_dir,
    default_kv_dir,
    encode_once,
    engine_name,
    one_engine,
    torch_engines,
    vllm_engines,
)
from .metrics import check_decisive_margin, qa_f1, rouge_l
from .records import (
    RESULTS_FORMAT,
    CaseRecord,
    EvalResults,
    PromptRecord,
    RetrievedRecord,
    RunConfig,
    load_results,
    save_results,
)
from .results import machine_info
from .retrieval import EvalCorpus
from .summary import REFERENCE, summarize
from .variants import Variant, method_variants

log = logging.getLogger(__name__)

DEFAULT_METHODS = ("full_recompute", "prefix_cache", "full_reuse", "cacheblend", "epic")
DEFAULT_RATIOS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
DEFAULT_MAX_NEW_TOKENS = {"qa": 32, "summary": 64}


def task_question(case: EvalCase, task: str) -> str:
    return SUMMARY_INSTRUCTION if task == "summary" else case.question


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
    corpus_dir: Path | None = None  # the data set's eval corpus (default: beside the KV store)
    kv_dtypes: Sequence[str] = ()  # chunk KV codecs to compare, the first the run's own (default: settings)
    engine: str = "torch"  # the engine that answers: "torch" (ours) or "vllm" (vLLM with our connector)
    # nats by which full prefill's first token must lead for a case to be decisive; it splits the summary
    # only (records keep the margin itself), so a resumed run may change it
    decisive_margin: float = DECISIVE_MARGIN


@dataclass
class EvalRun:
    """A loaded model, engine and retrieval set up for one data set."""

    dataset: Dataset
    task: str
    specs: list[Variant]
    engine: EngineProtocol  # the run's chunk context
    engines: dict[str, EngineProtocol]  # by engine_name(): chunk context [/codec], sharing the model
    corpus: EvalCorpus  # the data set's contexts, retrieved from as the product retrieves
    sampling: SamplingParams
    config: RunConfig


def setup_run(
    config: EvalConfig, model: LayerwiseModel | None = None, engine: EngineProtocol | None = None
) -> EvalRun:
    """Load what a run needs. ``model``: the PyTorch engines' model (default: load ``config.model``);
    ``engine``: an engine of ``config.engine``'s kind to answer every variant with, with its own prompts
    and store (default: eval makes its own, with the QA or summary prompt)."""
    from ..corpus.embedder import get_embedder
    from ..models.loader import load_model
    from ..models.tokenizer import load_model_tokenizer

    dataset = load_dataset(config.data)
    task = dataset.task if config.task == "auto" else config.task
    if task not in ("qa", "summary"):
        raise ValueError(f"unknown task {config.task!r}: use auto, qa or summary")
    if config.top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {config.top_k}")
    check_decisive_margin(config.decisive_margin)
    settings = get_settings()
    codecs = [dtype_name(c) for c in config.kv_dtypes] or [dtype_name(settings.kv_dtype)]
    specs = method_variants(config.methods, config.ratios, codecs)
    context = config.chunk_context or settings.chunk_context
    tokenizer = load_model_tokenizer(config.model, settings.home)
    kv_dir = Path(config.kv_dir) if config.kv_dir is not None else default_kv_dir(tokenizer.fingerprint)
    compute_dtype = settings.compute_dtype
    if engine is not None:
        one_engine(specs, context, codecs[0], config.engine)
        engines: dict[str, EngineProtocol] = {context: engine}
        kv_dir = engine.store.root
    elif config.engine == "vllm":
        engines = vllm_engines(tokenizer, specs, context, codecs[0], kv_dir, task)
    elif config.engine == "torch":
        model = model or load_model(config.model, config=settings)
        compute_dtype = str(model.dtype).removeprefix("torch.")
        engines = torch_engines(model, specs, context, codecs, kv_dir, task)
    else:
        raise ValueError(f"unknown engine {config.engine!r}: use torch or vllm")
    if tokenizer.fingerprint != next(iter(engines.values())).model.fingerprint:  # the corpus's tokens
        raise ValueError(
            f"the engine's model is not {config.model or 'the default model'}; name it in --model"
        )
    engine = engines[engine_name(Variant(REFERENCE, specs[0].spec), context, codecs[0])]
    max_new = config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS[task]
    builder = engine.prompts
    run_config = RunConfig(
        data=str(config.data),
        dataset=dataset.name,
        dataset_path=str(dataset.path),
        dataset_sha256=dataset.sha256,
        task=task,
        limit=config.limit,
        seed=config.seed,
        top_k=config.top_k,
        chunk_tokens=config.chunk_tokens,
        max_new_tokens=max_new,
        engine=config.engine,
        methods_revision=METHODS_REVISION,  # what a method label computes (blend/methods.py)
        model=engine.model.name,
        model_fingerprint=engine.model.fingerprint,
        compute_dtype=compute_dtype,
        kv_dtype=engine.store.kv_dtype_name,
        kv_dtypes=codecs,
        chunk_context=context,
        skip=config.skip,
        decisive_margin=config.decisive_margin,
        kv_dir=str(kv_dir),
        retrieval=(
            "top-k by cosine similarity (all-MiniLM-L6-v2), the eval corpus's search filtered to the case"
            if task == "qa"
            else "first k chunks"
        ),
        prompt=PromptRecord(
            system=builder.system_prompt,
            user_template=builder.user_template,
            question=SUMMARY_INSTRUCTION if task == "summary" else "{question}",
        ),
    )
    corpus_dir = config.corpus_dir or default_corpus_dir(kv_dir, dataset, config.chunk_tokens)
    return EvalRun(
        dataset=dataset,
        task=task,
        specs=specs,
        engine=engine,
        engines=engines,
        corpus=EvalCorpus.open(
            Path(corpus_dir),
            tokenizer,
            get_embedder(),
            config.chunk_tokens,
            engine.store,
            context,
        ),
        sampling=SamplingParams(max_tokens=max_new),
        config=run_config,
    )


def evaluate_case(run: EvalRun, case: EvalCase, specs: Sequence[Variant]) -> CaseRecord:
    """Retrieve, precompute and answer ``case`` with each of ``specs`` (the reference must be first)."""
    engine, task = run.engine, run.task
    question = task_question(case, task)
    retrieved, total_chunks = run.corpus.retrieve(case, run.config.top_k, task)
    refs = [ChunkRef(r.token_ids, r.chunk_id) for r in retrieved]
    started = time.perf_counter()
    context, codec = run.config.chunk_context, run.config.codecs[0]
    needs: dict[str, set[Reuse]] = {}
    for variant in specs:
        needs.setdefault(engine_name(variant, context, codec), set()).add(reuse_of(variant.spec))
    encode_once([run.engines[name] for name in needs], refs)
    for name, reuses in needs.items():
        if reuses - {Reuse.NOTHING}:
            store_in_ram(run.engines[name], question, refs, sorted(reuses - {Reuse.NOTHING}))
    precompute_s = time.perf_counter() - started

    gold_ids = engine.model.tokenizer(case.answers[0], add_special_tokens=False)["input_ids"]
    runs = [MethodRun(v.label, v.spec, run.engines[engine_name(v, context, codec)]) for v in specs]
    methods, prompt_tokens = compare_methods(runs, question, refs, run.sampling, continuation=gold_ids)
    reference = methods[REFERENCE].answer
    scored = {
        label: replace(
            record,
            gold=gold_score(task, record.answer, case.answers),
            agreement_rouge_l=rouge_l(record.answer, [reference]) if task == "summary" else None,
        )
        for label, record in methods.items()
    }
    return CaseRecord(
        id=case.case_id,
        question=case.question,
        answers=list(case.answers),
        chunks_total=total_chunks,
        retrieved=[RetrievedRecord.of(r) for r in retrieved],
        prompt_tokens=prompt_tokens,
        cached_tokens=sum(len(r.token_ids) for r in retrieved),
        precompute_s=precompute_s,
        methods=scored,
    )


def gold_score(task: str, answer: str, answers: Sequence[str]) -> float:
    """Rouge-L for summaries, LongBench QA F1 otherwise."""
    return rouge_l(answer, answers) if task == "summary" else qa_f1(answer, answers)


def run_eval(
    config: EvalConfig,
    model: LayerwiseModel | None = None,
    on_case: Callable[[int, int, CaseRecord], None] | None = None,
    engine: EngineProtocol | None = None,
) -> EvalResults:
    """Run (or resume) an evaluation; returns the results, also written to ``config.json_path`` after
    every case when given. ``model``, ``engine``: see :func:`setup_run`."""
    run = setup_run(config, model, engine)
    try:
        return _run_cases(run, config, on_case)
    finally:
        run.corpus.close()


def _run_cases(
    run: EvalRun, config: EvalConfig, on_case: Callable[[int, int, CaseRecord], None] | None
) -> EvalResults:
    cases = select_cases(run.dataset.cases, config.limit, config.seed, config.skip)
    results = _start_results(run, config)
    done = {c.id: c for c in results.cases}
    labels = [s.label for s in run.specs]
    for position, case in enumerate(cases, start=1):
        previous = done.get(case.case_id)
        missing = [s for s in run.specs if previous is None or s.label not in previous.methods]
        if missing:
            if previous is not None and missing[0].label != REFERENCE:
                # the reference's answer and logits are needed again; its rerun is deterministic
                missing.insert(0, next(s for s in run.specs if s.label == REFERENCE))
            record = evaluate_case(run, case, missing)
            log.info("case %d: %s", case.case_id, ", ".join(s.label for s in missing))
            if previous is not None:  # the case as it was, with the new records (the reference's rerun)
                record = replace(previous, methods={**previous.methods, **record.methods})
            done[case.case_id] = record
            results = replace(results, cases=sorted(done.values(), key=lambda c: c.id))
            summary = summarize(results.cases, run.task, labels, decisive_margin=config.decisive_margin)
            results = replace(results, summary=summary)
            if config.json_path is not None:
                save_results(results, config.json_path)
        if on_case is not None:
            on_case(position, len(cases), done[case.case_id])
    selected = {c.case_id for c in cases}
    results = replace(
        results, summary=summarize(results.cases, run.task, labels, selected, config.decisive_margin)
    )
    if config.json_path is not None:
        save_results(results, config.json_path)
    return results


def _start_results(run: EvalRun, config: EvalConfig) -> EvalResults:
    path = config.json_path
    commands = [config.command] if config.command else []
    if path is None or not Path(path).is_file():
        return EvalResults(
            format=RESULTS_FORMAT, config=run.config, commands=commands, cases=[], machine=machine_info()
        )
    results = load_results(path)
    changed = _changed_setting(results.config, run.config)
    if changed is not None:
        name, then, now = changed
        raise EvalDataError(
            f"{path} was produced with another {name} ({then!r}, now {now!r}); give a new --json file to "
            "start over"
        )
    return replace(
        results,
        # the stored keys keep their places; keys the file lacked follow them
        config=replace(run.config, key_order=results.config.key_order),
        commands=list(dict.fromkeys([*results.commands, *commands])),  # each command once, first run's place
        # the machine line reports the first start's load; each resume is recorded beside it
        resumes=[*(results.resumes or []), machine_info()],
    )


def _changed_setting(stored: RunConfig, run: RunConfig) -> tuple[str, Any, Any] | None:
    """The first setting that changes per-case results and differs between a results file's run and this
    one, as (name, then, now): a results file can only be resumed when none does. A file made before a
    setting was recorded ran with its default."""
    settings = (
        ("dataset_sha256", stored.dataset_sha256, run.dataset_sha256),
        ("task", stored.task, run.task),
        ("top_k", stored.top_k, run.top_k),
        ("chunk_tokens", stored.chunk_tokens, run.chunk_tokens),
        ("max_new_tokens", stored.max_new_tokens, run.max_new_tokens),
        ("model_fingerprint", stored.model_fingerprint, run.model_fingerprint),
        ("kv_dtype", stored.kv_dtype, run.kv_dtype),
        ("prompt", stored.prompt.to_dict(), run.prompt.to_dict()),
        ("chunk_context", stored.chunk_context, run.chunk_context),
        ("engine", stored.engine_kind, run.engine_kind),
        ("methods_revision", stored.revision, run.revision),
    )
    return next(((name, then, now) for name, then, now in settings if then != now), None)
