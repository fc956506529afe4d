"""``vllm.platform_plugins`` entry point that selects vLLM's CPU platform when asked.

With vLLM's CUDA wheel on a machine without a GPU, vLLM detects no platform. When
``VLLM_SAMPLING_MASK_TEST_CPU=1`` this plugin selects ``CpuPlatform`` and, in the same process,
makes Model Runner V2 runnable under ``TRITON_INTERPRET=1`` (set, with ``CUDA_VISIBLE_DEVICES=""``,
before vLLM is imported; ``cpu_test_env()`` returns them):

- ``libdevice.log1p`` (vLLM's Gumbel sampler) is ``None`` in the interpreter: replaced by plain
  ``tl`` math;
- vLLM's Triton top-k/top-p kernel does not run in the interpreter: ``HAS_TRITON = False`` in
  ``vllm.v1.sample.ops.topk_topp_sampler`` routes top-k/top-p to vLLM's PyTorch implementation
  (which keeps top-k boundary ties, so rows may be wider than top_k);
- the readers and writers of vLLM's shared-memory queues (an engine core waiting on its workers,
  workers waiting for the next step) spin on ``sched_yield`` while they wait (a reader for up to
  1 s after its last read, then it sleeps on a socket): on a 2-core CI machine a spinning engine
  core takes the core its API server or a second worker needs. Here each turn of the loop sleeps
  1 ms instead (a CPU engine step takes tens of ms).
  (Sleeping on the notify socket at once, ``busy_loop_s=0``, stalled the pipeline-parallel
  test: its steps waited out the 60 s read timeout.)

The environment also keeps ``humming`` (imported by vLLM's quantization utilities in every vLLM
process) from starting its two background CUDA builds at each import: without CUDA the launcher
build never succeeds, so every process paid for two more interpreters importing torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from vllm_sampling_mask_testing.held_steps import ENV_HELD_STEPS

ENV_FLAG = "VLLM_SAMPLING_MASK_TEST_CPU"


def cpu_test_env() -> dict[str, str]:
    """Environment for a process (or subprocess) that runs vLLM on CPU with MRV2."""
    return {
        ENV_FLAG: "1",
        "CUDA_VISIBLE_DEVICES": "",
        "TRITON_INTERPRET": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "2",
        "HUMMING_DISABLE_PARALLEL_BUILD": "1",
        # held rows of FINAL_ONLY requests leave the engine core mid-request too (held_steps.py)
        ENV_HELD_STEPS: "5",
    }


def cpu_platform_if_requested() -> str | None:
    if os.environ.get(ENV_FLAG) != "1":
        return None
    _install_interpreter_shims()
    return "vllm.platforms.cpu.CpuPlatform"


def _install_interpreter_shims() -> None:
    import triton.language.extra.libdevice as libdevice

    from vllm_sampling_mask_testing import interpreter_shims

    if getattr(libdevice, "_sampling_mask_shimmed", False):
        return
    libdevice.log1p = interpreter_shims.log1p
    libdevice.isnan = interpreter_shims.isnan
    libdevice._sampling_mask_shimmed = True

    from vllm_sampling_mask.patching import Patch, apply_patches

    apply_patches([
        Patch(
            target="vllm.v1.sample.ops.topk_topp_sampler:HAS_TRITON",
            make="vllm_sampling_mask_testing.cpu_platform:_no_triton_top_k_top_p",
            why="vLLM's Triton top-k/top-p kernel fails in the interpreter; use its torch path.",
            process="all (tests only)",
            remove_when="never (test support)",
        ),
        Patch(
            target="vllm.distributed.utils:sched_yield",
            also_bound_in=("vllm.distributed.device_communicators.shm_broadcast",),
            make="vllm_sampling_mask_testing.cpu_platform:_sleep_a_millisecond",
            why="Spinning shared-memory queue loops take a 2-core CI machine's second core from "
                "the process they wait for; sleep 1 ms per turn instead.",
            process="all (tests only)",
            remove_when="never (test support)",
        ),
    ])


def _no_triton_top_k_top_p(original: bool) -> bool:
    return False


def _sleep_a_millisecond(original: Callable[[], None]) -> Callable[[], None]:
    def sched_yield() -> None:
        time.sleep(0.001)

    return sched_yield
