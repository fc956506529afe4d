"""Front-end switch and engine-start checks (extends ``vllm/engine/arg_utils.py``).

``--return-sampling-mask`` / ``EngineArgs(return_sampling_mask=True)`` /
``LLM(..., return_sampling_mask=True)`` all fold into ``additional_config["return_sampling_mask"]``,
the only config channel that reaches every process. ``create_engine_config`` then rejects, with a
``ValueError`` before any model is loaded, every configuration whose masks would be wrong or lost.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

from vllm_sampling_mask.config import ENABLE_KEY, REQUIRED_LOGPROBS_MODE, SamplingMaskConfig

CLI_FLAG = "--return-sampling-mask"
CLI_HELP = (
    "Return, for every generated token, the ascending vocabulary ids that survived sampling "
    "filters (logit bias, penalties, bad words, temperature, min-p, top-k/top-p) as "
    "`sampling_mask` (vllm-sampling-mask plugin). Requires Model Runner V2 and "
    f"--logprobs-mode {REQUIRED_LOGPROBS_MODE}; requests must use temperature > 0 and top_k > 0 "
    "(or top_p < 1 with --additional-config '{\"sampling_mask_allow_top_p_only\": true}')."
)
_MRV2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def fold_flag(engine_args: Any, enabled: bool) -> None:
    """Write the switch into ``engine_args.additional_config`` (a fresh dict: never shared)."""
    engine_args.additional_config = {**(engine_args.additional_config or {}), ENABLE_KEY: enabled}


def wrap_init(original: Any) -> Any:
    """``EngineArgs.__init__`` accepting ``return_sampling_mask`` (LLM passes kwargs straight in)."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, return_sampling_mask: bool | None = None, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if return_sampling_mask is not None:
            if not isinstance(return_sampling_mask, bool):
                raise ValueError(f"return_sampling_mask must be a bool, got {return_sampling_mask!r}.")
            fold_flag(self, return_sampling_mask)

    return __init__


def wrap_add_cli_args(original: staticmethod) -> staticmethod:
    """``EngineArgs.add_cli_args`` plus ``--return-sampling-mask`` (shown in ``vllm serve --help``)."""
    add_cli_args = original.__func__

    @functools.wraps(add_cli_args)
    def wrapped(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = add_cli_args(parser, *args, **kwargs)
        if not any(CLI_FLAG in action.option_strings for action in parser._actions):
            parser.add_argument(CLI_FLAG, action="store_true", default=False, help=CLI_HELP)
        return parser

    return staticmethod(wrapped)


def wrap_from_cli_args(original: classmethod) -> classmethod:
    """``EngineArgs.from_cli_args`` carrying our flag (it keeps only dataclass fields)."""
    from_cli_args = original.__func__

    @functools.wraps(from_cli_args)
    def wrapped(cls: type, args: argparse.Namespace) -> Any:
        engine_args = from_cli_args(cls, args)
        if getattr(args, "return_sampling_mask", False):
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
        _refuse_v1_runner_env()
        try:
            vllm_config = original(self, *args, **kwargs)
        except ValueError as exc:
            if "Model Runner V2" in str(exc):
                raise ValueError(
                    f"{CLI_FLAG} needs Model Runner V2, which cannot run this configuration: "
                    f"{exc}"
                ) from exc
            raise
        check_vllm_config(vllm_config)
        return vllm_config

    return create_engine_config


def _refuse_v1_runner_env() -> None:
    """An explicit ``VLLM_USE_V2_MODEL_RUNNER=0`` contradicts the switch: say so."""
    value = os.environ.get(_MRV2_ENV)
    if value is not None and value.strip().lower() in ("0", "false"):
        raise ValueError(
            f"{CLI_FLAG} requires Model Runner V2, but {_MRV2_ENV}={value} selects the V1 runner. "
            f"Unset {_MRV2_ENV} or set it to 1."
        )


def wrap_use_v2_model_runner(original: property) -> property:
    """``VllmConfig.use_v2_model_runner``: True for a mask engine, in every process.

    vLLM 0.26 reads ``VLLM_USE_V2_MODEL_RUNNER`` and otherwise falls back to the V1 runner for
    some configurations, silently; our sampler hook exists in V2 only. Deciding from the config
    (which every engine process receives) instead of setting the variable leaves other engines
    of the process as stock, and V2's own validation still refuses configurations it can't run.
    """
    stock = original.fget

    @functools.wraps(stock)
    def use_v2_model_runner(self: Any) -> bool:
        return SamplingMaskConfig.of(self).enabled or stock(self)

    return property(use_v2_model_runner)


def check_engine_args(engine_args: Any) -> None:
    """Checks that need only the arguments (before vLLM builds, and maybe rejects, a config)."""
    if os.environ.get("VLLM_USE_RUST_FRONTEND", "0").strip() not in ("", "0"):
        raise ValueError(
            f"{CLI_FLAG} is not supported with VLLM_USE_RUST_FRONTEND=1: the Rust frontend "
            "bypasses the Python output path that carries the masks. Unset VLLM_USE_RUST_FRONTEND."
        )
    if engine_args.speculative_config:
        _reject_speculative_decoding(engine_args.speculative_config)
    if engine_args.logits_processors:
        _reject_logits_processors(engine_args.logits_processors)


def _reject_speculative_decoding(speculative_config: Any) -> None:
    method = (speculative_config.get("method") if isinstance(speculative_config, dict)
              else getattr(speculative_config, "method", None))
    raise ValueError(
        f"{CLI_FLAG} does not support speculative decoding (got --speculative-config with "
        f"method {method!r}): rejection sampling does not draw from the filtered distribution a "
        "mask records. Remove --speculative-config."
    )


def _reject_logits_processors(logits_processors: Any) -> None:
    raise ValueError(
        f"{CLI_FLAG} does not support engine-level custom logits processors (got "
        f"--logits-processors {logits_processors}): they make vLLM 0.26 use the V1 model "
        "runner, where masks are not captured. Remove --logits-processors."
    )


def check_vllm_config(vllm_config: Any) -> None:
    """Raise ``ValueError`` if an engine with masks on would return wrong or no masks."""
    model_config = vllm_config.model_config
    if vllm_config.speculative_config is not None:
        _reject_speculative_decoding(vllm_config.speculative_config)
    if getattr(model_config, "is_diffusion", False):
        raise ValueError(
            f"{CLI_FLAG} does not support diffusion models ({model_config.model}): they do not "
            "sample one token per step from the filtered distribution."
        )
    if model_config.logits_processors:
        _reject_logits_processors(model_config.logits_processors)
    if model_config.logprobs_mode != REQUIRED_LOGPROBS_MODE:
        raise ValueError(
            f"{CLI_FLAG} requires --logprobs-mode {REQUIRED_LOGPROBS_MODE}, got "
            f"{model_config.logprobs_mode!r}: returned logprobs must be pi_old normalised over "
            f"the same kept set as the mask. Pass logprobs_mode=\"{REQUIRED_LOGPROBS_MODE}\"."
        )
    SamplingMaskConfig.of(vllm_config)  # validates the remaining keys
