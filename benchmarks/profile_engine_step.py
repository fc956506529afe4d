"""Where a decode step spends its host time, masks off vs on: wall time per step of vLLM's
per-step functions and of the plugin's, in an in-process engine.

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` puts the engine core in this process (frontend and engine
core then share one thread, so the totals are not ``bench_engine_throughput``'s; the
per-function costs are). For each config (``off``, ``on``, ``optout``; one engine after the
other) and each batch size: ``--reps`` generates of ``--output-len`` tokens (same prompts and
sampling as ``bench_engine_throughput``), with wall timers around::

    EngineCore.step / step_with_batch_queue   Scheduler.schedule / update_from_output
    GPUModelRunner.execute_model / sample_tokens   Sampler.__call__ / sample
    AsyncOutput.__init__ / get_output   OutputProcessor.process_outputs
    sample_from_candidates / compact_step (kernel launches)
    MappedRows.take   DeviceStepMasks.copy_to_host_nonblocking   HostStepMasks.unpack

reported in ms per step (the timers nest: ``step`` contains most of the others), and the
cyclic collector's time per generation (``gc.callbacks``). With
``--same-process-optout`` the ``on`` engine also runs every round with all its requests opted
out, timed apart (``on_optout``, the order flipping every round): what the masks cost each
function within one process, free of the speed each engine process draws. Engines built one
after the other in this process are not comparable with each other (a later one ran every
function slower, its full collections longer: docs/benchmarks.md, session 35), so ``--configs
on --same-process-optout`` alone is the fair comparison. ``--cprofile``
adds the top functions by own time of one more round; ``--cuda-profile`` the CUDA kernels of one
short round (torch profiler), i.e. the GPU time per step::

    python benchmarks/profile_engine_step.py --no-enforce-eager --out bench_out/profile.json  # GPU
    python benchmarks/profile_engine_step.py --small                                          # CPU
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine_throughput as engine_bench  # noqa: E402

# (module, class or None for a module-level function, attribute)
TIMED_FUNCTIONS = (
    ("vllm.v1.engine.core", "EngineCore", "step"),
    ("vllm.v1.engine.core", "EngineCore", "step_with_batch_queue"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler", "__call__"),
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler", "sample"),
    ("vllm.v1.worker.gpu.async_utils", "AsyncOutput", "__init__"),
    ("vllm.v1.worker.gpu.async_utils", "AsyncOutput", "get_output"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
    ("vllm_sampling_mask.worker.sampler", None, "sample_from_candidates"),
    ("vllm_sampling_mask.worker.sampler", None, "compact_step"),
    ("vllm_sampling_mask.worker.step_masks", "MappedRows", "take"),
    ("vllm_sampling_mask.worker.step_masks", "DeviceStepMasks", "copy_to_host_nonblocking"),
    ("vllm_sampling_mask.worker.step_masks", "HostStepMasks", "unpack"),
)
STEP_COUNTER = "GPUModelRunner.execute_model"


class StepTimers:
    """Accumulated wall seconds and calls per timed function (installed once per process, over
    the plugin's own wrappers and before any engine is built)."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}
        self._installed = False
        self._collection_began = 0.0

    def install(self) -> None:
        if self._installed:
            return
        gc.callbacks.append(self._time_collection)
        for module_name, class_name, attr in TIMED_FUNCTIONS:
            owner: Any = importlib.import_module(module_name)
            if class_name is not None:
                owner = getattr(owner, class_name)
            if class_name is not None and attr not in vars(owner):
                continue  # e.g. step_with_batch_queue on a version without it
            name = f"{class_name}.{attr}" if class_name else attr
            setattr(owner, attr, self._timed(getattr(owner, attr), name))
        self._installed = True

    def _time_collection(self, phase: str, info: dict[str, int]) -> None:
        """A ``gc.callbacks`` hook: the cyclic collector's wall time per generation, as
        ``gc generation N`` (the collector runs inside whichever function allocated last, so its
        time is also inside that function's)."""
        if phase == "start":
            self._collection_began = time.perf_counter()
            return
        slot = self.totals.setdefault(f"gc generation {info['generation']}", [0.0, 0])
        slot[0] += time.perf_counter() - self._collection_began
        slot[1] += 1

    def _timed(self, original: Callable[..., Any], name: str) -> Callable[..., Any]:
        slot = self.totals.setdefault(name, [0.0, 0])

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                slot[0] += time.perf_counter() - began
                slot[1] += 1

        return timed

    def reset(self) -> None:
        for slot in self.totals.values():
            slot[0], slot[1] = 0.0, 0

    def snapshot(self) -> dict[str, list[float]]:
        """A copy of the totals since the last ``reset``."""
        return {name: list(slot) for name, slot in self.totals.items()}

    def per_step(self, totals: dict[str, list[float]] | None = None) -> dict[str, Any]:
        """``totals`` (default: the live ones) per step of the model runner."""
        totals = self.totals if totals is None else totals
        steps = max(int(totals.get(STEP_COUNTER, [0, 0])[1]), 1)
        ranked = sorted(totals.items(), key=lambda item: -item[1][0])
        return {"steps": steps, "ms_per_step": {name: 1e3 * total / steps
                                                for name, (total, calls) in ranked if calls},
                "calls": {name: calls for name, (total, calls) in ranked if calls}}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU smoke run (tiny model).")
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    parser.add_argument("--model", help=f"Default {engine_bench.DEFAULT_MODEL}.")
    parser.add_argument("--configs", default="off,on")
    parser.add_argument("--batch-sizes", type=engine_bench.int_list)
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--reps", type=int)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--logprobs", type=int, help="SamplingParams.logprobs (default None).")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="Per engine (default 0.85 / the number of configs: the engines "
                        "run one after the other in this process, which keeps what each "
                        "earlier one took).")
    parser.add_argument("--same-process-optout", action="store_true",
                        help="The on engine also runs each round with every request opted out "
                        "(reported as on_optout).")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="Also cProfile one round at the largest batch; keep the top N.")
    parser.add_argument("--cuda-profile", action="store_true",
                        help="Also the CUDA kernel time of one 32-token round at the largest batch.")
    args = parser.parse_args(argv)
    sizes = engine_bench.SMALL if args.small else engine_bench.FULL
    for name in ("batch_sizes", "output_len", "prompt_len", "reps"):
        if getattr(args, name) is None:
            setattr(args, name, sizes[name])
    args.warmup_len = sizes["warmup_len"]
    args.temperature, args.dtype = 1.0, "float32" if args.small else "auto"
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = round(0.85 / len(args.configs.split(",")), 2)
    return args


def profile_config(name: str, args: argparse.Namespace, model: str,
                   timers: StepTimers) -> dict[str, dict[str, Any]]:
    """``{mode: result}``: the config's own, and ``on_optout`` beside ``on`` if asked."""
    engine = engine_bench.EngineUnderTest(name, args, model, args.gpu_memory_utilization)
    try:
        engine.warm_up()
        results: dict[str, dict[str, Any]] = {mode: {"by_batch": {}} for mode in engine.modes}
        for b in args.batch_sizes:
            totals: dict[str, dict[str, list[float]]] = {mode: {} for mode in engine.modes}
            for r in range(args.reps):
                for mode in engine.modes if r % 2 == 0 else engine.modes[::-1]:
                    timers.reset()
                    engine.run_mode_round(mode, b, r)
                    for function, (seconds, calls) in timers.snapshot().items():
                        slot = totals[mode].setdefault(function, [0.0, 0])
                        slot[0] += seconds
                        slot[1] += calls
            for mode, result in results.items():
                result["by_batch"][str(b)] = timers.per_step(totals[mode]) | {
                    "tokens_per_s": [x["tokens_per_s"] for x in engine.rounds[mode][b]],
                    "median_step_s": [x.get("median_step_s") for x in engine.rounds[mode][b]]}
        result = results[name]
        largest = max(args.batch_sizes)
        prompts = engine_bench.make_prompts(largest, args.reps, args.prompt_len, engine.vocab)
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            engine.llm.generate(prompts, engine.params(args.output_len), use_tqdm=False)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
            result["cprofile_tottime"] = text.getvalue().splitlines()
        if args.cuda_profile:
            result["cuda_profile"] = cuda_profile(engine, prompts, timers)
        return results
    finally:
        engine.shutdown()


def cuda_profile(engine: Any, prompts: list[Any], timers: StepTimers) -> dict[str, Any]:
    """Device time of one 32-token round: total per step, and the kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    timers.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.llm.generate(prompts, engine.params(32), use_tqdm=False)
    steps = timers.per_step()["steps"]
    events = prof.key_averages()
    device_us = sum(event.self_device_time_total for event in events)
    return {"steps": steps, "device_ms_per_step": device_us / 1e3 / steps,
            "table": events.table(sort_by="self_device_time_total", row_limit=30).splitlines()}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine_bench.setup_environment(args.small)
    model = args.model or (engine_bench.small_model() if args.small else engine_bench.DEFAULT_MODEL)
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # this plugin's patches first, so that the timers wrap them
    timers = StepTimers()
    timers.install()  # before any engine exists: EngineCore binds step_fn at construction
    report: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                         for k, v in vars(args).items()},
                              "results": {}}
    for name in args.configs.split(","):
        report["results"].update(profile_config(name, args, model, timers))
        engine_bench.free_gpu_memory()
    for b in map(str, args.batch_sizes):
        names = list(report["results"])
        functions = list(report["results"][names[-1]]["by_batch"][b]["ms_per_step"])
        print(f"\nB={b}: ms per step  " + "  ".join(f"{n:>9s}" for n in names))
        for function in functions:
            cells = [report["results"][n]["by_batch"][b]["ms_per_step"].get(function)
                     for n in names]
            print(f"  {function:44s}" + "  ".join("        -" if c is None else f"{c:9.3f}"
                                                   for c in cells))
        steps = [[x for x in report["results"][n]["by_batch"][b]["median_step_s"] if x]
                 for n in names]
        print(f"  {'median engine step (median round)':44s}" + "  ".join(
            f"{1e3 * statistics.median(x):9.3f}" if x else "        -" for x in steps))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
