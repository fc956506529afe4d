"""Masks on parallel layouts across two GPUs through real vLLM (``gpu`` marker; needs two GPUs,
the lent ``nvidia-h200-x2``: ``run_h200.sh layouts``).

Tensor, pipeline and expert parallelism, each in a fresh interpreter
(``scripts/parallel_generation.py --gpu``: the 256-request mixed workload of the other GPU
tests, every row checked against the processed logprobs vLLM returned for it), on the runner
vLLM picks; data parallelism behind ``vllm serve`` (internal load balancing), requests finished
by both engines, every row of the HTTP responses checked. The rows a user gets come from the
output rank: vLLM's executor forwards only that rank's ``ModelRunnerOutput``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
from pathlib import Path

import pytest

from engine_cases import run_result_script
from http_server import MASK_FLAGS, running_server
from mask_invariants import mask_problems
from tiny_variants import build_tiny_moe

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("SAMPLING_MASK_GPU_MODEL", "/root/models/qwen3-0.6b")
MOE_MODEL = os.environ.get("SAMPLING_MASK_GPU_MOE_MODEL", "/root/models/qwen3-moe-tiny")
SCRIPT = Path(__file__).parent / "scripts" / "parallel_generation.py"


@pytest.fixture(autouse=True)
def two_gpus() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"{torch.cuda.device_count()} GPU(s): these layouts need two")
    if not os.path.isdir(MODEL):  # a GPU test that does not run is a failure, never a skip
        pytest.fail(f"GPU model {MODEL} not found (set SAMPLING_MASK_GPU_MODEL)")


def run_layout(model: str, *args: str) -> dict:
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc
    out = run_result_script(SCRIPT, env, model, "--gpu", *args)
    print(f"GPU_LAYOUT_SUMMARY {json.dumps({k: v for k, v in out.items() if k != 'problems'})}"
          f" {' '.join(args)} violations={len(out['problems'])}", flush=True)
    assert len(out["runners"]) == 2, out["runners"]
    assert out["rows"] == out["tokens"] > 0 and out["problems"] == [], out["problems"][:5]
    return out


def test_tensor_parallel() -> None:
    run_layout(MODEL, "--tensor-parallel-size", "2")


def test_pipeline_parallel() -> None:
    run_layout(MODEL, "--pipeline-parallel-size", "2")


def test_expert_parallel_moe() -> None:
    moe = str(build_tiny_moe(MODEL, Path(MOE_MODEL), hidden_size=512, head_dim=64))
    run_layout(moe, "--tensor-parallel-size", "2", "--enable-expert-parallel")


def test_data_parallel_server_rows_from_both_engines() -> None:
    flags = (*MASK_FLAGS, "--data-parallel-size", "2", "--max-num-seqs", "64",
             "--gpu-memory-utilization", "0.5")
    vocab = json.loads((Path(MODEL) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    bodies = [{"token_ids": [rng.randrange(100, 8000) for _ in range(rng.randrange(16, 256))],
               "sampling_params": {"temperature": 1.0, "top_k": [20, 50, 64][i % 3],
                                   "top_p": [1.0, 0.95, 0.8][i % 3], "max_tokens": 64,
                                   "seed": i}} for i in range(256)]
    with running_server(MODEL, dict(os.environ), flags, start_timeout=600) as server:
        def generate(body: dict) -> dict:
            with server.client() as client:
                response = client.post("/inference/v1/generate", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            choices = [c for body in pool.map(generate, bodies) for c in body["choices"]]
        finished = server.finished_by_engine()
    problems = [p for c in choices for p in mask_problems(c["token_ids"], c["sampling_mask"], vocab)]
    tokens = sum(len(c["token_ids"]) for c in choices)
    print(f"GPU_LAYOUT_SUMMARY DP=2 requests={len(choices)} tokens={tokens} "
          f"violations={len(problems)} finished_by_engine={finished}", flush=True)
    assert len(choices) == 256 and tokens > 0 and problems == [], problems[:5]
    assert sorted(finished) == ["0", "1"] and all(n > 0 for n in finished.values()), finished
