"""The worker's fusor runs on vLLM's own loaded modules: no second copy of the weights, same numbers.

The sharing is checked in the worker process (``VLLMEngine.weight_sharing``): every tensor the fusor
computes with must live in the storage of one of vLLM's parameters. The numbers are checked against the
PyTorch engine over the HF weights: chunk KV the worker computes through vLLM's modules equals the KV the
PyTorch engine computes (to the store's float16 resolution), and the greedy answers of test_vllm_engine.py
(full prefill through the connector, CacheBlend at 0.15) equal the PyTorch engine's token for token.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cacheblend_rag.engine.vllm.weights import UnknownLayoutError, layerwise_over_vllm, layout_problem
from cacheblend_rag.engine.vllm.worker import COPY, fusion_model
from cacheblend_rag.models.provision import resolve_model_path

pytestmark = pytest.mark.vllm


def test_fusion_computes_with_vllms_own_parameters(vllm_engine, model):
    report = vllm_engine.weight_sharing()
    assert report["weights"] == vllm_engine.fusion_weights == "vllm"
    assert report["own_tensors"] == 0 and report["own_bytes"] == 0
    # at least every layer's two norms, the final norm and the embedding table (tied to the LM head here)
    assert report["shared_tensors"] >= 2 * model.shape.num_layers + 2
    memory = vllm_engine.worker_memory()
    assert memory["pid"] > 0 and memory["rss_bytes"] > 0


def test_worker_chunk_kv_equals_the_pytorch_engines(vllm_engine, torch_engine, musique_rag):
    """A chunk prefilled in the worker (layer-wise over vLLM's fused projections, our norms and MLP gating)
    against the same chunk prefilled by the PyTorch engine over the HF model, layer by layer."""
    _, chunks = musique_rag(5)
    ids = chunks[1].token_ids
    key = vllm_engine.chunk_key(ids)
    assert not vllm_engine.store.contains(key)  # computed by the worker now, not read back
    assert vllm_engine.ensure_chunk_kv(ids) > 0
    stored = vllm_engine.store.get(key)
    expected = torch_engine.precompute(ids).to(vllm_engine.store.kv_dtype)
    worst = 0.0
    for layer in range(expected.num_layers):
        for got, want in zip(stored.layer(layer), expected.layer(layer), strict=True):
            # float16 storage: one rounding step apart at most where the float32 values straddle it
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
            worst = max(worst, float((got.float() - want.float()).abs().max()))
    print(f"max |KV difference| over {expected.num_layers} layers: {worst:.2e}")


def test_an_unknown_layout_falls_back_to_a_copy_of_the_weights(model, caplog):
    """A model laid out otherwise (here transformers' own modules, as a vLLM model on its transformers
    backend would be) is refused with the reason, and the worker loads its own copy instead, saying why.
    Needs no vLLM: runs in every environment."""
    path = resolve_model_path(None)
    problem = layout_problem(model.hf_model, model.hf_model.config)
    assert problem is not None and "LlamaRMSNorm" in problem
    with pytest.raises(UnknownLayoutError, match="LlamaRMSNorm"):
        layerwise_over_vllm(model.hf_model, path, model.dtype)
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.engine.vllm.worker"):
        fused, weights = fusion_model({"model": str(path)}, model.hf_model, model.dtype)
    assert weights == COPY and "own copy" in caplog.text and "LlamaRMSNorm" in caplog.text
    assert fused.hf_model is not model.hf_model and fused.fingerprint == model.fingerprint
