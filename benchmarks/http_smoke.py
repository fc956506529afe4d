"""GPU smoke test of the HTTP layer: start ``vllm serve MODEL --return-sampling-mask`` in the
background, run the HTTP checks of ``tests/test_http_endpoints.py`` against it (standard library
only: no httpx, no pytest), and print a one-line JSON summary (exit status 0 iff every check
passed).

    python benchmarks/http_smoke.py /root/models/small [--max-tokens 64] [--top-k 50]
        [--serve-arg=--gpu-memory-utilization=0.5 ...] [--out report.json]

Checks: masks on every choice of ``/inference/v1/generate`` (non-streaming, n=2, streaming),
``/v1/completions`` and ``/v1/chat/completions`` (with and without the opt-in field, streaming and
not); the mask contract (one row per token, rows strictly ascending, sampled token in its row);
streamed rows == non-streamed rows (seeded); compact == JSON; processed logprobs finite exactly
on the row and normalised over it; bad requests -> 400 and the server keeps serving; 50 streams
dropped mid-way leave ``vllm_sampling_mask:held_requests`` / ``held_rows`` at 0. Also reports
response bytes (JSON vs compact) and wall time of a concurrent batch with masks off/json/compact.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import math
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vllm_sampling_mask.compact_format import decode_compact

from testing_support import testing_module

free_port = testing_module("serve").free_port
serve_process = testing_module("serve").serve_process

PROMPT_IDS = [100, 200, 300, 400, 500, 600, 700, 800, 900, 999]  # in any vocabulary


class Client:
    def __init__(self, host: str, port: int, timeout: float = 600):
        self.host, self.port, self.timeout = host, port, timeout
        self.server_pid: int | None = None  # set by running_server

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        request = urllib.request.Request(f"http://{self.host}:{self.port}{path}",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def ok(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, content = self.post(path, body)
        if status != 200:
            raise AssertionError(f"{path} -> {status}: {content[:500]!r}")
        return json.loads(content)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://{self.host}:{self.port}{path}", timeout=60) as r:
            return r.read().decode()

    def stream(self, path: str, body: dict[str, Any], max_events: int | None = None) -> list[Any]:
        """Data payloads of a streamed response (parsed JSON or "[DONE]"); with ``max_events``
        the connection is dropped after that many events."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", path, json.dumps({**body, "stream": True}),
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise AssertionError(f"{path} stream -> {response.status}: {response.read()[:500]!r}")
            events: list[Any] = []
            while max_events is None or len(events) < max_events:
                line = response.fp.readline()
                if not line:
                    break
                line = line.decode().rstrip("\n")
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if data == "[DONE]":
                        break
            return events
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for line in self.get("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                key = name.split("{", 1)[0]
                values[key] = values.get(key, 0.0) + float(value)
        return values


def rows_of(mask: Any) -> list[list[int]]:
    return decode_compact(mask) if isinstance(mask, dict) else mask


def contract(token_ids: list[int], mask: Any) -> list[list[int]]:
    rows = rows_of(mask)
    assert len(rows) == len(token_ids), f"{len(rows)} rows for {len(token_ids)} tokens"
    for i, (token, row) in enumerate(zip(token_ids, rows)):
        assert all(a < b for a, b in zip(row, row[1:])), f"row {i} not strictly ascending"
        assert token in row, f"token {i} ({token}) not in its row"
    return rows


def streamed_choices(events: list[Any]) -> dict[int, dict[str, list]]:
    assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-1:]}"
    out: dict[int, dict[str, list]] = {}
    for event in events[:-1]:
        assert "error" not in event, event
        for choice in event["choices"]:
            if "token_ids" not in choice:
                continue
            rows = rows_of(choice["sampling_mask"])
            assert len(rows) == len(choice["token_ids"]), "chunk rows != chunk tokens"
            acc = out.setdefault(choice["index"], {"token_ids": [], "rows": []})
            acc["token_ids"] += choice["token_ids"]
            acc["rows"] += rows
    return out


class Smoke:
    def __init__(self, client: Client, args: argparse.Namespace):
        self.c, self.args = client, args
        self.sampling = {"temperature": 1.0, "top_k": args.top_k, "top_p": 0.95}
        self.results: dict[str, str] = {}
        self.info: dict[str, Any] = {}

    def tito(self, **extra: Any) -> dict[str, Any]:
        params = {**self.sampling, "max_tokens": self.args.max_tokens, "seed": 7,
                  **extra.pop("params", {})}
        return {"token_ids": PROMPT_IDS, "sampling_params": params, **extra}

    def completion(self, **extra: Any) -> dict[str, Any]:
        return {"prompt": ["The capital of France is", "Once upon a time"], "n": 2,
                "max_tokens": self.args.max_tokens, "seed": 7, **self.sampling, **extra}

    def chat(self, **extra: Any) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "n": 2,
                "max_tokens": self.args.max_tokens, "seed": 7, **self.sampling, **extra}

    def run(self, name: str, check: Callable[[], Any]) -> None:
        start = time.perf_counter()
        try:
            result = check()
            if result is not None:
                self.info[name] = result
            self.results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - every failure is reported, none stops the run
            self.results[name] = f"FAIL {type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc(file=sys.stderr)
        self.info.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 2)

    # --------------------------------------------------------------- checks

    def tito_full_and_logprobs(self) -> dict[str, Any]:
        k = self.args.top_k
        body = self.c.ok("/inference/v1/generate", self.tito(params={"logprobs": k}))
        widths = []
        for choice in body["choices"]:
            rows = contract(choice["token_ids"], choice["sampling_mask"])
            widths += [len(r) for r in rows]
            for i, (row, entry) in enumerate(zip(rows, choice["logprobs"]["content"])):
                tops = {int(t["token"].split(":")[1]): t["logprob"] for t in entry["top_logprobs"]}
                tops[choice["token_ids"][i]] = entry["logprob"]
                finite = sorted(t for t, lp in tops.items() if lp > -9999.0)
                assert set(finite) <= set(row), f"row {i}: finite logprob outside the mask"
                if len(row) <= k:
                    assert finite == row, f"row {i}: finite logprobs {finite[:5]} != row {row[:5]}"
                    total = math.fsum(math.exp(tops[t]) for t in row)
                    assert abs(math.log(total)) < 2e-3, f"row {i}: logsumexp over row {math.log(total)}"
        return {"max_row_width": max(widths), "mean_row_width": round(sum(widths) / len(widths), 2)}

    def tito_n2(self) -> None:
        body = self.c.ok("/inference/v1/generate", self.tito(params={"n": 2, "output_kind": 2, "seed": None}))
        assert len(body["choices"]) == 2
        for choice in body["choices"]:
            contract(choice["token_ids"], choice["sampling_mask"])

    def tito_stream_equals_full(self) -> None:
        full = self.c.ok("/inference/v1/generate", self.tito())["choices"][0]
        streamed = streamed_choices(self.c.stream("/inference/v1/generate", self.tito()))[0]
        assert streamed["token_ids"] == full["token_ids"], "seeded stream sampled other tokens"
        assert streamed["rows"] == full["sampling_mask"], "streamed rows != full rows"

    def tito_compact_equals_json(self) -> dict[str, Any]:
        status_json, as_json = self.c.post("/inference/v1/generate", self.tito())
        compact_body = self.tito(sampling_mask_format="compact")
        status_compact, compact = self.c.post("/inference/v1/generate", compact_body)
        assert status_json == status_compact == 200
        j, p = json.loads(as_json)["choices"][0], json.loads(compact)["choices"][0]
        assert decode_compact(p["sampling_mask"]) == j["sampling_mask"]
        streamed = streamed_choices(self.c.stream("/inference/v1/generate", compact_body))
        assert streamed[0]["rows"] == j["sampling_mask"]
        return {"tokens": len(j["token_ids"]), "json_bytes": len(as_json), "compact_bytes": len(compact)}

    def openai(self, path: str, make: Callable[..., dict[str, Any]], num_choices: int) -> None:
        status, plain = self.c.post(path, make())
        assert status == 200 and b'"sampling_mask"' not in plain, "a request without the field got masks"
        body = self.c.ok(path, make(return_sampling_mask=True))
        assert len(body["choices"]) == num_choices
        for choice in body["choices"]:
            contract(choice["token_ids"], choice["sampling_mask"])
        streamed = streamed_choices(self.c.stream(path, make(return_sampling_mask=True)))
        compact = self.c.ok(path, make(return_sampling_mask=True, sampling_mask_format="compact"))
        for choice, packed in zip(body["choices"], compact["choices"]):
            assert streamed[choice["index"]]["rows"] == choice["sampling_mask"], "stream != full"
            assert decode_compact(packed["sampling_mask"]) == choice["sampling_mask"], "compact != json"

    def bad_requests(self) -> None:
        paths = {"/inference/v1/generate": self.tito, "/v1/completions": self.completion,
                 "/v1/chat/completions": self.chat}
        for path, make in paths.items():
            tito = path == "/inference/v1/generate"
            cases = [("temperature", {"temperature": 0.0}), ("top_k", {"top_k": 0})]
            if tito:  # OpenAI requests fill a missing top_k from the model's generation config
                cases.append(("top_k", {"top_k": None}))
            fields = [("sampling_mask_format", {"sampling_mask_format": "xml"}),
                      ("return_sampling_mask", {"return_sampling_mask": "yes"})]
            for name, change in cases + fields:
                for stream in (False, True):
                    body = make() if tito else make(return_sampling_mask=True, n=1)
                    target = body["sampling_params"] if tito and name in ("temperature", "top_k") else body
                    target.update(change)
                    for key in [k for k, v in target.items() if v is None]:
                        del target[key]
                    status, content = self.c.post(path, {**body, "stream": stream})
                    assert status == 400, f"{path} {change} stream={stream}: {status} {content[:200]!r}"
                    assert name in json.loads(content)["error"]["message"], content[:300]
            good = self.c.ok(path, make() if tito else make(return_sampling_mask=True))
            for choice in good["choices"]:
                contract(choice["token_ids"], choice["sampling_mask"])

    def dropped_streams(self) -> dict[str, Any]:
        long = {"max_tokens": max(self.args.max_tokens, 256), "ignore_eos": True}
        bodies = [
            ("/inference/v1/generate",
             {"token_ids": PROMPT_IDS, "sampling_params": {**self.sampling, **long}}),
            ("/v1/completions",
             {"prompt": "Hello", **self.sampling, **long, "return_sampling_mask": True}),
            ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}], **self.sampling, **long,
              "return_sampling_mask": True, "sampling_mask_format": "compact"}),
        ]
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(self.c.stream, *bodies[i % 3], max_events=2 + i % 3) for i in range(50)]
            events = [f.result() for f in futures]
        assert all(e and e[-1] != "[DONE]" for e in events), "a stream ended before it was dropped"
        deadline = time.monotonic() + 120
        while True:
            m = self.c.metrics()
            state = (m.get("vllm_sampling_mask:held_requests"), m.get("vllm_sampling_mask:held_rows"),
                     m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0))
            if state == (0, 0, 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert state == (0, 0, 0), f"held requests/rows, in flight after drops: {state}"
        body = self.c.ok("/inference/v1/generate", self.tito())
        contract(body["choices"][0]["token_ids"], body["choices"][0]["sampling_mask"])
        return {"seconds_to_zero": round(120 - (deadline - time.monotonic()), 2)}

    def concurrent_batch(self) -> dict[str, Any]:
        out = {}
        for label, extra in (("off", {"return_sampling_mask": False}), ("json", {}),
                             ("compact", {"sampling_mask_format": "compact"})):
            bodies = [self.tito(params={"seed": None}, **extra) for _ in range(self.args.batch)]
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(self.args.batch) as pool:
                results = list(pool.map(lambda b: self.c.post("/inference/v1/generate", b), bodies))
            assert all(status == 200 for status, _ in results)
            out[label] = {"seconds": round(time.perf_counter() - start, 3),
                          "bytes": sum(len(content) for _, content in results)}
        return out


@contextlib.contextmanager
def running_server(cmd: list[str], env: dict[str, str] | None, log_path: Path | str,
                   startup_timeout: float) -> Iterator[Client]:
    """``cmd`` (a ``vllm serve ... --port P``) in its own process group, output to
    ``log_path``, until ``/health`` answers; stopped at exit."""
    client = Client("127.0.0.1", int(cmd[cmd.index("--port") + 1]))

    def healthy() -> bool:
        try:
            client.get("/health")
            return True
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    with serve_process(cmd, env, Path(log_path), healthy, startup_timeout) as process:
        client.server_pid = process.pid
        yield client


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests in the timing check")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `vllm serve` argument")
    parser.add_argument("--log", default=None, help="server log file (default: a temp file)")
    parser.add_argument("--out", default=None, help="also write the full report here")
    args = parser.parse_args()

    port = free_port()
    log_path = args.log or tempfile.mkstemp(prefix="http-smoke-serve-", suffix=".log")[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--return-sampling-mask",
           "--logprobs-mode", "processed_logprobs", "--max-model-len", str(args.max_model_len),
           "--max-logprobs", str(max(64, args.top_k + 1)), *args.serve_arg]
    report: dict[str, Any] = {"model": args.model, "log": log_path}
    start = time.perf_counter()
    try:
        with running_server(cmd, None, log_path, args.startup_timeout) as client:
            report["startup_seconds"] = round(time.perf_counter() - start, 1)

            smoke = Smoke(client, args)
            smoke.run("tito_full_and_logprobs", smoke.tito_full_and_logprobs)
            smoke.run("tito_n2_final_only", smoke.tito_n2)
            smoke.run("tito_stream_equals_full", smoke.tito_stream_equals_full)
            smoke.run("tito_compact_equals_json", smoke.tito_compact_equals_json)
            smoke.run("completions", lambda: smoke.openai("/v1/completions", smoke.completion, 4))
            smoke.run("chat_completions", lambda: smoke.openai("/v1/chat/completions", smoke.chat, 2))
            smoke.run("bad_requests_400", smoke.bad_requests)
            smoke.run("dropped_streams_free_state", smoke.dropped_streams)
            smoke.run("concurrent_batch", smoke.concurrent_batch)
            report["checks"] = smoke.results
            report["info"] = smoke.info
            report["ok"] = all(v == "ok" for v in smoke.results.values())
            with open(log_path, errors="replace") as log:
                report["log_tracebacks"] = log.read().count("Traceback")
    except Exception as exc:  # noqa: BLE001
        report["ok"] = False
        report["error"] = f"{type(exc).__name__}: {exc}"
    line = json.dumps(report, separators=(",", ":"))
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
