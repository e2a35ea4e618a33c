"""Where a round's time goes: per-phase wall time of one round of N agents.

    .venv/bin/python scripts/profile_round.py [--agents 8] [--chunks 6] [--chunk-tokens 512]
        [--no-scheduler] [--old]

The workload of ``bench --only round``: the bench's own agents (:func:`agent_requests`: role i, the same
``--chunks`` MuSiQue chunks of ``--chunk-tokens`` tokens, question i; cacheblend at the default r) over
an engine whose store holds the chunks in RAM. After a warm-up it fuses the round once through
``Engine.fuse_group`` (rounds on) with timers around the round's phases (probe, blend, taking the chunks
out, the members' fusion) and the operations inside them, then (unless ``--no-scheduler``) times the round
through the batch scheduler as the bench does: all agents submitted at once, the time until every one
has its first token. ``--old`` first runs the round with its members fused as requests of their
own (as before they joined one pass over the round's cache) and the probe allocating its scores at every
layer, in the same process, for a before/after under the same load (the probe still runs as the blend's
own). Run it on a quiet machine; it runs the model for about a minute.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from profile_fusion import musique_chunks  # scripts/ is on sys.path when a script in it runs

from cacheblend_rag.blend import fusor as fusor_module
from cacheblend_rag.blend import layers as layers_module
from cacheblend_rag.blend import placement as placement_module
from cacheblend_rag.blend import probe as probe_module
from cacheblend_rag.blend import round as round_module
from cacheblend_rag.blend.fusor import FusionRequest
from cacheblend_rag.blend.segments import kv_sources
from cacheblend_rag.blend.spec import parse_method
from cacheblend_rag.engine import Engine, SamplingParams
from cacheblend_rag.engine.fidelity import store_in_ram
from cacheblend_rag.engine.prompt import ChunkRef
from cacheblend_rag.eval.bench.round import agent_requests, timed_round
from cacheblend_rag.eval.datasets import load_dataset
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.models.runtime import LayerwiseModel
from cacheblend_rag.settings import get_settings
from cacheblend_rag.store.kvstore import KVStore

TOTALS: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)
PHASE = ["outside"]


@contextmanager
def phase(name: str):
    previous = PHASE[0]
    PHASE[0] = name if previous == "outside" else f"{previous}>{name}"
    started = time.perf_counter()
    try:
        yield
    finally:
        TOTALS[PHASE[0]] += time.perf_counter() - started
        COUNTS[PHASE[0]] += 1
        PHASE[0] = previous


def timed(owner, name: str, label: str | None = None, as_phase: bool = False) -> None:
    """Wrap ``owner.name`` with a timer (keyed by the current phase, or a phase of its own)."""
    original = getattr(owner, name)
    label = label or name

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if as_phase:
            with phase(label):
                return original(*args, **kwargs)
        key = f"{PHASE[0]}/{label}"
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TOTALS[key] += time.perf_counter() - started
            COUNTS[key] += 1

    setattr(owner, name, wrapper)


def instrument() -> None:
    fusor_cls, run_cls = fusor_module.Fusor, fusor_module._Run
    timed(fusor_cls, "probe", "round probe", as_phase=True)
    skip = {"_is_chunk", "_last_chunk", "_question", "_occurrences"}
    for name, value in vars(round_module).copy().items():  # the round's own helpers, each a phase
        own = callable(value) and getattr(value, "__module__", "") == round_module.__name__
        if own and name.startswith("_") and name not in skip:
            timed(round_module, name, name, as_phase=True)
    timed(fusor_cls, "fuse_many", "fuse_many", as_phase=True)
    timed(placement_module.CachedPlacement, "place", "place cached")
    probe_pass_timer(run_cls)
    timed(probe_module.ProbePass, "attention_inputs", "probe attention inputs (probabilities, mass)")
    timed(probe_module.ProbePass, "attend", "probe attend (output from probabilities)")
    timed(run_cls, "__init__", "run init")
    timed(run_cls, "attention_inputs", "attention inputs (incl. placing)")
    timed(run_cls, "attend", "attend")
    timed(run_cls, "result", "result")
    timed(LayerwiseModel, "project_qkv", "project qkv")
    timed(LayerwiseModel, "finish_layer", "o-proj + MLP")
    timed(layers_module, "run_layer", "run_layer")
    fusor_module.run_layer = layers_module.run_layer


def probe_pass_timer(run_cls) -> None:
    """The query probe inside a fusion (a round's is its blend's own): from its pass's start to the
    fusion's begin()."""
    started: list[float] = []
    original_init, original_begin = probe_module.ProbePass.__init__, run_cls.begin

    def init(self, *args, **kwargs):
        started.append(time.perf_counter())
        original_init(self, *args, **kwargs)

    def begin(self, probe):
        if probe is not None and started:
            TOTALS[f"{PHASE[0]}/probe pass"] += time.perf_counter() - started.pop(0)
            COUNTS[f"{PHASE[0]}/probe pass"] += 1
        return original_begin(self, probe)

    probe_module.ProbePass.__init__, run_cls.begin = init, begin


@contextmanager
def old_round():
    """The round as it was: every member fused as a request of its own (an observer sends it there) and
    the probe's scores in fresh tensors at every layer."""
    original = probe_module.query_probabilities
    probe_module.query_probabilities = lambda q, keys, mask, scaling, buffers=None: original(
        q, keys, mask, scaling
    )
    try:
        yield
    finally:
        probe_module.query_probabilities = original


def old_requests(engine, work) -> list[FusionRequest]:
    def observer(*_) -> None:
        pass

    return [
        FusionRequest(r.segments, r.method, engine._loader(kv_sources(r.segments)), observer=observer)
        for r in work
    ]


def chunk_refs(model, chunks: int, chunk_tokens: int) -> list[ChunkRef]:
    """``chunks`` MuSiQue chunks of exactly ``chunk_tokens`` tokens, as scripts/profile_fusion.py takes."""
    return [ChunkRef(p) for p in musique_chunks(model, chunks, chunk_tokens)]


@contextmanager
def round_workload(chunks: int, chunk_tokens: int, agents: int):
    """The bench's round workload in a scratch store: (settings, engine, the chunks, ``agents`` MuSiQue
    questions), the chunks' KV computed and held in RAM."""
    settings = get_settings()
    model = load_model(config=settings)
    with tempfile.TemporaryDirectory() as tmp:
        store = KVStore(tmp, model.fingerprint, model.shape)
        engine = Engine(model, store=store)
        try:
            refs = chunk_refs(model, chunks, chunk_tokens)
            questions = [c.question for c in load_dataset("musique").cases[:agents]]
            for ref in refs:
                engine.ensure_chunk_kv(ref.token_ids)
            store_in_ram(engine, questions[0], refs)
            yield settings, engine, refs, questions
        finally:
            engine.close()
            store.close()


def report(title: str, wall: float) -> None:
    print(f"\n== {title}: {wall:.3f} s wall")
    for key in sorted(TOTALS, key=lambda k: (k.split("/")[0], -TOTALS[k])):
        print(f"  {key:55s} {TOTALS[key]:8.3f} s  x{COUNTS[key]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--no-scheduler", action="store_true")
    parser.add_argument("--old", action="store_true", help="first the round as before (same process)")
    args = parser.parse_args()

    with round_workload(args.chunks, args.chunk_tokens, args.agents) as (settings, engine, refs, questions):
        blend = parse_method("cacheblend").with_ratio(settings.ratio)
        sampling = SamplingParams(max_tokens=16)

        def jobs():
            built = agent_requests(engine, refs, questions, blend, sampling, own_order=False)
            return built, [FusionRequest(r.segments, blend.build()) for r in built]

        built, work = jobs()
        print(
            f"{args.agents} agents, prompts of {[sum(len(s) for s in r.segments) for r in built]} tokens, "
            f"{torch.get_num_threads()} threads"
        )
        engine.fuse_group(work, rounds=True)  # warm-up (and the agents' heads computed)
        instrument()
        if args.old:
            TOTALS.clear()
            COUNTS.clear()
            started = time.perf_counter()
            with old_round():
                routes = [engine.fusor.route(r) for r in old_requests(engine, work)]
                old = round_module.fuse_round(engine.fusor, routes, engine._loader)
            report(f"as before: members fused on their own, probe buffers fresh, {args.agents} agents", 0)
            print(f"  wall {time.perf_counter() - started:.3f} s")
        TOTALS.clear()
        COUNTS.clear()
        started = time.perf_counter()
        results = engine.fuse_group(work, rounds=True)
        wall = time.perf_counter() - started
        report(f"Engine.fuse_group (rounds), {args.agents} agents", wall)
        rounds = {r.round.requests if r.round else 0 for r in results}
        print(f"  round sizes {rounds}; computed tokens per agent {[r.computed_tokens for r in results]}")
        if args.old:
            gap = max(float((a.logits - b.logits).abs().max()) for a, b in zip(old, results, strict=True))
            print(f"  max |logit| difference from the members fused on their own: {gap:.2e}")
        if not args.no_scheduler:
            TOTALS.clear()
            COUNTS.clear()
            built, _ = jobs()
            timing = timed_round(engine, built, rounds=True)
            report(f"scheduler, all first tokens {timing['all_first_tokens_s']:.3f} s", 0.0)
            print(f"  {timing}")


if __name__ == "__main__":
    main()
