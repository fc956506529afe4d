"""Where a mask server's two processes spend their CPU during HTTP rounds: py-spy samples of the
API server and the engine core while ``bench_http_throughput.py``'s rounds run, per mode.

One ``vllm serve --return-sampling-mask`` (``bench_http_throughput.serve_command``), one warm-up
round per mode, then ``--reps`` times, for each mode: ``py-spy record`` (``--nonblocking``, so the
processes are never paused; ``--threads``; idle stacks dropped) attached to the API server and to
the engine core, ``--rounds`` timed rounds, the recorders stopped. Per mode and process the
report holds the main thread's samples, the functions with the most samples in their stacks
(inclusive) and, for frames of ``vllm_sampling_mask``, the plugin's innermost frame with the
call it was in (its self time and what it called): what masks add to each process, beside the
rounds' tokens/s, tokens per step and latencies. py-spy samples ``--rate`` times a second and
drops the stacks of idle threads, so a sample count / rate is the seconds a thread was active (a
thread spinning in a CUDA sync counts as active).

Needs ``py-spy`` (``pip install py-spy``; on the device, carry its wheel and install it with
``pip install --no-index --target DIR``) and permission to read the server's memory (same user,
ptrace allowed)::

    python3 benchmarks/profile_http_server.py /root/models/qwen3-0.6b --py-spy /root/pyspy/bin/py-spy \\
        --out $OUT/http_profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# This script's directory is on sys.path.
import bench_http_throughput as http_bench

PLUGIN_FRAME = "vllm_sampling_mask/"
_LINE_NUMBER = re.compile(r":\d+\)$")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?",
                        help=f"Model path (default {http_bench.DEFAULT_MODEL}; --small: a tiny local model).")
    parser.add_argument("--small", action="store_true",
                        help="CPU smoke run: tiny model, concurrency 2, one recording per mode.")
    parser.add_argument("--py-spy", default=shutil.which("py-spy"), help="py-spy executable.")
    parser.add_argument("--modes", type=http_bench.mode_list, default=["off", "compact"])
    parser.add_argument("--concurrency", type=int, help="Default 64 (--small: 2).")
    parser.add_argument("--reps", type=int, help="Recordings per mode (default 2; --small: 1).")
    parser.add_argument("--rounds", type=int, help="Timed rounds per recording (default 2; --small: 1).")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second.")
    parser.add_argument("--top", type=int, default=40, help="Functions kept per process.")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                        help="Eager server (default: compiled, as run_h200.sh's HTTP runs; "
                        "--small: always eager).")
    parser.add_argument("--out", type=Path, help="Write the report as JSON here.")
    args = parser.parse_args(argv)
    for name, full, small in (("concurrency", 64, 2), ("reps", 2, 1), ("rounds", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else full)
    if not args.py_spy:
        parser.error("py-spy not found: pip install py-spy, or pass --py-spy PATH")
    return args


def summarize_stacks(raw: str, top: int) -> dict[str, Any]:
    """Summary of py-spy's ``--format raw`` output (``thread (TID): NAME;frame;...;frame COUNT``
    per line, outermost frame first): samples per thread, and of the busiest thread the ``top``
    functions by inclusive samples and the plugin's innermost frames with their callee
    (``"function (file) -> callee (file)"``; ``<self>`` where the plugin's frame is the last)."""
    threads: collections.Counter[str] = collections.Counter()
    stacks: list[tuple[str, list[str], int]] = []
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        threads[thread] += int(count)
        stacks.append((thread, [_LINE_NUMBER.sub(")", frame) for frame in frames], int(count)))
    if not threads:
        return {"threads": {}, "main_samples": 0, "inclusive": {}, "plugin": {}}
    main = threads.most_common(1)[0][0]
    inclusive: collections.Counter[str] = collections.Counter()
    plugin: collections.Counter[str] = collections.Counter()
    for thread, frames, count in stacks:
        if thread != main:
            continue
        for frame in set(frames):
            inclusive[frame] += count
        innermost = [i for i, frame in enumerate(frames) if PLUGIN_FRAME in frame]
        if innermost:
            i = innermost[-1]
            callee = frames[i + 1] if i + 1 < len(frames) else "<self>"
            plugin[f"{frames[i]} -> {callee}"] += count
    return {"threads": dict(threads), "main_thread": main, "main_samples": threads[main],
            "inclusive": dict(inclusive.most_common(top)), "plugin": dict(plugin.most_common(top))}


def engine_core_pids(server_pid: int) -> list[int]:
    """The server's engine-core processes (vLLM names them ``EngineCore``)."""
    import psutil  # a vLLM requirement

    return [child.pid for child in psutil.Process(server_pid).children(recursive=True)
            if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline())]


def record(py_spy: str, pids: dict[str, int], rate: int,
           folder: Path) -> list[tuple[str, Path, subprocess.Popen[bytes]]]:
    """Start one ``py-spy record`` per process; returns (name, raw file, recorder)."""
    recorders = []
    for name, pid in pids.items():
        path = folder / f"{name}.txt"
        with open(folder / f"{name}.err", "w") as errors:  # a file: a pipe could fill and block
            recorder = subprocess.Popen(
                [py_spy, "record", "-p", str(pid), "--nonblocking", "--threads", "-r", str(rate),
                 "-f", "raw", "-o", str(path)], stdout=subprocess.DEVNULL, stderr=errors)
        recorders.append((name, path, recorder))
    time.sleep(1.0)  # attached before the round starts
    return recorders


def stop(recorders: list[tuple[str, Path, subprocess.Popen[bytes]]], top: int) -> dict[str, Any]:
    """SIGINT every recorder (py-spy then writes its file) and summarise each file."""
    for _, _, recorder in recorders:
        recorder.send_signal(signal.SIGINT)
    out = {}
    for name, path, recorder in recorders:
        recorder.wait(timeout=120)
        if not path.exists():
            errors = path.with_suffix(".err").read_text()
            raise RuntimeError(f"py-spy wrote nothing for {name}: {errors[-500:]}")
        out[name] = summarize_stacks(path.read_text(), top)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    bench_args = http_bench.parse_args(
        [*([args.model] if args.model else []), *(["--small"] if args.small else []),
         "--concurrency", str(args.concurrency),
         "--enforce-eager" if args.enforce_eager or args.small else "--no-enforce-eager"])
    model = http_bench.model_path(bench_args)
    folder = Path(tempfile.mkdtemp(prefix="http-profile-"))
    cmd = http_bench.serve_command(bench_args, model, http_bench.free_port())
    concurrency = args.concurrency
    recordings: list[dict[str, Any]] = []
    with http_bench.running_server(cmd, http_bench.server_environment(args.small), folder / "serve.log",
                                   bench_args.startup_timeout) as client:
        pids = {"api_server": client.server_pid}
        pids.update({f"engine_core_{i}": pid
                     for i, pid in enumerate(engine_core_pids(client.server_pid))})
        for mode in args.modes:
            http_bench.run_round(client, http_bench.request_bodies(
                bench_args, mode, concurrency, -1, concurrency, bench_args.warmup_tokens),
                mode, concurrency)
        for rep in range(args.reps):
            for mode in args.modes:
                recorders = record(args.py_spy, pids, args.rate, folder)
                rounds = []
                for r in range(args.rounds):
                    bodies = http_bench.request_bodies(
                        bench_args, mode, concurrency, 100 + rep * args.rounds + r,
                        http_bench.request_count(bench_args, concurrency), bench_args.max_tokens)
                    result = http_bench.run_round(client, bodies, mode, concurrency)
                    rounds.append(result)
                    print(f"[{mode}] rep {rep} round {r}: {result['tokens_per_s']:,.0f} tok/s, "
                          f"{http_bench.engine_cell(result)}, {result['violations']} violations",
                          flush=True)
                processes = stop(recorders, args.top)
                recordings.append({"mode": mode, "rep": rep, "rounds": rounds,
                                   "processes": processes})
                print(f"[{mode}] rep {rep}: main-thread samples "
                      + ", ".join(f"{name} {p['main_samples']}" for name, p in processes.items()),
                      flush=True)
    report = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "model": model, "device": http_bench.device_name(args.small), "server_command": cmd,
              "recordings": recordings,
              "ok": all(r["violations"] == 0 for rec in recordings for r in rec["rounds"])}
    for rec in recordings:
        print(f"\n== {rec['mode']} rep {rec['rep']}")
        for name, process in rec["processes"].items():
            print(f"-- {name}: {process['main_samples']} main-thread samples; plugin frames:")
            for frame, count in list(process["plugin"].items())[:12]:
                print(f"{count:6d}  {frame}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"written to {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
