"""Per-step cost of the sampling paths a step can take, one batch at a time (GPU).

For each batch B (vocabulary V = 151936, fp32 processed logits, ``top_k`` ``--top-k`` (50),
``top_p`` 0.95, temperature 1), the paths are:

- ``stock_flashinfer``: vLLM's ``flashinfer_sample`` (what stock vLLM 0.26 runs for this batch);
- ``vllm_topk_topp+compaction``: the mask engine before the candidate sampler: vLLM's
  ``apply_top_k_top_p`` (Triton for B >= 8, the PyTorch sort below), its ``gumbel_sample`` and
  ``compact_support``;
- ``candidates``: ``sample_from_candidates``; ``top_candidates`` (its first launch: on CUDA
  FlashInfer's radix top-k) and ``torch.topk`` alone;
- with ``logprobs=1`` (``--logprobs``): ``stock_flashinfer+raw_logprobs`` (stock's step: the
  sample, then vLLM's ``compute_topk_scores`` over the unmodified logits, which stock copies
  for that, as every path here does), ``candidates+logprobs`` (the kernel's own processed
  logprobs: a mask engine's step) and ``candidates+processed+vllm_logprobs`` (the ``-inf``-filled
  processed logits and vLLM's ``compute_topk_scores`` over them: a step with
  ``logprob_token_ids``, and every logprobs step before the kernel computed them).

Every path starts from a copy of the logits (vLLM's filters work in place), timed alone as
``clone``. Per path: ``loop_us``, back-to-back calls timed by CUDA events (max of host and device
per call), and ``host_us``, the wall time of issuing the same calls (no sync in between). Before
timing, the candidate sampler's kept sets of the first rows are checked against the torch
reference and every sampled token against its row::

    python benchmarks/bench_sampler_paths.py --out bench_out/sampler_paths.json   # H200, ~1 min
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

VOCAB = 151936
TOP_P = 0.95
VERIFY_ROWS = 16


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    parser.add_argument("--batch-sizes", default="1,8,64,256,512")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--top-k", type=int, default=50,
                        help="Every row's top_k, <= MAX_CANDIDATES (1024): up to there a step "
                        "samples with the candidate sampler, masks wanted or not.")
    parser.add_argument("--logprobs", action="store_true",
                        help="Also time the paths of a step that returns logprobs=1.")
    return parser.parse_args(argv)


def time_path(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host_s = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return {"loop_us": start.elapsed_time(end) * 1e3 / reps, "host_us": host_s * 1e6 / reps}


def verify_candidates(logits: Any, result: Any, rows: int, top_k: int) -> None:
    from vllm_sampling_mask.worker.candidate_sampler import kept_candidates_reference

    expected = kept_candidates_reference(logits[:rows].cpu(), [top_k] * rows, [TOP_P] * rows)
    packed = result.packed[:rows].cpu()
    got = [packed[r, 1 : 1 + int(packed[r, 0])].tolist() for r in range(rows)]
    if got != expected:
        raise AssertionError(f"candidate rows differ from the reference: {got[:2]} vs "
                             f"{expected[:2]}")
    for token, row in zip(result.sampled[:rows].tolist(), got):
        if token not in row:
            raise AssertionError(f"sampled token {token} not in its row {row}")


def run_batch(batch: int, reps: int, top_k: int, logprobs: bool) -> dict[str, Any]:
    import torch

    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p, flashinfer_sample
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    from vllm_sampling_mask.worker.candidate_sampler import sample_from_candidates, top_candidates
    from vllm_sampling_mask.worker.compaction import compact_support
    from vllm_sampling_mask.worker.step_masks import tie_slack

    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(batch)
    logits = torch.randn(batch, VOCAB, device=device, generator=gen) * 3
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    k = torch.full((batch,), top_k, dtype=torch.int32, device=device)
    p = torch.full((batch,), TOP_P, dtype=torch.float32, device=device)
    temperature = torch.ones(batch, dtype=torch.float32, device=device)
    seeds = torch.arange(batch, dtype=torch.int64, device=device)
    pos = torch.full((batch,), 100, dtype=torch.int64, device=device)
    width = top_k + tie_slack(top_k)

    def candidates(write_processed: bool, num_logprobs: int | None = None) -> Callable[[], Any]:
        return lambda: sample_from_candidates(logits.clone(), top_k, slots, k, p, temperature,
                                              seeds, pos, write_processed, num_logprobs)

    def candidates_vllm_logprobs() -> Any:
        result = sample_from_candidates(logits.clone(), top_k, slots, k, p, temperature, seeds,
                                        pos, write_processed=True)
        return compute_topk_scores(result.processed, 1, result.sampled)

    def stock_raw_logprobs() -> Any:
        sampled = flashinfer_sample(logits.clone(), k, p).to(torch.int64)
        return compute_topk_scores(logits, 1, sampled)

    def vllm_path() -> Any:
        filtered = apply_top_k_top_p(logits.clone(), k, p)
        gumbel_sample(filtered, slots, temperature, seeds, pos, apply_temperature=False)
        return compact_support(filtered, width)

    verify_candidates(logits, candidates(True)(), min(batch, VERIFY_ROWS), top_k)
    with_torch_topk = lambda: torch.topk(logits.clone(), top_k, dim=1)  # noqa: E731
    paths: dict[str, Callable[[], Any]] = {
        "clone": logits.clone,
        "vllm_topk_topp+compaction": vllm_path,
        "candidates": candidates(False),
        "torch.topk": with_torch_topk,
        "top_candidates": lambda: top_candidates(logits.clone(), top_k),
    }
    if logprobs:
        paths["candidates+logprobs"] = candidates(False, 1)
        paths["candidates+processed+vllm_logprobs"] = candidates_vllm_logprobs
    try:
        import flashinfer  # noqa: F401

        paths["stock_flashinfer"] = lambda: flashinfer_sample(logits.clone(), k, p)
        if logprobs:
            paths["stock_flashinfer+raw_logprobs"] = stock_raw_logprobs
    except ImportError:
        pass
    return {"batch": batch, **{name: time_path(fn, reps) for name, fn in paths.items()}}


def main(argv: Sequence[str] | None = None) -> dict:
    import torch

    args = parse_args(argv)
    results = [run_batch(int(b), args.reps, args.top_k, args.logprobs)
               for b in args.batch_sizes.split(",")]
    report = {"vocab": VOCAB, "top_k": args.top_k, "top_p": TOP_P, "reps": args.reps,
              "logprobs": args.logprobs,
              "device": torch.cuda.get_device_name(), "results": results}
    names = [n for n in results[0] if n != "batch"]
    print("| B | " + " | ".join(f"{n} loop/host us" for n in names) + " |")
    for r in results:
        cells = [f"{r[n]['loop_us']:.1f} / {r[n]['host_us']:.1f}" for n in names]
        print(f"| {r['batch']} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
