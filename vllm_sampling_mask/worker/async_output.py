"""Device->host copy of masks with the sampled tokens (extends ``vllm/v1/worker/gpu/async_utils.py``).

Our copy is issued on the main stream, where the sampler wrote the masks, just before
``AsyncOutput.__init__``: vLLM's copy stream waits for the main stream before its own copies
and records the copy event after them, so that one event covers ours too: no extra sync, no
stream switch, and ``get_output`` (which waits on the event) finds it complete. The device
tensors stay referenced through ``sampler_output`` (held by the ``AsyncOutput``) until then.
Rows the candidate kernel wrote into mapped host memory (``MappedRows``) need no copy: the same
event fires after that kernel, which ran on the main stream before.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_sampling_mask.patching import take_attribute
from vllm_sampling_mask.worker.step_masks import NO_MASKS_WANTED, HostStepMasks, NoStepMasks

_HOST_ATTR = "_sampling_mask_host"


def wrap_init(original: Any) -> Any:
    """``AsyncOutput.__init__`` plus the async copy of ``sampler_output.sampling_mask``."""

    @functools.wraps(original)
    def __init__(
        self: Any,
        model_runner_output: Any,
        sampler_output: Any,
        num_sampled_tokens: Any,
        main_stream: Any,
        copy_stream: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        device_masks = getattr(sampler_output, "sampling_mask", None)
        if device_masks is NO_MASKS_WANTED:
            setattr(self, _HOST_ATTR, NO_MASKS_WANTED)  # nothing to copy
        elif device_masks is not None:
            # The current stream is ``main_stream``, as vLLM's own __init__ assumes too (it sets
            # the current stream back to ``main_stream`` after its copies).
            setattr(self, _HOST_ATTR, device_masks.copy_to_host_nonblocking())
        original(
            self, model_runner_output, sampler_output, num_sampled_tokens, main_stream,
            copy_stream, *args, **kwargs,
        )

    return __init__


def wrap_get_output(original: Any) -> Any:
    """``AsyncOutput.get_output`` plus ``ModelRunnerOutput.sampling_masks`` (one bytes row per
    request)."""

    @functools.wraps(original)
    def get_output(self: Any) -> Any:
        output = original(self)  # waits on the copy event
        host: HostStepMasks | NoStepMasks | None = take_attribute(self, _HOST_ATTR)
        if host is not None:
            output.sampling_masks = host.unpack(self.num_sampled_tokens_np)
        return output

    return get_output
