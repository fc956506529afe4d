"""A ``vllm serve`` subprocess in its own process group, for the HTTP tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LOG_TAIL_CHARS = 6000


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_process(cmd: list[str], env: dict[str, str] | None, log_path: Path,
                  healthy: Callable[[], bool], start_timeout: float,
                  stop_timeout: float = 60.0) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` (stdout and stderr to ``log_path``) until ``healthy()`` is true, polled every
    second; yield the process; at exit SIGTERM its process group, SIGKILL after
    ``stop_timeout`` s. A process that exits or stays unhealthy for ``start_timeout`` s raises
    ``RuntimeError`` with the log's tail."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + start_timeout
        while not healthy():
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[:6]} exited with {proc.returncode}; {log_path} ends:\n"
                                   f"{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:6]} not healthy after {start_timeout} s; {log_path} "
                                   f"ends:\n{_tail(log_path)}")
            time.sleep(1)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
