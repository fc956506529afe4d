"""Masks for a model family beyond the dense tiny model, end to end on CPU: a random-weight
Qwen3-MoE (8 experts, top-2; ``tiny_variants.build_tiny_moe``), on the runner vLLM 0.26 picks for
it with and without the switch (the V1 runner), every row checked against vLLM's processed
logprobs."""

from __future__ import annotations

import pytest

from engine_cases import generate
from mask_invariants import check_completion
from tiny_variants import build_tiny_moe

pytestmark = pytest.mark.slow


def test_moe_model_rows_on_the_runner_vllm_picks(tiny_model_dir: str,
                                                 pytestconfig: pytest.Config) -> None:
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    moe = str(build_tiny_moe(tiny_model_dir, pytestconfig.cache.mkdir("vllm_sampling_mask_moe")))
    options = dict(enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0,
                   dtype="float32", max_num_batched_tokens=256)
    stock_v2 = EngineArgs(moe, **options).create_engine_config().use_v2_model_runner
    assert not stock_v2  # vLLM 0.26 runs this MoE on its V1 runner
    llm = LLM(moe, return_sampling_mask=True, logprobs_mode="processed_logprobs",
              max_logprobs=32, **options)
    try:
        assert llm.llm_engine.vllm_config.use_v2_model_runner is stock_v2
        params = [SamplingParams(temperature=1.0, top_k=12, logprobs=12, max_tokens=12, seed=i)
                  for i in range(3)]
        params.append(SamplingParams(temperature=0.7, top_k=24, top_p=0.8, min_p=0.05,
                                     logprobs=24, max_tokens=12))
        completions = generate(llm, [{"prompt_token_ids": [41 + i, 42, 43, 44]}
                                     for i in range(len(params))], params)
        for completion in completions:
            assert len(completion.token_ids) == 12 or completion.finish_reason == "stop"
            assert check_completion(completion, with_logprobs=True) == []
    finally:
        del llm
