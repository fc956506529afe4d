"""How steady is this machine? Repeated fixed work on the host CPU and on the GPU, no vLLM.

The engine benchmarks' rounds spread by +-20-30% on the lent H200 while the effects they measure
are 1-2%. This probe tells where such spread comes from, in ~20 s:

- ``cpu``:        a fixed pure-Python loop (~5 ms), timed ``--reps`` times: host speed (vCPU
                  steal, frequency, a busy hyperthread sibling);
- ``cpu_pinned``: the same loop pinned to one logical CPU per physical core in turn (is one
                  core slower than another?);
- ``launch``:     200 tiny CUDA kernels then a sync (host-bound, like a decode step's launches);
- ``device``:     a fixed chain of matmuls timed by CUDA events (GPU speed: clocks, a co-tenant);
- ``steal``:      the machine's steal time (``/proc/stat``) over the whole probe.

Each series reports min / median / max and max/min. ``--out`` writes JSON::

    python benchmarks/probe_machine_noise.py --out bench_out/noise.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def summary(samples: list[float]) -> dict[str, float]:
    return {"min_ms": min(samples) * 1e3, "median_ms": statistics.median(samples) * 1e3,
            "max_ms": max(samples) * 1e3, "max_over_min": max(samples) / min(samples),
            "n": len(samples)}


def timed(run: Callable[[], Any], reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
    return samples


def python_loop(n: int = 120_000) -> int:
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def one_cpu_per_core() -> list[int]:
    """The first logical CPU of every physical core this process may run on."""
    chosen, seen = [], set()
    for cpu in sorted(os.sched_getaffinity(0)):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        siblings = path.read_text().strip() if path.exists() else str(cpu)
        if siblings not in seen:
            seen.add(siblings)
            chosen.append(cpu)
    return chosen


def loop_seconds_per_cpu(cpus: list[int], reps: int) -> dict[int, list[float]]:
    """``python_loop``'s seconds, ``reps`` times on each of ``cpus`` in turn (this process
    pinned to it); the process's affinity is restored afterwards."""
    allowed = os.sched_getaffinity(0)
    samples = {}
    try:
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            samples[cpu] = timed(python_loop, reps)
    finally:
        os.sched_setaffinity(0, allowed)
    return samples


def fastest_cpus(count: int, reps: int = 5) -> tuple[list[int], dict[str, float]]:
    """The ``count`` allowed logical CPUs that run ``python_loop`` fastest (median of ``reps``),
    and every CPU's median seconds."""
    samples = loop_seconds_per_cpu(sorted(os.sched_getaffinity(0)), reps)
    speed = {cpu: statistics.median(seconds) for cpu, seconds in samples.items()}
    chosen = sorted(sorted(speed, key=speed.get)[:count])
    return chosen, {str(cpu): seconds for cpu, seconds in speed.items()}


def steal_ticks() -> int | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8])  # cpu user nice system idle iowait irq softirq steal
    except (OSError, IndexError, ValueError):
        return None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    steal0, t0 = steal_ticks(), time.monotonic()
    report: dict[str, Any] = {"cpus": sorted(os.sched_getaffinity(0)),
                              "one_cpu_per_core": one_cpu_per_core()}
    report["cpu"] = summary(timed(python_loop, args.reps))
    per_core = {str(cpu): summary(seconds) for cpu, seconds in loop_seconds_per_cpu(
        report["one_cpu_per_core"], max(5, args.reps // 20)).items()}
    report["cpu_pinned"] = per_core
    try:
        import torch

        if torch.cuda.is_available():
            x = torch.zeros(16, device="cuda")
            a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

            def launches() -> None:
                for _ in range(200):
                    x.add_(1.0)
                torch.cuda.synchronize()

            def device_ms() -> float:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    a @ a
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / 1e3

            launches()
            device_ms()
            report["launch"] = summary(timed(launches, args.reps))
            report["device"] = summary([device_ms() for _ in range(args.reps)])
            report["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    steal1 = steal_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    report["steal_s"] = None if steal0 is None else (steal1 - steal0) / hz
    report["wall_s"] = time.monotonic() - t0
    for name in ("cpu", "launch", "device"):
        if name in report:
            s = report[name]
            print(f"{name:7s} min {s['min_ms']:8.3f}  median {s['median_ms']:8.3f}  max "
                  f"{s['max_ms']:8.3f} ms  max/min {s['max_over_min']:.2f}")
    print("per core median ms:", {c: round(s["median_ms"], 3) for c, s in per_core.items()})
    print(f"steal {report['steal_s']} s over {report['wall_s']:.1f} s, cpus {report['cpus']}, "
          f"one per core {report['one_cpu_per_core']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
