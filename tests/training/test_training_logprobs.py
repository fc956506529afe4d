"""support_logprobs against the dense recipe (values and gradients) and on edge cases."""

import math

import pytest
import torch
from _training_cases import ATOL, BF16_ATOL, RTOL, make_case

from vllm_sampling_mask.training import (
    PackedMasks,
    support_logprobs,
    support_logprobs_reference,
)


def _values_and_grad(fn, logits, *args, return_full, **kwargs):
    """Outputs of ``fn`` and d(random weighted sum of outputs)/d(logits)."""
    leaf = logits.detach().clone().requires_grad_()
    outputs = fn(leaf, *args, return_full=return_full, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    weights = torch.Generator().manual_seed(7)
    loss = sum((out * torch.randn(out.shape, generator=weights)).sum() for out in outputs)
    loss.backward()
    return [out.detach() for out in outputs], leaf.grad


@pytest.mark.parametrize("vocab_size", [111, 1000])
@pytest.mark.parametrize("return_full", [False, True], ids=["kept", "kept+full"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_dense_recipe(vocab_size: int, return_full: bool, temperature: float) -> None:
    case = make_case(num_tokens=37, vocab_size=vocab_size, seed=vocab_size)
    logits = torch.randn(37, vocab_size, generator=torch.Generator().manual_seed(1)) * 3
    kwargs = dict(valid=case.valid, temperature=temperature)
    fast, fast_grad = _values_and_grad(support_logprobs, logits, case.token_ids, case.masks,
                                       return_full=return_full, chunk_size=5, **kwargs)
    dense, dense_grad = _values_and_grad(support_logprobs_reference, logits, case.token_ids,
                                         case.masks, return_full=return_full, **kwargs)
    for got, want in zip(fast, dense):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fast_grad, dense_grad, atol=ATOL, rtol=RTOL)
    # Not vacuous: scored rows carry real values and gradients, padding rows none.
    assert (fast[0][case.scored] < 0).sum() > 10
    assert fast_grad[~case.scored].abs().max() == 0
    if return_full:  # the full softmax gives every scored row a gradient, size-1 rows too
        assert fast_grad[case.scored].abs().sum(dim=1).min() > 0


def test_dense_reference_against_hand_computation() -> None:
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0), 5.0]])
    masks = PackedMasks.from_rows([[0, 1, 2]])
    kept, full = support_logprobs_reference(logits, torch.tensor([1]), masks, return_full=True)
    assert kept.item() == pytest.approx(math.log(2 / 6))
    assert full.item() == pytest.approx(math.log(2 / (6 + math.exp(5.0))))
    fast_kept, fast_full = support_logprobs(logits, torch.tensor([1]), masks, return_full=True)
    assert fast_kept.item() == pytest.approx(math.log(2 / 6), abs=1e-6)
    assert fast_full.item() == pytest.approx(full.item(), abs=1e-6)


def test_row_of_size_one_is_certain() -> None:
    logits = torch.randn(3, 50, requires_grad=True)
    masks = PackedMasks.from_rows([[7], [7], [1, 7]])
    kept = support_logprobs(logits, torch.tensor([7, 7, 7]), masks)
    assert kept[:2].tolist() == [0.0, 0.0]
    kept.sum().backward()
    assert logits.grad[:2].abs().max() == 0 and logits.grad[2].abs().max() > 0


def test_whole_vocabulary_row_equals_full_log_softmax() -> None:
    logits = torch.randn(4, 111) * 4
    masks = PackedMasks.from_rows([list(range(111))] * 4)
    tokens = torch.tensor([0, 50, 110, 3])
    kept, full = support_logprobs(logits, tokens, masks, return_full=True)
    expected = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(kept, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(full, expected, atol=ATOL, rtol=RTOL)


def test_padding_rows_are_zero_without_gradient() -> None:
    logits = torch.randn(4, 20, requires_grad=True)
    masks = PackedMasks.from_rows([[1, 2], [], [3, 4], [5, 6]])
    tokens = torch.tensor([2, -100, 4, 6])
    valid = torch.tensor([True, True, False, True])
    kept, full = support_logprobs(logits, tokens, masks, valid=valid, return_full=True)
    assert kept[1].item() == 0 and kept[2].item() == 0 and full[1].item() == 0
    assert kept[0].item() < 0 and full[3].item() < kept[3].item()
    (kept.sum() + full.sum()).backward()
    assert logits.grad[1:3].abs().max() == 0
    assert logits.grad[[0, 3]].abs().min(dim=1).values.min() > 0  # full softmax touches every id


def test_sampled_token_outside_its_row() -> None:
    logits = torch.randn(3, 20, requires_grad=True)
    masks = PackedMasks.from_rows([[1, 2], [3, 4], [5]])
    tokens = torch.tensor([2, 9, 5])
    with pytest.raises(ValueError, match="got token 9 at position 1 outside its row of 2 ids"):
        support_logprobs(logits, tokens, masks)
    kept = support_logprobs(logits, tokens, masks, check=False)
    assert kept[1].item() == float("-inf") and math.isfinite(kept[0].item())
    kept[[0, 2]].sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[1].abs().max() == 0


@pytest.mark.parametrize("rows, tokens, message", [
    ([[1, 2], [3, 25]], [2, 3], r"vocab_size=20\).*got 25 in row 1"),
    ([[1, 2], [3, 4]], [2, 21], r"token_ids must lie in \[0, vocab_size=20\).*got 21 at position 1"),
    ([[1, 2]], [2, 3], r"one row per token \(2\), got 1 rows"),
    ([[2, 1], [3]], [2, 3], "strictly ascending"),
])
def test_invalid_inputs_raise(rows, tokens, message) -> None:
    with pytest.raises(ValueError, match=message):
        support_logprobs(torch.randn(2, 20), torch.tensor(tokens), PackedMasks.from_rows(rows))


def test_argument_checks() -> None:
    masks = PackedMasks.from_rows([[1]])
    with pytest.raises(ValueError, match=r"logits.view\(B \* L, V\)"):
        support_logprobs(torch.randn(1, 1, 20), torch.tensor([1]), masks)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        support_logprobs(torch.randn(1, 20), torch.tensor([1]), masks, temperature=0)


def test_strided_logits() -> None:
    """A transposed (non-contiguous) logits view gives the same values and gradients."""
    case = make_case(num_tokens=12, vocab_size=111, seed=3)
    storage = torch.randn(111, 12, requires_grad=True)
    kept = support_logprobs(storage.T, case.token_ids, case.masks, valid=case.valid)
    kept.sum().backward()
    contiguous = storage.detach().T.contiguous().requires_grad_()
    dense = support_logprobs_reference(contiguous, case.token_ids, case.masks, valid=case.valid)
    dense.sum().backward()
    torch.testing.assert_close(kept.detach(), dense.detach(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(storage.grad.T, contiguous.grad, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("return_full", [False, True])
def test_bfloat16_logits_against_fp32_reference(return_full: bool) -> None:
    case = make_case(num_tokens=24, vocab_size=1000, seed=11)
    logits = (torch.randn(24, 1000) * 3).bfloat16()
    fast, fast_grad = _values_and_grad(support_logprobs, logits, case.token_ids, case.masks,
                                       return_full=return_full, valid=case.valid)
    dense, dense_grad = _values_and_grad(support_logprobs_reference, logits.float(),
                                         case.token_ids, case.masks, return_full=return_full,
                                         valid=case.valid)
    assert fast_grad.dtype == torch.bfloat16
    for got, want in zip(fast, dense):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32 math on bf16 inputs
    torch.testing.assert_close(fast_grad.float(), dense_grad, atol=BF16_ATOL, rtol=BF16_ATOL)


def test_bfloat16_gradient_of_confident_tokens_is_rounded_once() -> None:
    """With both outputs, the gradient at a sampled token of probability ~1 is a small difference
    of large terms ((1 - p) * g): rounded to bf16 once it keeps ~3 significant digits, rounded
    term by term it would lose them all."""
    num_tokens, vocab_size = 16, 256
    generator = torch.Generator().manual_seed(3)
    token_ids = torch.randint(0, vocab_size, (num_tokens,), generator=generator)
    logits = torch.randn(num_tokens, vocab_size, generator=generator)
    logits[torch.arange(num_tokens), token_ids] = 14.0  # p ~ 1 - 2e-4 over the vocabulary
    rows = [sorted({int(t)} | set(torch.randperm(vocab_size, generator=generator)[:7].tolist()))
            for t in token_ids]
    masks = PackedMasks.from_rows(rows)
    logits = logits.bfloat16()
    _, fast_grad = _values_and_grad(support_logprobs, logits, token_ids, masks, return_full=True,
                                    chunk_size=5)
    _, exact_grad = _values_and_grad(support_logprobs_reference, logits.double(), token_ids,
                                     masks, return_full=True)
    at_tokens = torch.arange(num_tokens), token_ids
    got, want = fast_grad[at_tokens].double(), exact_grad[at_tokens]
    assert want.abs().min() > 0
    assert ((got - want).abs() / want.abs()).max() < 2 ** -7  # one bf16 rounding: <= 2 ** -8
    torch.testing.assert_close(fast_grad.double(), exact_grad, atol=1e-6, rtol=2 ** -7)


def test_batched_padded_layout() -> None:
    """[B, L, V] logits through .view(B * L, V) with pack_padded_batch masks."""
    from vllm_sampling_mask.training import pack_padded_batch

    logits = torch.randn(2, 5, 30)
    positions = torch.tensor([[False, True, True, True, False], [True, True, False, False, False]])
    sequence_masks = [[[1, 2], [3], [4, 5, 6]], [[7, 8], [0, 29]]]
    labels = torch.full((2, 5), -100)
    labels[positions] = torch.tensor([2, 3, 6, 7, 29])
    masks = pack_padded_batch(sequence_masks, positions)
    kept = support_logprobs(logits.view(10, 30), labels.view(10), masks).view(2, 5)
    expected = torch.zeros(2, 5)
    for (b, l), row, token in zip(positions.nonzero().tolist(),
                                  [r for seq in sequence_masks for r in seq], [2, 3, 6, 7, 29]):
        expected[b, l] = logits[b, l, row].log_softmax(-1)[row.index(token)]
    torch.testing.assert_close(kept, expected, atol=ATOL, rtol=RTOL)
