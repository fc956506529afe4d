"""The workloads of the GPU engine tests (both runners) and their contract check."""

from __future__ import annotations

import random
from typing import Any

from mask_invariants import check_completion


def mixed_requests(num_requests: int, seed: int = 0,
                   speculative: bool = False) -> tuple[list[Any], list[Any]]:
    """``(prompts, params)``: 1 in 8 prompts exceeds a 2048-token budget (chunked prefill), half
    share a 512-token prefix (prefix caching); top_k 20/50/64 with top_p 1/0.95/0.8, some
    min_p, presence penalties, seeds and stop tokens; logprobs cover each row (top_k + 8).
    ``speculative``: no min_p (vLLM 0.26 refuses it under speculative decoding)."""
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
            min_p=0.02 if i % 5 == 0 and not speculative else 0.0,
            presence_penalty=0.3 if i % 7 == 0 else 0.0,
            logprobs=top_k + 8, max_tokens=rng.randrange(32, 192), seed=i if i % 4 == 0 else None,
            stop_token_ids=[rng.randrange(100, 8000) for _ in range(20)] if i % 6 == 0 else None))
    return prompts, params


def repeating_pattern_requests(count: int, *, top_k: int,
                               logprobs: int) -> tuple[list[Any], list[Any]]:
    """``(prompts, params)`` whose prompts repeat a 6-token pattern, so speculative drafts exist
    and get accepted; 3 in 4 stop at the pattern's 5th token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, params = [], []
    for i in range(count):
        pattern = [1000 + 37 * i + j for j in range(6)]
        prompts.append(TokensPrompt(prompt_token_ids=pattern * 8))
        params.append(SamplingParams(temperature=0.3, top_k=top_k, logprobs=logprobs,
                                     max_tokens=96, seed=i,
                                     stop_token_ids=[pattern[4]] if i % 4 else None))
    return prompts, params


def check_outputs(outputs: list[Any], params: list[Any]) -> dict:
    """Violations by request index, and the counts of what was checked (``banned_rows``: rows
    of requests that asked the test logits processor to ban even ids)."""
    from vllm_sampling_mask_testing.logits_processors import REQUEST_KEY

    violations, tokens, banned_rows = {}, 0, 0
    for i, (output, p) in enumerate(zip(outputs, params)):
        (completion,) = output.outputs
        tokens += len(completion.token_ids)
        extra = p.extra_args or {}
        if extra.get("return_sampling_mask") is False:
            if completion.sampling_mask is not None:
                violations[i] = ["opted out but got a mask"]
            continue
        problems = check_completion(completion, with_logprobs=True)
        if extra.get(REQUEST_KEY):
            rows = completion.sampling_mask.token_ids
            banned_rows += len(rows)
            if any(t % 2 == 0 for row in rows for t in row):
                problems.append("even id in a row of a request that banned them")
        if problems:
            violations[i] = problems
    return {"violations": violations, "tokens": tokens, "banned_rows": banned_rows}
