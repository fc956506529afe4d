"""The main job: generate with sampling masks and print them (or serve a model with masks on).

    vllm-sampling-mask-demo                 # builds a tiny local model, prints completions + masks
    vllm-sampling-mask-demo MODEL_PATH      # the same with your model
    vllm-sampling-mask-demo MODEL_PATH --serve [vllm serve options...]

No model download is ever needed: without a model path a tiny random Qwen2 with a locally
trained tokenizer is built under ``~/.cache/vllm-sampling-mask`` (seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "vllm-sampling-mask" / "tiny-model"
PROMPTS = ["Hello world", "The quick brown fox", "kalo mitor zen", "0123456789"]


def _print_completion(prompt: str, completion) -> None:
    rows = completion.sampling_mask.token_ids
    print(f"\nprompt {prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    for i, (token, row) in enumerate(zip(completion.token_ids, rows)):
        kept = math.fsum(math.exp(lp.logprob) for lp in completion.logprobs[i].values()
                         if math.isfinite(lp.logprob))
        shown = row if len(row) <= 12 else row[:6] + ["..."] + row[-3:]
        print(f"  token {token:>6}  kept {len(row):>4} ids  sum p(kept)={kept:.4f}  {shown}")


def run_offline(model: str, top_k: int, top_p: float, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model, return_sampling_mask=True, logprobs_mode="processed_logprobs",
              max_model_len=1024, seed=0, max_logprobs=max(top_k + 8, 20))
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, max_tokens=max_tokens,
                            logprobs=top_k + 8)
    outputs = llm.generate(PROMPTS, params)
    tokens = violations = 0
    for output in outputs:
        completion = output.outputs[0]
        _print_completion(output.prompt, completion)
        rows = completion.sampling_mask.token_ids
        tokens += len(completion.token_ids)
        violations += (len(rows) != len(completion.token_ids)) + sum(
            t not in r for t, r in zip(completion.token_ids, rows))
    summary = {"model": model, "requests": len(outputs), "tokens": tokens, "violations": violations}
    print("\nSUMMARY " + json.dumps(summary))
    return summary


def parse_arguments(argv: list[str]) -> tuple[str | None, argparse.Namespace, list[str]]:
    """``(model or None, our options, vllm serve options)``. The model, if given, comes first
    (so ``--serve --port 8001`` can't read ``8001`` as the model); options we don't know are
    passed to ``vllm serve`` and are an error without ``--serve``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     usage="%(prog)s [MODEL] [--serve [vllm serve options ...]]")
    parser.add_argument("--serve", action="store_true",
                        help="run `vllm serve MODEL --return-sampling-mask` instead")
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--max-tokens", type=int, default=8)
    model = argv[0] if argv and not argv[0].startswith("-") else None
    args, serve_args = parser.parse_known_args(argv[1:] if model is not None else argv)
    if serve_args and not args.serve:
        parser.error(f"unrecognized arguments: {' '.join(serve_args)} (vllm serve options "
                     "need --serve)")
    return model, args, serve_args


def main(argv: list[str] | None = None) -> None:
    model, args, serve_args = parse_arguments(sys.argv[1:] if argv is None else argv)
    if model is None:
        from vllm_sampling_mask.tiny_model import build_tiny_model

        model = str(build_tiny_model(DEFAULT_MODEL_DIR))
        print(f"built tiny model in {model}")
    if args.serve:
        command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
                   "--return-sampling-mask", "--logprobs-mode", "processed_logprobs", *serve_args]
        print(" ".join(command), flush=True)
        os.execv(sys.executable, command)
    summary = run_offline(model, args.top_k, args.top_p, args.max_tokens)
    sys.exit(1 if summary["violations"] else 0)


if __name__ == "__main__":
    main()
