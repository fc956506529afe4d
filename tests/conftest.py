"""Test harness: CPU platform forcing, the tiny model fixture, the ``gpu`` marker, the grouping
of tests for parallel workers.

On a machine without an NVIDIA GPU every test process runs vLLM on its CPU platform with Model
Runner V2 (or vLLM's CPU subclass of the V1 runner, where vLLM picks V1) and Triton kernels under
the interpreter (see ``vllm_sampling_mask_testing.cpu_platform``). The
environment is set here, at collection time, before any test imports vLLM or Triton; subprocess
tests pass ``cpu_test_env()`` on. ``gpu`` tests are skipped without CUDA.

``scripts/test.sh`` runs the CPU suite on two pytest-xdist workers (``--dist loadgroup``): one
engine test mostly keeps one core busy, so two of them use a 2-core machine. Each module is one
group (its module-scoped engine starts once), and the modules on the shared mask server are one
group with it; modules that start engines are queued first, so the short ones fill the end.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def has_nvidia_gpu() -> bool:
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


HAS_GPU = has_nvidia_gpu()
if not HAS_GPU:
    from vllm_sampling_mask_testing.cpu_platform import cpu_test_env

    os.environ.update(cpu_test_env())


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        on_the_shared_server = "mask_server" in getattr(item, "fixturenames", ())
        group = "mask_server" if on_the_shared_server else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: "slow" not in item.keywords)  # stable: modules keep their order
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(pytestconfig: pytest.Config) -> str:
    """Tiny random Qwen2 + locally trained tokenizer, cached under the pytest cache dir (built by
    one parallel worker while the others wait)."""
    from filelock import FileLock

    from vllm_sampling_mask.tiny_model import build_tiny_model

    cache = Path(pytestconfig.cache.mkdir("vllm_sampling_mask_tiny_model"))
    with FileLock(f"{cache}.lock"):
        return str(build_tiny_model(cache))


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """Environment for subprocesses that run vLLM (CPU platform when there is no GPU)."""
    env = dict(os.environ)
    if not HAS_GPU:
        from vllm_sampling_mask_testing.cpu_platform import cpu_test_env

        env.update(cpu_test_env())
    return env


@pytest.fixture(scope="session")
def mask_server(tiny_model_dir: str, subprocess_env: dict[str, str]):
    """One ``vllm serve --return-sampling-mask`` (fp32: vLLM's min-p kernel does not run on
    bfloat16 logits in the Triton interpreter) shared by the HTTP endpoint and fuzz modules, so
    CI starts it once (~1 minute on a 2-core machine)."""
    from http_server import MASK_FLAGS, running_server

    with running_server(tiny_model_dir, subprocess_env, (*MASK_FLAGS, "--dtype", "float32")) as srv:
        yield srv
