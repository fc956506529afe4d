"""Speculative decoding with masks on Model Runner V2, on a real GPU through real vLLM (``gpu``
marker; run on the H200 in a pytest invocation of its own).

EAGLE drafts from ``tiny_variants.build_tiny_eagle_draft`` (a draft that proposes its input token
again, sharing the target's embeddings and lm_head), the mixed workload of the other GPU tests
plus prompts that repeat a pattern: every token's row is checked against the processed logprobs
vLLM returns for it, draft positions included, and some drafts must be accepted.
"""

from __future__ import annotations

import os

import pytest

from tiny_variants import build_tiny_eagle_draft
from gpu_workloads import check_outputs, mixed_requests, repeating_pattern_requests

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("SAMPLING_MASK_GPU_MODEL", "/root/models/qwen3-0.6b")


def test_mrv2_eagle_speculative_decoding(tmp_path, monkeypatch) -> None:
    if not os.path.isdir(MODEL):  # a GPU test that does not run is a failure, never a skip
        pytest.fail(f"GPU model {MODEL} not found (set SAMPLING_MASK_GPU_MODEL)")
    from vllm import LLM

    draft = build_tiny_eagle_draft(MODEL, tmp_path / "eagle_draft")
    # The draft was just built with torch on the CPU in this process; an engine core forked
    # after that sat silent after "Using V2 Model Runner" on the H200 (twice, 2026-12-02), a
    # spawned one started at once.
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    llm = LLM(MODEL, return_sampling_mask=True, logprobs_mode="processed_logprobs",
              speculative_config={"method": "eagle", "model": str(draft),
                                  "num_speculative_tokens": 3},
              max_num_seqs=128, max_model_len=4096, max_logprobs=80, seed=0,
              gpu_memory_utilization=0.5, disable_log_stats=False,
              enforce_eager=os.environ.get("SAMPLING_MASK_GPU_EAGER", "1") == "1")
    try:
        assert llm.llm_engine.vllm_config.use_v2_model_runner
        prompts, params = mixed_requests(64, seed=7, speculative=True)
        pattern_prompts, pattern_params = repeating_pattern_requests(64, top_k=4, logprobs=12)
        prompts += pattern_prompts
        params += pattern_params
        result = check_outputs(llm.generate(prompts, params, use_tqdm=False), params)
        accepted = sum(m.value for m in llm.get_metrics()
                       if m.name == "vllm:spec_decode_num_accepted_tokens")
        print(f"GPU_MRV2_EAGLE tokens={result['tokens']} accepted_draft_tokens={accepted} "
              f"violations={len(result['violations'])}", flush=True)
        assert not result["violations"], dict(list(result["violations"].items())[:5])
        assert accepted > 0
    finally:
        del llm
