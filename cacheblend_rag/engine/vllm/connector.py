"""The CacheBlend KV connector for vLLM V1 (``KVConnectorBase_V1``), loaded by module path.

vLLM can skip prefill only for a prefix of a prompt whose KV a connector provides. For a blend request
(see :mod:`.protocol`) that prefix is every prompt token but the last: the template, the retrieved chunks
and the question, which the fusor computes anyway (fresh text, exact attention over the fused KV). The
connector

* on the scheduler side, claims that span as externally computed (``get_num_new_matched_tokens``; never
  the last prompt token), notes the blocks vLLM allocated for it (``update_state_after_alloc``) and passes
  the request's token ids, segmentation and block ids to the worker (``build_connector_meta``);
* on the worker side, before the forward (``start_load_kv``), fuses the whole prompt with our layer-wise
  runtime over vLLM's own modules (:mod:`.weights`). On vLLM's CPU backend each layer's fused K/V is
  written into the request's blocks once it is final and the layer's recomputed rows attend there with
  vLLM's own kernel (:mod:`.paged`); on another backend the fused K/V of the claimed positions is written
  after the fusion. vLLM then computes the last prompt token against that KV and decodes as usual.

K/V are written through the attention backend's own ``do_kv_cache_update`` (the call vLLM makes for every
token it computes), so the paged layout never has to be known here. On this CPU backend it is, per layer,
(num_blocks, num_kv_heads, block_size, 2 * head_dim) with each block/head holding K transposed
[head_dim, block_size] then V [block_size, head_dim]; CUDA backends differ, and the same call covers both.
Keys are cached after RoPE in vLLM as in our runtime, so fused keys go in as they are.

Every layer is written before the forward begins: fusion is one sequential pass over the model's layers,
so a per-layer hand-off to vLLM's forward (``wait_for_layer_load``) would only overlap work on a device
with spare compute. A blend that fails (store I/O, unknown method) reports its blocks as failed; with
``kv_load_failure_policy="recompute"`` vLLM then prefills them itself, so the answer is still an exact
one.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..base import fusion_figures
from .paged import PagedTarget, is_cpu_attention
from .protocol import BlendRequest
from .worker import WorkerBlender, current_blender, record_failure

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class BlendLoad:
    """One request's load for this step: positions [start, end) of its prompt go to its blocks."""

    request_id: str
    request: BlendRequest
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int


@dataclass
class CacheBlendMetadata(KVConnectorMetadata):
    loads: list[BlendLoad] = field(default_factory=list)


class CacheBlendConnector(KVConnectorBase_V1):
    """Scheduler side: claims blended spans. Worker side: fuses them and writes them into the paged cache."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._extra = dict(self._kv_transfer_config.kv_connector_extra_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            # each worker would hold a slice of heads or layers; the fused KV covers all of them
            raise NotImplementedError(
                "the CacheBlend connector supports one worker (no tensor/pipeline parallelism)"
            )
        # scheduler side
        self._pending: dict[str, BlendLoad] = {}
        # worker side
        self._model_dtype = vllm_config.model_config.dtype
        self._layers: list[tuple[str, int]] = []
        self._blender: WorkerBlender | None = None  # this process's, once started (see blender)
        self._failed_blocks: set[int] = set()

    # -- scheduler side ------------------------------------------------------------------------------

    def _blend_request(self, request: Request) -> BlendRequest | None:
        try:
            blend = BlendRequest.from_params(request.kv_transfer_params)
        except ValueError as exc:
            log.error("request %s: %s; prefilling it in full", request.request_id, exc)
            return None
        if blend is not None and blend.num_tokens != request.num_prompt_tokens:
            log.error(
                "request %s: blend request describes %d tokens, the prompt has %d; prefilling it in full",
                request.request_id,
                blend.num_tokens,
                request.num_prompt_tokens,
            )
            return None
        return blend

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        blend = self._blend_request(request)
        if blend is None:
            return 0, False
        return max(0, blend.claim_end - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        blend = self._blend_request(request)
        if blend is None:  # cannot happen: a positive claim came from a valid blend request
            return
        end = blend.claim_end
        self._pending[request.request_id] = BlendLoad(
            request_id=request.request_id,
            request=blend,
            token_ids=list(request.prompt_token_ids or []),
            block_ids=list(blocks.get_block_ids()[0]),
            start=end - num_external_tokens,
            end=end,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = CacheBlendMetadata(loads=list(self._pending.values()))
        self._pending.clear()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = []
        for name in kv_caches:
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise NotImplementedError(
                    f"KV cache layer {name!r} has no layer index; cannot map it to our model"
                )
            layers.append((name, int(match.group(1))))
        self._layers = sorted(layers, key=lambda item: item[1])

    @property
    def blender(self) -> WorkerBlender:
        """This worker's blender, started by VLLMEngine's ``cacheblend_start`` RPC right after vLLM loaded
        its model (so an unsupported model fails at engine start, and no request pays for it)."""
        if self._blender is None:
            blender = current_blender()
            num_layers = blender.shape.num_layers
            if [index for _, index in self._layers] != list(range(num_layers)):
                raise NotImplementedError(
                    f"vLLM caches KV for layers {[i for _, i in self._layers]}, the model has {num_layers}"
                )
            self._blender = blender
        return self._blender

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CacheBlendMetadata)
        for load in meta.loads:
            try:
                self._load(load, forward_context)
            except Exception as exc:  # a bad blend must not take the engine down: vLLM recomputes it
                log.exception("CacheBlend load of request %s failed; vLLM will prefill it", load.request_id)
                failed_blocks = {load.block_ids[p // self._block_size] for p in range(load.start, load.end)}
                self._failed_blocks.update(failed_blocks)
                record_failure(load.request.request_key, exc)

    def _load(self, load: BlendLoad, forward_context: ForwardContext) -> None:
        blender = self.blender
        started = time.perf_counter()
        layers = [forward_context.no_compile_layers[name] for name, _ in self._layers]
        target = self._paged_target(load, layers) if blender.pages else None
        fusion = blender.blend(load.request, load.token_ids, target)
        fused_s = time.perf_counter() - started
        written = target.written if target is not None else set()
        # layers the fusion did not write in place (another backend): their claimed K/V, written now
        positions = torch.arange(load.start, load.end)
        blocks = torch.tensor(load.block_ids, dtype=torch.long)
        cache = fusion.cache
        for (_, index), layer in zip(self._layers, layers, strict=True):
            if index in written:
                continue
            kv_cache = layer.kv_cache
            slots = (
                blocks[positions // self._block_size] * self._block_size + positions % self._block_size
            ).to(kv_cache.device)
            # [Hkv, n, d] -> [n, Hkv, d], the token-major shape the backend's cache update takes
            keys = (
                cache.keys[index][0, :, load.start : load.end]
                .transpose(0, 1)
                .to(kv_cache.device, self._model_dtype)
            )
            values = cache.values[index][0, :, load.start : load.end].transpose(0, 1)
            values = values.to(kv_cache.device, self._model_dtype)
            layer.impl.do_kv_cache_update(layer, keys.contiguous(), values.contiguous(), kv_cache, slots)
        stats: dict[str, Any] = {
            "claimed_tokens": load.end - load.start,
            "prompt_tokens": fusion.num_tokens,
            "reused_tokens": fusion.reused_tokens,
            "computed_tokens": fusion.computed_tokens,
            "recompute_ratio": fusion.recompute_ratio,
            "kept_per_segment": list(fusion.kept_per_segment),
            "fusion_s": fused_s,
            "write_s": time.perf_counter() - started - fused_s,
            "load_wait_s": fusion.load_wait_s,
            # layers whose fused K/V the fusion wrote into vLLM's paged cache in place, and by which
            # kernel their rows were attended (vLLM's over the paged cache, or our runtime's: paged.py)
            "paged_layers": len(written),
            "attention_kernels": dict(target.kernels) if target is not None else {},
            "attention_choice": blender.attention_report(),
            "fused_token_layers": sum(fusion.attended_tokens_per_layer),
            # the template's opening, reused exactly (its KV kept in the worker, computed on a miss)
            "exact_head": exact_head(fusion),
        }
        if load.request.diagnostics:  # only when asked: the positions are a list as long as the prompt
            stats["diagnostics"] = fusion_figures(fusion)
        blender.record(load.request.request_key, stats)

    def _paged_target(self, load: BlendLoad, layers: list[Any]) -> PagedTarget | None:
        """Where the fusion writes and attends in vLLM's paged cache: every layer on vLLM's CPU backend,
        and blocks for the whole prompt (None otherwise: the fusion attends in its own cache)."""
        num_tokens = len(load.token_ids)
        if len(load.block_ids) * self._block_size < num_tokens or not all(map(is_cpu_attention, layers)):
            return None
        return PagedTarget(layers, load.block_ids, self._block_size, load.start, num_tokens)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward began

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # chunk KV is stored by our own precompute, never read back from vLLM's cache

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


def exact_head(fusion: Any) -> dict[str, Any]:
    """The prompt's exact head segment as the worker fused it: its tokens, and whether its KV was computed
    for this request (no tokens: the prompt had none)."""
    head = fusion.plan.segments[0]
    if not (head.is_cached and head.exact):
        return {"tokens": 0, "computed": False}
    return {"tokens": len(head), "computed": bool(head.computed)}
