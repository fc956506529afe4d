"""Masks across the engine-core -> frontend msgspec boundary (extends ``vllm/v1/engine/__init__.py``).

``EngineCoreOutput`` is an ``array_like`` msgspec Struct with fixed fields. A subclass with one
trailing optional field encodes as one extra array element. msgspec encodes that element even when
it is ``None`` (``omit_defaults`` does not apply to ``array_like`` structs), so the scheduler builds
the subclass only inside the ``update_from_output`` of an engine whose switch is on (a scoped patch
of its ``EngineCoreOutput`` binding); every other output is vLLM's own class, built by vLLM's own
binding, and vLLM's own bytes. A decoder typed with the base class silently
drops the extra element, so the client's decoder is typed with ``EngineCoreOutputsWithMasks``
(which decodes vLLM's shorter arrays too) and checked at start-up.
"""

from __future__ import annotations

import functools
import sys
from array import array
from contextlib import AbstractContextManager
from typing import Any

import msgspec
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

from vllm_sampling_mask import patching
from vllm_sampling_mask.config import SamplingMaskConfig
from vllm_sampling_mask.outputs import SamplingMask


def rows_mask(rows: list[bytes]) -> SamplingMask:
    """The ``SamplingMask`` of wire rows (one per token, in order), undecoded."""
    if len(rows) == 1:  # a streamed token: no join
        return SamplingMask.from_wire_row(rows[0])
    return SamplingMask.from_wire([len(row) >> 2 for row in rows], b"".join(rows))


class JoinedMaskRows(msgspec.Struct, gc=False):  # type: ignore[call-arg]
    """Several tokens' rows in two buffers: how the engine core sends a held request's rows
    (every ``HELD_STEPS`` steps and with its last output), so that the frontend's decoder makes
    two objects per request and message, not one per row, and keeps ``ids`` as the block it came
    in.

    lengths: ids per row, in token order, little-endian int32 (``4 * T`` bytes for ``T`` rows);
    ids: the rows' kept ids, each row ascending, concatenated, little-endian int32
    (``4 * sum(lengths)`` bytes). In the engine core both are the ``bytearray``s the scheduler
    wrote the rows into (``core.scheduler.HeldRows``, ``ids`` cut to them); msgpack writes them
    as ``bin`` and the frontend decodes ``bytes``. Encoded as a map: the field's union already
    has its one array-like type (``list[bytes]``).
    """

    lengths: bytes
    ids: bytes

    def __len__(self) -> int:
        return len(self.lengths) >> 2

    def row_lengths(self) -> array:
        """``lengths`` as an ``array("i")`` (ids per row)."""
        lengths = array("i")
        lengths.frombytes(self.lengths)
        if sys.byteorder == "big":
            lengths.byteswap()
        return lengths


class EngineCoreOutputWithMask(
    EngineCoreOutput, array_like=True, omit_defaults=True, gc=False  # type: ignore[call-arg]
):
    """``EngineCoreOutput`` plus the mask rows of its new tokens.

    sampling_mask: a new token's kept ids, ascending, as little-endian int32 bytes (``4 * n``
    bytes for ``n`` ids); a list of such rows, one per token, when the output has several new
    tokens (a speculative-decoding step); a held request's rows so far, ``JoinedMaskRows``;
    ``None`` for outputs without a new token or of a request that opted out. msgpack tells the
    three apart by type (bin / array / map), so the every-step case of one token costs no more
    than a row.
    """

    sampling_mask: bytes | list[bytes] | JoinedMaskRows | None = None


class EngineCoreOutputsWithMasks(
    EngineCoreOutputs, array_like=True, omit_defaults=True, gc=False  # type: ignore[call-arg]
):
    """``EngineCoreOutputs`` whose decoder keeps ``EngineCoreOutputWithMask.sampling_mask``."""

    outputs: list[EngineCoreOutputWithMask] = []  # type: ignore[assignment]


MASK_BUG_HINT = "This is a bug in vllm-sampling-mask; please report it."


def fail_output(output: EngineCoreOutput) -> None:
    """Turn ``output`` into vLLM's per-request error, in place: it finishes its request with
    ``FinishReason.ERROR`` (HTTP 500 for that request only, ``finish_reason == "error"`` in
    ``LLM`` outputs) and carries no token, logprob or row, so what the request returned so far
    stays aligned. The caller ends the request where it lives (scheduler / output processor)."""
    from vllm.v1.engine import FinishReason

    output.new_token_ids = []
    output.new_logprobs = None
    output.finish_reason = FinishReason.ERROR
    output.stop_reason = None
    if isinstance(output, EngineCoreOutputWithMask):
        output.sampling_mask = None


SCHEDULER_OUTPUT_BINDING = "vllm.v1.core.sched.scheduler:EngineCoreOutput"


def outputs_carry_masks() -> AbstractContextManager[None]:
    """Within this block the scheduler builds ``EngineCoreOutputWithMask`` (engine core thread)."""
    return patching.scoped_patch(SCHEDULER_OUTPUT_BINDING)


def replace_engine_core_output(original: type) -> type:
    """Scheduler binding of ``EngineCoreOutput`` inside ``outputs_carry_masks``: our subclass.
    Outside it the binding stays vLLM's class, so an engine with the switch off pays nothing."""
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
        outputs=[EngineCoreOutputWithMask("probe", [7], sampling_mask=b"\7\0\0\0")]
    )
    decoded = MsgpackDecoder(core_client.EngineCoreOutputs).decode(MsgpackEncoder().encode(probe))
    if getattr(decoded.outputs[0], "sampling_mask", None) != probe.outputs[0].sampling_mask:
        raise RuntimeError(
            "--return-sampling-mask: the engine-core client's decoder would drop sampling masks "
            f"(it decodes {core_client.EngineCoreOutputs.__qualname__}); another plugin or vLLM "
            "version replaced vllm.v1.engine.core_client.EngineCoreOutputs."
        )


def wrap_engine_init(original: Any) -> Any:
    """``LLMEngine.__init__`` / ``AsyncLLM.__init__``: the engine-start checks (again, for engines
    built from a ``VllmConfig`` without ``EngineArgs``), the transport check, and the output
    processor's switch."""
    from vllm_sampling_mask.engine.arg_utils import check_vllm_config
    from vllm_sampling_mask.engine.output_processor import enable_masks  # here: it imports us

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        enabled = SamplingMaskConfig.of(vllm_config).enabled
        if enabled:
            check_vllm_config(vllm_config)
            check_client_decoder()
        original(self, vllm_config, *args, **kwargs)
        enable_masks(self.output_processor, enabled)

    return __init__
