"""The engine's fusion as users run it on an accelerator (``fusion="static"``, forced here on the CPU): int8
chunk KV from the RAM tier, joined and decoded on the device per layer, then the static steps. One fusion's
device operations stay a small multiple of a full prefill's and do not grow with the chunk count."""

from __future__ import annotations

import pytest
import torch
from op_counting import LayerOps, text_ids

from cacheblend_rag.blend import get_method
from cacheblend_rag.config import Config
from cacheblend_rag.engine import ChunkRef, Engine
from cacheblend_rag.models.fused import fused_weights
from cacheblend_rag.store.fileformat import EncodedChunk
from cacheblend_rag.store.kvstore import KVStore


@pytest.fixture(scope="module")
def ids(model) -> list[int]:
    return text_ids(model)


def _engine(model, root, fusion: str) -> Engine:
    store = KVStore(root, model.fingerprint, model.shape, "int8")
    return Engine(model, store=store, config=Config(fusion=fusion))


def _segments(engine: Engine, ids: list[int], chunks: int, tokens: int):
    refs = [ChunkRef(tuple(ids[i * tokens : (i + 1) * tokens]), f"c{i}") for i in range(chunks)]
    return engine.rag_segments("Who founded the company?", refs, "cacheblend")


def _count(engine: Engine, segments) -> tuple[LayerOps, object]:
    ops = LayerOps()
    engine.fusor.layer_hook = ops.mark
    with ops:
        fused = engine.fuse(segments, get_method("cacheblend"))
    return ops, fused


def test_a_fusion_from_int8_ram_stays_small_and_flat_in_the_chunk_count(model, ids, tmp_path):
    fused_weights(model)  # (packed once per model, on first use)
    engine = _engine(model, tmp_path / "kv", "static")
    totals = {}
    for chunks, tokens in ((2, 768), (12, 128)):
        segments = _segments(engine, ids, chunks, tokens)
        engine.fuse(segments, get_method("cacheblend"))  # computes and stores the chunks' KV
        segments = _segments(engine, ids, chunks, tokens)
        assert all(isinstance(s.kv, EncodedChunk) for s in segments if s.kv is not None and not s.exact)
        ops, _ = _count(engine, segments)
        assert ops.syncs == []
        full = LayerOps()
        with full, torch.inference_mode():
            model.prefill([t for s in segments for t in s.token_ids])
        totals[chunks] = ops.total()
        assert ops.total() <= 3 * full.total(), (ops.total(), full.total())
    assert abs(totals[2] - totals[12]) <= 0.1 * totals[2], totals
    engine.close()


def test_the_static_engine_fusion_equals_the_layer_passes_on_int8_chunks(model, ids, tmp_path):
    static, layers = _engine(model, tmp_path / "a", "static"), _engine(model, tmp_path / "b", "layers")
    results = []
    for engine in (static, layers):
        engine.fuse(_segments(engine, ids, 6, 128), get_method("cacheblend"))
        results.append(engine.fuse(_segments(engine, ids, 6, 128), get_method("cacheblend")))
    assert torch.equal(results[0].selected, results[1].selected)
    assert (results[0].logits - results[1].logits).abs().max().item() < 2e-4
    static.close()
    layers.close()


def test_an_engine_set_to_replay_graphs_fuses_each_request_as_the_static_path(model, ids, tmp_path):
    config = Config(fusion="static", fusion_compile="graphs")
    graphs = Engine(
        model, store=KVStore(tmp_path / "g", model.fingerprint, model.shape, "int8"), config=config
    )
    static = _engine(model, tmp_path / "s", "static")
    assert graphs.fusor.graphs is not None and static.fusor.graphs is None
    # the same buckets, other chunks: the replay must place this request's KV and read its tokens
    requests = [(0, "Who founded the company?"), (6, "Who founded the company?")]
    for offset, question in requests:
        outs = []
        for engine in (graphs, static):
            refs = [
                ChunkRef(tuple(ids[(offset + i) * 128 : (offset + i + 1) * 128]), f"c{offset + i}")
                for i in range(6)
            ]
            outs.append(
                engine.fuse(engine.rag_segments(question, refs, "cacheblend"), get_method("cacheblend"))
            )
        assert torch.equal(outs[0].logits, outs[1].logits)
        assert torch.equal(outs[0].selected, outs[1].selected)
    assert len(graphs.fusor.graphs) == 1
    graphs.close()
    static.close()
