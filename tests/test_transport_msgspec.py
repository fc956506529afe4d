"""Masks across the engine-core -> frontend msgspec boundary (``engine/transport.py``).

Everything goes through vLLM's own ``MsgpackEncoder`` / ``MsgpackDecoder``
(``vllm.v1.serial_utils``), as the engine-core process and the core client use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pytest

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason, core_client
from vllm.v1.outputs import LogprobsLists
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_builders import engine_core_output, mask_row
from vllm_sampling_mask.engine.transport import (
    EngineCoreOutputsWithMasks,
    EngineCoreOutputWithMask,
    check_client_decoder,
    outputs_carry_masks,
    rows_mask,
)
from vllm_sampling_mask.patching import original_of

TIMESTAMP = 123.25  # EngineCoreOutputs stamps time.monotonic() unless given one
INT32_MAX = 2**31 - 1

MASKS: dict[str, list[int] | None] = {  # one row per output: one new token per step
    "no_mask": None,
    "empty_row": [],
    "one_id": [7],
    "large_row": list(range(0, 3 * 65_536, 3)),  # 65,536 ids, 256 KiB on the wire
    "near_int32_max": [0, 1, INT32_MAX - 2, INT32_MAX - 1, INT32_MAX],
}


# --------------------------------------------------------------------------- builders


def outputs_with(masks: dict[str, list[int] | None]) -> EngineCoreOutputs:
    """One ``EngineCoreOutputWithMask`` per entry, as vLLM's scheduler builds the batch."""
    outputs = []
    for i, (request_id, row) in enumerate(masks.items()):
        finished = i % 2 == 1
        outputs.append(engine_core_output(
            request_id,
            [100 + i],
            row,
            finish_reason=FinishReason.STOP if finished else None,
            stop_reason=42 if finished else None,
        ))
    return EngineCoreOutputs(outputs=outputs, timestamp=TIMESTAMP)


def round_trip(obj: Any, decode_as: type) -> Any:
    """Encode like the engine core (out-of-band buffers included), decode as the client."""
    return MsgpackDecoder(decode_as).decode(MsgpackEncoder().encode(obj))


def encoded_bytes(obj: Any) -> list[bytes]:
    return [bytes(buf) for buf in MsgpackEncoder().encode(obj)]


def as_vllm_wire(output: EngineCoreOutput) -> list[bytes]:
    """``output``'s vLLM fields re-encoded as vLLM's own class (compares numpy fields exactly)."""
    fields = {name: getattr(output, name) for name in EngineCoreOutput.__struct_fields__}
    batch = EngineCoreOutputs(outputs=[EngineCoreOutput(**fields)], timestamp=TIMESTAMP)
    return encoded_bytes(batch)


def logprobs(num_tokens: int, width: int) -> LogprobsLists:
    """``[num_tokens, width]`` logprobs; arrays of 256 bytes or more travel out of band."""
    ids = np.arange(num_tokens * width, dtype=np.int32).reshape(num_tokens, width)
    return LogprobsLists(ids, -np.ones((num_tokens, width), dtype=np.float32),
                         np.zeros(num_tokens, dtype=np.int32))


# --------------------------------------------------------------------------- cases


def test_plugin_rebinds_scheduler_and_client_types() -> None:
    """In any process with the package installed, the scheduler's binding builds our output
    subclass in mask steps (a scoped patch: vLLM's class otherwise) and the client decodes our
    batch subclass."""
    from vllm.v1.core.sched import scheduler

    assert scheduler.EngineCoreOutput is EngineCoreOutput
    with outputs_carry_masks():
        assert scheduler.EngineCoreOutput is EngineCoreOutputWithMask
    assert original_of("vllm.v1.core.sched.scheduler:EngineCoreOutput") is EngineCoreOutput
    assert core_client.EngineCoreOutputs is EngineCoreOutputsWithMasks
    assert original_of("vllm.v1.engine.core_client:EngineCoreOutputs") is EngineCoreOutputs
    # The batch subclass only retypes ``outputs``: same fields in the same wire positions.
    assert [f.name for f in msgspec.structs.fields(EngineCoreOutputsWithMasks)] == [
        f.name for f in msgspec.structs.fields(EngineCoreOutputs)
    ]


def test_patched_client_decoder_keeps_every_mask_exactly() -> None:
    """Round trip with the client's binding: rows of 0, 1 and 65,536 ids and ids up to 2**31-1
    come back bit-exact; outputs without masks stay without."""
    sent = outputs_with(MASKS)
    received = round_trip(sent, core_client.EngineCoreOutputs)

    assert isinstance(received, EngineCoreOutputsWithMasks)
    assert [type(o) for o in received.outputs] == [EngineCoreOutputWithMask] * len(MASKS)
    assert received.outputs == sent.outputs  # every field, masks included
    for output, row in zip(received.outputs, MASKS.values()):
        if row is None:
            assert output.sampling_mask is None
        else:
            assert rows_mask([output.sampling_mask]).token_ids == [row]


def test_masks_survive_out_of_band_buffers() -> None:
    """A mask behind large logprobs (numpy arrays sent as separate zero-copy buffers) decodes
    exactly, and the logprobs still do too."""
    output = engine_core_output("r", [6], [1, 6, INT32_MAX])
    output.new_logprobs = logprobs(num_tokens=1, width=128)
    sent = EngineCoreOutputs(outputs=[output], timestamp=TIMESTAMP)
    assert len(MsgpackEncoder().encode(sent)) > 1  # really out of band

    received = round_trip(sent, core_client.EngineCoreOutputs).outputs[0]
    assert rows_mask([received.sampling_mask]).token_ids == [[1, 6, INT32_MAX]]
    np.testing.assert_array_equal(received.new_logprobs.logprob_token_ids,
                                  output.new_logprobs.logprob_token_ids)


def test_a_speculative_outputs_rows_travel_as_a_list() -> None:
    """Several new tokens (a speculative step): one row each, as a msgpack array of bin rows;
    a one-token output beside it keeps the single-row form."""
    several = engine_core_output("r", [6, 7, 8])
    several.sampling_mask = [mask_row([1, 6]), mask_row([7]), mask_row([2, 8, INT32_MAX])]
    single = engine_core_output("s", [9], [9, 10])
    received = round_trip(EngineCoreOutputs(outputs=[several, single]),
                          core_client.EngineCoreOutputs).outputs
    assert received == [several, single]
    assert rows_mask(received[0].sampling_mask).token_ids == [[1, 6], [7], [2, 8, INT32_MAX]]
    assert isinstance(received[1].sampling_mask, bytes)


def test_vllm_original_decoder_drops_masks() -> None:
    """Why the client binding is patched: decoded with vLLM's own ``EngineCoreOutputs`` the
    trailing mask element is silently ignored, everything else decodes as before."""
    original = original_of("vllm.v1.engine.core_client:EngineCoreOutputs")
    sent = outputs_with(MASKS)
    received = round_trip(sent, original)

    assert [type(o) for o in received.outputs] == [EngineCoreOutput] * len(MASKS)
    assert not any(hasattr(o, "sampling_mask") for o in received.outputs)
    for got, put in zip(received.outputs, sent.outputs):
        fields = msgspec.structs.asdict(put)
        fields.pop("sampling_mask")
        assert got == EngineCoreOutput(**fields)


WITHOUT_MASK_CASES = [
    {},
    {"finish_reason": FinishReason.LENGTH, "stop_reason": "</s>"},
    {"num_nans_in_logits": 3},  # last vLLM field set: every field is on the wire
    {"new_logprobs": logprobs(num_tokens=1, width=2), "kv_transfer_params": {"k": 1}},
]
WITHOUT_MASK_IDS = ["minimal", "finished", "all_fields", "logprobs"]


def ours_and_vllms(extra: dict[str, Any]) -> tuple[EngineCoreOutputs, EngineCoreOutputs]:
    """The same output as our subclass (mask None) and as vLLM's class."""
    ours = EngineCoreOutputWithMask("r", [1, 2], **extra)
    vllms = EngineCoreOutput("r", [1, 2], **extra)
    return (EngineCoreOutputs(outputs=[ours], timestamp=TIMESTAMP),
            EngineCoreOutputs(outputs=[vllms], timestamp=TIMESTAMP))


@pytest.mark.parametrize("extra", WITHOUT_MASK_CASES, ids=WITHOUT_MASK_IDS)
def test_outside_a_mask_step_the_scheduler_builds_vllms_class(extra: dict[str, Any]) -> None:
    """The scheduler's ``EngineCoreOutput`` binding is vLLM's own class (so vLLM's exact wire
    bytes, and no wrapper per output) unless a mask engine's ``update_from_output`` is running."""
    from vllm.v1.core.sched import scheduler as scheduler_module

    assert scheduler_module.EngineCoreOutput is EngineCoreOutput
    built = scheduler_module.EngineCoreOutput("r", [1, 2], **extra)
    assert type(built) is EngineCoreOutput
    _, vllms = ours_and_vllms(extra)
    assert encoded_bytes(EngineCoreOutputs(outputs=[built], timestamp=TIMESTAMP)) == encoded_bytes(vllms)
    with outputs_carry_masks():
        assert type(scheduler_module.EngineCoreOutput("r", [1], **extra)) is EngineCoreOutputWithMask
    assert scheduler_module.EngineCoreOutput is EngineCoreOutput


@pytest.mark.parametrize("extra", WITHOUT_MASK_CASES, ids=WITHOUT_MASK_IDS)
def test_subclass_without_mask_decodes_like_vllms(extra: dict[str, Any]) -> None:
    """msgspec encodes a ``None`` trailing field of an array_like struct (one nil; ``omit_defaults``
    does not apply): both decoders still read it as vLLM's output."""
    ours, vllms = ours_and_vllms(extra)
    ours_wire, vllms_wire = encoded_bytes(ours), encoded_bytes(vllms)
    assert ours_wire[1:] == vllms_wire[1:]  # out-of-band buffers identical
    ours_raw, vllms_raw = (msgspec.msgpack.decode(w[0]) for w in (ours_wire, vllms_wire))
    assert ours_raw[1][0] == vllms_raw[1][0] + [None]

    original = original_of("vllm.v1.engine.core_client:EngineCoreOutputs")
    by_vllm = MsgpackDecoder(original).decode(ours_wire).outputs[0]
    patched = MsgpackDecoder(core_client.EngineCoreOutputs).decode(ours_wire).outputs[0]
    assert patched.sampling_mask is None
    assert as_vllm_wire(by_vllm) == as_vllm_wire(patched) == vllms_wire


def test_with_mask_the_wire_adds_one_trailing_element() -> None:
    """With a mask, the output's array is vLLM's full field list plus one element: the row's
    int32 bytes."""
    output = engine_core_output("r", [1], [1, 4])
    raw = msgspec.msgpack.decode(encoded_bytes(EngineCoreOutputs(outputs=[output]))[0])
    (array,) = raw[1]  # EngineCoreOutputs field 1: outputs
    assert len(array) == len(msgspec.structs.fields(EngineCoreOutput)) + 1
    assert array[-1] == np.asarray([1, 4], dtype="<i4").tobytes() == mask_row([1, 4])


def test_check_client_decoder_passes_with_the_patch() -> None:
    """Start-up check: the installed client binding keeps masks."""
    check_client_decoder()


def test_check_client_decoder_fails_when_the_binding_is_reverted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Start-up check: a client decoding vLLM's class (another plugin, another vLLM) is refused
    with a RuntimeError naming the class, instead of masks going missing later."""
    monkeypatch.setattr(
        core_client, "EngineCoreOutputs",
        original_of("vllm.v1.engine.core_client:EngineCoreOutputs"),
    )
    with pytest.raises(RuntimeError, match=r"would drop sampling masks.*EngineCoreOutputs"):
        check_client_decoder()


@pytest.mark.parametrize("rows", [[[]], [[], []], [[1, 2], [], [3]], [[INT32_MAX]]],
                         ids=["one_empty", "two_empty", "mixed", "int32_max"])
def test_wire_rows_round_trip(rows: Sequence[Sequence[int]]) -> None:
    """``rows_mask`` of the rows' wire bytes gives the rows back, empty rows included."""
    assert rows_mask([mask_row(r) for r in rows]).token_ids == [list(r) for r in rows]
    assert rows_mask([mask_row(rows[0])]).token_ids == [list(rows[0])]


def test_zero_rows_decode_to_no_rows() -> None:
    assert rows_mask([]).token_ids == []
