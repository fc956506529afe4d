"""Masks for a model family beyond the dense tiny model, end to end on CPU, on the runner vLLM
0.26 picks for it with and without the switch (the V1 runner), every row checked against vLLM's
processed logprobs: a random-weight hybrid Qwen3-Next (Gated DeltaNet and attention layers, sparse
MoE blocks; ``tiny_variants.build_tiny_hybrid``).

It covers vLLM's fused-MoE layer too, so the plain Qwen3-MoE (``build_tiny_moe``, which passed
here in the same way) runs only on the GPU (``test_gpu_model_families.py``): each CPU engine
costs CI about a minute."""

from __future__ import annotations

import pytest

from engine_cases import generate
from engine_start import start_llm
from mask_invariants import check_completion
from tiny_variants import build_tiny_hybrid

pytestmark = pytest.mark.slow


def test_hybrid_model_rows_on_the_runner_vllm_picks(tiny_model_dir: str,
                                                    pytestconfig: pytest.Config) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    model = str(build_tiny_hybrid(tiny_model_dir,
                                  pytestconfig.cache.mkdir("vllm_sampling_mask_hybrid")))
    # vLLM's CPU Gated DeltaNet kernel keeps its recurrent state in float32 only.
    options = dict(enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0,
                   max_num_batched_tokens=256, dtype="bfloat16", mamba_ssm_cache_dtype="float32")
    stock_v2 = EngineArgs(model, **options).create_engine_config().use_v2_model_runner
    assert not stock_v2  # vLLM 0.26 runs hybrid models on its V1 runner
    llm = start_llm(
        model, return_sampling_mask=True, logprobs_mode="processed_logprobs",
        max_logprobs=32, **options)
    try:
        assert llm.llm_engine.vllm_config.use_v2_model_runner is stock_v2
        # logprobs = top_k + 8: bfloat16 logits tie at the top-k boundary, and ties are kept.
        params = [SamplingParams(temperature=1.0, top_k=12, logprobs=20, max_tokens=12, seed=i)
                  for i in range(3)]
        params.append(SamplingParams(temperature=0.7, top_k=24, top_p=0.8, min_p=0.05,
                                     logprobs=32, max_tokens=12))
        completions = generate(llm, [{"prompt_token_ids": [41 + i, 42, 43, 44]}
                                     for i in range(len(params))], params)
        widths = [len(row) for c in completions for row in c.sampling_mask.token_ids]
        assert max(widths) < 100  # a random model whose logits differ (not one long tie)
        for completion in completions:
            assert len(completion.token_ids) == 12 or completion.finish_reason == "stop"
            assert check_completion(completion, with_logprobs=True) == []
    finally:
        del llm
