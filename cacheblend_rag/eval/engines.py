"""The prompts, chunk KV stores and engines an eval run (and the bench, over eval's store) answers with.

A run answers on PyTorch engines over one loaded model, one per chunk context and codec its variants
name (:func:`torch_engines`), or on one vLLM engine (:func:`vllm_engines`), which takes one chunk context
and codec. Chunk KV is kept across runs in one store per model under the settings' home
(:func:`default_kv_dir`), the data set's eval corpus beside it (:func:`default_corpus_dir`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..blend.segments import ChunkContext
from ..engine import ChunkRef, Engine, EngineProtocol, PromptBuilder
from ..engine.fidelity import REFERENCE
from ..models.runtime import LayerwiseModel, ModelShape
from ..models.tokenizer import ModelTokenizer, chunk_context_ids
from ..settings import Settings, get_settings
from ..store.kvstore import KVStore
from ..store.shared import KVStoreOptions
from .datasets import Dataset
from .variants import Variant

# The paper-style short-answer prompt; the model is told to answer in a few words, not a sentence.
QA_SYSTEM = "You are a helpful assistant. Answer the question using only the passages provided."
QA_TEMPLATE = "Passages:\n{passages}\n\nQuestion: {question}\nAnswer with a few words only, no sentence."
SUMMARY_SYSTEM = "You are a helpful assistant that summarizes news articles."
SUMMARY_TEMPLATE = "News articles:\n{passages}\n\n{question}"
SUMMARY_INSTRUCTION = "Write a short summary of the news articles above."


def settings_store(
    root: Path, fingerprint: str, shape: ModelShape, codec: str | None = None, **options: Any
) -> KVStore:
    """A chunk KV store for eval and bench at ``root``: in ``codec`` (default: the ``kv_dtype`` setting),
    with the settings' tier budgets and remote tier; ``options`` (:class:`KVStore`'s) override them."""
    settings = get_settings()
    kwargs = {**KVStoreOptions.of(settings).store_kwargs(), **options}
    return KVStore(root, fingerprint, shape, codec or settings.kv_dtype, **kwargs)


def default_kv_dir(model: LayerwiseModel | str) -> Path:
    """Where eval and bench keep chunk KV across runs: one store per model (or model fingerprint) under
    the settings' home."""
    fingerprint = model if isinstance(model, str) else model.fingerprint
    return get_settings().home / "eval" / "kv" / fingerprint[:16]


def default_corpus_dir(kv_dir: Path, dataset: Dataset, chunk_tokens: int) -> Path:
    """Where a data set's eval corpus lives: beside the run's KV store, one per data set file and chunk
    size."""
    return kv_dir.with_name(f"{kv_dir.name}-corpora") / f"{dataset.sha256[:16]}-{chunk_tokens}"


def prompt_builder(tokenizer, task: str) -> PromptBuilder:
    if task == "summary":
        return PromptBuilder(tokenizer, SUMMARY_SYSTEM, SUMMARY_TEMPLATE)
    return PromptBuilder(tokenizer, QA_SYSTEM, QA_TEMPLATE)


def qa_engine(model: LayerwiseModel, settings: Settings, kv_dir: Path | None = None) -> Engine:
    """A PyTorch engine over eval's chunk KV store of ``model`` (or ``kv_dir``) with eval's QA prompt:
    what bench sections and scripts that measure on eval's cases answer with."""
    kv_dir = kv_dir or default_kv_dir(model)
    return Engine(model, kv_dir, prompt_builder(model.tokenizer, "qa"), config=settings)


def torch_engines(
    model: LayerwiseModel, specs: list[Variant], context: str, codecs: list[str], kv_dir: Path, task: str
) -> dict[str, EngineProtocol]:
    """A PyTorch engine per chunk context and codec the variants run on, all over one model."""
    engines: dict[str, EngineProtocol] = {}
    stores: dict[str, KVStore] = {}  # one per codec, shared by the chunk contexts
    for variant in [Variant(REFERENCE, specs[0].spec), *specs]:
        name = engine_name(variant, context, codecs[0])
        if name in engines:
            continue
        codec = variant.kv_dtype or codecs[0]
        if codec not in stores:
            stores[codec] = settings_store(kv_dir, model.fingerprint, model.shape, codec)
        chunk_context = ChunkContext(chunk_context_ids(model.tokenizer, variant.context or context))
        engines[name] = Engine(
            model, stores[codec], prompt_builder(model.tokenizer, task), chunk_context, config=get_settings()
        )
    return engines


def vllm_engines(
    model: ModelTokenizer, specs: list[Variant], context: str, codec: str, kv_dir: Path, task: str
) -> dict[str, EngineProtocol]:
    """The one vLLM engine over ``model`` a run on ``engine="vllm"`` answers with (each starts a vLLM
    instance: the variants must share its chunk context and codec)."""
    from ..engine import create_engine

    one_engine(specs, context, codec, "vllm")
    builder = prompt_builder(model.tokenizer, task)
    engine = create_engine(
        "vllm", model.path, kv_dir, prompt_builder=builder, kv_dtype=codec, config=get_settings()
    )
    return {context: engine}


def one_engine(specs: list[Variant], context: str, codec: str, kind: str) -> None:
    """Refuse variants one engine cannot answer: those of another chunk context or codec."""
    others = {engine_name(v, context, codec) for v in specs} - {context}
    if others:
        raise ValueError(f"eval on one {kind} engine runs one chunk context and codec; drop {sorted(others)}")


def engine_name(variant: Variant, context: str, codec: str) -> str:
    """The engine a variant runs on: its chunk context, and its codec when not the run's own."""
    chunk_context = variant.context or context
    return chunk_context if variant.kv_dtype in (None, codec) else f"{chunk_context}/{variant.kv_dtype}"


def encode_once(engines: Sequence[Engine], refs: Sequence[ChunkRef]) -> None:
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
