"""Static fusions replayed per size bucket (blend/static_graph.py), on the CPU: a replay runs the captured
fusion's compute again over its own tensors, so a value not copied in from the new prompt would give the
old prompt's answer. Every later prompt of a bucket must fuse exactly as its own static fusion does."""

from __future__ import annotations

import pytest
import torch
from static_prompts import STATIC_SPECS, prompt_maker

from cacheblend_rag.blend import Fusor, get_method, parse_method
from cacheblend_rag.blend.plan import FusionPlan
from cacheblend_rag.blend.segments import DirectLayerKV, kv_sources
from cacheblend_rag.blend.static import static_fusion
from cacheblend_rag.blend.static_graph import FusionGraphs


@pytest.fixture(scope="module")
def make_prompt(model):
    return prompt_maker(model)


def _key(model, segments, method) -> tuple:
    plan = FusionPlan.from_segments(segments)
    fusion = static_fusion(model, plan, method, DirectLayerKV(kv_sources(segments)))
    return fusion.bucket_key()


def _graph_fusor(model) -> Fusor:
    fusor = Fusor(model, static=True)
    fusor.graphs = FusionGraphs(model, capture=False)
    return fusor


@pytest.mark.parametrize("spec", STATIC_SPECS)
def test_a_replay_fuses_each_prompt_as_its_own_static_fusion(model, make_prompt, spec):
    method = parse_method(spec).build()
    first = make_prompt(6, 128)
    # other prompts of the same buckets: another question, other chunk lengths (another prompt length)
    candidates = [make_prompt(6, 128, "Who founded it, and where?"), make_prompt(6, 126), make_prompt(6, 127)]
    same = [s for s in candidates if _key(model, s, method) == _key(model, first, method)]
    assert len(same) >= 2, "the test needs two other prompts of the first one's buckets"
    fusor = _graph_fusor(model)
    for segments in (first, *same):
        replayed = fusor.fuse(segments, method, extra_capacity=4)
        alone = Fusor(model, static=True).fuse(segments, method, extra_capacity=4)
        assert torch.equal(replayed.logits, alone.logits)
        assert torch.equal(replayed.selected, alone.selected)
        n = alone.num_tokens
        assert replayed.cache.capacity == n + 4 and replayed.cache.length == n
        for a, b in ((replayed.cache.keys, alone.cache.keys), (replayed.cache.values, alone.cache.values)):
            assert all(torch.equal(x[..., :n, :], y[..., :n, :]) for x, y in zip(a, b, strict=True))
            assert all(not x[..., n:, :].any() for x in a)  # the room for decoding starts zeroed
        assert replayed.qkv_tokens_per_layer == alone.qkv_tokens_per_layer
        assert replayed.attended_tokens_per_layer == alone.attended_tokens_per_layer
    assert len(fusor.graphs) == 1


def test_each_bucket_gets_its_own_capture_and_the_oldest_goes(model, make_prompt):
    method = get_method("cacheblend")
    fusor = _graph_fusor(model)
    fusor.graphs.max_graphs = 2
    shapes = [(2, 128), (6, 128), (3, 256)]
    for num, size in shapes:
        fusor.fuse(make_prompt(num, size), method)
    assert len(fusor.graphs) == 2
    assert fusor.graphs.memory_bytes() > 0
    again = fusor.fuse(make_prompt(2, 128), method)  # captured anew: still its own fusion
    alone = Fusor(model, static=True).fuse(make_prompt(2, 128), method)
    assert torch.equal(again.logits, alone.logits)


def test_the_fusor_takes_the_graphs_by_compile_mode(model):
    assert Fusor(model, static=True, compile_mode="graphs").graphs is not None
    assert Fusor(model, static=True).graphs is None
