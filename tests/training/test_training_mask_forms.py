"""Every log-prob function takes masks in whichever form a rollout returns them, and nothing else."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_sampling_mask.compact_format import COMPACT_ENCODING, DELTA_VARINT_ENCODING, encode_compact
from vllm_sampling_mask.outputs import SamplingMask
from vllm_sampling_mask.training import (
    PackedMasks,
    support_logprobs,
    support_logprobs_from_hidden,
    support_logprobs_reference,
)

VOCAB, HIDDEN = 11, 4
# Two completions of 3 and 2 tokens; the sampled token is in every row.
FIRST_ROWS, SECOND_ROWS = [[1, 4, 7], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5]], [[2, 9], [3, 6, 8]]
ROWS = FIRST_ROWS + SECOND_ROWS
TOKENS = torch.tensor([4, 10, 5, 9, 3])


def undecoded(rows: list[list[int]]) -> SamplingMask:
    """Our SamplingMask as the engine hands it over (int32 bytes, lists never built)."""
    ids = np.array([i for row in rows for i in row], dtype="<i4")
    return SamplingMask.from_wire([len(row) for row in rows], ids.tobytes())


FORMS = {
    "rows (sampling_mask.token_ids)": lambda: ROWS,
    "tuple rows": lambda: tuple(tuple(row) for row in ROWS),
    "numpy rows": lambda: [np.asarray(row, dtype=np.int64) for row in ROWS],
    "one SamplingMask": lambda: SamplingMask(ROWS),
    "list of SamplingMask": lambda: [SamplingMask(FIRST_ROWS), undecoded(SECOND_ROWS)],
    "list of upstream SamplingMask": lambda: [SimpleNamespace(token_ids=FIRST_ROWS),
                                              SimpleNamespace(token_ids=SECOND_ROWS)],
    "PackedMasks": lambda: PackedMasks.from_rows(ROWS),
    "compact dict": lambda: encode_compact(ROWS, encoding=DELTA_VARINT_ENCODING),
    "compact int32 dict": lambda: encode_compact(ROWS, encoding=COMPACT_ENCODING),
    "streamed compact chunks": lambda: [encode_compact(ROWS[:2]), encode_compact(ROWS[2:3]),
                                        encode_compact([]), encode_compact(ROWS[3:])],
}


def _logits_and_head() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(len(ROWS), HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator)
    return hidden @ weight.T, hidden, weight


@pytest.mark.parametrize("form", FORMS)
def test_every_function_takes_every_form(form: str) -> None:
    logits, hidden, weight = _logits_and_head()
    expected = support_logprobs(logits, TOKENS, PackedMasks.from_rows(ROWS), temperature=0.7)
    got = support_logprobs(logits, TOKENS, FORMS[form](), temperature=0.7)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(
        support_logprobs_from_hidden(hidden, weight, TOKENS, FORMS[form](), temperature=0.7),
        expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        support_logprobs_reference(logits, TOKENS, FORMS[form](), temperature=0.7),
        expected, rtol=1e-5, atol=1e-5)
    assert PackedMasks.from_any(FORMS[form]()).to_rows() == ROWS


def test_rows_exactly_as_vllm_returns_them_are_differentiable() -> None:
    # The call of issue 14: support_logprobs(logits, token_ids, completion.sampling_mask.token_ids)
    completion = SimpleNamespace(token_ids=TOKENS.tolist(), sampling_mask=undecoded(ROWS))
    logits = _logits_and_head()[0].requires_grad_()
    kept = support_logprobs(logits, torch.tensor(completion.token_ids),
                            completion.sampling_mask.token_ids)
    kept.sum().backward()
    assert kept[2].item() == 0.0  # a row of one id: the token was certain
    assert logits.grad[0, [0, 2, 3]].abs().sum() == 0  # ids outside row 0 get no gradient
    assert logits.grad[0, [1, 4, 7]].abs().sum() > 0


ACCEPTED = ("masks must be a PackedMasks, rows as list[list[int]] (SamplingMask.token_ids), a "
            "SamplingMask (or any object with .token_ids), a compact wire-format dict "
            "{'encoding': 'csr-...', ...}, or a list of SamplingMask / compact dicts / PackedMasks "
            "(concatenated in order), got ")


@pytest.mark.parametrize("masks, got", [
    (None, "NoneType (a completion without sampling_mask: start the engine with "
           "return_sampling_mask=True)."),
    (torch.tensor([[1, 4, 7]]), "Tensor."),
    (5, "int."),
    ("[[1, 4]]", "str."),
    ({1, 4}, "set."),
    ([[1, 4], [2.0, 5]], "list whose row 1 holds float at position 0."),
    ([[1, 4], None], "list whose element 1 is NoneType."),
    ([1, 4, 7], "list whose element 0 is int."),
    (SimpleNamespace(token_ids=None), "NoneType (a completion without sampling_mask: start the "
                                      "engine with return_sampling_mask=True)."),
])
def test_anything_else_is_a_type_error_naming_the_accepted_forms(masks: object, got: str) -> None:
    logits, hidden, weight = _logits_and_head()
    tokens = TOKENS[:1]
    for call in (lambda: support_logprobs(logits[:1], tokens, masks),
                 lambda: support_logprobs_from_hidden(hidden[:1], weight, tokens, masks),
                 lambda: support_logprobs_reference(logits[:1], tokens, masks),
                 lambda: PackedMasks.from_any(masks)):
        with pytest.raises(TypeError) as error:
            call()
        assert str(error.value) == ACCEPTED + got
