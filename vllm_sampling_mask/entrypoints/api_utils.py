"""A JSON body that is not an object is a 400 on a mask server (extends
``vllm/entrypoints/serve/utils/api_utils.py``).

vLLM's request models (``CompletionRequest``, ``ChatCompletionRequest``, ...) run "before"
validators that call ``data.get``: a body such as ``123``, ``"x"`` or ``[]`` raises
``AttributeError`` there, which FastAPI turns into a 500. The routes depend on
``validate_json_request`` (FastAPI solves a route's dependencies before it validates the body), so
on a server started with ``--return-sampling-mask`` that dependency also refuses such a body, with
vLLM's own 400 for invalid requests. Without the switch the dependency is vLLM's.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_sampling_mask.config import SamplingMaskConfig


def wrap_validate_json_request(original: Any) -> Any:
    """``validate_json_request`` plus: the body must be a JSON object (mask servers)."""
    from fastapi.exceptions import RequestValidationError

    @functools.wraps(original)
    async def validate_json_request(raw_request: Any) -> None:
        await original(raw_request)
        if not SamplingMaskConfig.of(getattr(raw_request.app.state, "vllm_config", None)).enabled:
            return
        start = (await raw_request.body()).lstrip()[:1]
        if start != b"{":  # an object starts so; other invalid JSON fails vLLM's own parsing
            raise RequestValidationError(errors=[{
                "type": "model_attributes_type", "loc": ("body",),
                "msg": "The request body must be a JSON object ({...}), got "
                       f"{start.decode(errors='replace') or 'an empty body'!r}...",
            }])

    return validate_json_request
