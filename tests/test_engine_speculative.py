"""Speculative decoding with masks, end to end on CPU, on both runners: ngram drafts on vLLM's V1
runner, and EAGLE drafts on Model Runner V2 (a tiny draft that proposes its input token again:
``tiny_variants.py``); the rejection samplers' and our kernels run under the Triton interpreter.

A speculative step samples several tokens per request; each gets the row of the distribution it
came from: a draft position's target distribution as rejection sampling used it (accepted draft
or recovered token), or the bonus position's. The prompts repeat a pattern so that drafts exist
and are accepted; with logprobs as wide as top_k, the contract check compares every row with the
processed distribution vLLM itself reports for that token.
"""

from __future__ import annotations

import pytest

from engine_cases import generate
from engine_start import start_llm
from mask_invariants import check_completion

pytestmark = pytest.mark.slow

SPECULATIVE_TOKENS = 3
PATTERN = [41, 42, 43, 44, 45, 46]


@pytest.fixture(scope="module", params=["ngram-v1", "eagle-mrv2"])
def llm(request: pytest.FixtureRequest, tiny_model_dir: str, pytestconfig: pytest.Config):
    if request.param == "ngram-v1":
        speculative = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        from tiny_variants import build_tiny_eagle_draft

        draft = build_tiny_eagle_draft(
            tiny_model_dir, pytestconfig.cache.mkdir("vllm_sampling_mask_eagle_draft"))
        speculative = {"method": "eagle", "model": str(draft)}
    engine = start_llm(
        tiny_model_dir, return_sampling_mask=True, logprobs_mode="processed_logprobs",
        enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0, dtype="float32",
        max_num_batched_tokens=256,  # a small profile run: a faster start on CPU
        max_logprobs=32, disable_log_stats=False,
        speculative_config={**speculative, "num_speculative_tokens": SPECULATIVE_TOKENS})
    expected_v2 = request.param == "eagle-mrv2"
    assert engine.llm_engine.vllm_config.use_v2_model_runner is expected_v2
    yield engine
    del engine


def prompts(count: int) -> list[dict]:
    return [{"prompt_token_ids": PATTERN[i % 3:] + PATTERN * 4} for i in range(count)]


def draft_counts(llm) -> tuple[int, int]:
    """(draft tokens proposed, draft tokens accepted) so far."""
    metrics = {m.name: m.value for m in llm.get_metrics()
               if m.name in ("vllm:spec_decode_num_draft_tokens",
                             "vllm:spec_decode_num_accepted_tokens")}
    return (int(metrics.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(metrics.get("vllm:spec_decode_num_accepted_tokens", 0)))


def test_every_accepted_position_has_its_row(llm) -> None:
    from vllm import SamplingParams

    drafted_before, accepted_before = draft_counts(llm)
    params = [SamplingParams(temperature=0.2, top_k=12, logprobs=12, max_tokens=16, seed=i)
              for i in range(3)]
    params.append(SamplingParams(temperature=0.5, top_k=24, top_p=0.8, logprobs=24,
                                 max_tokens=16, seed=9))
    # Hot enough that drafts are rejected too (recovered tokens drawn at draft positions).
    params.append(SamplingParams(temperature=1.5, top_k=24, logprobs=24, max_tokens=16, seed=5))
    completions = generate(llm, prompts(len(params)), params)
    drafted, accepted = draft_counts(llm)
    assert accepted > accepted_before, "no draft token was accepted"
    # Some drafts were rejected too: recovered tokens were drawn at draft positions.
    assert drafted - drafted_before > accepted - accepted_before, "no draft token was rejected"
    for completion in completions:
        assert len(completion.token_ids) == 16
        assert check_completion(completion, with_logprobs=True) == []


def test_tokens_cut_inside_a_step_keep_their_rows(llm) -> None:
    """max_tokens and a stop token end a request inside a speculative step: its rows are the
    kept tokens' only, and an opted-out request in the batch gets no mask."""
    from vllm import SamplingParams

    base = dict(temperature=0.2, top_k=12, logprobs=12, seed=3)
    (free,) = generate(llm, prompts(2)[1:], SamplingParams(max_tokens=16, **base))
    short = SamplingParams(max_tokens=5, **base)
    # The same seeded request, stopped at the first time it samples its 7th token.
    stopped = SamplingParams(max_tokens=16, stop_token_ids=[free.token_ids[6]], **base)
    opted_out = SamplingParams(max_tokens=10, extra_args={"return_sampling_mask": False}, **base)
    short_c, stopped_c, opted_out_c = generate(llm, prompts(3), [short, stopped, opted_out])
    assert len(short_c.token_ids) == 5
    assert stopped_c.finish_reason == "stop" and len(stopped_c.token_ids) < 16
    for completion in (short_c, stopped_c):
        assert check_completion(completion, with_logprobs=True) == []
    assert opted_out_c.sampling_mask is None and len(opted_out_c.token_ids) == 10


def test_streamed_outputs_carry_each_steps_rows(llm) -> None:
    """DELTA outputs (several tokens per speculative step): each delta's mask has one row per
    token it carries, and the deltas concatenate to the final rows."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.2, top_k=12, logprobs=12, max_tokens=12, seed=4,
                            output_kind=RequestOutputKind.DELTA)
    outputs = llm.generate(prompts(1), params, use_tqdm=False)
    (completion,) = outputs[0].outputs
    assert check_completion(completion, with_logprobs=True) == []
