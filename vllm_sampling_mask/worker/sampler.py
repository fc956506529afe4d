"""Capture in the MRV2 sampler (extends ``vllm/v1/worker/gpu/sample/sampler.py``).

``Sampler.sample`` returns the processed logits after every transform vLLM applies (logit bias,
penalties, bad words, temperature, min-p, top-k/top-p; grammar masks come earlier), so that is
where we compact. The FlashInfer sampler never materialises the filtered logits (its
"processed" logits are the pre-top-k ones), so a sampler that captures masks never uses it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from vllm_sampling_mask.config import SamplingMaskConfig
from vllm_sampling_mask.worker.compaction import compact_support
from vllm_sampling_mask.worker.step_masks import DeviceStepMasks

_CAPTURE_ATTR = "sampling_mask_capture"
_PENDING_ATTR = "_sampling_mask_pending"


class SamplingMaskCapture:
    """Per-sampler capture settings; ``compact`` launches the kernel (no host sync)."""

    def __init__(self, max_width: int, vocab_size: int):
        self.max_width = max_width
        self.vocab_size = vocab_size

    def compact(self, processed_logits: torch.Tensor, top_k_np: np.ndarray) -> DeviceStepMasks:
        """``processed_logits`` ``[R, V]``; ``top_k_np`` ``[R]`` host-side per-request top_k."""
        # vLLM stores "no top_k" as the vocabulary size, so the batch's largest top_k bounds
        # every row except for ties at the top-k boundary. Those are common (bf16 logits; an
        # H200 engine at batch 256 had a row over top_k in 126 of 131 steps), and a row over
        # the width is read from the bitmap, so the width leaves room for them.
        max_top_k = int(top_k_np.max()) if top_k_np.size else 1
        width = max(1, min(max_top_k + tie_slack(max_top_k), processed_logits.shape[1],
                           self.max_width))
        support = compact_support(processed_logits, width)
        return DeviceStepMasks(support, overflow_expected=max_top_k > width)


def tie_slack(top_k: int) -> int:
    """Extra width beyond ``top_k`` for ids tied with the k-th logit."""
    return max(32, top_k // 4)


def attach_capture(sampler: Any, vllm_config: Any) -> None:
    """Make ``sampler`` capture masks if the engine's switch is on (called after load_model)."""
    config = SamplingMaskConfig.of(vllm_config)
    if not config.enabled or sampler is None:
        return
    sampler.use_flashinfer = False
    sampler.__dict__[_CAPTURE_ATTR] = SamplingMaskCapture(
        config.max_width, sampler.sampling_states.vocab_size
    )


def wrap_load_model(original: Any) -> Any:
    """``GPUModelRunner.load_model`` (MRV2), then attach the capture to its sampler."""

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        attach_capture(getattr(self, "sampler", None), self.vllm_config)
        return result

    return load_model


def wrap_sample(original: Any) -> Any:
    """``Sampler.sample``: compact the processed logits it returns."""

    @functools.wraps(original)
    def sample(
        self: Any,
        logits: torch.Tensor,
        expanded_idx_mapping: torch.Tensor,
        idx_mapping_np: np.ndarray,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sampled, processed_logits = original(
            self, logits, expanded_idx_mapping, idx_mapping_np, *args, **kwargs
        )
        capture = self.__dict__.get(_CAPTURE_ATTR)
        if capture is not None:
            top_k_np = self.sampling_states.top_k.np[idx_mapping_np]
            self.__dict__[_PENDING_ATTR] = capture.compact(processed_logits, top_k_np)
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
