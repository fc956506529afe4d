"""HTTP throughput of ``POST /inference/v1/generate`` with sampling masks off, JSON and compact.

One ``vllm serve MODEL --return-sampling-mask --logprobs-mode processed_logprobs`` runs in the
background (started and stopped as ``http_smoke.py`` does; standard library HTTP only, one
connection per request). Per request mode, on that one server:

- ``off``:     ``"return_sampling_mask": false``: the request opts out of masks in the engine too
  (not captured, no rows on the wire), so ``json``/``compact`` vs ``off`` is the whole cost of
  masks for that traffic (rounds are one mode at a time: an ``off`` round's batches hold no
  request that wants masks);
- ``json``:    the endpoint's default on this server, rows as ``list[list[int]]``;
- ``compact``: ``"sampling_mask_format": "compact"`` (``csr-delta-varint-base64``);
- ``off_stop`` / ``compact_stop`` (not run by default; ``--modes``): ``off`` / ``compact`` with a
  stop string no output contains (``NEVER_STOP``). A request with stop strings is finished by the
  frontend, so the engine core does not hold its rows until the end (``rows_held_until_finish``):
  its rows come with every step's output, and ``compact_stop`` / ``off_stop`` is what masks cost
  that way, beside ``compact`` / ``off`` with the rows held.

For each concurrency C (``--concurrency``, default 1,64), C client threads send ``--requests``
non-streaming requests (default max(8, 4 C)), each ``--prompt-len`` random token ids below 2000
(seeded, fresh for every request so the prefix cache never helps), ``temperature 1.0, top_k 50,
top_p 0.95, max_tokens --max-tokens, ignore_eos``. One short warm-up round per mode first, then
``--rounds`` rounds with the modes interleaved (off, json, compact, off, ...) so drift hits all
alike. Per round: output tokens/s = generated tokens / wall time of the round (first request sent
to last response read), requests/s, mean response body bytes, mean request latency; per mode the
median over rounds, and tokens/s relative to ``off`` (``off_stop`` for ``compact_stop``) at the
same C. Each round also reads the server's Prometheus counters (``/metrics``, before and after,
outside the timing): the engine steps it took (``engine_steps``), its mean tokens per step, the
step period the frontend saw (``inter_token_ms``: the mean inter-token latency) and the server's
own mean request latency, so that a slower mode tells a longer step from emptier batches (time
the engine spends between a wave's last tokens and the next wave's requests). After each round
(outside the timing) every response is checked with
``http_smoke.contract``: one row per generated token, rows ascending, the sampled token in its
row (compact decoded with ``decode_compact``); ``off``, ``off_stop``: no mask. Exit status 1 on
any violation or failed request::

    python3 benchmarks/bench_http_throughput.py /root/models/qwen3-0.6b --out bench_out/http.json  # H200
    python benchmarks/bench_http_throughput.py --small --out bench_out/http_throughput_small.json  # CPU smoke

(On the lent H200: eager, C=1 alone takes ~6 min; compiled (``--no-enforce-eager``), C=1 and 64
with 2 rounds took 4 min together, rounds of one mode spreading by up to 30%: 4 rounds by default.)

``--small`` builds the tiny model of ``vllm_sampling_mask.tiny_model`` and starts the server with
the CPU-platform environment of ``tests/support`` (Triton interpreter): the numbers mean nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import importlib.metadata
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# This script's directory is on sys.path.
from http_smoke import Client, contract, free_port, running_server
from thread_load import busiest_threads, thread_cpu_times

ENDPOINT = "/inference/v1/generate"
DEFAULT_MODEL = "/root/models/qwen3-0.6b"
SMALL_MODEL_DIR = Path(tempfile.gettempdir()) / "vllm_sampling_mask_bench" / "tiny_model"
MODES: dict[str, dict[str, Any]] = {
    "off": {"return_sampling_mask": False},
    "json": {},
    "compact": {"sampling_mask_format": "compact"},
    "off_stop": {"return_sampling_mask": False},
    "compact_stop": {"sampling_mask_format": "compact"},
}
DEFAULT_MODES = ["off", "json", "compact"]
NEVER_STOP = "\x00never\x01"  # control characters no output of the byte-level BPE decodes to
STOP_MODES = {"off_stop", "compact_stop"}
OFF_MODES = {mode for mode, fields in MODES.items() if fields.get("return_sampling_mask") is False}
COMPACT_MODES = {mode for mode, fields in MODES.items()
                 if fields.get("sampling_mask_format") == "compact"}
PROMPT_ID_RANGE = (10, 2000)  # above the special tokens, inside any vocabulary
FULL = {"concurrency": [1, 64], "max_tokens": 256, "prompt_len": 128, "rounds": 4,
        "warmup_tokens": 16}
SMALL = {"concurrency": [1, 4], "max_tokens": 8, "prompt_len": 16, "rounds": 2, "warmup_tokens": 4}
SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 0.95, "ignore_eos": True}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def mode_list(text: str) -> list[str]:
    modes = text.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or "off" not in modes:
        raise argparse.ArgumentTypeError(f"modes must be among {', '.join(MODES)} and include "
                                         f"off, got {text!r}")
    return modes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?",
                        help=f"Model path (default {DEFAULT_MODEL}; --small: a tiny local model).")
    parser.add_argument("--small", action="store_true",
                        help="CPU smoke run: tiny model, concurrency 1 and 4, 8 tokens, fp32.")
    parser.add_argument("--concurrency", type=int_list, help=f"Default {FULL['concurrency']}.")
    parser.add_argument("--modes", type=mode_list, default=DEFAULT_MODES,
                        help=f"Request modes, comma-separated, 'off' among them (default "
                        f"{','.join(DEFAULT_MODES)}; also {','.join(sorted(STOP_MODES))}).")
    parser.add_argument("--requests", type=int,
                        help="Requests per round and mode (default max(8, 4 C); --small: max(4, 2 C)).")
    parser.add_argument("--max-tokens", type=int, help=f"Default {FULL['max_tokens']}.")
    parser.add_argument("--prompt-len", type=int, help=f"Default {FULL['prompt_len']}.")
    parser.add_argument("--rounds", type=int, help=f"Timed rounds per mode (default {FULL['rounds']}).")
    parser.add_argument("--warmup-tokens", type=int, help="max_tokens of the warm-up round.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompts.")
    parser.add_argument("--dtype", help="Model dtype (default auto; --small: float32).")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                        help="Eager (default, fast start); --no-enforce-eager: torch.compile + "
                        "CUDA graphs.")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--serve-arg", action="append", default=[], help="Extra `vllm serve` argument.")
    parser.add_argument("--log", type=Path, help="Server log file (default: a temp file).")
    parser.add_argument("--out", type=Path, help="Write the full results as JSON here.")
    args = parser.parse_args(argv)
    for name, value in (SMALL if args.small else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype is None:
        args.dtype = "float32" if args.small else "auto"  # vLLM's min-p kernel: no bf16 on CPU
    return args


def request_count(args: argparse.Namespace, concurrency: int) -> int:
    if args.requests is not None:
        return args.requests
    return max(4, 2 * concurrency) if args.small else max(8, 4 * concurrency)


def server_environment(small: bool) -> dict[str, str]:
    """The server's environment: ours, plus the CPU test platform of ``tests/support`` if small."""
    env = dict(os.environ)
    if small:
        from testing_support import testing_module

        env.update(testing_module("cpu_platform").cpu_test_env())
    return env


def model_path(args: argparse.Namespace) -> str:
    """The model to serve: ``args.model``, else the tiny local model (``--small``, built once)
    or ``DEFAULT_MODEL``."""
    if args.model is None and args.small:
        from vllm_sampling_mask.tiny_model import build_tiny_model

        return str(build_tiny_model(SMALL_MODEL_DIR))
    return args.model or DEFAULT_MODEL


def serve_command(args: argparse.Namespace, model: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), "--return-sampling-mask",
           "--logprobs-mode", "processed_logprobs", "--dtype", args.dtype,
           "--max-model-len", str(args.prompt_len + args.max_tokens + 16),
           "--max-num-seqs", str(max(args.concurrency))]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + args.serve_arg


def request_bodies(args: argparse.Namespace, mode: str, concurrency: int, round_index: int,
                   count: int, max_tokens: int) -> list[dict[str, Any]]:
    """``count`` request bodies with random prompts, a function of (seed, C, round, mode) only."""
    rng = random.Random(f"{args.seed}-{concurrency}-{round_index}-{mode}")
    params = {**SAMPLING, "max_tokens": max_tokens}
    if mode in STOP_MODES:
        params["stop"] = [NEVER_STOP]
    return [{"token_ids": [rng.randrange(*PROMPT_ID_RANGE) for _ in range(args.prompt_len)],
             "sampling_params": params, **MODES[mode]} for _ in range(count)]


def timed_post(client: Client, body: dict[str, Any]) -> tuple[int, bytes, float]:
    """(HTTP status, response body, seconds); status 0 when the connection failed."""
    start = time.perf_counter()
    try:
        status, content = client.post(ENDPOINT, body)
    except (OSError, http.client.HTTPException) as exc:
        status, content = 0, f"{type(exc).__name__}: {exc}".encode()
    return status, content, time.perf_counter() - start


def response_problem(mode: str, status: int, content: bytes) -> tuple[int, int, str | None]:
    """(generated tokens, ids kept over its rows, violation or None) of one response."""
    if status != 200:
        return 0, 0, f"HTTP {status}: {content[:300]!r}"
    try:
        (choice,) = json.loads(content)["choices"]
        tokens = len(choice["token_ids"])
    except (ValueError, KeyError, TypeError) as exc:
        return 0, 0, f"not one choice with token_ids ({type(exc).__name__}): {content[:300]!r}"
    if mode in OFF_MODES:
        return tokens, 0, "a mask with return_sampling_mask false" if "sampling_mask" in choice else None
    if choice.get("sampling_mask") is None:
        return tokens, 0, "no sampling_mask"
    if mode in COMPACT_MODES and not isinstance(choice["sampling_mask"], dict):
        return tokens, 0, "compact asked, lists sent"
    try:
        rows = contract(choice["token_ids"], choice["sampling_mask"])
    except AssertionError as exc:
        return tokens, 0, str(exc)
    return tokens, sum(len(row) for row in rows), None


# Prometheus series (summed over their labels) read around every round.
COUNTERS = ("vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum",
            "vllm:inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_sum",
            "vllm:e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_sum")


def engine_counters(client: Client) -> dict[str, float]:
    """``COUNTERS`` from the server's ``/metrics`` ({} where it has none)."""
    try:
        text = client.get("/metrics")
    except (OSError, http.client.HTTPException):
        return {}
    totals = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def engine_side(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """A round's engine steps, tokens per step, mean inter-token ms and server latency s."""
    if not before or not after:
        return {}
    delta = {name: after[name] - before[name] for name in COUNTERS}

    def ratio(numerator: str, denominator: str, scale: float = 1.0) -> float | None:
        count = delta[f"vllm:{denominator}"]
        return scale * delta[f"vllm:{numerator}"] / count if count else None

    return {"engine_steps": delta["vllm:iteration_tokens_total_count"],
            "tokens_per_step": ratio("iteration_tokens_total_sum", "iteration_tokens_total_count"),
            "inter_token_ms": ratio("inter_token_latency_seconds_sum",
                                    "inter_token_latency_seconds_count", 1e3),
            "server_latency_s": ratio("e2e_request_latency_seconds_sum",
                                      "e2e_request_latency_seconds_count")}


def run_round(client: Client, bodies: list[dict[str, Any]], mode: str,
              concurrency: int) -> dict[str, Any]:
    """Send ``bodies`` from ``concurrency`` threads, time the round, then check every response."""
    counters_before = engine_counters(client)
    cpu_before = thread_cpu_times(client.server_pid)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda body: timed_post(client, body), bodies))
    seconds = time.perf_counter() - start
    busy = busiest_threads(cpu_before, thread_cpu_times(client.server_pid), seconds)
    engine = engine_side(counters_before, engine_counters(client))
    tokens = kept_ids = 0
    problems = []
    for status, content, _ in results:
        num_tokens, num_kept, problem = response_problem(mode, status, content)
        tokens += num_tokens
        kept_ids += num_kept
        if problem is not None:
            problems.append(problem)
    return {"seconds": seconds, "requests": len(bodies), "output_tokens": tokens,
            "tokens_per_s": tokens / seconds, "requests_per_s": len(bodies) / seconds,
            "mean_response_bytes": statistics.fmean(len(c) for _, c, _ in results),
            "mean_latency_s": statistics.fmean(s for _, _, s in results),
            "mean_row_width": kept_ids / tokens if mode not in OFF_MODES and tokens else None,
            "failed_requests": sum(status != 200 for status, _, _ in results),
            "violations": len(problems), "problems": problems[:5]} | busy | engine


def run_concurrency(client: Client, args: argparse.Namespace,
                    concurrency: int) -> dict[str, dict[str, Any]]:
    """Warm-up, then ``args.rounds`` interleaved rounds of every mode; per-mode medians."""
    count = request_count(args, concurrency)
    for mode in args.modes:  # warm-up: round -1, prompts no timed round uses
        run_round(client, request_bodies(args, mode, concurrency, -1, concurrency,
                                         args.warmup_tokens), mode, concurrency)
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    for r in range(args.rounds):
        for mode in args.modes:
            bodies = request_bodies(args, mode, concurrency, r, count, args.max_tokens)
            result = run_round(client, bodies, mode, concurrency)
            rounds[mode].append(result)
            print(f"[C={concurrency} {mode}] round {r}: {result['tokens_per_s']:,.1f} tok/s, "
                  f"{result['mean_response_bytes']:,.0f} B/request, "
                  f"{result['violations']} violations; busiest thread busy: API server "
                  f"{result['frontend_busy']:.2f}, engine core {result['core_busy']:.2f}; "
                  f"{engine_cell(result)}", flush=True)
    by_mode = {}
    for mode, mode_rounds in rounds.items():
        by_mode[mode] = {
            **{f"median_{key}": statistics.median(x[key] for x in mode_rounds)
               for key in ("tokens_per_s", "requests_per_s", "mean_response_bytes",
                           "mean_latency_s")},
            "requests": count,
            "failed_requests": sum(x["failed_requests"] for x in mode_rounds),
            "violations": sum(x["violations"] for x in mode_rounds),
            "rounds": mode_rounds,
        }
    for mode, result in by_mode.items():
        off = "off_stop" if mode in STOP_MODES and "off_stop" in by_mode else "off"
        result["tokens_per_s_vs_off"] = (result["median_tokens_per_s"]
                                         / by_mode[off]["median_tokens_per_s"])
    return by_mode


def device_name(small: bool) -> str:
    """The GPU's name (asked after the server stopped: no CUDA context beside the server's)."""
    if small:
        return "cpu (Triton interpreter)"
    try:
        import torch
    except ImportError:
        return "unknown (no torch)"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    title = (f"{report['model']} on {report['device']} over HTTP ({ENDPOINT}, non-streaming), "
             f"{'eager' if c['enforce_eager'] else 'compiled'}, prompt {c['prompt_len']} -> "
             f"{c['max_tokens']} tokens, top_k {SAMPLING['top_k']}, top_p {SAMPLING['top_p']}, "
             f"median of {c['rounds']} rounds")
    header = ("| C | mode | requests | tok/s | req/s | bytes/request | mean latency s "
              "| tok/s vs off | violations | busiest thread: API server / engine core "
              "| engine steps / tokens per step / inter-token ms |")
    lines = [title, "", header, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for concurrency, by_mode in report["results"].items():
        for mode, r in by_mode.items():
            lines.append(
                f"| {concurrency} | {mode} | {r['requests']} | {r['median_tokens_per_s']:,.1f} | "
                f"{r['median_requests_per_s']:,.2f} | {r['median_mean_response_bytes']:,.0f} | "
                f"{r['median_mean_latency_s']:.3f} | {r['tokens_per_s_vs_off']:.3f} | "
                f"{r['violations']} | {busy_cell(r['rounds'])} | {steps_cell(r['rounds'])} |")
    return "\n".join(lines)


def engine_cell(result: dict[str, Any]) -> str:
    """A round's engine side (``engine_side``) in words."""
    if result.get("engine_steps") is None:
        return "no /metrics"
    return (f"{result['engine_steps']:.0f} engine steps of {result['tokens_per_step'] or 0:.1f} "
            f"tokens, inter-token {result['inter_token_ms'] or 0:.3f} ms, server latency "
            f"{result['server_latency_s'] or 0:.3f} s")


def steps_cell(rounds: list[dict[str, Any]]) -> str:
    """The rounds' median engine steps, tokens per step and inter-token ms (``engine_side``)."""
    keys = ("engine_steps", "tokens_per_step", "inter_token_ms")
    if any(x.get(key) is None for x in rounds for key in keys):
        return "-"
    steps, tokens, itl = (statistics.median(x[key] for x in rounds) for key in keys)
    return f"{steps:.0f} / {tokens:.1f} / {itl:.3f}"


def busy_cell(rounds: list[dict[str, Any]]) -> str:
    """The rounds' median busiest-thread load (CPU / wall) of the server's two sides."""
    if "core_busy" not in rounds[0]:  # a report from before the field
        return "-"
    return " / ".join(f"{statistics.median(x[key] for x in rounds):.2f}"
                      for key in ("frontend_busy", "core_busy"))


def summary(report: dict[str, Any]) -> dict[str, Any]:
    return {"model": report["model"], "device": report["device"], "ok": report["ok"],
            "tokens_per_s": {f"C{c}": {m: round(r["median_tokens_per_s"], 1)
                                       for m, r in by_mode.items()}
                             for c, by_mode in report["results"].items()},
            "vs_off": {f"C{c}": {m: round(r["tokens_per_s_vs_off"], 3)
                                 for m, r in by_mode.items() if m not in OFF_MODES}
                       for c, by_mode in report["results"].items()},
            "bytes_per_request": {f"C{c}": {m: round(r["median_mean_response_bytes"])
                                            for m, r in by_mode.items()}
                                  for c, by_mode in report["results"].items()}}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = model_path(args)
    if args.small:
        args.model = model  # the report's config names the tiny model it built
    if args.log is None:
        fd, name = tempfile.mkstemp(prefix="bench-http-serve-", suffix=".log")
        os.close(fd)
        args.log = Path(name)
    log_path = args.log
    cmd = serve_command(args, model, free_port())
    print(f"server: {' '.join(cmd)} (log {log_path})", flush=True)
    began = time.perf_counter()
    with running_server(cmd, server_environment(args.small), log_path, args.startup_timeout) as client:
        startup_s = time.perf_counter() - began
        print(f"server healthy after {startup_s:.0f} s", flush=True)
        results = {str(c): run_concurrency(client, args, c) for c in args.concurrency}
        # Counted before the stop: SIGTERM to the process group logs an EngineDeadError traceback.
        tracebacks = log_path.read_text(errors="replace").count("Traceback")
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": model,
        "device": device_name(args.small),
        "vllm": importlib.metadata.version("vllm"),
        "server_command": cmd,
        "server_startup_s": startup_s,
        "server_log": str(log_path),
        "server_log_tracebacks_before_stop": tracebacks,
        "results": results,
    }
    report["ok"] = all(r["violations"] == 0 for by_mode in results.values()
                       for r in by_mode.values())
    print("\n" + markdown(report) + "\n")
    print(json.dumps(summary(report), separators=(",", ":")), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"written to {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
