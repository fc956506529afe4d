"""Masked generation on a parallel layout, run in a fresh interpreter (its own worker processes
and process groups), printed as one JSON line: every completion's rows checked against the
processed logprobs vLLM returned for it.

usage: python parallel_generation.py MODEL --tensor-parallel-size N | --pipeline-parallel-size N
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def runner_class(worker):  # runs inside each worker process (sent by collective_rpc)
    runner = worker.model_runner
    return f"{type(runner).__module__}.{type(runner).__qualname__}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: mask_invariants
    from mask_invariants import check_completion
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, return_sampling_mask=True, logprobs_mode="processed_logprobs",
              enforce_eager=True, max_model_len=128, max_num_seqs=8, max_logprobs=64, seed=0,
              dtype="float32", tensor_parallel_size=args.tensor_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size)
    params = [SamplingParams(temperature=1.0, top_k=12 + i, top_p=[1.0, 0.9][i % 2],
                             min_p=0.02 if i == 3 else 0.0, logprobs=32, max_tokens=10, seed=i)
              for i in range(6)]
    outputs = llm.generate([{"prompt_token_ids": [41 + i, 42, 43]} for i in range(len(params))],
                           params, use_tqdm=False)
    completions = [c for o in outputs for c in o.outputs]
    print("RESULT " + json.dumps({
        "use_v2_model_runner": llm.llm_engine.vllm_config.use_v2_model_runner,
        "runners": llm.collective_rpc(runner_class),
        "tokens": sum(len(c.token_ids) for c in completions),
        "rows": sum(len(c.sampling_mask.token_ids) for c in completions),
        "problems": [p for c in completions for p in check_completion(c, with_logprobs=True)],
    }), flush=True)


if __name__ == "__main__":
    main()
