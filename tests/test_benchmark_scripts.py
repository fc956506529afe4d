"""Benchmark scripts that run on CPU in seconds, run as a user runs them (a fresh process), so a
change to the code they drive can't leave them broken until the next GPU session."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts' modules, imported by the tests below


def test_host_overhead_smoke_run(subprocess_env: dict[str, str], tmp_path: Path) -> None:
    # The script checks its own hops (rows unpacked, handed out, attached) against the worker's.
    out = tmp_path / "host_overhead.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_host_overhead.py"), "--small",
                             "--out", str(out)], capture_output=True, text=True, env=subprocess_env,
                            cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads(out.read_text())
    assert set(report["per_process_ms"]) == set(report["per_process_held_ms"]) == {
        "engine_core", "frontend"}
    assert {"unpack", "unpack_overflow", "scheduler", "scheduler_held", "scheduler_held_flush",
            "frontend", "frontend_held", "held_finish", "attach"} <= set(report["results"])
    # --small: fewer requests than the targets' 512
    assert report["target_met"] is None and report["target_met_held"] is None


@pytest.mark.parametrize("loop", ["c", "python"])
def test_held_rows_smoke_run(subprocess_env: dict[str, str], tmp_path: Path, loop: str) -> None:
    # The script checks that every held row reached the frontend's decoder.
    out = tmp_path / "held_rows.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_held_rows.py"), "--small",
                             "--loop", loop, "--out", str(out)], capture_output=True, text=True,
                            env=subprocess_env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads(out.read_text())
    assert len(report["period_ms_per_step"]) == 2
    assert report["engine_core_ms_per_step"] > 0 and report["frontend_decode_send_ms"] > 0
    if loop == "python":
        assert report["machine"]["hand_out_loop"] == "python"


def test_output_processor_smoke_run(subprocess_env: dict[str, str], tmp_path: Path) -> None:
    # vLLM's real OutputProcessor, both modes in lock step; the script checks every request
    # finished with all its tokens and, in `on` only, a mask row per token.
    out = tmp_path / "output_processor.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_output_processor.py"),
                             "--small", "--block", "3", "--out", str(out)], capture_output=True,
                            text=True, env=subprocess_env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads(out.read_text())
    assert len(report["rounds"]) == 2 and set(report["rounds"][0]) == {"stock", "on"}
    for key in ("all", "without_gc"):
        assert len(report["stock_over_on"][key]["rounds"]) == 2
        assert report["stock_over_on"][key]["median"] > 0
    for result in report["rounds"][0].values():  # the steps' split adds up to the round (8 steps)
        split = result["row_steps_ms"] + result["other_steps_ms"]
        assert split == pytest.approx(8 * result["cpu_ms_per_step"])
        assert result["row_steps_ms"] > 0 and result["other_steps_ms"] > 0


def test_output_processor_row_steps_are_the_steps_whose_frames_carry_rows() -> None:
    from bench_output_processor import RoundInputs

    held = RoundInputs.row_steps_of(argparse.Namespace(tokens=130, rows="held"))
    assert held == {63, 127, 129}  # every HELD_STEPS-th (64) and the last
    every = RoundInputs.row_steps_of(argparse.Namespace(tokens=5, rows="every_step"))
    assert every == set(range(5))


def test_pool_paired_rounds_pairs_each_round_with_the_baselines() -> None:
    from pool_paired_rounds import pool

    def run(stock: list[float], on: list[float]) -> dict:
        def engine(values: list[float]) -> dict:
            return {"interleaved": True,
                    "by_batch": {"64": {"rounds": [{"tokens_per_s": v} for v in values]}}}
        return {"results": {"stock": engine(stock), "on": engine(on)}}

    # Round r of on is 0.9x round r of stock although the rounds themselves drift 2x.
    reports = [run([100, 200, 150], [90, 180, 135]), run([50, 80], [45, 72]),
               {"results": {"stock": run([1], [1])["results"]["stock"]}}]  # no "on": skipped
    sequential = run([100], [10])
    sequential["results"]["stock"]["interleaved"] = False  # not pairs: skipped
    reports.append(sequential)
    pooled = pool(reports, ["on", "optout"], "stock")
    assert list(pooled) == ["on/stock"]
    summary = pooled["on/stock"]["64"]
    assert summary["pairs"] == 5
    for key in ("median", "median_low", "median_high", "geometric_mean"):
        assert abs(summary[key] - 0.9) < 1e-9, (key, summary)


def test_pool_paired_rounds_pairs_the_median_step_metric_where_rounds_have_it() -> None:
    from pool_paired_rounds import pool

    def run(stock: list[dict], on: list[dict]) -> dict:
        return {"results": {name: {"interleaved": True, "by_batch": {"1": {"rounds": rounds}}}
                            for name, rounds in (("stock", stock), ("on", on))}}

    # Wall-time throughput says 0.5 (one slow round of on), the median steps say 1.
    new = run([{"tokens_per_s": 100, "median_step_tokens_per_s": 400}],
              [{"tokens_per_s": 50, "median_step_tokens_per_s": 400}])
    old = run([{"tokens_per_s": 100}], [{"tokens_per_s": 80}])  # before the metric: skipped
    step = pool([new, old], ["on"], "stock", "median_step_tokens_per_s")["on/stock"]["1"]
    assert (step["pairs"], step["median"]) == (1, 1.0)
    assert pool([new, old], ["on"], "stock")["on/stock"]["1"]["pairs"] == 2


def test_engine_step_times_reads_the_engine_cores_timestamps() -> None:
    # Steps with outputs only; the client's own get_output is back afterwards.
    from types import SimpleNamespace

    from bench_engine_throughput import engine_step_times, median_step_seconds

    class Client:
        def __init__(self) -> None:
            self.steps = iter([(1.0, ["a"]), (1.5, []), (1.25, ["b"]), (1.75, ["c"]),
                               (2.5, ["d"])])

        def get_output(self) -> SimpleNamespace:
            timestamp, outputs = next(self.steps)
            return SimpleNamespace(timestamp=timestamp, outputs=outputs)

    client = Client()
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))
    with engine_step_times(llm) as stamps:
        for _ in range(5):
            client.get_output()
    assert stamps == [1.0, 1.25, 1.75, 2.5]
    assert "get_output" not in vars(client)
    assert median_step_seconds(stamps) == 0.5  # intervals 0.25, 0.5, 0.75
    assert median_step_seconds(stamps[:1]) is None


def test_pool_paired_rounds_resamples_whole_generations() -> None:
    # Each generation's engines keep the speed they drew at start: 0.8 in every round of one
    # generation, 1.0 in the other. Resampling rounds would make 0.8-vs-1.0 look resolved.
    from pool_paired_rounds import pool

    def engine(values: list[float]) -> dict:
        return {"interleaved": True, "by_batch": {"1": {"rounds": [
            {"tokens_per_s": v, "generation": i // 6} for i, v in enumerate(values)]}}}

    stock = [100.0] * 12
    on = [80.0] * 6 + [100.0] * 6
    summary = pool([{"results": {"stock": engine(stock), "on": engine(on)}}], ["on"],
                   "stock")["on/stock"]["1"]
    assert (summary["pairs"], summary["clusters"]) == (12, 2)
    assert abs(summary["median_low"] - 0.8) < 1e-9 and abs(summary["median_high"] - 1.0) < 1e-9
    # The spread from one set of processes to the next: the sd of the two clusters' log medians.
    assert abs(summary["cluster_spread"] - abs(math.log(0.8)) / math.sqrt(2)) < 1e-9


def test_pool_paired_rounds_splits_spread_into_rounds_and_processes() -> None:
    # Two rounds per set of processes, +-0.1 around each set's mean (round variance 0.02).
    from pool_paired_rounds import summarize

    def clusters(offsets: list[float]) -> list[list[float]]:
        return [[m + 0.1, m - 0.1] for m in offsets]

    # The sets' means spread by 0.1 each way: variance 0.04 / 3, of which round noise explains
    # 0.02 / 2 (a mean of two rounds); the rest is the processes'.
    summary = summarize(clusters([0.1, -0.1, 0.1, -0.1]))
    assert abs(summary["round_spread"] - math.sqrt(0.02)) < 1e-12
    assert abs(summary["process_spread"] - math.sqrt(0.04 / 3 - 0.01)) < 1e-12
    assert summary["process_spread_high"] >= summary["process_spread"]
    # Means that spread less than round noise predicts: no process part (0, not a complex sd).
    assert summarize(clusters([0.0] * 4))["process_spread"] == 0.0
    # One round per set, or one set: no split.
    assert summarize([[0.1], [0.2], [0.3]])["round_spread"] is None
    assert summarize([[0.1, 0.2]])["process_spread"] is None


def test_engine_throughput_merges_generations_into_clustered_pairs() -> None:
    from bench_engine_throughput import merge_generations, paired_ratios

    def result(values: list[float]) -> dict:
        return {"engine_start_s": 1.0, "interleaved": True, "by_batch": {"64": {
            "rounds": [{"tokens_per_s": v} for v in values],
            "mask_check": {"ok": True, "rows": 2, "problems": []}}}}

    merged = merge_generations([{"stock": result([100, 100]), "on": result([90, 90])},
                                {"stock": result([100, 200]), "on": result([100, 200])}])
    rounds = merged["on"]["by_batch"]["64"]["rounds"]
    assert [r["generation"] for r in rounds] == [0, 0, 1, 1]
    assert merged["on"]["by_batch"]["64"]["mask_check"]["rows"] == 4
    assert merged["on"]["engine_start_s_by_generation"] == [1.0, 1.0]
    paired = paired_ratios(merged)["on/stock"]["64"]
    assert paired["by_generation"] == pytest.approx([0.9, 1.0])
    assert paired["rounds"] == pytest.approx([0.9, 0.9, 1.0, 1.0])
    low, high = paired["interval"]
    assert abs(low - 0.9) < 1e-9 and abs(high - 1.0) < 1e-9


def test_profile_engine_step_times_functions_that_exist() -> None:
    # A renamed function would make the profile fail at its start on the GPU machine.
    import importlib

    from profile_engine_step import TIMED_FUNCTIONS

    for module_name, class_name, attr in TIMED_FUNCTIONS:
        owner = importlib.import_module(module_name)
        if class_name is not None:
            owner = getattr(owner, class_name)
        if attr != "step_with_batch_queue":  # only on versions that have it
            assert callable(getattr(owner, attr)), (module_name, class_name, attr)


def test_profile_engine_step_reports_each_modes_totals_per_model_runner_step() -> None:
    # --same-process-optout: each mode's rounds are timed apart and summed, then per step.
    from profile_engine_step import STEP_COUNTER, StepTimers

    timers = StepTimers()
    timers.totals.update({STEP_COUNTER: [0.5, 100], "Scheduler.schedule": [0.2, 100],
                          "HostStepMasks.unpack": [0.0, 0]})
    taken = timers.snapshot()
    timers.reset()
    assert timers.per_step()["ms_per_step"] == {}  # the live totals were reset...
    report = timers.per_step(taken)  # ...the snapshot was not
    assert report["steps"] == 100 and report["calls"] == {STEP_COUNTER: 100,
                                                         "Scheduler.schedule": 100}
    assert report["ms_per_step"] == {STEP_COUNTER: 5.0, "Scheduler.schedule": 2.0}


def test_profile_engine_step_times_the_cyclic_collector_by_generation() -> None:
    import gc

    from profile_engine_step import StepTimers

    timers = StepTimers()
    gc.callbacks.append(timers._time_collection)
    try:
        gc.collect(1)
        gc.collect(2)
    finally:
        gc.callbacks.remove(timers._time_collection)
    assert timers.totals["gc generation 1"][1] == 1 and timers.totals["gc generation 2"][1] == 1
    assert timers.totals["gc generation 2"][0] > 0


def test_http_profile_summarizes_the_busiest_thread_and_the_plugins_frames() -> None:
    # py-spy's raw format: one line per distinct stack, outermost frame first, then its count.
    from profile_http_server import summarize_stacks

    raw = "\n".join([
        "thread (1): MainThread;run (loop.py:10);step (core.py:5);"
        "hand_out (vllm_sampling_mask/core/scheduler.py:120) 7",
        "thread (1): MainThread;run (loop.py:10);step (core.py:5);"
        "hand_out (vllm_sampling_mask/core/scheduler.py:121);join (x.py:3) 2",
        "thread (1): MainThread;run (loop.py:11);step (core.py:6) 4",
        "thread (2): Thread-1;poll (zmq.py:9);hand_out (vllm_sampling_mask/core/scheduler.py:1) 5",
        "not a stack line",
    ])
    summary = summarize_stacks(raw, top=10)
    assert summary["threads"] == {"thread (1): MainThread": 13, "thread (2): Thread-1": 5}
    assert summary["main_samples"] == 13
    # Inclusive counts merge a function's lines; the other thread's samples are not in them.
    assert summary["inclusive"]["run (loop.py)"] == 13
    assert summary["inclusive"]["hand_out (vllm_sampling_mask/core/scheduler.py)"] == 9
    assert summary["plugin"] == {
        "hand_out (vllm_sampling_mask/core/scheduler.py) -> <self>": 7,
        "hand_out (vllm_sampling_mask/core/scheduler.py) -> join (x.py)": 2}
    assert summarize_stacks("", top=10)["main_samples"] == 0


def test_engine_throughput_pairs_the_on_engine_with_its_own_opted_out_rounds() -> None:
    # --same-process-optout: on/on_optout pairs the two modes of one process, whether or not a
    # stock engine ran beside it; on/stock and on_optout/stock still pair with stock's rounds.
    from bench_engine_throughput import SAME_PROCESS_OPTOUT, paired_ratios

    def result(values: list[float], interleaved: bool = True) -> dict:
        return {"interleaved": interleaved, "by_batch": {"256": {
            "rounds": [{"tokens_per_s": v} for v in values]}}}

    alone = paired_ratios({"on": result([99, 198]), SAME_PROCESS_OPTOUT: result([100, 200])})
    assert list(alone) == [f"on/{SAME_PROCESS_OPTOUT}"]
    assert alone[f"on/{SAME_PROCESS_OPTOUT}"]["256"]["median"] == pytest.approx(0.99)
    beside = paired_ratios({"stock": result([110, 220]), "on": result([99, 198]),
                            SAME_PROCESS_OPTOUT: result([100, 200])})
    assert set(beside) == {"on/stock", f"{SAME_PROCESS_OPTOUT}/stock",
                           f"on/{SAME_PROCESS_OPTOUT}"}
    assert beside["on/stock"]["256"]["median"] == pytest.approx(0.9)
    # A stock engine that ran before the others (not interleaved) gives no pairs at all.
    sequential = paired_ratios({"stock": result([110, 220], interleaved=False),
                                "on": result([99, 198]), SAME_PROCESS_OPTOUT: result([100, 200])})
    assert list(sequential) == [f"on/{SAME_PROCESS_OPTOUT}"]


def test_engine_throughput_pairs_both_modes_with_the_stock_sampler_rounds() -> None:
    # --same-process-stock-sampler: on and on_optout each pair with the same process's rounds on
    # vLLM's own sampler; the mode is refused with --logprobs (not stock's path there).
    from bench_engine_throughput import (
        SAME_PROCESS_OPTOUT,
        SAME_PROCESS_STOCK_SAMPLER,
        paired_ratios,
        parse_args,
    )

    def result(values: list[float]) -> dict:
        return {"interleaved": True, "by_batch": {"1": {
            "rounds": [{"tokens_per_s": v} for v in values]}}}

    pairs = paired_ratios({"on": result([95, 190]), SAME_PROCESS_OPTOUT: result([98, 196]),
                           SAME_PROCESS_STOCK_SAMPLER: result([100, 200])})
    assert pairs[f"on/{SAME_PROCESS_STOCK_SAMPLER}"]["1"]["median"] == pytest.approx(0.95)
    assert pairs[f"{SAME_PROCESS_OPTOUT}/{SAME_PROCESS_STOCK_SAMPLER}"]["1"]["median"] == (
        pytest.approx(0.98))
    assert pairs[f"on/{SAME_PROCESS_OPTOUT}"]["1"]["median"] == pytest.approx(95 / 98)
    with pytest.raises(SystemExit):
        parse_args(["--same-process-stock-sampler", "--logprobs", "1"])


def test_engine_throughput_checkpoints_every_round_but_a_generations_last(monkeypatch) -> None:
    # A run cut by its time limit on the GPU machine must keep the rounds it finished: each
    # interleaved round but the generation's last is handed to the checkpoint, unchecked masks
    # marked as such, and the checkpoint merges into a report like the final one.
    import argparse

    import bench_engine_throughput as bench

    class FakeEngine:
        def __init__(self, name: str, *args, **kwargs) -> None:
            self.name, self.rounds = name, {}

        def build(self) -> None: ...

        def warm_up(self) -> None: ...

        def run_round(self, batch: int, round_index: int) -> None:
            self.rounds.setdefault(batch, []).append(
                {"tokens_per_s": 100.0 if self.name == "stock" else 90.0})

        def results(self) -> dict:
            done = len(self.rounds[64]) == 3
            check = {"ok": True, "rows": 1, "problems": []} if done else bench.NOT_CHECKED
            return {self.name: {"engine_start_s": 1.0, "interleaved": True, "by_batch": {
                str(b): {"rounds": list(r), "mask_check": check}
                for b, r in self.rounds.items()}}}

        def shutdown(self) -> None: ...

    monkeypatch.setattr(bench, "EngineProcess", FakeEngine)
    monkeypatch.setattr(bench, "free_gpu_memory", lambda: None)
    args = argparse.Namespace(gpu_memory_utilization=None, reps=3, batch_sizes=[64, 256])
    checkpoints: list[dict] = []
    final = bench.run_generation(["stock", "on"], 0, args, "model", [], None, checkpoints.append)
    assert [len(c["on"]["by_batch"]["256"]["rounds"]) for c in checkpoints] == [1, 2]
    partial = bench.merge_generations([checkpoints[-1]])
    assert partial["on"]["by_batch"]["64"]["mask_check"]["ok"] is None
    assert bench.paired_ratios(partial)["on/stock"]["64"]["median"] == pytest.approx(0.9)
    assert bench.merge_generations([final])["on"]["by_batch"]["64"]["mask_check"]["ok"] is True


def test_pool_paired_rounds_reads_http_reports() -> None:
    # bench_http_throughput.py's modes alternate on one server: each concurrency pools as a
    # batch size, each report as a cluster.
    from pool_paired_rounds import engine_shaped, pool

    def report(off: list[float], compact: list[float]) -> dict:
        return {"server_command": ["vllm", "serve"], "results": {"64": {
            "off": {"rounds": [{"tokens_per_s": v} for v in off]},
            "compact": {"rounds": [{"tokens_per_s": v} for v in compact]}}}}

    reports = [engine_shaped(report([100, 200], [90, 180])), engine_shaped(report([100], [100]))]
    summary = pool(reports, ["compact"], "off")["compact/off"]["64"]
    assert (summary["pairs"], summary["clusters"]) == (3, 2)
    assert summary["median"] == pytest.approx(0.9)
    engine_report = {"results": {"stock": {}}}
    assert engine_shaped(engine_report) is engine_report


def test_http_rounds_read_the_engine_side_from_prometheus_counters() -> None:
    # Each HTTP round reads vLLM's /metrics before and after: summed over label sets, the
    # differences give engine steps, tokens per step, the inter-token period and the server's
    # latency; a server without /metrics gives nothing (the round still counts).
    import bench_http_throughput as bench

    def metrics(steps: float, tokens: float, itl_s: float, e2e_s: float, requests: float) -> str:
        labels = '{engine="0",model_name="m"}'
        return "\n".join([
            "# HELP vllm:iteration_tokens_total Number of tokens per engine_step.",
            f"vllm:iteration_tokens_total_count{labels} {steps / 2}",
            f'vllm:iteration_tokens_total_count{{engine="1",model_name="m"}} {steps / 2}',
            f"vllm:iteration_tokens_total_sum{labels} {tokens}",
            f'vllm:iteration_tokens_total_bucket{{le="1.0",{labels[1:]} 3.0',
            f"vllm:inter_token_latency_seconds_count{labels} {tokens}",
            f"vllm:inter_token_latency_seconds_sum{labels} {itl_s}",
            f"vllm:e2e_request_latency_seconds_count{labels} {requests}",
            f"vllm:e2e_request_latency_seconds_sum{labels} {e2e_s}"])

    class FakeClient:
        def __init__(self, pages: list[str]):
            self.pages = pages

        def get(self, path: str) -> str:
            assert path == "/metrics"
            if not self.pages:
                raise OSError("no /metrics")
            return self.pages.pop(0)

    client = FakeClient([metrics(10, 100, 1.0, 2.0, 4), metrics(110, 6500, 13.8, 10.0, 12)])
    before, after = bench.engine_counters(client), bench.engine_counters(client)
    side = bench.engine_side(before, after)
    assert side == pytest.approx({"engine_steps": 100, "tokens_per_step": 64.0,
                                  "inter_token_ms": 2.0, "server_latency_s": 1.0})
    assert bench.engine_counters(client) == {} and bench.engine_side({}, after) == {}
    assert "100 engine steps of 64.0 tokens" in bench.engine_cell(side)
    assert bench.engine_cell({}) == "no /metrics"


def test_thread_load_reports_the_busiest_thread_of_each_side() -> None:
    # Which process bounds a round: the busiest thread's CPU seconds over the round's wall time,
    # from per-thread totals before and after (a thread started during the round counts from 0).
    from thread_load import busiest_threads

    before = {"frontend": {1: 10.0, 2: 5.0}, "core": {7: 100.0}}
    after = {"frontend": {1: 11.5, 2: 5.5}, "core": {7: 101.0, 8: 1.8}}
    busy = busiest_threads(before, after, seconds=2.0)
    assert busy == pytest.approx({"frontend_busy": 0.75, "frontend_cpu": 1.0,
                                  "core_busy": 0.9, "core_cpu": 1.4})


PINNED_TREE = """
import json, multiprocessing, os, sys, threading
sys.path.insert(0, sys.argv[1])
from bench_engine_throughput import pin_process_tree

def child(ready, done):
    threading.Thread(target=done.wait, daemon=True).start()
    ready.set()
    done.wait()

if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    ready, done = spawn.Event(), spawn.Event()
    threading.Thread(target=done.wait, daemon=True).start()
    proc = spawn.Process(target=child, args=(ready, done))
    proc.start()
    ready.wait()
    counts = pin_process_tree([0, 1], [1, 0])
    import psutil
    layout = {}
    for process in [psutil.Process()] + psutil.Process().children(recursive=True):
        for thread in process.threads():
            key = ("main" if thread.id == process.pid else "other") + (
                "_frontend" if process.pid == os.getpid() else "_core")
            layout.setdefault(key, set()).update(os.sched_getaffinity(thread.id))
    done.set()
    proc.join()
    print(json.dumps({"counts": counts, "layout": {k: sorted(v) for k, v in layout.items()}}))
"""


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_pinning_puts_each_sides_main_threads_alone_on_its_first_cpu(tmp_path: Path) -> None:
    # In a process of its own: the test process's CPUs stay as they are.
    script = tmp_path / "pinned_tree.py"
    script.write_text(PINNED_TREE)
    result = subprocess.run([sys.executable, str(script), str(BENCHMARKS)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    # Frontend CPUs [0, 1]: its main thread on 0 alone, its other threads on 1; engine-core
    # CPUs [1, 0]: the child's main thread on 1, its other threads on 0.
    assert report["layout"] == {"main_frontend": [0], "other_frontend": [1],
                                "main_core": [1], "other_core": [0]}
    assert report["counts"]["frontend_threads"] >= 2 and report["counts"]["core_threads"] >= 2


def test_wake_placement_reads_the_cpu_each_turn_ran_on() -> None:
    # Both processes on one CPU: every turn of each must read that CPU back.
    from probe_machine_noise import wake_placement

    cpu = min(os.sched_getaffinity(0))
    wake = wake_placement([cpu], turns=3, seconds=0.05)
    assert wake["a"] == wake["b"] == [cpu] * 3
    assert wake["stayed_share"] == [1.0, 1.0]
    assert 0.2 < wake["b_over_a"] < 5.0


def test_the_neighbour_probe_times_each_cpu_alone_then_beside_a_running_spinner(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The loop's timings are faked (real ones depend on what else the machine runs): 1 s per loop
    # while no spinner process is alive, 2 s while one is. The probe must take the first with none
    # running, the second with its spinner running, and stop the spinner afterwards.
    import multiprocessing

    import probe_machine_noise

    def fake_loop_seconds(cpus: list[int], reps: int) -> dict[int, list[float]]:
        spinning = any(child.name == probe_machine_noise.SPINNER_NAME and child.is_alive()
                       for child in multiprocessing.active_children())
        return {cpu: [2.0 if spinning else 1.0] * reps for cpu in cpus}

    monkeypatch.setattr(probe_machine_noise, "loop_seconds_per_cpu", fake_loop_seconds)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    assert probe_machine_noise.slowdown_beside_spinner(cpus[0], cpus, reps=3) == {
        cpu: 2.0 for cpu in cpus}
    assert not [child for child in multiprocessing.active_children()
                if child.name == probe_machine_noise.SPINNER_NAME]
    report = probe_machine_noise.busy_neighbours(cpus, reps=1)
    pairs = [[c, d] for c in cpus for d in cpus if c != d]
    assert report["slowdown"] == {str(c): {str(d): 2.0 for d in cpus if d != c} for c in cpus}
    assert [pair[:2] for pair in report["coupled"]] == pairs
