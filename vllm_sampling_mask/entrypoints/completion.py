"""Masks on ``/v1/completions`` (extends ``vllm/entrypoints/openai/completion/serving.py``).

Opt-in per request: ``"return_sampling_mask": true`` (and optionally
``"sampling_mask_format": "compact"``), read from the request's extra fields (vLLM's OpenAI
models keep unknown fields). Each choice then carries ``token_ids`` (the generated ids, also
without ``return_token_ids``) and ``sampling_mask``; streamed chunks carry the rows of their own
tokens. Other requests get vLLM's response unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_sampling_mask.entrypoints.mask_fields import MaskFieldError, parse_mask_options
from vllm_sampling_mask.entrypoints.serving import (
    Arguments,
    bad_request,
    current_options,
    engine_masks_enabled,
    mask_of,
    observe,
    rows_of,
    serve_with_options,
)
from vllm_sampling_mask.entrypoints.sse import StreamMasks


def wrap_create_completion(original: Any) -> Any:
    """``OpenAIServingCompletion.create_completion``: validate the mask fields (HTTP 400)."""

    @functools.wraps(original)
    async def create_completion(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            options = parse_mask_options(request.model_extra, engine_enabled=engine_masks_enabled(self))
        except MaskFieldError as exc:
            return bad_request(self, exc)
        return await serve_with_options(options, original, self, request, *args, **kwargs)

    return create_completion


def wrap_request_output_to_completion_response(original: Any) -> Any:
    """Non-streaming response: each choice gets ``token_ids`` and ``sampling_mask``."""

    @functools.wraps(original)
    def request_output_to_completion_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        response = original(self, *args, **kwargs)
        options = current_options()
        if not options.enabled:
            return response
        final_res_batch = Arguments(original, (self, *args), kwargs)["final_res_batch"]
        # vLLM numbers the choices in this order: prompts, then each prompt's outputs.
        outputs = [output for final_res in final_res_batch for output in final_res.outputs]
        for choice, output in zip(response.choices, outputs, strict=True):
            choice.token_ids = list(output.token_ids)
            choice.sampling_mask = options.render(mask_of(output))  # an extra field: serialised
        return response

    return request_output_to_completion_response


def wrap_completion_stream_generator(original: Any) -> Any:
    """Streaming response: every chunk carries the rows of the tokens it carries."""

    @functools.wraps(original)
    def completion_stream_generator(self: Any, *args: Any, **kwargs: Any) -> Any:
        options = current_options()
        if not options.enabled:
            return original(self, *args, **kwargs)
        call = Arguments(original, (self, *args), kwargs)
        request = call["request"]
        num_choices = 1 if request.n is None else request.n  # vLLM's choice numbering
        masks = StreamMasks(options)

        def seen(item: Any) -> None:
            prompt_index, result = item
            for output in result.outputs:
                masks.add(output.index + prompt_index * num_choices, output.token_ids, rows_of(output))

        call["result_generator"] = observe(call["result_generator"], seen)
        return masks.rewrite_stream(call.call(original))

    return completion_stream_generator
