"""Masks across the engine-core -> frontend msgspec boundary (extends ``vllm/v1/engine/__init__.py``).

``EngineCoreOutput`` is an ``array_like`` msgspec Struct with fixed fields. A subclass with one
trailing optional field encodes as one extra array element (none at all when it is ``None``,
thanks to ``omit_defaults``: with masks off the wire bytes are vLLM's), but a decoder typed with
the base class silently drops that element, so the client's decoder is typed with
``EngineCoreOutputsWithMasks`` and checked at start-up.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import numpy as np

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

from vllm_sampling_mask.config import SamplingMaskConfig
from vllm_sampling_mask.worker.step_masks import StepSamplingMasks


class SamplingMaskRows(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """The mask rows of one request's new tokens in one step.

    row_lengths: ``[num_new_tokens]`` kept-id counts.
    token_ids:   the rows concatenated, little-endian int32 bytes.
    """

    row_lengths: list[int]
    token_ids: bytes

    @classmethod
    def from_step(cls, step: StepSamplingMasks, row_index: int) -> SamplingMaskRows:
        row = step.row(row_index)
        return cls([int(row.size)], row.astype("<i4", copy=False).tobytes())

    def to_lists(self) -> list[list[int]]:
        ids = np.frombuffer(self.token_ids, dtype="<i4")
        if len(self.row_lengths) == 1:
            return [ids.tolist()]
        return [r.tolist() for r in np.split(ids, np.cumsum(self.row_lengths)[:-1])]


class EngineCoreOutputWithMask(
    EngineCoreOutput, array_like=True, omit_defaults=True, gc=False  # type: ignore[call-arg]
):
    """``EngineCoreOutput`` plus the mask rows of its ``new_token_ids``."""

    sampling_mask: SamplingMaskRows | None = None


class EngineCoreOutputsWithMasks(
    EngineCoreOutputs, array_like=True, omit_defaults=True, gc=False  # type: ignore[call-arg]
):
    """``EngineCoreOutputs`` whose decoder keeps ``EngineCoreOutputWithMask.sampling_mask``."""

    outputs: list[EngineCoreOutputWithMask] = []  # type: ignore[assignment]


def replace_engine_core_output(original: type) -> type:
    """Scheduler binding of ``EngineCoreOutput`` -> our subclass (every output can carry rows)."""
    assert original is EngineCoreOutput
    return EngineCoreOutputWithMask


def replace_engine_core_outputs(original: type) -> type:
    """Core-client binding of ``EngineCoreOutputs`` -> our subclass (its decoder's type)."""
    assert original is EngineCoreOutputs
    return EngineCoreOutputsWithMasks


def check_client_decoder() -> None:
    """Raise ``RuntimeError`` if the frontend's decoder would drop masks (run at engine start)."""
    from vllm.v1.engine import core_client
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    probe = EngineCoreOutputs(
        outputs=[EngineCoreOutputWithMask("probe", [7], sampling_mask=SamplingMaskRows([1], b"\7\0\0\0"))]
    )
    decoded = MsgpackDecoder(core_client.EngineCoreOutputs).decode(MsgpackEncoder().encode(probe))
    if getattr(decoded.outputs[0], "sampling_mask", None) != probe.outputs[0].sampling_mask:
        raise RuntimeError(
            "--return-sampling-mask: the engine-core client's decoder would drop sampling masks "
            f"(it decodes {core_client.EngineCoreOutputs.__qualname__}); another plugin or vLLM "
            "version replaced vllm.v1.engine.core_client.EngineCoreOutputs."
        )


def wrap_engine_init(original: Any) -> Any:
    """``LLMEngine.__init__`` / ``AsyncLLM.__init__``: check the transport, tag the output processor."""

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        enabled = SamplingMaskConfig.of(vllm_config).enabled
        if enabled:
            check_client_decoder()
        original(self, vllm_config, *args, **kwargs)
        self.output_processor.__dict__["sampling_mask_enabled"] = enabled

    return __init__
