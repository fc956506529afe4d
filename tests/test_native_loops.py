"""The per-output loops in C against their Python references: the scheduler's row hand-out
(``core/_hand_out_native.c``) and the frontend's row intake (``engine/_take_rows_native.c``).

Random steps mix every kind of output each loop meets. The scheduler's: streamed, held,
opted-out, several tokens (speculative decoding's bug case), no token with and without a finish,
flush steps. The frontend's: every kind of row list (streamed, FINAL_ONLY every step and at its
compaction, CUMULATIVE, held), outputs with and without their row, several rows, finishes,
requests without a state or a row list. Both loops run on copies of the same step; every output,
row and row list must be the same. ``test_scheduler_slicing.py`` and
``test_output_processor_modes.py`` run the scheduler and vLLM's output processor with each loop.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm.v1.engine import EngineCoreOutputs, FinishReason

from vllm_sampling_mask.core import scheduler as scheduler_module
from vllm_sampling_mask.engine import output_processor as output_processor_module
from vllm_sampling_mask.engine.output_processor import COMPACT_ROWS, RequestMaskRows
from vllm_sampling_mask.engine.transport import EngineCoreOutputWithMask, JoinedMaskRows
from vllm_sampling_mask.worker.step_masks import StepSamplingMasks

native = scheduler_module._hand_out_rows_native
NativeHeldRows = scheduler_module._NativeHeldRows
needs_native = pytest.mark.skipif(native is None, reason="core/_hand_out_native.c is not built")
take_native = output_processor_module._take_rows_native
needs_take_native = pytest.mark.skipif(take_native is None,
                                       reason="engine/_take_rows_native.c is not built")


def test_the_c_loops_are_built_where_they_can_be() -> None:
    """setup.py's extensions are optional: only a machine without a compiler or Python's
    headers may lack them (CI has both, so a broken build fails here)."""
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not (os.path.exists(headers) and shutil.which(compiler)):
        pytest.skip("no C compiler or no Python headers here")
    assert native is not None and take_native is not None


# --------------------------------------------------------------------------- the scheduler's


def random_step(seed: int, held_rows_type: type, num_requests: int = 64):
    """One step: outputs (in an order other than the batch's), the step's rows, the batch
    index, the held table (``held_rows_type`` objects: each held request with some earlier rows
    and some room after them or none) and the flush flag."""
    rng = np.random.default_rng(seed)
    request_ids = [f"req-{seed}-{i}" for i in range(num_requests)]
    batch = rng.permutation(num_requests)
    index = {request_ids[i]: int(r) for i, r in enumerate(batch)}
    kinds = rng.choice(["streamed", "held", "opted_out", "several", "none", "none_finish",
                        "held_finish", "held_none_finish"], num_requests,
                       p=[0.3, 0.3, 0.1, 0.05, 0.05, 0.05, 0.1, 0.05])
    rows: list[bytes | None] = [None] * num_requests
    outputs, held = [], {}
    for i, kind in enumerate(kinds):
        rid = request_ids[i]
        if kind != "opted_out":
            width = int(rng.integers(0, 9))  # an empty row too: a token no id was kept for
            rows[index[rid]] = rng.integers(0, 1 << 31, width).astype("<i4").tobytes()
        num_new = {"several": 3, "none": 0, "none_finish": 0, "held_none_finish": 0}.get(kind, 1)
        finish = FinishReason.STOP if kind.endswith("finish") else None
        outputs.append(EngineCoreOutputWithMask(rid, list(range(num_new)), finish_reason=finish))
        if kind.startswith("held"):  # some rows held already, some room left after them or not
            held[rid] = held_rows_type(int(rng.integers(1, 4)))
            for _ in range(int(rng.integers(0, 3))):
                held[rid].hold(bytes([i]) * 4 * int(rng.integers(0, 3)))
    return outputs, StepSamplingMasks.from_rows(rows), index, held, bool(rng.integers(0, 4) == 0)


@needs_native
@pytest.mark.parametrize("reserve_rows", [1, 3, 64])
def test_held_rows_in_c_hold_and_take_what_the_python_ones_do(reserve_rows: int) -> None:
    """``HeldRows`` in C (the table's entries where the C loop is built) against its Python
    reference, over many rows and takes: empty rows, rows wider than the room made, a take of
    nothing, rows held again after a take, rows given as bytes or as a view of a step's bytes."""
    rng = np.random.default_rng(reserve_rows)
    both = (NativeHeldRows(reserve_rows), scheduler_module.HeldRows(reserve_rows))
    for t in range(300):
        if rng.integers(0, 20) == 0:
            taken = [rows.take() for rows in both]
            assert taken[0] == taken[1] and all(len(rows) == 0 for rows in both)
            assert taken[0] is None or all(type(b) is bytearray for b in taken[0])
            continue
        width = int(rng.choice([0, 1, 50, int(rng.integers(0, 400))]))
        row = rng.integers(0, 1 << 31, width).astype("<i4").tobytes()
        if t % 2:
            row = memoryview(b"\0" * 8 + row)[8:]
        for rows in both:
            rows.hold(row)
        assert len(both[0]) == len(both[1]) > 0
    assert both[0].take() == both[1].take() is not None


@pytest.mark.parametrize("held_rows_type", [
    pytest.param(lambda r: NativeHeldRows(r), marks=needs_native, id="c"),
    pytest.param(lambda r: scheduler_module.HeldRows(r), id="python")])
def test_held_rows_refuse_what_is_not_rows(held_rows_type) -> None:
    """A row must be whole int32 ids (4 bytes each); room for no rows is refused."""
    with pytest.raises(ValueError, match="reserve_rows must be at least 1"):
        held_rows_type(0)
    rows = held_rows_type(4)
    rows.hold(bytes(4))
    with pytest.raises(ValueError, match="a row of 6 bytes"):
        rows.hold(bytes(6))
    assert len(rows) == 1 and rows.take() == (bytearray(b"\1\0\0\0"), bytearray(4))


def rows_held(held: dict[str, Any]) -> dict[str, tuple[bytes, bytes]]:
    """The held table's rows, taken: each request's lengths and ids (cut to its rows)."""
    return {rid: tuple(map(bytes, rows.take() or ((), ()))) for rid, rows in held.items()}


def hand_out(loop_is_native: bool, seed: int, monkeypatch: pytest.MonkeyPatch):
    """One random step through the C loop (its held table of C ``HeldRows``) or the Python one
    (of Python ``HeldRows``)."""
    held_rows_type = NativeHeldRows if loop_is_native else scheduler_module.HeldRows
    outputs, step, index, held, flush = random_step(seed, held_rows_type)
    monkeypatch.setattr(scheduler_module, "_hand_out_rows_native", native if loop_is_native else None)
    several = scheduler_module._hand_out_rows({0: EngineCoreOutputs(outputs=outputs)}, step,
                                              index, held, flush)
    return ([(o.request_id, o.sampling_mask) for o in outputs],
            [o.request_id for o in several], rows_held(held), flush)


@needs_native
@pytest.mark.parametrize("seed", range(40))
def test_the_c_loop_hands_out_what_the_python_loop_does(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hand_out(True, seed, monkeypatch) == hand_out(False, seed, monkeypatch)


@needs_native
def test_the_random_steps_meet_every_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeds above reach each kind of output (so the comparison can fail on each)."""
    seen = set()
    for seed in range(40):
        rows, several, after, flush = hand_out(True, seed, monkeypatch)
        masks = dict(rows)
        seen |= {"flush"} if flush else set()
        seen |= {"held sent" if isinstance(m, JoinedMaskRows) else "streamed"
                 if isinstance(m, bytes) else "no row" for m in masks.values()}
        seen |= {"several"} if several else set()
        seen |= {"held kept"} if any(lengths for lengths, _ in after.values()) else set()
    assert seen == {"flush", "held sent", "streamed", "no row", "several", "held kept"}


@needs_native
@pytest.mark.parametrize("start, end", [(0, 10**6), (-4, 4), (8, 4)])
def test_a_row_outside_its_step_raises_instead_of_a_wrong_row(start: int, end: int) -> None:
    """Python's slicing would clip a bad row silently; the C loop refuses it (a bug's sign)."""
    output = EngineCoreOutputWithMask("a", [1])
    # a negative start is only "opted out" if not held
    held = {"a": NativeHeldRows(64)} if start < 0 else {}
    with pytest.raises(IndexError, match="outside the step"):
        native([output], {"a": 0}, held, [start], [end], bytes(16), False)
    assert output.sampling_mask is None and rows_held(held) == ({"a": (b"", b"")} if held else {})


@needs_native
def test_batch_rows_and_offsets_may_be_any_integers() -> None:
    """numpy integers read as Python's do (``__index__``), as the Python loop's indexing does."""
    output = EngineCoreOutputWithMask("a", [1])
    native([output], {"a": np.int64(1)}, {}, [np.int32(0), 4], [np.int64(4), 8], bytes(range(8)),
           False)
    assert output.sampling_mask == bytes(range(4, 8))
    with pytest.raises(TypeError):
        native([output], {"a": 0.0}, {}, [0], [4], bytes(4), False)


@needs_native
def test_a_batch_row_past_the_step_and_an_unknown_request_raise() -> None:
    with pytest.raises(IndexError, match="batch row 3 of a step with 1 rows"):
        native([EngineCoreOutputWithMask("a", [1])], {"a": 3}, {}, [0], [4], bytes(4), False)
    with pytest.raises(KeyError, match="b"):
        native([EngineCoreOutputWithMask("b", [1])], {"a": 0}, {}, [0], [4], bytes(4), False)


@needs_native
def test_held_rows_before_a_failing_output_are_written() -> None:
    """The C loop makes a held row's room during its pass and writes the bytes after it (all of
    a step's destinations prefetched at once); an output that fails the pass leaves the rows
    before it held, written, as their HeldRows say."""
    blob = bytes(range(16))
    held = {rid: NativeHeldRows(64) for rid in ("a", "b")}
    outputs = [EngineCoreOutputWithMask(rid, [1]) for rid in ("a", "b", "unknown")]
    with pytest.raises(KeyError, match="unknown"):
        native(outputs, {"a": 0, "b": 1}, held, [0, 4], [4, 12], blob, False)
    assert rows_held(held) == {"a": (bytes([1, 0, 0, 0]), blob[:4]),
                               "b": (bytes([2, 0, 0, 0]), blob[4:12])}


class RenamedOutput(EngineCoreOutputWithMask):
    """An output type whose attribute lookup is not its slots': read by attribute."""

    def __getattribute__(self, name: str):
        value = super().__getattribute__(name)
        return "b" if name == "request_id" else value


@needs_native
def test_outputs_of_other_types_are_read_by_attribute_and_unset_fields_raise() -> None:
    """The C loop reads msgspec's slots at their offsets, found per output type: outputs of
    other types between them (no slots, or their own attribute lookup) are read by attribute,
    and a slot left unset raises AttributeError as reading the attribute does."""
    blob = bytes(range(12))
    outputs = [EngineCoreOutputWithMask("a", [1]),
               SimpleNamespace(request_id="b", new_token_ids=[1], finish_reason=None,
                               sampling_mask=None),
               RenamedOutput("a", [1]),
               EngineCoreOutputWithMask("c", [1], finish_reason=FinishReason.STOP)]
    held = {"c": NativeHeldRows(64)}
    several, send = native(outputs, {"a": 0, "b": 1, "c": 2}, held, [0, 4, 8], [4, 8, 12], blob,
                           False)
    assert [o.sampling_mask for o in outputs[:3]] == [blob[:4], blob[4:8], blob[4:8]]
    assert several == [] and send == [outputs[3]]
    assert rows_held(held) == {"c": (b"\1\0\0\0", blob[8:])}
    for name in ("request_id", "new_token_ids"):
        output = EngineCoreOutputWithMask("a", [1])
        delattr(output, name)
        with pytest.raises(AttributeError, match=name):
            native([output], {"a": 0}, {}, [0], [4], blob, False)
    output = EngineCoreOutputWithMask("a", [1])
    del output.finish_reason  # read for a held output only
    with pytest.raises(AttributeError, match="finish_reason"):
        native([output], {"a": 0}, {"a": NativeHeldRows(64)}, [0], [4], blob, False)


@needs_native
def test_the_c_loop_takes_only_the_types_it_was_written_for() -> None:
    """Other row containers go to the Python loop (``_hand_out_rows`` checks first); called
    with them anyway, the C loop raises TypeError rather than reading them as something else."""
    output = EngineCoreOutputWithMask("a", [1])
    with pytest.raises(TypeError):
        native([output], {"a": 0}, {}, [0], [4], memoryview(bytes(4)), False)
    with pytest.raises(TypeError):
        native([output], {"a": 0}, {}, np.zeros(1, dtype=np.int64), [4], bytes(4), False)
    for rows in [[bytearray(), bytearray(), 0], scheduler_module.HeldRows(64), None]:
        with pytest.raises(TypeError, match="must be a HeldRows of _hand_out_native"):
            native([output], {"a": 0}, {"a": rows}, [0], [4], bytes(4), False)


@needs_native
def test_held_rows_fill_their_buffers_over_steps_as_in_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A held request's buffers fill over many steps (the C loop makes them room its own way,
    rows wider than it made room for included) and go out, cut to their rows, on flush steps;
    both loops send and keep the same rows, step after step."""
    rng = np.random.default_rng(0)
    request_ids = [f"req-{i}" for i in range(8)]
    runs = {}
    for loop in (native, None):
        monkeypatch.setattr(scheduler_module, "_hand_out_rows_native", loop)
        held = {rid: (NativeHeldRows if loop else scheduler_module.HeldRows)(64)
                for rid in request_ids}
        sent = []
        for t in range(150):
            rows = [rng.integers(0, 1 << 31, int(rng.integers(0, 300))).astype("<i4").tobytes()
                    for _ in request_ids]
            outputs = [EngineCoreOutputWithMask(rid, [t]) for rid in request_ids]
            scheduler_module._hand_out_rows(
                {0: EngineCoreOutputs(outputs=outputs)}, StepSamplingMasks.from_rows(rows),
                {rid: i for i, rid in enumerate(request_ids)}, held, t % 64 == 63)
            sent.append([o.sampling_mask for o in outputs])
        runs[loop is None] = (sent, rows_held(held))
        rng = np.random.default_rng(0)
    assert runs[True] == runs[False]
    sent, held = runs[True]
    assert sum(m is not None for step in sent for m in step) == 2 * len(request_ids)
    assert all(len(lengths) == 4 * (150 - 128) for lengths, _ in held.values())
    assert all(len(m.ids) == 4 * sum(m.row_lengths()) for step in sent for m in step if m)


# --------------------------------------------------------------------------- the frontend's


def random_frontend_step(seed: int):
    """A processor (its request states and remembered ids) and one step's outputs: 64 requests,
    or 2 (every odd seed, so that some steps have no output the Python loop gets)."""
    rng = np.random.default_rng(seed)
    num_requests = 2 if seed % 2 else 64
    states, outputs = {}, []
    for i in range(num_requests):
        rid = f"req-{seed}-{i}"
        kind = rng.choice(["streamed", "final_every_step", "final_compacts", "cumulative", "held",
                           "no_rows", "no_state"], p=[0.3, 0.15, 0.1, 0.15, 0.15, 0.05, 0.1])
        state = SimpleNamespace(request_id=rid, streaming_input=False,
                                detokenizer=SimpleNamespace(num_output_tokens=lambda: 0))
        if kind != "no_rows" and kind != "no_state":
            state.sampling_mask_rows = holder = RequestMaskRows(
                streaming=kind == "streamed", final_only=kind.startswith("final") or kind == "held",
                held=kind == "held")
            if kind == "final_compacts":  # one row short of its compaction
                holder.pending.extend([bytes([i]) * 4] * (COMPACT_ROWS - 1))
        if kind != "no_state":
            states[rid] = state
        row = rng.integers(0, 1 << 31, int(rng.integers(1, 6))).astype("<i4").tobytes()
        shape = rng.choice(["one", "one", "one", "none", "token_no_row", "row_no_token", "several",
                            "rows_list", "finish", "finish_no_row"])
        tokens, mask, finish = {
            "one": ([7], row, None), "none": ([], None, None), "token_no_row": ([7], None, None),
            "row_no_token": ([], row, None), "several": ([7, 8], [row, row[:4]], None),
            "rows_list": ([7], [row, row], None), "finish": ([7], row, FinishReason.STOP),
            "finish_no_row": ([7], None, FinishReason.STOP),
        }[str(shape)]
        outputs.append(EngineCoreOutputWithMask(rid, tokens, finish_reason=finish,
                                                sampling_mask=mask))
    # and a request that ended since the last pass: forgotten only by a pass that saw no output
    # of a request with rows every step
    remembered = set(states) | {f"gone-{seed}"}
    processor = SimpleNamespace(request_states=states, sampling_mask_requests=remembered,
                                sampling_mask_lockstep=set(remembered))
    return processor, outputs


def take(loop_is_native: bool, seed: int, monkeypatch: pytest.MonkeyPatch):
    processor, outputs = random_frontend_step(seed)
    monkeypatch.setattr(output_processor_module, "_take_rows_native",
                        take_native if loop_is_native else None)
    to_abort = output_processor_module._take_rows_every_step(
        processor, outputs, processor.sampling_mask_requests)
    holders = {rid: (h.lengths.tolist(), bytes(h.blob), h.pending, h.blocks, h.held)
               for rid, state in processor.request_states.items()
               if (h := getattr(state, "sampling_mask_rows", None)) is not None}
    return (to_abort, holders, processor.sampling_mask_requests,
            [(o.new_token_ids, o.finish_reason, o.sampling_mask) for o in outputs])


@needs_take_native
@pytest.mark.parametrize("seed", range(40))
def test_the_frontends_c_loop_takes_what_the_python_loop_does(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert take(True, seed, monkeypatch) == take(False, seed, monkeypatch)


@needs_take_native
def test_the_random_frontend_steps_meet_every_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeds above fail requests, compact, and grow every kind of row list."""
    aborted = compacted = 0
    grown = set()
    for seed in range(40):
        to_abort, holders, _, _ = take(True, seed, monkeypatch)
        aborted += len(to_abort)
        for lengths, blob, pending, blocks, held in holders.values():
            compacted += bool(blocks)
            if blob or pending or blocks:
                grown.add("held" if held else "cumulative" if pending is None else "pending")
    assert aborted and compacted and grown == {"held", "cumulative", "pending"}


@needs_take_native
def test_a_step_of_only_held_or_unknown_requests_forgets_the_finished(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No output of a request with rows every step: the remembered ids of requests whose state
    is gone are dropped (the pass is skipped from then on), with either loop."""
    for loop_is_native in (True, False):
        monkeypatch.setattr(output_processor_module, "_take_rows_native",
                            take_native if loop_is_native else None)
        state = SimpleNamespace(sampling_mask_rows=RequestMaskRows(final_only=True, held=True))
        processor = SimpleNamespace(request_states={"held": state},
                                    sampling_mask_requests={"held", "gone"},
                                    sampling_mask_lockstep={"gone"})
        output_processor_module._take_rows_every_step(
            processor, [EngineCoreOutputWithMask("held", [7])], processor.sampling_mask_requests)
        assert processor.sampling_mask_requests == {"held"}
        assert processor.sampling_mask_lockstep == set()
