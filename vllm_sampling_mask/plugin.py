"""vLLM entry points. Both install the same patch list; installing twice is a no-op.

- ``vllm.platform_plugins`` ``register_early``: runs when vLLM first resolves its platform, in
  every process, before ``EngineArgs`` exists, so ``LLM(model, return_sampling_mask=True)``
  works with no import in user code. It selects no platform (returns ``None``), and since vLLM
  swallows platform-plugin errors it only logs a version mismatch.
- ``vllm.general_plugins`` ``register``: vLLM's documented hook (frontend, engine core, every
  worker); it raises on an unsupported vLLM.
"""

from __future__ import annotations

import logging

from vllm_sampling_mask.patching import UnsupportedVllmVersionError, apply_patches, check_vllm_version

logger = logging.getLogger("vllm_sampling_mask")


def installed_vllm_version() -> str:
    """The running vLLM's version string."""
    from vllm import version

    return version.__version__


def register() -> None:
    """``vllm.general_plugins`` entry point: check the version, install every patch."""
    from vllm_sampling_mask.patches import PATCHES

    check_vllm_version(installed_vllm_version())
    apply_patches(PATCHES)


def register_early() -> None:
    """``vllm.platform_plugins`` entry point: install patches early; select no platform."""
    try:
        register()
    except UnsupportedVllmVersionError as exc:
        logger.error("%s", exc)
    return None
