"""vLLM entry points. Both install the same patch list; installing twice is a no-op.

- ``vllm.platform_plugins`` ``register_early``: runs when vLLM first resolves its platform, in
  every process, before ``EngineArgs`` exists, so ``LLM(model, return_sampling_mask=True)``
  works with no import in user code. It selects no platform (returns ``None``).
- ``vllm.general_plugins`` ``register``: vLLM's documented hook (frontend, engine core, every
  worker).

Neither raises on a vLLM other than 0.26.x (vLLM does not catch general-plugin errors: every
engine of the process would fail, switch on or off). There they warn once per process and install
only the version guard (``Patch.version_guard``), which calls vLLM's own code unless the switch is
on, and then refuses the engine at start with a ``ValueError`` naming the version.
"""

from __future__ import annotations

import logging

from vllm_sampling_mask.patching import UnsupportedVllmVersionError, apply_patches, check_vllm_version

logger = logging.getLogger("vllm_sampling_mask")
_warned_versions: set[str] = set()


def installed_vllm_version() -> str:
    """The running vLLM's version string."""
    from vllm import version

    return version.__version__


def check_installed_vllm_version() -> None:
    """Raise ``UnsupportedVllmVersionError`` (a ``ValueError``) unless the running vLLM is one
    the patches were written for."""
    check_vllm_version(installed_vllm_version())


def register() -> None:
    """``vllm.general_plugins`` entry point: install every patch on a supported vLLM; on another,
    warn once and install only the version guard."""
    from vllm_sampling_mask.patches import PATCHES

    try:
        check_installed_vllm_version()
    except UnsupportedVllmVersionError as exc:
        if str(exc) not in _warned_versions:
            _warned_versions.add(str(exc))
            logger.warning("%s The plugin is inactive: vLLM runs as installed, and an engine "
                           "started with return_sampling_mask is refused.", exc)
        apply_patches([patch for patch in PATCHES if patch.version_guard])
        return
    apply_patches(PATCHES)


def register_early() -> None:
    """``vllm.platform_plugins`` entry point: install patches early; select no platform."""
    register()
    return None
