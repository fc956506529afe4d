"""Per-request checks (extends ``vllm/v1/engine/input_processor.py`` and the beam-search mixins).

With masks on, a request must describe a distribution whose support is bounded: temperature > 0
(greedy has no distribution to replay) and top_k > 0 (bounds every row's width), or, on an engine
that allows it (``sampling_mask_allow_top_p_only``), no top_k and top_p < 1. A violation is a
``ValueError`` for that request only (HTTP 400 in the server); the engine keeps serving. A request
that opts out (``extra_args["return_sampling_mask"] = False``) is not checked; one that opts in
on an engine without the switch is refused.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator
from typing import Any

from vllm_sampling_mask.config import (
    REQUEST_KEY,
    TOP_P_ONLY_KEY,
    SamplingMaskConfig,
    is_request_choice,
    request_wants_masks,
)

_SWITCH = "the engine returns sampling masks (--return-sampling-mask)"


def check_sampling_params(params: Any, allow_top_p_only: bool = False) -> None:
    """Raise ``VLLMValidationError`` (a ``ValueError``; HTTP 400 with ``param`` set) naming the
    parameter if ``params`` can't carry a mask. ``allow_top_p_only``: the engine's
    ``sampling_mask_allow_top_p_only``."""
    from vllm.exceptions import VLLMValidationError

    if params.temperature <= 0:
        raise VLLMValidationError(
            f"temperature must be > 0 when {_SWITCH}, got {params.temperature}: greedy decoding "
            "has no sampling distribution to replay. Use temperature > 0 (e.g. 1.0).",
            parameter="temperature", value=params.temperature,
        )
    if params.top_k is not None and params.top_k > 0:
        return
    if not allow_top_p_only:
        raise VLLMValidationError(
            f"top_k must be > 0 when {_SWITCH}, got {params.top_k}: it bounds the size of every "
            "mask row. Set top_k (e.g. 50; up to the vocabulary size), or start the engine with "
            f"additional_config {{\"{TOP_P_ONLY_KEY}\": true}} to accept top_p < 1 without top_k.",
            parameter="top_k", value=params.top_k,
        )
    if params.top_p >= 1.0:
        raise VLLMValidationError(
            f"top_k must be > 0 or top_p < 1 when {_SWITCH}, got top_k={params.top_k} and "
            f"top_p={params.top_p}: without either, every row is the whole vocabulary. Set "
            "top_p < 1 (e.g. 0.95) or top_k > 0.",
            parameter="top_p", value=params.top_p,
        )


def check_request_key(params: Any, engine_enabled: bool) -> None:
    """Raise ``VLLMValidationError`` if ``extra_args["return_sampling_mask"]`` is not a bool (or
    0 / 1: the OpenAI requests' ``vllm_xargs`` turn JSON booleans into ints), or asks for masks
    on an engine whose switch is off."""
    from vllm.exceptions import VLLMValidationError

    asked = (params.extra_args or {}).get(REQUEST_KEY)
    if asked is not None and not is_request_choice(asked):
        raise VLLMValidationError(
            f"extra_args[{REQUEST_KEY!r}] must be a bool, got {asked!r}.",
            parameter=REQUEST_KEY, value=asked,
        )
    if asked and not engine_enabled:
        raise VLLMValidationError(
            f"extra_args[{REQUEST_KEY!r}] asks for sampling masks, but this engine was started "
            "without return_sampling_mask=True (--return-sampling-mask).",
            parameter=REQUEST_KEY, value=asked,
        )


def _mask_config(holder: Any, vllm_config: Any) -> SamplingMaskConfig:
    config = holder.__dict__.get("_sampling_mask_config")
    if config is None:
        config = holder.__dict__["_sampling_mask_config"] = SamplingMaskConfig.of(vllm_config)
    return config


def wrap_validate_params(original: Any) -> Any:
    """``InputProcessor._validate_params`` plus our per-request checks."""
    from vllm.sampling_params import SamplingParams

    @functools.wraps(original)
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        original(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams):
            config = _mask_config(self, self.vllm_config)
            if params.extra_args:
                check_request_key(params, config.enabled)
            if config.enabled and request_wants_masks(params):
                check_sampling_params(params, config.allow_top_p_only)

    return _validate_params


_BEAM_SEARCH_ERROR = (
    f"beam search is not supported when {_SWITCH}: beams are chosen by cumulative logprob, "
    "not sampled from the filtered distribution, so there is no mask to replay. Use sampling "
    "(temperature > 0, top_k > 0) or an engine without --return-sampling-mask."
)


def wrap_offline_beam_search(original: Any) -> Any:
    """``LLM.beam_search`` refused with a clear error when masks are on."""

    @functools.wraps(original)
    def beam_search(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _mask_config(self, self.llm_engine.vllm_config).enabled:
            raise ValueError(_BEAM_SEARCH_ERROR)
        return original(self, *args, **kwargs)

    return beam_search


def wrap_online_beam_search(original: Any) -> Any:
    """The server's beam search (an async generator) refused the same way."""

    @functools.wraps(original)
    async def beam_search(self: Any, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        if _mask_config(self, self.engine_client.vllm_config).enabled:
            raise ValueError(_BEAM_SEARCH_ERROR)
        async for output in original(self, *args, **kwargs):
            yield output

    return beam_search
