"""Run a test module with a C loop and with its Python reference alone.

The plugin's per-output loops in C (optional extensions, ``setup.py``) are module attributes
that are ``None`` where not built, and the Python loop runs then; a test module that drives one
of them gets ``loop_fixture(module, attr)`` as an autouse fixture, so that each of its tests runs
twice: ``native`` (skipped where not built) and ``python`` (the attribute set to ``None``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest


def loop_fixture(module: ModuleType, attr: str) -> Any:
    """An autouse fixture, parametrized ``native`` / ``python``, for ``module.attr``'s loop."""

    @pytest.fixture(autouse=True, params=["native", "python"])
    def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
        if request.param == "python":
            monkeypatch.setattr(module, attr, None)
        elif getattr(module, attr) is None:
            pytest.skip(f"{module.__name__}.{attr} (a C loop) is not built here")
        return request.param

    return loop
