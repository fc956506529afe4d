"""The plugin as a user meets it: a fresh interpreter, no import of ours, vLLM's entry points only."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine_cases import run_result_script

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "seeded_generation.py"
TEST_PLATFORM_PLUGIN = "sampling_mask_test_cpu"


def run_user_script(model: str, env: dict[str, str], *args: str, plugins: str | None = None) -> dict:
    env = {**env, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc with a function
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    return run_result_script(SCRIPT, env, model, *args)


def test_llm_keyword_starts_model_runner_v2_with_masks(tiny_model_dir: str, subprocess_env: dict) -> None:
    out = run_user_script(tiny_model_dir, subprocess_env, "--mask")
    assert out["imported_our_package_before_vllm"] is False
    [runner] = out["runner"]
    assert runner["is_model_runner_v2"], runner
    assert runner["mask_capture_attached"] and runner["sampler_uses_flashinfer"] is False
    assert runner["sampler_attributes_in_a_dict"] is False  # CPython's fast layout kept
    for tokens, rows in zip(out["token_ids"], out["sampling_mask"]):
        assert len(rows) == len(tokens) and all(t in r for t, r in zip(tokens, rows))


def test_flag_off_generation_is_identical_with_and_without_the_plugin(
        tiny_model_dir: str, subprocess_env: dict) -> None:
    # The two interpreters run side by side (each mostly waits on one core at its start).
    with ThreadPoolExecutor(2) as pool:
        without_run = pool.submit(run_user_script, tiny_model_dir, subprocess_env,
                                  plugins=TEST_PLATFORM_PLUGIN)
        with_run = pool.submit(run_user_script, tiny_model_dir, subprocess_env,
                               plugins=f"{TEST_PLATFORM_PLUGIN},sampling_mask")
        without, with_plugin = without_run.result(), with_run.result()
    assert without["applied_patches"] == []
    assert "vllm.engine.arg_utils:EngineArgs.__init__" in with_plugin["applied_patches"]
    assert with_plugin["token_ids"] == without["token_ids"]
    # Same tokens and logprobs; CPU matmuls may differ in the last float32 bit between two
    # processes (thread scheduling), so logprobs are compared to 1e-5.
    for got_seq, want_seq in zip(with_plugin["logprobs"], without["logprobs"], strict=True):
        for got, want in zip(got_seq, want_seq, strict=True):
            assert got.keys() == want.keys()
            assert all(abs(got[k] - want[k]) <= 1e-5 for k in got), (got, want)
    assert with_plugin["sampling_mask"] == without["sampling_mask"] == [None] * 4
    assert with_plugin["runner"][0]["mask_capture_attached"] is False
    # The sampler's wrappers (every engine's) leave its attributes where stock keeps them.
    assert (with_plugin["runner"][0]["sampler_attributes_in_a_dict"]
            is without["runner"][0]["sampler_attributes_in_a_dict"] is False)
