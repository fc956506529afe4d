"""support_logprobs_from_hidden against the dense recipe on hidden @ W.T (+ bias)."""

import pytest
import torch
from _training_cases import ATOL, BF16_ATOL, RTOL, make_case

from vllm_sampling_mask.training import (
    PackedMasks,
    support_logprobs_from_hidden,
    support_logprobs_reference,
)

HIDDEN = 24


def _inputs(num_tokens: int, vocab_size: int, with_bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
    weight = torch.randn(vocab_size, HIDDEN, generator=generator) / 2
    bias = torch.randn(vocab_size, generator=generator) if with_bias else None
    return hidden, weight, bias


def _run(fn, hidden, weight, bias, return_full):
    """Outputs and gradients (hidden, weight, bias) of a random weighted sum of the outputs."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (hidden, weight, bias)]
    outputs = fn(*leaves, return_full)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    generator = torch.Generator().manual_seed(5)
    sum((o * torch.randn(o.shape, generator=generator)).sum() for o in outputs).backward()
    return [o.detach() for o in outputs], [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("vocab_size", [111, 1000])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
@pytest.mark.parametrize("return_full", [False, True], ids=["kept", "kept+full"])
def test_matches_dense_recipe(vocab_size: int, chunk_size: int, return_full: bool) -> None:
    num_tokens = 41
    case = make_case(num_tokens, vocab_size, seed=vocab_size + chunk_size)
    with_bias = chunk_size % 2 == 1  # exercise both with and without an LM-head bias
    temperature = 0.8 if return_full else 1.0
    hidden, weight, bias = _inputs(num_tokens, vocab_size, with_bias)

    def fast(h, w, b, full):
        return support_logprobs_from_hidden(
            h, w, case.token_ids, case.masks, lm_head_bias=b, valid=case.valid,
            temperature=temperature, return_full=full, chunk_size=chunk_size)

    def dense(h, w, b, full):
        logits = h @ w.T + (b if b is not None else 0)
        return support_logprobs_reference(logits, case.token_ids, case.masks, valid=case.valid,
                                          temperature=temperature, return_full=full)

    got, got_grads = _run(fast, hidden, weight, bias, return_full)
    want, want_grads = _run(dense, hidden, weight, bias, return_full)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        if w is not None:
            torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")
    assert got_grads[0][case.scored].abs().sum() > 0
    assert got_grads[0][~case.scored].abs().max() == 0


def test_frozen_weight_gets_no_gradient() -> None:
    case = make_case(12, 111, seed=2)
    hidden, weight, _ = _inputs(12, 111, with_bias=False)
    hidden.requires_grad_()
    kept = support_logprobs_from_hidden(hidden, weight, case.token_ids, case.masks,
                                        valid=case.valid, chunk_size=5)
    kept.sum().backward()
    assert weight.grad is None and hidden.grad is not None
    dense_hidden = hidden.detach().clone().requires_grad_()
    support_logprobs_reference(dense_hidden @ weight.T, case.token_ids, case.masks,
                               valid=case.valid).sum().backward()
    torch.testing.assert_close(hidden.grad, dense_hidden.grad, atol=ATOL, rtol=RTOL)


def test_token_outside_row_and_argument_checks() -> None:
    hidden, weight, _ = _inputs(2, 50, with_bias=False)
    masks = PackedMasks.from_rows([[1, 2], [3]])
    with pytest.raises(ValueError, match="got token 4 at position 1 outside its row"):
        support_logprobs_from_hidden(hidden, weight, torch.tensor([1, 4]), masks)
    kept = support_logprobs_from_hidden(hidden, weight, torch.tensor([1, 4]), masks, check=False)
    assert kept[1].item() == float("-inf") and kept[0].item() < 0
    with pytest.raises(ValueError, match="share a dtype"):
        support_logprobs_from_hidden(hidden, weight.double(), torch.tensor([1, 3]), masks)
    with pytest.raises(ValueError, match=r"lm_head_weight \[V, H\]"):
        support_logprobs_from_hidden(hidden, weight[:, :3], torch.tensor([1, 3]), masks)
    with pytest.raises(ValueError, match="chunk_size must be > 0"):
        support_logprobs_from_hidden(hidden, weight, torch.tensor([1, 3]), masks, chunk_size=0)


def test_empty_batch() -> None:
    hidden, weight, _ = _inputs(0, 50, with_bias=False)
    kept, full = support_logprobs_from_hidden(
        hidden, weight, torch.zeros(0, dtype=torch.int64), PackedMasks.from_rows([]),
        return_full=True)
    assert kept.shape == (0,) and full.shape == (0,)


@pytest.mark.parametrize("return_full", [False, True])
def test_bfloat16_against_fp32_reference(return_full: bool) -> None:
    case = make_case(24, 1000, seed=9)
    hidden, weight, _ = _inputs(24, 1000, with_bias=False)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()

    def fast(h, w, b, full):
        return support_logprobs_from_hidden(h, w, case.token_ids, case.masks, valid=case.valid,
                                            return_full=full, chunk_size=8)

    def dense(h, w, b, full):
        return support_logprobs_reference(h @ w.T, case.token_ids, case.masks, valid=case.valid,
                                          return_full=full)

    got, got_grads = _run(fast, hidden, weight, None, return_full)
    want, want_grads = _run(dense, hidden.float(), weight.float(), None, return_full)
    assert got_grads[1].dtype == torch.bfloat16
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=BF16_ATOL * 5, rtol=BF16_ATOL)
    for g, w in zip(got_grads[:2], want_grads[:2]):
        torch.testing.assert_close(g.float(), w, atol=BF16_ATOL, rtol=BF16_ATOL)
