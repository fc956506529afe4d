"""Capture in the MRV2 sampler (extends ``vllm/v1/worker/gpu/sample/sampler.py``).

A step whose requests all have a ``top_k`` of at most ``MAX_CANDIDATES`` (and the engine's width
cap) samples with the candidate sampler (``candidate_sampler.py``: top-k, top-p and the sample
over each row's top_k candidates, the kept ids written by the kernel that samples), whether or
not a request wants masks: it takes less device time than vLLM's FlashInfer sampler and draws
the tokens vLLM's own Gumbel path draws from the same kept set (seeded requests included), so
requests that opt out get it too. Other mask steps (top-p only, larger top_k) run vLLM's
top-k/top-p + Gumbel path and compact the processed logits it returns, after every transform
vLLM applies (logit bias, penalties, bad words, temperature, min-p, top-k/top-p; grammar masks
come earlier); vLLM's FlashInfer sampler is never used there, since its "processed" logits are
the pre-top-k ones. Both paths start from vLLM's own ``apply_sampling_params``. A candidate step
that returns processed logprobs computes them in the same kernel, over the kept ids, and hands
them to ``Sampler.__call__``'s ``compute_topk_scores``; vLLM would compute the same values from a
``-inf``-filled ``[R, V]`` tensor in several passes over it.

Speculative decoding (EAGLE, EAGLE3, MTP, DFlash, DSpark): a step with draft tokens is sampled
by vLLM's ``RejectionSampler``, which applies every transform including top-k/top-p to the
logits of every position (each request's draft positions, then its bonus position) and hands
them to ``rejection_sample``: a draft token is accepted against, a recovered token drawn from,
and the bonus token sampled from that position's distribution. That tensor is compacted as it
is handed over, one row per position (``GroupedStepMasks``); an output takes the rows of the
positions its accepted tokens came from.

The sampler remembers which of its requests opted out (``extra_args["return_sampling_mask"] =
False``): their rows are sampled and copied with the others but do not set the compaction width
and are never unpacked; a step with none that wants masks captures and copies nothing, and
where the candidate sampler does not apply runs vLLM's sampler as it is (FlashInfer included).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.v1.outputs import LogprobsTensors

from vllm_sampling_mask.config import (
    REQUIRED_LOGPROBS_MODE,
    SamplingMaskConfig,
    request_wants_masks,
)
from vllm_sampling_mask.patching import take_attribute
from vllm_sampling_mask.worker.candidate_sampler import (
    MAX_CANDIDATES,
    sample_from_candidates,
    top_candidates,
    use_torch_top_k,
)
from vllm_sampling_mask.worker.compaction import CompactSupport
from vllm_sampling_mask.worker.step_masks import (
    NO_MASKS_WANTED,
    DeviceStepMasks,
    GroupedStepMasks,
    MappedRows,
    compact_step,
    uva_buffer,
)

logger = logging.getLogger("vllm_sampling_mask")

_CAPTURE_ATTR = "sampling_mask_capture"
_PENDING_ATTR = "_sampling_mask_pending"


class SamplingMaskCapture:
    """Per-sampler capture settings and state; ``compact`` launches the kernel (no host sync).

    wants_masks: ``[max_num_reqs]`` bool, by vLLM's request slot: whether that request wants
    masks (set at ``Sampler.add_request``).
    use_flashinfer: what vLLM chose for this sampler; used by steps that capture nothing.
    mapped_rows: host buffers the candidate kernel writes the rows into (CUDA with UVA; None:
    the rows are written to device memory and copied).
    """

    def __init__(self, max_width: int, vocab_size: int, max_num_reqs: int = 0,
                 use_flashinfer: bool = False, mapped_rows: MappedRows | None = None):
        self.max_width = max_width
        self.vocab_size = vocab_size
        self.wants_masks = np.ones(max_num_reqs, dtype=bool)
        self.use_flashinfer = use_flashinfer
        self.mapped_rows = mapped_rows

    def compact(self, processed_logits: torch.Tensor, top_k_np: np.ndarray,
                row_wants: np.ndarray | None = None) -> DeviceStepMasks:
        """``processed_logits`` ``[R, V]``; ``top_k_np`` ``[R]`` host-side per-request top_k;
        ``row_wants`` ``[R]`` bool, the rows that want masks (None: all)."""
        return compact_step(processed_logits, top_k_np, self.max_width, row_wants)


def attach_capture(sampler: Any, vllm_config: Any) -> None:
    """Make ``sampler`` capture masks if the engine's switch is on (called after load_model)."""
    config = SamplingMaskConfig.of(vllm_config)
    if not config.enabled or sampler is None:
        return
    states = sampler.sampling_states
    setattr(sampler, _CAPTURE_ATTR, SamplingMaskCapture(
        config.max_width, states.vocab_size, states.max_num_reqs, sampler.use_flashinfer,
        mapped_rows_on(states.top_k.gpu.device),
    ))
    sampler.use_flashinfer = False
    # FlashInfer JIT-compiles its top-k kernels on first use (minutes on a new machine): do it
    # while the engine loads, not in the first request's step; if that fails, torch.topk.
    try:
        top_candidates(torch.zeros((1, states.vocab_size), device=states.top_k.gpu.device), 1)
    except Exception as exc:
        logger.warning("FlashInfer's top-k failed (%s: %s); the sampling-mask candidate sampler "
                       "uses torch.topk, which is slower.", type(exc).__name__, exc)
        use_torch_top_k()


def mapped_rows_on(device: torch.device) -> MappedRows | None:
    """``MappedRows`` for a CUDA device that can map pinned host memory, else None."""
    from vllm.utils.platform_utils import is_uva_available

    if device.type != "cuda" or not is_uva_available():
        return None
    return MappedRows(uva_buffer)


def wrap_load_model(original: Any) -> Any:
    """``GPUModelRunner.load_model`` (MRV2), then attach the capture to its sampler."""

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        attach_capture(getattr(self, "sampler", None), self.vllm_config)
        return result

    return load_model


def wrap_add_request(original: Any) -> Any:
    """``Sampler.add_request``: remember whether the request in that slot wants masks."""

    @functools.wraps(original)
    def add_request(self: Any, req_idx: int, prompt_len: int, sampling_params: Any) -> None:
        original(self, req_idx, prompt_len, sampling_params)
        capture = getattr(self, _CAPTURE_ATTR, None)
        if capture is not None:
            capture.wants_masks[req_idx] = request_wants_masks(sampling_params)

    return add_request


def wrap_sample(original: Any) -> Any:
    """``Sampler.sample``: sample with the candidate sampler where it applies, else with vLLM's
    path, compacting the processed logits it returns (rows that want masks)."""

    @functools.wraps(original)
    def sample(
        self: Any,
        logits: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        idx_mapping_np: np.ndarray,
        pos: torch.Tensor,
        input_ids: torch.Tensor,
        expanded_local_pos: torch.Tensor,
        return_logprobs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        args = (logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids, expanded_local_pos)
        capture = getattr(self, _CAPTURE_ATTR, None)
        if capture is None:
            return original(self, *args, return_logprobs=return_logprobs)
        row_wants = capture.wants_masks[idx_mapping_np]
        top_k_np = self.sampling_states.top_k.np[idx_mapping_np]
        max_top_k = int(top_k_np.max())
        if max_top_k <= min(MAX_CANDIDATES, capture.max_width):
            return sample_with_candidates(self, capture, args, max_top_k, return_logprobs,
                                          row_wants)
        any_wants = bool(row_wants.any())
        self.use_flashinfer = capture.use_flashinfer and not any_wants
        sampled, processed_logits = original(self, *args, return_logprobs=return_logprobs)
        if not any_wants:
            setattr(self, _PENDING_ATTR, NO_MASKS_WANTED)
        else:
            setattr(self, _PENDING_ATTR, capture.compact(
                processed_logits, top_k_np, None if row_wants.all() else row_wants))
        return sampled, processed_logits

    return sample


def sample_with_candidates(
    sampler: Any, capture: SamplingMaskCapture, args: tuple[Any, ...], max_top_k: int,
    return_logprobs: bool, row_wants: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Sampler.sample`` of a step whose top_k are all <= ``MAX_CANDIDATES``: vLLM's
    transforms up to min-p, then the candidate sampler; leaves the step's masks pending.

    ``args``: ``Sampler.sample``'s ``(logits, expanded_idx_mapping, idx_mapping_np, pos,
    input_ids, expanded_local_pos)``; ``row_wants``: ``[R]`` bool, the rows that want masks
    (none: nothing is copied, as in a step vLLM samples). Returns ``(sampled [R] int64,
    processed logits)``. Where the candidate sampler computes the step's logprobs itself
    (``logprobs_from_candidates``) they wait for ``compute_topk_scores`` and the processed
    logits returned are the pre-top-k ones, which ``Sampler.__call__`` then does not read; where
    vLLM computes them, the processed logits are filtered (``-inf`` outside each row's kept ids).
    """
    logits = sampler.apply_sampling_params(*args, skip_top_k_top_p=True)
    states = sampler.sampling_states
    num_logprobs = (logprobs_from_candidates(sampler, args[2], logits.shape[1])
                    if return_logprobs else None)
    num_candidates = max(max_top_k, num_logprobs or 0)
    any_wants = row_wants.any()
    mapped_rows = capture.mapped_rows
    mapped = (mapped_rows.take(logits.shape[0], 1 + num_candidates)
              if any_wants and mapped_rows is not None else None)
    result = sample_from_candidates(
        logits, num_candidates, args[1], states.top_k.gpu, states.top_p.gpu,
        states.temperature.gpu, states.seeds.gpu, args[3],
        write_processed=return_logprobs and num_logprobs is None, num_logprobs=num_logprobs,
        packed=None if mapped is None else mapped.device_rows(logits.shape[0],
                                                              1 + num_candidates),
    )
    if not any_wants:
        setattr(sampler, _PENDING_ATTR, NO_MASKS_WANTED)
    else:
        support = CompactSupport(result.packed, None, logits.shape[1])
        setattr(sampler, _PENDING_ATTR, DeviceStepMasks(
            support, row_wants=None if row_wants.all() else row_wants, mapped=mapped))
    if num_logprobs is not None:
        global _candidate_logprobs
        _candidate_logprobs = CandidateLogprobs(result.sampled, LogprobsTensors(
            result.logprob_ids, result.logprobs, result.ranks))
    return result.sampled, result.processed if result.processed is not None else logits


def logprobs_from_candidates(sampler: Any, idx_mapping_np: np.ndarray,
                             vocab_size: int) -> int | None:
    """How many top logprobs the candidate sampler returns for a step that returns logprobs,
    or None where vLLM computes them from the filtered ``[R, V]`` processed logits: logprobs
    other than processed ones, the logprobs of given token ids (``logprob_token_ids``), or more
    top logprobs than the candidate sampler can take candidates."""
    if sampler.logprobs_mode != REQUIRED_LOGPROBS_MODE:
        return None
    if sampler.logprob_token_ids_state.max_num_token_ids(idx_mapping_np) > 0:
        return None
    num_logprobs = max(sampler.sampling_states.max_num_logprobs(idx_mapping_np), 0)
    return num_logprobs if num_logprobs <= min(MAX_CANDIDATES, vocab_size) else None


@dataclass
class CandidateLogprobs:
    """The logprobs the candidate sampler computed for the step whose sampled tokens are
    ``sampled`` (``[R]`` int64), as ``compute_topk_scores`` returns them."""

    sampled: torch.Tensor
    logprobs: LogprobsTensors


# Set by ``sample_with_candidates``; taken by ``compute_topk_scores``, which
# ``Sampler.__call__`` calls next by its module name with the same sampled tensor (and cleared
# after every ``Sampler.__call__``).
_candidate_logprobs: CandidateLogprobs | None = None


def wrap_compute_topk_scores(original: Any) -> Any:
    """``compute_topk_scores`` as MRV2's ``Sampler.__call__`` calls it: the logprobs the
    candidate sampler already computed for this step, instead of a pass over ``[R, V]``."""

    @functools.wraps(original)
    def compute_topk_scores(logits: torch.Tensor, num_logprobs: int,
                            sampled_token_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        global _candidate_logprobs
        ready = _candidate_logprobs
        if ready is None or ready.sampled is not sampled_token_ids:
            return original(logits, num_logprobs, sampled_token_ids, *args, **kwargs)
        _candidate_logprobs = None
        if ready.logprobs.logprobs.shape[1] != 1 + num_logprobs:
            raise RuntimeError(
                f"sampling masks: the candidate sampler computed "
                f"{ready.logprobs.logprobs.shape[1] - 1} top logprobs for a step that returns "
                f"{num_logprobs}. This is a bug in vllm-sampling-mask; please report it.")
        cu_num_logits = args[0] if args else kwargs.get("cu_num_logits")
        return ready.logprobs._replace(cu_num_generated_tokens=cu_num_logits)

    return compute_topk_scores


def wrap_call(original: Any) -> Any:
    """``Sampler.__call__``: hand the step's masks to ``SamplerOutput.sampling_mask``."""

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _candidate_logprobs
        try:
            output = original(self, *args, **kwargs)
        finally:
            _candidate_logprobs = None
        pending = take_attribute(self, _PENDING_ATTR)
        if pending is not None:
            output.sampling_mask = pending
        return output

    return __call__


@dataclass
class SpeculativeRows:
    """What the compaction of one speculative step's positions needs, and its result.

    top_k_np, row_wants: ``[num_positions]``, each position's request's top_k and whether it
    wants masks (None: all).
    """

    capture: SamplingMaskCapture
    top_k_np: np.ndarray
    row_wants: np.ndarray | None
    pending: DeviceStepMasks | None = None


# The speculative step being rejection-sampled in this process (set by
# ``RejectionSampler.__call__`` around it): ``rejection_sample`` is a module function with no
# sampler to ask.
_speculative_rows: SpeculativeRows | None = None


def wrap_rejection_sampler_call(original: Any) -> Any:
    """``RejectionSampler.__call__`` (MRV2): ``SamplerOutput.sampling_mask`` of a step with draft
    tokens, one row per position, grouped by request."""

    @functools.wraps(original)
    def __call__(self: Any, logits: torch.Tensor, input_batch: Any,
                 draft_logits: torch.Tensor | None = None) -> Any:
        capture = getattr(self.sampler, _CAPTURE_ATTR, None)
        if capture is None:
            return original(self, logits, input_batch, draft_logits)
        idx_mapping_np = input_batch.idx_mapping_np
        wants = capture.wants_masks[idx_mapping_np]
        if not wants.any():
            output = original(self, logits, input_batch, draft_logits)
            output.sampling_mask = NO_MASKS_WANTED
            return output
        cu_positions = np.array(input_batch.cu_num_logits_np, dtype=np.int64)
        per_request = np.diff(cu_positions)
        top_k_np = np.repeat(self.sampler.sampling_states.top_k.np[idx_mapping_np], per_request)
        global _speculative_rows
        rows = _speculative_rows = SpeculativeRows(
            capture, top_k_np, None if wants.all() else np.repeat(wants, per_request))
        try:
            output = original(self, logits, input_batch, draft_logits)
        finally:
            _speculative_rows = None
        if rows.pending is None:
            raise RuntimeError(
                "sampling masks: Model Runner V2's rejection sampler did not call "
                "rejection_sample for a step with draft tokens. This is a bug in "
                "vllm-sampling-mask; please report it."
            )
        output.sampling_mask = GroupedStepMasks(rows.pending, cu_positions)
        return output

    return __call__


def wrap_rejection_sample(original: Any) -> Any:
    """``rejection_sample`` as Model Runner V2's rejection sampler calls it: compact the target
    logits of every position first (after logit bias, penalties, bad words, temperature, min-p
    and top-k/top-p: ``Sampler.apply_sampling_params``), the distributions the step's tokens
    come from."""

    @functools.wraps(original)
    def rejection_sample(processed_logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rows = _speculative_rows
        if rows is not None and rows.pending is None:
            rows.pending = rows.capture.compact(processed_logits, rows.top_k_np, rows.row_wants)
        return original(processed_logits, *args, **kwargs)

    return rejection_sample
