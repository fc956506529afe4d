"""Scripts written for upstream vLLM (>= 0.28) run unchanged: its module, its switch spellings."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_sampling_mask_import():
    # Upstream's own test (tests/test_outputs.py), unchanged.
    from vllm.sampling_mask import SamplingMask
    from vllm.outputs import SamplingMask as S2

    assert SamplingMask is S2


def run_fresh(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_upstream_module_is_the_first_import_of_a_fresh_interpreter(subprocess_env: dict) -> None:
    result = run_fresh("""
        from vllm.sampling_mask import SamplingMask
        import vllm
        import vllm.outputs
        assert SamplingMask is vllm.outputs.SamplingMask is vllm.sampling_mask.SamplingMask
        assert SamplingMask(token_ids=[[1, 5], [2]]).token_ids == [[1, 5], [2]]
        print("OK", getattr(vllm.sampling_mask, "__file__", None))
    """, subprocess_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["OK", "None"]  # no file written into vLLM's package


def test_upstream_module_comes_from_the_plugin(subprocess_env: dict) -> None:
    # With the plugin excluded by vLLM's allowlist the module does not exist: vLLM's installed
    # package is untouched.
    env = {**subprocess_env, "VLLM_PLUGINS": "sampling_mask_test_cpu"}
    result = run_fresh("import vllm.sampling_mask", env)
    assert result.returncode == 1
    assert "No module named 'vllm.sampling_mask'" in result.stderr
