"""Masks for model families beyond the dense Qwen3 on a real GPU through real vLLM (``gpu``
marker; run on the H200 in a pytest invocation of its own: ``run_h200.sh families``).

A random-weight Qwen3-MoE (``tiny_variants.build_tiny_moe``, 8 experts, top-2, the target's
151936-id vocabulary) on the runner vLLM 0.26 picks for it with the switch off (V1), the
256-request mixed workload of the other GPU tests: every token's row checked against the
processed logprobs vLLM returns for it. The slim vLLM build of ``shared/device`` needs vLLM's
MoE kernels (``_moe_C_stable_libtorch.abi3.so``) put back first; ``run_h200.sh`` does that from
``.vstage5``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpu_workloads import check_outputs, mixed_requests
from tiny_variants import build_tiny_moe

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("SAMPLING_MASK_GPU_MODEL", "/root/models/qwen3-0.6b")
MOE_MODEL = os.environ.get("SAMPLING_MASK_GPU_MOE_MODEL", "/root/models/qwen3-moe-tiny")
NUM_REQUESTS = 256


def test_moe_rows_on_the_runner_vllm_picks(monkeypatch) -> None:
    if not os.path.isdir(MODEL):  # a GPU test that does not run is a failure, never a skip
        pytest.fail(f"GPU model {MODEL} not found (set SAMPLING_MASK_GPU_MODEL)")
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    moe = str(build_tiny_moe(MODEL, Path(MOE_MODEL), hidden_size=512, head_dim=64))
    # Built with torch on the CPU in this process: spawn the engine core (a forked one hung
    # after such work in test_gpu_engine_speculative.py).
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    options = dict(max_num_seqs=NUM_REQUESTS, max_model_len=4096, max_logprobs=80, seed=0,
                   gpu_memory_utilization=0.5, disable_log_stats=False,
                   enforce_eager=os.environ.get("SAMPLING_MASK_GPU_EAGER", "1") == "1")
    stock_v2 = EngineArgs(moe, **options).create_engine_config().use_v2_model_runner
    llm = LLM(moe, return_sampling_mask=True, logprobs_mode="processed_logprobs", **options)
    try:
        use_v2 = llm.llm_engine.vllm_config.use_v2_model_runner
        assert use_v2 is stock_v2
        prompts, params = mixed_requests(NUM_REQUESTS, seed=11)
        result = check_outputs(llm.generate(prompts, params, use_tqdm=False), params)
        print("GPU_MOE_SUMMARY " + json.dumps({
            "model": moe, "runner": "MRV2" if use_v2 else "V1", "requests": len(params),
            "tokens": result["tokens"], "violations": len(result["violations"])}), flush=True)
        assert not result["violations"], dict(list(result["violations"].items())[:5])
    finally:
        del llm
