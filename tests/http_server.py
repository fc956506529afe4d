"""Start one real ``vllm serve`` subprocess for a test module, and HTTP helpers for it.

Set ``SAMPLING_MASK_TEST_SERVER_URL`` (e.g. ``http://127.0.0.1:8000``) to test an already running
server started with the flags the module expects instead (handy while iterating: an engine start
costs 45-150 s on a CPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_sampling_mask_testing.serve import free_port, serve_process

EXTERNAL_URL_ENV = "SAMPLING_MASK_TEST_SERVER_URL"
MASK_FLAGS = ("--return-sampling-mask", "--logprobs-mode", "processed_logprobs")


@dataclass
class Server:
    url: str
    log_path: Path | None
    pid: int | None = None
    """The ``vllm serve`` process (API server; the engine core is its child); ``None`` for an
    external server."""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def client(self, timeout: float = 300.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def finished_by_engine(self) -> dict[str, float]:
        """Requests finished per engine (the ``engine`` label of vLLM's
        ``vllm:request_success_total``): which engines of a data-parallel server served."""
        finished: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:request_success_total{"):
                engine = line.split('engine="', 1)[1].split('"', 1)[0]
                finished[engine] = finished.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
        return finished

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples without labels, plus vLLM's request gauges summed over labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_part, _, value = line.rpartition(" ")
            name = name_part.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
        return values


@contextlib.contextmanager
def running_server(model: str, env: dict[str, str], extra_args: tuple[str, ...] = (),
                   start_timeout: float = 900.0) -> Iterator[Server]:
    """``vllm serve model`` on 127.0.0.1 (own process group, killed at exit), once ``/health`` is up."""
    external = os.environ.get(EXTERNAL_URL_ENV)
    if external:
        yield Server(external.rstrip("/"), None)
        return
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--max-model-len", "512", "--max-num-seqs", "8", *extra_args]
    server = Server(f"http://127.0.0.1:{port}", log_path)

    def healthy() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        return False

    try:
        with serve_process(cmd, env, log_path, healthy, start_timeout, stop_timeout=30) as proc:
            server.pid = proc.pid
            yield server
    finally:
        log_path.unlink(missing_ok=True)  # a failed start put its tail in the exception


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any] | str]:
    """The ``data:`` payloads of a streamed response: parsed JSON, or ``"[DONE]"``."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        yield payload if payload == "[DONE]" else json.loads(payload)


def sse_raw(response: httpx.Response) -> list[str]:
    """The raw ``data:`` payload strings of a streamed response, ``[DONE]`` excluded."""
    return [line[len("data: "):] for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]
