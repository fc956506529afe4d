"""Start the offline engine of a CPU test, with one more try if its engine core died starting."""

from __future__ import annotations

import warnings
from typing import Any

ENGINE_START_FAILURE = "Engine core initialization failed"
"""vLLM's error when the engine core process exits before it is ready (the root cause is what
that process printed)."""


def start_llm(*args: Any, **kwargs: Any) -> Any:
    """``vllm.LLM(*args, **kwargs)``, built a second time if the first engine core died starting.

    On a busy machine running two pytest workers, an engine core can die starting for reasons
    outside the test. One: vLLM picks its torch.distributed port by binding a free port and
    releasing it (``get_open_port``), and any process of the machine can take the port before
    the engine core binds it again (vLLM's own data-parallel group start retries for this). The
    failed try is reported as a warning; a failure that repeats fails the test.
    """
    from vllm import LLM

    try:
        return LLM(*args, **kwargs)
    except RuntimeError as first:
        if ENGINE_START_FAILURE not in str(first):
            raise
        warnings.warn(f"vLLM's engine core died starting; one more try: {first}", stacklevel=2)
        return LLM(*args, **kwargs)
