"""Bytes on the wire for one completion's sampling mask: JSON lists vs the compact formats.

Synthetic masks, seeded: T rows (one per generated token), each K distinct vocabulary ids drawn
uniformly from [0, V) and sorted (a top-k row of a real model spreads over the vocabulary the
same way; uniform is the conservative case for the delta encoding, whose gaps only shrink when
kept ids cluster), the sampled token one id of its row. Sizes are of ``json.dumps`` with the
separators vLLM's ``JSONResponse`` uses, for the response-shaped dict of
``/inference/v1/generate`` (one choice) and for the ``sampling_mask`` value alone; gzip -6 of the
response for reference (vLLM does not compress responses). Times: encode = what the server does
per choice, from the mask as the output processor attaches it (int32 bytes, not decoded) to the
serialised value (``MaskOptions.render`` + ``json.dumps``); decode = parse + to
``list[list[int]]`` (JSON) or to CSR numpy arrays (compact, ``decode_compact_arrays``, what
``PackedMasks.from_compact`` uses).

usage: python benchmarks/bench_http_wire_size.py [--tokens 256] [--top-k 50] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from array import array

import numpy as np

from vllm_sampling_mask.compact_format import (
    COMPACT_ENCODING,
    DELTA_VARINT_ENCODING,
    decode_compact_arrays,
    encode_compact,
    encode_compact_arrays,
)
from vllm_sampling_mask.entrypoints.mask_fields import COMPACT_FORMAT, JSON_FORMAT, MaskOptions
from vllm_sampling_mask.outputs import SamplingMask


def dumps(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    rows = [sorted(rng.choice(args.vocab, args.top_k, replace=False).tolist()) for _ in range(args.tokens)]
    token_ids = [row[int(rng.integers(len(row)))] for row in rows]
    lengths = array("i", [len(row) for row in rows])
    blob = bytearray(np.array([i for row in rows for i in row], dtype="<i4").tobytes())

    def attached() -> SamplingMask:
        """The mask as a non-streaming request's output carries it (a live bytes buffer)."""
        return SamplingMask.from_wire(lengths, blob)

    encoders = {
        "json": lambda: dumps(MaskOptions(True, JSON_FORMAT).render(attached())),
        "compact csr-int32le-base64": lambda: dumps(encode_compact_arrays(
            *attached().csr(), encoding=COMPACT_ENCODING)),
        "compact csr-delta-varint-base64 (HTTP)": lambda: dumps(
            MaskOptions(True, COMPACT_FORMAT).render(attached())),
    }

    forms = {
        "json": rows,
        "compact csr-int32le-base64": encode_compact(rows, encoding=COMPACT_ENCODING),
        "compact csr-delta-varint-base64 (HTTP)": encode_compact(rows, encoding=DELTA_VARINT_ENCODING),
    }
    print(f"{args.tokens} tokens x top_k {args.top_k}, vocab {args.vocab}: "
          f"{args.tokens * args.top_k} kept ids")
    print(f"{'form':40s} {'mask B':>9s} {'B/id':>6s} {'response B':>11s} {'gzip B':>8s} "
          f"{'encode ms':>9s} {'decode ms':>9s}")
    for name, mask in forms.items():
        response = {"choices": [{"index": 0, "token_ids": token_ids, "sampling_mask": mask,
                                 "finish_reason": "length"}]}
        mask_bytes, response_bytes = len(dumps(mask)), dumps(response)
        encode = encoders[name]
        assert encode() == dumps(mask), name  # the server's bytes are the reference encoder's
        if name == "json":
            decode = lambda: json.loads(dumps(rows))  # noqa: E731
        else:
            decode = lambda m=mask: decode_compact_arrays(json.loads(dumps(m)))  # noqa: E731
        timings = []
        for fn in (encode, decode):
            start = time.perf_counter()
            for _ in range(20):
                fn()
            timings.append((time.perf_counter() - start) / 20 * 1e3)
        print(f"{name:40s} {mask_bytes:9d} {mask_bytes / (args.tokens * args.top_k):6.2f} "
              f"{len(response_bytes):11d} {len(gzip.compress(response_bytes)):8d} "
              f"{timings[0]:9.2f} {timings[1]:9.2f}")


if __name__ == "__main__":
    main()
