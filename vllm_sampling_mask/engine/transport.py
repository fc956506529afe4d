"""Masks across the engine-core -> frontend msgspec boundary (extends ``vllm/v1/engine/__init__.py``).

``EngineCoreOutput`` is an ``array_like`` msgspec Struct with fixed fields. A subclass with one
trailing optional field encodes as one extra array element. msgspec encodes that element even when
it is ``None`` (``omit_defaults`` does not apply to ``array_like`` structs), so the scheduler builds
the subclass only inside the ``update_from_output`` of an engine whose switch is on; every other
output is vLLM's own class and vLLM's own bytes. A decoder typed with the base class silently
drops the extra element, so the client's decoder is typed with ``EngineCoreOutputsWithMasks``
(which decodes vLLM's shorter arrays too) and checked at start-up.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

from vllm_sampling_mask.config import SamplingMaskConfig
from vllm_sampling_mask.outputs import SamplingMask


class SamplingMaskRows(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """The mask rows of one request's new tokens in one step.

    row_lengths: ``[num_new_tokens]`` kept-id counts.
    token_ids:   the rows concatenated, little-endian int32 bytes.
    """

    row_lengths: list[int]
    token_ids: bytes

    def to_lists(self) -> list[list[int]]:
        """The rows as ``list[list[int]]`` (one per token)."""
        return decode_rows([self])


def decode_rows(chunks: list[SamplingMaskRows]) -> list[list[int]]:
    """All rows of several chunks, in order (decoded by ``SamplingMask``, one ``tolist``)."""
    return SamplingMask.concat(
        [SamplingMask.from_wire(chunk.row_lengths, chunk.token_ids) for chunk in chunks]
    ).token_ids


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


_building_with_masks = False


@contextlib.contextmanager
def outputs_carry_masks() -> Iterator[None]:
    """Within this block the scheduler builds ``EngineCoreOutputWithMask`` (engine core thread)."""
    global _building_with_masks
    _building_with_masks = True
    try:
        yield
    finally:
        _building_with_masks = False


def replace_engine_core_output(original: type) -> Callable[..., Any]:
    """Scheduler binding of ``EngineCoreOutput``: our subclass inside ``outputs_carry_masks``,
    vLLM's class (and so vLLM's exact wire bytes) everywhere else."""
    assert original is EngineCoreOutput

    def engine_core_output(*args: Any, **kwargs: Any) -> EngineCoreOutput:
        cls = EngineCoreOutputWithMask if _building_with_masks else original
        return cls(*args, **kwargs)

    return engine_core_output


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
