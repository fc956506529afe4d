"""Speculative decoding with masks on Model Runner V2, on a real GPU through real vLLM (``gpu``
marker; run on the H200 in a pytest invocation of its own).

EAGLE drafts from ``draft_models.build_tiny_eagle_draft`` (a draft that proposes its input token
again, sharing the target's embeddings and lm_head), the mixed workload of the other GPU tests
plus prompts that repeat a pattern: every token's row is checked against the processed logprobs
vLLM returns for it, draft positions included, and some drafts must be accepted.
"""

from __future__ import annotations

import os

import pytest

from draft_models import build_tiny_eagle_draft
from gpu_workloads import mixed_requests
from mask_invariants import check_completion

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("SAMPLING_MASK_GPU_MODEL", "/root/models/qwen3-0.6b")


def test_mrv2_eagle_speculative_decoding(tmp_path) -> None:
    if not os.path.isdir(MODEL):  # a GPU test that does not run is a failure, never a skip
        pytest.fail(f"GPU model {MODEL} not found (set SAMPLING_MASK_GPU_MODEL)")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    draft = build_tiny_eagle_draft(MODEL, tmp_path / "eagle_draft")
    llm = LLM(MODEL, return_sampling_mask=True, logprobs_mode="processed_logprobs",
              speculative_config={"method": "eagle", "model": str(draft),
                                  "num_speculative_tokens": 3},
              max_num_seqs=128, max_model_len=4096, max_logprobs=80, seed=0,
              gpu_memory_utilization=0.5, disable_log_stats=False,
              enforce_eager=os.environ.get("SAMPLING_MASK_GPU_EAGER", "1") == "1")
    try:
        assert llm.llm_engine.vllm_config.use_v2_model_runner
        prompts, params = mixed_requests(64, seed=7)
        for i in range(64):
            pattern = [1000 + 37 * i + j for j in range(6)]
            prompts.append(TokensPrompt(prompt_token_ids=pattern * 8))
            params.append(SamplingParams(temperature=0.3, top_k=4, logprobs=12, max_tokens=96,
                                         seed=i, stop_token_ids=[pattern[4]] if i % 4 else None))
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens = 0
        violations = {}
        for output, p in zip(outputs, params):
            for completion in output.outputs:
                tokens += len(completion.token_ids)
                wants = (p.extra_args or {}).get("return_sampling_mask", True)
                if not wants:
                    if completion.sampling_mask is not None:
                        violations[output.request_id] = ["a mask for an opted-out request"]
                    continue
                problems = check_completion(completion, with_logprobs=bool(p.logprobs))
                if problems:
                    violations[output.request_id] = problems[:3]
        accepted = sum(m.value for m in llm.get_metrics()
                       if m.name == "vllm:spec_decode_num_accepted_tokens")
        print(f"GPU_MRV2_EAGLE tokens={tokens} accepted_draft_tokens={accepted} "
              f"violations={len(violations)}", flush=True)
        assert not violations, dict(list(violations.items())[:5])
        assert accepted > 0
    finally:
        del llm
