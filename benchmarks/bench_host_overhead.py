"""Host CPU time per engine step of the mask pipeline, without an engine or a GPU.

One decode step of ``--requests`` requests (one sampled token each) over a ``--vocab`` vocabulary
with top_k ``--top-k``, through the same code the engine runs, each hop timed separately::

    python benchmarks/bench_host_overhead.py --out bench_out/host_overhead.json   # 512 x 151936
    python benchmarks/bench_host_overhead.py --small                              # smoke (seconds)

- ``launch_*``         worker, only where CUDA and FlashInfer are: the host side of a mask
                       step's sampling call (``candidates``) and of stock vLLM's
                       (``stock_flashinfer``) on ``[R, V]`` fp32 CUDA logits; their
                       difference ``launch_extra`` is in the engine-core total, and so is
                       ``launch_copy``: what gets the step's rows to the host as the engine
                       does it (a mapped host buffer for the kernel to write where the device
                       has UVA: ``MappedRows``; ``launch_copy_device``, not in the totals:
                       issuing the copy from device memory instead);
- ``unpack``           worker: ``HostStepMasks.unpack``, the copied ``[R, 1 + W]`` counts + ids
                       -> the step's row bytes and offsets; ``unpack_overflow``: the same with
                       one row wider than W (expanded from the bitmap by ``expand_rows``);
- ``scheduler``        engine core: the ``Scheduler.update_from_output`` wrapper, i.e.
                       the step's row bytes, one to every request's output, by the C loop
                       where it is built (``machine.hand_out_loop``); ``scheduler_python`` and
                       ``scheduler_held_python`` (not in the totals) its Python reference;
- ``encode``/``decode`` the ZMQ hop: vLLM's ``MsgpackEncoder`` / ``MsgpackDecoder`` of one
                       ``EngineCoreOutputs`` of R outputs with masks and, ``*_stock``, without
                       (vLLM's own types); ``*_extra`` is the difference;
- ``frontend``         the ``OutputProcessor.process_outputs`` wrapper: accumulation of each
                       request's undecoded rows on its state, by the C loop where it is built
                       (``machine.take_rows_loop``); ``frontend_python`` (not in the totals) its
                       Python reference;
- ``*_held``           the same hops for FINAL_ONLY requests without stop strings, whose rows the
                       engine core holds (``LLM.generate``, non-streaming HTTP): a step that
                       sends no rows, and (``*_held_flush``) the step every ``HELD_STEPS`` that
                       sends each request's rows so far (one step each, in the middle and at the
                       end of a period; ``bench_held_rows.py`` times whole periods);
                       ``held_finish`` is the frontend taking them at the request's end (the
                       rows checked, one ``SamplingMask`` built);
- ``attach``           the ``RequestState._new_completion_output`` wrapper for every request,
                       DELTA (every step when streaming; once per request otherwise): a
                       ``SamplingMask`` over the step's bytes, not decoded;
- ``read_token_ids`` / ``read_csr``: not in the totals: what a consumer pays afterwards to read
                       every attached mask as Python lists or as CSR numpy arrays.

The total adds both processes' work; the engine-core and frontend subtotals run in parallel.
``per_process_held_ms`` are the subtotals for held requests, the flush step's extra work and the
finish spread over the ``HELD_STEPS`` steps they cover (a request of ``HELD_STEPS`` tokens).
The wrappers are the plugin's own (``wrap_*``) around no-op originals, so vLLM's own work is
not counted. Every row holds ``top_k`` ids (all rows full: the upper bound of the common path;
top-p shortens rows). Times are medians over ``--reps`` of the thread's CPU time (wall time
beside it), with the garbage collector enabled; the hops whose differences are reported (the
launches, encodes, decodes, and the held scheduler pass with and without its flush) take turns
rep by rep, so a slow phase of the machine moves them alike instead of one of them.

``--pin-fastest`` first times a fixed Python loop on every allowed CPU and runs on the fastest
(``probe_machine_noise.fastest_cpus``): on the lent H200 machine vCPUs differ by up to ~1.7x,
and an unpinned run on a slow one doubled every hop, vLLM's own encode/decode included.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from size_defaults import (  # benchmarks/, the script's own directory
    add_step_size_options,
    fill_size_defaults,
)

FULL_SIZE = dict(requests=512, vocab=151936, top_k=50, reps=200)
SMALL_SIZE = dict(requests=16, vocab=4096, top_k=50, reps=20)
# Per step at 512 requests (issue 11), per process: the two run in parallel.
TARGET_MS = {"engine_core": 0.1, "frontend": 0.5}


class Stub(SimpleNamespace):
    """Stand-in for a vLLM object (scheduler, output processor, request state): the given
    attributes, ``None`` for any other the wrappers read."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_size_options(parser, SMALL_SIZE, FULL_SIZE)
    parser.add_argument("--reps", type=int,
                        help=f"Timed repetitions (default {FULL_SIZE['reps']}).")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--pin-fastest", action="store_true",
                        help="Run on the CPU that runs a fixed loop fastest now.")
    return fill_size_defaults(parser.parse_args(argv), SMALL_SIZE, FULL_SIZE)


Hop = tuple[Callable[[Any], Any], Callable[[], Any]]  # (run, setup)


def measure(hops: dict[str, Hop], warmup: int, reps: int) -> dict[str, dict[str, float]]:
    """Median thread CPU time and wall time of each hop's ``run(setup())`` in ms (``setup`` not
    timed), the hops taking turns rep by rep: a slow phase of the machine lands on all of them,
    so the differences between them (a mask hop less its stock counterpart) keep their size.

    CPU time (``time.thread_time_ns``) is the headline: it is what the step costs the host and
    it is not inflated when other processes preempt this one; wall time is kept beside it.
    """
    for _ in range(warmup):
        for run, setup in hops.values():
            run(setup())
    gc.collect()
    cpu: dict[str, list[float]] = {name: [] for name in hops}
    wall: dict[str, list[float]] = {name: [] for name in hops}
    for _ in range(reps):
        for name, (run, setup) in hops.items():
            state = setup()
            wall0, cpu0 = time.perf_counter_ns(), time.thread_time_ns()
            run(state)
            cpu1, wall1 = time.thread_time_ns(), time.perf_counter_ns()
            cpu[name].append((cpu1 - cpu0) / 1e6)
            wall[name].append((wall1 - wall0) / 1e6)
    results = {}
    for name, times in cpu.items():
        times.sort()
        results[name] = {"cpu_ms": statistics.median(times),
                         "cpu_p90_ms": times[int(0.9 * (len(times) - 1))],
                         "wall_ms": statistics.median(wall[name]), "reps": reps}
    return results


def make_step(num_requests: int, vocab_size: int, top_k: int, wide_row: int | None):
    """A ``HostStepMasks`` as the async copy leaves it: ``top_k`` sorted random ids per row.

    Built by ``compact_support_reference`` from processed logits (-inf but ``top_k`` random
    ids per row), so it follows the kernel's output layout, on the GPU where there is one (so
    that a wide row is expanded there, as in the engine). With ``wide_row`` set, row 0 keeps
    ``wide_row`` (> top_k) ids: the width is ``top_k``, so that row is expanded from the bitmap
    (a tie at the top-k boundary, or a request's top_k above the width cap).
    """
    import numpy as np
    import torch

    from vllm_sampling_mask.worker.compaction import compact_support_reference
    from vllm_sampling_mask.worker.step_masks import DeviceStepMasks

    rng = np.random.default_rng(0)
    logits = torch.full((num_requests, vocab_size), float("-inf"))  # [R, V]
    for r in range(num_requests):
        kept = wide_row if (r == 0 and wide_row is not None) else top_k
        logits[r, torch.from_numpy(rng.choice(vocab_size, kept, replace=False))] = 1.0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    support = compact_support_reference(logits.to(device), top_k)
    del logits
    host = DeviceStepMasks(support).copy_to_host_nonblocking()
    if device == "cuda":
        torch.cuda.synchronize()  # what unpack finds after the step's copy event
    return host


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    pinned = None
    if args.pin_fastest:
        from probe_machine_noise import fastest_cpus

        chosen, loop_s = fastest_cpus(1)
        os.sched_setaffinity(0, chosen)
        pinned = {"cpu": chosen[0], "loop_s_per_cpu": loop_s}
    import torch

    if not torch.cuda.is_available():
        # vLLM's scheduler module needs a platform: the CPU test platform, as the tests use.
        from bench_engine_throughput import setup_environment

        setup_environment(small=True)
    import msgspec
    import numpy as np
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    import vllm.v1.core.sched.scheduler  # noqa: F401  (scoped patches: their modules must be
    import vllm.v1.engine.output_processor  # noqa: F401  imported for them to be installed)

    from vllm.v1.engine import FinishReason

    from vllm_sampling_mask.core import scheduler as scheduler_module
    from vllm_sampling_mask.engine import output_processor as output_processor_module
    from vllm_sampling_mask.core.scheduler import HELD_STEPS, new_held_rows, wrap_update_from_output
    from vllm_sampling_mask.patches import PATCHES
    from vllm_sampling_mask.patching import apply_patches
    from vllm_sampling_mask.engine.output_processor import (
        RequestMaskRows,
        mask_rows_of,
        wrap_new_completion_output,
        wrap_process_outputs,
    )
    from vllm_sampling_mask.engine.transport import (
        EngineCoreOutputsWithMasks,
        EngineCoreOutputWithMask,
    )

    apply_patches(PATCHES)  # as vLLM's plugin loading does in every engine process
    R, V, K = args.requests, args.vocab, args.top_k
    host = make_step(R, V, K, wide_row=None)
    host_wide = make_step(R, V, K, wide_row=min(V, 4 * K))
    num_sampled = np.ones(R, dtype=np.int32)
    step = host.unpack(num_sampled)
    assert sum(step.row_lengths()) == R * K
    rng = np.random.default_rng(1)
    tokens = [int(step.row(i)[rng.integers(K)]) for i in range(R)]
    request_ids = [f"cmpl-{i:032x}-0" for i in range(R)]  # vLLM-like ids
    index = {rid: i for i, rid in enumerate(request_ids)}
    results: dict[str, dict[str, float]] = {}

    def no_setup() -> None:
        return None

    def timed(name: str, run: Callable[[Any], Any], setup: Callable[[], Any] = no_setup) -> None:
        results.update(measure({name: (run, setup)}, args.warmup, args.reps))

    def timed_together(hops: dict[str, Hop]) -> None:
        """Hops whose differences are reported: timed in turns (``measure``)."""
        results.update(measure(hops, args.warmup, args.reps))

    # (a) worker
    launch = cuda_launch_timers(R, V, K)
    if launch is not None:
        timed_together({"launch_candidates": launch["candidates"],
                        "launch_stock_flashinfer": launch["stock_flashinfer"]})
        timed("launch_copy", *launch["copy"])
        timed("launch_copy_device", *launch["copy_device"])
    timed("unpack", lambda _: host.unpack(num_sampled))
    timed("unpack_overflow", lambda _: host_wide.unpack(num_sampled))

    # (b) engine core: the plugin's update_from_output wrapper around a scheduler that returned
    # one EngineCoreOutput per request (fresh objects each rep, as the scheduler makes them).
    def scheduler_outputs() -> dict[int, Any]:
        return {0: EngineCoreOutputs(outputs=[EngineCoreOutputWithMask(rid, [tok])
                                              for rid, tok in zip(request_ids, tokens)])}

    update = wrap_update_from_output(lambda self, sched_out, runner_out: self.pending)
    runner_output = SimpleNamespace(sampling_masks=step, req_id_to_index=index, req_ids=request_ids)
    sched_output = SimpleNamespace(finished_req_ids=set())

    def scheduler_setup(held: bool = False, flush: bool = False) -> Any:
        # held: FINAL_ONLY requests, whose rows stay in the scheduler until their last output
        # (scheduler.HeldRows: each request's buffers, made room for HELD_STEPS rows at its
        # first), each request holding HELD_STEPS // 2 rows before the step; flush: the step that
        # sends them, HELD_STEPS - 1 rows before it (bench_held_rows.py times whole periods).
        earlier = HELD_STEPS - 1 if flush else HELD_STEPS // 2
        held_rows = {}
        for rid, row in zip(request_ids, map(step.row_bytes, range(R)) if held else ()):
            held_rows[rid] = new_held_rows()
            for _ in range(earlier):
                held_rows[rid].hold(row)
        return Stub(sampling_mask_enabled=True, pending=scheduler_outputs(),
                    sampling_mask_held=held_rows, sampling_mask_steps=HELD_STEPS - 1 if flush else 0)

    def scheduler_step(sched: Any) -> Any:
        return update(sched, sched_output, runner_output)

    def python_loop(module: Any, attr: str, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run`` with ``module.attr``, a C loop, set aside: its Python reference runs (and a
        held table made by ``run`` holds the Python loop's ``HeldRows``)."""
        def run_python(*args: Any) -> Any:
            native = getattr(module, attr)
            setattr(module, attr, None)
            try:
                return run(*args)
            finally:
                setattr(module, attr, native)
        return run_python

    scheduler_step_python = python_loop(scheduler_module, "_hand_out_rows_native", scheduler_step)
    hand_out_loop = "python" if scheduler_module._hand_out_rows_native is None else "c"
    timed_together({
        "scheduler": (scheduler_step, scheduler_setup),
        # with the C loop built, its Python reference alone beside it (not in the totals)
        **({"scheduler_python": (scheduler_step_python, scheduler_setup),
            "scheduler_held_python": (scheduler_step_python, python_loop(
                scheduler_module, "_hand_out_rows_native", lambda: scheduler_setup(held=True)))}
           if hand_out_loop == "c" else {}),
    })
    timed_together({  # the flush's share is their difference
        "scheduler_held": (scheduler_step, lambda: scheduler_setup(held=True)),
        "scheduler_held_flush": (scheduler_step, lambda: scheduler_setup(held=True, flush=True)),
    })
    held_step = update(scheduler_setup(held=True), sched_output, runner_output)[0]
    flush_step = update(scheduler_setup(held=True, flush=True), sched_output, runner_output)[0]
    assert all(o.sampling_mask is None for o in held_step.outputs)
    assert all(len(o.sampling_mask) == HELD_STEPS for o in flush_step.outputs)
    with_masks = update(scheduler_setup(), sched_output, runner_output)[0]
    without_masks = EngineCoreOutputs(outputs=[EngineCoreOutput(rid, [tok])
                                               for rid, tok in zip(request_ids, tokens)])

    # (d) the ZMQ hop's serialisation, with and without masks
    encoder = MsgpackEncoder()
    decoder_masks = MsgpackDecoder(EngineCoreOutputsWithMasks)
    decoder_stock = MsgpackDecoder(EngineCoreOutputs)
    frames_masks = encoder.encode(with_masks)
    frames_stock = encoder.encode(without_masks)
    frames_held, frames_flush = encoder.encode(held_step), encoder.encode(flush_step)
    timed_together({
        "encode_with_masks": (lambda _: encoder.encode(with_masks), no_setup),
        "encode_stock": (lambda _: encoder.encode(without_masks), no_setup),
        "encode_held": (lambda _: encoder.encode(held_step), no_setup),
        "encode_held_flush": (lambda _: encoder.encode(flush_step), no_setup),
    })
    timed_together({
        "decode_with_masks": (lambda _: decoder_masks.decode(frames_masks), no_setup),
        "decode_stock": (lambda _: decoder_stock.decode(frames_stock), no_setup),
        "decode_held": (lambda _: decoder_masks.decode(frames_held), no_setup),
        "decode_held_flush": (lambda _: decoder_masks.decode(frames_flush), no_setup),
    })
    decoded = decoder_masks.decode(frames_masks)
    assert decoded.outputs[0].sampling_mask == with_masks.outputs[0].sampling_mask
    wire_bytes = {"with_masks": sum(len(f) for f in frames_masks),
                  "stock": sum(len(f) for f in frames_stock)}

    # (c) frontend: the plugin's process_outputs wrapper (per-request accumulation)
    process = wrap_process_outputs(lambda self, outputs, *a, **k: SimpleNamespace(reqs_to_abort=[]))

    def frontend_setup() -> Any:
        # As add_request leaves them (once per request, not per step): row list made.
        states = {rid: Stub(request_id=rid) for rid in request_ids}
        for state in states.values():
            mask_rows_of(state)
        return Stub(sampling_mask_requests=set(request_ids), request_states=states,
                    sampling_mask_lockstep=set(request_ids), sampling_mask_calls=0)

    def frontend_step(proc: Any) -> Any:
        return process(proc, decoded.outputs)

    frontend_python = python_loop(output_processor_module, "_take_rows_native", frontend_step)
    take_rows_loop = "python" if output_processor_module._take_rows_native is None else "c"
    timed_together({
        "frontend": (frontend_step, frontend_setup),
        # with the C loop built, its Python reference beside it (not in the totals)
        **({"frontend_python": (frontend_python, frontend_setup)} if take_rows_loop == "c"
           else {}),
    })
    # Held (FINAL_ONLY) requests mid-generation: their outputs carry no rows.
    held_outputs = decoder_stock.decode(frames_stock).outputs

    def frontend_held_setup() -> Any:
        return Stub(sampling_mask_requests=set(request_ids), request_states={},
                    sampling_mask_lockstep=set(), sampling_mask_calls=0)

    timed("frontend_held", lambda proc: process(proc, held_outputs), frontend_held_setup)
    attach = wrap_new_completion_output(lambda self, *a: self.completion)

    def new_completion(state: Any) -> Any:  # as RequestState.make_request_output calls it
        return attach(state, state.completion.token_ids, None, None)

    # The flush step as the requests' last: every output finishes with its HELD_STEPS rows.
    for output in flush_step.outputs:
        output.finish_reason = FinishReason.LENGTH
    frames_finish = encoder.encode(flush_step)
    before_last = SimpleNamespace(num_output_tokens=lambda: HELD_STEPS - 1)

    def held_finish_setup() -> tuple[Any, list[Any]]:
        states = {rid: Stub(request_id=rid, output_kind=RequestOutputKind.FINAL_ONLY,
                            detokenizer=before_last,
                            completion=SimpleNamespace(token_ids=[tok] * HELD_STEPS))
                  for rid, tok in zip(request_ids, tokens)}
        for state in states.values():
            mask_rows_of(state, held=True)
        proc = Stub(sampling_mask_requests=set(request_ids), request_states=states,
                    sampling_mask_lockstep=set(), sampling_mask_calls=0)
        return proc, decoder_masks.decode(frames_finish).outputs  # decoded: not timed here

    def held_finish(setup: tuple[Any, list[Any]]) -> list[Any]:
        proc, outputs = setup
        process(proc, outputs)
        return [new_completion(state) for state in proc.request_states.values()]

    timed("held_finish", held_finish, held_finish_setup)
    finished = held_finish(held_finish_setup())
    assert [len(c.sampling_mask) for c in finished] == [HELD_STEPS] * R
    assert finished[0].sampling_mask.token_ids[-1] == step.row(0).tolist(), "held rows differ"
    processor = frontend_setup()
    process(processor, decoded.outputs)
    first_rows = processor.request_states[request_ids[0]].sampling_mask_rows.live().token_ids
    assert first_rows == [step.row(0).tolist()], "frontend rows differ from the worker's"

    # (e) attach: _new_completion_output for every request, DELTA (streaming: every step). The
    # no-op original returns a completion made in setup (vLLM's own cost is not ours). Earlier
    # rows were handed out (and dropped) by earlier outputs: the new token's chunk is held.
    def attach_setup() -> list[Any]:
        states = []
        for i, (rid, tok) in enumerate(zip(request_ids, tokens)):
            held = RequestMaskRows(streaming=True)
            held.append(step.row_bytes(i))
            states.append(Stub(request_id=rid, completion=SimpleNamespace(token_ids=[tok]),
                               output_kind=RequestOutputKind.DELTA, sampling_mask_rows=held))
        return states

    timed("attach", lambda states: [new_completion(s) for s in states], attach_setup)
    attached = [new_completion(s).sampling_mask for s in attach_setup()]
    assert attached[0].token_ids == [step.row(0).tolist()], "attached rows differ"

    # (f) not the plugin's per-step work: what a consumer then pays to read the masks, as
    # Python lists (``.token_ids``) or as CSR arrays (``.csr()``, what PackedMasks uses).
    def attached_masks() -> list[Any]:
        return [new_completion(s).sampling_mask for s in attach_setup()]

    timed("read_token_ids", lambda masks: [m.token_ids for m in masks], attached_masks)
    timed("read_csr", lambda masks: [m.csr() for m in masks], attached_masks)

    ms = {name: r["cpu_ms"] for name, r in results.items()}  # read_* are the consumer's
    per_step = {
        **({"launch_extra": ms["launch_candidates"] - ms["launch_stock_flashinfer"],
            "launch_copy": ms["launch_copy"]} if "launch_candidates" in ms else {}),
        "unpack": ms["unpack"],
        "scheduler": ms["scheduler"],
        "encode_extra": ms["encode_with_masks"] - ms["encode_stock"],
        "decode_extra": ms["decode_with_masks"] - ms["decode_stock"],
        "frontend": ms["frontend"],
        "attach": ms["attach"],
    }
    total = sum(per_step.values())
    # With one GPU the worker runs inside the engine-core process; the frontend is another
    # process, so the two subtotals overlap in time (async scheduling overlaps both with the GPU).
    per_process = {
        "engine_core": per_step.get("launch_extra", 0.0) + per_step.get("launch_copy", 0.0)
        + per_step["unpack"] + per_step["scheduler"]
        + per_step["encode_extra"],
        "frontend": per_step["decode_extra"] + per_step["frontend"] + per_step["attach"],
    }
    # Held (FINAL_ONLY) requests: a step that sends no rows, plus the flush step's extra and the
    # finish spread over the HELD_STEPS steps they cover.
    launches = per_step.get("launch_extra", 0.0) + per_step.get("launch_copy", 0.0)
    per_process_held = {
        "engine_core": launches + ms["unpack"] + ms["scheduler_held"]
        + ms["encode_held"] - ms["encode_stock"]
        + (ms["scheduler_held_flush"] - ms["scheduler_held"]
           + ms["encode_held_flush"] - ms["encode_held"]) / HELD_STEPS,
        "frontend": ms["decode_held"] - ms["decode_stock"] + ms["frontend_held"]
        + (ms["decode_held_flush"] - ms["decode_held"] + ms["held_finish"]) / HELD_STEPS,
    }
    report = {
        "config": {"requests": R, "vocab": V, "top_k": K, "reps": args.reps,
                   "warmup": args.warmup, "rows": "all full (top_k ids each)",
                   "unpack_overflow_wide_row": min(V, 4 * K)},
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "numpy": np.__version__, "msgspec": msgspec.__version__,
                    "pinned": pinned, "hand_out_loop": hand_out_loop,
                    "take_rows_loop": take_rows_loop},
        "results": results,
        "wire_bytes": wire_bytes,
        "per_step_ms": per_step,
        "per_process_ms": per_process,
        "per_process_held_ms": per_process_held,
        "total_ms": total,
        "target_ms": TARGET_MS,
        "target_met": ({name: per_process[name] <= limit for name, limit in TARGET_MS.items()}
                       if R >= FULL_SIZE["requests"] else None),
        "target_met_held": ({name: per_process_held[name] <= limit
                             for name, limit in TARGET_MS.items()}
                            if R >= FULL_SIZE["requests"] else None),
    }
    print(table(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"\nwritten to {args.out}")
    return report


def cuda_launch_timers(num_requests: int, vocab_size: int, top_k: int
                       ) -> dict[str, Hop] | None:
    """``{name: (run, setup)}`` timing the host side of a mask step's sampling call
    (``candidates``: ``sample_from_candidates``, the FlashInfer top-k and the Triton launch)
    and of stock vLLM's (``stock_flashinfer``: ``flashinfer_sample``) on the same ``[R, V]``
    fp32 CUDA logits, top_k ``top_k``, top_p 0.95, and what gets the mask step's rows to the
    host: ``copy``, as in the engine (a ``MappedRows`` buffer taken for the kernel, held by the
    step's masks and released as unpack releases it; the issue of the copy where UVA is
    missing), and ``copy_device``, the issue of the copy from device memory
    (``DeviceStepMasks.copy_to_host_nonblocking``, on the current stream as in the engine);
    ``None`` without CUDA or FlashInfer. ``setup`` waits for the GPU, so each timed call starts
    with an idle queue."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import flashinfer_sample
    except ImportError:
        return None
    from vllm_sampling_mask.worker.candidate_sampler import sample_from_candidates
    from vllm_sampling_mask.worker.compaction import CompactSupport
    from vllm_sampling_mask.worker.sampler import mapped_rows_on
    from vllm_sampling_mask.worker.step_masks import DeviceStepMasks

    R = num_requests
    logits = torch.randn(R, vocab_size, device="cuda")  # [R, V] fp32
    k = torch.full((R,), top_k, dtype=torch.int32, device="cuda")
    p = torch.full((R,), 0.95, dtype=torch.float32, device="cuda")
    slots = torch.arange(R, dtype=torch.int32, device="cuda")
    temperature = torch.ones(R, dtype=torch.float32, device="cuda")
    seeds = torch.arange(R, dtype=torch.int64, device="cuda")
    pos = torch.full((R,), 100, dtype=torch.int64, device="cuda")

    def setup() -> torch.Tensor:
        copy = logits.clone()  # both paths filter in place
        torch.cuda.synchronize()
        return copy

    step = sample_from_candidates(logits.clone(), top_k, slots, k, p, temperature, seeds, pos,
                                  write_processed=False)
    device_masks = DeviceStepMasks(CompactSupport(step.packed, None, vocab_size))

    mapped_rows = mapped_rows_on(logits.device)

    def idle() -> None:
        torch.cuda.synchronize()

    def engine_copy(_: Any) -> Any:
        slot = mapped_rows.take(R, 1 + top_k)
        support = CompactSupport(slot.device_rows(R, 1 + top_k), None, vocab_size)
        host = DeviceStepMasks(support, mapped=slot).copy_to_host_nonblocking()
        slot.release()
        return host

    copy_device = (lambda _: device_masks.copy_to_host_nonblocking(), idle)
    return {
        "candidates": (lambda x: sample_from_candidates(x, top_k, slots, k, p, temperature,
                                                        seeds, pos, write_processed=False), setup),
        "stock_flashinfer": (lambda x: flashinfer_sample(x, k, p), setup),
        "copy": copy_device if mapped_rows is None else (engine_copy, idle),
        "copy_device": copy_device,
    }


def cpu_name() -> str:
    """The CPU's model name, for the reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(report: dict) -> str:
    c, r = report["config"], report["results"]
    lines = [f"R={c['requests']} requests, V={c['vocab']}, top_k={c['top_k']} "
             f"({report['machine']['cpu']}, {report['machine']['cpus']} CPUs; the scheduler's "
             f"loop: {report['machine']['hand_out_loop']}, the frontend's: "
             f"{report['machine']['take_rows_loop']})", "",
             "| hop | CPU ms | CPU p90 ms | wall ms | CPU us / request |",
             "|---|---:|---:|---:|---:|"]
    for name, t in r.items():
        lines.append(f"| {name} | {t['cpu_ms']:.3f} | {t['cpu_p90_ms']:.3f} | {t['wall_ms']:.3f} | "
                     f"{1e3 * t['cpu_ms'] / c['requests']:.2f} |")
    w = report["wire_bytes"]
    lines += ["", f"wire bytes per step: {w['with_masks']:,} with masks, {w['stock']:,} stock", "",
              "| per step (median thread CPU time) | ms |", "|---|---:|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in report["per_step_ms"].items()]
    for key, label in (("", "streamed / every step"), ("_held", "held (FINAL_ONLY)")):
        met = report["target_met" + key]
        for name, value in report[f"per_process{key}_ms"].items():
            verdict = "n/a at fewer than 512 requests" if met is None else (
                "met" if met[name] else "MISSED")
            lines.append(f"| subtotal {name} process, {label} | {value:.3f} (target <= "
                         f"{report['target_ms'][name]} ms: {verdict}) |")
    lines.append(f"| total | {report['total_ms']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
