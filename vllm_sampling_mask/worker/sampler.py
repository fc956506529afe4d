"""Capture in the MRV2 sampler (extends ``vllm/v1/worker/gpu/sample/sampler.py``).

``Sampler.sample`` returns the processed logits after every transform vLLM applies (logit bias,
penalties, bad words, temperature, min-p, top-k/top-p; grammar masks come earlier), so that is
where we compact. The FlashInfer sampler never materialises the filtered logits (its
"processed" logits are the pre-top-k ones), so a step that captures masks never uses it. The
sampler remembers which of its requests opted out (``extra_args["return_sampling_mask"] = False``):
their rows go through the step's kernel call and copy with the others but do not set the copy
width and are never unpacked, and a step with none that wants masks runs vLLM's sampler as it
is (FlashInfer included) with no capture.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from vllm_sampling_mask.config import SamplingMaskConfig, request_wants_masks
from vllm_sampling_mask.worker.step_masks import NO_MASKS_WANTED, DeviceStepMasks, compact_step

_CAPTURE_ATTR = "sampling_mask_capture"
_PENDING_ATTR = "_sampling_mask_pending"


class SamplingMaskCapture:
    """Per-sampler capture settings and state; ``compact`` launches the kernel (no host sync).

    wants_masks: ``[max_num_reqs]`` bool, by vLLM's request slot: whether that request wants
    masks (set at ``Sampler.add_request``).
    use_flashinfer: what vLLM chose for this sampler; used by steps that capture nothing.
    """

    def __init__(self, max_width: int, vocab_size: int, max_num_reqs: int = 0,
                 use_flashinfer: bool = False):
        self.max_width = max_width
        self.vocab_size = vocab_size
        self.wants_masks = np.ones(max_num_reqs, dtype=bool)
        self.use_flashinfer = use_flashinfer

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
    sampler.__dict__[_CAPTURE_ATTR] = SamplingMaskCapture(
        config.max_width, states.vocab_size, states.max_num_reqs, sampler.use_flashinfer
    )
    sampler.use_flashinfer = False


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
        capture = self.__dict__.get(_CAPTURE_ATTR)
        if capture is not None:
            capture.wants_masks[req_idx] = request_wants_masks(sampling_params)

    return add_request


def wrap_sample(original: Any) -> Any:
    """``Sampler.sample``: compact the processed logits it returns (rows that want masks)."""

    @functools.wraps(original)
    def sample(
        self: Any,
        logits: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        idx_mapping_np: np.ndarray,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        capture = self.__dict__.get(_CAPTURE_ATTR)
        if capture is None:
            return original(self, logits, expanded_idx_mapping, idx_mapping_np, *args, **kwargs)
        row_wants = capture.wants_masks[idx_mapping_np]
        any_wants = bool(row_wants.any())
        self.use_flashinfer = capture.use_flashinfer and not any_wants
        sampled, processed_logits = original(
            self, logits, expanded_idx_mapping, idx_mapping_np, *args, **kwargs
        )
        if not any_wants:
            self.__dict__[_PENDING_ATTR] = NO_MASKS_WANTED
        else:
            top_k_np = self.sampling_states.top_k.np[idx_mapping_np]
            self.__dict__[_PENDING_ATTR] = capture.compact(
                processed_logits, top_k_np, None if row_wants.all() else row_wants)
        return sampled, processed_logits

    return sample


def wrap_call(original: Any) -> Any:
    """``Sampler.__call__``: hand the step's masks to ``SamplerOutput.sampling_mask``."""

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        pending = self.__dict__.pop(_PENDING_ATTR, None)
        if pending is not None:
            output.sampling_mask = pending
        return output

    return __call__
