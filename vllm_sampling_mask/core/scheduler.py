"""Cut each step's mask rows per request (extends ``vllm/v1/core/sched/scheduler.py``).

``update_from_output`` trims every request's new tokens (EOS, stop tokens, max_tokens,
max_model_len) and drops stale async frames; it always keeps a *prefix* of the step's sampled
tokens. So the rows of an output are the first ``len(new_token_ids)`` rows of its request's batch
row: with one sampled token per request per step (speculative decoding is rejected at start),
one row or none. Partial prefill chunks produce no tokens and so no rows; requests that opted
out of masks have a ``None`` row and their outputs carry none.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_sampling_mask.config import SamplingMaskConfig
from vllm_sampling_mask.engine.transport import outputs_carry_masks


def wrap_init(original: Any) -> Any:
    """``Scheduler.__init__``: remember the switch."""

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, *args, **kwargs)
        self.__dict__["sampling_mask_enabled"] = SamplingMaskConfig.of(vllm_config).enabled

    return __init__


def wrap_update_from_output(original: Any) -> Any:
    """``Scheduler.update_from_output`` plus ``EngineCoreOutput.sampling_mask`` (the row's
    bytes) for every output with a new token."""

    @functools.wraps(original)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        if not self.__dict__.get("sampling_mask_enabled"):
            return original(self, scheduler_output, model_runner_output)
        with outputs_carry_masks():
            outputs = original(self, scheduler_output, model_runner_output)
        step = getattr(model_runner_output, "sampling_masks", None)
        index = model_runner_output.req_id_to_index
        row_bytes = None if step is None else step.rows
        for engine_core_outputs in outputs.values():
            for output in engine_core_outputs.outputs:
                num_new = len(output.new_token_ids)
                if num_new == 0:
                    continue
                if row_bytes is None or num_new != 1:
                    raise RuntimeError(
                        f"sampling masks lost for request {output.request_id}: the step produced "
                        f"{num_new} token(s) but {'no masks' if step is None else 'one row'}. "
                        "This is a bug in vllm-sampling-mask; please report it."
                    )
                output.sampling_mask = row_bytes[index[output.request_id]]  # None: opted out
        return outputs

    return update_from_output
