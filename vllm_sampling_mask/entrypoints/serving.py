"""Helpers the HTTP serving wrappers share (extend ``vllm/entrypoints/serve/engine/serving.py``).

The serving classes of vLLM build their responses inside long methods we do not copy. Each of
our wrappers works at the method's seams instead: the request's mask options are parsed once by
the outer entry (``create_completion``, ``create_chat_completion``, ``serve_tokens``) and handed
to the inner builders it calls (in the same task) through a context variable; the builders'
engine-output iterator is observed on its way in, and their response on its way out.
Requests that do not ask for masks go straight to vLLM's methods: their responses are vLLM's.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from http import HTTPStatus
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextvars import ContextVar
from typing import Any

from vllm_sampling_mask.config import REQUEST_KEY, SamplingMaskConfig
from vllm_sampling_mask.engine.output_processor import rows_kept_as_delta_varint
from vllm_sampling_mask.entrypoints.mask_fields import DISABLED, MaskOptions
from vllm_sampling_mask.outputs import SamplingMask

_options: ContextVar[MaskOptions] = ContextVar("vllm_sampling_mask_http_options", default=DISABLED)
_ENABLED_CACHE = "_sampling_mask_http_enabled"


def engine_masks_enabled(serving: Any) -> bool:
    """The server's ``--return-sampling-mask`` switch, read from a serving object's engine and
    kept on it as an attribute: not through ``serving.__dict__``, which on CPython 3.11-3.12
    would slow every later attribute read of vLLM's code on it."""
    enabled = getattr(serving, _ENABLED_CACHE, None)
    if enabled is None:
        enabled = SamplingMaskConfig.of(serving.engine_client.vllm_config).enabled
        setattr(serving, _ENABLED_CACHE, enabled)
    return enabled


@contextlib.contextmanager
def request_options(options: MaskOptions) -> Iterator[None]:
    """Make ``options`` the current request's (for the builders called inside this block); a
    request answered in ``csr-delta-varint-base64`` has its rows kept in that form as they
    arrive (``rows_kept_as_delta_varint``: its engine request is added inside this block)."""
    token = _options.set(options)
    rows_form = (rows_kept_as_delta_varint() if options.renders_delta_varint
                 else contextlib.nullcontext())
    try:
        with rows_form:
            yield
    finally:
        _options.reset(token)


def current_options() -> MaskOptions:
    """The options of the request being served in this task (``DISABLED`` outside one)."""
    return _options.get()


def mask_of(output: Any) -> SamplingMask:
    """The mask of one ``CompletionOutput``, one row per token (not decoded); raises if a mask
    engine attached none."""
    mask = getattr(output, "sampling_mask", None)
    if mask is None:
        if not output.token_ids:
            return SamplingMask([])
        raise RuntimeError(
            f"completion {output.index} has {len(output.token_ids)} tokens but no sampling mask "
            "although the engine returns masks. This is a bug in vllm-sampling-mask."
        )
    if len(mask) != len(output.token_ids):
        raise RuntimeError(
            f"completion {output.index} has {len(mask)} mask rows for {len(output.token_ids)} "
            "tokens. This is a bug in vllm-sampling-mask."
        )
    return mask


def rows_of(output: Any) -> list[list[int]]:
    """The mask rows of one ``CompletionOutput`` as lists (``mask_of``'s checks)."""
    return mask_of(output).token_ids


def tell_engine(request: Any, wants_masks: bool) -> None:
    """Carry one HTTP request's choice into the ``SamplingParams.extra_args`` vLLM builds for it
    (``GenerateRequest.sampling_params``; ``vllm_xargs`` of the OpenAI requests), so that a
    request without masks is neither checked nor captured by the engine."""
    params = getattr(request, "sampling_params", None)
    if params is not None:
        params.extra_args = {**(params.extra_args or {}), REQUEST_KEY: wants_masks}
    elif hasattr(request, "vllm_xargs"):
        request.vllm_xargs = {**(request.vllm_xargs or {}), REQUEST_KEY: wants_masks}


def bad_request(serving: Any, exc: Any) -> Any:
    """vLLM's HTTP 400 ``ErrorResponse`` for a ``MaskFieldError`` (names the parameter)."""
    return serving.create_error_response(str(exc), param=exc.parameter)


async def serve_with_options(options: MaskOptions, original: Callable[..., Any], serving: Any,
                             *args: Any, **kwargs: Any) -> Any:
    """Await an entry method (``create_*``, ``serve_tokens``) with the request's mask options
    current; a request without masks gets vLLM's call (on a mask server, opted out first)."""
    if engine_masks_enabled(serving):
        tell_engine(args[0], options.enabled)
    if not options.enabled:
        return await original(serving, *args, **kwargs)
    with request_options(options):
        result = await original(serving, *args, **kwargs)
    return await error_before_stream(serving, result)


async def response_and_final_output(original: Callable[..., Any], serving: Any,
                                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Await a full (non-streaming) generator method; also return the last ``RequestOutput``
    its ``result_generator`` yielded (``None`` if none: the response is then an error)."""
    call = Arguments(original, (serving, *args), kwargs)
    final = LastItem()
    call["result_generator"] = observe(call["result_generator"], final)
    response = await call.call(original)
    return response, final.item


async def observe(source: AsyncIterator[Any], seen: Callable[[Any], None]) -> AsyncGenerator[Any, None]:
    """Yield every item of ``source`` after passing it to ``seen``; closing this closes ``source``."""
    try:
        async for item in source:
            seen(item)
            yield item
    finally:
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


async def error_before_stream(serving: Any, result: Any) -> Any:
    """Turn an error that ends a stream before it sent anything into a real HTTP error.

    vLLM starts a streamed response (HTTP 200) before the engine has seen the request, so a
    request the engine rejects (e.g. temperature 0 on a mask server) becomes a 200 whose only
    event is an error. For a stream of ours, wait for its first event (the first engine output
    comes with it, so nothing is delayed): an error there becomes vLLM's ``ErrorResponse`` with
    that status (400). ``result`` that is no stream is returned as is.
    """
    if not inspect.isasyncgen(result):
        return result
    try:
        first = await result.__anext__()
    except StopAsyncIteration:
        return result
    error = _stream_error(first)
    if error is None:
        return _prepend(first, result)
    await result.aclose()
    try:
        status = HTTPStatus(int(error.get("code", 400)))
    except ValueError:
        status = HTTPStatus.BAD_REQUEST
    return serving.create_error_response(
        str(error.get("message", "")), err_type=str(error.get("type", "BadRequestError")),
        status_code=status, param=error.get("param"))


def _stream_error(event: Any) -> dict[str, Any] | None:
    if not isinstance(event, str) or not event.startswith('data: {"error"'):
        return None
    try:
        error = json.loads(event[len("data: "):]).get("error")
    except ValueError:
        return None
    return error if isinstance(error, dict) else None


async def _prepend(first: Any, rest: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


class LastItem:
    """Keeps the last item it is called with (the final ``RequestOutput`` of a request)."""

    def __init__(self) -> None:
        self.item: Any = None

    def __call__(self, item: Any) -> None:
        self.item = item


class Arguments:
    """A wrapped method's call, with parameters readable and replaceable by name."""

    def __init__(self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self._bound = _signature(original).bind(*args, **kwargs)

    def __getitem__(self, name: str) -> Any:
        return self._bound.arguments[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self._bound.arguments[name] = value

    def call(self, original: Callable[..., Any]) -> Any:
        return original(*self._bound.args, **self._bound.kwargs)


_signatures: dict[Callable[..., Any], inspect.Signature] = {}


def _signature(function: Callable[..., Any]) -> inspect.Signature:
    signature = _signatures.get(function)
    if signature is None:
        signature = _signatures[function] = inspect.signature(function)
    return signature
