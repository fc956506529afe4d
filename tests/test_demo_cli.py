"""Arguments of the main job's console script ``vllm-sampling-mask-demo``."""

from __future__ import annotations

import pytest

from vllm_sampling_mask.demo import parse_arguments


def test_model_first_then_options_and_vllm_serve_options() -> None:
    model, args, serve_args = parse_arguments(["/m", "--serve", "--port", "8001", "--top-k", "5"])
    assert (model, args.serve, args.top_k, serve_args) == ("/m", True, 5, ["--port", "8001"])


def test_without_a_model_an_option_value_is_not_taken_for_one() -> None:
    model, args, serve_args = parse_arguments(["--serve", "--port", "8001"])
    assert (model, args.serve, serve_args) == (None, True, ["--port", "8001"])
    assert parse_arguments([])[0] is None


def test_vllm_serve_options_without_serve_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_arguments(["/m", "--tensor-parallel-size", "2"])
    assert "need --serve" in capsys.readouterr().err
