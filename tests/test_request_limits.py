"""Per-request values a mask engine refuses (``engine/input_processor.py``), engine-free.

Two kinds: values that would let a token outside its finite row be sampled (mask requests only),
and values Model Runner V2's fixed-width per-request tensors can't hold (every request of a mask
engine: the worker would raise and end the engine). Both must name the parameter (HTTP 400).
The engine-level and HTTP tests send the same values to real engines.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vllm_builders import engine_core_request, sampling_params
from vllm_sampling_mask.engine.input_processor import check_engine_limits, check_sampling_params

VOCAB = 2000
PROMPT = [5, 6, 7]


@pytest.mark.parametrize(("params", "parameter"), [
    ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ({"logit_bias": {5: -float("inf")}}, "logit_bias"),
    ({"logit_bias": {5: 1e308}}, "logit_bias"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),
    ({"repetition_penalty": 0.005}, "repetition_penalty"),
], ids=["bias_nan", "bias_inf", "bias_-inf", "bias_1e308", "bias_100.5", "rep_1e-40", "rep_0.005"])
def test_values_that_make_a_logit_non_finite_are_refused(params: dict[str, Any], parameter: str) -> None:
    with pytest.raises(VLLMValidationError, match=parameter) as info:
        check_sampling_params(SamplingParams(temperature=1.0, top_k=5, **params))
    assert info.value.parameter == parameter


def test_values_at_the_bounds_are_accepted() -> None:
    check_sampling_params(SamplingParams(temperature=1.0, top_k=5, logit_bias={5: 100.0, 6: -100},
                                         repetition_penalty=0.01))


def request(prompt: list[int] = PROMPT, **params: Any) -> Any:
    """An ``EngineCoreRequest`` as ``process_inputs`` leaves it (EOS stop id, bad-word ids)."""
    bad_words_token_ids = params.pop("bad_words_token_ids", None)
    built = sampling_params(**params)
    if bad_words_token_ids is not None:
        built._bad_words_token_ids = bad_words_token_ids
    return engine_core_request("r", prompt, built)


LIMITS = [
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**63 - 1, "n": 2}, "seed"),  # sample 1 uses seed + 1
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": 2**31 - len(PROMPT)}, "max_tokens"),
    ({"min_tokens": 2**31, "max_tokens": 2**31}, "max_tokens"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias"),
    ({"allowed_token_ids": list(range(1025))}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, VOCAB]}, "allowed_token_ids"),
    ({"min_tokens": 2, "stop_token_ids": list(range(1, 129))}, "stop_token_ids"),  # + EOS: 129
    ({"min_tokens": 2, "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"min_tokens": 2, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"bad_words_token_ids": [[i] for i in range(129)]}, "bad_words"),
    ({"bad_words_token_ids": [list(range(1025))]}, "bad_words"),
]


@pytest.mark.parametrize(("params", "parameter"), LIMITS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(LIMITS)])
def test_values_mrv2_cannot_store_are_refused(params: dict[str, Any], parameter: str) -> None:
    with pytest.raises(VLLMValidationError, match=parameter) as info:
        check_engine_limits(request(**params), VOCAB, VOCAB - 1)
    assert info.value.parameter == parameter


@pytest.mark.parametrize("prompt", [[5, -1, 7], [5, VOCAB, 7], [2**40]], ids=["negative", "vocab", "2**40"])
def test_prompt_ids_outside_the_vocabulary_are_refused(prompt: list[int]) -> None:
    with pytest.raises(VLLMValidationError, match=r"prompt token_ids must hold token ids in \[0, 2000\)"):
        check_engine_limits(request(prompt), VOCAB, VOCAB - 1)
    check_engine_limits(request([VOCAB + 5]), VOCAB, VOCAB + 5)  # a larger tokenizer's ids pass


def test_values_at_the_limits_are_accepted() -> None:
    for params in [
        {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"seed": 2**63 - 2, "n": 2},
        {"max_tokens": 2**31 - 1 - len(PROMPT)},
        {"logit_bias": {i: 1.0 for i in range(1024)}},
        {"allowed_token_ids": list(range(1024))},
        {"min_tokens": 2, "stop_token_ids": list(range(1, 128))},
        {"stop_token_ids": [VOCAB + 7]},  # only stored (and checked) with min_tokens > 0
        {"bad_words_token_ids": [[i] for i in range(128)]},
    ]:
        check_engine_limits(request(**params), VOCAB, VOCAB - 1)
