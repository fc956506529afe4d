"""Random test cases shared by the log-prob tests (no test functions here)."""

from dataclasses import dataclass

import torch

from vllm_sampling_mask.training import IGNORE_INDEX, PackedMasks

ATOL = 1e-5  # fp32 fast path vs fp32 dense reference, values and gradients
RTOL = 1e-5
BF16_ATOL = 3e-2  # bf16 inputs vs the fp32 reference on the same (rounded) values


@dataclass
class Case:
    token_ids: torch.Tensor  # [T] int64, IGNORE_INDEX on padding rows
    masks: PackedMasks
    valid: torch.Tensor  # [T] bool, False on a few extra padding rows
    scored: torch.Tensor  # [T] bool, rows that are neither ignored nor invalid


def make_case(num_tokens: int, vocab_size: int, seed: int) -> Case:
    """Rows of every kind: size 1, the whole vocabulary, small and wide random sets, and
    padding rows (ignore_index with an empty row, and valid=False with a non-empty row)."""
    generator = torch.Generator().manual_seed(seed)
    rows, tokens = [], []
    for t in range(num_tokens):
        kind = t % 6
        if kind == 0:
            size = 1
        elif kind == 1:
            size = vocab_size
        elif kind == 2:
            size = int(torch.randint(2, 6, (), generator=generator))
        else:
            size = int(torch.randint(2, vocab_size, (), generator=generator))
        ids = torch.randperm(vocab_size, generator=generator)[:size].sort().values
        rows.append(ids.tolist())
        tokens.append(int(ids[torch.randint(size, (), generator=generator)]))
    valid = torch.ones(num_tokens, dtype=torch.bool)
    for t in range(4, num_tokens, 7):  # ignored: token -100, empty mask row
        tokens[t], rows[t] = IGNORE_INDEX, []
    for t in range(5, num_tokens, 11):  # invalid by mask, row left in place
        valid[t] = False
    token_ids = torch.tensor(tokens)
    return Case(token_ids=token_ids, masks=PackedMasks.from_rows(rows), valid=valid,
                scored=valid & (token_ids != IGNORE_INDEX))
