"""Masks on ``POST /inference/v1/generate`` (extends
``vllm/entrypoints/scale_out/token_in_token_out/{protocol,serving}.py``).

On a server started with ``--return-sampling-mask`` every choice carries ``sampling_mask``, row i
for ``token_ids[i]``. ``return_sampling_mask: false`` in a request turns it off for that request,
as does ``sampling_params.extra_args.return_sampling_mask: false`` when the top-level field is
absent (the top-level field wins); ``sampling_mask_format: "compact"`` sends the compact dict.
Streamed chunks carry the rows of their own tokens; a streamed request with ``n > 1`` is refused
(HTTP 400: vLLM 0.26 cannot stream it here). Without the switch the endpoint is vLLM's.

The route is vLLM's (registered before any endpoint plugin, and Starlette serves the first
matching route), so we extend ``ServingTokens`` rather than add a route. ``GenerateRequest`` is a
plain pydantic model that drops unknown fields, so the mask fields are read from the request's
JSON body, which Starlette has already parsed and cached. ``GenerateResponse`` serialises its
choices by their declared type, so a response with masks is rebuilt as ``GenerateResponseWithMasks``,
which declares the choice subclass that has the field.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateResponse,
    GenerateResponseChoice,
)
from vllm.sampling_params import RequestOutputKind

from vllm_sampling_mask.config import REQUEST_KEY, is_request_choice
from vllm_sampling_mask.entrypoints.mask_fields import MaskFieldError, parse_mask_options
from vllm_sampling_mask.entrypoints.serving import (
    bad_request,
    current_options,
    engine_masks_enabled,
    mask_of,
    response_and_final_output,
    serve_with_options,
)


class GenerateResponseChoiceWithMask(GenerateResponseChoice):
    """A ``/inference/v1/generate`` choice with its sampling mask."""

    sampling_mask: list[list[int]] | dict[str, Any] | None = None
    """Row i: the ascending vocabulary ids kept when ``token_ids[i]`` was sampled (``"json"``),
    or the compact dict of ``vllm_sampling_mask.compact_format`` (``"compact"``)."""


class GenerateResponseWithMasks(GenerateResponse):
    """``GenerateResponse`` declaring the choice type that carries ``sampling_mask``."""

    choices: list[GenerateResponseChoiceWithMask]  # type: ignore[assignment]


def with_masks(response: Any, outputs: dict[int, Any], options: Any) -> GenerateResponseWithMasks:
    """``response`` rebuilt with every choice's mask (no re-validation: values are vLLM's)."""
    choices = [
        GenerateResponseChoiceWithMask.model_construct(
            _fields_set=choice.model_fields_set | {"sampling_mask"},
            **dict(choice),
            sampling_mask=options.render(mask_of(outputs[choice.index])),
        )
        for choice in response.choices
    ]
    fields = dict(response)
    fields["choices"] = choices
    return GenerateResponseWithMasks.model_construct(_fields_set=response.model_fields_set, **fields)


async def _body_fields(raw_request: Any) -> dict[str, Any]:
    # FastAPI parsed the body into GenerateRequest through Request.json(), which caches it.
    if raw_request is None:
        return {}
    try:
        body = await raw_request.json()
    except (ValueError, RuntimeError):
        return {}
    return body if isinstance(body, dict) else {}


def _params_choice(request: Any, engine_enabled: bool) -> bool:
    """What a request without the top-level field gets: its ``sampling_params.extra_args``
    choice if it made one (the Python API's opt-out), else the server's switch. Raises
    ``MaskFieldError`` on an invalid choice."""
    extra_args = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    choice = extra_args.get(REQUEST_KEY)
    if choice is None:
        return engine_enabled
    if not is_request_choice(choice):
        raise MaskFieldError(f"sampling_params.extra_args.{REQUEST_KEY} must be a boolean, got "
                             f"{choice!r}.", f"sampling_params.extra_args.{REQUEST_KEY}")
    return bool(choice)


def _refuse_streamed_samples(request: Any) -> None:
    """vLLM 0.26's stream generator of this endpoint fails after the first chunk of a request with
    n > 1 (an error event inside a 200 stream): on a mask server such a request is a 400 up front."""
    num_samples = getattr(getattr(request, "sampling_params", None), "n", 1)
    if getattr(request, "stream", False) and num_samples > 1:
        raise MaskFieldError(
            f"sampling_params.n must be 1 with stream: true on /inference/v1/generate, got "
            f"{num_samples}: vLLM 0.26 cannot stream several samples on this endpoint. Send "
            "stream: false with sampling_params.output_kind 2 (FINAL_ONLY) to get all samples, or "
            "one streamed request per sample.", "sampling_params.n")


def _final_output_only(request: Any) -> None:
    """Ask vLLM for the last output only (FINAL_ONLY) of a non-streamed request that gets masks
    and whose output kind is CUMULATIVE (the default).

    vLLM's non-streaming generator builds the response from the last output it reads; with
    CUMULATIVE the API server still builds and hands over an output, mask included, at every
    step of the request (the cost is in docs/benchmarks.md). The response is the same, except
    that with ``n > 1`` it now holds every sample (CUMULATIVE hands each sample's outputs over
    separately, and vLLM's generator keeps the last one it read).
    """
    params = request.sampling_params
    if not request.stream and params.output_kind is RequestOutputKind.CUMULATIVE:
        params.output_kind = RequestOutputKind.FINAL_ONLY


def wrap_serve_tokens(original: Any) -> Any:
    """``ServingTokens.serve_tokens``: read and validate the mask fields (HTTP 400); a
    non-streamed request that gets masks asks vLLM for its final output only."""

    @functools.wraps(original)
    async def serve_tokens(self: Any, request: Any, raw_request: Any = None, *args: Any,
                           **kwargs: Any) -> Any:
        enabled = engine_masks_enabled(self)
        try:
            if enabled:
                _refuse_streamed_samples(request)
            options = parse_mask_options(await _body_fields(raw_request), engine_enabled=enabled,
                                         default_enabled=_params_choice(request, enabled))
        except MaskFieldError as exc:
            return bad_request(self, exc)
        if options.enabled:
            _final_output_only(request)
        return await serve_with_options(options, original, self, request, raw_request, *args,
                                        **kwargs)

    return serve_tokens


def wrap_serve_tokens_full_generator(original: Any) -> Any:
    """Non-streaming response: every choice gets ``sampling_mask``."""

    @functools.wraps(original)
    async def serve_tokens_full_generator(self: Any, *args: Any, **kwargs: Any) -> Any:
        options = current_options()
        if not options.enabled:
            return await original(self, *args, **kwargs)
        response, final = await response_and_final_output(original, self, args, kwargs)
        if final is None or not isinstance(response, GenerateResponse):
            return response  # an ErrorResponse
        return with_masks(response, {o.index: o for o in final.outputs}, options)

    return serve_tokens_full_generator
