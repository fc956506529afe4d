"""Masked generation on a parallel layout, run in a fresh interpreter (its own worker processes
and process groups), printed as one JSON line: every completion's rows checked against the
processed logprobs vLLM returned for it.

usage: python parallel_generation.py MODEL [--tensor-parallel-size N] [--pipeline-parallel-size N]
           [--enable-expert-parallel] [--gpu]

Without ``--gpu``: six short requests on the CPU test engine (float32, eager). With it: the
256-request mixed workload of the GPU tests (``gpu_workloads.mixed_requests``) on an engine
shaped like theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

GPU_REQUESTS = 256


def runner_class(worker):  # runs inside each worker process (sent by collective_rpc)
    runner = worker.model_runner
    return f"{type(runner).__module__}.{type(runner).__qualname__}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: mask_invariants
    from mask_invariants import check_completion
    from vllm import LLM, SamplingParams

    layout = dict(tensor_parallel_size=args.tensor_parallel_size,
                  pipeline_parallel_size=args.pipeline_parallel_size,
                  enable_expert_parallel=args.enable_expert_parallel)
    if args.gpu:
        from gpu_workloads import check_outputs, mixed_requests

        engine = dict(max_num_seqs=GPU_REQUESTS, max_model_len=4096, max_logprobs=80,
                      gpu_memory_utilization=0.5,
                      enforce_eager=os.environ.get("SAMPLING_MASK_GPU_EAGER", "1") == "1")
        prompts, params = mixed_requests(GPU_REQUESTS, seed=11)
    else:
        engine = dict(enforce_eager=True, max_model_len=128, max_num_seqs=8, max_logprobs=64,
                      dtype="float32")
        params = [SamplingParams(temperature=1.0, top_k=12 + i, top_p=[1.0, 0.9][i % 2],
                                 min_p=0.02 if i == 3 else 0.0, logprobs=32, max_tokens=10,
                                 seed=i) for i in range(6)]
        prompts = [{"prompt_token_ids": [41 + i, 42, 43]} for i in range(len(params))]
    llm = LLM(args.model, return_sampling_mask=True, logprobs_mode="processed_logprobs", seed=0,
              **layout, **engine)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    if args.gpu:
        checked = check_outputs(outputs, params)
        problems = [f"request {i}: {p}" for i, found in checked["violations"].items()
                    for p in found]
    else:
        problems = [p for c in completions for p in check_completion(c, with_logprobs=True)]
    print("RESULT " + json.dumps({
        "use_v2_model_runner": llm.llm_engine.vllm_config.use_v2_model_runner,
        "runners": llm.collective_rpc(runner_class),
        "requests": len(params),
        "tokens": sum(len(c.token_ids) for c in completions),
        "rows": sum(len(c.sampling_mask.token_ids) for c in completions),
        "problems": problems,
    }), flush=True)


if __name__ == "__main__":
    main()
