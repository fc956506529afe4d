"""What masks cost the frontend process where it bounds the engine: vLLM's real output path.

With ``logprobs=1`` at batch 64 and 256 the offline engine's frontend (one Python process, one
GIL) is the bound on the H200, stock included (docs/benchmarks.md, "With `logprobs=1`"): its
CPU time per step, not the engine core's, sets the throughput. This script measures that CPU time
without using a GPU (on a GPU machine, its host's CPU: ``run_h200.sh frontend``): one round of
``--requests`` requests generating ``--tokens`` tokens each with ``--logprobs`` top logprobs
(FINAL_ONLY, as ``LLM.generate`` asks), each step's ``EngineCoreOutputs`` decoded from its
msgpack frames (the frontend's output thread) and passed to a real vLLM 0.26 ``OutputProcessor``
with a real tokenizer and detokenizer::

    python benchmarks/bench_output_processor.py --out bench_out/output_processor.json
    python benchmarks/bench_output_processor.py --small          # smoke (seconds)

Two modes in one process, in lock step (``run_round``), the plugin's patches applied in both:

- ``stock``: vLLM's ``EngineCoreOutputs`` decoded by vLLM's decoder, a processor with masks
  off (what the plugin's wrappers cost there is vLLM's own path plus one attribute read);
- ``on``: the outputs also carry the rows (``--top-k`` ids each) as a mask engine's scheduler
  sends them, decoded by its decoder (``EngineCoreOutputsWithMasks``), a processor with masks
  on; each request's ``CompletionOutput.sampling_mask`` is attached at its end (not read).
  ``--rows held`` (default): the rows of these FINAL_ONLY requests are held in the engine core
  and come every ``HELD_STEPS`` steps and with the last output; ``--rows every_step``: every output
  carries its token's row, as for a FINAL_ONLY request with stop strings (which the requests of
  both modes then have).

Reported per round: each mode's thread CPU time per step and stock/on of it (the headline: a
frontend-bound engine's on/stock throughput, as far as the frontend's own work goes), with the
collector off while the modes are timed (``--collector off``, the default; see ``run_round``),
or on, its share counted apart (then also stock/on without that share), and each mode's CPU
time split between the steps that carry rows in ``on`` (held: every ``HELD_STEPS``-th and the
last) and the others, per round (``median_ms_per_round``). The engine core's
frames are built before the round (their cost is the engine core's: ``bench_host_overhead.py``).
The tokenizer is the tiny model's (a BPE trained on a small corpus, at most
``--tokenizer-vocab`` ids), token ids random.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from size_defaults import fill_size_defaults  # benchmarks/, the script's own directory

FULL_SIZE = dict(requests=256, tokens=256, rounds=8)
SMALL_SIZE = dict(requests=8, tokens=8, rounds=2)
MODES = ("stock", "on")
MODEL_DIR = Path(tempfile.gettempdir()) / "vllm_sampling_mask_bench" / "output_processor_model"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help=f"Small sizes {SMALL_SIZE}.")
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    parser.add_argument("--requests", type=int, help=f"R (default {FULL_SIZE['requests']}).")
    parser.add_argument("--tokens", type=int,
                        help=f"Tokens per request, i.e. steps (default {FULL_SIZE['tokens']}).")
    parser.add_argument("--rounds", type=int,
                        help=f"Rounds, each of both modes (default {FULL_SIZE['rounds']}).")
    parser.add_argument("--logprobs", type=int, default=1, help="Top logprobs per token (-1: none).")
    parser.add_argument("--top-k", type=int, default=50, help="Ids per mask row.")
    parser.add_argument("--rows", choices=("held", "every_step"), default="held",
                        help="How the engine core sends the rows (see the module docstring).")
    parser.add_argument("--collector", choices=("off", "on"), default="off",
                        help="Python's cyclic collector while the modes are timed (run_round).")
    parser.add_argument("--block", type=int, default=16,
                        help="Steps each mode runs before the other takes its turn.")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokenizer-vocab", type=int, default=8192,
                        help="Vocabulary the tiny tokenizer is trained for (it may end smaller).")
    return fill_size_defaults(parser.parse_args(argv), SMALL_SIZE, FULL_SIZE)


class RoundInputs:
    """One round's requests and the msgpack frames of each of its steps, per mode."""

    def __init__(self, args: argparse.Namespace, round_index: int, vocab: int) -> None:
        import numpy as np
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
        from vllm.v1.outputs import LogprobsLists
        from vllm.v1.serial_utils import MsgpackEncoder

        from vllm_sampling_mask.engine.transport import (
            EngineCoreOutputsWithMasks,
            EngineCoreOutputWithMask,
            JoinedMaskRows,
        )

        rng = np.random.default_rng(round_index)
        R, T, n = args.requests, args.tokens, args.logprobs
        self.request_ids = [f"round{round_index}-{i:032x}" for i in range(R)]
        self.prompts = rng.integers(1, vocab, (R, args.prompt_len)).tolist()
        tokens = rng.integers(1, vocab, (T, R))
        encoder = MsgpackEncoder()
        self.frames: dict[str, list[Any]] = {mode: [] for mode in MODES}
        self.row_steps = self.row_steps_of(args)
        held: list[list[bytes]] = [[] for _ in range(R)]
        for t in range(T):
            finish = FinishReason.LENGTH if t == T - 1 else None
            stock, on = [], []
            for r, rid in enumerate(self.request_ids):
                token = int(tokens[t, r])
                fields = dict(request_id=rid, new_token_ids=[token], finish_reason=finish)
                if n >= 0:  # [1, 1 + n]: the sampled token, then the top n (as the scheduler)
                    ids = np.concatenate(([token], rng.integers(1, vocab, n))).astype(np.int32)
                    fields["new_logprobs"] = LogprobsLists(
                        ids[None], -rng.random((1, 1 + n), dtype=np.float32) * 5,
                        np.ones(1, dtype=np.int32))
                row = np.union1d(rng.choice(vocab, args.top_k - 1, replace=False), [token])
                row_bytes = row.astype("<i4").tobytes()
                if args.rows == "held":
                    held[r].append(row_bytes)
                    rows, sent = held[r], t in self.row_steps
                    # sent as the scheduler sends held rows: the rows' lengths and ids, joined
                    row_bytes = JoinedMaskRows(
                        np.array([len(b) >> 2 for b in rows], dtype="<i4").tobytes(),
                        b"".join(rows)) if sent else None
                    if sent:
                        held[r] = []
                stock.append(EngineCoreOutput(**fields))
                on.append(EngineCoreOutputWithMask(**fields, sampling_mask=row_bytes))
            stamp = time.monotonic()
            self.frames["stock"].append(encoder.encode(EngineCoreOutputs(outputs=stock,
                                                                         timestamp=stamp)))
            self.frames["on"].append(encoder.encode(EngineCoreOutputsWithMasks(outputs=on,
                                                                               timestamp=stamp)))

    @staticmethod
    def row_steps_of(args: argparse.Namespace) -> set[int]:
        """The steps whose ``on`` frames carry rows: every step, or (held) every
        ``HELD_STEPS``-th and the last."""
        from vllm_sampling_mask.core.scheduler import HELD_STEPS

        last = args.tokens - 1
        return {t for t in range(args.tokens)
                if args.rows == "every_step" or t == last or (t + 1) % HELD_STEPS == 0}


def new_processor(mode: str, inputs: RoundInputs, args: argparse.Namespace,
                  tokenizer: Any) -> Any:
    """A vLLM ``OutputProcessor`` (masks on for ``on``) holding the round's requests, as
    ``LLM.generate`` adds them (FINAL_ONLY)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor

    from vllm_sampling_mask.engine.output_processor import enable_masks

    processor = OutputProcessor(tokenizer, log_stats=False)
    enable_masks(processor, mode == "on")
    for rid, prompt in zip(inputs.request_ids, inputs.prompts):
        params = SamplingParams(temperature=1.0, top_k=args.top_k, top_p=0.95,
                                max_tokens=args.tokens, output_kind=RequestOutputKind.FINAL_ONLY,
                                logprobs=None if args.logprobs < 0 else args.logprobs,
                                stop=["<never in the text>"] if args.rows == "every_step" else None)
        params.update_from_generation_config({}, 0)
        processor.add_request(EngineCoreRequest(
            request_id=rid, prompt_token_ids=prompt, mm_features=None, sampling_params=params,
            pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
            data_parallel_rank=None, external_req_id=rid), None)
    return processor


def run_round(inputs: RoundInputs, args: argparse.Namespace, tokenizer: Any,
              decoders: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Both modes' processors in lock step: every block of ``--block`` steps is decoded and
    processed by one, then the other (the order flips every block), each step timed (thread
    CPU), so a slow phase of the machine lands on both. (Modes alternate by block, not every
    step: vLLM's code would then see the two modes' request-state classes alternate 256
    outputs at a time, and CPython's specialised attribute lookups, re-made at every switch,
    would cost both; an engine runs one mode.)

    The collector is off while the modes run (``--collector off``; a full collection after the
    round). A full collection walks every tracked object of the process (~600k with vLLM,
    transformers and torch loaded; ~0.35 s on the dev machine), and which mode it lands in
    follows the process's allocation sequence, not what the mode allocated: two modes in one
    process put it in ``on`` 3 times a round to ``stock``'s once (dev machine and H200 host),
    where each mode alone in its own process collects as often as the other (5 and 6 times in
    768 steps, dev machine). Its time can be counted apart (``--collector on``: callbacks, by
    the mode it ran in), but not the slower work after it (caches it emptied), which then
    lands on ``on`` too.

    Returns ``{mode: {"cpu_ms_per_step", "gc_ms_per_step", "full_collections",
    "row_steps_ms", "other_steps_ms"}}``: the last two split the round's CPU time between the
    steps whose ``on`` frames carry rows (``RoundInputs.row_steps``) and the others.
    """
    processors = {mode: new_processor(mode, inputs, args, tokenizer) for mode in MODES}
    step_ns = {mode: [0] * args.tokens for mode in MODES}
    collector = {mode: [0, 0.0] for mode in MODES}  # [full collections, seconds of all]
    finished: dict[str, list[Any]] = {mode: [] for mode in MODES}
    running: list[Any] = [MODES[0], 0.0]  # the mode being timed; its collection's start

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            running[1] = time.perf_counter()
            return
        entry = collector[running[0]]
        entry[0] += info["generation"] == 2
        entry[1] += time.perf_counter() - running[1]

    gc.collect()  # every round starts from the same collector state
    gc.callbacks.append(record)
    if args.collector == "off":
        gc.disable()
    try:
        for block, first in enumerate(range(0, args.tokens, args.block)):
            for mode in MODES if block % 2 == 0 else MODES[::-1]:
                running[0] = mode
                for t in range(first, min(first + args.block, args.tokens)):
                    cpu0 = time.thread_time_ns()
                    outputs = decoders[mode].decode(inputs.frames[mode][t])
                    finished[mode] += processors[mode].process_outputs(
                        outputs.outputs, outputs.timestamp).request_outputs
                    step_ns[mode][t] = time.thread_time_ns() - cpu0
    finally:
        gc.enable()
        gc.callbacks.remove(record)
    for mode in MODES:
        completions = [o.outputs[0] for o in finished[mode]]
        assert len(completions) == args.requests and not processors[mode].request_states
        assert all(len(c.token_ids) == args.tokens for c in completions)
        masks = [getattr(c, "sampling_mask", None) for c in completions]
        assert all(m is None for m in masks) if mode == "stock" else all(
            m is not None and len(m) == args.tokens for m in masks), f"{mode}: wrong masks"

    def steps_ms(mode: str, row_steps: bool) -> float:
        return sum(ns for t, ns in enumerate(step_ns[mode])
                   if (t in inputs.row_steps) == row_steps) / 1e6

    return {mode: {"cpu_ms_per_step": sum(step_ns[mode]) / 1e6 / args.tokens,
                   "gc_ms_per_step": 1e3 * collector[mode][1] / args.tokens,
                   "full_collections": collector[mode][0],
                   "row_steps_ms": steps_ms(mode, True),
                   "other_steps_ms": steps_ms(mode, False)} for mode in MODES}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engine_throughput import setup_environment

    import torch

    # vLLM's modules need a platform: a GPU machine's own, else the CPU test platform
    setup_environment(small=not torch.cuda.is_available())
    import vllm.v1.engine.output_processor  # noqa: F401  (the patched modules)
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder

    from vllm_sampling_mask.engine.transport import EngineCoreOutputsWithMasks
    from vllm_sampling_mask.patches import PATCHES
    from vllm_sampling_mask.patching import apply_patches
    from vllm_sampling_mask.tiny_model import build_tiny_model

    apply_patches(PATCHES)  # as vLLM's plugin loading does in every engine process
    model = build_tiny_model(MODEL_DIR, tokenizer_vocab=args.tokenizer_vocab,
                             model_vocab=args.tokenizer_vocab)
    tokenizer = get_tokenizer(str(model))
    vocab = len(tokenizer)
    decoders = {"stock": MsgpackDecoder(EngineCoreOutputs),
                "on": MsgpackDecoder(EngineCoreOutputsWithMasks)}
    run_round(RoundInputs(args, args.rounds, vocab), args, tokenizer, decoders)  # warm-up
    rounds: list[dict[str, dict[str, Any]]] = []
    for index in range(args.rounds):
        rounds.append(run_round(RoundInputs(args, index, vocab), args, tokenizer, decoders))
        print(f"round {index}: " + "; ".join(
            f"{mode} {r['cpu_ms_per_step']:.3f} ms CPU per step ({r['gc_ms_per_step']:.3f} of it "
            f"collecting, {r['full_collections']} full)" for mode, r in rounds[-1].items()),
            flush=True)

    def paired(without_gc: bool) -> dict[str, Any]:
        """stock / on per round: CPU per step, with or without the collector's share."""
        def cost(r: dict[str, Any]) -> float:
            return r["cpu_ms_per_step"] - (r["gc_ms_per_step"] if without_gc else 0.0)
        ratios = [cost(r["stock"]) / cost(r["on"]) for r in rounds]
        return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                "rounds": ratios}

    report = {
        "config": vars(args) | {"out": str(args.out) if args.out else None, "vocab": vocab},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "rounds": rounds,
        "median_ms_per_step": {mode: {key: statistics.median(r[mode][key] for r in rounds)
                                      for key in ("cpu_ms_per_step", "gc_ms_per_step")}
                               for mode in MODES},
        "median_ms_per_round": {mode: {key: statistics.median(r[mode][key] for r in rounds)
                                       for key in ("row_steps_ms", "other_steps_ms")}
                                for mode in MODES},
        "stock_over_on": {"all": paired(False), "without_gc": paired(True)},
    }
    med, ratio = report["median_ms_per_step"], report["stock_over_on"]
    split = report["median_ms_per_round"]
    print(f"\n{args.requests} requests x {args.tokens} tokens, logprobs {args.logprobs}, rows of "
          f"{args.top_k} ids ({args.rows}); frontend CPU per step (median round): stock "
          f"{med['stock']['cpu_ms_per_step']:.3f} ms, on {med['on']['cpu_ms_per_step']:.3f} ms")
    print(f"per round (median), the {len(RoundInputs.row_steps_of(args))} steps carrying rows: "
          f"stock {split['stock']['row_steps_ms']:.1f} ms, on {split['on']['row_steps_ms']:.1f} ms;"
          f" the others: stock {split['stock']['other_steps_ms']:.1f} ms, "
          f"on {split['on']['other_steps_ms']:.1f} ms")
    lines = ((("all", "the collector off while timed"),) if args.collector == "off" else
             (("without_gc", "without the collector's"),
              ("all", "with the collector's, where it landed")))
    for key, label in lines:
        r = ratio[key]
        print(f"stock/on ({label}; a frontend-bound engine's on/stock throughput), median "
              f"round [min, max]: {r['median']:.4f} [{r['min']:.4f}, {r['max']:.4f}]")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"written to {args.out}")
    return report


if __name__ == "__main__":
    main()
