"""Real generations through vLLM's engine (CPU: MRV2 under the Triton interpreter).

One engine for the module, which also accepts top-p-only requests
(``sampling_mask_allow_top_p_only``) and copies at most 48 ids per row (wider rows take the exact
fallbacks). Checks the mask contract on a batch that mixes every sampling transform, the
stop/length paths, n=2, and the per-request rejections (those of an engine without the top-p-only
setting: ``tests/test_http_endpoints.py`` and the unit test below).
"""

from __future__ import annotations

import os

import pytest
from vllm_sampling_mask_testing.held_steps import ENV_HELD_STEPS

from engine_cases import check_mixed_batch, check_opt_out, generate
from engine_start import start_llm
from mask_invariants import check_completion

pytestmark = pytest.mark.slow

MAX_LOGPROBS = 64
# Below the widest rows of the batch (top_k 50 plus ties, the top-p-only nucleus), so both exact
# fallbacks run: the bitmap copied with the ids (top-p only) and rows fetched from it afterwards.
MAX_WIDTH = 48


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str):
    engine = start_llm(
        tiny_model_dir, return_sampling_mask=True, logprobs_mode="processed_logprobs",
        enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0, dtype="float32",
        max_logprobs=MAX_LOGPROBS,
        additional_config={"sampling_mask_allow_top_p_only": True,
                           "sampling_mask_max_width": MAX_WIDTH})
    yield engine
    del engine


def test_mixed_batch_satisfies_the_contract(llm) -> None:
    check_mixed_batch(llm, MAX_WIDTH)


def test_rows_without_logprobs_and_streaming_style_outputs(llm) -> None:
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=6, seed=11)
    for completion in generate(llm, ["Hello"] * 3, params):
        assert check_completion(completion, with_logprobs=False) == []


@pytest.mark.skipif(ENV_HELD_STEPS not in os.environ,
                    reason="engine cores send held rows every 64 steps (cpu_test_env sets 5)")
def test_held_rows_leave_the_engine_core_mid_request(llm, monkeypatch) -> None:
    """LLM.generate's requests (FINAL_ONLY, no stop strings) have their rows held in the engine
    core, which on CPU sends them every 5 steps (``cpu_test_env``; 64 elsewhere): rows reach
    the frontend in pieces before the end and the mask still has one row per token, in order."""
    from vllm import SamplingParams

    from vllm_sampling_mask.engine import output_processor

    pieces: list[tuple[int, bool]] = []  # (rows, with the last output) per output with rows
    take = output_processor._take_held_output

    def counted(holder, state, output, row, to_abort) -> None:
        if row is not None:
            pieces.append((1 if row.__class__ is bytes else len(row), output.finished))
        take(holder, state, output, row, to_abort)

    monkeypatch.setattr(output_processor, "_take_held_output", counted)
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=12, ignore_eos=True, seed=5,
                            logprobs=16)
    completions = generate(llm, ["Hello", "the quick brown fox"], params)
    assert all(check_completion(c, with_logprobs=True) == [] for c in completions)
    assert sum(rows for rows, _ in pieces) == 2 * 12, pieces
    assert sum(last for _, last in pieces) == 2 and len(pieces) > 2, pieces


def test_seeded_requests_reproduce_run_to_run(llm) -> None:
    """The candidate sampler's noise depends on the request's seed and position: a seeded batch
    generated twice gives the same tokens and rows (unseeded requests differ)."""
    from vllm import SamplingParams

    prompts = ["Hello world", "the quick brown fox", "kalo mitor"]
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=0.9, max_tokens=10, seed=100 + k)
              for k in (5, 20, 40)]
    first, again = generate(llm, prompts, params), generate(llm, prompts, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.sampling_mask.token_ids for c in first] == [c.sampling_mask.token_ids for c in again]
    unseeded = [SamplingParams(temperature=1.0, top_k=40, max_tokens=10) for _ in range(2)]
    a, b = generate(llm, prompts[:1] * 2, unseeded)
    assert a.token_ids != b.token_ids  # 10 draws from top-40 rows: equal by chance ~never


def test_opted_out_requests_share_batches_and_get_no_mask(llm) -> None:
    check_opt_out(llm)


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
