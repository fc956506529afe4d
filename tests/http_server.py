"""Start one real ``vllm serve`` subprocess for a test module, and HTTP helpers for it.

Set ``SAMPLING_MASK_TEST_SERVER_URL`` (e.g. ``http://127.0.0.1:8000``) to test an already running
server started with the flags the module expects instead (handy while iterating: an engine start
costs 45-150 s on a CPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

EXTERNAL_URL_ENV = "SAMPLING_MASK_TEST_SERVER_URL"
MASK_FLAGS = ("--return-sampling-mask", "--logprobs-mode", "processed_logprobs")


@dataclass
class Server:
    url: str
    log_path: Path | None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def client(self, timeout: float = 300.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(model: str, env: dict[str, str], extra_args: tuple[str, ...] = (),
                   start_timeout: float = 900.0) -> Iterator[Server]:
    """``vllm serve model`` on 127.0.0.1 (own process group, killed at exit), once ``/health`` is up."""
    external = os.environ.get(EXTERNAL_URL_ENV)
    if external:
        yield Server(external.rstrip("/"), None)
        return
    port = _free_port()
    log_path = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--max-model-len", "512", "--max-num-seqs", "8", *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{server.log()[-6000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not healthy after {start_timeout}s:\n{server.log()[-6000:]}")
            time.sleep(1)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
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
