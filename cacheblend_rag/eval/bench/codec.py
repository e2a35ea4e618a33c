"""Section ``codec``: the chunk KV codecs side by side. Per codec: file bytes per token
(metadata included) on the sample corpus and on 512-token chunks; cacheblend TTFT at N x T from the RAM
tier and from a cold disk (interleaved over codecs, median of the repeats); ingest tokens/s (precompute and
store); and the read of one chunk from the remote tier (bytes and seconds) through the Redis server of
``--kv-remote`` / ``CACHEBLEND_KV_REMOTE`` (skipped, saying so, when none is configured)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...blend.segments import prefill_chunk_kv
from ...engine import ChunkRef, Engine
from ...engine.fidelity import store_in_ram
from ...records import OpenRecord
from ...settings import get_settings
from ...store.keys import chunk_key
from ...store.kvstore import KVStore
from ...store.remote import RedisKVTier
from ..engines import settings_store
from ..markdown import fmt, table
from .config import BenchContext
from .page import Page
from .ttft import engine_ttft

CODECS = ("float16", "int8", "int4")
SAMPLE_CORPUS = Path(__file__).parents[3] / "examples" / "data" / "corpus"


@dataclass(frozen=True)
class CodecBytes(OpenRecord):
    """Stored file bytes (metadata included) of some chunks in one codec."""

    file_bytes: int
    bytes_per_token: float
    vs_float16: float


@dataclass(frozen=True)
class CodecIngest(OpenRecord):
    """Precompute and store of the sample corpus in one codec."""

    seconds: float
    tokens_per_s: float
    vs_float16: float


@dataclass(frozen=True)
class CodecTtft(OpenRecord):
    """cacheblend TTFT per codec and tier (``ram``, ``disk``): median, samples, and vs float16."""

    median_s: dict[str, dict[str, float]]
    samples_s: dict[str, dict[str, list[float]]]
    vs_float16: dict[str, dict[str, float]]


@dataclass(frozen=True)
class CodecResult(OpenRecord):
    """The codecs side by side: bytes per token per set of chunks (the sample corpus, N-token chunks),
    ingest, TTFT, and the remote read (:func:`remote_read`: ``skipped`` saying why, or per codec)."""

    codecs: list[str]
    params: dict[str, Any]
    chunk_tokens: int
    num_chunks: int
    ratio: float
    repeats: int
    bytes_per_token: dict[str, dict[str, CodecBytes]]
    sample_corpus: dict[str, int]
    ingest: dict[str, CodecIngest]
    ttft: CodecTtft
    remote: dict[str, Any]


def section_codec(ctx: BenchContext) -> CodecResult:
    config = ctx.config
    model = ctx.model
    sample = sample_corpus_chunks(ctx, config.chunk_tokens)
    if config.quick:  # a smoke test: a few chunks of the sample corpus
        sample = sample[: config.num_chunks]
    long_chunks = ctx.chunk_ids(config.num_chunks, config.chunk_tokens)
    stores = {
        c: settings_store(ctx.work_dir / f"codec-{c}", model.fingerprint, model.shape, c) for c in CODECS
    }
    try:
        return CodecResult(
            codecs=list(CODECS),
            params={c: stores[c].codec.params for c in CODECS},
            chunk_tokens=config.chunk_tokens,
            num_chunks=config.num_chunks,
            ratio=config.ratio,
            repeats=config.repeats,
            bytes_per_token={
                "sample_corpus": _bytes_per_token(ctx, sample, "sample"),
                f"{config.chunk_tokens}_token_chunks": _bytes_per_token(ctx, long_chunks, "long"),
            },
            sample_corpus={"chunks": len(sample), "tokens": sum(map(len, sample))},
            ingest=_ingest_rate(ctx, sample),
            ttft=_ttft(ctx, stores, long_chunks),
            remote=remote_read(ctx, long_chunks[0]),
        )
    finally:
        for store in stores.values():
            store.close()


def sample_corpus_chunks(ctx: BenchContext, tokens: int) -> list[tuple[int, ...]]:
    """The sample corpus's files, tokenized and cut into chunks of at most ``tokens`` tokens."""
    out = []
    for path in sorted(SAMPLE_CORPUS.iterdir()):
        ids = ctx.model.tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        out += [tuple(ids[i : i + tokens]) for i in range(0, len(ids), tokens)]
    return out


def _bytes_per_token(ctx: BenchContext, chunks: list[tuple[int, ...]], tag: str) -> dict[str, CodecBytes]:
    """File bytes (metadata included) per token of ``chunks`` stored in each codec."""
    model = ctx.model
    stores = {
        c: settings_store(
            ctx.work_dir / f"codec-bytes-{tag}-{c}", model.fingerprint, model.shape, c, ram_budget_bytes=0
        )
        for c in CODECS
    }
    sizes = dict.fromkeys(CODECS, 0)
    try:
        for ids in chunks:
            kv = prefill_chunk_kv(model, ids)
            for codec, store in stores.items():
                key = store.chunk_key(ids)
                store.put_local(key, kv, ram=False)
                sizes[codec] += store.path_for(key).stat().st_size
    finally:
        for store in stores.values():
            store.close()
    tokens = sum(map(len, chunks))
    return {c: CodecBytes(sizes[c], sizes[c] / tokens, sizes[c] / sizes["float16"]) for c in CODECS}


def _ingest_rate(ctx: BenchContext, chunks: list[tuple[int, ...]]) -> dict[str, CodecIngest]:
    """Tokens/s of precompute + store per codec (chunks interleaved over codecs, fresh stores)."""
    model = ctx.model
    seconds = dict.fromkeys(CODECS, 0.0)
    engines = {
        c: Engine(
            model,
            settings_store(ctx.work_dir / f"codec-ingest-{c}", model.fingerprint, model.shape, c),
            config=get_settings(),
        )
        for c in CODECS
    }
    try:
        for engine in engines.values():
            engine.store.clear()
        for ids in chunks:
            for codec, engine in engines.items():
                started = time.perf_counter()
                engine.ensure_chunk_kv(ids)
                seconds[codec] += time.perf_counter() - started
    finally:
        for engine in engines.values():
            engine.close()
    tokens = sum(map(len, chunks))
    rates = {c: tokens / seconds[c] for c in CODECS}
    return {c: CodecIngest(seconds[c], rates[c], rates[c] / rates["float16"]) for c in CODECS}


def _ttft(ctx: BenchContext, stores: dict[str, KVStore], chunks: list[tuple[int, ...]]) -> CodecTtft:
    """cacheblend TTFT from the RAM tier and a cold disk per codec, interleaved, median of the repeats."""
    config = ctx.config
    refs = [ChunkRef(ids) for ids in chunks]
    engines = {c: Engine(ctx.model, store, config=get_settings()) for c, store in stores.items()}
    samples: dict[str, dict[str, list[float]]] = {c: {"ram": [], "disk": []} for c in CODECS}
    for engine in engines.values():
        store_in_ram(engine, ctx.question, refs)
        engine_ttft(engine, ctx.question, refs, "cacheblend_ram", config.ratio)  # warm-up
    for _ in range(config.repeats):
        for codec, engine in engines.items():
            for tier in ("ram", "disk"):
                measured = engine_ttft(engine, ctx.question, refs, f"cacheblend_{tier}", config.ratio)
                samples[codec][tier].append(measured["ttft_s"])
    medians = {c: {t: statistics.median(v) for t, v in tiers.items()} for c, tiers in samples.items()}
    return CodecTtft(
        median_s=medians,
        samples_s=samples,
        vs_float16={c: {t: medians[c][t] / medians["float16"][t] for t in ("ram", "disk")} for c in CODECS},
    )


def remote_read(ctx: BenchContext, ids: tuple[int, ...]) -> dict[str, Any]:
    """Bytes and seconds to read one chunk, every layer, from the remote tier (no local layer cache),
    codecs interleaved, median of the repeats. Its values go under a prefix of their own, removed after."""
    url = get_settings().kv_remote
    if not url:
        return {"skipped": "no remote tier configured (--kv-remote / CACHEBLEND_KV_REMOTE=redis://...)"}
    model = ctx.model
    kv = prefill_chunk_kv(model, ids)
    keys = {c: chunk_key(model.fingerprint, c, ids) for c in CODECS}
    prefix = "cacheblend:bench-codec"
    writers = {c: RedisKVTier(url, model.fingerprint, model.shape, c, prefix=prefix) for c in CODECS}
    samples: dict[str, list[float]] = {c: [] for c in CODECS}
    read_bytes = dict.fromkeys(CODECS, 0)
    try:
        for codec, writer in writers.items():
            writer.delete(keys[codec])
            writer.put(keys[codec], kv, pinned=False)
        for _ in range(ctx.config.repeats):
            for codec in CODECS:
                reader = RedisKVTier(
                    url, model.fingerprint, model.shape, codec, prefix=prefix, local_cache_bytes=0
                )
                started = time.perf_counter()
                source = reader.get(keys[codec])
                if source is None:
                    raise RuntimeError(f"the remote tier {url} did not serve the {codec} chunk just written")
                for layer in range(source.num_layers):
                    source.layer(layer)
                samples[codec].append(time.perf_counter() - started)
                read_bytes[codec] = reader.counters.bytes_read
                reader.close()
    finally:
        for codec, writer in writers.items():
            writer.delete(keys[codec])
            writer.close()
    medians = {c: statistics.median(v) for c, v in samples.items()}
    return {
        "url": url,
        "chunk_tokens": len(ids),
        "codecs": {
            c: {
                "bytes": read_bytes[c],
                "seconds": medians[c],
                "bytes_vs_float16": read_bytes[c] / read_bytes["float16"],
                "seconds_vs_float16": medians[c] / medians["float16"],
            }
            for c in CODECS
        },
    }


def render_codec(page: Page, section: CodecResult) -> list[str]:
    """The section in markdown (registered in report.py)."""
    codecs = section.codecs
    bpt = section.bytes_per_token
    sample = section.sample_corpus
    ttft, ingest, remote = section.ttft, section.ingest, section.remote
    parts = [
        f"Codecs {', '.join(codecs)} (int8/int4 parameters: "
        + "; ".join(f"{c} {section.params[c]}" for c in codecs if section.params[c])
        + f"). Sample corpus: {sample['chunks']} chunks, {sample['tokens']} tokens (files cut into "
        f"≤{section.chunk_tokens}-token chunks).",
        "",
        table(
            [
                "codec",
                *(f"{where.replace('_', ' ')}: B/token" for where in bpt),
                *(f"{w.replace('_', ' ')}: vs fp16" for w in bpt),
            ],
            [
                [
                    c,
                    *(fmt(bpt[w][c].bytes_per_token, 1) for w in bpt),
                    *(fmt(bpt[w][c].vs_float16, 3) for w in bpt),
                ]
                for c in codecs
            ],
        ),
        "",
        f"cacheblend TTFT at {section.num_chunks} × {section.chunk_tokens} "
        f"(r = {section.ratio:g}), median of {section.repeats} interleaved runs; ingest = precompute "
        "and store of the sample corpus:",
        "",
        table(
            [
                "codec",
                "TTFT RAM (s)",
                "vs fp16",
                "TTFT cold disk (s)",
                "vs fp16",
                "ingest tokens/s",
                "vs fp16",
            ],
            [
                [
                    c,
                    fmt(ttft.median_s[c]["ram"], 4),
                    fmt(ttft.vs_float16[c]["ram"], 3),
                    fmt(ttft.median_s[c]["disk"], 4),
                    fmt(ttft.vs_float16[c]["disk"], 3),
                    fmt(ingest[c].tokens_per_s, 0),
                    fmt(ingest[c].vs_float16, 3),
                ]
                for c in codecs
            ],
        ),
        "",
    ]
    if "skipped" in remote:
        parts.append(f"Remote tier: not measured ({remote['skipped']}).")
    else:
        parts += [
            f"Remote tier ({remote['url']}): one {remote['chunk_tokens']}-token chunk, every layer read:",
            "",
            table(
                ["codec", "bytes", "vs fp16", "seconds", "vs fp16"],
                [
                    [
                        c,
                        r["bytes"],
                        fmt(r["bytes_vs_float16"], 3),
                        fmt(r["seconds"], 4),
                        fmt(r["seconds_vs_float16"], 3),
                    ]
                    for c, r in remote["codecs"].items()
                ],
            ),
        ]
    return parts
