"""The layer-wise pipelined loader: same tensors as direct reads, prefetch hides load, errors surface."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from store_support import FINGERPRINT, flip_byte, tensor_span

from cacheblend_rag.blend.segments import ChunkKV, DirectLayerKV, LayerKVProvider
from cacheblend_rag.errors import CorruptKVError
from cacheblend_rag.store.kvstore import KVStore
from cacheblend_rag.store.pipeline import PipelinedLayerLoader, worth_prefetching


class SlowSource:
    """A chunk whose layers take ``delay`` seconds to read (a slow tier), counting the reads."""

    def __init__(self, kv: ChunkKV, delay: float) -> None:
        self.kv, self.delay, self.reads = kv, delay, 0
        self.fingerprint, self.num_tokens, self.num_layers = kv.fingerprint, kv.num_tokens, kv.num_layers
        self.threads: set[str] = set()

    def layer(self, layer: int):
        self.reads += 1
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        return self.kv.layer(layer)


def mixed_sources(tmp_path, shape, make_kv):
    """One chunk served from disk, one from RAM, in the storage dtype (fp16)."""
    store = KVStore(tmp_path, FINGERPRINT, shape, "float16", promote_on_read=False)
    disk_key, ram_key = store.chunk_key([1]), store.chunk_key([2])
    store.put(disk_key, make_kv(n=10, seed=1))
    store.evict_ram()
    store.put(ram_key, make_kv(n=7, seed=2))
    return [store.get(disk_key), store.get(ram_key)]


@pytest.mark.parametrize("prefetch", [True, False])
def test_loader_returns_exactly_what_direct_reads_return(tmp_path, shape, make_kv, prefetch):
    sources = mixed_sources(tmp_path, shape, make_kv)
    direct = DirectLayerKV(sources)
    loader: LayerKVProvider
    with PipelinedLayerLoader(sources, torch.float32, prefetch=prefetch) as loader:
        for layer in range(shape.num_layers):
            got, want = loader.layer(layer), direct.layer(layer)
            assert len(got) == 2
            for (k, v), (k_ref, v_ref) in zip(got, want, strict=True):
                assert k.dtype == v.dtype == torch.float32
                assert torch.equal(k, k_ref.float()) and torch.equal(v, v_ref.float())
        timings = loader.timings()
    assert timings.layers == shape.num_layers and timings.load_s > 0


def test_real_chunks_load_identically_from_disk(tmp_path, model, real_chunks):
    store = KVStore(tmp_path, model.fingerprint, model.shape, "bfloat16")
    keys = [store.chunk_key(ids) for ids, _ in real_chunks]
    for key, (_, kv) in zip(keys, real_chunks, strict=True):
        store.put(key, kv)
    store.evict_ram()
    sources = [store.get(key) for key in keys]
    with PipelinedLayerLoader(sources, model.dtype, model.device) as loader:
        for layer in range(model.num_layers):
            for (k, v), (_, kv) in zip(loader.layer(layer), real_chunks, strict=True):
                assert torch.equal(k, kv.keys[layer].to(torch.bfloat16).to(model.dtype))
                assert torch.equal(v, kv.values[layer].to(torch.bfloat16).to(model.dtype))


def test_prefetch_hides_load_behind_compute(make_kv):
    layers, delay = 4, 0.03
    source = SlowSource(make_kv(), delay)
    with PipelinedLayerLoader([source], torch.float32, prefetch=True) as loader:
        for layer in range(layers):
            loader.layer(layer)
            time.sleep(2 * delay)  # the "compute" of this layer, longer than one layer's load
        on = loader.timings()
    assert source.threads == {"kv-prefetch"} and source.reads == layers
    # only layer 0 (asked for right away) is waited for; the others load while the caller computes
    assert on.hidden_fraction > 0.5, on

    source = SlowSource(make_kv(), delay)
    with PipelinedLayerLoader([source], torch.float32, prefetch=False) as loader:
        for layer in range(layers):
            loader.layer(layer)
        off = loader.timings()
    assert off.hidden_fraction == 0.0 and off.wait_s == off.load_s >= layers * delay
    assert source.threads == {threading.current_thread().name}


def test_prefetch_stays_within_its_depth(make_kv):
    source = SlowSource(make_kv(), 0.0)
    loader = PipelinedLayerLoader([source], torch.float32, depth=1)
    time.sleep(0.2)
    assert source.reads == 1  # layer 0 only, until the caller asks for it
    loader.layer(0)
    time.sleep(0.2)
    assert source.reads == 2
    loader.close()


def test_corrupt_layer_surfaces_at_that_layer(tmp_path, shape, make_kv):
    store = KVStore(tmp_path, FINGERPRINT, shape, "float16")
    key = store.chunk_key([1])
    store.put(key, make_kv())
    store.evict_ram()
    start, _ = tensor_span(store.path_for(key), "layers.2.keys")
    flip_byte(store.path_for(key), start)
    with PipelinedLayerLoader([store.get(key)], torch.float32) as loader:
        loader.layer(0)
        loader.layer(1)
        with pytest.raises(CorruptKVError) as err:
            loader.layer(2)
        assert err.value.key == key
        with pytest.raises(CorruptKVError):
            loader.layer(3)


def test_close_mid_request_and_repeat_requests(make_kv):
    kv = make_kv()
    loader = PipelinedLayerLoader([kv], torch.float32)
    first = loader.layer(0)
    again = loader.layer(0)  # served already: read directly
    assert torch.equal(first[0][0], again[0][0])
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        loader.layer(1)


def test_bad_arguments(make_kv):
    kv = make_kv()
    short = ChunkKV(kv.keys[:2], kv.values[:2], kv.fingerprint)
    with pytest.raises(ValueError, match="disagree"):
        PipelinedLayerLoader([kv, short], torch.float32)
    with PipelinedLayerLoader([kv], torch.float32) as loader, pytest.raises(IndexError):
        loader.layer(kv.num_layers)


def test_only_slow_tiers_or_an_accelerator_are_worth_a_prefetch_thread(tmp_path, shape, make_kv):
    disk, ram = mixed_sources(tmp_path, shape, make_kv)
    assert (disk.tier, ram.tier) == ("disk", "ram")
    # from disk on a CPU: a thread only where a core is left over beside the compute's threads
    assert worth_prefetching([ram, disk], "cpu", spare=1) and worth_prefetching([disk], "cpu", spare=2)
    assert not worth_prefetching([disk], "cpu", spare=0) and not worth_prefetching(
        [ram, disk], "cpu", spare=0
    )
    # KV in RAM decodes faster on the compute's own cores than a thread hands it over
    assert not worth_prefetching([ram], "cpu", spare=4)
    assert not worth_prefetching([make_kv()], torch.device("cpu"), spare=4)
    assert worth_prefetching([ram], "cuda", spare=0)  # the copy to the device overlaps the compute
    assert not worth_prefetching([], "cpu", spare=4)


def test_a_remote_tier_is_read_ahead_in_a_thread_even_with_no_core_to_spare(make_kv):
    class RemoteSource:  # what a remote tier's reader says of itself (store/remote/source.py)
        tier = "remote"

    assert worth_prefetching([make_kv(), RemoteSource()], "cpu", spare=0)


def test_engine_reads_disk_kv_ahead_only_with_a_core_to_spare(tmp_path, model, real_chunks, monkeypatch):
    from cacheblend_rag.engine import Engine
    from cacheblend_rag.store import pipeline

    store = KVStore(tmp_path, model.fingerprint, model.shape, "int8")
    engine = Engine(model, store)
    keys = [store.chunk_key(ids) for ids, _ in real_chunks]
    for key, (_, kv) in zip(keys, real_chunks, strict=True):
        store.put(key, kv)
    with engine._loader([store.get(key) for key in keys]) as loader:
        assert loader._thread is None  # every source in RAM: read when asked for
        assert len(loader.layer(0)) == len(keys)
    for spare, threaded in ((1, True), (0, False)):
        monkeypatch.setattr(pipeline, "spare_cores", lambda spare=spare: spare)
        store.evict_ram()
        with engine._loader([store.get(key) for key in keys]) as loader:
            # from disk: prefetched while the fusor computes, when a core is free for it
            assert (loader._thread is not None) is threaded
            assert len(loader.layer(0)) == len(keys)


def test_the_disk_tier_asks_the_kernel_to_read_a_chunk_file_ahead_when_it_opens_it(
    tmp_path, shape, make_kv, monkeypatch
):
    from cacheblend_rag.store import disk as disk_module

    store = KVStore(tmp_path, FINGERPRINT, shape, "int8")
    kv = make_kv()
    key = store.chunk_key([7])
    store.put(key, kv)
    store.evict_ram()
    hints = []
    real = os.posix_fadvise
    monkeypatch.setattr(
        disk_module.os,
        "posix_fadvise",
        lambda fd, off, n, advice: hints.append(advice) or real(fd, off, n, advice),
    )
    source = store.get(key)
    assert source is not None and source.tier == "disk"
    assert hints == [os.POSIX_FADV_WILLNEED]
    torch.testing.assert_close(source.layer(0)[0].float(), kv.keys[0].float(), atol=0.05, rtol=0.05)
