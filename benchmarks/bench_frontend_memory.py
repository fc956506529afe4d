"""API-server memory held for the masks of in-flight non-streaming requests (CPU).

``--requests`` requests of ``--tokens`` tokens each receive one ``--row-ids``-id wire row per
step through the output processor's per-request storage (``RequestMaskRows.append``, what
``OutputProcessor.process_outputs`` calls). ``--output-kind``: ``final_only`` (non-streaming
``/inference/v1/generate`` and ``LLM.generate``: the rows are taken once, at the end) or
``cumulative`` (every step's output gets its live mask, ``RequestMaskRows.live``, what
``_new_completion_output`` attaches; the consumer keeps only the latest output, as the API
server's non-streaming handlers do) or ``http_compact`` (``final_only`` for a request the HTTP
server answers in ``csr-delta-varint-base64``: its rows are encoded a block at a time as they
arrive; the row is then ``--row-ids`` ascending ids drawn from a 151,936-token vocabulary, since
the encoding's size depends on their gaps). ``tracemalloc`` measures what is held before the
end, against 4 bytes per kept id (issue 11: <= 1.25 x)::

    python benchmarks/bench_frontend_memory.py --out bench_out/frontend_memory.json  # ~1 min
    python benchmarks/bench_frontend_memory.py --small
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

TARGET_RATIO = 1.25


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--row-ids", type=int, default=50, help="Kept ids per row (top_k).")
    parser.add_argument("--output-kind", choices=("final_only", "cumulative", "http_compact"),
                        default="final_only")
    parser.add_argument("--small", action="store_true", help="16 requests x 1024 tokens.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.small:
        args.requests, args.tokens = 16, 1024
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    import numpy as np

    from vllm_sampling_mask.engine.output_processor import RequestMaskRows

    args = parse_args(argv)
    varint = args.output_kind == "http_compact"
    if varint:  # the encoding's size depends on the gaps between ids: a top-k row's
        ids = np.random.default_rng(0).choice(151936, args.row_ids, replace=False)
        row = np.sort(ids).astype("<i4").tobytes()
    else:  # one wire row (contents don't matter)
        row = np.arange(args.row_ids, dtype="<i4").tobytes()
    gc.collect()
    tracemalloc.start()
    began = time.perf_counter()
    cumulative = args.output_kind == "cumulative"
    holders = [RequestMaskRows(final_only=not cumulative, varint=varint)
               for _ in range(args.requests)]
    latest = [None] * args.requests
    for _ in range(args.tokens):
        for r, holder in enumerate(holders):
            holder.append(bytes(row))  # a fresh bytes per row, as msgspec decodes them
            if cumulative:
                latest[r] = holder.live()
    seconds = time.perf_counter() - began
    gc.collect()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    kept_ids = args.requests * args.tokens * args.row_ids
    if not cumulative:  # what the last output of each request gets
        latest = [holder.take_last(args.tokens) for holder in holders]
    assert all(len(mask) == args.tokens for mask in latest)
    report = {
        "output_kind": args.output_kind,
        "requests": args.requests, "tokens": args.tokens, "row_ids": args.row_ids,
        "kept_ids": kept_ids, "held_bytes": held, "peak_bytes": peak,
        "bytes_per_kept_id": held / kept_ids, "ratio_to_4_bytes": held / (4 * kept_ids),
        "target_ratio": TARGET_RATIO, "met": held / (4 * kept_ids) <= TARGET_RATIO,
        "seconds": seconds,
    }
    print(f"{args.output_kind}: {args.requests} requests x {args.tokens} tokens x "
          f"{args.row_ids} ids: held "
          f"{held / 2**20:,.1f} MiB = {report['bytes_per_kept_id']:.3f} bytes per kept id "
          f"({report['ratio_to_4_bytes']:.3f} x 4; target <= {TARGET_RATIO}: "
          f"{'met' if report['met'] else 'MISSED'}); peak {peak / 2**20:,.1f} MiB, {seconds:.1f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
