"""The loading controller: r = max(r_match, r_floor), tier ranking, profiles measured on the real model."""

from __future__ import annotations

import json
import random

import pytest
import torch

from cacheblend_rag.blend.controller import (
    LoadingController,
    Profile,
    measure_prefill_per_layer,
    profile_path,
)
from cacheblend_rag.blend.segments import ChunkKV, Segment
from cacheblend_rag.blend.spec import choose_ratio
from cacheblend_rag.config import DEFAULT_KV_DTYPE
from cacheblend_rag.store.codec import get_codec
from cacheblend_rag.store.keys import kv_bytes_per_token_per_layer
from cacheblend_rag.store.profile import profile_device

BYTES_PER_TOKEN_LAYER = 768  # SmolLM2-135M in fp16: 2 x 3 heads x 64 x 2 bytes


def make_profile(ram: float = 10e9, disk: float = 1e9) -> Profile:
    return Profile(
        model_fingerprint="f" * 64,
        model="test",
        device="cpu",
        compute_dtype="float32",
        kv_dtype="float16",
        num_layers=30,
        kv_bytes_per_token_per_layer=BYTES_PER_TOKEN_LAYER,
        prefill=[(1024, 0.02), (512, 0.01), (2048, 0.05)],
        tier_bytes_per_s={"ram": ram, "disk": disk},
    )


def test_prefill_interpolation():
    profile = make_profile()
    assert profile.layer_prefill_seconds(512) == pytest.approx(0.01)
    assert profile.layer_prefill_seconds(768) == pytest.approx(0.015)
    assert profile.layer_prefill_seconds(256) == pytest.approx(0.005)
    assert profile.layer_prefill_seconds(3072) == pytest.approx(0.05 + 0.03)  # last slope, extended


def test_fast_tier_keeps_the_floor_ratio():
    decision = LoadingController(make_profile(), r_floor=0.15).choose(3072, 3136, "ram")
    assert decision.ratio == 0.15 and decision.r_match < 0.15
    assert decision.load_hidden and "floor" in decision.reason and decision.profiled


def test_slow_tier_raises_the_ratio_until_recompute_matches_load():
    controller = LoadingController(make_profile(disk=0.05e9), r_floor=0.15)
    decision = controller.choose(3072, 3136, "disk")
    assert 0.15 < decision.ratio < 1.0 and decision.ratio == decision.r_match
    assert decision.recompute_s_per_layer == pytest.approx(decision.load_s_per_layer)
    assert decision.load_hidden and not decision.prefer_full_prefill


def test_tier_slower_than_full_prefill_recomputes_everything():
    decision = LoadingController(make_profile(disk=1e6)).choose(3072, 3136, "disk")
    assert decision.ratio == 1.0 and decision.prefer_full_prefill and not decision.load_hidden


def test_ratio_is_never_below_the_floor_nor_above_one():
    rng = random.Random(0)
    for _ in range(200):
        floor = rng.uniform(0, 1)
        controller = LoadingController(make_profile(disk=10 ** rng.uniform(5, 11)), r_floor=floor)
        total = rng.randint(1, 8000)
        decision = controller.choose(rng.randint(0, total), total, rng.choice(["ram", "disk"]))
        assert floor <= decision.ratio <= 1.0


def test_without_a_profile_the_floor_is_used():
    decision = LoadingController(None, r_floor=0.2).choose(100, 120, "disk")
    assert decision.ratio == 0.2 and not decision.profiled and "cacheblend-rag profile" in decision.reason


class _Source:
    """Chunk KV as a store serves it: from the tier named (nothing is read here)."""

    fingerprint, num_tokens, num_layers = "f" * 64, 96, 30

    def __init__(self, tier: str) -> None:
        self.tier = tier


def test_a_request_gets_one_ratio_whichever_store_tier_its_chunks_are_read_from():
    # the RAM tier holds what ran lately: matched to the tier a read hits, the first request after a
    # start (read from disk) would get another ratio than the same request later (read from RAM)
    controller = LoadingController(make_profile(disk=0.002e9), r_floor=0.15)
    question = Segment.fresh(range(16))

    def prompt(*chunks) -> list[Segment]:
        return [*(Segment.cached(range(96), kv) for kv in chunks), question]

    on_disk = choose_ratio(controller, prompt(_Source("disk"), _Source("disk")))
    assert on_disk.tier == "disk" and on_disk.ratio > 0.15
    for tiers in [("ram", "ram"), ("ram", "disk"), ("remote", "ram")]:
        assert choose_ratio(controller, prompt(*map(_Source, tiers))) == on_disk
    computed = [Segment.cached(range(96), _in_memory(), computed=True) for _ in range(2)]
    assert choose_ratio(controller, [*computed, question]) == on_disk  # stored once computed
    held = choose_ratio(controller, prompt(_in_memory(), _in_memory()))  # a caller's own, in memory
    assert held.tier == "ram" and held.ratio == 0.15


def _in_memory() -> ChunkKV:
    return ChunkKV([torch.zeros(1, 96, 2)] * 30, [torch.zeros(1, 96, 2)] * 30, "f" * 64)


def test_decisions_serialise():
    controller = LoadingController(make_profile())
    for decision in (controller.choose(3072, 3136, "disk"), controller.choose(3072, 3136, "ram")):
        data = decision.to_dict()
        assert json.loads(json.dumps(data)) == data and data["ratio"] == decision.ratio


def test_bad_input_is_rejected():
    controller = LoadingController(make_profile())
    with pytest.raises(ValueError, match="num_cached_tokens"):
        controller.choose(200, 100)
    with pytest.raises(ValueError, match="not profiled"):
        controller.choose(10, 100, "nvme")
    with pytest.raises(ValueError, match="r_floor"):
        LoadingController(None, r_floor=1.5)
    with pytest.raises(ValueError, match="positive"):
        Profile("f", "m", "cpu", "float32", "float16", 30, 768, [(512, 0.0)], {"ram": 1.0})


def test_profile_round_trip(tmp_path):
    profile = make_profile()
    path = profile.save(tmp_path / "p.json")
    assert Profile.load(path) == profile
    data = json.loads(path.read_text())
    data["version"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="profile version"):
        Profile.load(path)


def test_prefill_measurement_on_the_real_model(model):
    points = measure_prefill_per_layer(model, [64, 16], repeats=1)
    assert [n for n, _ in points] == [16, 64] and all(s > 0 for _, s in points)


def test_profile_of_the_real_model_drives_the_controller(model, tmp_path):
    profile = profile_device(model, lengths=[32, 64], chunk_tokens=32, repeats=1, work_dir=tmp_path)
    # the default codec's encoded bytes (768 in float16: 2 x 3 heads x 64 dims x 2 bytes; int8 about half)
    expected = kv_bytes_per_token_per_layer(model.shape, DEFAULT_KV_DTYPE)
    assert profile.model_fingerprint == model.fingerprint and profile.kv_bytes_per_token_per_layer == expected
    assert expected < 768 if get_codec(DEFAULT_KV_DTYPE).quantized else expected == 768
    assert set(profile.tier_bytes_per_s) == {"ram", "disk"} and profile.notes["disk_warm_bytes_per_s"] > 0
    assert not list(tmp_path.iterdir())  # the measurement store was removed
    path = profile.save(profile_path(model.fingerprint, model.device, tmp_path))
    controller = LoadingController.for_model(model, home=tmp_path)
    assert controller.profile == Profile.load(path)
    decision = controller.choose(6 * 512, 6 * 512 + 50, "disk")
    assert decision.profiled and decision.ratio >= controller.r_floor and decision.tier == "disk"
