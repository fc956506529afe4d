"""The mixed 256-request workload of the GPU engine tests (both runners)."""

from __future__ import annotations

import random
from typing import Any


def mixed_requests(num_requests: int, seed: int = 0) -> tuple[list[Any], list[Any]]:
    """``(prompts, params)``: 1 in 8 prompts exceeds a 2048-token budget (chunked prefill), half
    share a 512-token prefix (prefix caching); top_k 20/50/64 with top_p 1/0.95/0.8, some
    min_p, presence penalties, seeds and stop tokens; logprobs cover each row (top_k + 8)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    shared_prefix = [rng.randrange(100, 8000) for _ in range(512)]
    prompts, params = [], []
    for i in range(num_requests):
        length = 2600 if i % 8 == 0 else rng.randrange(16, 256)
        body = [rng.randrange(100, 8000) for _ in range(length)]
        prompts.append(TokensPrompt(prompt_token_ids=(shared_prefix + body) if i % 2 else body))
        top_k = [20, 50, 64][i % 3]
        params.append(SamplingParams(
            temperature=[1.0, 0.8][i % 2], top_k=top_k, top_p=[1.0, 0.95, 0.8][i % 3],
            min_p=0.02 if i % 5 == 0 else 0.0, presence_penalty=0.3 if i % 7 == 0 else 0.0,
            logprobs=top_k + 8, max_tokens=rng.randrange(32, 192), seed=i if i % 4 == 0 else None,
            stop_token_ids=[rng.randrange(100, 8000) for _ in range(20)] if i % 6 == 0 else None))
    return prompts, params
