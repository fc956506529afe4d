"""``vllm.general_plugins`` entry point: a mask engine core that sends held rows every few steps.

The engine core holds the rows of FINAL_ONLY requests without stop strings and sends them every
``HELD_STEPS`` (64) steps and with the last output. CPU generations run a few dozen steps at
most, so with 64 they seldom send rows mid-request. With ``VLLM_SAMPLING_MASK_TEST_HELD_STEPS``
set (``cpu_test_env()`` sets it), every engine process started by ``multiprocessing`` (the engine
core, workers) uses that many steps instead: the CPU end-to-end tests then cross mid-request
flushes too. The test process itself (no parent process) keeps 64, which its unit tests assume,
and a process whose ``VLLM_PLUGINS`` leaves the plugin out (stock engines) imports nothing of it.
"""

from __future__ import annotations

import multiprocessing
import os

ENV_HELD_STEPS = "VLLM_SAMPLING_MASK_TEST_HELD_STEPS"
PLUGIN_NAME = "sampling_mask"  # the package's entry points (pyproject.toml)


def held_steps_if_requested() -> None:
    steps = os.environ.get(ENV_HELD_STEPS)
    allowed = os.environ.get("VLLM_PLUGINS")
    if not steps or multiprocessing.parent_process() is None:
        return
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        return
    from vllm_sampling_mask.core import scheduler

    scheduler.HELD_STEPS = int(steps)
