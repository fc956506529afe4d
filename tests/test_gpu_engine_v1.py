"""The V1 runner's capture on a real GPU through real vLLM (``gpu`` marker; run on the H200).

vLLM picks its V1 runner for these engines by itself: they load a custom logits processor
(``vllm_sampling_mask_testing``'s, which bans even token ids for the requests that ask), which
Model Runner V2 does not support. Same model and 256-request workload as ``test_gpu_engine.py``
(chunked prefill, prefix-cache hits, forced preemption), with async scheduling (masks copied on
V1's async output stream), plus requests that ask the processor and requests that opt out; then a
smaller batch on an engine without async scheduling (masks copied at the end of the step); then
ngram speculative decoding (0.25 of the memory). The engines fit together; run this module in its
own pytest invocation (``test_gpu_engine.py``'s engine takes vLLM's default 0.9).
"""

from __future__ import annotations

import json
import os

import pytest

from gpu_workloads import check_outputs, mixed_requests, repeating_pattern_requests

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("SAMPLING_MASK_GPU_MODEL", "/root/models/qwen3-0.6b")
NUM_REQUESTS = 256


def describe_runner(worker) -> dict:  # runs in the worker (collective_rpc)
    runner = worker.model_runner
    return {
        "runner": f"{type(runner).__module__}.{type(runner).__qualname__}",
        "sampler_path": runner.sampler.topk_topp_sampler.forward.__name__,
        "capture": getattr(runner, "sampling_mask_capture", None) is not None,
        "async_scheduling": runner.use_async_scheduling,
    }


def build_llm(async_scheduling: bool):
    if not os.path.isdir(MODEL):
        pytest.skip(f"GPU model {MODEL} not found (set SAMPLING_MASK_GPU_MODEL)")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM

    from vllm_sampling_mask_testing.logits_processors import PROCESSOR

    return LLM(MODEL, return_sampling_mask=True, logprobs_mode="processed_logprobs",
               logits_processors=[PROCESSOR], async_scheduling=async_scheduling,
               enable_prefix_caching=True, enable_chunked_prefill=True,
               max_num_batched_tokens=2048, max_num_seqs=NUM_REQUESTS, max_model_len=4096,
               num_gpu_blocks_override=1200, block_size=16, max_logprobs=80, seed=0,
               gpu_memory_utilization=0.35, disable_log_stats=False,
               enforce_eager=os.environ.get("SAMPLING_MASK_GPU_EAGER", "1") == "1")


@pytest.fixture(scope="module")
def v1_llm():
    llm = build_llm(async_scheduling=True)
    yield llm
    del llm


def with_processor_and_opt_outs(params: list) -> list:
    """Every 4th request asks the processor to ban even ids; every 8th (offset 2) opts out."""
    from vllm_sampling_mask_testing.logits_processors import REQUEST_KEY

    changed = []
    for i, p in enumerate(params):
        p = p.clone()
        if i % 4 == 1:
            p.extra_args = {REQUEST_KEY: True}
        elif i % 8 == 2:
            p.extra_args = {"return_sampling_mask": False}
        changed.append(p)
    return changed


def test_v1_capture_contract_at_batch_256_async(v1_llm) -> None:
    (worker,) = v1_llm.collective_rpc(describe_runner)
    assert worker == {"runner": "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
                      "sampler_path": "forward_native", "capture": True,
                      "async_scheduling": True}, worker
    prompts, params = mixed_requests(NUM_REQUESTS)
    params = with_processor_and_opt_outs(params)
    result = check_outputs(v1_llm.generate(prompts, params, use_tqdm=False), params)
    metrics = {m.name: getattr(m, "value", None) for m in v1_llm.get_metrics()
               if "preempt" in m.name or "prefix_cache" in m.name}
    print("GPU_V1_SUMMARY " + json.dumps({
        "requests": len(params), "tokens": result["tokens"],
        "banned_rows": result["banned_rows"], "violations": len(result["violations"]),
        "metrics": metrics, "worker": worker}), flush=True)
    assert not result["violations"], dict(list(result["violations"].items())[:5])
    assert result["banned_rows"] > 0


def test_v1_capture_with_sync_scheduling() -> None:
    llm = build_llm(async_scheduling=False)
    try:
        (worker,) = llm.collective_rpc(describe_runner)
        assert worker["capture"] and not worker["async_scheduling"], worker
        prompts, params = mixed_requests(64, seed=3)
        params = with_processor_and_opt_outs(params)
        result = check_outputs(llm.generate(prompts, params, use_tqdm=False), params)
        print(f"GPU_V1_SYNC tokens={result['tokens']} violations={len(result['violations'])}",
              flush=True)
        assert not result["violations"], dict(list(result["violations"].items())[:5])
    finally:
        del llm


def test_v1_ngram_speculative_decoding() -> None:
    """ngram drafts (always the V1 runner): the mixed workload plus prompts that repeat a pattern,
    so drafts exist and are accepted; every token's row checked against the processed logprobs
    vLLM returns for it (draft positions included)."""
    if not os.path.isdir(MODEL):
        pytest.skip(f"GPU model {MODEL} not found (set SAMPLING_MASK_GPU_MODEL)")
    from vllm import LLM

    llm = LLM(MODEL, return_sampling_mask=True, logprobs_mode="processed_logprobs",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3},
              max_num_seqs=128, max_model_len=4096, max_logprobs=80, seed=0,
              gpu_memory_utilization=0.25, disable_log_stats=False,
              enforce_eager=os.environ.get("SAMPLING_MASK_GPU_EAGER", "1") == "1")
    try:
        prompts, params = mixed_requests(64, seed=5, speculative=True)
        pattern_prompts, pattern_params = repeating_pattern_requests(64, top_k=20, logprobs=28)
        prompts += pattern_prompts
        params += pattern_params
        result = check_outputs(llm.generate(prompts, params, use_tqdm=False), params)
        accepted = sum(m.value for m in llm.get_metrics()
                       if m.name == "vllm:spec_decode_num_accepted_tokens")
        print(f"GPU_V1_NGRAM tokens={result['tokens']} accepted_draft_tokens={accepted} "
              f"violations={len(result['violations'])}", flush=True)
        assert not result["violations"], dict(list(result["violations"].items())[:5])
        assert accepted > 0
    finally:
        del llm
