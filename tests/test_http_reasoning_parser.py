"""Streamed chat with masks and logprobs on a real ``vllm serve --reasoning-parser qwen3``.

vLLM emits no chunk for an engine output its parser holds back (a lone ``</think>``), and drops
that output's logprobs with it; masks must not leave the rows of such tokens beside a short
``logprobs.content``. The tiny model's tokenizer gets ``<think>`` / ``</think>`` as special
tokens (ids inside the model's padded vocabulary), and ``logit_bias`` makes every sampled token
``</think>``.
"""

from __future__ import annotations

import shutil

import pytest

from http_server import MASK_FLAGS, running_server, sse_events

pytestmark = pytest.mark.slow

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def thinking_model(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """A copy of the tiny model whose tokenizer knows the think tags; ``(dir, </think> id)``."""
    from transformers import AutoTokenizer

    model = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.save_pretrained(model)
    return str(model), tokenizer.convert_tokens_to_ids("</think>")


def test_held_back_tokens_keep_their_logprobs(thinking_model: tuple[str, int],
                                              subprocess_env: dict[str, str]) -> None:
    model, think_end = thinking_model
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "top_k": 8,
            "max_tokens": MAX_TOKENS, "stream": True, "logprobs": True, "top_logprobs": 1,
            "return_sampling_mask": True, "logit_bias": {str(think_end): 100}}
    with running_server(model, subprocess_env, (*MASK_FLAGS, "--reasoning-parser", "qwen3")) as server, \
            server.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = [event["choices"][0] for event in sse_events(response)
                  if isinstance(event, dict) and event.get("choices")]
    generated = [chunk for chunk in chunks if chunk.get("token_ids")]
    token_ids = [token for chunk in generated for token in chunk["token_ids"]]
    assert token_ids == [think_end] * MAX_TOKENS
    for chunk in generated:
        content = chunk["logprobs"]["content"]
        assert len(content) == len(chunk["token_ids"]) == len(chunk["sampling_mask"]), chunk
        for token, row in zip(chunk["token_ids"], chunk["sampling_mask"]):
            assert token in row
    # Not vacuous: the parser held the first </think> back (vLLM would have sent no chunk).
    assert generated[0]["delta"] == {}
