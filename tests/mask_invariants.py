"""Checks every test of real generations applies to a completion's mask (CPU and GPU)."""

from __future__ import annotations

import math
from typing import Any


def check_completion(completion: Any, *, with_logprobs: bool) -> list[str]:
    """Return the violations of the mask contract for one ``CompletionOutput`` (empty = fine).

    Contract: one row per token; each row ascending without duplicates; the sampled token is in
    its row; with logprobs (processed, at least the row's width requested), the tokens returned
    with a finite logprob are exactly the row and their probabilities sum to 1.
    """
    problems: list[str] = []
    mask = completion.sampling_mask
    if mask is None:
        return ["sampling_mask is None"]
    rows = mask.token_ids
    if len(rows) != len(completion.token_ids):
        problems.append(f"{len(rows)} rows for {len(completion.token_ids)} tokens")
    for i, (token, row) in enumerate(zip(completion.token_ids, rows)):
        if any(a >= b for a, b in zip(row, row[1:])):
            problems.append(f"row {i} not strictly ascending")
        if token not in row:
            problems.append(f"token {i} ({token}) not in its row")
        if with_logprobs and completion.logprobs is not None:
            entries = completion.logprobs[i]
            if len(entries) < len(row):
                problems.append(f"row {i}: {len(entries)} logprobs for a row of {len(row)} ids: "
                                "the test must request logprobs >= the row width")
                continue
            finite = sorted(t for t, lp in entries.items() if math.isfinite(lp.logprob))
            if finite != row:
                problems.append(f"row {i}: finite logprob tokens {finite[:8]}... != row {row[:8]}...")
            total = math.fsum(math.exp(lp.logprob) for lp in entries.values() if math.isfinite(lp.logprob))
            if abs(math.log(total)) > 1e-4 if total > 0 else True:
                problems.append(f"row {i}: logsumexp of kept logprobs is {math.log(total) if total else '-inf'}")
    return problems


def mask_problems(token_ids: list[int], rows: list[list[int]], vocab_size: int) -> list[str]:
    """Violations of the HTTP mask contract for one choice (empty = fine)."""
    problems = []
    if len(rows) != len(token_ids):
        problems.append(f"{len(rows)} rows for {len(token_ids)} tokens")
    for i, (token, row) in enumerate(zip(token_ids, rows)):
        if any(a >= b for a, b in zip(row, row[1:])):
            problems.append(f"row {i} not strictly ascending")
        if token not in row:
            problems.append(f"token {i} ({token}) not in its row")
        if row and not (0 <= row[0] and row[-1] < vocab_size):
            problems.append(f"row {i} has ids outside [0, {vocab_size})")
    return problems
