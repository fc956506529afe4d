"""Cut each step's mask rows per request (extends ``vllm/v1/core/sched/scheduler.py``).

``update_from_output`` trims every request's new tokens (EOS, stop tokens, max_tokens,
max_model_len) and drops stale async frames; it always keeps a *prefix* of the step's sampled
tokens. So the rows of an output are the first ``len(new_token_ids)`` rows of its request's rows in
the step: one row per request, except in a speculative-decoding step, where a request has a row
per position it sampled at (draft positions, then the bonus position) and its accepted tokens
take a prefix of them. Partial prefill chunks produce no tokens and so no rows; requests that
opted out of masks have a ``None`` row and their outputs carry none.

Rows of a request that ``config.rows_held_until_finish`` (FINAL_ONLY, no stop strings) are kept
here, in ``Scheduler.sampling_mask_held``, each request's written into one buffer of ids and one
of lengths (``HeldRows``, or its C twin), and sent together (``JoinedMaskRows``: those two
buffers) with its last output and every ``HELD_STEPS`` steps (so that no message carries a long
rollout's rows at once), so the frontend does nothing for them on most steps and takes each
message's rows as one block; an aborted request's are dropped at the next step
(``SchedulerOutput.finished_req_ids``).
"""

from __future__ import annotations

import functools
import logging
import struct
from typing import TYPE_CHECKING, Any

from vllm_sampling_mask.config import (
    SamplingMaskConfig,
    request_wants_masks,
    rows_held_until_finish,
)
from vllm_sampling_mask.engine.transport import (
    MASK_BUG_HINT,
    JoinedMaskRows,
    fail_output,
    outputs_carry_masks,
)

try:  # the same loop as _hand_out_rows_python in C: an optional extension (setup.py)
    from vllm_sampling_mask.core._hand_out_native import HeldRows as _NativeHeldRows
    from vllm_sampling_mask.core._hand_out_native import hand_out_rows as _hand_out_rows_native
except ImportError:  # installed without a C compiler
    _hand_out_rows_native = _NativeHeldRows = None

if TYPE_CHECKING:
    from vllm_sampling_mask.worker.step_masks import StepSamplingMasks

logger = logging.getLogger("vllm_sampling_mask")


_HELD_ATTR = "sampling_mask_held"
_ROW_LENGTH = struct.Struct("<i")
_STEPS_ATTR = "sampling_mask_steps"
HELD_STEPS = 64
"""Held rows go out every this many steps (<= 64 rows a request, ~13 KB at top_k 50; more under
speculative decoding), and with each request's last output. The frontend keeps (or encodes:
``RequestMaskRows.varint``) each message's rows as a block as they come, so that little is left
for a request's end, where requests of equal length all end in the same step."""


class HeldRows:
    """A held request's rows since its last send, ``JoinedMaskRows``'s two fields as they fill:
    each row's id count (little-endian int32) appended to ``lengths`` and its ids written at
    ``ids[fill:]``, in token order. ``ids`` has room for a period's rows (``reserve_rows`` rows
    like the one that finds it short, or twice what it needs) and is cut to ``fill`` when taken.
    One buffer each, not a bytes object per row: a held row costs one copy, and a send no join
    (the message is these buffers), where appending to a growing buffer would copy a request's
    rows again every few steps.

    The Python reference of the C loop's ``_hand_out_native.HeldRows`` (``new_held_rows``),
    which keeps the same rows behind one C object: the loop reads one object a held row."""

    __slots__ = ("lengths", "ids", "fill", "reserve_rows")

    def __init__(self, reserve_rows: int) -> None:
        if reserve_rows < 1:
            raise ValueError("reserve_rows must be at least 1")
        self.reserve_rows = reserve_rows
        self.lengths, self.ids, self.fill = bytearray(), bytearray(), 0

    def __len__(self) -> int:
        return len(self.lengths) >> 2

    def hold(self, row: bytes | memoryview) -> None:
        """Add ``row`` (int32 little-endian ids; a ``memoryview`` of the step's bytes)."""
        size = len(row)
        if size % 4 or (size >> 2) > 0x7FFFFFFF:
            raise ValueError(f"a row of {size} bytes: not a whole number of int32 ids, "
                             "or more than 2**31 - 1")
        fill, ids = self.fill, self.ids
        if fill + size > len(ids):  # written past its end, a bytearray grows a row at a time
            ids.extend(bytes(max(self.reserve_rows * size, 2 * (fill + size)) - len(ids)))
        self.lengths += _ROW_LENGTH.pack(size >> 2)
        ids[fill : fill + size] = row
        self.fill = fill + size

    def take(self) -> tuple[bytearray, bytearray] | None:
        """The rows held, ``(lengths, ids)`` cut to them, leaving none (``None``: none held)."""
        if not self.lengths:
            return None
        lengths, ids = self.lengths, self.ids
        del ids[self.fill :]
        self.lengths, self.ids, self.fill = bytearray(), bytearray(), 0
        return lengths, ids


def new_held_rows() -> HeldRows:
    """A held request's entry in the table: the C loop's ``HeldRows`` where that loop runs (the
    only kind it takes), else the Python one; both make room for ``HELD_STEPS`` rows at once."""
    return (HeldRows if _hand_out_rows_native is None else _NativeHeldRows)(HELD_STEPS)


def wrap_init(original: Any) -> Any:
    """``Scheduler.__init__``: remember the switch; a mask engine's scheduler gets the table of
    held rows (request id -> its rows so far)."""

    @functools.wraps(original)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, *args, **kwargs)
        enabled = SamplingMaskConfig.of(vllm_config).enabled
        self.sampling_mask_enabled = enabled
        if enabled:
            setattr(self, _HELD_ATTR, {})
            setattr(self, _STEPS_ATTR, 0)  # steps that handed out rows, for HELD_STEPS

    return __init__


def wrap_add_request(original: Any) -> Any:
    """``Scheduler.add_request``: on a mask engine, a request whose rows are held until its last
    output (``rows_held_until_finish``) gets its (empty) entry in the table."""

    @functools.wraps(original)
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        original(self, request, *args, **kwargs)
        held = getattr(self, _HELD_ATTR, None)
        params = request.sampling_params
        if (held is not None and params is not None and request_wants_masks(params)
                and rows_held_until_finish(params, request.resumable)):
            held.setdefault(request.request_id, new_held_rows())

    return add_request


def wrap_update_from_output(original: Any) -> Any:
    """``Scheduler.update_from_output`` plus ``EngineCoreOutput.sampling_mask`` (the row's
    bytes) for every output with a new token.

    A step whose rows can't be matched with its tokens (no rows, a row count other than the
    batch's, several tokens for one request) is a bug; it fails only the requests that got a
    token in it (``fail_output``: vLLM's per-request error, logged), never the engine. A step in
    which no request wants masks gets vLLM's own outputs, at stock's cost: none of its requests
    has a row list in the frontend.
    """
    from vllm.v1.request import RequestStatus

    @functools.wraps(original)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        if not getattr(self, "sampling_mask_enabled", False):
            return original(self, scheduler_output, model_runner_output)
        held = getattr(self, _HELD_ATTR)
        if held:
            for req_id in scheduler_output.finished_req_ids:  # aborted (or finished) since
                held.pop(req_id, None)
        step = getattr(model_runner_output, "sampling_masks", None)
        if step is not None and step.none_wanted:
            return original(self, scheduler_output, model_runner_output)
        with outputs_carry_masks():
            outputs = original(self, scheduler_output, model_runner_output)
        step_problem = _step_problem(step, len(model_runner_output.req_ids))
        if step_problem is None:
            steps = getattr(self, _STEPS_ATTR) + 1
            setattr(self, _STEPS_ATTR, steps)
            hand_out = _hand_out_rows if step.groups is None else _hand_out_row_groups
            failed = hand_out(outputs, step, model_runner_output.req_id_to_index, held,
                              steps % HELD_STEPS == 0)
        else:
            failed = [output for engine_core_outputs in outputs.values()
                      for output in engine_core_outputs.outputs if output.new_token_ids]
        for output in failed:
            problem = step_problem or (f"the step produced {len(output.new_token_ids)} tokens "
                                       "for it but fewer rows")
            logger.error("sampling masks lost for request %s: %s; the request is finished "
                         "with an error. %s", output.request_id, problem, MASK_BUG_HINT)
            self.finish_requests(output.request_id, RequestStatus.FINISHED_ERROR)
            fail_output(output)
            # A held request keeps the rows of its earlier tokens (this step's are dropped).
            output.sampling_mask = _joined(held.pop(output.request_id, None))
        return outputs

    return update_from_output


def _hand_out_rows(outputs: dict[int, Any], step: StepSamplingMasks, index: dict[str, int],
                   held: dict[str, HeldRows], flush: bool) -> list[Any]:
    """Set ``sampling_mask`` of every output with one new token to its row's bytes (``None``
    for a request that opted out), or append the row to its request's ``held`` rows, which its
    last output carries, and every output of a ``flush`` step: the hot loop of a mask engine's
    engine core, one pass, one bytes object per streamed row and one copy per held one. Returns
    the outputs with several tokens (a bug: one row each).

    The loop runs in C (``_hand_out_native``: the same work without the interpreter) where it
    is built and the rows are one bytes object (not expanded on the device: a ``memoryview``)."""
    native = _hand_out_rows_native
    if (native is None or step.blob.__class__ is not bytes or step.ends.__class__ is not list
            or step.starts.__class__ not in (tuple, list)):
        return _hand_out_rows_python(outputs, step, index, held, flush)
    several: list[Any] = []
    for engine_core_outputs in outputs.values():
        more, send = native(engine_core_outputs.outputs, index, held, step.starts, step.ends,
                            step.blob, flush)
        several += more
        for output in send:
            _send_held_rows(output, held)
    return several


def _hand_out_rows_python(outputs: dict[int, Any], step: StepSamplingMasks,
                          index: dict[str, int], held: dict[str, HeldRows],
                          flush: bool) -> list[Any]:
    """``_hand_out_rows`` in Python: the reference of the C loop, and the loop where that is not
    built or the rows were expanded on the device."""
    blob, starts, ends = step.blob, step.starts, step.ends
    sliced_from_view = blob.__class__ is not bytes  # rows expanded on the device
    view = memoryview(blob)  # held rows are copied from it, not sliced into bytes first
    held_rows_of = held.get  # bound once: the loop runs per output
    several: list[Any] = []
    for engine_core_outputs in outputs.values():
        for output in engine_core_outputs.outputs:
            # One new token first, with the fewest checks: every output of every step takes it.
            if len(output.new_token_ids) == 1:
                request_id = output.request_id
                r = index[request_id]
                rows = held_rows_of(request_id)
                if rows is not None:
                    # Held requests want masks (the sampler's and this table's test is the same
                    # ``request_wants_masks``), so their rows are never opted-out ones: no
                    # ``starts[r] < 0`` check for them.
                    rows.hold(view[starts[r] : ends[r]])
                    if flush or output.finish_reason is not None:
                        _send_held_rows(output, held)
                    continue
                start = starts[r]
                if start >= 0:  # else opted out: no row (the field's default)
                    output.sampling_mask = (bytes(blob[start : ends[r]]) if sliced_from_view
                                            else blob[start : ends[r]])
            elif output.new_token_ids:
                several.append(output)
            elif held and output.finish_reason is not None:
                _send_held_rows(output, held)  # a finish without a token
            # else no token (a stale async frame, a partial prefill chunk): no row
    return several


def _hand_out_row_groups(outputs: dict[int, Any], step: StepSamplingMasks,
                         index: dict[str, int], held: dict[str, HeldRows],
                         flush: bool) -> list[Any]:
    """``_hand_out_rows`` for a speculative-decoding step: an output with ``n`` new tokens gets
    the first ``n`` rows of its request's group (``n`` > 1: a list of the rows' bytes), or adds
    them to its ``held`` rows. Returns the outputs with more tokens than rows."""
    blob, starts, ends, groups = step.blob, step.starts, step.ends, step.groups
    view = memoryview(blob)  # held rows are copied from it
    too_many: list[Any] = []
    for engine_core_outputs in outputs.values():
        for output in engine_core_outputs.outputs:
            num_new = len(output.new_token_ids)
            if num_new == 0:
                if held and output.finish_reason is not None:
                    _send_held_rows(output, held)
                continue
            r = index[output.request_id]
            first = groups[r]
            if num_new > groups[r + 1] - first:
                too_many.append(output)
                continue
            if starts[first] < 0:
                output.sampling_mask = None
                continue
            earlier = held.get(output.request_id)
            if earlier is None:
                rows = [bytes(blob[starts[j] : ends[j]]) for j in range(first, first + num_new)]
                output.sampling_mask = rows[0] if num_new == 1 else rows
                continue
            for j in range(first, first + num_new):
                earlier.hold(view[starts[j] : ends[j]])
            if flush or output.finish_reason is not None:
                _send_held_rows(output, held)
    return too_many


def _send_held_rows(output: Any, held: dict[str, HeldRows]) -> None:
    """``output`` carries its held request's rows so far; a request that goes on keeps its
    (emptied) entry, a finished one leaves the table."""
    if output.finish_reason is None:
        joined = _joined(held.get(output.request_id))
    else:
        joined = _joined(held.pop(output.request_id, None))
    if joined is not None:
        output.sampling_mask = joined


def _joined(rows: HeldRows | None) -> JoinedMaskRows | None:
    """The message part of a held request's rows, taken from it (``None``: it holds none)."""
    taken = None if rows is None else rows.take()
    return None if taken is None else JoinedMaskRows(*taken)


def _step_problem(step: StepSamplingMasks | None, num_batch_rows: int) -> str | None:
    """Why a step's rows can't be handed out (``None``: they can)."""
    if step is None:
        return "the step carries no masks"
    carried = len(step.starts) if step.groups is None else len(step.groups) - 1
    if carried != num_batch_rows:
        return f"the step carries mask rows for {carried} requests, the batch has {num_batch_rows}"
    return None
