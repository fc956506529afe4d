"""Scripts written for upstream vLLM (>= 0.28) run unchanged: its module, its switch spellings."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


# Upstream's own test (tests/test_outputs.py), unchanged.
def test_sampling_mask_import():
    from vllm.sampling_mask import SamplingMask
    from vllm.outputs import SamplingMask as S2

    assert SamplingMask is S2


def run_fresh(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.parametrize("platform", ["test platform", "whatever vLLM detects"])
def test_upstream_module_is_the_first_import_of_a_fresh_interpreter(subprocess_env: dict,
                                                                    platform: str) -> None:
    env = dict(subprocess_env)
    if platform != "test platform":
        env.pop("VLLM_SAMPLING_MASK_TEST_CPU", None)  # no platform on a CPU machine: no matter
    result = run_fresh("""
        from vllm.sampling_mask import SamplingMask
        import vllm
        import vllm.outputs
        assert SamplingMask is vllm.outputs.SamplingMask is vllm.sampling_mask.SamplingMask
        assert SamplingMask(token_ids=[[1, 5], [2]]).token_ids == [[1, 5], [2]]
        print("OK", getattr(vllm.sampling_mask, "__file__", None))
    """, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-2:] == ["OK", "None"]  # no file written into vLLM's package


def test_upstream_module_comes_from_the_plugin(subprocess_env: dict) -> None:
    # With the plugin excluded by vLLM's allowlist the module does not exist: vLLM's installed
    # package is untouched.
    env = {**subprocess_env, "VLLM_PLUGINS": "sampling_mask_test_cpu"}
    result = run_fresh("import vllm.sampling_mask", env)
    assert result.returncode == 1
    assert "No module named 'vllm.sampling_mask'" in result.stderr


@pytest.mark.parametrize("engine_args_class", ["EngineArgs", "AsyncEngineArgs"])
@pytest.mark.parametrize("keywords", [
    {"enable_return_sampling_mask": True},
    {"return_sampling_mask": True},
    {"return_sampling_mask": True, "enable_return_sampling_mask": True},
    {"enable_return_sampling_mask": False},
])
def test_both_keyword_spellings_are_the_switch(tiny_model_dir: str, engine_args_class: str,
                                               keywords: dict[str, bool]) -> None:
    import vllm.engine.arg_utils

    engine_args = getattr(vllm.engine.arg_utils, engine_args_class)(model=tiny_model_dir,
                                                                     **keywords)
    assert engine_args.additional_config == {"return_sampling_mask": next(iter(keywords.values()))}


@pytest.mark.parametrize("keywords, message", [
    ({"return_sampling_mask": True, "enable_return_sampling_mask": False},
     "return_sampling_mask and enable_return_sampling_mask are two spellings of one switch and "
     "must agree, got True and False. Pass only one of them."),
    ({"enable_return_sampling_mask": "yes"}, "enable_return_sampling_mask must be a bool, got 'yes'."),
])
def test_conflicting_or_non_bool_keywords_are_refused(tiny_model_dir: str, keywords: dict,
                                                      message: str) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    for engine_args_class in (EngineArgs, AsyncEngineArgs):
        with pytest.raises(ValueError) as error:
            engine_args_class(model=tiny_model_dir, **keywords)
        assert str(error.value) == message


class _EngineArgsSeen(Exception):
    pass


def test_llm_takes_upstreams_keyword(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.entrypoints.llm
    from vllm import LLM

    def capture(engine_args, **kwargs):
        raise _EngineArgsSeen(engine_args)

    monkeypatch.setattr(vllm.entrypoints.llm.LLMEngine, "from_engine_args", capture)
    with pytest.raises(_EngineArgsSeen) as seen:
        LLM(tiny_model_dir, enable_return_sampling_mask=True, logprobs_mode="processed_logprobs")
    assert seen.value.args[0].additional_config == {"return_sampling_mask": True}
    with pytest.raises(ValueError, match="must agree"):
        LLM(tiny_model_dir, enable_return_sampling_mask=True, return_sampling_mask=False)


@pytest.mark.parametrize("flag", ["--return-sampling-mask", "--enable-return-sampling-mask"])
def test_both_cli_spellings_are_the_switch(tiny_model_dir: str, flag: str) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", tiny_model_dir, flag])
    assert AsyncEngineArgs.from_cli_args(args).additional_config == {"return_sampling_mask": True}
