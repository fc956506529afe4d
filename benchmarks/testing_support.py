"""The test-support package (``tests/support``: the CPU test platform, the server helper) for the
benchmark scripts: installed (``pip install -e tests/support``) or straight from this checkout
(e.g. on the GPU machine, where only the plugin is installed)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType


def testing_module(name: str) -> ModuleType:
    """``vllm_sampling_mask_testing.<name>``."""
    try:
        return importlib.import_module(f"vllm_sampling_mask_testing.{name}")
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
        return importlib.import_module(f"vllm_sampling_mask_testing.{name}")
