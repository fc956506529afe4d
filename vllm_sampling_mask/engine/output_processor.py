"""Accumulate rows per request and attach ``CompletionOutput.sampling_mask``
(extends ``vllm/v1/engine/output_processor.py`` and ``vllm/outputs.py``).

Rows are appended to the request's state in lock step with its token ids, so a completion's
mask is always "the last ``len(token_ids)`` rows": all rows for FINAL_ONLY / CUMULATIVE outputs,
the rows of the new tokens for DELTA outputs (also when ``stream_interval`` batches several;
DELTA rows are dropped once handed out). The rows live on vLLM's ``RequestState``, so they are
freed with it (finish, abort, disconnect).
"""

from __future__ import annotations

import functools
import logging
from array import array
from typing import Any

from vllm_sampling_mask import patching
from vllm_sampling_mask.config import REQUEST_KEY, request_wants_masks
from vllm_sampling_mask.engine.transport import MASK_BUG_HINT, fail_output, rows_mask
from vllm_sampling_mask.outputs import SamplingMask

logger = logging.getLogger("vllm_sampling_mask")
_ROWS_ATTR = "sampling_mask_rows"
# On a mask engine's OutputProcessor: the ids of the requests given a row list, a superset of
# those in flight (pruned by process_outputs). Absent: the engine's switch is off.
_MASK_REQUESTS_ATTR = "sampling_mask_requests"
COMPLETION_OUTPUT_METHOD = "vllm.v1.engine.output_processor:RequestState._new_completion_output"


COMPACT_ROWS = 64
"""A FINAL_ONLY request joins its rows into one block every this many rows."""


class RequestMaskRows:
    """One request's rows, kept as the little-endian int32 bytes they came in.

    ``SamplingMask`` decodes rows into Python lists only when a user reads ``token_ids``. The
    layout follows the request's output kind:

    - DELTA (streamed): each output hands out the rows since the last, so ``pending`` keeps the
      rows' bytes objects as they arrived (no copy per step);
    - FINAL_ONLY (``LLM.generate``, non-streaming ``/inference/v1/generate``): the rows are
      taken once, at the end (``take_last``). ``pending`` keeps them as they arrived and every
      ``COMPACT_ROWS`` of them are joined into one block of ``blocks`` (their lengths in
      ``lengths``): ~4 bytes per kept id, and no buffer that grows by a row a step (one per
      request, re-allocated and copied as it grows);
    - CUMULATIVE (other non-streaming outputs): one growing buffer of ids (``blob``) and one
      length per row; every output gets ``live()``, a mask over these buffers that grows with
      the request, as the detokenizer's token list handed out with it does.
    """

    __slots__ = ("lengths", "blob", "pending", "blocks")

    def __init__(self, streaming: bool = False, final_only: bool = False) -> None:
        self.lengths = array("i")  # ids per row (FINAL_ONLY: per row of ``blocks``)
        self.blob = bytearray()  # CUMULATIVE: every row's ids, concatenated
        self.pending: list[bytes] | None = [] if streaming or final_only else None
        self.blocks: list[bytes] | None = [] if final_only else None

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
        for row in rows:
            self.append(row)

    def compact(self) -> None:
        """FINAL_ONLY: join the pending rows into one block."""
        pending = self.pending
        self.lengths.extend([len(row) >> 2 for row in pending])
        self.blocks.append(b"".join(pending))
        pending.clear()

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
        if self.blocks is not None:
            lengths = self.lengths.tolist() + [len(row) >> 2 for row in self.pending]
            blob = b"".join([*self.blocks, *self.pending])
        else:
            lengths, blob = self.lengths.tolist(), self.blob
        dropped = len(lengths) - num_rows
        start = 4 * sum(lengths[:dropped]) if dropped else 0
        return SamplingMask.from_wire(lengths[dropped:], bytes(memoryview(blob)[start:]))


def mask_rows_of(state: Any) -> RequestMaskRows:
    """The row list of a mask engine's request state, made on first use together with the
    state's own ``_new_completion_output`` that attaches the rows (other states keep vLLM's)."""
    holder = state.__dict__.get(_ROWS_ATTR)
    if holder is None:
        from vllm.sampling_params import RequestOutputKind

        kind = getattr(state, "output_kind", None)
        holder = state.__dict__[_ROWS_ATTR] = RequestMaskRows(
            streaming=kind is RequestOutputKind.DELTA,
            final_only=kind is RequestOutputKind.FINAL_ONLY)
        patching.patch_instance(COMPLETION_OUTPUT_METHOD, state)
    return holder


def enable_masks(processor: Any, enabled: bool) -> None:
    """Switch an ``OutputProcessor`` to a mask engine's (called once, as its engine is built)."""
    if enabled:
        processor.__dict__[_MASK_REQUESTS_ATTR] = set()
    else:
        processor.__dict__.pop(_MASK_REQUESTS_ATTR, None)


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
        mask_requests = self.__dict__.get(_MASK_REQUESTS_ATTR)
        if mask_requests is None or params is None:
            original(self, request, *args, **kwargs)
            return
        wants = request_wants_masks(params)
        session = self.request_states.get(request.request_id)
        if session is not None and request.resumable:
            if (session.__dict__.get(_ROWS_ATTR) is not None) != wants:
                raise ValueError(
                    f"request {request.request_id}: an input chunk of a streaming-input session "
                    f"sets extra_args[{REQUEST_KEY!r}] to {wants}, but the session started "
                    f"with {not wants}. A session returns masks for all of its tokens or none."
                )
        original(self, request, *args, **kwargs)
        if wants:
            state = self.request_states.get(request.request_id)
            if state is not None:
                mask_rows_of(state)
                mask_requests.add(request.request_id)

    return add_request


def wrap_process_outputs(original: Any) -> Any:
    """``OutputProcessor.process_outputs``: append each output's row before vLLM builds outputs.

    An output of a request with a row list must carry one row per new token (several only from
    a speculative-decoding step), so rows and token ids grow in lock step. One that does not (a
    bug: a lost or an extra row) fails that request alone: vLLM's per-request error
    (``fail_output``, logged), the request aborted in the engine core; the others of the batch
    are served as usual. Rows sent for a request that asked for none are not attached to it, so
    a step while no request with a row list is in flight is vLLM's alone (no pass over its
    outputs: what opted-out traffic costs stock).
    """

    @functools.wraps(original)
    def process_outputs(self: Any, engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        mask_requests = self.__dict__.get(_MASK_REQUESTS_ATTR)
        if not mask_requests:  # switch off, or no request with a row list in flight
            return original(self, engine_core_outputs, *args, **kwargs)
        states = self.request_states
        to_abort: list[str] = []
        held = False
        for output in engine_core_outputs:
            state = states.get(output.request_id)
            if state is None:
                continue
            holder = state.__dict__.get(_ROWS_ATTR)
            if holder is None:
                continue
            held = True
            row = getattr(output, "sampling_mask", None)
            num_new = len(output.new_token_ids)
            if row is not None:
                if num_new == 1:
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
            num_rows = 0 if row is None else len(row) if row.__class__ is list else 1
            logger.error(
                "sampling mask of request %s: an output with %d token(s) carries %d row(s); the "
                "request is finished with an error. %s", output.request_id, num_new, num_rows,
                MASK_BUG_HINT)
            if not output.finished:
                to_abort.append(output.request_id)
            state.streaming_input = False  # a failed streaming-input session ends too
            fail_output(output)
        if not held:
            # None of these outputs had a row list: forget the requests that finished or were
            # aborted since, so that steps of opted-out requests alone skip the pass above. (By
            # the remembered ids, not the states: AsyncLLM hands a step over in chunks, and a
            # chunk of opted-out outputs beside masked traffic must not cost a pass over all.)
            mask_requests.difference_update([rid for rid in mask_requests if rid not in states])
        result = original(self, engine_core_outputs, *args, **kwargs)
        result.reqs_to_abort.extend(to_abort)
        return result

    return process_outputs


def wrap_new_completion_output(original: Any) -> Any:
    """``RequestState._new_completion_output`` plus ``sampling_mask`` aligned with ``token_ids``
    (bound per request state by ``mask_rows_of``). Runs for every streamed token of every
    request, so it takes vLLM's three arguments by position."""
    from vllm.sampling_params import RequestOutputKind

    cumulative = RequestOutputKind.CUMULATIVE
    from_wire_row = SamplingMask.from_wire_row

    @functools.wraps(original)
    def _new_completion_output(self: Any, token_ids: list[int], finish_reason: Any,
                               stop_reason: Any) -> Any:
        completion = original(self, token_ids, finish_reason, stop_reason)
        holder: RequestMaskRows = self.sampling_mask_rows
        pending = holder.pending
        if pending is not None and len(pending) == 1 and len(completion.token_ids) == 1:
            # A streamed token (every step of every streaming request): its row as it came.
            completion.sampling_mask = from_wire_row(pending.pop())
            return completion
        num_tokens = len(completion.token_ids)  # == the rows held: process_outputs checks
        if self.output_kind is not cumulative:
            # DELTA: the new tokens' rows; FINAL_ONLY: all rows (built once, at the end).
            completion.sampling_mask = holder.take_last(num_tokens)
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
