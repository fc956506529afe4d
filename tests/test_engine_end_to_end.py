"""Real generations through vLLM's engine (CPU: MRV2 under the Triton interpreter).

One engine for the module, which also accepts top-p-only requests
(``sampling_mask_allow_top_p_only``) and copies at most 48 ids per row (wider rows take the exact
fallbacks). Checks the mask contract on a batch that mixes every sampling transform, the
stop/length paths, n=2, and the per-request rejections (those of an engine without the top-p-only
setting: ``tests/test_http_endpoints.py`` and the unit test below).
"""

from __future__ import annotations

import pytest

from mask_invariants import check_completion

pytestmark = pytest.mark.slow

MAX_LOGPROBS = 64
# Below the widest rows of the batch (top_k 50 plus ties, the top-p-only nucleus), so both exact
# fallbacks run: the bitmap copied with the ids (top-p only) and rows fetched from it afterwards.
MAX_WIDTH = 48


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str):
    from vllm import LLM

    engine = LLM(tiny_model_dir, return_sampling_mask=True, logprobs_mode="processed_logprobs",
                 enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0, dtype="float32",
                 max_logprobs=MAX_LOGPROBS,
                 additional_config={"sampling_mask_allow_top_p_only": True,
                                    "sampling_mask_max_width": MAX_WIDTH})
    yield engine
    del engine


def generate(llm, prompts, params):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [c for o in outputs for c in o.outputs]


def test_mixed_batch_satisfies_the_contract(llm) -> None:
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    banned = tokenizer.encode(" the")
    prompts = ["Hello world", "the quick brown fox", "kalo mitor", "0123456789 zen"]
    base = dict(temperature=1.0, max_tokens=12, seed=7)
    cases = {
        "top_k": SamplingParams(top_k=20, logprobs=28, **base),
        "top_p": SamplingParams(top_k=40, top_p=0.8, logprobs=48, **base),
        # No logprobs: a nucleus row can be wider than max_logprobs.
        "top_p_only": SamplingParams(top_k=-1, top_p=0.5, **base),
        "min_p": SamplingParams(top_k=40, min_p=0.05, logprobs=48, **base),
        "penalties": SamplingParams(top_k=30, presence_penalty=0.5, frequency_penalty=0.5,
                                    repetition_penalty=1.3, logprobs=38, **base),
        "logit_bias": SamplingParams(top_k=10, logit_bias={5: 5.0, 6: -100.0}, logprobs=18, **base),
        "bad_words": SamplingParams(top_k=25, bad_words=[" the"], logprobs=33, **base),
        "n2_temp": SamplingParams(top_k=16, n=2, temperature=0.7, logprobs=24, max_tokens=10, seed=3),
        "stop_string": SamplingParams(top_k=50, stop=["a", "e"], logprobs=58, **base),
        "stop_tokens": SamplingParams(top_k=50, stop_token_ids=list(range(300, 2000)), logprobs=58, **base),
        "max_tokens_1": SamplingParams(top_k=5, logprobs=13, temperature=1.0, max_tokens=1),
        "allowed": SamplingParams(top_k=50, allowed_token_ids=list(range(100, 140)), logprobs=58,
                                  **base),
    }
    results = {}
    for name, params in cases.items():
        results[name] = generate(llm, prompts, params)
    problems = {}
    for name, completions in results.items():
        for j, completion in enumerate(completions):
            found = check_completion(completion, with_logprobs=True)
            if found:
                problems[f"{name}[{j}]"] = found
    assert not problems, problems

    # Each transform is visible in the rows.
    for c in results["top_k"]:
        assert all(len(r) <= 20 + 8 for r in c.sampling_mask.token_ids)  # + PyTorch top-k ties
    top_p_only_rows = [r for c in results["top_p_only"] for r in c.sampling_mask.token_ids]
    assert max(map(len, top_p_only_rows)) > MAX_WIDTH, "no top-p-only row took the bitmap path"
    for c in results["allowed"]:
        assert all(set(r) <= set(range(100, 140)) for r in c.sampling_mask.token_ids)
    for c in results["logit_bias"]:
        assert all(6 not in r for r in c.sampling_mask.token_ids)
    if len(banned) == 1:
        for c in results["bad_words"]:
            assert all(banned[0] not in r for r in c.sampling_mask.token_ids)
    assert len(results["n2_temp"]) == 2 * len(prompts)
    stops = [c for c in results["stop_string"] if c.finish_reason == "stop"]
    assert stops, "no completion hit a stop string: the test exercises nothing"
    assert any(c.finish_reason == "stop" for c in results["stop_tokens"])
    assert all(len(c.token_ids) == 1 == len(c.sampling_mask.token_ids) for c in results["max_tokens_1"])
    assert any(len(r) > 1 for c in results["top_p"] for r in c.sampling_mask.token_ids), \
        "every row has one id: the model is too peaked to test filtering"


def test_rows_without_logprobs_and_streaming_style_outputs(llm) -> None:
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=6, seed=11)
    for completion in generate(llm, ["Hello"] * 3, params):
        assert check_completion(completion, with_logprobs=False) == []


def test_opted_out_requests_share_batches_and_get_no_mask(llm) -> None:
    """``extra_args["return_sampling_mask"] = False``: not checked (greedy, no top_k), no mask;
    the mask requests in the same batches still satisfy the contract, and a batch of only
    opted-out requests (no capture at all) runs too."""
    from vllm import SamplingParams

    out = {"return_sampling_mask": False}
    masked = SamplingParams(temperature=1.0, top_k=20, logprobs=28, max_tokens=8, seed=5)
    explicit = SamplingParams(temperature=1.0, top_k=20, logprobs=28, max_tokens=8, seed=6,
                              extra_args={"return_sampling_mask": True})
    greedy = SamplingParams(temperature=0.0, max_tokens=8, extra_args=out)
    unbounded = SamplingParams(temperature=1.0, max_tokens=8, seed=8, extra_args=out)
    prompts = ["Hello world", "the quick brown fox", "kalo mitor", "0123456789 zen"]
    params = [masked, greedy, unbounded, explicit]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for output, p in zip(outputs, params):
        (completion,) = output.outputs
        assert len(completion.token_ids) == 8
        if p.extra_args == out:
            assert completion.sampling_mask is None
        else:
            assert check_completion(completion, with_logprobs=True) == []
    greedy_alone = generate(llm, ["Hello world", "the quick brown fox"], [greedy, unbounded])
    assert all(c.sampling_mask is None and len(c.token_ids) == 8 for c in greedy_alone)
    with pytest.raises(ValueError, match=r"extra_args\['return_sampling_mask'\] must be a bool"):
        llm.generate(["Hello"], SamplingParams(temperature=1.0, top_k=4, max_tokens=2,
                                               extra_args={"return_sampling_mask": "no"}))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(temperature=0.0, top_k=10), r"temperature must be > 0.*got 0\.0"),
        (dict(temperature=1.0, top_k=0), r"top_k must be > 0 or top_p < 1.*got top_k=0 and top_p=1\.0"),
        (dict(temperature=1.0, top_k=-1), r"top_k must be > 0 or top_p < 1.*got top_k=-1"),
        (dict(temperature=1.0), r"top_k must be > 0 or top_p < 1"),
    ],
    ids=["temperature_0", "top_k_0", "top_k_-1", "top_k_unset"],
)
def test_bad_requests_are_rejected_and_engine_keeps_serving(llm, params, message) -> None:
    from vllm import SamplingParams

    with pytest.raises(ValueError, match=message):
        llm.generate(["Hello"], SamplingParams(max_tokens=2, **params), use_tqdm=False)
    ok = generate(llm, ["Hello"], SamplingParams(temperature=1.0, top_k=4, max_tokens=2))
    assert check_completion(ok[0], with_logprobs=False) == []


@pytest.mark.parametrize(
    ("prompt_ids", "params", "message"),
    [
        ([5, 6], dict(seed=2**63), r"seed must be in \[-9223372036854775808, 9223372036854775807\]"),
        ([5, 6], dict(max_tokens=2**31), r"max_tokens must be <= 2147483645"),
        ([5, 6], dict(logit_bias={5: float("nan")}), r"logit_bias values must be finite"),
        ([5, 6], dict(allowed_token_ids=list(range(1025))), r"allowed_token_ids must have at most 1024"),
        ([5, -1], {}, r"prompt token_ids must hold token ids in \[0, "),
    ],
    ids=["seed_2**63", "max_tokens_2**31", "logit_bias_nan", "allowed_1025", "prompt_id_-1"],
)
@pytest.mark.parametrize("opted_out", [False, True], ids=["masked", "opted_out"])
def test_values_that_break_masks_or_mrv2_are_refused(llm, prompt_ids, params, message,
                                                     opted_out) -> None:
    """Refused before the engine sees them (they ended it, or broke the contract); the limits of
    MRV2's per-request tensors apply to opted-out requests too, the mask checks do not."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra_args = {"return_sampling_mask": False} if opted_out else None
    request = SamplingParams(temperature=1.0, top_k=4, **{"max_tokens": 2, **params},
                             extra_args=extra_args)
    if opted_out and "logit_bias" in params:
        generate(llm, [TokensPrompt(prompt_token_ids=prompt_ids)], request)  # vLLM's to judge
    else:
        with pytest.raises(ValueError, match=message):
            llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], request, use_tqdm=False)
    ok = generate(llm, ["Hello"], SamplingParams(temperature=1.0, top_k=4, max_tokens=2))
    assert check_completion(ok[0], with_logprobs=False) == []


@pytest.mark.parametrize("top_k", [None, 0, -1], ids=["unset", "0", "-1"])
def test_without_the_top_p_only_setting_top_k_is_required(top_k) -> None:
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_sampling_mask.engine.input_processor import check_sampling_params

    params = SamplingParams(temperature=1.0, top_p=0.5, **({} if top_k is None else {"top_k": top_k}))
    with pytest.raises(VLLMValidationError, match="top_k must be > 0 when .*sampling_mask_allow_top_p_only") as info:
        check_sampling_params(params)
    assert info.value.parameter == "top_k"
    check_sampling_params(params, allow_top_p_only=True)  # accepted with the setting
    with pytest.raises(VLLMValidationError, match="top_p < 1") as info:
        check_sampling_params(SamplingParams(temperature=1.0, top_k=top_k or 0), allow_top_p_only=True)
    assert info.value.parameter == "top_p"


def test_the_request_key_is_a_bool_and_needs_the_switch() -> None:
    from vllm import SamplingParams

    from vllm_sampling_mask.engine.input_processor import check_request_key

    def params(value: object) -> SamplingParams:
        return SamplingParams(extra_args={"return_sampling_mask": value})

    check_request_key(params(False), engine_enabled=False)  # opting out is always fine
    check_request_key(params(True), engine_enabled=True)
    with pytest.raises(ValueError, match="started without return_sampling_mask"):
        check_request_key(params(True), engine_enabled=False)
    for bad in (2, -1, 0.0, "false"):
        with pytest.raises(ValueError, match="must be a bool, got"):
            check_request_key(params(bad), engine_enabled=True)


def test_openai_vllm_xargs_booleans_arrive_as_ints_and_still_opt_out() -> None:
    """The OpenAI requests type ``vllm_xargs`` values as ``str | int | float | list``, so pydantic
    parses a JSON ``false`` as 0: that must opt out (not be refused, not opt in)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_sampling_mask.config import request_wants_masks
    from vllm_sampling_mask.engine.input_processor import check_request_key

    for sent, wants in ((False, False), (True, True)):
        request = CompletionRequest.model_validate_json(
            '{"model": "m", "prompt": "x", "vllm_xargs": {"return_sampling_mask": %s}}'
            % str(sent).lower())
        params = request.to_sampling_params(16, None)
        assert params.extra_args["return_sampling_mask"] == int(sent)  # an int, not a bool
        check_request_key(params, engine_enabled=True)
        assert request_wants_masks(params) is wants
        if not wants:
            check_request_key(params, engine_enabled=False)  # opting out needs no switch


def test_beam_search_is_rejected(llm) -> None:
    from vllm.sampling_params import BeamSearchParams

    with pytest.raises(ValueError, match="beam search is not supported"):
        llm.beam_search([{"prompt": "Hello"}], BeamSearchParams(beam_width=2, max_tokens=2))
