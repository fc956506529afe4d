"""Generation workloads shared by the engine tests of both model runners (CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mask_invariants import check_completion


def run_result_script(script: Path, env: dict[str, str], *args: str) -> dict:
    """Run ``script`` in a fresh interpreter; the JSON of its last ``RESULT `` line."""
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                            env=env, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def generate(llm: Any, prompts: Any, params: Any) -> list[Any]:
    """The completions of ``llm.generate``, flattened."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [c for o in outputs for c in o.outputs]


def check_mixed_batch(llm: Any, max_width: int) -> None:
    """Every sampling transform, stop/length paths and n=2 in one batch: the mask contract
    holds and each transform is visible in the rows (``max_width``: the engine's
    ``sampling_mask_max_width``, below the widest top-p-only rows)."""
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()
    banned = tokenizer.encode(" the")
    prompts = ["Hello world", "kalo mitor"]
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
        # Up to 24 tokens: ids past the tokenizer's vocabulary decode to nothing.
        "stop_string": SamplingParams(top_k=50, stop=["a", "e", "o"], logprobs=58,
                                      **{**base, "max_tokens": 24}),
        "stop_tokens": SamplingParams(top_k=50, stop_token_ids=list(range(300, 2000)), logprobs=58, **base),
        "max_tokens_1": SamplingParams(top_k=5, logprobs=13, temperature=1.0, max_tokens=1),
        "allowed": SamplingParams(top_k=50, allowed_token_ids=list(range(100, 140)), logprobs=58,
                                  **base),
    }
    # One batch: every transform beside the others in the same steps.
    names = [name for name in cases for _ in prompts]
    outputs = llm.generate(prompts * len(cases), [cases[name] for name in names], use_tqdm=False)
    results: dict[str, list[Any]] = {name: [] for name in cases}
    for name, output in zip(names, outputs, strict=True):
        results[name].extend(output.outputs)
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
    assert max(map(len, top_p_only_rows)) > max_width, "no top-p-only row took the bitmap path"
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


def check_opt_out(llm: Any) -> None:
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
    # Opting out changes nothing of what is sampled: a seeded request alone in its batch (no
    # capture) draws the masked one's tokens, and its processed logprobs are normalised over
    # its top_k.
    seeded = dict(temperature=1.0, top_k=6, logprobs=10, max_tokens=8, seed=21)
    kept, dropped = (generate(llm, ["kalo mitor"], SamplingParams(**seeded, extra_args=extra))[0]
                     for extra in (None, out))
    assert dropped.sampling_mask is None and dropped.token_ids == kept.token_ids
    for token, step in zip(dropped.token_ids, dropped.logprobs):
        finite = [lp.logprob for lp in step.values() if math.isfinite(lp.logprob)]
        assert math.isfinite(step[token].logprob) and len(finite) == 6
        assert math.isclose(sum(math.exp(x) for x in finite), 1.0, abs_tol=1e-4)
    with pytest.raises(ValueError, match=r"extra_args\['return_sampling_mask'\] must be a bool"):
        llm.generate(["Hello"], SamplingParams(temperature=1.0, top_k=4, max_tokens=2,
                                               extra_args={"return_sampling_mask": "no"}))
