"""Masks on parallel layouts, end to end on CPU (two worker processes or two engines, each bound
to one of the machine's CPUs): tensor parallelism on Model Runner V2, pipeline parallelism on
the V1 runner, data parallelism behind ``vllm serve`` (internal load balancing). Every row is
checked; the rows a user gets come from the output rank only, since vLLM's executor forwards
only that rank's ``ModelRunnerOutput`` (the other ranks compute and drop theirs).

Pipeline parallelism on Model Runner V2 fails on CPU in vLLM 0.26 itself, with the mask switch
off too (``pp_utils`` records an event on the CPU platform's stream placeholder), so it runs
here on V1 only.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import pytest

from engine_cases import run_result_script
from http_server import MASK_FLAGS, running_server
from mask_invariants import mask_problems

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "parallel_generation.py"
TWO_WORKERS = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def run_layout(model: str, env: dict[str, str], *args: str) -> dict:
    env = {**env, **TWO_WORKERS, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc
    return run_result_script(SCRIPT, env, model, *args)


def test_tensor_parallel_rows_on_model_runner_v2(tiny_model_dir: str,
                                                  subprocess_env: dict) -> None:
    out = run_layout(tiny_model_dir, subprocess_env, "--tensor-parallel-size", "2")
    assert out["use_v2_model_runner"] and len(out["runners"]) == 2, out
    assert out["rows"] == out["tokens"] > 0 and out["problems"] == [], out


def test_pipeline_parallel_rows_on_the_v1_runner(tiny_model_dir: str,
                                                 subprocess_env: dict) -> None:
    env = {**subprocess_env, "VLLM_USE_V2_MODEL_RUNNER": "0"}
    out = run_layout(tiny_model_dir, env, "--pipeline-parallel-size", "2")
    assert not out["use_v2_model_runner"] and len(out["runners"]) == 2, out
    assert out["rows"] == out["tokens"] > 0 and out["problems"] == [], out


def test_data_parallel_server_rows_from_both_engines(tiny_model_dir: str,
                                                     subprocess_env: dict) -> None:
    vocab = json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    flags = (*MASK_FLAGS, "--dtype", "float32", "--data-parallel-size", "2")
    with running_server(tiny_model_dir, {**subprocess_env, **TWO_WORKERS}, flags) as server:
        def generate(i: int) -> dict:
            body = {"token_ids": [5 + i, 6, 7, 8], "sampling_params": {
                "temperature": 1.0, "top_k": 10 + i, "top_p": [1.0, 0.9][i % 2],
                "max_tokens": 10, "seed": i}}
            with server.client() as client:
                response = client.post("/inference/v1/generate", json=body)
            assert response.status_code == 200, response.text
            return response.json()

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            choices = [c for body in pool.map(generate, range(8)) for c in body["choices"]]
        finished = server.finished_by_engine()
    assert len(choices) == 8
    for choice in choices:
        assert len(choice["token_ids"]) == 10
        assert mask_problems(choice["token_ids"], choice["sampling_mask"], vocab) == []
    assert sorted(finished) == ["0", "1"] and all(n > 0 for n in finished.values()), finished
