"""Per-request checks (extends ``vllm/v1/engine/input_processor.py`` and the beam-search mixins).

With masks on, a request must describe a distribution whose support is bounded: temperature > 0
(greedy has no distribution to replay) and top_k > 0 (bounds every row's width), or, on an engine
that allows it (``sampling_mask_allow_top_p_only``), no top_k and top_p < 1; and no value may push
a logit to +inf or NaN, which would let a token outside its finite row be sampled (``logit_bias``
values, ``repetition_penalty``). A request that opts out
(``extra_args["return_sampling_mask"] = False``) skips these; one that opts in on an engine
without the switch is refused.

Every request of a mask engine, opted out or not, must also fit Model Runner V2's fixed-width
per-request tensors (on MRV2, which vLLM picks for most dense models, a value that does not fit
raises in the worker and ends the engine; the same limits hold on a V1 mask engine, one rule for
every mask server): ``check_engine_limits`` runs on the request ``process_inputs`` built
(after vLLM filled in ``max_tokens``, the EOS stop ids and the bad words' token ids). A violation
is a ``ValueError`` for that request only (HTTP 400 naming the parameter); the engine keeps
serving.
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
MAX_ABS_LOGIT_BIAS = 100.0
"""The bound the OpenAI endpoints clamp ``logit_bias`` to; a mask request beyond it is refused."""
MIN_REPETITION_PENALTY = 0.01
"""Below it, dividing a float32 logit by the penalty can overflow to +inf."""
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


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
    _check_finite_logits(params)
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


def _check_finite_logits(params: Any) -> None:
    """Refuse values that can make a processed logit +inf or NaN: such a token is not in its
    (finite) row, yet the sampler may draw it."""
    from vllm.exceptions import VLLMValidationError

    for token_id, bias in (params.logit_bias or {}).items():
        if not (isinstance(bias, (int, float)) and abs(bias) <= MAX_ABS_LOGIT_BIAS):
            raise VLLMValidationError(
                f"logit_bias values must be finite numbers in [-{MAX_ABS_LOGIT_BIAS:g}, "
                f"{MAX_ABS_LOGIT_BIAS:g}] when {_SWITCH}, got {bias!r} for token {token_id}: "
                "a non-finite or huge bias makes a logit +inf or NaN, outside the mask row, yet "
                "sampleable. Use a bias in that range (the OpenAI endpoints clamp to it).",
                parameter="logit_bias", value=bias,
            )
    if params.repetition_penalty < MIN_REPETITION_PENALTY:
        raise VLLMValidationError(
            f"repetition_penalty must be >= {MIN_REPETITION_PENALTY} when {_SWITCH}, got "
            f"{params.repetition_penalty}: dividing a logit by a smaller factor can overflow it "
            "to +inf, outside the mask row, yet sampleable.",
            parameter="repetition_penalty", value=params.repetition_penalty,
        )


def check_engine_limits(request: Any, vocab_size: int, max_prompt_id: int) -> None:
    """Raise ``VLLMValidationError`` naming the parameter if ``request`` (an ``EngineCoreRequest``
    as ``process_inputs`` built it) holds a value Model Runner V2's fixed-width per-request
    tensors can't store: the worker would raise and the engine would end. ``max_prompt_id``:
    the largest prompt id vLLM accepts (its own, upper-only check needs a tokenizer)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.worker.gpu.sample.bad_words import MAX_BAD_WORDS_TOTAL_TOKENS, MAX_NUM_BAD_WORDS
    from vllm.v1.worker.gpu.sample.logit_bias import (
        MAX_NUM_ALLOWED_TOKEN_IDS,
        MAX_NUM_LOGIT_BIAS_TOKENS,
        MAX_NUM_STOP_TOKEN_IDS,
    )

    def refuse(parameter: str, constraint: str, value: Any, why: str) -> None:
        raise VLLMValidationError(
            f"{parameter} {constraint} on this server ({_SWITCH}: Model Runner V2's per-request "
            f"tensors {why}), got {value!r}.", parameter=parameter, value=value)

    def check_ids(parameter: str, ids: Any, stop: int = vocab_size) -> None:
        if not ids or (min(ids) >= 0 and max(ids) < stop):  # C loops: prompts can be long
            return
        bad = [token_id for token_id in ids if not 0 <= token_id < stop]
        refuse(parameter, f"must hold token ids in [0, {stop})", bad[:8],
               "index the vocabulary with them")

    prompt_ids = request.prompt_token_ids or []
    check_ids("prompt token_ids", prompt_ids, max_prompt_id + 1)
    params = request.sampling_params
    if params is None:
        return
    prompt_len = len(prompt_ids)
    if params.seed is not None and not _INT64_MIN <= params.seed <= _INT64_MAX - (params.n - 1):
        refuse("seed", f"must be in [{_INT64_MIN}, {_INT64_MAX - (params.n - 1)}]", params.seed,
               "store it as int64 (with n > 1, sample i uses seed + i)")
    for name in ("max_tokens", "min_tokens"):
        value = getattr(params, name) or 0
        if prompt_len + value > _INT32_MAX:
            refuse(name, f"must be <= {_INT32_MAX - prompt_len} (2**31 - 1 minus the prompt "
                   "length)", value, "store prompt length + it as int32")
    limits = [
        ("logit_bias", len(params.logit_bias or ()), MAX_NUM_LOGIT_BIAS_TOKENS, "entries"),
        ("allowed_token_ids", len(params.allowed_token_ids or ()), MAX_NUM_ALLOWED_TOKEN_IDS, "ids"),
        ("bad_words", len(params.bad_words_token_ids or ()), MAX_NUM_BAD_WORDS, "token sequences"),
        ("bad_words", sum(map(len, params.bad_words_token_ids or ())), MAX_BAD_WORDS_TOTAL_TOKENS,
         "tokens"),
    ]
    if params.min_tokens > 0:  # only then are the stop ids stored (and indexed) per request
        limits.append(("stop_token_ids", len(params.all_stop_token_ids), MAX_NUM_STOP_TOKEN_IDS,
                       "ids (EOS included) with min_tokens > 0"))
        check_ids("stop_token_ids", params.all_stop_token_ids)
    for parameter, count, limit, unit in limits:
        if count > limit:
            refuse(parameter, f"must have at most {limit} {unit}", count, "have that size")
    if params.allowed_token_ids:
        check_ids("allowed_token_ids", params.allowed_token_ids)


def wrap_process_inputs(original: Any) -> Any:
    """``InputProcessor.process_inputs`` plus ``check_engine_limits`` on a mask engine."""

    @functools.wraps(original)
    def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = original(self, *args, **kwargs)
        if _mask_config(self, self.vllm_config).enabled:
            vocab_size = self.model_config.get_vocab_size()
            tokenizer = self.tokenizer
            max_prompt_id = max(vocab_size - 1, -1 if tokenizer is None else tokenizer.max_token_id)
            check_engine_limits(request, vocab_size, max_prompt_id)
        return request

    return process_inputs


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
    """The engine's mask config, kept on ``holder`` (the ``InputProcessor``, ``LLM`` or serving
    object asking; every engine's, switch off included) as an attribute: not through
    ``holder.__dict__``, which on CPython 3.11-3.12 would slow every later attribute read of
    vLLM's code on it."""
    config = getattr(holder, "_sampling_mask_config", None)
    if config is None:
        config = SamplingMaskConfig.of(vllm_config)
        holder._sampling_mask_config = config
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
