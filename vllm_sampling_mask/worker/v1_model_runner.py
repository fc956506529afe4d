"""Capture in vLLM 0.26's V1 model runner (extends ``vllm/v1/worker/gpu_model_runner.py`` and
``vllm/v1/sample/sampler.py``).

vLLM picks the V1 runner where Model Runner V2 can't run a config (hybrid models, custom logits
processors, prompt embeds, ...) or where ``VLLM_USE_V2_MODEL_RUNNER=0`` asks for it. Its
``Sampler.sample`` applies, after ``apply_logits_processors`` (allowed token ids, bad words, the
logits processors that can change the argmax: min_tokens, logit bias, custom ones; penalties),
temperature, the argmax-invariant processors (min-p, custom ones) and top-k/top-p, then draws
from the softmax of the result. In ``processed_logprobs`` mode, which a mask engine requires, it
returns the log-softmax of exactly those logits: finite on the kept set and nowhere else, so that
is where we compact. In that mode V1's ``TopKTopPSampler`` never takes its FlashInfer path
(FlashInfer can't return processed logprobs): the filtered logits always exist, and the sampler
runs as stock.

Per step (``GPUModelRunner.sample_tokens``) the runner hands its sampler the batch's host-side
top_k (``InputBatch.top_k_cpu``, for the copy width) and which rows want masks (a set of opted-out
request ids, usually empty: then nothing per row). After the step, the device->host copy runs on
V1's async output copy stream and is unpacked in ``AsyncGPUModelRunnerOutput.get_output`` (async
scheduling), or at once (sync scheduling: the step has already waited for the device). Rows
follow ``ModelRunnerOutput.req_ids``; partial prefill rows (``discard_request_mask``) yield ``b""``.

Speculative decoding (V1 runs ngram, EAGLE, MTP and draft models): the sampler's one call samples
the bonus positions, and ``rejection_sample`` gets the draft positions' target logits after
vLLM's transforms for them; both are compacted and unpacked into one group of rows per request
(``SpeculativeStepMasks``), of which the scheduler hands each output the prefix its accepted
tokens need.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_sampling_mask.config import SamplingMaskConfig, request_wants_masks
from vllm_sampling_mask.patching import take_attribute
from vllm_sampling_mask.worker.step_masks import (
    NO_MASKS_WANTED,
    DeviceStepMasks,
    HostSpeculativeStepMasks,
    HostStepMasks,
    NoStepMasks,
    SpeculativeStepMasks,
    compact_step,
)

_CAPTURE_ATTR = "sampling_mask_capture"
_HOST_ATTR = "_sampling_mask_host"


@dataclass
class StepInputs:
    """What the runner tells its sampler about one step's rows (host side, no device data).

    top_k_np: ``[R]`` int32, vLLM's top_k per row (the vocabulary size for "no top_k").
    row_wants: ``[R]`` bool, the rows whose requests want masks (None: all).
    num_draft: ``[R]`` int, each request's draft positions in a speculative-decoding step
        (None: not one).
    """

    top_k_np: np.ndarray
    row_wants: np.ndarray | None
    num_draft: np.ndarray | None = None

    def draft_rows(self) -> StepInputs:
        """The same inputs for the step's draft positions (request ``i``'s repeated
        ``num_draft[i]`` times)."""
        repeat = self.num_draft
        return StepInputs(np.repeat(self.top_k_np, repeat),
                          None if self.row_wants is None else np.repeat(self.row_wants, repeat))


class V1SamplingMaskCapture:
    """Capture state shared by one V1 runner and its sampler.

    opted_out: ids of the runner's requests that opted out of masks.
    step: set by ``sample_tokens`` for the one ``Sampler.sample`` call of a step; None otherwise
          (profiling and warm-up runs call the sampler too, and capture nothing).
    pending: the step's device masks, from ``Sampler.sample`` back to ``sample_tokens``.
    draft_step, pending_drafts: the same for the draft positions of a speculative-decoding step
          (``rejection_sample``).
    """

    def __init__(self, max_width: int):
        self.max_width = max_width
        self.opted_out: set[str] = set()
        self.step: StepInputs | None = None
        self.pending: DeviceStepMasks | None = None
        self.draft_step: StepInputs | None = None
        self.pending_drafts: DeviceStepMasks | None = None

    def compact(self, processed: torch.Tensor, step: StepInputs) -> DeviceStepMasks:
        """Launch the compaction of ``processed`` ``[rows, V]`` (finite = kept)."""
        return compact_step(processed, step.top_k_np, self.max_width, step.row_wants)

    def note_requests(self, scheduler_output: Any) -> None:
        """Track opt-outs from a ``SchedulerOutput`` (new requests and finished ids)."""
        self.opted_out.difference_update(scheduler_output.finished_req_ids)
        for new_request in scheduler_output.scheduled_new_reqs:
            params = new_request.sampling_params
            if params is None or request_wants_masks(params):
                self.opted_out.discard(new_request.req_id)
            else:
                self.opted_out.add(new_request.req_id)

    def row_wants(self, req_ids: list[str], num_rows: int) -> np.ndarray | None:
        """``[num_rows]`` bool for the first ``num_rows`` batch ``req_ids`` (None when no
        request opted out: O(1))."""
        opted_out = self.opted_out
        if not opted_out:
            return None
        return np.fromiter((r not in opted_out for r in req_ids[:num_rows]), dtype=bool,
                           count=num_rows)


@dataclass
class PendingHostMasks:
    """One step's masks between ``sample_tokens`` and ``get_output`` (async scheduling).

    copied: set after the copies on the async output copy stream (None: nothing was copied).
    num_sampled: ``[R]`` int32, 0 for rows whose token is discarded (partial prefill).
    """

    host: HostStepMasks | HostSpeculativeStepMasks | NoStepMasks
    copied: torch.cuda.Event | None
    num_sampled: np.ndarray

    def unpack(self) -> Any:
        """Wait for the copies, then one bytes row per request (a ``StepSamplingMasks``)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.unpack(self.num_sampled)


def wrap_init(original: Any) -> Any:
    """``GPUModelRunner.__init__`` (V1, also the base of the CPU runner), then share a capture
    between the runner and its sampler if the engine's switch is on."""

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, *args, **kwargs)
        config = SamplingMaskConfig.of(vllm_config)
        if config.enabled:
            capture = V1SamplingMaskCapture(config.max_width)
            setattr(self, _CAPTURE_ATTR, capture)
            setattr(self.sampler, _CAPTURE_ATTR, capture)

    return __init__


def wrap_update_states(original: Any) -> Any:
    """``GPUModelRunner._update_states``: note which new requests opted out."""

    @functools.wraps(original)
    def _update_states(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, scheduler_output, *args, **kwargs)
        capture = getattr(self, _CAPTURE_ATTR, None)
        if capture is not None:
            capture.note_requests(scheduler_output)
        return result

    return _update_states


def wrap_sampler_sample(original: Any) -> Any:
    """V1 ``Sampler.sample``: compact the processed logprobs of the step ``sample_tokens`` set."""

    @functools.wraps(original)
    def sample(self: Any, logits: torch.Tensor, sampling_metadata: Any, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        # V1's Sampler is an nn.Module: torch keeps its attributes in its dict anyway, and
        # getattr of one it lacks (every engine with the switch off) would go through
        # nn.Module.__getattr__, ~25x slower than this.
        capture = self.__dict__.get(_CAPTURE_ATTR)
        step = None if capture is None else capture.step
        if step is None:
            return original(self, logits, sampling_metadata, *args, **kwargs)
        capture.step = None  # one compaction per step
        sampled, processed_logprobs = original(self, logits, sampling_metadata, *args, **kwargs)
        if processed_logprobs is None:
            raise RuntimeError(
                "sampling masks: V1's sampler returned no processed logprobs for a step with "
                f"rows that want masks (logprobs_mode {self.logprobs_mode!r}). This is a bug in "
                "vllm-sampling-mask; please report it."
            )
        capture.pending = capture.compact(processed_logprobs, step)
        return sampled, processed_logprobs

    return sample


# The capture of the speculative-decoding step being sampled in this process (set by
# ``sample_tokens`` around it): ``rejection_sample`` is a module function with no runner to ask.
_drafting_capture: V1SamplingMaskCapture | None = None


def wrap_rejection_sample(original: Any) -> Any:
    """``rejection_sample`` (V1): compact the draft positions' target logits first, as
    ``RejectionSampler.forward`` hands them over: after the logits processors, temperature,
    top-k and top-p (``apply_sampling_constraints``; no min-p at draft positions in vLLM 0.26),
    the distribution each draft token is accepted against and a recovered token drawn from."""

    @functools.wraps(original)
    def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
                         max_spec_len: int, cu_num_draft_tokens: torch.Tensor,
                         draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                         *args: Any, **kwargs: Any) -> torch.Tensor:
        capture = _drafting_capture
        step = None if capture is None else capture.draft_step
        if step is not None:
            capture.draft_step = None
            capture.pending_drafts = capture.compact(target_logits, step)
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                        draft_probs, target_logits, *args, **kwargs)

    return rejection_sample


def wrap_sample_tokens(original: Any) -> Any:
    """``GPUModelRunner.sample_tokens`` (V1): set the step's rows for the sampler, then attach
    the step's masks to its output (``ModelRunnerOutput.sampling_masks``)."""

    @functools.wraps(original)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        capture = getattr(self, _CAPTURE_ATTR, None)
        if capture is None or self.execute_model_state is None:  # nothing is sampled
            return original(self, *args, **kwargs)
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_sampled = (~self.discard_request_mask.np[:num_reqs]).astype(np.int32)
        row_wants = capture.row_wants(batch.req_ids, num_reqs)
        if row_wants is not None and not row_wants.any():
            return _attach(self, original(self, *args, **kwargs), NO_MASKS_WANTED, num_sampled)
        spec = self.execute_model_state.spec_decode_metadata
        num_draft = None if spec is None else np.asarray(spec.num_draft_tokens, dtype=np.int64)
        step = capture.step = StepInputs(batch.top_k_cpu[:num_reqs], row_wants, num_draft)
        global _drafting_capture
        if num_draft is not None and num_draft.any():
            capture.draft_step, _drafting_capture = step.draft_rows(), capture
        try:
            output = original(self, *args, **kwargs)
            step_masks, drafts = capture.pending, capture.pending_drafts
        finally:
            capture.step = capture.pending = capture.draft_step = capture.pending_drafts = None
            _drafting_capture = None
        if step_masks is None or (drafts is None and num_draft is not None and num_draft.any()):
            raise RuntimeError(
                "sampling masks: V1's sampler did not run for a step with rows that want masks. "
                "This is a bug in vllm-sampling-mask; please report it."
            )
        if num_draft is not None:
            step_masks = SpeculativeStepMasks(step_masks, drafts, num_draft)
        return _attach(self, output, step_masks, num_sampled)

    return sample_tokens


def _attach(runner: Any, output: Any,
            step_masks: DeviceStepMasks | SpeculativeStepMasks | NoStepMasks,
            num_sampled: np.ndarray) -> Any:
    """Start the host copy of ``step_masks`` for ``output`` (an ``AsyncGPUModelRunnerOutput``),
    or copy and unpack it into ``output.sampling_masks`` now (a ``ModelRunnerOutput``)."""
    from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput

    if not isinstance(output, AsyncGPUModelRunnerOutput):
        # Sync scheduling: the step has already waited for the device (its sampled tokens are
        # on the host), so this copy waits for nothing but itself.
        host = step_masks.copy_to_host_nonblocking()
        if not isinstance(step_masks, NoStepMasks) and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        output.sampling_masks = host.unpack(num_sampled)
        return output
    copied = None
    host: HostStepMasks | HostSpeculativeStepMasks | NoStepMasks = NO_MASKS_WANTED
    if not isinstance(step_masks, NoStepMasks):
        # The same stream as vLLM's copies of this step (after them, so their event does not
        # cover ours: one more event). The device tensors stay referenced by ``host``.
        main_stream = torch.cuda.current_stream()
        copy_stream = runner._get_or_create_async_output_copy_stream()
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(main_stream)
            host = step_masks.copy_to_host_nonblocking()
            copied = torch.cuda.Event(blocking=True)
            copied.record()
    setattr(output, _HOST_ATTR, PendingHostMasks(host, copied, num_sampled))
    return output


def wrap_async_get_output(original: Any) -> Any:
    """``AsyncGPUModelRunnerOutput.get_output`` plus ``ModelRunnerOutput.sampling_masks``."""

    @functools.wraps(original)
    def get_output(self: Any) -> Any:
        output = original(self)
        pending: PendingHostMasks | None = take_attribute(self, _HOST_ATTR)
        if pending is not None:
            output.sampling_masks = pending.unpack()
        return output

    return get_output
