"""Replay audit: its pure parts on a tiny random transformers model, and main() end to end
with a stand-in ``vllm`` module that samples from that same model (no engine needed)."""

import json
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from vllm_sampling_mask.training.audit import (
    markdown_table,
    main,
    rescore_rollouts,
    rollouts_from_request_outputs,
    summarize,
)

transformers = pytest.importorskip("transformers")

VOCAB = 111


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        initializer_range=0.3,  # peaked enough that top-p truncation keeps a small set
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model(model_dir: str) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def sample_completion(model, prompt_ids, max_tokens, top_k, top_p, temperature, generator,
                      full_vocab_logprobs=False):
    """Test-side sampler: top-k then top-p on the model's logits; returns the tokens, their
    log-probs (kept-set normalised, like vLLM's processed log-probs) and the mask rows."""
    ids, tokens, logprobs, rows = list(prompt_ids), [], [], []
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float() / temperature
        order = logits.argsort(descending=True)[:top_k]
        probs = logits[order].softmax(-1)
        keep = int(((probs.cumsum(0) - probs) < top_p).sum())  # mass before each < top_p
        kept = order[:keep].sort().values
        kept_logprobs = logits[kept].log_softmax(-1)
        choice = int(torch.multinomial(kept_logprobs.exp(), 1, generator=generator))
        token = int(kept[choice])
        logprob = logits.log_softmax(-1)[token] if full_vocab_logprobs else kept_logprobs[choice]
        ids.append(token)
        tokens.append(token)
        logprobs.append(float(logprob))
        rows.append(kept.tolist())
    return tokens, logprobs, rows


def request_output(request_id, prompt_ids, completions):
    """A stand-in for vLLM's RequestOutput with the attributes the audit reads."""
    outputs = [
        SimpleNamespace(
            index=i, token_ids=tokens,
            logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs)],
            sampling_mask=SimpleNamespace(token_ids=rows))
        for i, (tokens, logprobs, rows) in enumerate(completions)
    ]
    return SimpleNamespace(request_id=request_id, prompt_token_ids=prompt_ids, outputs=outputs)


def test_rescore_reproduces_kept_set_logprobs(model) -> None:
    generator = torch.Generator().manual_seed(1)
    outputs = [
        request_output(str(r), prompt, [sample_completion(model, prompt, 8, 10, 0.8, 1.0,
                                                          generator) for _ in range(2)])
        for r, prompt in enumerate([[5, 6, 7], [42]])
    ]
    rollouts = rollouts_from_request_outputs(outputs)
    assert len(rollouts) == 4 and rollouts[3].prompt_token_ids == [42]
    summary = summarize(rescore_rollouts(model, rollouts))
    assert summary["num_tokens"] == 32 and summary["num_sequences"] == 4
    kept, full = summary["kept_set"], summary["full_vocab"]
    assert kept["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert kept["log_ratio_abs_max"] < 1e-4 and kept["ratio_outside_band"] == 0
    # Full-vocabulary scoring is biased by exactly the kept mass.
    assert summary["kept_mass_mean"] < 0.95
    assert full["ratio_mean"] == pytest.approx(summary["kept_mass_mean"], abs=1e-4)
    assert full["kl_k1"] > 0.01
    assert 1 < summary["mask_row_length_mean"] <= 10
    table = markdown_table({"truncated": summary})
    assert "| truncated | kept set | 32 | 1.0000 |" in table
    assert "| truncated | full vocab |" in table


def test_temperature_is_applied_in_rescoring(model) -> None:
    generator = torch.Generator().manual_seed(2)
    prompt = [3, 4]
    completion = sample_completion(model, prompt, 6, 20, 0.9, 0.6, generator)
    rollouts = rollouts_from_request_outputs([request_output("0", prompt, [completion])])
    matched = summarize(rescore_rollouts(model, rollouts, temperature=0.6))
    assert matched["kept_set"]["log_ratio_abs_max"] < 1e-4
    mismatched = summarize(rescore_rollouts(model, rollouts, temperature=1.0))
    assert mismatched["kept_set"]["log_ratio_abs_max"] > 1e-2


def test_rollouts_from_request_outputs_rejects_incomplete_outputs() -> None:
    good = ([1, 2], [-0.1, -0.2], [[1, 2], [2]])
    no_mask = request_output("a", [0], [good])
    no_mask.outputs[0].sampling_mask = None
    with pytest.raises(ValueError, match="return_sampling_mask=True"):
        rollouts_from_request_outputs([no_mask])
    short_mask = request_output("b", [0], [([1, 2], [-0.1, -0.2], [[1, 2]])])
    with pytest.raises(ValueError, match=r"one row per token \(2\), got 1 rows"):
        rollouts_from_request_outputs([short_mask])
    no_logprobs = request_output("c", [0], [good])
    no_logprobs.outputs[0].logprobs = None
    with pytest.raises(ValueError, match="logprobs=0"):
        rollouts_from_request_outputs([no_logprobs])


def _fake_vllm(model, full_vocab_logprobs: bool) -> tuple[ModuleType, list]:
    """A ``vllm`` module whose LLM samples from ``model`` with masks (records its kwargs)."""
    engines = []

    class SamplingParams:
        def __init__(self, n=1, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=16,
                     logprobs=None, seed=None, ignore_eos=False):
            self.__dict__.update(locals())

    class LLM:
        def __init__(self, model: str, **kwargs):
            self.kwargs = dict(kwargs, model=model)
            self.shut_down = False
            self.llm_engine = SimpleNamespace(
                engine_core=SimpleNamespace(shutdown=lambda: setattr(self, "shut_down", True)))
            engines.append(self)

        def generate(self, prompts, params):
            generator = torch.Generator().manual_seed(params.seed)
            outputs = []
            for r, prompt in enumerate(prompts):
                prompt_ids = [1 + ord(c) % (VOCAB - 1) for c in prompt][:12]
                completions = [sample_completion(model, prompt_ids, params.max_tokens,
                                                 params.top_k, params.top_p, params.temperature,
                                                 generator, full_vocab_logprobs)
                               for _ in range(params.n)]
                outputs.append(request_output(str(r), prompt_ids, completions))
            return outputs

    module = ModuleType("vllm")
    module.LLM, module.SamplingParams = LLM, SamplingParams
    return module, engines


@pytest.mark.parametrize("full_vocab_logprobs", [False, True], ids=["processed", "raw"])
def test_main_end_to_end_with_stand_in_engine(model, model_dir, tmp_path, monkeypatch, capsys,
                                              full_vocab_logprobs) -> None:
    fake, engines = _fake_vllm(model, full_vocab_logprobs)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\n\nThe capital of France is\n")
    out = tmp_path / "audit.json"
    status = main(["--model", model_dir, "--out", str(out), "--prompts-file", str(prompts),
                   "--samples-per-prompt", "2", "--max-tokens", "5", "--control-max-tokens", "3",
                   "--top-k", "8", "--top-p", "0.8", "--trainer-device", "cpu",
                   "--max-ratio-error", "1e-3"])

    (engine,) = engines
    assert engine.shut_down
    assert engine.kwargs["return_sampling_mask"] is True
    assert engine.kwargs["logprobs_mode"] == "processed_logprobs"
    report = json.loads(out.read_text())
    truncated, control = report["runs"]["truncated"], report["runs"]["control"]
    assert report["config"]["vocab_size"] == VOCAB and report["config"]["num_prompts"] == 2
    assert (truncated["num_sequences"], truncated["num_tokens"]) == (4, 20)
    assert (control["num_sequences"], control["num_tokens"]) == (2, 6)
    # Untruncated control: every row is the whole vocabulary, so kept == full == rollout.
    assert control["mask_row_length_mean"] == VOCAB
    assert control["kept_mass_mean"] == pytest.approx(1.0, abs=1e-5)
    assert control["full_vocab"]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    printed = capsys.readouterr()
    assert "| control | kept set | 6 |" in printed.out
    if full_vocab_logprobs:
        # An engine reporting full-vocabulary log-probs fails the kept-set check.
        assert status == 1 and "FAIL" in printed.err
        assert truncated["kept_set"]["ratio_mean"] > 1.01
    else:
        assert status == 0
        assert truncated["kept_set"]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert truncated["full_vocab"]["ratio_mean"] < 0.99
