"""No request breaks a mask server: a seeded fuzz run against one real ``vllm serve
--return-sampling-mask`` (CPU: MRV2 under the Triton interpreter, the tiny model).

``FUZZ_REQUESTS`` requests, generated from a fixed seed, across ``/inference/v1/generate``,
``/v1/completions`` and ``/v1/chat/completions``: valid requests (streaming and not, JSON and
compact masks, n > 1) mixed with wrong types, nulls, huge and negative numbers, NaN / Infinity
literals (raw bytes), empty and over-long prompts, token ids outside the vocabulary, bad mask
fields, streamed n > 1, malformed JSON and bodies that are not objects. Sent 8 at a time. Pass:

- every response is a 200 or a 4xx with a JSON error body: never a 5xx, a dropped connection or
  an error event inside a 200 stream; every request built valid is a 200;
- every 200 satisfies the mask contract (one row per token, the token in its row, rows strictly
  ascending within the vocabulary), streamed chunk by chunk;
- the server never restarts (same processes, ``/health`` up after every batch);
- 50 streams dropped after their first chunk leave the held-mask gauges at 0;
- the server's resident memory (API server + engine core) grows by less than 50 MiB.

Takes ~3 minutes on a 2-core CPU machine; the server is shared with test_http_endpoints.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from http_server import Server
from mask_invariants import mask_problems

pytestmark = pytest.mark.slow

SEED = 20261201
FUZZ_REQUESTS = 300  # issue 12: at least 300
CONCURRENCY = 8
MAX_TOKENS = 8
DROPPED_STREAMS = 50
MAX_RSS_GROWTH = 50 * 2**20
TITO, COMPLETIONS, CHAT = "/inference/v1/generate", "/v1/completions", "/v1/chat/completions"
MAX_MODEL_LEN = 512  # http_server's --max-model-len


OK, REFUSED, ANY = "ok", "refused", "any"


@dataclass
class Case:
    """One request: its path, raw body, what must come back, and a label for reports.

    expect: ``OK`` (built valid: a 200 whose choices carry masks), ``REFUSED`` (invalid: a 4xx)
    or ``ANY`` (one odd value vLLM may accept or refuse: a 200 or a 4xx).
    """

    path: str
    body: bytes
    expect: str
    label: str


def _dump(body: Any) -> bytes:
    return json.dumps(body).encode()


class CaseMaker:
    """Seeded request generator: one ``Case`` per call."""

    def __init__(self, seed: int, vocab_size: int):
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    def sampling(self) -> dict[str, Any]:
        rng = self.rng
        params: dict[str, Any] = {"temperature": rng.choice([0.5, 1.0, 1.3]),
                                  "top_k": rng.choice([1, 5, 20, 50]),
                                  "max_tokens": rng.randint(1, MAX_TOKENS)}
        if rng.random() < 0.5:
            params["top_p"] = rng.choice([0.5, 0.9, 1.0])
        if rng.random() < 0.3:
            params["seed"] = rng.randrange(2**31)
        if rng.random() < 0.3:
            params["logprobs"] = rng.randint(0, 5)  # chat: turned into logprobs / top_logprobs
        if rng.random() < 0.2:
            params["min_p"] = 0.05
        if rng.random() < 0.2:
            params["logit_bias"] = {str(rng.randrange(self.vocab_size)): rng.uniform(-100, 100)}
        return params

    def valid(self, path: str) -> Case:
        rng = self.rng
        stream = rng.random() < 0.4
        params = self.sampling()
        fields: dict[str, Any] = {}
        if rng.random() < 0.3:
            fields["sampling_mask_format"] = "compact"
        if path == TITO:
            if not stream and rng.random() < 0.3:
                params.update(n=2, output_kind=2)  # FINAL_ONLY: vLLM 0.26 returns every sample
            body = {"token_ids": [rng.randrange(3, 4000) for _ in range(rng.randint(1, 20))],
                    "sampling_params": params, "stream": stream, **fields}
        else:
            body = {**params, "stream": stream, "return_sampling_mask": True, **fields}
            if not stream and rng.random() < 0.3:
                body["n"] = 2
            if path == COMPLETIONS:
                body["prompt"] = rng.choice(["Hello world", "the quick brown fox", [5, 6, 7, 8]])
            else:
                body["messages"] = [{"role": "user", "content": rng.choice(["hi", "kalo mitor"])}]
                if "logprobs" in body:
                    body.update(logprobs=True, top_logprobs=body["logprobs"])
        return Case(path, _dump(body), OK, "valid")

    def broken(self, path: str) -> Case:
        """A valid body with one thing wrong (may still be accepted: only never a 5xx)."""
        rng = self.rng
        body = json.loads(self.valid(path).body)
        params = body["sampling_params"] if path == TITO else body
        kind = rng.choice(["type", "null", "number", "literal", "prompt", "ids", "mask_field",
                           "n_stream", "json", "not_object"])
        if kind == "type":
            key = rng.choice(["temperature", "top_k", "top_p", "max_tokens", "seed", "logprobs",
                              "n", "logit_bias", "stop", "min_p"])
            params[key] = rng.choice(["hot", [1, 2], {"a": 1}, True, "", [[]]])
            return Case(path, _dump(body), ANY, f"type {key}={params[key]!r}")
        if kind == "null":
            key = rng.choice(["token_ids", "sampling_params"] if path == TITO else
                             ["prompt"] if path == COMPLETIONS else ["messages"])
            body[key] = None
            return Case(path, _dump(body), REFUSED, f"null {key}")
        if kind == "number":
            key = rng.choice(["temperature", "top_k", "top_p", "max_tokens", "seed", "logprobs",
                              "n", "min_tokens", "repetition_penalty", "presence_penalty"])
            params[key] = rng.choice([-1, 0, -(2**63) - 1, 2**31, 2**63, 2**64, 10**30, 1e308,
                                      -1e308, 1e-40])
            return Case(path, _dump(body), ANY, f"number {key}={params[key]!r}")
        if kind == "literal":  # JSON's non-standard NaN / Infinity, as raw bytes
            key = rng.choice(["temperature", "top_p", "min_p", "logit_bias", "presence_penalty"])
            literal = rng.choice(["NaN", "Infinity", "-Infinity"])
            params[key] = {"5": "@@"} if key == "logit_bias" else "@@"
            raw = _dump(body).replace(b'"@@"', literal.encode())
            # The OpenAI endpoints clamp logit_bias to [-100, 100] (NaN to -100): then valid.
            clamped = key == "logit_bias" and path != TITO
            return Case(path, raw, ANY if clamped else REFUSED, f"literal {key}={literal}")
        if kind == "prompt":
            empty = rng.random() < 0.5
            if path == TITO:
                body["token_ids"] = [] if empty else [7] * (MAX_MODEL_LEN + 50)
            elif path == COMPLETIONS:
                body["prompt"] = "" if empty else "kalo " * 2000
            else:
                body["messages"] = [] if empty else [{"role": "user", "content": "kalo " * 2000}]
            # An empty chat still has its template's tokens: a valid prompt.
            expect = ANY if empty and path == CHAT else REFUSED
            return Case(path, _dump(body), expect, f"{'empty' if empty else 'over-long'} prompt")
        if kind == "ids":
            bad_id = rng.choice([self.vocab_size, 10**6, -1, 2**31, 2**40])
            key = rng.choice(["prompt", "logit_bias", "allowed_token_ids", "stop_token_ids"])
            if key == "prompt":
                if path == TITO:
                    body["token_ids"] = [5, bad_id, 7]
                elif path == COMPLETIONS:
                    body["prompt"] = [5, bad_id, 7]
                else:
                    params["logit_bias"] = {str(bad_id): 1.0}
            elif key == "logit_bias":
                params["logit_bias"] = {str(bad_id): 1.0}
            elif key == "allowed_token_ids":
                params["allowed_token_ids"] = [5, bad_id]
            else:
                params.update(stop_token_ids=[bad_id], min_tokens=1)
            return Case(path, _dump(body), REFUSED, f"id {key}={bad_id}")
        if kind == "mask_field":
            key, value = rng.choice([("sampling_mask_format", "xml"), ("sampling_mask_format", 3),
                                     ("return_sampling_mask", "yes"), ("return_sampling_mask", 1)])
            body[key] = value
            return Case(path, _dump(body), REFUSED, f"mask field {key}={value!r}")
        if kind == "n_stream":
            params["n"] = 2
            body["stream"] = True
            params.pop("output_kind", None)
            return Case(path, _dump(body), REFUSED if path == TITO else OK, "n=2 stream")
        if kind == "json":
            raw = _dump(body)
            cut = rng.choice([raw[: len(raw) // 2], raw + b",", b"{" + raw, raw.replace(b":", b"=", 1),
                              b"not json"])
            return Case(path, cut, REFUSED, "malformed json")
        raw = rng.choice([b"123", b'"x"', b"[]", b"null", b"[" + _dump(body) + b"]", b"true"])
        return Case(path, raw, REFUSED, f"not an object {raw[:20]!r}")

    def cases(self, n: int) -> list[Case]:
        paths = [TITO, COMPLETIONS, CHAT]
        made = []
        for i in range(n):
            path = paths[i % 3]
            made.append(self.valid(path) if self.rng.random() < 0.3 else self.broken(path))
        return made


def _check_choices(choices: list[dict[str, Any]], vocab_size: int, case: Case) -> list[str]:
    from vllm_sampling_mask.compact_format import decode_compact

    problems = []
    for choice in choices:
        mask = choice.get("sampling_mask")
        if mask is None:
            if case.expect == OK and choice.get("token_ids"):
                problems.append(f"choice {choice.get('index')} has no sampling_mask")
            continue
        rows = decode_compact(mask) if isinstance(mask, dict) else mask
        problems += mask_problems(choice["token_ids"], rows, vocab_size)
    return problems


def _check_stream(lines: list[str], vocab_size: int, case: Case) -> list[str]:
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return [f"stream does not end with [DONE]: {events[-1:]}"]
    problems = []
    for raw in events[:-1]:
        event = json.loads(raw)
        if "error" in event:
            return [f"error event in a 200 stream: {raw[:300]}"]
        choices = [c for c in event.get("choices", []) if "token_ids" in c or "sampling_mask" in c]
        problems += _check_choices(choices, vocab_size, case)
    return problems


async def _send(client: httpx.AsyncClient, case: Case, vocab_size: int) -> list[str]:
    """Send one case; return its violations of the pass criteria (empty = fine)."""
    headers = {"content-type": "application/json"}
    try:
        async with client.stream("POST", case.path, content=case.body, headers=headers) as response:
            if response.status_code != 200:
                body = await response.aread()
                if not 400 <= response.status_code < 500:
                    return [f"HTTP {response.status_code}: {body[:300]!r}"]
                try:
                    error = json.loads(body)
                except ValueError:
                    error = None
                if not isinstance(error, dict):
                    return [f"HTTP {response.status_code} without a JSON object body: {body[:200]!r}"]
                if case.expect == OK:
                    return ["a valid request was refused: " + body[:300].decode(errors="replace")]
                return []
            if case.expect == REFUSED:
                return ["an invalid request was accepted (HTTP 200)"]
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                return _check_stream([line async for line in response.aiter_lines()], vocab_size, case)
            body = json.loads(await response.aread())
            return _check_choices(body.get("choices", []), vocab_size, case)
    except httpx.HTTPError as exc:  # a dropped connection, a timeout
        return [f"{type(exc).__name__}: {exc}"]


def _process_tree(pid: int) -> tuple[set[int], int]:
    """``(pids of the server's process tree, their resident memory in bytes)``."""
    import psutil

    root = psutil.Process(pid)
    processes = [root, *root.children(recursive=True)]
    return {p.pid for p in processes}, sum(p.memory_info().rss for p in processes)


def _held(server: Server) -> tuple[float, float]:
    metrics = server.metrics()
    return metrics["vllm_sampling_mask:held_requests"], metrics["vllm_sampling_mask:held_rows"]


@pytest.fixture(scope="module")
def server(mask_server: Server) -> Server:
    return mask_server  # shared with test_http_endpoints.py (conftest.py)


def test_fuzzed_requests_never_break_the_server(server: Server, tiny_model_dir: str) -> None:
    vocab_size = json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    maker = CaseMaker(SEED, vocab_size)
    warm_up = [maker.valid(path) for path in (TITO, COMPLETIONS, CHAT) for _ in range(4)]
    cases = maker.cases(FUZZ_REQUESTS)
    started = time.monotonic()

    async def run(batch: list[Case]) -> list[list[str]]:
        limit = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            async def one(case: Case) -> list[str]:
                async with limit:
                    return await _send(client, case, vocab_size)
            return await asyncio.gather(*(one(case) for case in batch))

    def healthy() -> bool:
        return httpx.get(f"{server.url}/health", timeout=30).status_code == 200

    warm_up_problems = asyncio.run(run(warm_up))
    assert not any(warm_up_problems), (warm_up_problems, server.log()[-4000:])
    processes, rss_before = _process_tree(server.pid) if server.pid else (set(), 0)
    failures: dict[str, list[str]] = {}
    for start in range(0, len(cases), 40):
        batch = cases[start:start + 40]
        for case, problems in zip(batch, asyncio.run(run(batch))):
            if problems:
                failures[f"#{cases.index(case)} {case.path} {case.label}: {case.body[:160]!r}"] = problems
        assert healthy(), f"server unhealthy after request {start + len(batch)}"
    assert not failures, json.dumps(dict(list(failures.items())[:10]), indent=1)
    assert sum(case.expect == OK for case in cases) >= 60, "too few valid requests in the mix"

    async def drop_streams() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            async def one(i: int) -> None:
                case = maker.valid([TITO, COMPLETIONS, CHAT][i % 3])
                body = json.loads(case.body)
                params = body["sampling_params"] if case.path == TITO else body
                params.update(max_tokens=128, ignore_eos=True, n=1)
                params.pop("output_kind", None)
                body["stream"] = True
                async with client.stream("POST", case.path, content=_dump(body),
                                         headers={"content-type": "application/json"}) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            break  # leaving the block drops the connection after one chunk
            limit = asyncio.Semaphore(10)

            async def limited(i: int) -> None:
                async with limit:
                    await one(i)
            await asyncio.gather(*(limited(i) for i in range(DROPPED_STREAMS)))

    asyncio.run(drop_streams())
    deadline = time.monotonic() + 120  # aborts reach the engine asynchronously
    while _held(server) != (0, 0) and time.monotonic() < deadline:
        time.sleep(1)
    assert _held(server) == (0, 0)
    assert healthy()
    if server.pid:
        processes_after, rss_after = _process_tree(server.pid)
        assert processes_after == processes, "the server's processes changed (a restart)"
        assert rss_after - rss_before < MAX_RSS_GROWTH, (rss_before, rss_after)
        print(f"FUZZ requests={len(cases)} valid={sum(c.expect == OK for c in cases)} "
              f"rss_growth_mib={(rss_after - rss_before) / 2**20:.1f} "
              f"seconds={time.monotonic() - started:.0f}", flush=True)
