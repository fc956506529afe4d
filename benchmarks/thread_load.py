"""How busy each side of an engine was during a timed round: the frontend (a root process's
threads) and the engine core (its descendants' threads). A Python thread runs one thing at a
time, so a thread at ~1.0 CPU seconds per wall second is what bounds the round."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def process_tree_threads(root_pid: int) -> Iterator[tuple[str, Any, bool]]:
    """``("frontend", thread, main)`` for every thread of process ``root_pid``, ``("core",
    thread, main)`` for every thread of its descendants (psutil's ``pthread``: ``id``,
    ``user_time``, ``system_time``); ``main``: the thread is its process's main thread. A
    process that ended meanwhile is skipped."""
    import psutil  # a vLLM requirement

    root = psutil.Process(root_pid)
    for process, side in [(root, "frontend")] + [
            (child, "core") for child in root.children(recursive=True)]:
        try:
            threads = process.threads()
        except psutil.NoSuchProcess:
            continue
        for thread in threads:
            yield side, thread, thread.id == process.pid


def thread_cpu_times(root_pid: int) -> dict[str, dict[int, float]]:
    """CPU seconds (user + system) so far of every thread: ``{"frontend": {tid: s}, "core":
    {tid: s}}`` (``process_tree_threads``)."""
    times: dict[str, dict[int, float]] = {"frontend": {}, "core": {}}
    for side, thread, _ in process_tree_threads(root_pid):
        times[side][thread.id] = thread.user_time + thread.system_time
    return times


def busiest_threads(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]],
                    seconds: float) -> dict[str, float]:
    """Over a round of ``seconds`` (``thread_cpu_times`` at its start and end): the busiest
    thread's CPU time / wall time in the frontend and in the engine core (``frontend_busy``,
    ``core_busy``), and each side's CPU seconds per wall second over all its threads
    (``frontend_cpu``, ``core_cpu``). A thread started during the round counts from 0."""
    out: dict[str, float] = {}
    for key in ("frontend", "core"):
        deltas = [t - before[key].get(tid, 0.0) for tid, t in after[key].items()]
        out[f"{key}_busy"] = max(deltas, default=0.0) / seconds
        out[f"{key}_cpu"] = sum(deltas) / seconds
    return out
