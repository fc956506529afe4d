"""Per-row bookkeeping shared by the log-prob functions (input checks, padding, segment ops)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_sampling_mask.training.packed import MasksLike, PackedMasks

IGNORE_INDEX = -100
"""Default ``token_ids`` value of padding positions (the Hugging Face ``labels`` convention)."""


@dataclass(frozen=True)
class ScoredRows:
    """Index tensors describing which (row, id) pairs a log-prob computation touches.

    Attributes:
        scored: ``[T] bool`` False on padding rows (their output is 0, with no gradient).
        token_ids: ``[T] int64`` sampled ids, 0 on padding rows (safe to index with).
        has_token: ``[T] bool`` the sampled id appears in its mask row.
        kept_rows: ``[N] int64`` row of each kept id (``PackedMasks.row_index``).
        kept_ids: ``[N] int64`` kept vocabulary ids, rows concatenated.
        kept_is_sampled: ``[N] bool`` the kept id is its row's sampled id.
        offsets: ``[T + 1] int64`` row boundaries in ``kept_ids`` (on the masks' device).
    """

    scored: torch.Tensor
    token_ids: torch.Tensor
    has_token: torch.Tensor
    kept_rows: torch.Tensor
    kept_ids: torch.Tensor
    kept_is_sampled: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.scored.numel()


def prepare_rows(
    token_ids: torch.Tensor,
    masks: MasksLike,
    vocab_size: int,
    device: torch.device,
    valid: torch.Tensor | None,
    ignore_index: int,
    check: bool,
) -> ScoredRows:
    """Resolve padding, pack the masks on ``device`` and (if ``check``) validate everything.

    Args:
        token_ids: ``[T]`` integer sampled ids; ``ignore_index`` marks padding.
        masks: ``T`` rows in any form ``PackedMasks.from_any`` accepts; row ``t`` is the kept
            set of ``token_ids[t]``.
        valid: optional ``[T] bool``; False marks padding too.
        check: validate the masks (``PackedMasks.validate``), the sampled ids' range and that
            each scored row contains its sampled id. Costs a few device syncs.

    Raises ``TypeError`` on masks of no accepted form, ``ValueError`` on a shape mismatch, and
    with ``check`` on the first invalid value.
    """
    if token_ids.dim() != 1:
        raise ValueError(
            f"token_ids must be 1-D [T], got shape {tuple(token_ids.shape)}. Flatten a [B, L] "
            f"batch with .view(-1) and lay its masks out with pack_padded_batch."
        )
    num_rows = token_ids.numel()
    masks = PackedMasks.from_any(masks, device=device)
    if masks.num_rows != num_rows:
        raise ValueError(
            f"masks must have one row per token ({num_rows}), got {masks.num_rows} rows."
        )
    token_ids = token_ids.to(device=device, dtype=torch.int64)
    scored = token_ids != ignore_index
    if valid is not None:
        if valid.shape != token_ids.shape:
            raise ValueError(
                f"valid must have the shape of token_ids {tuple(token_ids.shape)}, got "
                f"{tuple(valid.shape)}."
            )
        scored = scored & valid.to(device=device, dtype=torch.bool)
    safe_token_ids = torch.where(scored, token_ids, 0)

    if check:
        masks.validate(vocab_size)
    kept_rows = masks.row_index()
    kept_ids = masks.token_ids.long()
    kept_is_sampled = kept_ids == safe_token_ids[kept_rows]
    hits = torch.zeros(num_rows, dtype=torch.int32, device=device)
    has_token = hits.index_add_(0, kept_rows, kept_is_sampled.to(torch.int32)) > 0

    if check:
        bad_token = scored & ((token_ids < 0) | (token_ids >= vocab_size))
        if bool(bad_token.any()):
            position = int(torch.nonzero(bad_token)[0])
            raise ValueError(
                f"token_ids must lie in [0, vocab_size={vocab_size}) or equal ignore_index="
                f"{ignore_index}, got {int(token_ids[position])} at position {position}."
            )
        missing = scored & ~has_token
        if bool(missing.any()):
            position = int(torch.nonzero(missing)[0])
            raise ValueError(
                f"the sampled token must be in its sampling-mask row, got token "
                f"{int(token_ids[position])} at position {position} outside its row of "
                f"{int(masks.row_lengths[position])} ids. Row t must belong to token_ids[t] "
                f"(check the alignment of logits, token_ids and masks); with check=False such "
                f"rows get log-prob -inf."
            )
    return ScoredRows(
        scored=scored,
        token_ids=safe_token_ids,
        has_token=has_token,
        kept_rows=kept_rows,
        kept_ids=kept_ids,
        kept_is_sampled=kept_is_sampled,
        offsets=masks.offsets,
    )


def segment_logsumexp(values: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Per-row logsumexp of a CSR-ordered vector (not differentiable; call under no-grad).

    Args:
        values: ``[N] float32``.
        rows: ``[N] int64`` row of each value.

    Returns:
        ``[num_rows] float32``; ``-inf`` for rows with no values.
    """
    row_max = torch.full((num_rows,), float("-inf"), dtype=values.dtype, device=values.device)
    row_max.scatter_reduce_(0, rows, values, reduce="amax", include_self=True)
    # Empty (or all -inf) rows: shift by 0 so exp() sees -inf, not nan.
    shift = torch.where(torch.isfinite(row_max), row_max, 0.0)
    sums = torch.zeros_like(row_max).index_add_(0, rows, torch.exp(values - shift[rows]))
    return torch.log(sums) + shift


def temperature_scaled(rows: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """``rows`` itself when ``inv_temperature == 1``, else a fresh float32 ``rows * inv_temperature``
    (scaling in bf16 would round the logits)."""
    if inv_temperature == 1.0:
        return rows
    return rows.to(torch.float32, copy=True).mul_(inv_temperature)
