"""Accumulate rows per request and attach ``CompletionOutput.sampling_mask``
(extends ``vllm/v1/engine/output_processor.py`` and ``vllm/outputs.py``).

Rows are appended to the request's state in lock step with its token ids, so a completion's
mask is always "the last ``len(token_ids)`` rows": all rows for FINAL_ONLY / CUMULATIVE outputs,
the rows of the new tokens for DELTA outputs (also when ``stream_interval`` batches several).
The rows live on vLLM's ``RequestState``, so they are freed with it (finish, abort, disconnect).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_sampling_mask.engine.transport import SamplingMaskRows, decode_rows
from vllm_sampling_mask.outputs import SamplingMask

_ROWS_ATTR = "sampling_mask_rows"
_ENABLED_ATTR = "sampling_mask_enabled"


class RequestMaskRows:
    """One request's rows: decoded rows plus step chunks not decoded yet.

    Chunks are decoded only when an output is built (every step when streaming, once at the end
    for ``LLM`` / non-streaming requests), so the per-step frontend work is an append.
    """

    __slots__ = ("rows", "_pending")

    def __init__(self) -> None:
        self.rows: list[list[int]] = []
        self._pending: list[SamplingMaskRows] = []

    def append(self, chunk: SamplingMaskRows) -> None:
        self._pending.append(chunk)

    def __len__(self) -> int:
        return len(self.rows) + sum(len(chunk.row_lengths) for chunk in self._pending)

    def materialized(self) -> list[list[int]]:
        """All rows so far (the same list object every call: it only grows)."""
        if self._pending:
            self.rows.extend(decode_rows(self._pending))
            self._pending.clear()
        return self.rows


def wrap_add_request(original: Any) -> Any:
    """``OutputProcessor.add_request``: give each new request state an empty row list."""

    @functools.wraps(original)
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        original(self, request, *args, **kwargs)
        if self.__dict__.get(_ENABLED_ATTR):
            state = self.request_states.get(request.request_id)
            if state is not None:
                state.__dict__.setdefault(_ROWS_ATTR, RequestMaskRows())

    return add_request


def wrap_process_outputs(original: Any) -> Any:
    """``OutputProcessor.process_outputs``: append each output's rows before vLLM builds outputs."""

    @functools.wraps(original)
    def process_outputs(self: Any, engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get(_ENABLED_ATTR):
            states = self.request_states
            for output in engine_core_outputs:
                rows = getattr(output, "sampling_mask", None)
                if rows is None:
                    continue
                state = states.get(output.request_id)
                if state is not None:
                    state.__dict__.setdefault(_ROWS_ATTR, RequestMaskRows()).append(rows)
        return original(self, engine_core_outputs, *args, **kwargs)

    return process_outputs


def wrap_new_completion_output(original: Any) -> Any:
    """``RequestState._new_completion_output`` plus ``sampling_mask`` aligned with ``token_ids``."""

    @functools.wraps(original)
    def _new_completion_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        completion = original(self, *args, **kwargs)
        holder: RequestMaskRows | None = self.__dict__.get(_ROWS_ATTR)
        if holder is not None:
            rows = holder.materialized()
            start = len(rows) - len(completion.token_ids)
            if start < 0:
                raise RuntimeError(
                    f"sampling mask of request {self.request_id} has {len(rows)} rows for "
                    f"{len(completion.token_ids)} tokens. This is a bug in vllm-sampling-mask."
                )
            # CUMULATIVE outputs hand out the detokenizer's live token list, which keeps
            # growing after the output is returned: share the live row list the same way so
            # the two stay aligned for a consumer that reads the output later.
            live = start == 0 and completion.token_ids is getattr(self.detokenizer, "token_ids", None)
            completion.sampling_mask = SamplingMask(rows if live else rows[start:])
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
            rows = merged.sampling_mask.token_ids if merged.sampling_mask is not None else []
            merged.sampling_mask = SamplingMask(rows + completion.sampling_mask.token_ids)

    return add


def add_completion_output_field(original: Any) -> None:
    """``CompletionOutput.sampling_mask`` class default ``None`` (instances set their own)."""
    return None


def export_sampling_mask_type(original: Any) -> type[SamplingMask]:
    """``vllm.outputs.SamplingMask``, as upstream vLLM >= 0.28 spells it."""
    return SamplingMask
