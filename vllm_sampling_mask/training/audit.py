"""Replay audit: does the trainer reproduce the rollout engine's log-probs on the kept set?

Rolls out with vLLM (``return_sampling_mask=True``, processed log-probs), rescores the same
prompt + completion tokens with Hugging Face transformers, and reports the importance-ratio
metrics of the trainer's log-probs against the engine's, both renormalised over each token's
sampling mask (``support_logprobs``) and over the full vocabulary. With identical weights the
kept-set ratio is ~1; the full-vocabulary ratio is the kept probability mass (< 1 under
truncation). An untruncated control run (``top_k`` = vocabulary size, ``top_p`` = 1) must give
~1 for both::

    python -m vllm_sampling_mask.training.audit --model DIR --top-k 50 --top-p 0.95 \\
        --out audit.json

vLLM and transformers are imported inside functions only: importing this module (or
``vllm_sampling_mask.training``) never imports them.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_sampling_mask.training.logprobs import support_logprobs
from vllm_sampling_mask.training.metrics import (
    DEFAULT_RATIO_BAND,
    importance_ratio_metrics,
    kept_probability_mass,
)
from vllm_sampling_mask.training.packed import PackedMasks

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "def fibonacci(n):",
    "List three uses of a paperclip:",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Translate to German: The weather is nice today.",
)


@dataclass(frozen=True)
class Rollout:
    """One completion as the engine produced it.

    Attributes:
        prompt_token_ids: the prompt's ``P`` token ids (``P >= 1``).
        token_ids: the ``T`` generated token ids.
        logprobs: ``[T] float32`` the engine's (processed, kept-set) log-prob of each token.
        masks: ``T`` rows, row ``t`` the kept set of ``token_ids[t]``.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor
    masks: PackedMasks


@dataclass(frozen=True)
class Rescored:
    """Per-token log-probs of a set of rollouts, concatenated in rollout order (``[T] float32``)."""

    rollout_logprobs: torch.Tensor
    kept_logprobs: torch.Tensor
    full_logprobs: torch.Tensor
    mask_row_lengths: torch.Tensor
    num_sequences: int


def rollouts_from_request_outputs(request_outputs: Iterable[Any]) -> list[Rollout]:
    """Convert vLLM ``RequestOutput``s (every completion of each, ``n > 1`` included).

    Each completion needs ``token_ids``, ``logprobs`` (requested with ``logprobs >= 0``) and
    ``sampling_mask.token_ids`` with one row per token. Raises ``ValueError`` otherwise.
    """
    rollouts = []
    for request in request_outputs:
        for completion in request.outputs:
            token_ids = list(completion.token_ids)
            where = f"request {request.request_id!r} completion {completion.index}"
            if completion.logprobs is None or len(completion.logprobs) != len(token_ids):
                raise ValueError(
                    f"{where}: logprobs must hold one entry per token; pass "
                    f"SamplingParams(logprobs=0)."
                )
            mask = getattr(completion, "sampling_mask", None)
            if mask is None:
                raise ValueError(
                    f"{where} has no sampling_mask; build the engine with "
                    f"LLM(..., return_sampling_mask=True)."
                )
            masks = PackedMasks.from_any(mask)
            if masks.num_rows != len(token_ids):
                raise ValueError(
                    f"{where}: sampling_mask must have one row per token ({len(token_ids)}), "
                    f"got {masks.num_rows} rows."
                )
            logprobs = [completion.logprobs[t][token].logprob for t, token in enumerate(token_ids)]
            rollouts.append(Rollout(
                prompt_token_ids=list(request.prompt_token_ids),
                token_ids=token_ids,
                logprobs=torch.tensor(logprobs, dtype=torch.float32),
                masks=masks,
            ))
    return rollouts


@torch.no_grad()
def rescore_rollouts(
    model: torch.nn.Module, rollouts: Sequence[Rollout], temperature: float = 1.0
) -> Rescored:
    """Score each rollout's tokens with a causal LM, one sequence at a time.

    Args:
        model: a Hugging Face causal LM (``model(input_ids).logits`` is ``[1, L, V]``).
        rollouts: completions with their masks; the prompt must be non-empty.
        temperature: the rollout temperature (logits are divided by it).

    Returns:
        ``Rescored`` with kept-set and full-vocabulary log-probs from ``support_logprobs``
        (which raises ``ValueError`` if a sampled token is outside its mask row).
    """
    device = next(model.parameters()).device
    kept, full, rollout, lengths = [], [], [], []
    for rollout_item in rollouts:
        num_prompt, num_generated = len(rollout_item.prompt_token_ids), len(rollout_item.token_ids)
        if num_prompt == 0:
            raise ValueError("rollout prompts must be non-empty to score the first token.")
        input_ids = torch.tensor(
            [rollout_item.prompt_token_ids + rollout_item.token_ids], device=device)
        # Position p scores token p + 1: the generated tokens are scored by p in [P-1, P+T-1).
        logits = model(input_ids=input_ids).logits[0, num_prompt - 1:num_prompt + num_generated - 1]
        kept_lp, full_lp = support_logprobs(
            logits.float(), input_ids[0, num_prompt:], rollout_item.masks,
            temperature=temperature, return_full=True)
        kept.append(kept_lp.cpu())
        full.append(full_lp.cpu())
        rollout.append(rollout_item.logprobs)
        lengths.append(rollout_item.masks.row_lengths.cpu())
    empty = torch.zeros(0)
    return Rescored(
        rollout_logprobs=torch.cat(rollout) if rollout else empty,
        kept_logprobs=torch.cat(kept) if kept else empty,
        full_logprobs=torch.cat(full) if full else empty,
        mask_row_lengths=torch.cat(lengths).float() if lengths else empty,
        num_sequences=len(rollouts),
    )


def summarize(rescored: Rescored, ratio_band: float = DEFAULT_RATIO_BAND) -> dict[str, Any]:
    """Metrics of one run: ratio metrics on the kept set and on the full vocabulary, the mean
    kept probability mass and the mask row sizes (see ``importance_ratio_metrics``)."""
    num_tokens = rescored.kept_logprobs.numel()
    kept_mass = kept_probability_mass(rescored.kept_logprobs, rescored.full_logprobs)
    return {
        "num_sequences": rescored.num_sequences,
        "num_tokens": num_tokens,
        "mask_row_length_mean": rescored.mask_row_lengths.mean().item() if num_tokens else None,
        "mask_row_length_max": rescored.mask_row_lengths.max().item() if num_tokens else None,
        "kept_mass_mean": kept_mass.double().mean().item() if num_tokens else None,
        "kept_set": importance_ratio_metrics(
            rescored.kept_logprobs, rescored.rollout_logprobs, ratio_band=ratio_band),
        "full_vocab": importance_ratio_metrics(
            rescored.full_logprobs, rescored.rollout_logprobs, ratio_band=ratio_band),
    }


def markdown_table(runs: dict[str, dict[str, Any]], ratio_band: float = DEFAULT_RATIO_BAND) -> str:
    """One table row per (run, normalisation) from ``summarize`` outputs keyed by run name."""
    band = f"[{1 - ratio_band:g}, {1 + ratio_band:g}]"
    lines = [
        f"| run | pi_theta over | tokens | ratio mean | outside {band} | KL k3 | KL k1 "
        f"| max abs log-ratio | kept mass | mask row mean |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, summary in runs.items():
        for scope, label in (("kept_set", "kept set"), ("full_vocab", "full vocab")):
            m = summary[scope]
            lines.append(
                f"| {name} | {label} | {summary['num_tokens']} | {m['ratio_mean']:.4f} | "
                f"{m['ratio_outside_band']:.2%} | {m['kl_k3']:.2e} | {m['kl_k1']:.2e} | "
                f"{m['log_ratio_abs_max']:.3g} | {_fmt(summary['kept_mass_mean'], '.4f')} | "
                f"{_fmt(summary['mask_row_length_mean'], '.1f')} |"
            )
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_sampling_mask.training.audit",
        description="Roll out with vLLM (sampling masks on), rescore with transformers, and "
                    "report importance-ratio metrics on the kept set and the full vocabulary.",
    )
    parser.add_argument("--model", required=True, help="Model directory (or hub id) for both.")
    parser.add_argument("--out", default="sampling_mask_audit.json", help="JSON report path.")
    parser.add_argument("--prompts-file", type=Path,
                        help="Text file, one prompt per line (default: 8 built-in prompts).")
    parser.add_argument("--samples-per-prompt", type=int, default=4,
                        help="Completions per prompt in the truncated run (SamplingParams.n).")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="Tokens per completion in the truncated run.")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--control-max-tokens", type=int, default=16,
                        help="Tokens per completion in the untruncated control run (one per "
                             "prompt): its mask rows hold the whole vocabulary, so keep it short; "
                             "0 skips the control.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32",
                        help="vLLM weight dtype (float32 matches the trainer exactly; bfloat16 "
                             "measures the usual bf16-rollout mismatch).")
    parser.add_argument("--trainer-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="transformers weight dtype used for rescoring.")
    parser.add_argument("--trainer-device", default=None,
                        help="Rescoring device (default: cuda if available, else cpu).")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="Generate max_tokens per completion even past EOS (a fixed token "
                        "count; every token is still sampled from the filtered distribution).")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="Engine batch limit (small values make CPU runs start faster).")
    parser.add_argument("--ratio-band", type=float, default=DEFAULT_RATIO_BAND,
                        help="Report the share of ratios outside [1 - band, 1 + band].")
    parser.add_argument("--max-ratio-error", type=float, default=None,
                        help="Exit with status 1 if a run's kept-set mean ratio is further than "
                             "this from 1.")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the audit; returns the process exit status."""
    args = parse_args(argv)
    prompts = (args.prompts_file.read_text().splitlines() if args.prompts_file
               else list(DEFAULT_PROMPTS))
    prompts = [p for p in prompts if p.strip()]

    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    vocab_size = AutoConfig.from_pretrained(args.model).get_text_config().vocab_size
    common = dict(temperature=args.temperature, logprobs=0, seed=args.seed,
                  ignore_eos=args.ignore_eos)
    run_params = {
        "truncated": SamplingParams(n=args.samples_per_prompt, top_k=args.top_k, top_p=args.top_p,
                                    min_p=args.min_p, max_tokens=args.max_tokens, **common),
    }
    if args.control_max_tokens > 0:
        # The engine rejects top_k <= 0 when masks are on; top_k = vocab is untruncated.
        run_params["control"] = SamplingParams(n=1, top_k=vocab_size, top_p=1.0, min_p=0.0,
                                               max_tokens=args.control_max_tokens, **common)

    llm = LLM(
        model=args.model,
        return_sampling_mask=True,
        logprobs_mode="processed_logprobs",
        enforce_eager=True,
        seed=args.seed,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}),
        generation_config="vllm",  # no sampling defaults from the model's generation_config
    )
    rollouts = {name: rollouts_from_request_outputs(llm.generate(prompts, params))
                for name, params in run_params.items()}
    # Stop the engine processes so the trainer model gets the GPU memory back.
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    device = args.trainer_device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.trainer_dtype)).to(device).eval()
    runs = {name: summarize(rescore_rollouts(model, items, args.temperature), args.ratio_band)
            for name, items in rollouts.items()}

    report = {"config": {**{k: str(v) if isinstance(v, Path) else v
                            for k, v in vars(args).items()},
                         "vocab_size": vocab_size, "num_prompts": len(prompts)},
              "runs": runs}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(markdown_table(runs, args.ratio_band))
    print(f"\nReport written to {args.out}")

    if args.max_ratio_error is not None:
        off = {name: s["kept_set"]["ratio_mean"] for name, s in runs.items()
               if not abs(s["kept_set"]["ratio_mean"] - 1.0) <= args.max_ratio_error}
        if off:
            print(f"FAIL: kept-set mean ratio further than {args.max_ratio_error} from 1: {off}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
