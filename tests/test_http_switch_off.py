"""A server started WITHOUT ``--return-sampling-mask``: vLLM's endpoints, untouched, and a clear
HTTP 400 for requests that ask for masks."""

from __future__ import annotations

import json

import pytest

from http_server import running_server

pytestmark = pytest.mark.slow

SAMPLING = {"temperature": 1.0, "top_k": 20, "max_tokens": 6, "seed": 3}
TITO = {"token_ids": [5, 6, 7, 8], "sampling_params": SAMPLING}
COMPLETION = {"prompt": "Hello world", **SAMPLING}
CHAT = {"messages": [{"role": "user", "content": "hi"}], **SAMPLING}
ENDPOINTS = [("/inference/v1/generate", TITO), ("/v1/completions", COMPLETION),
             ("/v1/chat/completions", CHAT)]
IDS = ["tito", "completions", "chat"]


@pytest.fixture(scope="module")
def client(tiny_model_dir: str, subprocess_env: dict[str, str]):
    with running_server(tiny_model_dir, subprocess_env) as server, server.client() as c:
        c.server = server
        yield c


def _vllm_bytes(path: str, content: bytes) -> bytes:
    """What vLLM's own response model serialises (as JSONResponse does) for these values."""
    if path == "/inference/v1/generate":
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateResponse as Model
    elif path == "/v1/completions":
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse as Model
    else:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse as Model
    dumped = Model.model_validate_json(content).model_dump()
    return json.dumps(dumped, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _greedy(path: str, body: dict) -> dict:
    """``body`` with temperature 0 and no top_k (refused by a mask server, fine here)."""
    params = {k: v for k, v in SAMPLING.items() if k != "top_k"} | {"temperature": 0.0}
    if path == "/inference/v1/generate":
        return {**body, "sampling_params": params}
    return {k: v for k, v in body.items() if k not in SAMPLING} | params


@pytest.mark.parametrize("path,body", ENDPOINTS, ids=IDS)
def test_responses_are_vllms(client, path, body) -> None:
    for request in (body, {**body, "return_sampling_mask": False},
                    {**body, "sampling_mask_format": "compact"}, _greedy(path, body)):
        response = client.post(path, json=request)
        assert response.status_code == 200, (request, response.text)
        assert b'"sampling_mask"' not in response.content
        assert response.content == _vllm_bytes(path, response.content)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("path,body", ENDPOINTS, ids=IDS)
def test_asking_for_masks_is_a_400_that_says_how_to_start_the_server(client, path, body, stream) -> None:
    response = client.post(path, json={**body, "return_sampling_mask": True, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "--return-sampling-mask" in error["message"]
    assert error["param"] == "return_sampling_mask"


@pytest.mark.parametrize("path,body", ENDPOINTS, ids=IDS)
def test_malformed_fields_are_a_400_without_the_switch_too(client, path, body) -> None:
    for field, value in (("sampling_mask_format", "xml"), ("return_sampling_mask", "yes")):
        response = client.post(path, json={**body, field: value})
        assert response.status_code == 400, response.text
        assert field in response.json()["error"]["message"]
    assert client.post(path, json=body).status_code == 200


def test_no_mask_gauges_without_the_switch(client) -> None:
    assert "vllm_sampling_mask:" not in client.get("/metrics").text
