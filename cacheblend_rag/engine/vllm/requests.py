"""One request's way through vLLM: our segments and sampling options as a vLLM request (token ids,
``SamplingParams``, the blend message in ``kv_transfer_params``), and vLLM's output as a result."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...blend.controller import LoadingController
from ...blend.methods import Reuse
from ...errors import CacheBlendError
from ..base import FusionDiagnostics, FusionStats, GenerationResult
from ..request import AdmittedRequest, GenerationRequest
from ..sampling import SamplingParams
from .protocol import BlendRequest

log = logging.getLogger(__name__)

# how every answer of the vLLM engine was fused (results' ``fusion_path``): by vLLM, with our connector
VLLM_PATH = "vllm"


@dataclass
class VLLMGenerationResult(GenerationResult):
    """A :class:`GenerationResult` plus what vLLM itself reported."""

    claimed_tokens: int = 0  # prompt tokens the connector provided as externally computed KV
    vllm_cached_tokens: int = 0  # vLLM's own count: prefix-cache hits plus external tokens
    kv_write_s: float = 0.0  # writing the fused K/V into vLLM's paged cache, part of ttft_s
    # layers whose fused K/V the fusion wrote into vLLM's paged cache in place (engine/vllm/paged.py; 0: the
    # fusor's own attention, K/V written after the fusion), and how many layers each kernel attended
    # ("vllm", "vllm_unmerged": vLLM's over the paged cache; "runtime": ours, paged.AttentionChoice)
    paged_layers: int = 0
    attention_kernels: dict[str, int] = field(default_factory=dict)
    # the worker's choice of that kernel so far: by size class, the kernel chosen and each one's timing
    attention_choice: dict[str, Any] = field(default_factory=dict)


@dataclass
class PreparedRequest:
    """A request ready for vLLM's engine, and what its result needs."""

    key: str
    prompt: dict[str, Any]
    params: Any  # vllm.SamplingParams
    admitted: AdmittedRequest
    blend: BlendRequest | None
    first_token_at: float | None = None
    output: Any = None  # the last vllm RequestOutput


def prepare_request(
    request: GenerationRequest, *, controller: LoadingController, eos_ids: set[int], max_model_len: int
) -> PreparedRequest:
    """``request`` as a vLLM request: prompt token ids, sampling parameters, and for a method that blends
    cached chunks the blend message (and a prefix-cache salt). Bad input raises."""
    from vllm import SamplingParams as VSamplingParams

    admitted = AdmittedRequest.of(request, controller, max_model_len, "vLLM's max_model_len")
    segments, sampling, recompute = request.segments, request.sampling, admitted.resolved.method
    ids = [t for s in segments for t in s.token_ids]
    key = uuid.uuid4().hex
    blend = None
    if recompute.reuses is Reuse.CHUNKS and any(s.is_cached for s in segments):
        blend = BlendRequest(
            key,
            tuple(len(s) for s in segments),
            tuple(s.is_cached for s in segments),
            recompute.name,
            recompute.options(),
            diagnostics=sampling.diagnostics,
        )
        if blend.claim_end == 0:
            blend = None  # no cached chunk before the question: nothing to blend
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    extra_args = None
    if blend is not None:
        prompt["cache_salt"] = blend.cache_salt(ids)
        extra_args = {"kv_transfer_params": blend.to_params()}
    params = VSamplingParams(
        max_tokens=admitted.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop=list(sampling.stop) or None,
        stop_token_ids=sorted(eos_ids),
        skip_special_tokens=True,
        extra_args=extra_args,
        structured_outputs=structured_outputs(sampling),
        # diagnostics: the whole vocabulary's raw log-probabilities (the engine starts vLLM with
        # logprobs_mode="raw_logprobs" and no max_logprobs cap); vLLM has no switch for the first token
        # alone, so such a request gets them at every step, and only it: other requests ask for none
        **({"logprobs": -1, "flat_logprobs": True} if sampling.diagnostics else {}),
    )
    return PreparedRequest(key, prompt, params, admitted, blend)


def structured_outputs(sampling: SamplingParams) -> Any:
    """vLLM's guided decoding for a request with a JSON constraint (None without one): the constraint's
    schema with its JSON options written in (``x-guidance``), which vLLM's ``guidance`` backend (the one
    :class:`~.engine.VLLMEngine` starts vLLM with, llguidance like the PyTorch engine's) compiles to the
    same grammar. vLLM does not steer the JSON to a close when the budget runs low, as the PyTorch
    engine does: a budget too small for the answer ends it unfinished (``finish_reason == "length"``)."""
    if sampling.constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(json=sampling.constraint.guidance_schema())


def build_result(
    request: PreparedRequest, stats: dict[str, Any] | None, eos_ids: set[int], vocab_size: int
) -> VLLMGenerationResult:
    """The result of a finished request, from vLLM's last output and the worker's fusion accounting
    (``stats``; None when nothing was blended), with its diagnostics when its sampling asked for them."""
    output = request.output
    completion = output.outputs[0]
    if completion.finish_reason not in ("stop", "length"):
        raise CacheBlendError(
            f"vLLM ended request {request.key} with finish reason {completion.finish_reason!r}"
        )
    token_ids = list(completion.token_ids)
    if completion.finish_reason == "stop" and token_ids and token_ids[-1] in eos_ids:
        token_ids.pop()  # like the PyTorch engine, report the answer without its end-of-sequence token
    cached = int(output.num_cached_tokens or 0)
    asked = request.admitted.request
    prompt_tokens = asked.prompt_tokens
    stats = stats or {}
    if "error" in stats:
        # the worker could not blend it and vLLM prefilled it instead: the answer is exact
        log.warning("request %s was prefilled in full: %s", request.key, stats["error"])
        fusion, claimed = FusionStats(0, prompt_tokens, 1.0, blended=False, path=VLLM_PATH), 0
    elif stats:
        fusion = FusionStats(
            int(stats["reused_tokens"]),
            int(stats["computed_tokens"]),
            float(stats["recompute_ratio"]),
            float(stats.get("load_wait_s", 0.0)),
            tuple(int(n) for n in stats.get("kept_per_segment", ())),
            path=VLLM_PATH,
            seconds=float(stats.get("fusion_s", 0.0)),
        )
        claimed = int(stats["claimed_tokens"])
    else:
        # nothing was claimed: whatever vLLM's prefix cache served (exact KV, or for a repeated blend
        # request the blocks it blended before) is reused, the rest prefilled
        fusion, claimed = FusionStats(cached, prompt_tokens - cached, 1.0, blended=False, path=VLLM_PATH), 0
    finished = time.perf_counter()
    result = VLLMGenerationResult.build(
        text=completion.text,
        token_ids=token_ids,
        finish_reason=completion.finish_reason,
        admitted=request.admitted,
        fusion=fusion,
        first_token_at=request.first_token_at,
        finished_at=finished,
        claimed_tokens=claimed,
        vllm_cached_tokens=cached,
        kv_write_s=float(stats.get("write_s", 0.0)),
        paged_layers=int(stats.get("paged_layers", 0)),
        attention_kernels=dict(stats.get("attention_kernels") or {}),
        attention_choice=dict(stats.get("attention_choice") or {}),
        diagnostics=(diagnostics(request, stats, cached, vocab_size) if asked.sampling.diagnostics else None),
    )
    # the worker reused the template's opening exactly (its own segments had it as an exact head, these
    # have it fresh): counted as the PyTorch engine counts its exact head (docs/accounting.md)
    head = stats.get("exact_head") or {}
    if head.get("tokens") and "error" not in stats:
        if head["computed"]:
            result.kv_computed_tokens += int(head["tokens"])
        else:
            result.cache_read_exact_tokens += int(head["tokens"])
    return result


def diagnostics(
    request: PreparedRequest, stats: dict[str, Any], cached: int, vocab_size: int
) -> FusionDiagnostics:
    """A finished request's :class:`FusionDiagnostics`. The first token's distribution is vLLM's own raw
    log-probabilities over the whole vocabulary (before temperature and logits processors; a JSON
    constraint's grammar mask is already in them, as vLLM applies it to the logits). The fusion's
    figures come from the worker (``stats``); a request vLLM prefilled itself recomputed every position
    its prefix cache did not serve (``cached``), with no fusion time; where vLLM's prefix cache served
    blocks blended for an earlier request, they are None. vLLM scores no continuation here: each
    ``continuation_nll`` is None."""
    prompt_tokens = request.admitted.request.prompt_tokens
    fused = stats.get("diagnostics")
    positions: tuple[int, ...] | None
    fraction: float | None
    fusion_s: float | None = None
    if fused is not None:
        positions = tuple(int(p) for p in fused["recomputed_positions"])
        fraction, fusion_s = float(fused["compute_fraction"]), float(fused["fusion_s"])
    elif "error" in stats:  # the blend failed and vLLM prefilled the claimed span itself
        positions, fraction = tuple(range(prompt_tokens)), 1.0
    elif request.blend is not None and cached > 0:
        # nothing claimed: vLLM's prefix cache served blocks an earlier request blended, whose
        # recomputed positions this request never saw
        log.debug("request %s: blended KV came from vLLM's prefix cache; no fusion figures", request.key)
        positions, fraction = None, None
    else:  # vLLM's own prefill (or its prefix cache's exact KV for the first ``cached`` tokens)
        positions, fraction = tuple(range(cached, prompt_tokens)), (prompt_tokens - cached) / prompt_tokens
    return FusionDiagnostics(
        first_token_logprobs=first_token_logprobs(request.output.outputs[0], vocab_size),
        recomputed_positions=positions,
        compute_fraction=fraction,
        fusion_s=fusion_s,
        continuation_nll=tuple(None for _ in request.admitted.request.sampling.score_continuations),
    )


def first_token_logprobs(completion: Any, vocab_size: int) -> torch.Tensor:
    """The first generated token's log-probabilities over the vocabulary (float32 [vocab], on CPU), from
    a vLLM completion that asked for every token's (``logprobs=-1``). A token vLLM gave none for is NaN:
    unknown, never made up."""
    from vllm.logprobs import FlatLogprobs

    logprobs = completion.logprobs
    if not logprobs:
        raise CacheBlendError("vLLM returned no log-probabilities for the first generated token")
    if isinstance(logprobs, FlatLogprobs):  # its lists, not a dict of a Logprob per vocabulary entry
        start, end = logprobs.start_indices[0], logprobs.end_indices[0]
        ids, values = logprobs.token_ids[start:end], logprobs.logprobs[start:end]
    else:
        ids, values = list(logprobs[0]), [lp.logprob for lp in logprobs[0].values()]
    out = torch.full((vocab_size,), float("nan"), dtype=torch.float32)
    out[torch.tensor(ids, dtype=torch.long)] = torch.tensor(values, dtype=torch.float32)
    missing = int(out.isnan().sum())
    if missing:
        log.warning(
            "vLLM gave the first token's log-probabilities of %d of %d tokens (the rest are NaN)",
            vocab_size - missing,
            vocab_size,
        )
    return out


def blend_keys(requests: Sequence[PreparedRequest]) -> list[str]:
    """Keys of the requests the worker blended (whose accounting it holds)."""
    return [r.key for r in requests if r.blend is not None]
