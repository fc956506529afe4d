"""How steady is this machine? Repeated fixed work on the host CPU and on the GPU, no vLLM.

The engine benchmarks' rounds spread by +-20-30% on the lent H200 while the effects they measure
are 1-2%. This probe tells where such spread comes from, in ~1 min (16 vCPUs):

- ``cpu``:        a fixed pure-Python loop (~5 ms), timed ``--reps`` times: host speed (vCPU
                  steal, frequency, a busy hyperthread sibling);
- ``cpu_pinned``: the same loop pinned to one logical CPU per physical core in turn (is one
                  core slower than another?);
- ``launch``:     200 tiny CUDA kernels then a sync (host-bound, like a decode step's launches);
- ``device``:     a fixed chain of matmuls timed by CUDA events (GPU speed: clocks, a co-tenant);
- ``steal``:      the machine's steal time (``/proc/stat``) over the whole probe;
- ``neighbours``:  the loop on each CPU while one other CPU spins, for every other CPU in turn:
                  the slowdowns over the loop alone (vCPUs that the VM shows as separate cores
                  but that share a physical core slow each other: pinning two hot threads to
                  such a pair would couple them);
- ``wake_cpus``:  two processes allowed on the same three CPUs take turns running the loop, as
                  interleaved engines do; the CPU each ran on, read every loop, and their speed
                  ratio turn by turn: whether the kernel keeps each on a CPU of its own (then
                  each runs at its vCPU's speed for its whole life, and the two differ by their
                  vCPUs'); ``wake_one_cpu``: the same, both on one CPU (what ``--pin`` of the
                  engine benchmark does with each side's main thread).

Each series reports min / median / max and max/min. ``--out`` writes JSON::

    python benchmarks/probe_machine_noise.py --out bench_out/noise.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from collections import Counter
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


SPINNER_NAME = "probe-machine-noise-spinner"


def _spin(cpu: int, stop: Any, started: Any) -> None:
    """``busy_neighbours``' spinner: a busy loop on ``cpu`` until ``stop`` is set."""
    os.sched_setaffinity(0, {cpu})
    started.set()
    while not stop.is_set():
        python_loop(2_000)


def slowdown_beside_spinner(spin_cpu: int, cpus: list[int], reps: int) -> dict[int, float]:
    """``python_loop``'s median seconds on each of ``cpus`` while a process spins on
    ``spin_cpu``, over its median alone on that CPU just before."""
    alone = {c: statistics.median(s) for c, s in loop_seconds_per_cpu(cpus, reps).items()}
    spawn = multiprocessing.get_context("spawn")
    stop, started = spawn.Event(), spawn.Event()
    spinner = spawn.Process(target=_spin, args=(spin_cpu, stop, started), name=SPINNER_NAME)
    spinner.start()
    try:
        started.wait(timeout=60)
        beside = loop_seconds_per_cpu(cpus, reps)
    finally:
        stop.set()
        spinner.join()
    return {c: statistics.median(beside[c]) / alone[c] for c in cpus}


def busy_neighbours(cpus: list[int], reps: int = 5) -> dict[str, Any]:
    """For every pair of ``cpus``: ``python_loop``'s median seconds on ``c`` while a process
    spins on ``d``, over its median alone on ``c`` (measured just before). Returns
    ``{"slowdown": {c: {d: ratio}}, "coupled": [[c, d, ratio], ...]}`` with the pairs slowed by
    more than 20%, the worst first."""
    slowdown: dict[str, dict[str, float]] = {str(c): {} for c in cpus}
    for d in cpus:
        for c, ratio in slowdown_beside_spinner(d, [c for c in cpus if c != d], reps).items():
            slowdown[str(c)][str(d)] = ratio
    coupled = sorted(([int(c), int(d), ratio] for c, row in slowdown.items()
                      for d, ratio in row.items() if ratio > 1.2), key=lambda x: -x[2])
    return {"slowdown": slowdown, "coupled": coupled}


def steal_ticks() -> int | None:
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8])  # cpu user nice system idle iowait irq softirq steal
    except (OSError, IndexError, ValueError):
        return None


def current_cpu() -> int:
    """The CPU the calling thread runs on now (field 39 of ``/proc/thread-self/stat``)."""
    stat = Path("/proc/thread-self/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[36])


def _take_turns(cpus: list[int], turns: int, seconds: float, mine: Any, theirs: Any,
                out: Any) -> None:
    """One of ``wake_placement``'s processes: on every turn, wait for ``mine`` (asleep, as an
    idle engine waits for work), run the loop for ``seconds``, then hand the turn over; put on
    ``out`` the CPU it ran on most in each turn and its loops per second in each turn."""
    os.sched_setaffinity(0, set(cpus))
    ran_on, speed = [], []
    for _ in range(turns):
        mine.wait()
        mine.clear()
        counts: Counter[int] = Counter()
        start = time.monotonic()
        while time.monotonic() < start + seconds:
            python_loop(20_000)
            counts[current_cpu()] += 1
        ran_on.append(counts.most_common(1)[0][0])
        speed.append(sum(counts.values()) / (time.monotonic() - start))
        theirs.set()
    out.put((os.getpid(), ran_on, speed))


def wake_placement(cpus: list[int], turns: int = 8, seconds: float = 0.4) -> dict[str, Any]:
    """Two processes on ``cpus`` taking ``turns`` turns each (``a`` first): the CPU each ran on
    most per turn, the share of turns each spent on the CPU of its previous turn, and
    ``b_over_a``, the median over turns of b's loop speed over a's in the same turn."""
    spawn = multiprocessing.get_context("spawn")
    turn_a, turn_b, out = spawn.Event(), spawn.Event(), spawn.Queue()
    runs = [spawn.Process(target=_take_turns, args=(cpus, turns, seconds, mine, theirs, out))
            for mine, theirs in ((turn_a, turn_b), (turn_b, turn_a))]
    for run in runs:
        run.start()
    turn_a.set()
    reports = {pid: (ran_on, speed) for pid, ran_on, speed in
               (out.get(timeout=60 + 4 * turns * seconds) for _ in runs)}
    for run in runs:
        run.join()
    (a_cpus, a_speed), (b_cpus, b_speed) = (reports[run.pid] for run in runs)
    stayed = [sum(x == y for x, y in zip(ran, ran[1:])) / (turns - 1) for ran in (a_cpus, b_cpus)]
    return {"cpus": cpus, "a": a_cpus, "b": b_cpus, "stayed_share": stayed,
            "b_over_a": statistics.median(b / a for a, b in zip(a_speed, b_speed))}


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
    report["neighbours"] = busy_neighbours(report["one_cpu_per_core"])
    report["wake_cpus"] = wake_placement(report["one_cpu_per_core"][:3])
    report["wake_one_cpu"] = wake_placement(report["one_cpu_per_core"][:1])
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
    print("CPU pairs where a spinning one slows the other's loop by > 20% (cpu, spinner, "
          f"slowdown): {report['neighbours']['coupled'] or 'none'}")
    for wake in (report["wake_cpus"], report["wake_one_cpu"]):
        print(f"two processes taking turns on CPUs {wake['cpus']}: a ran on {wake['a']}, b on "
              f"{wake['b']} (share of turns on the previous turn's CPU: {wake['stayed_share']});"
              f" b's speed over a's, median turn: {wake['b_over_a']:.3f}")
    print(f"steal {report['steal_s']} s over {report['wall_s']:.1f} s, cpus {report['cpus']}, "
          f"one per core {report['one_cpu_per_core']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
