"""Offline ``LLM.generate`` output throughput with sampling masks off and on, one model.

Engines are built one after the other in this process (each shut down and its GPU memory
awaited before the next), in the order stock, off, on, optout:

- ``off``:   the plugin installed, the engine switch off (vLLM's own sampler; FlashInfer where
  ``VLLM_USE_FLASHINFER_SAMPLER`` and an installed ``flashinfer`` allow it, else vLLM's Triton
  top-k/top-p + Gumbel sampler), default ``logprobs_mode``;
- ``on``:    ``LLM(..., return_sampling_mask=True, logprobs_mode="processed_logprobs")``;
- ``optout`` (only if asked): the ``on`` engine's settings, every request opted out
  (``extra_args={"return_sampling_mask": False}``): what a mask engine costs the requests that
  don't ask (no mask is returned; the target is optout/off = 1);
- ``stock`` (only if asked): the plugin not loaded at all (``VLLM_PLUGINS`` without it), always
  in a subprocess.

Each engine runs every batch size B: B random prompts of ``--prompt-len`` token ids
(``TokensPrompt``), ``temperature=1.0, top_k=50, top_p=0.95, max_tokens=--output-len,
ignore_eos=True, logprobs=--logprobs`` (default None). A short generate per B warms up first; then ``--reps``
rounds over all B, with fresh prompts each round (the same ones for every engine, so the prefix
cache never helps). Throughput = output tokens / wall time of ``generate``; the median round is
reported, and on/off per B; also the best round of each engine and their ratios (rounds can
spread by +-20% on a shared machine, and the best round is the least disturbed one). Each round
also records its median engine step (``median_step_s``, from the engine core's timestamps:
``engine_step_times``) and the throughput at that step (``median_step_tokens_per_s``; paired in
``paired_step_ratios``), which a few slow steps (the machine's bursts, or the engine's own) do
not move; the criterion stays the wall-time throughput::

    python benchmarks/bench_engine_throughput.py --out bench_out/engine_throughput.json  # H200
    python benchmarks/bench_engine_throughput.py --small                                 # CPU smoke

``--isolate`` builds each engine in a subprocess instead (one vLLM import per engine); an
engine that fails to start in-process after another one is retried that way. ``--interleave``
keeps every engine alive side by side, each in a subprocess of its own that runs rounds on
request (the same process layout for every config), and alternates their rounds, so all see the
same drift of the machine (the ratios of separate runs moved by more than the masks cost).

``--pin N`` (with ``--interleave``) first times a fixed Python loop on every CPU, takes the N
fastest and runs every engine on the same ones (all N while it starts, then the engine-core
process's main thread (busy loop and worker) alone on the fastest, the frontend's main thread
alone on the second, the frontend's other threads on the third, the engine core's other
threads on the rest: ``choose_cpus``, ``pin_process_tree``). On the lent H200 machine
vCPUs run host code at speeds that differ by up to ~1.7x and change over time
(``probe_machine_noise.py``); without pinning, an engine's hot threads land on whichever vCPUs
the kernel picks, so two engines of the same round need not run on equally fast ones. The
report also has ``paired_ratios``: per round, each engine's throughput over stock's (or
off's) in the same round, their median and range.

``--generations G`` (with ``--interleave``) runs that G times with fresh engine processes
(their start order rotated), ``--reps`` rounds each. Two engines of the same code kept a ~7-10%
difference through every round of one run on the H200 (``off`` against ``stock``) and not in
the next: much of a process's speed is drawn once, at its start, so the rounds of one set of
processes are not independent samples. ``paired_ratios`` then also has the median pair of each generation and a 95% interval
from resampling whole generations (``pool_paired_rounds.summarize``). With ``--interleave`` the
JSON is written after every round (``"complete": false`` until the end), so a run cut short by
a time limit keeps the rounds it finished.

``--same-process-optout`` removes that per-process draw from the mask engine's own cost: the
``on`` engine also runs every round with all its requests opted out (``on_optout``: the same
sampler, nothing captured or copied and vLLM's own outputs on every step, as in ``optout``),
right before or after its masked round (the order flips every round), in the same process.
``paired_ratios["on/on_optout"]`` is then what the masks cost the requests that ask for them,
free of which process drew which speed; ``on_optout/stock`` (with ``stock`` interleaved) is
what a mask engine costs requests that don't ask, with the per-process draw in it. Works with
or without ``--interleave``.

``--same-process-stock-sampler`` adds a third mode to the ``on`` engine's rounds,
``on_stock_sampler``: every request opted out *and* every step sampled by vLLM's own sampler
(FlashInfer), as stock samples; between rounds the benchmark switches the worker's sampler with
``LLM.collective_rpc`` (so ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` is set for every engine of
the run). ``on/on_stock_sampler`` and ``on_optout/on_stock_sampler`` are then the mask engine
against stock's sampling path within one process: no per-process draw, only the plugin's
wrappers (vLLM's own code, measured against stock as ``off``) beside stock's work. Not with
``--logprobs``: a mask engine returns processed logprobs, for which vLLM turns FlashInfer off.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from thread_load import busiest_threads, process_tree_threads, thread_cpu_times

CONFIG_ORDER = ("stock", "off", "on", "optout")
# The opted-out rounds that an ``on`` engine runs beside its own (``--same-process-optout``).
SAME_PROCESS_OPTOUT = "on_optout"
# Its rounds with every request opted out and vLLM's own sampler (``--same-process-stock-sampler``).
SAME_PROCESS_STOCK_SAMPLER = "on_stock_sampler"
OPTED_OUT_MODES = ("optout", SAME_PROCESS_OPTOUT, SAME_PROCESS_STOCK_SAMPLER)
DEFAULT_MODEL = "/root/models/qwen3-0.6b"
SMALL_MODEL_DIR = Path(tempfile.gettempdir()) / "vllm_sampling_mask_bench" / "tiny_model"
FULL = dict(batch_sizes=[1, 64, 256], output_len=256, prompt_len=128, reps=3, warmup_len=16)
SMALL = dict(batch_sizes=[1, 4], output_len=8, prompt_len=16, reps=2, warmup_len=4)
PLUGIN_PACKAGE = "vllm_sampling_mask"
GPU_FREE_TIMEOUT_S = 30.0


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="CPU smoke run: tiny model, batch 1 and 4, 8 tokens, fp32.")
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    parser.add_argument("--model", help=f"Default {DEFAULT_MODEL} (--small: a tiny local model).")
    parser.add_argument("--configs", default="off,on",
                        help="Comma list of stock, off, on, optout (default off,on).")
    parser.add_argument("--batch-sizes", type=int_list, help=f"Default {FULL['batch_sizes']}.")
    parser.add_argument("--output-len", type=int, help=f"Default {FULL['output_len']}.")
    parser.add_argument("--prompt-len", type=int, help=f"Default {FULL['prompt_len']}.")
    parser.add_argument("--reps", type=int, help=f"Timed rounds (default {FULL['reps']}).")
    parser.add_argument("--warmup-len", type=int, help="max_tokens of the warm-up generates.")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--logprobs", type=int, help="SamplingParams.logprobs (default None; RL "
                        "rollouts ask 1: stock returns raw logprobs, mask engines processed).")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                        help="Eager (default, fast start); --no-enforce-eager: torch.compile + "
                        "CUDA graphs.")
    parser.add_argument("--dtype", help="Model dtype (default auto; --small: float32).")
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--engine-args", type=json.loads, default={}, metavar="JSON",
                        help="More LLM(...) keywords for every engine, e.g. "
                        "'{\"speculative_config\": {\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 3}}'.")
    parser.add_argument("--same-process-optout", action="store_true",
                        help="The on engine also runs every round with all requests opted out "
                        f"({SAME_PROCESS_OPTOUT}), alternating with its own: the pair shares "
                        "one engine process.")
    parser.add_argument("--same-process-stock-sampler", action="store_true",
                        help="The on engine also runs every round with all requests opted out "
                        f"and vLLM's own sampler ({SAME_PROCESS_STOCK_SAMPLER}): stock's "
                        "sampling path in the mask engine's process.")
    parser.add_argument("--isolate", action="store_true", help="One subprocess per engine.")
    parser.add_argument("--interleave", action="store_true",
                        help="Keep every engine alive side by side (each in a subprocess) and "
                        "alternate their rounds.")
    parser.add_argument("--generations", type=int, default=1, metavar="G",
                        help="--interleave: G times, each with fresh engine processes.")
    parser.add_argument("--pin", type=int, metavar="N",
                        help="--interleave: run every engine on the same N fastest CPUs (2 for "
                        "its frontend, the rest for its engine core; each side's main thread "
                        "alone on one of them); N >= 3.")
    parser.add_argument("--frontend-cpus", type=int_list, help=argparse.SUPPRESS)
    parser.add_argument("--core-cpus", type=int_list, help=argparse.SUPPRESS)
    parser.add_argument("--worker-config", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = SMALL if args.small else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype is None:
        args.dtype = "float32" if args.small else "auto"  # vLLM's min-p kernel: no bf16 on CPU
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIG_ORDER))
    if unknown:
        parser.error(f"--configs: unknown {unknown}, choose from {list(CONFIG_ORDER)}")
    args.config_list = [c for c in CONFIG_ORDER if c in configs]
    if args.pin is not None and (args.pin < 3 or not args.interleave):
        parser.error("--pin N needs --interleave and N >= 3")
    if args.generations < 1 or (args.generations > 1 and not args.interleave):
        parser.error("--generations G needs --interleave and G >= 1")
    if args.same_process_stock_sampler and args.logprobs is not None:
        parser.error("--same-process-stock-sampler: not with --logprobs (vLLM does not sample "
                     "processed logprobs with FlashInfer, so it would not be stock's path)")
    return args


def setup_environment(small: bool) -> None:
    """Before vLLM is imported: the CPU test platform for ``--small`` (Triton interpreter)."""
    if not small:
        return
    from testing_support import testing_module

    os.environ.update(testing_module("cpu_platform").cpu_test_env())


def plugins_without_ours() -> str:
    """``VLLM_PLUGINS`` value that loads every installed vLLM plugin except this package's."""
    from importlib.metadata import entry_points

    names = {ep.name for group in ("vllm.platform_plugins", "vllm.general_plugins")
             for ep in entry_points(group=group) if not ep.value.startswith(PLUGIN_PACKAGE + ".")}
    return ",".join(sorted(names))


def sampler_info(cuda: bool) -> dict[str, Any]:
    """Which top-k/top-p sampler the ``off`` / ``stock`` engines use (as vLLM decides: FlashInfer
    needs CUDA, ``VLLM_USE_FLASHINFER_SAMPLER`` not 0 and an importable ``flashinfer``)."""
    env = os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")
    try:
        import flashinfer  # noqa: F401

        flashinfer_imports, error = True, None
    except Exception as exc:  # ImportError, or a broken install
        flashinfer_imports, error = False, f"{type(exc).__name__}: {exc}"[:200]
    env_allows = env is None or env.strip().lower() not in ("0", "false")
    if not cuda:
        off = "not CUDA: vLLM's PyTorch top-k/top-p (CPU smoke run)"
    elif env_allows and flashinfer_imports:
        off = "flashinfer"
    else:
        off = "triton (vLLM apply_top_k_top_p + gumbel_sample)"
    return {"VLLM_USE_FLASHINFER_SAMPLER": env, "flashinfer_imports": flashinfer_imports,
            "flashinfer_import_error": error, "off_sampler": off,
            "on_sampler": off if not cuda else
            "the plugin's candidate sampler where every top_k <= 1024 (FlashInfer's radix "
            "top-k + one Triton kernel), else vLLM's Triton top-k/top-p + compaction"}


def small_model() -> str:
    from vllm_sampling_mask.tiny_model import build_tiny_model

    return str(build_tiny_model(SMALL_MODEL_DIR))


def make_prompts(batch: int, round_index: int, prompt_len: int, vocab: int,
                 variant: int = 0) -> list[Any]:
    """``batch`` random ``TokensPrompt``s, a function of (batch, round, variant) only; a
    second variant gives an engine that runs two rounds per round prompts its prefix cache
    has not seen."""
    import numpy as np
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng([batch, round_index + 1] + ([variant] if variant else []))
    ids = rng.integers(10, vocab, size=(batch, prompt_len))  # above the special tokens
    return [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids]


NOT_CHECKED = {"ok": None, "rows": 0, "problems": []}
"""``mask_check`` of a checkpoint taken before the generation's last round (the one checked)."""


@contextlib.contextmanager
def engine_step_times(llm: Any) -> Iterator[list[float]]:
    """Collect, while the block runs, the engine core's timestamp of every step whose outputs
    reach ``llm``'s frontend: ``EngineCoreOutputs.timestamp``, ``time.monotonic()`` in the
    engine-core process when the step's outputs were built, so the frontend's own delays are
    not in the intervals. Steps without outputs are left out."""
    client = llm.llm_engine.engine_core
    get_output = client.get_output
    stamps: list[float] = []

    def recording_get_output(*args: Any, **kwargs: Any) -> Any:
        outputs = get_output(*args, **kwargs)
        if outputs.outputs:
            stamps.append(outputs.timestamp)
        return outputs

    client.get_output = recording_get_output
    try:
        yield stamps
    finally:
        del client.get_output  # the class's method again


def median_step_seconds(stamps: Sequence[float]) -> float | None:
    """Median interval between consecutive step timestamps (None with fewer than two): a
    round's typical step, which a few slow steps (the machine's, or the engine's own) do not
    move, unlike the round's tokens / wall time."""
    intervals = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(intervals) if intervals else None


def check_masks(outputs: list[Any], on: bool) -> dict[str, Any]:
    """Masks present, aligned and containing the sampled token (on); absent (off)."""
    rows = lengths = 0
    problems = []
    for output in outputs:
        for c in output.outputs:
            mask = getattr(c, "sampling_mask", None)
            if not on:
                if mask is not None:
                    problems.append(f"{output.request_id}: a mask with the switch off")
                continue
            if mask is None or len(mask.token_ids) != len(c.token_ids):
                num_rows = 0 if mask is None else len(mask.token_ids)
                problems.append(f"{output.request_id}: {num_rows} rows for "
                                f"{len(c.token_ids)} tokens")
                continue
            for token, row in zip(c.token_ids, mask.token_ids):
                rows += 1
                lengths += len(row)
                if token not in row:
                    problems.append(f"{output.request_id}: token {token} not in its row")
                    break
    return {"rows": rows, "mean_row_length": lengths / rows if rows else None,
            "problems": problems[:5], "ok": not problems}


class EngineUnderTest:
    """One engine of one config: warm-up, timed rounds, results (see ``run_config``).

    ``modes``: what each of its rounds runs, one timed generate each, in an order that flips
    every round: the config itself, and for ``on`` with ``--same-process-optout`` also
    ``on_optout``, the same batch size with every request opted out (fresh prompts, so the
    prefix cache never helps).
    """

    def __init__(self, name: str, args: argparse.Namespace, model: str,
                 gpu_memory_utilization: float | None) -> None:
        from vllm import LLM

        self.name, self.args = name, args
        # getattr: profile_engine_step builds engines from arguments of its own, without it
        self.modes = [name]
        if name == "on":
            for mode, flag in ((SAME_PROCESS_OPTOUT, "same_process_optout"),
                               (SAME_PROCESS_STOCK_SAMPLER, "same_process_stock_sampler")):
                if getattr(args, flag, False):
                    self.modes.append(mode)
        self.stock_sampler = False  # the worker's sampler as switched by enter_mode
        kwargs: dict[str, Any] = dict(
            model=model, enforce_eager=args.enforce_eager, dtype=args.dtype, seed=0,
            max_model_len=args.prompt_len + args.output_len + 16,
            max_num_seqs=max(args.batch_sizes),
        )
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(getattr(args, "engine_args", {}))  # profile_engine_step: none
        if name in ("on", "optout"):
            kwargs.update(return_sampling_mask=True, logprobs_mode="processed_logprobs")
        began = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.start_s = time.perf_counter() - began
        self.vllm_config = self.llm.llm_engine.vllm_config
        # The tokenizer's base vocabulary: ids added on top of it (a vision-language model's
        # image placeholders) would ask for inputs a random prompt does not have.
        self.vocab = min(self.llm.get_tokenizer().vocab_size,
                         self.vllm_config.model_config.get_vocab_size())
        self.rounds: dict[str, dict[int, list[dict[str, float]]]] = {
            mode: {b: [] for b in args.batch_sizes} for mode in self.modes}
        self.checks: dict[str, dict[int, dict[str, Any]]] = {mode: {} for mode in self.modes}

    def params(self, max_tokens: int, mode: str | None = None) -> Any:
        from vllm import SamplingParams

        a = self.args
        opt_out = (mode or self.name) in OPTED_OUT_MODES
        return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                              max_tokens=max_tokens, ignore_eos=True, logprobs=a.logprobs,
                              extra_args={"return_sampling_mask": False} if opt_out else None)

    def enter_mode(self, mode: str) -> None:
        """Switch the worker's sampler to vLLM's own for ``on_stock_sampler`` rounds and back.

        The candidate sampler takes a step whose top_k are all <= the capture's width cap; a
        cap of 0 sends every step to vLLM's sampler, which uses FlashInfer when no request of
        the step wants masks (``worker/sampler.py``). Only opted-out requests run meanwhile.
        """
        stock_sampler = mode == SAME_PROCESS_STOCK_SAMPLER
        if stock_sampler == self.stock_sampler:
            return

        def switch(worker: Any, to_stock: bool) -> int:
            sampler = getattr(worker.model_runner, "sampler", None)
            capture = getattr(sampler, "sampling_mask_capture", None)
            if capture is None:
                raise RuntimeError("--same-process-stock-sampler needs a mask engine on Model "
                                   "Runner V2 (its sampler carries the capture)")
            if "bench_max_width" not in capture.__dict__:
                capture.bench_max_width = capture.max_width
            capture.max_width = 0 if to_stock else capture.bench_max_width
            return capture.max_width

        self.llm.collective_rpc(switch, args=(stock_sampler,))
        self.stock_sampler = stock_sampler

    def warm_up(self) -> None:
        for mode in self.modes:
            self.enter_mode(mode)
            for b in self.args.batch_sizes:  # round -1: prompts no timed round uses
                self.llm.generate(make_prompts(b, -1, self.args.prompt_len, self.vocab),
                                  self.params(self.args.warmup_len, mode), use_tqdm=False)

    def run_round(self, batch: int, round_index: int) -> None:
        for mode in self.modes if round_index % 2 == 0 else self.modes[::-1]:
            self.run_mode_round(mode, batch, round_index)

    def run_mode_round(self, mode: str, batch: int, round_index: int) -> None:
        prompts = make_prompts(batch, round_index, self.args.prompt_len, self.vocab,
                               variant=self.modes.index(mode))
        self.enter_mode(mode)
        cpu_before = thread_cpu_times(os.getpid())
        with engine_step_times(self.llm) as stamps:
            t0 = time.perf_counter()
            outputs = self.llm.generate(prompts, self.params(self.args.output_len, mode),
                                        use_tqdm=False)
            seconds = time.perf_counter() - t0
        busy = busiest_threads(cpu_before, thread_cpu_times(os.getpid()), seconds)
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        # At the round's mean tokens per step (the batch size, but with draft tokens).
        step_s = median_step_seconds(stamps)
        step = {} if step_s is None else {
            "median_step_s": step_s, "median_step_tokens_per_s": tokens / len(stamps) / step_s}
        self.rounds[mode][batch].append({"seconds": seconds, "output_tokens": tokens,
                                         "tokens_per_s": tokens / seconds} | step | busy)
        print(f"[{mode}] B={batch} round {round_index}: {tokens / seconds:,.0f} tok/s "
              f"({tokens} tokens, {seconds:.2f} s; median step "
              f"{step_s * 1e3 if step_s else float('nan'):.3f} ms; busiest thread busy: "
              f"frontend {busy['frontend_busy']:.2f}, engine core {busy['core_busy']:.2f})",
              flush=True)
        if round_index % self.args.reps == self.args.reps - 1:  # a generation's last round
            self.checks[mode][batch] = check_masks(outputs, on=mode == "on")

    def results(self) -> dict[str, dict[str, Any]]:
        """``{mode: result}``; the two modes of one process are marked as alternating rounds
        (``interleaved``), so ``paired_ratios`` and ``pool_paired_rounds`` pair them."""
        common = {
            "engine_start_s": self.start_s,
            "use_v2_model_runner": bool(self.vllm_config.use_v2_model_runner),
            "logprobs_mode": str(self.vllm_config.model_config.logprobs_mode),
            "additional_config": dict(self.vllm_config.additional_config or {}),
        }
        if len(self.modes) > 1:
            common |= {"interleaved": True, "engine_process": self.name}
        return {mode: common | {"by_batch": {str(b): {
            "median_tokens_per_s": statistics.median(x["tokens_per_s"] for x in rounds),
            "best_tokens_per_s": max(x["tokens_per_s"] for x in rounds),
            "rounds": rounds, "mask_check": self.checks[mode].get(b, NOT_CHECKED)}
            for b, rounds in self.rounds[mode].items()}} for mode in self.modes}

    def shutdown(self) -> None:
        shutdown(self.llm)
        del self.llm
        gc.collect()


REPLY_PREFIX = "@@bench_engine_throughput@@ "


class EngineProcess:
    """One engine in a subprocess that runs rounds on request, so engines can be interleaved
    (``stock`` with this plugin not loaded). ``cpus`` = (frontend, engine core) pins it. The
    child imports vLLM at once and builds its engine on ``build()``: the engines of a
    generation import side by side, and start one after the other (an engine measures the GPU
    memory free at its start)."""

    def __init__(self, name: str, args: argparse.Namespace, argv: Sequence[str],
                 gpu_memory_utilization: float,
                 cpus: tuple[list[int], list[int]] | None = None) -> None:
        env = dict(os.environ)
        if name == "stock":
            env["VLLM_PLUGINS"] = plugins_without_ours()
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker-config", name,
               "--worker-serve", "--gpu-memory-utilization", str(gpu_memory_utilization)]
        if cpus is not None:
            cmd += ["--frontend-cpus", ",".join(map(str, cpus[0])),
                    "--core-cpus", ",".join(map(str, cpus[1]))]
        print(f"[{name}] subprocess: {' '.join(cmd)}", flush=True)
        self.name, self.args = name, args
        self.plugins = env.get("VLLM_PLUGINS")
        self.process = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, bufsize=1)

    def build(self) -> None:
        self.call("build")

    def call(self, command: str) -> Any:
        """Send one command, echo the child's output until its reply, return the reply."""
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(REPLY_PREFIX):
                reply = json.loads(line[len(REPLY_PREFIX):])
                if "error" in reply:
                    raise RuntimeError(f"{self.name} engine: {reply['error']}")
                return reply["value"]
            print(line, end="", flush=True)
        raise RuntimeError(f"{self.name} engine exited (code {self.process.wait()})")

    def warm_up(self) -> None:
        self.call("warm_up")

    def run_round(self, batch: int, round_index: int) -> None:
        self.call(f"round {batch} {round_index}")

    def results(self) -> dict[str, dict[str, Any]]:
        extra = {"VLLM_PLUGINS": self.plugins} if self.name == "stock" else {}
        return {mode: result | extra for mode, result in self.call("results").items()}

    def shutdown(self) -> None:
        if self.process.poll() is None:
            try:
                self.call("quit")
            finally:
                self.process.wait(timeout=120)


def serve_rounds(name: str, args: argparse.Namespace, model: str) -> None:
    """Child of ``EngineProcess``: import vLLM, build the engine (pinned where asked) on
    ``build``, then run the commands read on stdin (``warm_up``, ``round B R``, ``results``,
    ``quit``), one reply line each."""
    def reply(**message: Any) -> None:
        print(REPLY_PREFIX + json.dumps(message), flush=True)

    if args.frontend_cpus and args.core_cpus:
        # On the same CPUs from the start, so every engine's processes start, and take their
        # memory, where they will run (the engine core inherits this); split once it exists.
        os.sched_setaffinity(0, set(args.frontend_cpus) | set(args.core_cpus))
    import vllm  # noqa: F401  (the slow part of a start, before the parent's turn comes)

    if sys.stdin.readline().strip() != "build":
        return
    engine = EngineUnderTest(name, args, model, args.gpu_memory_utilization)
    pinned = bool(args.frontend_cpus and args.core_cpus)
    if pinned:
        counts = pin_process_tree(args.frontend_cpus, args.core_cpus)
        print(f"[{name}] pinned {counts['frontend_threads']} frontend threads to "
              f"{args.frontend_cpus}, {counts['core_threads']} engine-core threads to "
              f"{args.core_cpus} (main threads on the first of each)", flush=True)
    reply(value=None)
    try:
        for line in sys.stdin:
            command, *params = line.split()
            try:
                value = None
                if command == "warm_up":
                    engine.warm_up()
                elif command == "round":
                    if pinned:  # threads started since (they inherit their starter's CPUs)
                        pin_process_tree(args.frontend_cpus, args.core_cpus)
                    engine.run_round(int(params[0]), int(params[1]))
                elif command == "results":
                    value = engine.results()
                elif command == "quit":
                    reply(value=None)
                    return
                reply(value=value)
            except Exception as exc:  # the parent reports it and stops
                reply(error=f"{type(exc).__name__}: {exc}"[:2000])
    finally:
        engine.shutdown()


def run_config(name: str, args: argparse.Namespace, model: str) -> dict[str, dict[str, Any]]:
    """Build one engine, time every batch size, shut it down; ``{mode: result}`` (see
    ``EngineUnderTest``). Runs in this process."""
    engine = EngineUnderTest(name, args, model, args.gpu_memory_utilization)
    try:
        engine.warm_up()
        for r in range(args.reps):
            for b in args.batch_sizes:
                engine.run_round(b, r)
        return engine.results()
    finally:
        engine.shutdown()


def run_generation(names: list[str], generation: int, args: argparse.Namespace, model: str,
                   argv: Sequence[str], pinning: dict[str, Any] | None,
                   checkpoint: Callable[[dict[str, dict[str, Any]]], None]
                   ) -> dict[str, dict[str, Any]]:
    """One generation: all ``names`` engines alive at once, each in a fresh process of its own
    (with ``--gpu-memory-utilization``, default 0.85 / their number; started in an order
    rotated by ``generation``), rounds ``generation * reps ...`` alternating between them (the
    order flips every round), so a drift of the machine over time affects every config alike.
    ``checkpoint`` gets the generation's results after every round but its last (a run cut by
    a time limit keeps the rounds it finished)."""
    share = args.gpu_memory_utilization or round(0.85 / len(names), 2)
    cpus = (pinning["frontend_cpus"], pinning["core_cpus"]) if pinning else None
    shift = generation % len(names)
    start_order = names[shift:] + names[:shift]
    engines: list[EngineProcess] = []
    try:
        for name in start_order:
            engines.append(EngineProcess(name, args, argv, share, cpus))
        for engine in engines:
            engine.build()
        for engine in engines:
            engine.warm_up()

        def results() -> dict[str, dict[str, Any]]:
            return {mode: result | {"isolated": True, "interleaved": True,
                                    "gpu_memory_utilization": share}
                    for e in engines for mode, result in e.results().items()}

        for r in range(generation * args.reps, (generation + 1) * args.reps):
            for b in args.batch_sizes:
                for engine in (engines if r % 2 == 0 else engines[::-1]):
                    engine.run_round(b, r)
            if r < (generation + 1) * args.reps - 1:
                checkpoint(results())
        return results()
    finally:
        for engine in engines:
            engine.shutdown()
        free_gpu_memory()


def merge_generations(generations: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One result per engine from its generations' results: every round (tagged with its
    ``generation``), medians and best rounds over all of them, the mask checks of all."""
    merged: dict[str, dict[str, Any]] = {}
    for name in generations[0]:
        runs = [g[name] for g in generations if name in g]
        result = dict(runs[0])
        result["engine_start_s_by_generation"] = [r["engine_start_s"] for r in runs]
        result["by_batch"] = {}
        for batch in runs[0]["by_batch"]:
            rounds = [x | {"generation": g} for g, r in enumerate(runs)
                      for x in r["by_batch"][batch]["rounds"]]
            checks = [r["by_batch"][batch]["mask_check"] for r in runs]
            oks = [c["ok"] for c in checks]
            result["by_batch"][batch] = {
                "median_tokens_per_s": statistics.median(x["tokens_per_s"] for x in rounds),
                "best_tokens_per_s": max(x["tokens_per_s"] for x in rounds),
                "rounds": rounds,
                "mask_check": {"ok": None if None in oks else all(oks),
                               "rows": sum(c["rows"] for c in checks),
                               "problems": [p for c in checks for p in c["problems"]][:5],
                               "by_generation": checks}}
        merged[name] = result
    return merged


def choose_cpus(count: int) -> dict[str, Any]:
    """The ``count`` CPUs that run a fixed loop fastest now: two for frontends, the rest for
    engine cores, each side's first CPU for its main thread (``pin_process_tree``); the
    fastest for the engine core's, which bounds a step, the second fastest for the frontend's."""
    from probe_machine_noise import fastest_cpus

    available = len(os.sched_getaffinity(0))
    if available < count:
        raise SystemExit(f"--pin {count}: this process may run on {available} CPUs only")
    chosen, seconds = fastest_cpus(count)
    print(f"CPUs {chosen} chosen (loop ms per CPU: "
          f"{ {c: round(s * 1e3, 2) for c, s in seconds.items()} })", flush=True)
    by_speed = sorted(chosen, key=lambda cpu: seconds[str(cpu)])
    return {"frontend_cpus": by_speed[1:3], "core_cpus": by_speed[:1] + by_speed[3:],
            "loop_s_per_cpu": seconds, "main_threads_alone": True}


def pin_process_tree(frontend_cpus: list[int], core_cpus: list[int]) -> dict[str, int]:
    """Pin this process's threads to ``frontend_cpus`` and its descendants' (the engine core and
    what it started) to ``core_cpus``; on each side, the main threads alone on its first CPU,
    the other threads on the rest (on the first too where a side has one CPU).

    The main threads are the hot ones (``LLM.generate`` in the frontend; the engine core's busy
    loop, which with one GPU also runs the worker): each alone on one CPU, that CPU the same for
    every engine, so the engines of a round run their hot threads on the same vCPUs. Left to
    the kernel among a side's CPUs, a hot thread tends to stay where it last ran, so two
    engines' hot threads could sit on two vCPUs of different speeds for a whole process life.
    Threads started later inherit their starter's pinning: the child calls this again before
    every round."""
    counts = {"frontend": 0, "core": 0}
    for side, thread, main in process_tree_threads(os.getpid()):
        cpus = frontend_cpus if side == "frontend" else core_cpus
        try:
            os.sched_setaffinity(thread.id, cpus[:1] if main or len(cpus) == 1 else cpus[1:])
            counts[side] += 1
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return {"frontend_threads": counts["frontend"], "core_threads": counts["core"]}


def shutdown(llm: Any) -> None:
    """Stop the engine-core process now (instead of at garbage collection)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # best effort: GC shuts it down too
        print(f"engine shutdown: {type(exc).__name__}: {exc}", flush=True)


def free_gpu_memory() -> None:
    """Release cached memory here and wait until the previous engine's process let go of its."""
    try:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except ImportError:
        pass
    if shutil.which("nvidia-smi") is None:
        time.sleep(5)
        return
    deadline = time.monotonic() + GPU_FREE_TIMEOUT_S
    used = None
    while time.monotonic() < deadline:
        try:
            query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
            out = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout
            used = max(int(x) for x in out.split())  # MiB
        except (OSError, ValueError, subprocess.SubprocessError):
            time.sleep(5)
            return
        if used < 2048:
            return
        time.sleep(1)
    print(f"warning: {used} MiB still used on the GPU after {GPU_FREE_TIMEOUT_S:.0f} s", flush=True)


def run_isolated(name: str, argv: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``run_config`` in a fresh interpreter (``stock`` also hides this plugin from vLLM)."""
    env = dict(os.environ)
    if name == "stock":
        env["VLLM_PLUGINS"] = plugins_without_ours()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv,
               "--worker-config", name, "--worker-out", str(out)]
        print(f"[{name}] subprocess: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, env=env, check=True)
        results = json.loads(out.read_text())
    extra = {"VLLM_PLUGINS": env["VLLM_PLUGINS"]} if name == "stock" else {}
    return {mode: result | {"isolated": True} | extra for mode, result in results.items()}


def main(argv: Sequence[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    setup_environment(args.small)
    if args.same_process_stock_sampler:
        # collective_rpc sends a function (EngineUnderTest.enter_mode); set for every engine
        # of the run (inherited by the subprocesses), so all run under the same settings.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    model = args.model or (small_model() if args.small else DEFAULT_MODEL)

    if args.worker_config and args.worker_serve:  # child of EngineProcess
        serve_rounds(args.worker_config, args, model)
        return None
    if args.worker_config:  # child of run_isolated
        result = run_config(args.worker_config, args, model)
        args.worker_out.write_text(json.dumps(result))
        return None

    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    sequential = [] if args.interleave else args.config_list
    for i, name in enumerate(sequential):
        try:
            if args.isolate or name == "stock":
                results.update(run_isolated(name, argv))
            else:
                try:
                    results.update({mode: result | {"isolated": False} for mode, result
                                    in run_config(name, args, model).items()})
                except Exception as exc:
                    # A later engine may find the GPU memory of the previous one not yet
                    # released: retry that case once, in a fresh process.
                    if i == 0 or "memory" not in str(exc).lower():
                        raise
                    print(f"[{name}] in-process engine failed ({type(exc).__name__}: {exc}); "
                          "retrying in a subprocess", flush=True)
                    free_gpu_memory()
                    error = f"{type(exc).__name__}: {exc}"[:500]
                    results.update({mode: result | {"in_process_error": error} for mode, result
                                    in run_isolated(name, argv).items()})
        except Exception as exc:  # keep the other engines' numbers
            errors[name] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"[{name}] FAILED: {errors[name]}", flush=True)
        free_gpu_memory()
    together = [n for n in args.config_list if n not in sequential]
    if not together:
        return write_report(args, model, None, results, errors, final=True)
    pinning = choose_cpus(args.pin) if args.pin else None
    generations: list[dict[str, dict[str, Any]]] = []
    for generation in range(args.generations):
        def checkpoint(partial: dict[str, dict[str, Any]]) -> None:
            write_report(args, model, pinning, results | merge_generations(
                generations + [partial]), errors, final=False)

        try:
            generations.append(run_generation(together, generation, args, model, argv, pinning,
                                              checkpoint))
        except Exception as exc:
            errors["+".join(together)] = (f"generation {generation}: "
                                          f"{type(exc).__name__}: {exc}"[:2000])
            print(f"[{'+'.join(together)}] FAILED: {errors['+'.join(together)]}", flush=True)
            break
        if generation < args.generations - 1:
            write_report(args, model, pinning, results | merge_generations(generations), errors,
                          final=False)
    if generations:
        results.update(merge_generations(generations))
    return write_report(args, model, pinning, results, errors, final=True)


def write_report(args: argparse.Namespace, model: str, pinning: dict[str, Any] | None,
                  results: dict[str, dict[str, Any]], errors: dict[str, str],
                  final: bool) -> dict[str, Any]:
    """Build the report, print it, write ``--out``; the last call also exits non-zero if an
    engine failed. Earlier calls (after each but the last generation) are checkpoints."""
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k not in ("out", "worker_config", "worker_out", "worker_serve")} | {"model": model},
        "environment": environment(args.small) | {"cpu_pinning": pinning},
        "results": results,
        "errors": errors,
        "ratios": ratios(results, args.batch_sizes),
        "best_round_ratios": ratios(results, args.batch_sizes, "best_tokens_per_s"),
        "paired_ratios": paired_ratios(results),
        "paired_step_ratios": paired_ratios(results, "median_step_tokens_per_s"),
        "complete": final,
    }
    print("\n" + markdown(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"\nwritten to {args.out}{'' if final else ' (checkpoint)'}")
    if final and errors:
        sys.exit(f"failed engines: {sorted(errors)}")
    return report


def environment(small: bool) -> dict[str, Any]:
    import torch
    import vllm

    cuda = not small and torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "cpu (Triton interpreter)"
    return {"device": device, "vllm": vllm.__version__, "torch": torch.__version__,
            "plugin_installed": importlib.util.find_spec(PLUGIN_PACKAGE) is not None,
            "sampler": sampler_info(cuda)}


def ratios(results: dict[str, dict], batch_sizes: list[int],
           key: str = "median_tokens_per_s") -> dict[str, dict[str, float]]:
    """``{"on/off": {B: ratio}, ...}`` of the engines' ``key`` throughput per batch size."""
    def tps(name: str, b: int) -> float:
        return results[name]["by_batch"][str(b)][key]

    out: dict[str, dict[str, float]] = {}
    for num, den in (("on", "off"), ("off", "stock"), ("on", "stock"), ("optout", "off"),
                     ("optout", "stock"), ("on", SAME_PROCESS_OPTOUT),
                     (SAME_PROCESS_OPTOUT, "stock"), ("on", SAME_PROCESS_STOCK_SAMPLER),
                     (SAME_PROCESS_OPTOUT, SAME_PROCESS_STOCK_SAMPLER),
                     (SAME_PROCESS_STOCK_SAMPLER, "stock")):
        if num in results and den in results:
            out[f"{num}/{den}"] = {str(b): tps(num, b) / tps(den, b) for b in batch_sizes}
    return out


def paired_ratios(results: dict[str, dict],
                  metric: str = "tokens_per_s") -> dict[str, dict[str, Any]]:
    """``{"on/stock": {B: {"median", "min", "max", "rounds", "by_generation", "interval"}},
    ...}``: round r of each engine over round r of the baseline (stock, else off), which ran
    next to it in time, and ``on/on_optout``, ``on/on_stock_sampler`` and
    ``on_optout/on_stock_sampler`` (the modes of one process); the median pair
    of each generation, and the 95% interval of the median from resampling generations (None
    with one generation)."""
    from pool_paired_rounds import paired_log_ratios, summarize

    base = "stock" if "stock" in results else "off" if "off" in results else None
    comparisons = [(name, base) for name in results if base is not None and name != base]
    if "on" in results and SAME_PROCESS_OPTOUT in results:
        comparisons.append(("on", SAME_PROCESS_OPTOUT))
    if SAME_PROCESS_STOCK_SAMPLER in results:
        comparisons += [(name, SAME_PROCESS_STOCK_SAMPLER) for name in ("on", SAME_PROCESS_OPTOUT)
                        if name in results]
    out: dict[str, dict[str, Any]] = {}
    for name, baseline in comparisons:
        by_batch = {}
        for b, clusters in paired_log_ratios({"results": results}, name, baseline,
                                             metric).items():
            rounds = [math.exp(x) for cluster in clusters for x in cluster]
            pooled = summarize(clusters)
            by_batch[b] = {
                "median": statistics.median(rounds), "min": min(rounds), "max": max(rounds),
                "rounds": rounds,
                "by_generation": [math.exp(statistics.median(c)) for c in clusters],
                "interval": [pooled["median_low"], pooled["median_high"]]
                if len(clusters) > 1 else None}
        if by_batch:  # engines that did not alternate rounds have no pairs
            out[f"{name}/{baseline}"] = by_batch
    return out


def markdown(report: dict) -> str:
    c, results = report["config"], report["results"]
    names = list(results)
    env = report["environment"]
    lines = [f"{c['model']} on {env['device']}, {'eager' if c['enforce_eager'] else 'compiled'}, "
             f"prompt {c['prompt_len']} -> {c['output_len']} tokens, top_k {c['top_k']}, "
             f"top_p {c['top_p']}, {c['reps']} rounds (median)"
             f"{', engines interleaved' if c['interleave'] else ''}; off sampler: "
             f"{env['sampler']['off_sampler']}", ""]
    header = "| B | " + " | ".join(f"{n} tok/s" for n in names) + " | " + " | ".join(
        report["ratios"]) + " |"
    lines += [header, "|" + "---:|" * header.count(" | ") + "---:|"]
    for b in c["batch_sizes"]:
        cells = [f"{results[n]['by_batch'][str(b)]['median_tokens_per_s']:,.0f}" for n in names]
        cells += [f"{r[str(b)]:.3f}" for r in report["ratios"].values()]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, by_batch in report["best_round_ratios"].items():
        lines.append(f"best round {name}: " + ", ".join(
            f"B={b} {by_batch[str(b)]:.3f}" for b in c["batch_sizes"]))
    for kind, pairs in (("", report.get("paired_ratios", {})),
                        (" at their median step", report.get("paired_step_ratios", {}))):
        for name, by_batch in pairs.items():
            lines.append(f"paired rounds{kind} {name} (median [min, max]): " + ", ".join(
                f"B={b} {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]"
                for b, v in by_batch.items()))
            if any(v["interval"] for v in by_batch.values()):
                lines.append("  by generation (median pair of each; 95% interval over "
                             "generations): " + ", ".join(
                                 f"B={b} " + "/".join(f"{g:.3f}" for g in v["by_generation"])
                                 + f" [{v['interval'][0]:.3f}, {v['interval'][1]:.3f}]"
                                 for b, v in by_batch.items()))
    for n in names:
        busy = [(b, [x["frontend_busy"] for x in v["rounds"]],
                 [x["core_busy"] for x in v["rounds"]])
                for b, v in results[n]["by_batch"].items() if "core_busy" in v["rounds"][0]]
        if busy:
            lines.append(f"{n}: busiest thread's CPU / wall, median round, frontend / engine core: "
                         + ", ".join(f"B={b} {statistics.median(f):.2f} / "
                                     f"{statistics.median(c):.2f}" for b, f, c in busy))
    for n in names:
        r = results[n]
        oks = [x["mask_check"]["ok"] for x in r["by_batch"].values()]
        check = "not yet" if None in oks else "ok" if all(oks) else "FAILED"
        lines.append(f"{n}: engine start {r['engine_start_s']:.0f} s, MRV2 "
                     f"{r['use_v2_model_runner']}, logprobs_mode {r['logprobs_mode']}, "
                     f"mask check {check}")
    for n, error in report["errors"].items():
        lines.append(f"{n}: FAILED: {error.splitlines()[0] if error else ''}")
    runners = {results[n]["use_v2_model_runner"] for n in names}
    if len(runners) > 1:
        lines.append("WARNING: the engines used different model runners; the ratios compare "
                     "more than the masks.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
