"""Sampling masks over HTTP, against one real ``vllm serve --return-sampling-mask`` (CPU: MRV2
under the Triton interpreter; GPU: the real thing).

Covers ``/inference/v1/generate`` (TITO), ``/v1/completions`` and ``/v1/chat/completions``,
streaming and not, JSON and compact; that requests which don't ask get vLLM's bytes; that bad
requests get HTTP 400 and the server keeps serving; and that 50 streams dropped mid-way (and
non-streaming clients that time out) leave no per-request mask state (the
``vllm_sampling_mask:held_*`` gauges on ``/metrics``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from http_server import Server, sse_events, sse_raw
from mask_invariants import mask_problems

pytestmark = pytest.mark.slow

TOP_K = 20
SAMPLING = {"temperature": 1.0, "top_k": TOP_K, "top_p": 0.95}
PROMPT_IDS = [5, 6, 7, 8, 100, 200, 300]
CHAT = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def server(mask_server: Server) -> Server:
    return mask_server


@pytest.fixture(scope="module")
def vocab_size(tiny_model_dir: str) -> int:
    return json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def client(server: Server):
    with server.client() as c:
        yield c


def decoded(mask: Any) -> list[list[int]]:
    from vllm_sampling_mask.compact_format import decode_compact

    return decode_compact(mask) if isinstance(mask, dict) else mask


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_choices(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[int, dict[str, list]]:
    """Concatenated ``token_ids`` / decoded ``sampling_mask`` per choice index of a stream."""
    per_choice: dict[int, dict[str, list]] = {}
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        assert "error" not in event, event
        for choice in event["choices"]:
            if "token_ids" not in choice:  # chat role chunk
                assert "sampling_mask" not in choice
                continue
            rows = decoded(choice["sampling_mask"])
            assert len(rows) == len(choice["token_ids"]), choice  # rows of exactly its tokens
            acc = per_choice.setdefault(choice["index"], {"token_ids": [], "rows": []})
            acc["token_ids"] += choice["token_ids"]
            acc["rows"] += rows
    return per_choice


# ------------------------------------------------------------------ /inference/v1/generate


# vLLM 0.26's TITO endpoint mishandles n > 1, with or without this plugin: non-streaming with the
# default CUMULATIVE output kind it returns only the last child's choice (FINAL_ONLY, 2, returns
# all of them), and streaming fails with IndexError. A non-streamed request with masks and the
# default output kind runs FINAL_ONLY, so it gets every choice.
FINAL_ONLY = 2


def tito_body(**extra: Any) -> dict[str, Any]:
    params = {**SAMPLING, "max_tokens": 12, "seed": 11, **extra.pop("params", {})}
    return {"token_ids": PROMPT_IDS, "sampling_params": params, **extra}


@pytest.mark.parametrize("params", [{"n": 2, "output_kind": FINAL_ONLY, "logprobs": 1},
                                    {"n": 2}, {"seed": None}],
                         ids=["n2_final_only_logprobs", "n2_default_output_kind", "n1_unseeded"])
def test_tito_every_choice_carries_its_mask(client, vocab_size, params) -> None:
    body = post(client, "/inference/v1/generate", tito_body(params=params))
    assert len(body["choices"]) == params.get("n", 1)
    for choice in body["choices"]:
        assert choice["token_ids"], choice
        assert mask_problems(choice["token_ids"], choice["sampling_mask"], vocab_size) == []
        assert all(len(row) >= 1 for row in choice["sampling_mask"])
        if params.get("logprobs"):
            assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])


def test_tito_stream_concatenates_to_the_full_response(client) -> None:
    full = post(client, "/inference/v1/generate", tito_body())
    streamed = stream_choices(client, "/inference/v1/generate", tito_body())
    assert sorted(streamed) == [0]
    for choice in full["choices"]:
        # Seeded: the stream samples the same tokens, so the rows must be equal too.
        assert streamed[choice["index"]]["token_ids"] == choice["token_ids"]
        assert streamed[choice["index"]]["rows"] == choice["sampling_mask"]


def test_tito_compact_decodes_to_the_json_rows(client) -> None:
    as_json = post(client, "/inference/v1/generate", tito_body())
    compact = post(client, "/inference/v1/generate", tito_body(sampling_mask_format="compact"))
    streamed = stream_choices(client, "/inference/v1/generate", tito_body(sampling_mask_format="compact"))
    for j, c in zip(as_json["choices"], compact["choices"]):
        assert c["sampling_mask"]["encoding"] == "csr-delta-varint-base64"
        assert c["token_ids"] == j["token_ids"]
        assert decoded(c["sampling_mask"]) == j["sampling_mask"]
        assert streamed[j["index"]]["rows"] == j["sampling_mask"]


def test_tito_request_can_opt_out(client) -> None:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateResponseChoice

    body = post(client, "/inference/v1/generate", tito_body(return_sampling_mask=False))
    for choice in body["choices"]:
        assert list(choice) == list(GenerateResponseChoice.model_fields)


def test_tito_request_can_opt_out_through_its_extra_args(client) -> None:
    """The Python API's opt-out inside ``sampling_params`` works over HTTP too (a greedy request
    is then served without a mask); the top-level field, when given, wins."""
    greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    body = tito_body(params={**greedy, "extra_args": {"return_sampling_mask": False}})
    for choice in post(client, "/inference/v1/generate", body)["choices"]:
        assert choice["token_ids"] and choice.get("sampling_mask") is None
    body = tito_body(return_sampling_mask=True, params={"extra_args": {"return_sampling_mask": False}})
    for choice in post(client, "/inference/v1/generate", body)["choices"]:
        assert len(choice["sampling_mask"]) == len(choice["token_ids"])
    bad = client.post("/inference/v1/generate",
                      json=tito_body(params={"extra_args": {"return_sampling_mask": "no"}}))
    assert bad.status_code == 400 and "extra_args.return_sampling_mask" in bad.text


def test_other_endpoints_opt_out_with_vllm_xargs(client) -> None:
    """``/v1/responses`` has no mask field, so on a mask server its requests are mask requests
    (greedy: 400) unless ``vllm_xargs`` opts out; pydantic parses that ``false`` as ``0``."""
    body = {"input": "Hello", "temperature": 0.0, "max_output_tokens": 4}
    refused = client.post("/v1/responses", json=body)
    assert refused.status_code == 400 and "temperature must be > 0" in refused.text
    served = client.post("/v1/responses", json={
        **body, "vllm_xargs": {"return_sampling_mask": False}})
    assert served.status_code == 200, served.text
    assert served.json()["status"] == "incomplete"  # reached max_output_tokens, not an error


# ------------------------------------------------------------------ OpenAI endpoints


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"prompt": ["Hello world", "kalo mitor"], "n": 2, "max_tokens": 10, "seed": 5,
            **SAMPLING, **extra}


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"messages": CHAT, "n": 2, "max_tokens": 10, "seed": 5, **SAMPLING, **extra}


OPENAI = [("/v1/completions", completion_body, 4), ("/v1/chat/completions", chat_body, 2)]


def _response_model(path: str, streaming: bool) -> Any:
    if path == "/v1/completions":
        from vllm.entrypoints.openai.completion import protocol
        return protocol.CompletionStreamResponse if streaming else protocol.CompletionResponse
    from vllm.entrypoints.openai.chat_completion import protocol
    return protocol.ChatCompletionStreamResponse if streaming else protocol.ChatCompletionResponse


@pytest.mark.parametrize("path,make_body,_", OPENAI, ids=["completions", "chat"])
def test_openai_without_the_field_is_vllms_response(client, path, make_body, _) -> None:
    response = client.post(path, json=make_body())
    assert response.status_code == 200, response.text
    assert b'"sampling_mask"' not in response.content
    # Byte for byte what vLLM's own response model serialises for these values (JSONResponse).
    model = _response_model(path, streaming=False).model_validate_json(response.content)
    expected = json.dumps(model.model_dump(), ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode()
    assert response.content == expected
    assert all(choice.get("token_ids") is None for choice in response.json()["choices"])

    with client.stream("POST", path, json=make_body(stream=True)) as streamed:
        chunks = sse_raw(streamed)
    stream_model = _response_model(path, streaming=True)
    for raw in chunks:
        assert '"sampling_mask"' not in raw
        chunk = stream_model.model_validate_json(raw)
        assert raw in (chunk.model_dump_json(exclude_unset=True),
                       chunk.model_dump_json(exclude_unset=True, exclude_none=True)), raw


@pytest.mark.parametrize("path,make_body,num_choices", OPENAI, ids=["completions", "chat"])
def test_openai_with_the_field(client, vocab_size, path, make_body, num_choices) -> None:
    plain = post(client, path, make_body())
    body = post(client, path, make_body(return_sampling_mask=True))
    assert len(body["choices"]) == num_choices
    for before, choice in zip(plain["choices"], body["choices"]):
        # Same seed: asking for masks changes nothing about what is generated.
        assert choice.get("text", choice.get("message")) == before.get("text", before.get("message"))
        assert mask_problems(choice["token_ids"], choice["sampling_mask"], vocab_size) == []

    streamed = stream_choices(client, path, make_body(return_sampling_mask=True))
    compact = post(client, path, make_body(return_sampling_mask=True, sampling_mask_format="compact"))
    compact_streamed = stream_choices(client, path, make_body(return_sampling_mask=True,
                                                              sampling_mask_format="compact"))
    for choice, packed in zip(body["choices"], compact["choices"]):
        i = choice["index"]
        assert streamed[i]["token_ids"] == choice["token_ids"]
        assert streamed[i]["rows"] == choice["sampling_mask"]
        assert packed["token_ids"] == choice["token_ids"]
        assert decoded(packed["sampling_mask"]) == choice["sampling_mask"]
        assert compact_streamed[i]["rows"] == choice["sampling_mask"]


def test_openai_field_keeps_return_token_ids_and_echo(client) -> None:
    body = post(client, "/v1/completions", completion_body(
        n=1, return_sampling_mask=True, return_token_ids=True, echo=True))
    for choice in body["choices"]:
        assert choice["prompt_token_ids"]  # vLLM's own field still there
        assert len(choice["sampling_mask"]) == len(choice["token_ids"])


# ------------------------------------------------------------------ bad requests


BAD_PARAMS = [
    ("temperature", {"temperature": 0.0}),
    ("top_k", {"top_k": None}),
    ("top_k", {"top_k": 0}),
    ("top_k", {"top_k": -1}),
]
BAD_FIELDS = [
    ("sampling_mask_format", {"sampling_mask_format": "xml"}),
    ("sampling_mask_format", {"sampling_mask_format": 3}),
    ("return_sampling_mask", {"return_sampling_mask": "yes"}),
    ("return_sampling_mask", {"return_sampling_mask": 1}),
]


def _bad_body(path: str, params: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    if path == "/inference/v1/generate":
        body = tito_body(**fields)
        body["sampling_params"].update(params)
        body["sampling_params"] = {k: v for k, v in body["sampling_params"].items() if v is not None}
        return body
    make = completion_body if path == "/v1/completions" else chat_body
    body = make(return_sampling_mask=True, n=1, **params)
    body.update(fields)
    return {k: v for k, v in body.items() if v is not None}


@pytest.mark.parametrize("path", ["/inference/v1/generate", "/v1/completions", "/v1/chat/completions"])
def test_bad_requests_get_400_and_the_server_keeps_serving(client, vocab_size, path) -> None:
    cases = [(name, params, {}) for name, params in BAD_PARAMS]
    cases += [(name, {}, fields) for name, fields in BAD_FIELDS]
    for name, params, fields in cases:
        for stream in (False, True):
            body = {**_bad_body(path, params, fields), "stream": stream}
            response = client.post(path, json=body)
            assert response.status_code == 400, (name, params, fields, stream, response.text)
            assert name in response.json()["error"]["message"], response.text
    body = post(client, path, _bad_body(path, {}, {}))
    for choice in body["choices"]:
        assert mask_problems(choice["token_ids"], choice["sampling_mask"], vocab_size) == []


def test_requests_without_masks_are_not_checked(client) -> None:
    """On a mask server, requests that don't ask for masks are vLLM's: greedy and without top_k
    they are served (not a 400), with no mask."""
    greedy = {"temperature": 0.0, "top_k": None, "top_p": None}
    for path, make in (("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)):
        body = {k: v for k, v in make(n=1, **greedy).items() if v is not None}
        for choice in post(client, path, body)["choices"]:
            assert "sampling_mask" not in choice
    body = tito_body(return_sampling_mask=False)
    body["sampling_params"] = {k: v for k, v in {**body["sampling_params"], **greedy}.items()
                               if v is not None}
    for choice in post(client, "/inference/v1/generate", body)["choices"]:
        assert choice["token_ids"] and choice.get("sampling_mask") is None


# ------------------------------------------------------------------ dropped streams


async def _drop_after(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                      chunks: int) -> tuple[int, bool]:
    """Read ``chunks`` events, then drop the connection; returns (events read, finished first)."""
    seen, finished = 0, False
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                finished = finished or '"finish_reason":"' in line or line == "data: [DONE]"
                if seen >= chunks:
                    break  # leaving the block closes the connection mid-stream
    return seen, finished


# Long enough that no stream ends before it is dropped (dropped streams cost only a few steps).
DROP_MAX_TOKENS = 128


def _drop_bodies(n: int) -> list[tuple[str, dict[str, Any]]]:
    long = {"max_tokens": DROP_MAX_TOKENS, "ignore_eos": True}
    kinds = [
        ("/inference/v1/generate", {"token_ids": PROMPT_IDS, "sampling_params": {**SAMPLING, **long}}),
        ("/v1/completions", {"prompt": "Hello", **SAMPLING, **long, "return_sampling_mask": True}),
        ("/v1/chat/completions", {"messages": CHAT, **SAMPLING, **long, "return_sampling_mask": True,
                                  "sampling_mask_format": "compact"}),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


# Within the test server's --max-model-len 512: a stream long enough to be scraped mid-way.
GAUGE_MAX_TOKENS = 400


def _held(server: Server) -> tuple[float, float, float]:
    metrics = server.metrics()
    in_flight = metrics.get("vllm:num_requests_running", 0) + metrics.get("vllm:num_requests_waiting", 0)
    return metrics["vllm_sampling_mask:held_requests"], metrics["vllm_sampling_mask:held_rows"], in_flight


def test_the_gauges_see_requests_in_flight(server) -> None:
    # A stream hands its rows out with every chunk (DELTA), so between chunks its state holds a
    # row list with no rows in it; a non-streaming request with stop strings holds every row
    # until it finishes (without, the engine core holds them and sends 256 at a time).
    # The engine does not wait for the client, so a short stream can finish before one scrape:
    # scrape after every chunk of a long one (closing it early aborts the rest).
    most_requests = 0.0
    with server.client() as c, c.stream("POST", "/v1/completions", json={
            "prompt": "Hello", **SAMPLING, "max_tokens": GAUGE_MAX_TOKENS, "ignore_eos": True,
            "return_sampling_mask": True, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                most_requests = max(most_requests, _held(server)[0])
                if most_requests >= 1 or line == "data: [DONE]":
                    break
    assert most_requests >= 1

    body = {"prompt": "Hello", **SAMPLING, "max_tokens": 32, "ignore_eos": True,
            "return_sampling_mask": True, "stop": ["<never in the text>"]}

    def complete() -> int:
        with server.client() as c:
            return c.post("/v1/completions", json=body).status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete) for _ in range(4)]
        most_rows = 0.0
        while not all(f.done() for f in futures):
            most_rows = max(most_rows, _held(server)[1])
            time.sleep(0.05)  # scrape, don't compete with the server for the CPU
        assert [f.result() for f in futures] == [200] * 4
    assert most_rows >= 1


def test_dropped_clients_leave_no_mask_state(server, client, vocab_size) -> None:
    async def drop_all() -> list[int]:
        limits = asyncio.Semaphore(10)
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as aclient:
            async def one(path: str, body: dict[str, Any], k: int) -> tuple[int, bool]:
                async with limits:
                    return await _drop_after(aclient, path, body, chunks=2 + k % 3)
            return await asyncio.gather(*(one(p, b, k) for k, (p, b) in enumerate(_drop_bodies(50))))

    results = asyncio.run(drop_all())
    assert len(results) == 50
    assert all(seen >= 2 and not finished for seen, finished in results), results

    # Non-streaming clients that give up (time out) before the response: also aborted and freed.
    with httpx.Client(base_url=server.url, timeout=1.0) as impatient:
        for path, body in _drop_bodies(6):
            with pytest.raises(httpx.TimeoutException):
                impatient.post(path, json=body)

    deadline = time.monotonic() + 120  # aborts reach the engine asynchronously
    while True:
        held_requests, held_rows, in_flight = _held(server)
        if (held_requests, held_rows, in_flight) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert (held_requests, held_rows, in_flight) == (0, 0, 0)

    body = post(client, "/inference/v1/generate", tito_body())
    for choice in body["choices"]:
        assert mask_problems(choice["token_ids"], choice["sampling_mask"], vocab_size) == []
    assert "were never sent" not in server.log()


# ------------------------------------------------------------------ values that break masks or MRV2


def _raw_post(client: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return client.post(path, content=raw, headers={"content-type": "application/json"})


# Sent as raw bytes: Python's JSON encoder would refuse NaN/Infinity only with allow_nan=False,
# and a client may send them either way.
TITO_REFUSED = [
    ("logit_bias", b'"logit_bias": {"5": NaN}'),
    ("logit_bias", b'"logit_bias": {"5": Infinity}'),
    ("logit_bias", b'"logit_bias": {"5": -Infinity}'),
    ("logit_bias", b'"logit_bias": {"5": 1e308}'),
    ("logit_bias", b'"logit_bias": {' + b", ".join(b'"%d": 1.0' % i for i in range(1025)) + b"}"),
    ("repetition_penalty", b'"repetition_penalty": 1e-40'),
    ("seed", b'"seed": 9223372036854775808'),
    ("max_tokens", b'"max_tokens": 2147483648'),
    ("max_tokens", b'"max_tokens": 9223372036854775808'),
    ("allowed_token_ids", b'"allowed_token_ids": [' + b", ".join(b"%d" % i for i in range(1025)) + b"]"),
    ("stop_token_ids", b'"min_tokens": 2, "stop_token_ids": [1000000]'),
]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_tito_values_that_would_break_the_mask_or_the_engine_get_400(server, client, vocab_size,
                                                                      stream) -> None:
    """Each is refused naming its parameter (before: 200 with the sampled token missing from its
    row, or the engine ended: every request in flight lost); the server keeps serving."""
    for parameter, field in TITO_REFUSED:
        raw = (b'{"token_ids": [5, 6, 7], "stream": %s, "sampling_params": {"temperature": 1.0, '
               b'"top_k": 20, %s}}' % (b"true" if stream else b"false", field))
        response = _raw_post(client, "/inference/v1/generate", raw)
        assert response.status_code == 400, (parameter, response.text[:500])
        assert parameter in response.json()["error"]["message"], response.text[:500]
    opted_out = (b'{"token_ids": [5, 6, 7], "return_sampling_mask": false, "sampling_params": '
                 b'{"temperature": 0.0, "seed": 9223372036854775808}}')
    response = _raw_post(client, "/inference/v1/generate", opted_out)
    assert response.status_code == 400 and "seed" in response.text  # the engine's limits: all requests
    body = post(client, "/inference/v1/generate", tito_body(params={"logit_bias": {"5": 100.0}}))
    for choice in body["choices"]:
        assert mask_problems(choice["token_ids"], choice["sampling_mask"], vocab_size) == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"])
def test_a_json_body_that_is_not_an_object_gets_400(client, path) -> None:
    for raw in (b"123", b'"x"', b"[]", b"null", b"  [1, 2]"):
        response = _raw_post(client, path, raw)
        assert response.status_code == 400, (raw, response.status_code, response.text[:300])
        assert "error" in response.json()


def test_tito_n2_stream_is_refused_up_front(client) -> None:
    response = client.post("/inference/v1/generate",
                           json=tito_body(stream=True, params={"n": 2, "output_kind": FINAL_ONLY}))
    assert response.status_code == 400, response.text[:300]
    assert "sampling_params.n must be 1 with stream: true" in response.json()["error"]["message"]
