"""The HTTP layer without a server: request fields, SSE chunk rewriting, the first-event error
check, and that the serving wrappers hand requests that don't ask straight to vLLM."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_sampling_mask.compact_format import decode_compact
from vllm_sampling_mask.entrypoints.mask_fields import (
    DISABLED,
    MaskFieldError,
    MaskOptions,
    parse_mask_options,
)
from vllm_sampling_mask.entrypoints.sse import StreamMasks

# ------------------------------------------------------------------ request fields


@pytest.mark.parametrize("fields,engine,default,expected", [
    (None, True, False, DISABLED),
    ({}, True, True, MaskOptions(True, "json")),  # TITO on a mask server
    ({"return_sampling_mask": None}, True, True, MaskOptions(True, "json")),
    ({"return_sampling_mask": False}, True, True, DISABLED),
    ({"return_sampling_mask": True}, True, False, MaskOptions(True, "json")),
    ({"return_sampling_mask": True, "sampling_mask_format": "compact"}, True, False,
     MaskOptions(True, "compact")),
    ({"sampling_mask_format": "compact"}, True, False, DISABLED),  # format alone asks nothing
    ({"sampling_mask_format": "compact"}, False, False, DISABLED),
    ({"return_sampling_mask": False}, False, False, DISABLED),
])
def test_parse_mask_options(fields, engine, default, expected) -> None:
    assert parse_mask_options(fields, engine_enabled=engine, default_enabled=default) == expected


@pytest.mark.parametrize("fields,parameter,match", [
    ({"return_sampling_mask": "yes"}, "return_sampling_mask", "must be a boolean.*'yes' \\(str\\)"),
    ({"return_sampling_mask": 1}, "return_sampling_mask", "must be a boolean"),
    ({"return_sampling_mask": 0}, "return_sampling_mask", "must be a boolean"),
    ({"return_sampling_mask": [True]}, "return_sampling_mask", "must be a boolean"),
    ({"sampling_mask_format": "xml"}, "sampling_mask_format", "one of 'json', 'compact', got 'xml'"),
    ({"sampling_mask_format": "JSON"}, "sampling_mask_format", "one of"),
    ({"sampling_mask_format": 3}, "sampling_mask_format", "one of"),
    ({"sampling_mask_format": ["json"]}, "sampling_mask_format", "one of"),
])
def test_malformed_fields_name_the_parameter(fields, parameter, match) -> None:
    for engine in (True, False):
        with pytest.raises(MaskFieldError, match=match) as caught:
            parse_mask_options(fields, engine_enabled=engine)
        assert caught.value.parameter == parameter


def test_asking_a_server_without_the_switch_says_how_to_start_it() -> None:
    with pytest.raises(MaskFieldError, match="--return-sampling-mask") as caught:
        parse_mask_options({"return_sampling_mask": True}, engine_enabled=False)
    assert caught.value.parameter == "return_sampling_mask"


def test_render() -> None:
    rows = [[1, 5], [2]]
    assert MaskOptions(True, "json").render(rows) == rows
    assert MaskOptions(True, "json").render(((1, 5), (2,))) == rows
    packed = MaskOptions(True, "compact").render(rows)
    assert packed["encoding"] == "csr-delta-varint-base64" and decode_compact(packed) == rows


def test_render_of_a_whole_mask_reads_its_bytes_without_decoding_them() -> None:
    # A completion's mask as the engine attaches it: int32 bytes, a live buffer for CUMULATIVE
    # outputs. The compact dict comes from its CSR arrays; its rows stay undecoded.
    from array import array

    from vllm_sampling_mask.outputs import SamplingMask

    rows = [[1, 5, 151935], [2], []]
    blob = bytearray(array("i", [i for row in rows for i in row]).tobytes())
    live = SamplingMask.from_wire(array("i", [len(row) for row in rows]), blob)
    assert MaskOptions(True, "compact").render(live) == MaskOptions(True, "compact").render(rows)
    assert live._rows is None  # not decoded
    assert MaskOptions(True, "json").render(live) == rows
    assert MaskOptions(True, "compact").render(SamplingMask(rows)) == MaskOptions(
        True, "compact").render(rows)
    assert decode_compact(MaskOptions(True, "compact").render(SamplingMask([]))) == []


# ------------------------------------------------------------------ SSE rewriting


def event(**chunk: Any) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


def payload(text: str) -> dict[str, Any]:
    assert text.startswith("data: ") and text.endswith("\n\n")
    return json.loads(text[len("data: "):])


def test_rewrite_puts_each_choices_pending_rows_into_its_next_chunk() -> None:
    masks = StreamMasks(MaskOptions(True, "json"))
    masks.add(0, [7], [[3, 7]])
    masks.add(1, [9, 4], [[9], [1, 4]])
    role = event(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}])
    assert masks.rewrite(role) == role  # no token_ids key: not an output chunk
    out = payload(masks.rewrite(event(id="x", choices=[{"index": 1, "text": "a", "token_ids": None}])))
    assert out == {"id": "x", "choices": [{"index": 1, "text": "a", "token_ids": [9, 4],
                                           "sampling_mask": [[9], [1, 4]]}]}
    # A chunk vLLM skipped for choice 0: its tokens ride in the next one.
    masks.add(0, [8], [[8, 10]])
    out = payload(masks.rewrite(event(choices=[{"index": 0, "token_ids": [8]}])))
    assert out["choices"][0]["token_ids"] == [7, 8]
    assert out["choices"][0]["sampling_mask"] == [[3, 7], [8, 10]]
    assert masks.pending_rows == 0
    # A final chunk with no new tokens still reports (empty) lists.
    out = payload(masks.rewrite(event(choices=[{"index": 0, "token_ids": [], "finish_reason": "stop"}])))
    assert out["choices"][0]["token_ids"] == [] and out["choices"][0]["sampling_mask"] == []


@pytest.mark.parametrize("text", [
    "data: [DONE]\n\n",
    'data: {"error":{"message":"x","code":400}}\n\n',
    'data: {"choices":[],"usage":{"prompt_tokens":1}}\n\n',
    "data: not json\n\n",
    ": keep-alive\n\n",
], ids=["done", "error", "usage", "not_json", "comment"])
def test_rewrite_leaves_other_events_alone(text: str) -> None:
    masks = StreamMasks(MaskOptions(True, "json"))
    masks.add(0, [1], [[1]])
    assert masks.rewrite(text) is text
    assert masks.pending_rows == 1


def test_rewrite_compact_per_chunk_and_non_ascii_text() -> None:
    masks = StreamMasks(MaskOptions(True, "compact"))
    masks.add(0, [5, 6], [[5], [2, 6, 151935]])
    out = masks.rewrite(event(choices=[{"index": 0, "text": "é✓", "token_ids": None}]))
    assert "é✓" in out
    choice = payload(out)["choices"][0]
    assert decode_compact(choice["sampling_mask"]) == [[5], [2, 6, 151935]]


def test_add_refuses_rows_that_do_not_match_the_tokens() -> None:
    with pytest.raises(RuntimeError, match="2 rows for 1 new tokens"):
        StreamMasks(MaskOptions(True, "json")).add(0, [1], [[1], [2]])


def test_rewrite_stream_closes_its_source_and_warns_on_unsent_rows(caplog) -> None:
    closed = []

    async def source():
        try:
            yield event(choices=[{"index": 0, "token_ids": None}])
            yield event(choices=[{"index": 0, "token_ids": None}])
        finally:
            closed.append(True)

    async def consume(first_only: bool) -> list[str]:
        masks = StreamMasks(MaskOptions(True, "json"))
        masks.add(0, [1], [[1]])
        stream = masks.rewrite_stream(source())
        out = [await stream.__anext__()]
        if first_only:
            await stream.aclose()  # a client that went away
        else:
            masks.add(1, [2], [[2]])  # a choice no chunk ever reports
            out += [e async for e in stream]
        return out

    assert len(asyncio.run(consume(first_only=True))) == 1 and closed == [True]
    with caplog.at_level(logging.WARNING, logger="vllm_sampling_mask"):
        assert len(asyncio.run(consume(first_only=False))) == 2
    assert "1 rows of a finished stream were never sent" in caplog.text


# ------------------------------------------------------------------ serving helpers and wrappers


class FakeServing:
    def __init__(self, enabled: bool):
        config = SimpleNamespace(additional_config={"return_sampling_mask": enabled})
        self.engine_client = SimpleNamespace(vllm_config=config)
        self.parser_cls = None
        self.errors: list[dict[str, Any]] = []

    def create_error_response(self, message, err_type="BadRequestError", status_code=400, param=None):
        error = {"message": message, "type": err_type, "code": int(status_code), "param": param}
        self.errors.append(error)
        return SimpleNamespace(error=error)


def test_error_before_stream() -> None:
    from vllm_sampling_mask.entrypoints.serving import error_before_stream

    async def stream(*events: str):
        for e in events:
            yield e

    async def run(*events: str) -> Any:
        serving = FakeServing(True)
        result = await error_before_stream(serving, stream(*events))
        if hasattr(result, "error"):
            return result.error
        return [e async for e in result]

    error = ('data: {"error": {"message": "top_k must be > 0", "type": "BadRequestError", '
             '"param": null, "code": 400}}\n\n')
    assert asyncio.run(run(error, "data: [DONE]\n\n")) == {
        "message": "top_k must be > 0", "type": "BadRequestError", "code": 400, "param": None}
    assert asyncio.run(run("data: {}\n\n", error)) == ["data: {}\n\n", error]  # too late to change
    assert asyncio.run(run()) == []
    not_a_stream = object()
    assert asyncio.run(error_before_stream(FakeServing(True), not_a_stream)) is not_a_stream


def _run(coro):
    return asyncio.run(coro)


def test_wrappers_pass_requests_that_do_not_ask_straight_to_vllm() -> None:
    from vllm_sampling_mask.entrypoints import chat_completion, completion, sse, token_in_token_out

    sentinel = object()
    request = SimpleNamespace(model_extra={}, stream=False, include_reasoning=True, n=None)

    async def create(self, request, raw_request=None):
        return sentinel

    def build(self, request, *args, **kwargs):
        return sentinel

    for serving in (FakeServing(True), FakeServing(False)):
        assert _run(completion.wrap_create_completion(create)(serving, request)) is sentinel
        assert _run(chat_completion.wrap_create_chat_completion(create)(serving, request)) is sentinel
        # No options in scope (a request that did not ask): vLLM's builders, results untouched.
        assert completion.wrap_request_output_to_completion_response(build)(serving, [], request) is sentinel
        assert completion.wrap_completion_stream_generator(build)(serving, request) is sentinel
        assert sse.wrap_request_output_stream(build)(serving, request) is sentinel
    # TITO on a server without the switch: nothing to read from the body either.
    tito = token_in_token_out.wrap_serve_tokens(create)
    assert _run(tito(FakeServing(False), request, None)) is sentinel


def test_wrappers_answer_400_for_malformed_fields() -> None:
    from vllm_sampling_mask.entrypoints import chat_completion, completion, token_in_token_out

    async def never(self, request, raw_request=None):
        raise AssertionError("vLLM must not see a malformed request")

    bad = SimpleNamespace(model_extra={"return_sampling_mask": "yes"}, include_reasoning=True)
    for wrap in (completion.wrap_create_completion, chat_completion.wrap_create_chat_completion):
        serving = FakeServing(True)
        _run(wrap(never)(serving, bad))
        assert serving.errors[0]["param"] == "return_sampling_mask"

    class RawRequest:
        async def json(self):
            return {"token_ids": [1], "sampling_mask_format": "xml"}

    serving = FakeServing(True)
    _run(token_in_token_out.wrap_serve_tokens(never)(serving, SimpleNamespace(), RawRequest()))
    assert serving.errors[0]["param"] == "sampling_mask_format"


def test_chat_refuses_masks_when_reasoning_is_hidden() -> None:
    from vllm_sampling_mask.entrypoints import chat_completion

    async def never(self, request, raw_request=None):
        raise AssertionError("must be refused")

    serving = FakeServing(True)
    serving.parser_cls = object
    request = SimpleNamespace(model_extra={"return_sampling_mask": True}, include_reasoning=False)
    _run(chat_completion.wrap_create_chat_completion(never)(serving, request))
    assert "include_reasoning" in serving.errors[0]["message"]


def test_tito_response_declares_the_mask_field() -> None:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateResponse,
        GenerateResponseChoice,
    )

    from vllm_sampling_mask.entrypoints.token_in_token_out import GenerateResponseWithMasks, with_masks

    response = GenerateResponse(request_id="r", choices=[
        GenerateResponseChoice(index=0, token_ids=[4, 2], finish_reason="length")])
    from vllm_sampling_mask.outputs import SamplingMask

    output = SimpleNamespace(index=0, token_ids=[4, 2], sampling_mask=SamplingMask([[1, 4], [2]]))
    for options, expected in ((MaskOptions(True, "json"), [[1, 4], [2]]),
                              (MaskOptions(True, "compact"), None)):
        rebuilt = with_masks(response, {0: output}, options)
        assert isinstance(rebuilt, GenerateResponseWithMasks) and isinstance(rebuilt, GenerateResponse)
        dumped = rebuilt.model_dump()
        mask = dumped["choices"][0].pop("sampling_mask")
        assert dumped == response.model_dump()  # everything else is vLLM's
        assert (mask if expected is not None else decode_compact(mask)) == [[1, 4], [2]]


def test_rows_of_refuses_a_missing_or_misaligned_mask() -> None:
    from vllm_sampling_mask.entrypoints.serving import mask_of, rows_of
    from vllm_sampling_mask.outputs import SamplingMask

    assert rows_of(SimpleNamespace(index=0, token_ids=[], sampling_mask=None)) == []
    assert len(mask_of(SimpleNamespace(index=0, token_ids=[], sampling_mask=None))) == 0
    for read in (rows_of, mask_of):
        with pytest.raises(RuntimeError, match="no sampling mask"):
            read(SimpleNamespace(index=0, token_ids=[1], sampling_mask=None))
        with pytest.raises(RuntimeError, match="1 mask rows for 2 tokens"):
            read(SimpleNamespace(index=0, token_ids=[1, 2], sampling_mask=SamplingMask([[1]])))


@pytest.mark.parametrize("stream,logprobs,parser,forced", [
    (True, True, True, True),  # the one case vLLM would drop logprobs of held-back tokens
    (True, False, True, False),
    (False, True, True, False),
    (True, True, False, False),  # no parser: vLLM sends a chunk for every engine output
])
def test_streamed_chat_with_logprobs_and_a_parser_sends_every_chunk(
        stream: bool, logprobs: bool, parser: bool, forced: bool) -> None:
    from vllm_sampling_mask.entrypoints import chat_completion

    seen: list[Any] = []

    async def vllm_chat(self, request, raw_request=None):
        seen.append(request.return_token_ids)
        return "response"

    serving = FakeServing(True)
    serving.parser_cls = object if parser else None
    request = SimpleNamespace(model_extra={"return_sampling_mask": True}, include_reasoning=True,
                              stream=stream, logprobs=logprobs, return_token_ids=False,
                              n=None, vllm_xargs=None)
    _run(chat_completion.wrap_create_chat_completion(vllm_chat)(serving, request))
    assert serving.errors == [] and seen == [forced]


@pytest.mark.parametrize("stream, params, expected", [
    (False, {}, "FINAL_ONLY"),  # masks, default output kind: the last output only
    (False, {"output_kind": 1}, "DELTA"),  # the client's choice stands
    (False, {"extra_args": {"return_sampling_mask": False}}, "CUMULATIVE"),  # no masks: vLLM's
    (True, {}, "CUMULATIVE"),  # streamed: vLLM itself makes it DELTA later
])
def test_tito_non_streamed_masked_requests_ask_for_the_final_output_only(stream, params,
                                                                         expected) -> None:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.sampling_params import RequestOutputKind

    from vllm_sampling_mask.entrypoints.token_in_token_out import wrap_serve_tokens

    seen = []

    async def serve_tokens(self: Any, request: Any, raw_request: Any = None) -> str:
        seen.append(request.sampling_params.output_kind)
        return "response"

    serving = SimpleNamespace(engine_client=SimpleNamespace(vllm_config=SimpleNamespace(
        additional_config={"return_sampling_mask": True})))
    request = GenerateRequest.model_validate({"token_ids": [5, 6, 7], "stream": stream,
                                              "sampling_params": {"max_tokens": 4, **params}})
    assert asyncio.run(wrap_serve_tokens(serve_tokens)(serving, request)) == "response"
    assert seen == [RequestOutputKind[expected]]


# ------------------------------------------------------------------ response bodies


def test_bodies_with_masks_are_written_by_msgspec_and_others_as_stock() -> None:
    # The routers' JSONResponse (patched): a body whose choices carry sampling_mask is the same
    # JSON, written by msgspec; any other body is Starlette's bytes exactly.
    import importlib

    from fastapi.responses import JSONResponse

    from vllm_sampling_mask.entrypoints.json_response import carries_masks, mask_json_response

    response_type = mask_json_response(JSONResponse)
    for module in ("vllm.entrypoints.scale_out.token_in_token_out.api_router",
                   "vllm.entrypoints.openai.completion.api_router",
                   "vllm.entrypoints.openai.chat_completion.api_router"):
        assert importlib.import_module(module).JSONResponse is response_type, module
    compact = MaskOptions(True, "compact").render([[1, 5, 9], [2]])
    choice = {"index": 0, "token_ids": [5, 2], "logprobs": {"content": [{"logprob": -0.25}]},
              "finish_reason": "length"}
    bodies = [
        {"id": "cmpl-1", "choices": [{**choice, "sampling_mask": [[1, 5, 9], [2]]}],
         "prompt_logprobs": [None, {7: {"logprob": -1.5}}]},
        {"id": "cmpl-2", "choices": [{**choice, "sampling_mask": compact},
                                     {**choice, "index": 1, "sampling_mask": compact}]},
    ]
    for body in bodies:
        assert carries_masks(body)
        rendered = response_type(content=body).body
        assert json.loads(rendered) == json.loads(JSONResponse(content=body).body)
    for body in [{"id": "cmpl-3", "choices": [choice]}, {"error": {"message": "bad", "code": 400}},
                 {"choices": []}, [1, 2], None]:
        assert not carries_masks(body)
        assert response_type(content=body).body == JSONResponse(content=body).body
    # A NaN logprob (a row that keeps nothing) is null, where json.dumps refuses the response.
    nan_body = {"choices": [{**choice, "logprobs": {"content": [{"logprob": float("nan")}]},
                             "sampling_mask": [[], []]}]}
    assert json.loads(response_type(content=nan_body).body)["choices"][0]["logprobs"] == {
        "content": [{"logprob": None}]}
    with pytest.raises(ValueError):
        JSONResponse(content=nan_body)


def test_render_sends_a_mask_kept_as_delta_varints_as_it_is() -> None:
    """A compact response's mask whose rows were encoded as they arrived is sent without
    encoding them again (nor decoding them); JSON lists decode it."""
    from array import array

    from vllm_sampling_mask.engine.output_processor import RequestMaskRows

    rows = [[1, 5, 151935], [2], [], [0, 7]]
    holder = RequestMaskRows(final_only=True, varint=True)
    for row in rows:
        holder.append(array("i", row).tobytes())
    mask = holder.take_last(len(rows))
    assert mask.delta_varint() is not None
    compact = MaskOptions(True, "compact")
    assert compact.renders_delta_varint and not MaskOptions(True, "json").renders_delta_varint
    assert compact.render(mask) == compact.render(rows)
    assert mask._rows is None  # not decoded
    assert MaskOptions(True, "json").render(mask) == rows
