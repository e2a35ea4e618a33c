"""The static fusion (blend/static.py), the path an accelerator takes, run on the CPU: the same results as
the layer passes, a fixed number of device operations per layer whatever the chunk count, nothing read
back to the host between the first layer and the logits, and steps a graph compiler traces without a break
and replays for every layer and every prompt of a size bucket without recompiling."""

from __future__ import annotations

import pytest
import torch
from op_counting import LayerOps
from static_prompts import STATIC_SPECS, prompt_maker

from cacheblend_rag.blend import Fusor, Segment, get_method, parse_method, static_steps
from cacheblend_rag.blend.plan import FusionPlan
from cacheblend_rag.blend.segments import DirectLayerKV, kv_sources
from cacheblend_rag.blend.static import EAGER_STEPS, Steps, static_fusion
from cacheblend_rag.blend.static_layout import StaticLayout
from cacheblend_rag.models.fused import fused_weights, prefill_layer, signed_sin


@pytest.fixture(scope="module")
def make_prompt(model):
    return prompt_maker(model)


def counted(model, segments, method, **fusor_options) -> tuple[LayerOps, object]:
    fused_weights(model)  # (packed once per model, on first use)
    ops = LayerOps()
    fusor = Fusor(model, static=True, layer_hook=ops.mark, **fusor_options)
    with ops:
        fused = fusor.fuse(segments, method)
    return ops, fused


@pytest.mark.parametrize("spec", STATIC_SPECS)
def test_the_static_fusion_equals_the_layer_passes(model, make_prompt, spec):
    method = parse_method(spec).build()
    segments = make_prompt(4, 160)
    eager = Fusor(model, static=False).fuse(segments, method)
    static = Fusor(model, static=True).fuse(segments, method)
    assert torch.equal(eager.selected, static.selected)
    assert (eager.logits - static.logits).abs().max().item() < 2e-4
    n = eager.num_tokens
    for layer in range(model.num_layers):
        for a, b in ((eager.cache.keys, static.cache.keys), (eager.cache.values, static.cache.values)):
            assert (a[layer][0, :, :n] - b[layer][0, :, :n]).abs().max().item() < 5e-4
    assert static.qkv_tokens_per_layer == eager.qkv_tokens_per_layer
    assert static.attended_tokens_per_layer == eager.attended_tokens_per_layer
    assert static.reused_tokens == eager.reused_tokens


def test_full_recompute_takes_the_static_path_and_equals_full_prefill(model, make_prompt):
    segments = [Segment.fresh(s.token_ids) for s in make_prompt(2, 128)]
    ops, fused = counted(model, segments, get_method("full_recompute"))
    reference, _ = model.prefill([t for s in segments for t in s.token_ids])
    assert len(ops.per_layer()) == model.num_layers  # the static path ran (its layers were marked)
    assert (fused.logits - reference[0]).abs().max().item() < 2e-4


@pytest.mark.parametrize("chunks", [2, 6, 12])
def test_the_default_runs_a_fixed_number_of_operations_per_layer(model, make_prompt, chunks):
    ops, _ = counted(model, make_prompt(chunks, 128), get_method("cacheblend"))
    layers = ops.per_layer()
    probe, blend = layers[: model.num_layers], layers[model.num_layers :]
    # (the probe's last layer also selects and builds the blend's tables; the blend's last also finishes)
    assert max(probe[:-1]) <= 40, probe
    assert max(blend[:-1]) <= 50, blend
    assert len(set(probe[1:-1])) == 1 and len(set(blend[1:-1])) == 1
    assert ops.syncs == []
    assert ops.total() <= 40 * len(probe) + 50 * len(blend) + 150


def test_the_operation_counts_do_not_depend_on_the_chunk_count(model, make_prompt):
    counts = []
    for chunks in (2, 12):
        ops, _ = counted(model, make_prompt(chunks, 128), get_method("cacheblend"))
        counts.append((ops.per_layer(), ops.total()))
    assert counts[0][0] == counts[1][0]
    assert counts[0][1] == counts[1][1]


def test_hkvd_check_layer_and_full_reuse_stay_small(model, make_prompt):
    for chunks in (2, 12):
        ops, _ = counted(model, make_prompt(chunks, 128), get_method("cacheblend_hkvd"))
        layers = ops.per_layer()
        assert layers[1] <= 60, layers  # the check layer (schedule: layer 1)
        assert max(layers[2:-1]) <= 50, layers
        assert ops.syncs == []
        ops, _ = counted(model, make_prompt(chunks, 128), get_method("full_reuse"))
        assert max(ops.per_layer()[:-1]) <= 42
        assert ops.syncs == []


def test_nothing_is_read_back_between_the_first_layer_and_the_logits(model, make_prompt, monkeypatch):
    """Beyond the operations a dispatch mode sees, the host's own reads of a tensor (on an accelerator
    each waits for the device) are refused while the layers run."""
    ops = LayerOps()
    for name in ("cpu", "tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _original=original, _name=name, **kwargs):
            if ops.inside:
                ops.syncs.append(f"Tensor.{_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    for spec in ("cacheblend", "cacheblend_hkvd", "epic"):
        method = get_method(spec)
        with ops:
            Fusor(model, static=True, layer_hook=ops.mark).fuse(make_prompt(6, 128), method)
    assert ops.syncs == []


def test_a_full_prefill_layer_is_small(model, make_prompt):
    ids = torch.tensor([t for s in make_prompt(2, 128) for t in s.token_ids])
    fw = fused_weights(model)
    positions = torch.arange(ids.numel())
    cos, sin = model.rope.cos_sin(positions, model.dtype)
    cache = model.new_cache(ids.numel())
    hidden = model.embed(ids).to(model.dtype)
    ops = LayerOps()
    with torch.inference_mode(), ops:
        prefill_layer(fw.layers[0], hidden, cos, signed_sin(sin), cache.keys[0][0], cache.values[0][0], fw)
    assert ops.total() <= 42


def _recording(calls: dict) -> Steps:
    def wrap(name, step):
        def recorded(*args, **kwargs):
            calls.setdefault(name, (args, kwargs))
            return step(*args, **kwargs)

        return recorded

    return Steps(*(wrap(name, step) for name, step in zip(Steps._fields, EAGER_STEPS, strict=True)))


def test_the_steps_trace_without_a_graph_break(model, make_prompt):
    calls: dict = {}
    steps = _recording(calls)
    for method in (get_method("cacheblend"), get_method("cacheblend_hkvd")):
        fusor = Fusor(model, static=True)
        fusor.steps = steps
        fusor.fuse(make_prompt(6, 128), method)
    assert set(calls) == set(Steps._fields)
    for name, (args, kwargs) in calls.items():
        with torch.inference_mode():
            explained = torch._dynamo.explain(getattr(static_steps, name))(*args, **kwargs)
        assert explained.graph_break_count == 0, (name, explained.break_reasons)
        assert explained.graph_count == 1, name


def test_compiled_steps_do_not_recompile_for_other_layers_or_prompts_in_the_bucket(model, make_prompt):
    first = make_prompt(6, 128)
    others = ("Who founded the company, and when?", "Who founded it?", "Who was the founder of the company?")
    second = next(
        make_prompt(6, 128, q)
        for q in others
        if _buckets(model, make_prompt(6, 128, q)) == _buckets(model, first)
    )
    for method in (get_method("cacheblend"), get_method("cacheblend_hkvd")):
        fusor = Fusor(model, static=True, compile_mode="eager")
        warm = fusor.fuse(first, method)
        with torch.compiler.set_stance("fail_on_recompile"):
            again = fusor.fuse(second, method)
        eager = Fusor(model, static=False).fuse(second, method)
        assert torch.equal(again.selected, eager.selected)
        assert (again.logits - eager.logits).abs().max().item() < 2e-4
        assert warm.num_tokens != again.num_tokens


def _buckets(model, segments) -> tuple:
    layout = StaticLayout.build(FusionPlan.from_segments(segments), model.rope, model.dtype, model.device)
    return layout.keys, layout.fresh_bucket, layout.cached_index.numel(), layout.chunks


def test_the_fast_probe_scores_the_query_rows_as_the_exact_one_does(model, make_prompt):
    """A low-precision model's probe (only the query rows scored, their output by the attention kernel),
    run here in float32: the same scores within float error, so the same selection."""
    segments = make_prompt(6, 128)
    plan = FusionPlan.from_segments(segments)
    method = get_method("cacheblend")
    results = []
    for fast in (False, True):
        fusion = static_fusion(model, plan, method, DirectLayerKV(kv_sources(segments)))
        fusion.fast = fast
        logits, selected, _ = fusion.run()
        results.append((logits, selected, fusion.scores[0][: plan.num_tokens]))
    (exact_logits, exact_rows, exact_scores), (fast_logits, fast_rows, fast_scores) = results
    assert fusion.layout.scored < fusion.layout.fresh_bucket  # fewer rows scored than computed
    assert torch.allclose(fast_scores, exact_scores, rtol=1e-4, atol=1e-6)
    assert torch.equal(fast_rows, exact_rows)
    assert (fast_logits - exact_logits).abs().max().item() < 2e-4
