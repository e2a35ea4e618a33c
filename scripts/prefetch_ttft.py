"""TTFT with the load pipeline's prefetch thread on and off, chunk KV in the RAM tier or on disk (the
choice ``store.pipeline.worth_prefetching`` makes for the engine).

    .venv/bin/python scripts/prefetch_ttft.py [--chunks 6] [--chunk-tokens 512] [--repeats 3]
        [--methods full_reuse,cacheblend,full_recompute] [--tier ram|disk]

The ``scripts/profile_fusion.py`` prompt's chunks are stored in a scratch KV store of the settings' codec
(int8 by default) and kept in its RAM tier; each method is answered (one token) through ``Engine`` with
its loader prefetching and not, interleaved, after a warm-up round; the median TTFT of ``--repeats`` is
printed. With ``--tier disk`` the RAM tier is evicted and the chunk files dropped from the page cache
before every run, as ``bench``'s cold disk column does, and TTFT counts building the prompt (where the
files are opened). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from profile_fusion import musique_chunks

from cacheblend_rag.blend.spec import parse_method
from cacheblend_rag.engine import ChunkRef, Engine, SamplingParams
from cacheblend_rag.engine.fidelity import store_in_ram
from cacheblend_rag.eval.bench.ttft import only_on_disk
from cacheblend_rag.eval.engines import settings_store
from cacheblend_rag.models.loader import load_model
from cacheblend_rag.settings import get_settings
from cacheblend_rag.store.pipeline import PipelinedLayerLoader

QUESTION = "Which river flows through the city where the author of the book was born?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="full_reuse,cacheblend,full_recompute")
    parser.add_argument("--tier", choices=("ram", "disk"), default="ram")
    args = parser.parse_args()

    settings = get_settings()
    model = load_model(config=settings)
    with tempfile.TemporaryDirectory() as scratch:
        store = settings_store(Path(scratch), model.fingerprint, model.shape)
        engine = Engine(model, store, config=settings)
        refs = [ChunkRef(ids) for ids in musique_chunks(model, args.chunks, args.chunk_tokens)]
        store_in_ram(engine, QUESTION, refs)
        methods = args.methods.split(",")
        samples: dict[tuple[str, bool], list[float]] = {}
        for repeat in range(args.repeats + 1):  # round 0 warms up
            for prefetch in (True, False):

                def loader(sources, prefetch=prefetch):
                    return PipelinedLayerLoader(list(sources), model.dtype, model.device, prefetch=prefetch)

                engine._loader = loader  # pylint: disable=protected-access  # the choice under test
                for name in methods:
                    spec = parse_method(name).with_ratio(settings.ratio, where_taken=True)
                    if args.tier == "disk":
                        only_on_disk(engine, refs)
                    started = time.perf_counter()
                    segments = engine.rag_segments(QUESTION, refs, spec)
                    segments_s = time.perf_counter() - started
                    result = engine.generate(segments, spec.build(), SamplingParams(max_new_tokens=1))
                    if repeat:
                        samples.setdefault((name, prefetch), []).append(segments_s + result.ttft_s)
        engine.close()
    where = "in the RAM tier" if args.tier == "ram" else "on disk, page cache dropped"
    print(f"{args.chunks} x {args.chunk_tokens} tokens, chunk KV {store.kv_dtype_name} {where}")
    print(f"{'method':16s} {'prefetch on (s)':>16s} {'prefetch off (s)':>17s}")
    for name in methods:
        on, off = (statistics.median(samples[(name, flag)]) for flag in (True, False))
        print(f"{name:16s} {on:16.3f} {off:17.3f}")


if __name__ == "__main__":
    main()
