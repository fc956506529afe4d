"""Front-end switch and engine-start checks (extends ``vllm/engine/arg_utils.py``).

``--return-sampling-mask`` / ``EngineArgs(return_sampling_mask=True)`` /
``LLM(..., return_sampling_mask=True)`` all fold into ``additional_config["return_sampling_mask"]``,
the only config channel that reaches every process. Upstream's docs spell the switch
``--enable-return-sampling-mask`` / ``enable_return_sampling_mask``: both spellings are accepted. ``create_engine_config`` then rejects, with a
``ValueError`` before any model is loaded, every configuration whose masks would be wrong or lost.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

from vllm_sampling_mask.config import ENABLE_KEY, REQUIRED_LOGPROBS_MODE, SamplingMaskConfig

CLI_FLAG = "--return-sampling-mask"
CLI_ALIAS = "--enable-return-sampling-mask"
KEYWORD = "return_sampling_mask"
KEYWORD_ALIAS = "enable_return_sampling_mask"
CLI_HELP = (
    "Return, for every generated token, the ascending vocabulary ids that survived sampling "
    "filters (logit bias, penalties, bad words, custom logits processors, temperature, min-p, "
    "top-k/top-p) as `sampling_mask` (vllm-sampling-mask plugin). Requires --logprobs-mode "
    f"{REQUIRED_LOGPROBS_MODE}; requests must use temperature > 0 and top_k > 0 "
    "(or top_p < 1 with --additional-config '{\"sampling_mask_allow_top_p_only\": true}'). "
    f"Upstream vLLM's docs spell the same switch {CLI_ALIAS}."
)


def fold_flag(engine_args: Any, enabled: bool) -> None:
    """Write the switch into ``engine_args.additional_config`` (a fresh dict: never shared)."""
    engine_args.additional_config = {**(engine_args.additional_config or {}), ENABLE_KEY: enabled}


def switch_from_keywords(return_sampling_mask: bool | None,
                         enable_return_sampling_mask: bool | None) -> bool | None:
    """The switch set by either spelling of the keyword (``None``: neither given).

    Raises ``ValueError`` on a non-bool value or on two values that disagree.
    """
    for name, value in ((KEYWORD, return_sampling_mask),
                        (KEYWORD_ALIAS, enable_return_sampling_mask)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}.")
    if (return_sampling_mask is not None and enable_return_sampling_mask is not None
            and return_sampling_mask != enable_return_sampling_mask):
        raise ValueError(
            f"{KEYWORD} and {KEYWORD_ALIAS} are two spellings of one switch and must agree, got "
            f"{return_sampling_mask} and {enable_return_sampling_mask}. Pass only one of them."
        )
    return return_sampling_mask if return_sampling_mask is not None else enable_return_sampling_mask


def wrap_init(original: Any) -> Any:
    """``EngineArgs.__init__`` accepting ``return_sampling_mask`` or its upstream spelling
    ``enable_return_sampling_mask`` (LLM passes kwargs straight in)."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, return_sampling_mask: bool | None = None,
                 enable_return_sampling_mask: bool | None = None, **kwargs: Any) -> None:
        enabled = switch_from_keywords(return_sampling_mask, enable_return_sampling_mask)
        original(self, *args, **kwargs)
        if enabled is not None:
            fold_flag(self, enabled)

    return __init__


def wrap_add_cli_args(original: staticmethod) -> staticmethod:
    """``EngineArgs.add_cli_args`` plus ``--return-sampling-mask`` and its alias
    ``--enable-return-sampling-mask`` (one option, shown in ``vllm serve --help``)."""
    add_cli_args = original.__func__

    @functools.wraps(add_cli_args)
    def wrapped(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = add_cli_args(parser, *args, **kwargs)
        if not any(CLI_FLAG in action.option_strings for action in parser._actions):
            parser.add_argument(CLI_FLAG, CLI_ALIAS, dest=KEYWORD, action="store_true",
                                default=False, help=CLI_HELP)
        return parser

    return staticmethod(wrapped)


def wrap_from_cli_args(original: classmethod) -> classmethod:
    """``EngineArgs.from_cli_args`` carrying our flag (it keeps only dataclass fields)."""
    from_cli_args = original.__func__

    @functools.wraps(from_cli_args)
    def wrapped(cls: type, args: argparse.Namespace) -> Any:
        engine_args = from_cli_args(cls, args)
        if getattr(args, KEYWORD, False):
            fold_flag(engine_args, True)
        return engine_args

    return classmethod(wrapped)


def wrap_create_engine_config(original: Any) -> Any:
    """``EngineArgs.create_engine_config`` with the engine-start checks of the switch. Also the
    version guard: the one patch installed on a vLLM other than 0.26.x, where it refuses the
    switch by version (``ValueError``) and otherwise calls vLLM's method."""
    from vllm_sampling_mask.plugin import check_installed_vllm_version

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not SamplingMaskConfig.from_additional_config(self.additional_config).enabled:
            return original(self, *args, **kwargs)
        check_installed_vllm_version()
        check_engine_args(self)
        vllm_config = original(self, *args, **kwargs)
        check_vllm_config(vllm_config)
        return vllm_config

    return create_engine_config


def check_engine_args(engine_args: Any) -> None:
    """Checks that need only the arguments (before vLLM builds, and maybe rejects, a config)."""
    if os.environ.get("VLLM_USE_RUST_FRONTEND", "0").strip() not in ("", "0"):
        raise ValueError(
            f"{CLI_FLAG} is not supported with VLLM_USE_RUST_FRONTEND=1: the Rust frontend "
            "bypasses the Python output path that carries the masks. Unset VLLM_USE_RUST_FRONTEND."
        )


def check_vllm_config(vllm_config: Any) -> None:
    """Raise ``ValueError`` if an engine with masks on would return wrong or no masks."""
    model_config = vllm_config.model_config
    speculative_config = vllm_config.speculative_config
    method = getattr(speculative_config, "rejection_sample_method", "standard")
    if speculative_config is not None and method != "standard":
        raise ValueError(
            f"{CLI_FLAG} requires rejection_sample_method 'standard' in --speculative-config, "
            f"got {method!r}: 'synthetic' accepts draft tokens at fixed rates whatever the "
            "target distribution (an accepted token may lie outside its row), and 'block' "
            "accepts drafts by their joint ratio, which this plugin has not verified keeps "
            "every accepted token inside its position's row."
        )
    if getattr(model_config, "is_diffusion", False):
        raise ValueError(
            f"{CLI_FLAG} does not support diffusion models ({model_config.model}): they do not "
            "sample one token per step from the filtered distribution."
        )
    if model_config.logprobs_mode != REQUIRED_LOGPROBS_MODE:
        raise ValueError(
            f"{CLI_FLAG} requires --logprobs-mode {REQUIRED_LOGPROBS_MODE}, got "
            f"{model_config.logprobs_mode!r}: returned logprobs must be pi_old normalised over "
            f"the same kept set as the mask. Pass logprobs_mode=\"{REQUIRED_LOGPROBS_MODE}\"."
        )
    SamplingMaskConfig.of(vllm_config)  # validates the remaining keys
