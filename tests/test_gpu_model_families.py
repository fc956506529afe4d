"""Masks for model families beyond the dense Qwen3 on a real GPU through real vLLM (``gpu``
marker; run on the H200 in a pytest invocation of its own: ``run_h200.sh families``).

A random-weight Qwen3-MoE (``tiny_variants.build_tiny_moe``, 8 experts, top-2, the target's
151936-id vocabulary) and a random-weight hybrid Qwen3-Next (``build_tiny_hybrid``: Gated
DeltaNet and attention layers, MoE blocks), each on the runner vLLM 0.26 picks for it with the
switch off (V1), with the 256-request mixed workload of the other GPU tests; a random-weight
Qwen2-VL (``tiny_variants.build_tiny_vl``) on Model Runner V2 with an image in every prompt.
Every token's row is checked against the processed logprobs vLLM returns for it. The slim vLLM
build of ``shared/device`` needs vLLM's MoE kernels (``_moe_C_stable_libtorch.abi3.so``) put
back first; ``run_h200.sh`` does that from ``.vstage5``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpu_workloads import check_outputs, mixed_requests
from tiny_variants import VISION_TOKENS, build_tiny_hybrid, build_tiny_moe, build_tiny_vl

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("SAMPLING_MASK_GPU_MODEL", "/root/models/qwen3-0.6b")
MOE_MODEL = os.environ.get("SAMPLING_MASK_GPU_MOE_MODEL", "/root/models/qwen3-moe-tiny")
VL_MODEL = os.environ.get("SAMPLING_MASK_GPU_VL_MODEL", "/root/models/qwen2-vl-tiny")
HYBRID_MODEL = os.environ.get("SAMPLING_MASK_GPU_HYBRID_MODEL", "/root/models/qwen3-next-tiny")
NUM_REQUESTS = 256


@pytest.mark.parametrize("family", ["moe", "hybrid"])
def test_rows_on_the_runner_vllm_picks(family: str, monkeypatch) -> None:
    if not os.path.isdir(MODEL):  # a GPU test that does not run is a failure, never a skip
        pytest.fail(f"GPU model {MODEL} not found (set SAMPLING_MASK_GPU_MODEL)")
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    build, out = {"moe": (build_tiny_moe, MOE_MODEL),
                  "hybrid": (build_tiny_hybrid, HYBRID_MODEL)}[family]
    model = str(build(MODEL, Path(out), hidden_size=512, head_dim=64))
    # Built with torch on the CPU in this process: spawn the engine core (a forked one hung
    # after such work in test_gpu_engine_speculative.py).
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    options = dict(max_num_seqs=NUM_REQUESTS, max_model_len=4096, max_logprobs=80, seed=0,
                   gpu_memory_utilization=0.5, disable_log_stats=False,
                   enforce_eager=os.environ.get("SAMPLING_MASK_GPU_EAGER", "1") == "1")
    if family == "hybrid":
        # vLLM picks FlashInfer's Gated DeltaNet prefill on SM90, a CuTe-DSL kernel the staged
        # FlashInfer can't run ("SM90 GDN prefill DSL kernel is unavailable", with or without
        # masks); its Triton kernel computes the same layer.
        options["gdn_prefill_backend"] = "triton"
    stock_v2 = EngineArgs(model, **options).create_engine_config().use_v2_model_runner
    llm = LLM(model, return_sampling_mask=True, logprobs_mode="processed_logprobs", **options)
    try:
        use_v2 = llm.llm_engine.vllm_config.use_v2_model_runner
        assert use_v2 is stock_v2
        prompts, params = mixed_requests(NUM_REQUESTS, seed=11)
        result = check_outputs(llm.generate(prompts, params, use_tqdm=False), params)
        print(f"GPU_{family.upper()}_SUMMARY " + json.dumps({
            "model": model, "runner": "MRV2" if use_v2 else "V1", "requests": len(params),
            "tokens": result["tokens"], "violations": len(result["violations"])}), flush=True)
        assert not result["violations"], dict(list(result["violations"].items())[:5])
    finally:
        del llm


def test_vision_language_rows_with_image_inputs(monkeypatch) -> None:
    if not os.path.isdir(MODEL):
        pytest.fail(f"GPU model {MODEL} not found (set SAMPLING_MASK_GPU_MODEL)")
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    vl = str(build_tiny_vl(MODEL, Path(VL_MODEL)))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # built in this process, as above
    llm = LLM(vl, return_sampling_mask=True, logprobs_mode="processed_logprobs",
              max_num_seqs=64, max_model_len=1024, max_logprobs=80, seed=0,
              limit_mm_per_prompt={"image": 1}, gpu_memory_utilization=0.3,
              enforce_eager=os.environ.get("SAMPLING_MASK_GPU_EAGER", "1") == "1")
    try:
        assert llm.llm_engine.vllm_config.use_v2_model_runner
        rng = np.random.default_rng(0)
        image_prompt = "".join(VISION_TOKENS[i] for i in (0, 2, 1))  # start, image, end
        prompts, params = [], []
        for i in range(64):
            side = int(rng.integers(56, 113))
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            prompts.append({"prompt": image_prompt + " describe it",
                            "multi_modal_data": {"image": Image.fromarray(pixels)}})
            top_k = [12, 40][i % 2]
            params.append(SamplingParams(temperature=1.0, top_k=top_k, top_p=[1.0, 0.9][i % 3 > 0],
                                         logprobs=top_k + 8, max_tokens=48, seed=i))
        result = check_outputs(llm.generate(prompts, params, use_tqdm=False), params)
        print("GPU_VL_SUMMARY " + json.dumps({
            "model": vl, "runner": "MRV2", "requests": len(params), "tokens": result["tokens"],
            "violations": len(result["violations"])}), flush=True)
        assert not result["violations"], dict(list(result["violations"].items())[:5])
    finally:
        del llm
