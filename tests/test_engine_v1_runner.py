"""Real generations through vLLM's V1 model runner (CPU: vLLM's CPU runner, a subclass of the V1
``GPUModelRunner``; our compaction kernel under the Triton interpreter).

vLLM 0.26 picks V1 for this engine by itself: Model Runner V2 supports neither custom logits
processors nor prompt embeds, and the engine has both (the test processor bans even token ids
for the requests that ask). The same workloads as the MRV2 module (every sampling transform, stop
and length paths, n=2, opt-out), then what only V1 runs: the custom processor, prompt embeds,
and a token budget of 128 so a long prompt is prefilled in chunks while other requests decode.
"""

from __future__ import annotations

import pytest

from engine_cases import check_mixed_batch, check_opt_out, generate
from engine_start import start_llm
from mask_invariants import check_completion

pytestmark = pytest.mark.slow

MAX_WIDTH = 48  # as in the MRV2 module: both exact fallbacks run
TOKEN_BUDGET = 128


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str, monkeypatch_module: pytest.MonkeyPatch):
    from vllm_sampling_mask_testing.logits_processors import PROCESSOR

    monkeypatch_module.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # vLLM's own choice
    engine = start_llm(
        tiny_model_dir, return_sampling_mask=True, logprobs_mode="processed_logprobs",
        enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0, dtype="float32",
        max_logprobs=64, max_num_batched_tokens=TOKEN_BUDGET, enable_chunked_prefill=True,
        enable_prompt_embeds=True, logits_processors=[PROCESSOR],
        additional_config={"sampling_mask_allow_top_p_only": True,
                           "sampling_mask_max_width": MAX_WIDTH})
    yield engine
    del engine


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_vllm_picked_the_v1_runner(llm) -> None:
    assert not llm.llm_engine.vllm_config.use_v2_model_runner


def test_mixed_batch_satisfies_the_contract(llm) -> None:
    check_mixed_batch(llm, MAX_WIDTH)


def test_opted_out_requests_share_batches_and_get_no_mask(llm) -> None:
    check_opt_out(llm)


def test_rows_reflect_a_custom_logits_processor(llm) -> None:
    """Requests that ask the processor to ban even ids get odd-only rows (with processed
    logprobs normalised over them); the others in the same batches keep even ids."""
    from vllm import SamplingParams

    from vllm_sampling_mask_testing.logits_processors import REQUEST_KEY

    banned = SamplingParams(temperature=1.0, top_k=40, logprobs=48, max_tokens=10, seed=1,
                            extra_args={REQUEST_KEY: True})
    plain = SamplingParams(temperature=1.0, top_k=40, logprobs=48, max_tokens=10, seed=2)
    prompts = ["Hello world", "the quick brown fox", "kalo mitor", "0123456789 zen"]
    params = [banned, plain, banned, plain]
    completions = generate(llm, prompts, params)
    problems = {i: check_completion(c, with_logprobs=True) for i, c in enumerate(completions)}
    assert not any(problems.values()), problems
    for completion, p in zip(completions, params):
        rows = completion.sampling_mask.token_ids
        even_ids = sum(t % 2 == 0 for row in rows for t in row)
        if p is banned:
            assert even_ids == 0 and all(t % 2 for t in completion.token_ids)
        else:
            assert even_ids > 0, "the processor banned ids of a request that did not ask"


def test_prompt_embeds(llm, tiny_model_dir: str) -> None:
    """Prompts given as embeddings (the model's own token embeddings), batched with token
    prompts."""
    from safetensors.torch import load_file
    from vllm import SamplingParams

    weights = load_file(f"{tiny_model_dir}/model.safetensors")
    embeddings = weights["model.embed_tokens.weight"]
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_embeds": embeddings[tokenizer.encode(text)].clone()}
               for text in ("Hello world", "kalo mitor")] + ["the quick brown fox"]
    params = SamplingParams(temperature=1.0, top_k=30, top_p=0.9, logprobs=38, max_tokens=8,
                            seed=4)
    completions = generate(llm, prompts, params)
    assert [len(c.token_ids) for c in completions] == [8, 8, 8]
    problems = {i: check_completion(c, with_logprobs=True) for i, c in enumerate(completions)}
    assert not any(problems.values()), problems


def test_chunked_prefill_beside_decoding_requests(llm) -> None:
    """A prompt over the token budget is prefilled over several steps in which the short
    requests decode: its partial-chunk rows sample nothing and yield no mask row."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    long_prompt = TokensPrompt(prompt_token_ids=[100 + (7 * i) % 1800 for i in range(3 * TOKEN_BUDGET)])
    prompts = ["Hello world", "kalo mitor", long_prompt, "the quick brown fox"]
    # No seed: vLLM 0.26's V1 runner rewinds a seeded request's generator for a partial-prefill
    # row with Generator.set_offset, which CPU generators lack (the engine dies; stock too).
    params = SamplingParams(temperature=1.0, top_k=20, logprobs=28, max_tokens=12,
                            ignore_eos=True)
    completions = generate(llm, prompts, params)
    assert [len(c.token_ids) for c in completions] == [12] * 4
    problems = {i: check_completion(c, with_logprobs=True) for i, c in enumerate(completions)}
    assert not any(problems.values()), problems
