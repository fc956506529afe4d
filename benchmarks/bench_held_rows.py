"""Engine-core CPU per step for held rows over whole send periods, and the frontend's decode of a
send (CPU; no engine, no GPU).

A held request's rows (FINAL_ONLY without stop strings: ``LLM.generate``, non-streaming HTTP)
cost the engine core on every step (the scheduler's hand-out), on the step that sends them (every
``HELD_STEPS``, its outputs' encoding) and when the sent outputs are freed; what they cost there
depends on what the rows held before look like (where they lie in memory, how their buffers grew),
which ``bench_host_overhead.py``'s held and flush hops, timed on fresh tables, do not show. This
runs ``--requests`` held requests through ``--periods`` whole periods of ``HELD_STEPS`` steps,
each step's rows drawn at random (``--top-k`` ids of ``--vocab``, cycled from a few pre-drawn
steps), through the scheduler's hand-out (``core.scheduler._hand_out_rows``, the C loop where it
is built; ``--loop python``: its Python reference), vLLM's msgpack encoding of the step's outputs
and their release, timed together per step (thread CPU time, garbage collection between
periods), and decodes each send's frame with the frontend's decoder. Between two steps it writes
``--evict-mb`` of other memory (untimed), as the rest of an engine step's host work would, so
that each step finds the held rows' buffers out of the CPU's nearer caches (without it the
bench flatters a design that writes into many scattered buffers)::

    python benchmarks/bench_held_rows.py --out bench_out/held_rows.json   # 512 x 151936
    python benchmarks/bench_held_rows.py --small                          # smoke (seconds)

Reported: ``engine_core_ms_per_step``, the mean step over the timed periods, sends included
(what the engine core pays on average); the median and mean of the steps without a send; the
median send step; ``frontend_decode_send_ms``, the median decode of a send's frame.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench_host_overhead import cpu_name  # benchmarks/, the script's own directory
from size_defaults import add_step_size_options, fill_size_defaults

SMALL_SIZE = {"requests": 16, "vocab": 4096, "top_k": 50, "periods": 2}
FULL_SIZE = {"requests": 512, "vocab": 151936, "top_k": 50, "periods": 20}
DRAWN_STEPS = 8
"""Steps of rows drawn up front; the periods cycle through them (drawing 512 rows a step would
take longer than the steps timed)."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_size_options(parser, SMALL_SIZE, FULL_SIZE)
    parser.add_argument("--periods", type=int,
                        help=f"Timed periods of HELD_STEPS steps (default {FULL_SIZE['periods']}).")
    parser.add_argument("--warmup-periods", type=int, default=2)
    parser.add_argument("--evict-mb", type=int, default=16,
                        help="Memory written between two steps, untimed (0: none).")
    parser.add_argument("--loop", choices=["c", "python"], default="c",
                        help="The scheduler's hand-out: its C loop (where built) or Python's.")
    return fill_size_defaults(parser.parse_args(argv), SMALL_SIZE, FULL_SIZE)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import numpy as np
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_sampling_mask.core import scheduler as scheduler_module
    from vllm_sampling_mask.core.scheduler import HELD_STEPS
    from vllm_sampling_mask.engine.transport import (
        EngineCoreOutputsWithMasks,
        EngineCoreOutputWithMask,
    )
    from vllm_sampling_mask.worker.step_masks import StepSamplingMasks

    if args.loop == "python":
        scheduler_module._hand_out_rows_native = None
    loop = "python" if scheduler_module._hand_out_rows_native is None else "c"
    R, V, K = args.requests, args.vocab, args.top_k
    rng = np.random.default_rng(0)
    steps = [StepSamplingMasks.from_rows(
        [np.sort(rng.choice(V, K, replace=False)).astype("<i4").tobytes() for _ in range(R)])
        for _ in range(DRAWN_STEPS)]
    request_ids = [f"cmpl-{i:032x}-0" for i in range(R)]  # vLLM-like ids
    index = {rid: i for i, rid in enumerate(request_ids)}
    held = {rid: scheduler_module.new_held_rows() for rid in request_ids}  # as add_request does
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputsWithMasks)
    other_memory = np.zeros(args.evict_mb << 18, dtype=np.int32)

    step_ms: list[list[float]] = []  # per timed period, per step
    decode_ms: list[float] = []
    sent_rows = 0
    for period in range(args.warmup_periods + args.periods):
        timed = period >= args.warmup_periods
        gc.collect()
        gc.disable()
        times = []
        for t in range(HELD_STEPS):
            send = t == HELD_STEPS - 1
            other_memory += 1  # the rest of the engine step's host work
            outputs = {0: EngineCoreOutputs(outputs=[EngineCoreOutputWithMask(rid, [t])
                                                     for rid in request_ids])}
            start = time.thread_time_ns()
            scheduler_module._hand_out_rows(outputs, steps[t % DRAWN_STEPS], index, held, send)
            frame = encoder.encode(outputs[0])
            del outputs  # freed in the engine core too, once its output thread sent them
            times.append((time.thread_time_ns() - start) / 1e6)
            if send:
                start = time.thread_time_ns()
                decoded = decoder.decode(frame)
                if timed:
                    decode_ms.append((time.thread_time_ns() - start) / 1e6)
                sent_rows += sum(len(o.sampling_mask) for o in decoded.outputs)
                del decoded
        gc.enable()
        if timed:
            step_ms.append(times)
    assert sent_rows == R * HELD_STEPS * (args.warmup_periods + args.periods), "rows lost"

    held_steps = [ms for times in step_ms for ms in times[:-1]]
    report = {
        "config": {"requests": R, "vocab": V, "top_k": K, "held_steps": HELD_STEPS,
                   "periods": args.periods, "warmup_periods": args.warmup_periods,
                   "evict_mb": args.evict_mb},
        "machine": {"cpu": cpu_name(), "python": platform.python_version(),
                    "hand_out_loop": loop},
        "engine_core_ms_per_step": statistics.mean(sum(times) / HELD_STEPS
                                                   for times in step_ms),
        "held_step_ms_median": statistics.median(held_steps),
        "held_step_ms_mean": statistics.mean(held_steps),
        "send_step_ms_median": statistics.median(times[-1] for times in step_ms),
        "frontend_decode_send_ms": statistics.median(decode_ms),
        "period_ms_per_step": [sum(times) / HELD_STEPS for times in step_ms],
    }
    print(f"R={R} held requests, top_k={K}, {args.periods} periods of {HELD_STEPS} steps "
          f"(the scheduler's loop: {loop}; {report['machine']['cpu']})")
    for key in ("engine_core_ms_per_step", "held_step_ms_median", "held_step_ms_mean",
                "send_step_ms_median", "frontend_decode_send_ms"):
        print(f"| {key} | {report[key]:.4f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"\nwritten to {args.out}")
    return report


if __name__ == "__main__":
    main()
