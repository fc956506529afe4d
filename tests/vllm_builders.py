"""Hand-built vLLM 0.26 engine objects shared by the engine-free component tests.

Requests and outputs are built directly (no ``InputProcessor``, no engine), with the fields vLLM
0.26 requires (``EngineCoreRequest.external_req_id``, the EOS id the input processor would set).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreRequest, FinishReason

from vllm_sampling_mask.engine.transport import EngineCoreOutputWithMask, JoinedMaskRows

EOS_TOKEN_ID = 0
"""The tiny model's ``<|endoftext|>`` id (its config's ``eos_token_id``)."""


def sampling_params(
    *,
    max_tokens: int = 16,
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    **kwargs: Any,
) -> SamplingParams:
    """``SamplingParams`` as the input processor leaves them (EOS id set), sampling with top-k."""
    params = SamplingParams(
        temperature=1.0, top_k=8, max_tokens=max_tokens, output_kind=output_kind, **kwargs
    )
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return params


def engine_core_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    external_req_id: str | None = None,
    arrival_time: float = 0.0,
) -> EngineCoreRequest:
    """An ``EngineCoreRequest`` for a token prompt (``external_req_id`` defaults to the id)."""
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival_time,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=external_req_id if external_req_id is not None else request_id,
    )


def mask_row(row: Sequence[int]) -> bytes:
    """The wire form of one token's row, as the scheduler builds it."""
    return np.asarray(row, dtype="<i4").tobytes()


def joined_mask_rows(rows: Sequence[Sequence[int]]) -> JoinedMaskRows:
    """The wire form of a held request's rows, as the scheduler sends them."""
    lengths = np.array([len(row) for row in rows], dtype="<i4").tobytes()
    return JoinedMaskRows(lengths, b"".join(mask_row(row) for row in rows))


def engine_core_output(
    request_id: str,
    new_token_ids: Sequence[int],
    row: Sequence[int] | None = None,
    *,
    finish_reason: FinishReason | None = None,
    stop_reason: int | str | None = None,
) -> EngineCoreOutputWithMask:
    """An engine-core output for ``new_token_ids``; ``row`` (if given) is its one token's mask."""
    return EngineCoreOutputWithMask(
        request_id=request_id,
        new_token_ids=list(new_token_ids),
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        sampling_mask=None if row is None else mask_row(row),
    )
