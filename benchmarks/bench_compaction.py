"""Time of ``compact_support`` (the per-step Triton compaction) against memory bandwidth.

For every batch B, vocabulary V and top_k, the logits are what the sampler hands over after
top-k: random fp32 with all but the top_k largest of each row set to -inf (top_k >= V keeps
all). The width is the sampler's: ``W = min(top_k, V, cap)`` with ``cap`` the engine's
``sampling_mask_max_width`` (``--max-width``), so ``top_k = cap + 1`` exercises the bitmap
fallback. One bf16 row per top_k at ``--bf16-at`` (B, V)::

    python benchmarks/bench_compaction.py --out bench_out/compaction.json   # H200, ~1.5 min
    python benchmarks/bench_compaction.py --small                           # CPU smoke

Per configuration:

- ``kernel_us``: device time of one call, median of ``--reps`` CUDA-event pairs around a single
  call. Before each call the L2 is flushed by reading a 256 MiB buffer behind a spin kernel, so
  the host launches are queued while the GPU is busy and the events measure device time only.
  ``kernel_us_dirty_l2``: the same after a 256 MiB memset instead (alternating reps): the L2
  then holds ~60 MB of dirty lines that the timed call writes back to HBM as its reads evict
  them, which is not the call's own traffic (earlier runs of this script used this flush).
- ``launch_us``: host time of the call (two Triton launches and two allocations).
- ``loop_us``: back-to-back calls, warm L2, total / reps: max(device, host) per call.
- ``GB/s`` = (logits read + ids, counts, bits written) / ``kernel_us``, and its fraction of the
  device-to-device copy bandwidth measured in the same run (``dst.copy_(src)`` of ``--copy-mib``,
  2 x size bytes).
- ``isfinite+nonzero``: the vectorised torch baseline (``isfinite``, row counts, ``nonzero``;
  ``nonzero`` syncs the host, which is part of its cost), same timing as ``kernel_us``.
- ``reference``: ``compact_support_reference`` (a host-synchronising loop over rows), wall time,
  median of ``--ref-reps``, only for B <= ``--ref-max-batch``.
- host side of the step: ``copy_ms`` (``copy_to_host_nonblocking`` + synchronize, wall) and
  ``unpack_ms`` (``HostStepMasks.unpack``), median of up to ``--unpack-reps`` within a time budget.

Every configuration is first checked against the reference on its first rows.
On CPU (``--device cpu``, the default with ``--small``) the kernels run in Triton's interpreter:
the times only show that the script works.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FULL = dict(batch_sizes=[1, 64, 256, 512], vocab_sizes=[32000, 151936, 262144],
            top_ks=[20, 50, 512], bf16_at=[256, 151936], reps=100, warmup=10, copy_mib=1024,
            unpack_reps=20, ref_reps=5)
SMALL = dict(batch_sizes=[1, 4], vocab_sizes=[1000, 4096], top_ks=[5, 20], bf16_at=[4, 4096],
             reps=5, warmup=1, copy_mib=64, unpack_reps=3, ref_reps=2, max_width=64)
# Issue 6 targets, judged at top_k = TARGET_TOP_K.
TARGET_TOP_K = 50
TARGET_BW_AT, TARGET_BW_FRACTION = (256, 151936), 0.80
TARGET_LATENCY_AT, TARGET_LATENCY_US = (1, 151936), 20.0
# Issue 11: rows wider than the width cap (top-p only) cost <= 5 ms of host time per step.
TARGET_WIDE_AT, TARGET_WIDE_MS = (256, 151936), 5.0
SMALL_SWEEP_AT = ((4, 1000), (1, 1000))  # --small: the sweep's (B, V) points on CPU
VERIFY_ROWS = 8
FLUSH_BYTES = 256 << 20
SPIN_CYCLES = 1_000_000  # ~0.5 ms at H200 clocks: the host queues a whole rep meanwhile
UNPACK_BUDGET_S = 3.0


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def launch_list(text: str) -> list[tuple[int, int, int]]:
    launches = []
    for item in text.split(","):
        block, count_warps, scatter_warps = (int(x) for x in item.split(":"))
        launches.append((block, count_warps, scatter_warps))
    return launches


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="Tiny sizes for a CPU smoke run.")
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        help="Default: cpu with --small, else cuda.")
    parser.add_argument("--batch-sizes", type=int_list, help=f"Default {FULL['batch_sizes']}.")
    parser.add_argument("--vocab-sizes", type=int_list, help=f"Default {FULL['vocab_sizes']}.")
    parser.add_argument("--top-ks", type=int_list,
                        help=f"Default {FULL['top_ks']} plus cap + 1 (the bitmap fallback).")
    parser.add_argument("--max-width", type=int,
                        help="The cap of W (default: the plugin's DEFAULT_MAX_WIDTH).")
    parser.add_argument("--bf16-at", type=int_list,
                        help="B,V of the bf16 rows (default 256,151936).")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--copy-mib", type=int, help="Size of the bandwidth copy (default 1024).")
    parser.add_argument("--unpack-reps", type=int)
    parser.add_argument("--ref-reps", type=int)
    parser.add_argument("--ref-max-batch", type=int, default=64)
    parser.add_argument("--launches", type=launch_list, default=[],
                        help="Also time these launch configurations (BLOCK:COUNT_WARPS:"
                             "SCATTER_WARPS, comma separated) at the target points, with each "
                             "kernel's device time from the profiler.")
    args = parser.parse_args(argv)
    args.add_cap_plus_one = args.top_ks is None
    defaults = {**FULL, **(SMALL if args.small else {})}
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.device is None:
        args.device = "cpu" if args.small else "cuda"
    return args


def setup_environment(device: str) -> None:
    """CPU: Triton's interpreter, no GPU (must run before torch / triton / vllm are imported)."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["TRITON_INTERPRET"] = "1"


class Timer:
    """Device time per call (CUDA events, L2 flushed) or wall time on CPU."""

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.flush = torch.zeros(FLUSH_BYTES // 4 if self.cuda else 1, dtype=torch.float32,
                                 device=device)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def per_call(self, fn: Callable[[], Any], reps: int, warmup: int) -> dict[str, float]:
        """Median device time of one call after a clean and after a dirty L2 flush, and median
        host time of issuing it."""
        torch = self.torch
        for _ in range(warmup):
            fn()
        self.sync()
        host_us, pairs = [], {"read": [], "memset": []}
        for rep in range(2 * reps if self.cuda else reps):
            flush = "read" if rep % 2 == 0 else "memset"
            if self.cuda:
                if hasattr(torch.cuda, "_sleep"):
                    torch.cuda._sleep(SPIN_CYCLES)
                if flush == "read":
                    self.flush.sum()
                else:
                    self.flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            began = time.perf_counter()
            fn()
            host_us.append((time.perf_counter() - began) * 1e6)
            if self.cuda:
                end.record()
                pairs[flush].append((start, end))
        self.sync()
        if not self.cuda:
            return {"kernel_us": statistics.median(host_us), "kernel_us_min": min(host_us),
                    "kernel_us_dirty_l2": None, "launch_us": statistics.median(host_us)}
        device_us = {k: [s.elapsed_time(e) * 1e3 for s, e in v] for k, v in pairs.items()}
        return {"kernel_us": statistics.median(device_us["read"]),
                "kernel_us_min": min(device_us["read"]),
                "kernel_us_dirty_l2": statistics.median(device_us["memset"]),
                "launch_us": statistics.median(host_us)}

    def loop(self, fn: Callable[[], Any], reps: int) -> float:
        """Microseconds per call of ``reps`` back-to-back calls (warm L2)."""
        self.sync()
        began = time.perf_counter()
        if self.cuda:
            start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
        for _ in range(reps):
            fn()
        if self.cuda:
            end.record()
            self.sync()
            return start.elapsed_time(end) * 1e3 / reps
        return (time.perf_counter() - began) * 1e6 / reps

    def wall(self, fn: Callable[[], Any], reps: int,
             budget_s: float | None = None) -> dict[str, float]:
        """Median wall ms of ``fn()`` + synchronize (at least 2 reps when over the budget)."""
        times: list[float] = []
        total = 0.0
        for _ in range(reps):
            self.sync()
            began = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - began) * 1e3)
            total += times[-1] / 1e3
            if budget_s is not None and total > budget_s and len(times) >= 2:
                break
        return {"ms": statistics.median(times), "reps": len(times)}


def copy_bandwidth(timer: Timer, device: Any, mib: int) -> dict[str, float]:
    torch = timer.torch
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    reps = 20 if timer.cuda else 3
    for _ in range(3):
        dst.copy_(src)
    timer.sync()
    times = []
    for _ in range(reps):
        if timer.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            dst.copy_(src)
            end.record()
            timer.sync()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - began)
    seconds = statistics.median(times)
    del src, dst
    return {"bytes_per_s": 2 * (mib << 20) / seconds, "size_mib": mib, "reps": reps,
            "note": "dst.copy_(src), bytes = 2 x size, median of CUDA-event times"}


def make_logits(batch: int, vocab: int, top_k: int, dtype: Any, device: Any, seed: int) -> Any:
    """``[B, V]`` processed logits: random, all but each row's ``top_k`` largest set to -inf.

    Exactly ``min(top_k, V)`` finite per row (the top-k indices, so value ties cannot add any).
    """
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch, vocab, device=device, generator=generator)
    if top_k < vocab:
        top = logits.topk(top_k, dim=1)
        logits.fill_(float("-inf")).scatter_(1, top.indices, top.values)
    return logits.to(dtype)


def verify(support: Any, logits: Any, width: int) -> None:
    """Raise if the first rows differ from ``compact_support_reference``."""
    import torch

    from vllm_sampling_mask.worker.compaction import compact_support_reference

    rows = min(VERIFY_ROWS, logits.shape[0])
    ref = compact_support_reference(logits[:rows], width)
    counts = support.counts[:rows]
    if not torch.equal(counts, ref.counts) or not torch.equal(support.bits[:rows], ref.bits):
        raise AssertionError(f"counts or bitmap differ from the reference ({tuple(logits.shape)})")
    for r in range(rows):
        n = min(int(counts[r]), width)
        if not torch.equal(support.ids[r, :n], ref.ids[r, :n]):
            raise AssertionError(f"ids of row {r} differ from the reference "
                                 f"({tuple(logits.shape)})")


def run_config(timer: Timer, args: argparse.Namespace, batch: int, vocab: int, top_k: int,
               dtype_name: str, copy_bps: float) -> dict[str, Any]:
    import numpy as np
    import torch

    from vllm_sampling_mask.worker.compaction import (
        BITS_PER_WORD,
        compact_support,
        compact_support_reference,
    )
    from vllm_sampling_mask.worker.step_masks import DeviceStepMasks

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    device = timer.flush.device
    logits = make_logits(batch, vocab, top_k, dtype, device, seed=batch * 7 + vocab + top_k)
    width = max(1, min(top_k, vocab, args.max_width))  # as SamplingMaskCapture.compact
    overflow = top_k > width  # every row wider than W: expanded from the bitmap
    kept = min(top_k, vocab)
    num_words = -(-vocab // BITS_PER_WORD)
    nbytes = batch * vocab * logits.element_size() + 4 * batch * (width + 1 + num_words)

    support = compact_support(logits, width)
    verify(support, logits, width)
    result: dict[str, Any] = {
        "dtype": dtype_name, "batch": batch, "vocab": vocab, "top_k": top_k, "width": width,
        "kept_per_row": kept, "overflow": overflow, "bytes": nbytes,
    }
    result.update(timer.per_call(lambda: compact_support(logits, width), args.reps, args.warmup))
    result["loop_us"] = timer.loop(lambda: compact_support(logits, width), args.reps)
    result["bytes_per_s"] = nbytes / (result["kernel_us"] * 1e-6)
    result["copy_bw_fraction"] = result["bytes_per_s"] / copy_bps
    if result["kernel_us_dirty_l2"] is not None:
        result["copy_bw_fraction_dirty_l2"] = (
            nbytes / (result["kernel_us_dirty_l2"] * 1e-6) / copy_bps)

    def isfinite_nonzero() -> Any:
        finite = torch.isfinite(logits)  # [B, V] bool
        counts = finite.sum(dim=1, dtype=torch.int32)  # [B]
        return counts, finite.nonzero()[:, 1].to(torch.int32)  # syncs: output size

    base = timer.per_call(isfinite_nonzero, args.reps, args.warmup)
    result["isfinite_nonzero_us"] = base["kernel_us"]
    result["speedup_vs_isfinite_nonzero"] = base["kernel_us"] / result["kernel_us"]
    if batch <= args.ref_max_batch:
        ref = timer.wall(lambda: compact_support_reference(logits, width), args.ref_reps)
        result["reference_ms"], result["reference_reps"] = ref["ms"], ref["reps"]
    else:
        result["reference_ms"] = None
        result["reference_skipped"] = f"B > --ref-max-batch {args.ref_max_batch} (a loop over rows)"

    device_masks = DeviceStepMasks(support)
    num_sampled = np.ones(batch, dtype=np.int32)
    last: dict[str, Any] = {}  # keeps only the latest host copy alive

    def copy_to_host() -> None:
        last["host"] = device_masks.copy_to_host_nonblocking()

    copy = timer.wall(copy_to_host, args.unpack_reps, UNPACK_BUDGET_S)
    host = last.pop("host")
    step = host.unpack(num_sampled)
    if sum(step.row_lengths()) != batch * kept:
        raise AssertionError(f"unpack returned {sum(step.row_lengths())} ids, "
                             f"expected {batch * kept}")
    for r in range(min(batch, VERIFY_ROWS)):
        if step.row(r).tolist() != torch.isfinite(logits[r]).nonzero().flatten().tolist():
            raise AssertionError(f"unpacked row {r} differs from the finite ids of its logits")
    began = time.perf_counter()
    unpack_times = []
    while len(unpack_times) < args.unpack_reps:
        t0 = time.perf_counter()
        host.unpack(num_sampled)
        unpack_times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() - began > UNPACK_BUDGET_S and len(unpack_times) >= 2:
            break
    result.update(copy_ms=copy["ms"], unpack_ms=statistics.median(unpack_times),
                  unpack_reps=len(unpack_times),
                  copied_bytes=copied_bytes(batch, width, kept, overflow))
    return result


def copied_bytes(batch: int, width: int, kept: int, overflow: bool) -> int:
    """Bytes the host receives per step: ``[B, 1 + W]`` int32, then the expanded ids of the rows
    wider than W; a compaction wider than ``WIDE_UNPACK_WIDTH`` copies only its counts and
    expands every row."""
    from vllm_sampling_mask.worker.step_masks import WIDE_UNPACK_WIDTH

    if width > WIDE_UNPACK_WIDTH:
        return 4 * batch * (1 + kept)
    return 4 * batch * (1 + width + (kept if overflow else 0))


def per_kernel_device_us(timer: Timer, fn: Callable[[], Any], reps: int) -> dict[str, float]:
    """Mean device microseconds per launch of each kernel ``fn`` runs (profiler; CUDA only)."""
    torch = timer.torch
    if not timer.cuda:
        return {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        timer.sync()
    return {e.key: e.device_time_total / e.count for e in prof.key_averages()
            if e.device_time_total > 0}


def launch_sweep(timer: Timer, args: argparse.Namespace, copy_bps: float) -> list[dict]:
    """Time each ``--launches`` configuration at the target points (top_k 50, fp32 and bf16 at
    the bandwidth point, fp32 at B=1; plus whole-vocabulary rows at a quarter of the batch), and
    split its device time by kernel with the profiler (warm L2, mean of ``--reps`` calls)."""
    import torch

    from vllm_sampling_mask.worker.compaction import CompactionLaunch, compact_support

    (batch, vocab), (small_batch, _) = (SMALL_SWEEP_AT if args.small
                                        else (TARGET_BW_AT, TARGET_LATENCY_AT))
    points = [("fp32", batch, vocab, TARGET_TOP_K), ("bf16", batch, vocab, TARGET_TOP_K),
              ("fp32", small_batch, vocab, TARGET_TOP_K), ("fp32", batch // 4, vocab, vocab)]
    out = []
    for dtype_name, batch, vocab, top_k in points:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        logits = make_logits(batch, vocab, top_k, dtype, timer.flush.device, seed=batch + top_k)
        width = max(1, min(top_k, vocab, args.max_width))
        nbytes = batch * vocab * logits.element_size()
        for block, count_warps, scatter_warps in args.launches:
            launch = CompactionLaunch(block, count_warps, scatter_warps)
            verify(compact_support(logits, width, launch), logits, width)
            timed = timer.per_call(lambda: compact_support(logits, width, launch), args.reps,
                                   args.warmup)
            per_kernel = per_kernel_device_us(timer, lambda: compact_support(
                logits, width, launch), args.reps)
            result = {"dtype": dtype_name, "batch": batch, "vocab": vocab, "top_k": top_k,
                      "block": block, "count_warps": count_warps, "scatter_warps": scatter_warps,
                      **timed, "per_kernel_us_warm_l2": per_kernel,
                      "logits_read_fraction_of_copy_bw":
                          nbytes / (timed["kernel_us"] * 1e-6) / copy_bps}
            print(json.dumps(result), flush=True)
            out.append(result)
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    setup_environment(args.device)
    import torch

    from vllm_sampling_mask.config import DEFAULT_MAX_WIDTH

    if args.max_width is None:
        args.max_width = DEFAULT_MAX_WIDTH
    if args.add_cap_plus_one:
        args.top_ks = [*args.top_ks, args.max_width + 1]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu (or --small) for a smoke run")
    timer = Timer(device)
    copy = copy_bandwidth(timer, device, args.copy_mib)
    print(f"copy bandwidth: {copy['bytes_per_s'] / 1e9:,.0f} GB/s", flush=True)

    sweep = launch_sweep(timer, args, copy["bytes_per_s"]) if args.launches else []
    configs = [("fp32", b, v, k) for b in args.batch_sizes for v in args.vocab_sizes
               for k in args.top_ks]
    configs += [("bf16", args.bf16_at[0], args.bf16_at[1], k) for k in args.top_ks]
    results = []
    for dtype_name, b, v, k in configs:
        results.append(run_config(timer, args, b, v, k, dtype_name, copy["bytes_per_s"]))
        print(row(results[-1]), flush=True)
        if timer.cuda:
            torch.cuda.empty_cache()

    report = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "device": torch.cuda.get_device_name(device) if timer.cuda else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "l2_flushed": timer.cuda,
        "copy_bandwidth": copy,
        "results": results,
        "launch_sweep": sweep,
        "targets": targets(results, args.small),
    }
    print("\n" + markdown(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"\nwritten to {args.out}")
    return report


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def targets(results: list[dict], small: bool) -> list[dict[str, Any]]:
    def find(at: tuple[int, int]) -> dict | None:
        for r in results:
            if (r["dtype"], r["batch"], r["vocab"], r["top_k"]) == ("fp32", *at, TARGET_TOP_K):
                return r
        return None

    out = []
    bw, lat = find(TARGET_BW_AT), find(TARGET_LATENCY_AT)
    wide = next((r for r in results if (r["dtype"], r["batch"], r["vocab"]) == ("fp32", *TARGET_WIDE_AT)
                 and r["overflow"] and r["kept_per_row"] > r["width"]), None)
    out.append({"target": f">= {TARGET_BW_FRACTION:.0%} of copy bandwidth at B={TARGET_BW_AT[0]}, "
                          f"V={TARGET_BW_AT[1]}, fp32, top_k={TARGET_TOP_K}",
                "value": None if bw is None else bw["copy_bw_fraction"],
                "met": (None if bw is None or small
                        else bw["copy_bw_fraction"] >= TARGET_BW_FRACTION)})
    out.append({"target": f"<= {TARGET_LATENCY_US / 1e3} ms at B={TARGET_LATENCY_AT[0]}, "
                          f"V={TARGET_LATENCY_AT[1]}, fp32, top_k={TARGET_TOP_K} (device time)",
                "value": None if lat is None else lat["kernel_us"] / 1e3,
                "met": None if lat is None or small else lat["kernel_us"] <= TARGET_LATENCY_US})
    out.append({"target": f"<= {TARGET_WIDE_MS} ms host per step (unpack) at B={TARGET_WIDE_AT[0]}, "
                          f"V={TARGET_WIDE_AT[1]}, every row wider than the width cap",
                "value": None if wide is None else wide["unpack_ms"],
                "met": None if wide is None or small else wide["unpack_ms"] <= TARGET_WIDE_MS})
    return out


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _ms(value: float | None) -> str:
    return "skipped" if value is None else f"{value:.2f}"


HEADER = ("| dtype | B | V | top_k | W | kernel us | dirty-L2 us | launch us | loop us | GB/s | "
          "% copy BW | "
          "isfinite+nonzero us | x faster | reference ms | copy ms | unpack ms |")


def row(r: dict) -> str:
    return (f"| {r['dtype']} | {r['batch']} | {r['vocab']} | {r['top_k']} | {r['width']} | "
            f"{r['kernel_us']:.1f} | {_us(r['kernel_us_dirty_l2'])} | {r['launch_us']:.1f} | "
            f"{r['loop_us']:.1f} | "
            f"{r['bytes_per_s'] / 1e9:,.0f} | {100 * r['copy_bw_fraction']:.0f}% | "
            f"{r['isfinite_nonzero_us']:.1f} | {r['speedup_vs_isfinite_nonzero']:.1f} | "
            f"{_ms(r['reference_ms'])} | {r['copy_ms']:.3f} | {r['unpack_ms']:.3f} |")


def markdown(report: dict) -> str:
    copy = report["copy_bandwidth"]
    lines = [f"device: {report['device']}; copy bandwidth {copy['bytes_per_s'] / 1e9:,.0f} GB/s "
             f"({copy['size_mib']} MiB dst.copy_(src)); L2 flushed: {report['l2_flushed']}", "",
             HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    lines += [row(r) for r in report["results"]]
    lines.append("")
    for t in report["targets"]:
        verdict = "n/a (smoke run)" if t["met"] is None else ("met" if t["met"] else "MISSED")
        value = "n/a" if t["value"] is None else f"{t['value']:.4g}"
        lines.append(f"target {t['target']}: {value} -> {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
