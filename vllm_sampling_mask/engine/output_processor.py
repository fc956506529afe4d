"""Accumulate rows per request and attach ``CompletionOutput.sampling_mask``
(extends ``vllm/v1/engine/output_processor.py`` and ``vllm/outputs.py``).

Rows are appended to the request's state in lock step with its token ids, so a completion's
mask is always "the last ``len(token_ids)`` rows": all rows for FINAL_ONLY / CUMULATIVE outputs,
the rows of the new tokens for DELTA outputs (also when ``stream_interval`` batches several;
DELTA rows are dropped once handed out). The rows live on vLLM's ``RequestState``, so they are
freed with it (finish, abort, disconnect).

The engine core holds the rows of most FINAL_ONLY requests (``config.rows_held_until_finish``)
and sends them every ``HELD_STEPS`` (64) steps and with the last output: while only such
requests are in flight, a step's pass here looks up just the outputs that carry rows or finish.

A FINAL_ONLY request that the HTTP server will answer with a ``csr-delta-varint-base64`` mask
(``rows_kept_as_delta_varint``) keeps its rows in that form, encoded a block of
``COMPACT_ROWS`` at a time as they arrive: requests that finish in the same step (a batch of
equal-length rollouts) then leave the API server one block each to encode, not every row, and
the next requests are not kept waiting behind that work.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from array import array
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import numpy as np

from vllm_sampling_mask import patching
from vllm_sampling_mask.compact_format import delta_varint_as_int32le, delta_varint_payload
from vllm_sampling_mask.config import REQUEST_KEY, request_wants_masks, rows_held_until_finish
from vllm_sampling_mask.engine.transport import (
    MASK_BUG_HINT,
    JoinedMaskRows,
    fail_output,
    rows_mask,
)
from vllm_sampling_mask.outputs import SamplingMask

try:  # the common outputs of _take_rows_every_step_python in C: an optional extension (setup.py)
    from vllm_sampling_mask.engine._take_rows_native import (
        take_rows_every_step as _take_rows_native,
    )
except ImportError:  # installed without a C compiler
    _take_rows_native = None

logger = logging.getLogger("vllm_sampling_mask")
_ROWS_ATTR = "sampling_mask_rows"
# On a mask engine's OutputProcessor: the ids of the requests given a row list, a superset of
# those in flight (pruned by process_outputs). Absent: the engine's switch is off.
_MASK_REQUESTS_ATTR = "sampling_mask_requests"
# ... and of those whose rows come with every output (not held in the engine core until the end).
_LOCKSTEP_ATTR = "sampling_mask_lockstep"
# Calls of the held-rows pass between two prunings of the remembered ids (it looks up only
# outputs with rows or a finish, so it can't tell that an aborted request is gone).
PRUNE_EVERY = 64
_CALLS_ATTR = "sampling_mask_calls"
COMPLETION_OUTPUT_METHOD = "vllm.v1.engine.output_processor:RequestState._new_completion_output"
# The module's binding of RequestState, which OutputProcessor.add_request makes states from:
# inside a mask request's add_request, the subclass with our _new_completion_output.
REQUEST_STATE_BINDING = "vllm.v1.engine.output_processor:RequestState"


COMPACT_ROWS = 64
"""A FINAL_ONLY request joins its rows into one block every this many rows."""

_delta_varint_rows: ContextVar[bool] = ContextVar("vllm_sampling_mask_delta_varint_rows",
                                                  default=False)


@contextlib.contextmanager
def rows_kept_as_delta_varint() -> Iterator[None]:
    """FINAL_ONLY requests added to the output processor inside this block (the HTTP layer's
    call for one request that returns ``csr-delta-varint-base64``) keep their rows in that
    form: their masks' ``SamplingMask.delta_varint()``."""
    token = _delta_varint_rows.set(True)
    try:
        yield
    finally:
        _delta_varint_rows.reset(token)


class RequestMaskRows:
    """One request's rows, kept as the little-endian int32 bytes they came in.

    ``SamplingMask`` decodes rows into Python lists only when a user reads ``token_ids``. The
    layout follows the request's output kind:

    - DELTA (streamed): each output hands out the rows since the last, so ``pending`` keeps the
      rows' bytes objects as they arrived (no copy per step);
    - FINAL_ONLY (``LLM.generate``, non-streaming ``/inference/v1/generate``): the rows are
      taken once, at the end (``take_last``). They arrive one a step (stop strings): ``pending``
      keeps them as they came and every ``COMPACT_ROWS`` of them are joined into one block of
      ``blocks`` (their lengths in ``lengths``): ~4 bytes per kept id, and no buffer that grows
      by a row a step (one per request, re-allocated and copied as it grows). Where the engine
      core holds them (``held``), they arrive every 64 steps and at the end, already joined
      (``add_joined``): each message's rows are a block as they came.
      With ``varint`` each block is ``compact_format.delta_varint_payload`` of its rows
      instead (~2 bytes per id at top_k 50 over a 151,936-token vocabulary);
    - CUMULATIVE (other non-streaming outputs): one growing buffer of ids (``blob``) and one
      length per row; every output gets ``live()``, a mask over these buffers that grows with
      the request, as the detokenizer's token list handed out with it does.
    """

    __slots__ = ("lengths", "blob", "pending", "blocks", "held", "varint")

    def __init__(self, streaming: bool = False, final_only: bool = False,
                 held: bool = False, varint: bool = False) -> None:
        if held and not final_only:
            raise ValueError("only a FINAL_ONLY request's rows are held until its end")
        if varint and not final_only:
            raise ValueError("only a FINAL_ONLY request's rows are kept as delta varints")
        self.lengths = array("i")  # ids per row (FINAL_ONLY: per row of ``blocks``)
        self.blob = bytearray()  # CUMULATIVE: every row's ids, concatenated
        self.pending: list[bytes] | None = [] if streaming or final_only else None
        self.blocks: list[bytes] | None = [] if final_only else None
        self.held = held  # the engine core sends the rows every 64 steps and at the end
        self.varint = varint  # blocks are delta_varint_payload, not int32 bytes

    def __len__(self) -> int:
        if self.pending is None:
            return len(self.lengths)
        return len(self.pending) if self.blocks is None else len(self.lengths) + len(self.pending)

    def append(self, row: bytes) -> None:
        """Add one token's wire row (its kept ids, ascending, little-endian int32)."""
        pending = self.pending
        if pending is None:
            self.blob += row
            self.lengths.append(len(row) >> 2)
            return
        pending.append(row)
        if len(pending) >= COMPACT_ROWS and self.blocks is not None:
            self.compact()

    def extend(self, rows: list[bytes]) -> None:
        """Add several tokens' wire rows (a speculative-decoding step)."""
        pending = self.pending
        if pending is None:
            for row in rows:
                self.append(row)
            return
        pending.extend(rows)
        if len(pending) >= COMPACT_ROWS and self.blocks is not None:
            self.compact()

    def add_joined(self, lengths: array, ids: bytes) -> None:
        """FINAL_ONLY: add several tokens' rows sent joined (``JoinedMaskRows``: a held
        request's), ``lengths`` ids per row and ``ids`` their bytes, as one block."""
        if self.pending:
            self.compact()  # rows that came one by one before these
        self._add_block(lengths, ids)

    def compact(self) -> None:
        """FINAL_ONLY: join the pending rows into one block (``varint``: encode them)."""
        pending = self.pending
        self._add_block(array("i", [len(row) >> 2 for row in pending]), b"".join(pending))
        pending.clear()

    def _add_block(self, lengths: array, block: bytes) -> None:
        """Append one block of rows (little-endian int32 ids) and their lengths; ``varint``:
        encoded."""
        if self.varint:
            try:
                block = delta_varint_payload(np.asarray(lengths, dtype=np.int64),
                                             np.frombuffer(block, dtype="<i4"))
            except ValueError:
                # Rows the encoding refuses (not ascending: a bug upstream) stay int32 bytes,
                # the blocks before them too, so that the response's own encoding reports them.
                self.varint = False
                if self.blocks:
                    self.blocks = [delta_varint_as_int32le(self.lengths, b"".join(self.blocks))]
        self.lengths += lengths
        self.blocks.append(block)

    def drop(self) -> None:
        """Forget every row held (a request failed for a lost or an extra row)."""
        self.lengths, self.blob = array("i"), bytearray()
        if self.pending is not None:
            self.pending = []
        if self.blocks is not None:
            self.blocks = []

    def live(self) -> SamplingMask:
        """All rows so far, and every row appended later (CUMULATIVE outputs: a request's
        output kind, and so its holder's layout, is fixed when its state is made)."""
        return SamplingMask.from_wire(self.lengths, self.blob)

    def take_last(self, num_rows: int) -> SamplingMask:
        """The last ``num_rows`` rows, undecoded; every row held is dropped (DELTA and
        FINAL_ONLY outputs). Requires ``num_rows <= len(self)``."""
        if self.blocks is None and self.pending is not None:
            pending, self.pending = self.pending, []
            return rows_mask(pending if len(pending) == num_rows else pending[-num_rows:])
        mask = self.snapshot_last(num_rows)
        self.lengths = array("i")
        if self.blocks is None:
            self.blob = bytearray()
        else:
            self.blocks, self.pending = [], []
        return mask

    def snapshot_last(self, num_rows: int) -> SamplingMask:
        """The last ``num_rows`` rows as they are now (a copy); nothing is dropped. Not for
        streaming holders."""
        if self.varint and self.pending:
            self.compact()  # the last rows: one more block
        if self.varint:
            lengths, blob = self.lengths.tolist(), b"".join(self.blocks)
            if len(lengths) == num_rows:
                return SamplingMask.from_delta_varint(lengths, blob)
            blob = delta_varint_as_int32le(lengths, blob)
        elif self.blocks is not None:
            lengths = self.lengths.tolist() + [len(row) >> 2 for row in self.pending]
            blob = b"".join([*self.blocks, *self.pending])
            if len(lengths) == num_rows:  # every row: the join is the mask's own (no copy)
                return SamplingMask.from_wire(lengths, blob)
        else:
            lengths, blob = self.lengths.tolist(), self.blob
        dropped = len(lengths) - num_rows
        start = 4 * sum(lengths[:dropped]) if dropped else 0
        return SamplingMask.from_wire(lengths[dropped:], bytes(memoryview(blob)[start:]))


def mask_rows_of(state: Any, held: bool = False) -> RequestMaskRows:
    """The row list of a mask engine's request state, made on first use (the state itself is
    made by ``add_request`` as ``mask_request_state``'s class, whose ``_new_completion_output``
    attaches the rows; other states keep vLLM's). ``held``: the engine core holds the rows,
    sent every 64 steps and with the last output (FINAL_ONLY only). A FINAL_ONLY state made
    inside ``rows_kept_as_delta_varint`` keeps its rows in that form.

    Attributes are set and read as attributes, never through ``state.__dict__``: on CPython
    3.11-3.12 that would move the state's attributes into a dict of its own, and vLLM's reads of
    them, ~25 per output and step, would get slower."""
    holder = getattr(state, _ROWS_ATTR, None)
    if holder is None:
        from vllm.sampling_params import RequestOutputKind

        kind = getattr(state, "output_kind", None)
        final_only = kind is RequestOutputKind.FINAL_ONLY
        holder = RequestMaskRows(
            streaming=kind is RequestOutputKind.DELTA, final_only=final_only, held=held,
            varint=final_only and _delta_varint_rows.get())
        setattr(state, _ROWS_ATTR, holder)
    return holder


def mask_request_state(original: type) -> type:
    """``RequestState`` as ``OutputProcessor.add_request`` binds it for a request that wants
    masks (``REQUEST_STATE_BINDING``): the subclass whose ``_new_completion_output`` attaches
    them, so that the state is made as one (``patching.instance_class``)."""
    return patching.instance_class(COMPLETION_OUTPUT_METHOD, original)


def enable_masks(processor: Any, enabled: bool) -> None:
    """Switch an ``OutputProcessor`` to a mask engine's (called once, as its engine is built).
    Its attributes, as a request state's (``mask_rows_of``), are never set through
    ``processor.__dict__``."""
    if enabled:
        setattr(processor, _MASK_REQUESTS_ATTR, set())
        setattr(processor, _LOCKSTEP_ATTR, set())
        setattr(processor, _CALLS_ATTR, 0)
        return
    for attr in (_MASK_REQUESTS_ATTR, _LOCKSTEP_ATTR, _CALLS_ATTR):
        if hasattr(processor, attr):
            delattr(processor, attr)


def wrap_add_request(original: Any) -> Any:
    """``OutputProcessor.add_request``: give each new request state of a mask engine its row
    list, unless the request opted out.

    A streaming-input session adds one request per input chunk under one id, each with its own
    ``SamplingParams``; the state, and so the choice of masks, is made by the first. A later
    chunk that changes the choice is refused (``ValueError``, that session only): its tokens'
    rows would be missing from, or extra to, the state's row list.
    """

    @functools.wraps(original)
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        params = request.sampling_params
        mask_requests = getattr(self, _MASK_REQUESTS_ATTR, None)
        if mask_requests is None or params is None:
            original(self, request, *args, **kwargs)
            return
        wants = request_wants_masks(params)
        session = self.request_states.get(request.request_id)
        if session is not None and request.resumable:
            if (getattr(session, _ROWS_ATTR, None) is not None) != wants:
                raise ValueError(
                    f"request {request.request_id}: an input chunk of a streaming-input session "
                    f"sets extra_args[{REQUEST_KEY!r}] to {wants}, but the session started "
                    f"with {not wants}. A session returns masks for all of its tokens or none."
                )
        if not wants:
            original(self, request, *args, **kwargs)
            return
        with patching.scoped_patch(REQUEST_STATE_BINDING):  # a new state: mask_request_state's
            original(self, request, *args, **kwargs)
        state = self.request_states.get(request.request_id)
        if state is not None:
            held = rows_held_until_finish(params, request.resumable)
            mask_rows_of(state, held)
            mask_requests.add(request.request_id)
            if not held:
                getattr(self, _LOCKSTEP_ATTR).add(request.request_id)

    return add_request


def wrap_process_outputs(original: Any) -> Any:
    """``OutputProcessor.process_outputs``: add each output's rows before vLLM builds outputs.

    A request whose rows come every step must get one row per new token (several only from a
    speculative-decoding step), so rows and token ids grow in lock step; a request whose rows
    the engine core holds (``RequestMaskRows.held``) must have a row per token once it
    finishes. A request that breaks this (a bug: a lost or an extra row) fails alone: vLLM's
    per-request error (``fail_output``, logged), the request aborted in the engine core; the
    others of the batch are served as usual. Rows sent for a request that asked for none are not
    attached to it, so a step while no request with a row list is in flight is vLLM's alone (no
    pass over its outputs: what opted-out traffic costs stock); while only held requests are,
    the pass reads two fields of each output and looks up only those with rows or a finish.
    """

    @functools.wraps(original)
    def process_outputs(self: Any, engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        mask_requests = getattr(self, _MASK_REQUESTS_ATTR, None)
        if not mask_requests:  # switch off, or no request with a row list in flight
            return original(self, engine_core_outputs, *args, **kwargs)
        if getattr(self, _LOCKSTEP_ATTR):
            to_abort = _take_rows_every_step(self, engine_core_outputs, mask_requests)
        else:
            to_abort = _take_held_rows(self, engine_core_outputs, mask_requests)
        result = original(self, engine_core_outputs, *args, **kwargs)
        if to_abort:
            result.reqs_to_abort.extend(to_abort)
        return result

    return process_outputs


def _take_rows_every_step(processor: Any, outputs: list[Any], mask_requests: set[str]) -> list[str]:
    """The pass while a request whose rows come every step is in flight: every output's request
    is looked up. Returns the ids of the requests failed here that the engine core still runs.

    Where the C loop (``_take_rows_native``) is built, it takes the common outputs (one row for
    one token, nothing for none) and leaves the rest to the Python loop."""
    lockstep_seen = False
    if _take_rows_native is not None and outputs.__class__ is list:
        lockstep_seen, outputs = _take_rows_native(outputs, processor.request_states, _ROWS_ATTR,
                                                   COMPACT_ROWS)
    to_abort, lockstep_rest = _take_rows_every_step_python(processor, outputs)
    if not (lockstep_seen or lockstep_rest):
        # None of these outputs had rows every step: forget the requests that finished or were
        # aborted since, so that steps of opted-out (or held) requests alone skip this pass. (By
        # the remembered ids, not the states: AsyncLLM hands a step over in chunks, and a chunk
        # of opted-out outputs beside masked traffic must not cost a pass over all.)
        _forget_finished(processor, mask_requests)
    return to_abort


def _take_rows_every_step_python(processor: Any, outputs: list[Any]) -> tuple[list[str], bool]:
    """``_take_rows_every_step``'s loop in Python, for every kind of output: the reference of
    the C loop, and the loop for what that leaves. Returns the failed requests to abort and
    whether an output of a request whose rows come every step was seen."""
    states = processor.request_states
    to_abort: list[str] = []
    lockstep_seen = False
    for output in outputs:
        state = states.get(output.request_id)
        if state is None:
            continue
        holder = getattr(state, _ROWS_ATTR, None)
        if holder is None:
            continue
        row = getattr(output, "sampling_mask", None)
        if holder.held:
            if row is not None or output.finish_reason is not None:
                _take_held_output(holder, state, output, row, to_abort)
            continue
        lockstep_seen = True
        num_new = len(output.new_token_ids)
        if row is not None:
            if num_new == 1 and row.__class__ is bytes:
                pending = holder.pending
                if pending is None:
                    holder.append(row)
                else:  # streamed or FINAL_ONLY (every step): append's work, inlined
                    pending.append(row)
                    if len(pending) >= COMPACT_ROWS and holder.blocks is not None:
                        holder.compact()
                continue
            if row.__class__ is list and len(row) == num_new:
                holder.extend(row)  # a speculative step's tokens
                continue
        elif num_new == 0:
            continue
        num_rows = 0 if row is None else 1 if row.__class__ is bytes else len(row)
        _fail(state, output, f"an output with {num_new} token(s) carries {num_rows} row(s)",
              to_abort)
    return to_abort, lockstep_seen


def _take_held_rows(processor: Any, outputs: list[Any], mask_requests: set[str]) -> list[str]:
    """The pass while every request with a row list in flight is held: only outputs that carry
    rows or finish are looked up."""
    states = processor.request_states
    to_abort: list[str] = []
    for output in outputs:
        row = getattr(output, "sampling_mask", None)
        if row is None and output.finish_reason is None:
            continue
        state = states.get(output.request_id)
        if state is None:
            continue
        holder = getattr(state, _ROWS_ATTR, None)
        if holder is not None:
            _take_held_output(holder, state, output, row, to_abort)
    calls = getattr(processor, _CALLS_ATTR) + 1
    if calls >= PRUNE_EVERY:
        calls = 0
        _forget_finished(processor, mask_requests)
    setattr(processor, _CALLS_ATTR, calls)
    return to_abort


def _take_held_output(holder: RequestMaskRows, state: Any, output: Any, row: Any,
                      to_abort: list[str]) -> None:
    """Add the rows a held request's output carries; at its finish, check that it has a row
    per token."""
    if row.__class__ is JoinedMaskRows:
        lengths = row.row_lengths()
        if 4 * sum(lengths) != len(row.ids):
            _fail(state, output, f"its {len(lengths)} joined rows hold {sum(lengths)} ids but "
                  f"{len(row.ids)} bytes", to_abort)
            holder.drop()  # its completion gets no mask
            return
        holder.add_joined(lengths, row.ids)
    elif row.__class__ is list:
        holder.extend(row)
    elif row is not None:  # one row: a step the engine core sent as it came
        holder.append(row)
    if output.finish_reason is None:
        return
    num_tokens = state.detokenizer.num_output_tokens() + len(output.new_token_ids)
    if len(holder) != num_tokens:
        _fail(state, output, f"it finished after {num_tokens} token(s) with {len(holder)} row(s)",
              to_abort)
        holder.drop()  # its completion gets no mask


def _fail(state: Any, output: Any, problem: str, to_abort: list[str]) -> None:
    """Finish ``output``'s request with vLLM's per-request error; its rows can't be trusted."""
    logger.error("sampling mask of request %s: %s; the request is finished with an error. %s",
                 output.request_id, problem, MASK_BUG_HINT)
    if not output.finished:
        to_abort.append(output.request_id)
    state.streaming_input = False  # a failed streaming-input session ends too
    fail_output(output)


def _forget_finished(processor: Any, mask_requests: set[str]) -> None:
    """Drop the remembered ids whose request state is gone (finished, aborted)."""
    states = processor.request_states
    for ids in (mask_requests, getattr(processor, _LOCKSTEP_ATTR)):
        ids.difference_update([rid for rid in ids if rid not in states])


def wrap_new_completion_output(original: Any) -> Any:
    """``RequestState._new_completion_output`` plus ``sampling_mask`` aligned with ``token_ids``
    (the method of ``mask_request_state``'s class). Runs for every streamed token of every
    request, so it takes vLLM's three arguments by position."""
    from vllm.sampling_params import RequestOutputKind

    cumulative = RequestOutputKind.CUMULATIVE
    from_wire_row = SamplingMask.from_wire_row

    @functools.wraps(original)
    def _new_completion_output(self: Any, token_ids: list[int], finish_reason: Any,
                               stop_reason: Any) -> Any:
        completion = original(self, token_ids, finish_reason, stop_reason)
        holder: RequestMaskRows | None = getattr(self, _ROWS_ATTR, None)
        if holder is None:  # made while another thread's add_request had the class bound
            return completion
        pending = holder.pending
        if pending is not None and len(pending) == 1 and len(completion.token_ids) == 1:
            # A streamed token (every step of every streaming request): its row as it came.
            completion.sampling_mask = from_wire_row(pending.pop())
            return completion
        num_tokens = len(completion.token_ids)  # == the rows held: process_outputs checks
        if self.output_kind is not cumulative:
            # DELTA: the new tokens' rows; FINAL_ONLY: all rows (built once, at the end). A held
            # request failed for a missing row has fewer rows than tokens: no mask.
            completion.sampling_mask = (holder.take_last(num_tokens)
                                        if len(holder) >= num_tokens else None)
            return completion
        # CUMULATIVE outputs hand out the detokenizer's live token list, which keeps growing
        # after the output is returned: hand out the live rows the same way so the two stay
        # aligned for a consumer that reads the output later.
        live = len(holder) == num_tokens and completion.token_ids is getattr(
            self.detokenizer, "token_ids", None)
        completion.sampling_mask = holder.live() if live else holder.snapshot_last(num_tokens)
        return completion

    return _new_completion_output


def wrap_request_output_add(original: Any) -> Any:
    """``RequestOutput.add``: coalesced DELTA outputs merge their masks like their token ids."""

    @functools.wraps(original)
    def add(self: Any, next_output: Any, aggregate: bool) -> None:
        if not aggregate or all(c.sampling_mask is None for c in next_output.outputs):
            return original(self, next_output, aggregate)
        before = {completion.index: completion for completion in self.outputs}
        original(self, next_output, aggregate)
        for completion in next_output.outputs:
            merged = before.get(completion.index)
            if merged is None or merged is completion or completion.sampling_mask is None:
                continue
            parts = [completion.sampling_mask]
            if merged.sampling_mask is not None:
                parts.insert(0, merged.sampling_mask)
            merged.sampling_mask = SamplingMask.concat(parts)

    return add


def add_completion_output_field(original: Any) -> None:
    """``CompletionOutput.sampling_mask`` class default ``None`` (instances set their own)."""
    return None


def export_sampling_mask_type(original: Any) -> type[SamplingMask]:
    """``vllm.outputs.SamplingMask``, as upstream vLLM >= 0.28 spells it."""
    return SamplingMask
