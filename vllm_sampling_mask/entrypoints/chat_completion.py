"""Masks on ``/v1/chat/completions`` (extends ``vllm/entrypoints/openai/chat_completion/serving.py``).

Same opt-in fields as ``/v1/completions``. Each choice carries ``token_ids`` (every generated id,
reasoning and tool-call tokens included) and ``sampling_mask``. When streaming, tokens a
reasoning or tool parser holds back without emitting a chunk ride in the next chunk of their
choice, except with ``logprobs``: vLLM would drop their logprobs, so such a stream is sent with
``return_token_ids`` (a chunk for every engine output). Refused (HTTP 400) with
``include_reasoning: false`` on a server with a reasoning or tool parser: vLLM hides those tokens
there, and their masks (which contain each sampled token) would reveal them.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_sampling_mask.entrypoints.mask_fields import RETURN_FIELD, MaskFieldError, parse_mask_options
from vllm_sampling_mask.entrypoints.serving import (
    bad_request,
    current_options,
    engine_masks_enabled,
    mask_of,
    response_and_final_output,
    serve_with_options,
)


def _prepare_request(serving: Any, request: Any) -> None:
    """Refuse what masks can't serve; make a streamed chat with logprobs send every chunk."""
    if serving.parser_cls is None:
        return
    if not request.include_reasoning:
        raise MaskFieldError(
            f"{RETURN_FIELD} is not supported with include_reasoning=false on a server with a "
            "reasoning or tool parser: the masks contain every sampled token, hidden ones too. "
            "Set include_reasoning to true or drop the field.", RETURN_FIELD)
    if request.stream and request.logprobs:
        # vLLM skips the chunk of an engine output its parser holds back, and with it that
        # output's logprobs; its tokens and rows would ride in the next chunk, one logprob
        # entry short. With return_token_ids vLLM sends every chunk (an empty delta for held
        # tokens), so each chunk's logprobs, token_ids and rows line up.
        request.return_token_ids = True


def wrap_create_chat_completion(original: Any) -> Any:
    """``OpenAIServingChat.create_chat_completion``: validate the mask fields (HTTP 400)."""

    @functools.wraps(original)
    async def create_chat_completion(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            options = parse_mask_options(request.model_extra, engine_enabled=engine_masks_enabled(self))
            if options.enabled:
                _prepare_request(self, request)
        except MaskFieldError as exc:
            return bad_request(self, exc)
        return await serve_with_options(options, original, self, request, *args, **kwargs)

    return create_chat_completion


def wrap_chat_completion_full_generator(original: Any) -> Any:
    """Non-streaming response: each choice gets ``token_ids`` and ``sampling_mask``."""

    @functools.wraps(original)
    async def chat_completion_full_generator(self: Any, *args: Any, **kwargs: Any) -> Any:
        options = current_options()
        if not options.enabled:
            return await original(self, *args, **kwargs)
        response, final = await response_and_final_output(original, self, args, kwargs)
        if final is None or not hasattr(response, "choices"):
            return response  # an ErrorResponse
        outputs = {output.index: output for output in final.outputs}
        for choice in response.choices:
            output = outputs[choice.index]
            choice.token_ids = list(output.token_ids)
            choice.sampling_mask = options.render(mask_of(output))  # an extra field: serialised
        return response

    return chat_completion_full_generator
