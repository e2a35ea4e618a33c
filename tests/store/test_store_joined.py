"""Chunks kept encoded in RAM, served joined (store/joined.py): each layer of a run of chunks is decoded
in one go, to exactly what decoding each chunk alone gives, in the same order."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.blend.segments import ChunkKV
from cacheblend_rag.store.codec import CODECS
from cacheblend_rag.store.fileformat import EncodedChunk
from cacheblend_rag.store.joined import JoinedLayerKV


def encoded(codec_name: str, tokens: int, seed: int) -> EncodedChunk:
    codec = CODECS[codec_name]
    generator = torch.Generator().manual_seed(seed)
    layers = [
        codec.encode(
            torch.randn(3, tokens, 64, generator=generator), torch.randn(3, tokens, 64, generator=generator)
        )
        for _ in range(2)
    ]
    return EncodedChunk(codec, layers, "fingerprint", tokens, {})


@pytest.mark.parametrize("codec", ["int8", "float16"])
def test_a_run_of_chunks_decodes_to_each_chunk_decoded_alone(codec):
    # lengths around the key group (128): a partial last group, an exact one, several
    chunks = [encoded(codec, n, seed) for seed, n in enumerate((37, 128, 300))]
    head = ChunkKV([torch.randn(3, 5, 64) for _ in range(2)], [torch.randn(3, 5, 64) for _ in range(2)], "f")
    loader = JoinedLayerKV([head, *chunks], torch.float32, torch.device("cpu"))
    assert [len(run.sources) for run in loader.runs] == [1, 3]
    for layer in range(2):
        (head_k, head_v), (keys, values) = loader.layer(layer)
        assert torch.equal(head_k, head.keys[layer]) and torch.equal(head_v, head.values[layer])
        alone = [chunk.layer(layer) for chunk in chunks]
        assert torch.equal(keys, torch.cat([k for k, _ in alone], dim=1).float())
        assert torch.equal(values, torch.cat([v for _, v in alone], dim=1).float())


def test_int4_chunks_and_stored_sources_are_not_joined():
    assert JoinedLayerKV.serves([encoded("int8", 40, 0), encoded("float16", 40, 1)])
    assert not JoinedLayerKV.serves([encoded("int4", 40, 0)])
    mixed = JoinedLayerKV([encoded("int8", 40, 0), encoded("float16", 40, 1)], torch.float32, "cpu")
    assert len(mixed.runs) == 2  # one run per codec, in order


@pytest.mark.parametrize("lengths", [(37, 128, 300), (128, 256)])  # partial key groups, whole ones
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", ["int8", "float16"])
def test_staging_several_layers_gives_what_each_layer_serves(codec, dtype, lengths):
    chunks = [encoded(codec, n, seed) for seed, n in enumerate(lengths)]
    head = ChunkKV([torch.randn(3, 5, 64) for _ in range(2)], [torch.randn(3, 5, 64) for _ in range(2)], "f")
    loader = JoinedLayerKV([head, *chunks], dtype, torch.device("cpu"))
    rows = 5 + sum(lengths)
    out = torch.zeros((2, 3, 2, rows + 7, 64), dtype=dtype)  # [layers, Hkv, K/V, padded rows, d]
    loader.stage(0, 2, out)
    for layer in range(2):
        served = loader.layer(layer)
        assert torch.equal(out[layer, :, 0, :rows], torch.cat([k for k, _ in served], dim=1))
        assert torch.equal(out[layer, :, 1, :rows], torch.cat([v for _, v in served], dim=1))
    assert not out[:, :, :, rows:].any()  # the padding is left as it was
