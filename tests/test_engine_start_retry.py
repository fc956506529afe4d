"""``engine_start.start_llm``: one more try only for an engine core that died starting."""

from __future__ import annotations

import pytest

from engine_start import ENGINE_START_FAILURE, start_llm


class FlakyLLM:
    """Stands in for ``vllm.LLM``: raises the queued errors, then is built."""

    errors: list[Exception] = []
    built = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        if FlakyLLM.errors:
            raise FlakyLLM.errors.pop(0)
        FlakyLLM.built += 1


@pytest.fixture
def flaky_llm(monkeypatch: pytest.MonkeyPatch) -> type[FlakyLLM]:
    import vllm

    monkeypatch.setattr(vllm, "LLM", FlakyLLM)
    monkeypatch.setattr(FlakyLLM, "errors", [])
    monkeypatch.setattr(FlakyLLM, "built", 0)
    return FlakyLLM


def test_an_engine_core_that_died_starting_gets_one_more_try(flaky_llm) -> None:
    flaky_llm.errors = [RuntimeError(f"{ENGINE_START_FAILURE}. See root cause above.")]
    with pytest.warns(UserWarning, match="one more try"):
        assert isinstance(start_llm("model"), flaky_llm)
    assert flaky_llm.built == 1


def test_a_second_death_fails(flaky_llm) -> None:
    flaky_llm.errors = [RuntimeError(ENGINE_START_FAILURE), RuntimeError(ENGINE_START_FAILURE)]
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match=ENGINE_START_FAILURE):
        start_llm("model")
    assert flaky_llm.built == 0


def test_other_errors_are_not_retried(flaky_llm) -> None:
    flaky_llm.errors = [RuntimeError("--return-sampling-mask: bad config"), ValueError("x")]
    with pytest.raises(RuntimeError, match="bad config"):
        start_llm("model")
    assert flaky_llm.errors  # the ValueError was never reached: no second try
