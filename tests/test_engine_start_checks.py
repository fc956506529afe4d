"""Engine start: the runner a mask engine gets, and the ValueErrors of create_engine_config (before
any model loads)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_sampling_mask.config import SamplingMaskConfig
from vllm_sampling_mask_testing.logits_processors import PROCESSOR

GOOD = dict(return_sampling_mask=True, logprobs_mode="processed_logprobs", enforce_eager=True,
            max_model_len=256)


def engine_config(model: str, **overrides):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, **{**GOOD, **overrides}).create_engine_config()


@pytest.mark.parametrize(
    ("overrides", "env", "v2"),
    [
        ({}, None, True),
        ({"logits_processors": [PROCESSOR]}, None, False),
        ({"enable_prompt_embeds": True}, None, False),
        ({"enforce_eager": False, "compilation_config": {"mode": 1}}, None, False),  # stock compile
        ({}, "0", False),
        ({}, "1", True),
    ],
    ids=["dense", "logits_processors", "prompt_embeds", "stock_torch_compile", "env_0", "env_1"],
)
def test_a_mask_engine_runs_the_runner_vllm_picks(
        tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch, overrides: dict, env: str | None,
        v2: bool) -> None:
    """Masks are captured in both runners: the switch neither forces MRV2 nor refuses what
    vLLM runs on V1 (custom logits processors, prompt embeds, ...), and
    ``VLLM_USE_V2_MODEL_RUNNER`` is honoured both ways."""
    from vllm.engine.arg_utils import EngineArgs

    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    vllm_config = engine_config(tiny_model_dir, **overrides)
    assert SamplingMaskConfig.of(vllm_config).enabled
    assert vllm_config.use_v2_model_runner is v2
    stock = EngineArgs(model=tiny_model_dir, **{**GOOD, "return_sampling_mask": False,
                                                **overrides}).create_engine_config()
    assert stock.use_v2_model_runner is v2


def test_forcing_mrv2_on_a_config_it_cannot_run_is_vllms_own_error(
        tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="custom logits processors"):
        engine_config(tiny_model_dir, logits_processors=[PROCESSOR])


def test_engines_built_from_a_vllm_config_are_checked_too(tiny_model_dir: str) -> None:
    """``LLMEngine(vllm_config, ...)`` without ``EngineArgs`` (RL frameworks do this): the same
    start checks, before anything starts."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    vllm_config = EngineArgs(model=tiny_model_dir, enforce_eager=True,
                             max_model_len=256).create_engine_config()  # raw_logprobs
    vllm_config.additional_config = {"return_sampling_mask": True}
    with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs"):
        LLMEngine(vllm_config, executor_class=None, log_stats=False)


def test_keyword_and_additional_config_are_the_same_switch(tiny_model_dir: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    by_keyword = EngineArgs(model=tiny_model_dir, return_sampling_mask=True)
    by_config = EngineArgs(model=tiny_model_dir, additional_config={"return_sampling_mask": True})
    assert by_keyword.additional_config == by_config.additional_config == {"return_sampling_mask": True}
    assert EngineArgs(model=tiny_model_dir).additional_config == {}


def test_logprobs_mode_other_than_processed_is_rejected(tiny_model_dir: str) -> None:
    with pytest.raises(ValueError, match=r"--logprobs-mode processed_logprobs.*'raw_logprobs'"):
        engine_config(tiny_model_dir, logprobs_mode="raw_logprobs")


NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}


def test_speculative_decoding_on_the_v1_runner_is_accepted(tiny_model_dir: str) -> None:
    config = engine_config(tiny_model_dir, speculative_config=NGRAM)
    assert config.speculative_config.method == "ngram" and not config.use_v2_model_runner


def test_speculative_decoding_on_model_runner_v2_is_accepted(
        tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import VllmConfig

    from vllm_sampling_mask.engine.arg_utils import check_vllm_config

    config = engine_config(tiny_model_dir, speculative_config=NGRAM)
    # As an EAGLE / MTP config runs (this tiny model has no draft head to build one with).
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    check_vllm_config(config)


@pytest.mark.parametrize("method", ["synthetic", "block"])
def test_rejection_methods_other_than_standard_are_rejected(tiny_model_dir: str,
                                                            method: str) -> None:
    from vllm_sampling_mask.engine.arg_utils import check_vllm_config

    config = engine_config(tiny_model_dir, speculative_config=NGRAM)
    config.speculative_config.rejection_sample_method = method
    with pytest.raises(ValueError, match=rf"rejection_sample_method 'standard'.*{method!r}"):
        check_vllm_config(config)


def test_diffusion_models_are_rejected(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.model import ModelConfig

    monkeypatch.setattr(ModelConfig, "is_diffusion", property(lambda self: True))
    with pytest.raises(ValueError, match="diffusion"):
        engine_config(tiny_model_dir)


def test_rust_frontend_is_rejected(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    with pytest.raises(ValueError, match="VLLM_USE_RUST_FRONTEND"):
        engine_config(tiny_model_dir)


def test_bad_additional_config_values_are_rejected(tiny_model_dir: str) -> None:
    with pytest.raises(ValueError, match="return_sampling_mask.*bool"):
        engine_config(tiny_model_dir, return_sampling_mask=None,
                      additional_config={"return_sampling_mask": "yes"})
    with pytest.raises(ValueError, match="sampling_mask_max_width"):
        engine_config(tiny_model_dir, additional_config={"sampling_mask_max_width": 0})
    with pytest.raises(ValueError, match="sampling_mask_allow_top_p_only.*bool"):
        engine_config(tiny_model_dir, additional_config={"sampling_mask_allow_top_p_only": 1})


def test_flag_off_changes_nothing_in_config(tiny_model_dir: str) -> None:
    from vllm.engine.arg_utils import EngineArgs

    vllm_config = EngineArgs(model=tiny_model_dir, logprobs_mode="raw_logprobs",
                             enforce_eager=True).create_engine_config()
    assert not SamplingMaskConfig.of(vllm_config).enabled


def test_a_non_dict_additional_config_is_a_switch_off_engine(tiny_model_dir: str) -> None:
    """vLLM also accepts any hashable object as ``additional_config``: it holds none of our keys."""
    from vllm.engine.arg_utils import EngineArgs

    class PlatformSettings:
        def compute_hash(self) -> str:
            return "settings"

    vllm_config = EngineArgs(model=tiny_model_dir, enforce_eager=True,
                             additional_config=PlatformSettings()).create_engine_config()
    assert not SamplingMaskConfig.of(vllm_config).enabled


def test_cli_lists_the_flag_and_its_upstream_spelling(subprocess_env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--help=all"],
        capture_output=True, text=True, env=subprocess_env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    help_text = " ".join(result.stdout.split()).replace("- ", "-")  # argparse wraps lines
    assert "--return-sampling-mask, --enable-return-sampling-mask" in help_text
    assert "Upstream vLLM's docs spell the same switch --enable-return-sampling-mask." in help_text


def test_cli_flag_reaches_additional_config(tiny_model_dir: str) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", tiny_model_dir, "--return-sampling-mask"])
    assert AsyncEngineArgs.from_cli_args(args).additional_config["return_sampling_mask"] is True
    args = parser.parse_args(["--model", tiny_model_dir])
    assert "return_sampling_mask" not in AsyncEngineArgs.from_cli_args(args).additional_config
