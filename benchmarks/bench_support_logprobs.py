"""Peak memory and time of kept-set log-probs, forward + backward, measured in one run.

Compares the dense recipe (``[T, V]`` bool mask, masked_fill, log_softmax, gather; upcast to
fp32 as trainers usually do, and in bf16) with ``support_logprobs`` on the same bf16 logits,
and the dense recipe on ``hidden @ W.T`` with ``support_logprobs_from_hidden``::

    python benchmarks/bench_support_logprobs.py --out bench_out/support_logprobs.json  # H200
    python benchmarks/bench_support_logprobs.py --small                                # CPU smoke

Memory is the peak of ``torch.cuda.max_memory_allocated`` above what is allocated before the
call (the inputs: logits, or hidden + weight), so it counts every temporary, the saved
activations and the gradients the backward returns (``torch.autograd.grad``). ``workspace`` is
that peak minus the returned gradients, which every method must produce. Time is CUDA events
around forward + backward, averaged over ``--reps`` after ``--warmup``. Masks are the top-k ids
of random scores: uniformly spread, the worst case for the per-chunk unions of the hidden-state
variant (real top-k sets overlap across positions). On CPU only times are reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from vllm_sampling_mask.training import (
    PackedMasks,
    support_logprobs,
    support_logprobs_from_hidden,
    support_logprobs_reference,
)
from vllm_sampling_mask.training.logprobs_from_hidden import DEFAULT_TOKEN_CHUNK

from size_defaults import fill_size_defaults  # benchmarks/, the script's own directory

FULL_SIZE = dict(tokens=8192, vocab=151936, top_k=50, hidden=1024)
SMALL_SIZE = dict(tokens=256, vocab=4096, top_k=50, hidden=64)

# (case, the dense baseline whose memory and time it is divided by)
COMPARISONS = (
    ("support_logprobs", "dense_fp32"),
    ("support_logprobs", "dense_bf16"),
    ("support_logprobs_from_hidden", "dense_from_hidden_fp32"),
    ("support_logprobs_from_hidden", "dense_fp32"),
    ("support_logprobs+full", "dense_fp32+full"),
    ("support_logprobs_from_hidden+full", "dense_from_hidden_fp32+full"),
)
# (case, the dense baseline whose log-probs and gradients it must reproduce)
AGREEMENT = (
    ("support_logprobs", "dense_fp32"),
    ("support_logprobs_from_hidden", "dense_from_hidden_fp32"),
    ("support_logprobs+full", "dense_fp32+full"),
    ("support_logprobs_from_hidden+full", "dense_from_hidden_fp32+full"),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true",
                        help=f"Small sizes {SMALL_SIZE} for a CPU smoke check.")
    parser.add_argument("--out", type=Path, help="Write the results as JSON here.")
    parser.add_argument("--tokens", type=int, help=f"T (default {FULL_SIZE['tokens']}).")
    parser.add_argument("--vocab", type=int, help=f"V (default {FULL_SIZE['vocab']}).")
    parser.add_argument("--top-k", type=int, help=f"Ids per mask row (default {FULL_SIZE['top_k']}).")
    parser.add_argument("--hidden", type=int, help=f"H (default {FULL_SIZE['hidden']}).")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_TOKEN_CHUNK,
                        help="Token chunk of support_logprobs_from_hidden.")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return fill_size_defaults(parser.parse_args(argv), SMALL_SIZE, FULL_SIZE)


def make_masks(num_tokens: int, vocab_size: int, top_k: int, device: torch.device,
               generator: torch.Generator) -> tuple[PackedMasks, torch.Tensor]:
    """``top_k`` distinct ascending random ids per row, and one sampled id from each row."""
    rows = []
    for start in range(0, num_tokens, 1024):  # bounded [1024, V] scratch
        scores = torch.rand(min(1024, num_tokens - start), vocab_size, device=device,
                            generator=generator)
        rows.append(scores.topk(top_k, dim=1).indices.sort(dim=1).values)
    ids = torch.cat(rows)  # [T, k]
    pick = torch.randint(top_k, (num_tokens, 1), device=device, generator=generator)
    token_ids = ids.gather(1, pick).squeeze(1)
    lengths = torch.full((num_tokens,), top_k, dtype=torch.int64, device=device)
    return PackedMasks.from_csr(lengths, ids.reshape(-1)), token_ids


def measure(run: Callable[[], torch.Tensor], inputs: list[torch.Tensor], device: torch.device,
            warmup: int, reps: int) -> dict[str, float | None]:
    """Peak memory of one forward + backward above the live inputs, then its mean time."""
    def step() -> list[torch.Tensor]:
        output = run()
        return list(torch.autograd.grad(output.sum(), inputs))

    cuda = device.type == "cuda"
    result: dict[str, float | None] = {"peak_bytes": None, "grad_bytes": None,
                                       "workspace_bytes": None}
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        result.update(peak_bytes=peak, grad_bytes=grad_bytes, workspace_bytes=peak - grad_bytes)
        del grads
    for _ in range(warmup):
        step()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            step()
        end.record()
        torch.cuda.synchronize()
        result["ms"] = start.elapsed_time(end) / reps
    else:
        began = time.perf_counter()
        for _ in range(reps):
            step()
        result["ms"] = (time.perf_counter() - began) * 1e3 / reps
    return result


def compare(case: tuple[Callable[[], torch.Tensor], list[torch.Tensor]],
            baseline: tuple[Callable[[], torch.Tensor], list[torch.Tensor]]) -> dict[str, float]:
    """Max abs differences of the log-probs and of the input gradients (of their sum)."""
    (run, inputs), (base_run, base_inputs) = case, baseline
    output, base_output = run(), base_run()
    grads = torch.autograd.grad(output.sum(), inputs)
    base_grads = torch.autograd.grad(base_output.sum(), base_inputs)
    return {
        "logprob": (output - base_output).abs().max().item(),
        "grad": max((g.float() - b.float()).abs().max().item() for g, b in zip(grads, base_grads)),
        "grad_scale": max(b.float().abs().max().item() for b in base_grads),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    T, V, H = args.tokens, args.vocab, args.hidden
    masks, token_ids = make_masks(T, V, args.top_k, device, generator)

    hidden = (torch.randn(T, H, device=device, generator=generator)).bfloat16().requires_grad_()
    weight = (torch.randn(V, H, device=device, generator=generator) / H ** 0.5).bfloat16()
    weight.requires_grad_()
    logits = (hidden.detach() @ weight.detach().T).requires_grad_()  # [T, V] bf16

    def stacked(outputs: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``[T]``, or ``[2, T]`` (kept, full) for the ``return_full`` variants."""
        return torch.stack(outputs) if isinstance(outputs, tuple) else outputs

    def dense(logits_fn: Callable[[], torch.Tensor], full: bool) -> Callable[[], torch.Tensor]:
        return lambda: stacked(support_logprobs_reference(logits_fn(), token_ids, masks,
                                                          return_full=full))

    def from_logits(full: bool) -> Callable[[], torch.Tensor]:
        return lambda: stacked(support_logprobs(logits, token_ids, masks, return_full=full))

    def from_hidden(full: bool) -> Callable[[], torch.Tensor]:
        return lambda: stacked(support_logprobs_from_hidden(
            hidden, weight, token_ids, masks, return_full=full, chunk_size=args.chunk_size))

    cases: dict[str, tuple[Callable[[], torch.Tensor], list[torch.Tensor]]] = {
        "dense_fp32": (dense(logits.float, False), [logits]),
        "dense_bf16": (dense(lambda: logits, False), [logits]),
        "support_logprobs": (from_logits(False), [logits]),
        "dense_from_hidden_fp32": (dense(lambda: (hidden @ weight.T).float(), False),
                                   [hidden, weight]),
        "support_logprobs_from_hidden": (from_hidden(False), [hidden, weight]),
        "dense_fp32+full": (dense(logits.float, True), [logits]),
        "support_logprobs+full": (from_logits(True), [logits]),
        "dense_from_hidden_fp32+full": (dense(lambda: (hidden @ weight.T).float(), True),
                                        [hidden, weight]),
        "support_logprobs_from_hidden+full": (from_hidden(True), [hidden, weight]),
    }
    agreement = {f"{case} vs {baseline}": compare(cases[case], cases[baseline])
                 for case, baseline in AGREEMENT}

    results = {}
    for name, (run, inputs) in cases.items():
        results[name] = measure(run, inputs, device, args.warmup, args.reps)
        print(f"{name:30s} " + ", ".join(
            f"{k}={v / 2**20:.1f} MiB" if k.endswith("bytes") and v is not None else f"{k}={v}"
            for k, v in results[name].items()), flush=True)

    ratios = {}
    for case, baseline in COMPARISONS:
        mine, base = results[case], results[baseline]
        ratios[f"{case}/{baseline}"] = {
            "peak_memory": (mine["peak_bytes"] / base["peak_bytes"]
                            if base["peak_bytes"] else None),
            "workspace_memory": (mine["workspace_bytes"] / base["workspace_bytes"]
                                 if base["workspace_bytes"] else None),
            "time": mine["ms"] / base["ms"],
        }
    report = {
        "config": {"tokens": T, "vocab": V, "top_k": args.top_k, "hidden": H,
                   "chunk_size": args.chunk_size, "dtype": "bfloat16", "warmup": args.warmup,
                   "reps": args.reps},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "agreement": agreement,
        "results": results,
        "ratios": ratios,
    }
    print(markdown(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"\nwritten to {args.out}")
    return report


def markdown(report: dict) -> str:
    def mib(value: float | None) -> str:
        return "n/a" if value is None else f"{value / 2**20:,.0f}"

    def ratio(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    c = report["config"]
    lines = [
        f"T={c['tokens']}, V={c['vocab']}, k={c['top_k']}, H={c['hidden']}, bf16, "
        f"chunk={c['chunk_size']}, device={report['device']}",
        "",
        "| case | peak MiB | workspace MiB | fwd+bwd ms |",
        "|---|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        lines.append(f"| {name} | {mib(r['peak_bytes'])} | {mib(r['workspace_bytes'])} | "
                     f"{r['ms']:.2f} |")
    lines += ["", "| ratio | peak memory | workspace | time |", "|---|---:|---:|---:|"]
    for name, r in report["ratios"].items():
        lines.append(f"| {name} | {ratio(r['peak_memory'])} | {ratio(r['workspace_memory'])} | "
                     f"{ratio(r['time'])} |")
    lines += ["", "| agreement | max abs log-prob diff | max abs grad diff | max abs grad |",
              "|---|---:|---:|---:|"]
    for name, a in report["agreement"].items():
        lines.append(f"| {name} | {a['logprob']:.2e} | {a['grad']:.2e} | {a['grad_scale']:.2e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
