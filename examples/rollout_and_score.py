"""Roll out with vLLM (sampling masks on), score with the policy on the kept sets, one GRPO step.

    python examples/rollout_and_score.py                  # builds a tiny local model
    python examples/rollout_and_score.py MODEL_DIR --top-k 50 --top-p 0.95 --max-tokens 64

1. ``LLM(model, return_sampling_mask=True, logprobs_mode="processed_logprobs")`` samples
   ``--group-size`` completions per prompt; each completion carries its tokens, pi_old of each
   token on its kept set (the processed log-prob) and ``sampling_mask``.
2. The engine is shut down and the same weights are loaded as a transformers policy.
3. ``grpo_step.py``: pi_theta of each token renormalised over its kept set
   (``support_logprobs``), the ratio pi_theta / pi_old, a clipped GRPO/PPO loss, backward and
   one optimizer step. With identical weights the kept-set ratio is 1; the full-vocabulary one
   is the kept probability mass.

Exits 1 if the loss or gradient is not finite, or (``--max-ratio-error``) the kept-set mean
ratio is off 1.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from grpo_step import Rollout, add_rollout_args, grpo_step, report

PROMPTS = ["The quick brown fox", "Hello world"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_rollout_args(parser, "engine")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    return parser.parse_args()


def roll_out(args: argparse.Namespace) -> list[Rollout]:
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, return_sampling_mask=True, logprobs_mode="processed_logprobs",
              dtype=args.dtype, seed=0, enforce_eager=True, max_model_len=1024,
              max_num_seqs=len(PROMPTS) * args.group_size,
              gpu_memory_utilization=args.gpu_memory_utilization, generation_config="vllm")
    params = SamplingParams(n=args.group_size, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, max_tokens=args.max_tokens, logprobs=0)
    rollouts = [
        Rollout(prompt_token_ids=list(output.prompt_token_ids),
                token_ids=list(completion.token_ids),
                logprobs=[completion.logprobs[i][token].logprob
                          for i, token in enumerate(completion.token_ids)],
                sampling_mask=completion.sampling_mask)  # one row per token
        for output in llm.generate(PROMPTS, params) for completion in output.outputs
    ]
    llm.llm_engine.engine_core.shutdown()  # give the memory back to the policy
    del llm
    gc.collect()
    return rollouts


def main() -> int:
    args = parse_args()
    if args.model is None:
        from vllm_sampling_mask.demo import DEFAULT_MODEL_DIR
        from vllm_sampling_mask.tiny_model import build_tiny_model

        args.model = str(build_tiny_model(DEFAULT_MODEL_DIR))
    rollouts = roll_out(args)

    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    policy.to(device).train()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)
    metrics = grpo_step(policy, optimizer, rollouts, args.group_size, args.temperature)
    return report(metrics, args.max_ratio_error)


if __name__ == "__main__":
    sys.exit(main())
