"""pi_theta's log-prob of each sampled token, renormalised over its sampling mask (kept set).

For token ``t`` with kept set ``S_t`` and (temperature-scaled) logits ``z_t``::

    kept log-prob  = z_t[token_t] - logsumexp(z_t[S_t])
    full log-prob  = z_t[token_t] - logsumexp(z_t)          (return_full=True)

``support_logprobs`` gathers only the ``N = sum |S_t|`` kept logits, so its memory is O(N) on
top of the logits and their gradient: no ``[T, V]`` boolean mask, no masked copy, no
``[T, V]`` log-softmax output. ``support_logprobs_reference`` is the dense recipe, shipped as
the obviously-correct reference the tests and the benchmark compare against.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from vllm_sampling_mask.training._rows import (
    IGNORE_INDEX,
    ScoredRows,
    prepare_rows,
    segment_logsumexp,
    temperature_scaled,
)
from vllm_sampling_mask.training.packed import MasksLike, PackedMasks

DEFAULT_FULL_VOCAB_CHUNK = 1024
"""Rows per chunk of the full-vocabulary log-softmax (``[chunk, V] float32`` temporaries)."""


def support_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    masks: MasksLike,
    *,
    valid: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    return_full: bool = False,
    check: bool = True,
    chunk_size: int = DEFAULT_FULL_VOCAB_CHUNK,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each sampled token under the softmax restricted to its kept set.

    Args:
        logits: ``[T, V]`` float (fp32/bf16/fp16), any strides; row ``t`` scores
            ``token_ids[t]`` (for a causal LM: the logits of the position *before* the token).
            A ``[B, L, V]`` batch is passed as ``logits.view(B * L, V)`` (shift the labels,
            not the logits, so the view needs no copy).
        token_ids: ``[T]`` integer sampled ids; ``ignore_index`` marks padding rows.
        masks: ``T`` rows, row ``t`` the kept set of ``token_ids[t]``, in any form
            ``PackedMasks.from_any`` accepts: ``PackedMasks``, ``list[list[int]]``
            (``completion.sampling_mask.token_ids``), a ``SamplingMask``, a compact HTTP dict,
            or a list of several completions' masks (concatenated); moved to
            ``logits.device``. Padding rows' mask rows are ignored (usually empty).
        valid: optional ``[T] bool``; False marks padding rows as well.
        ignore_index: ``token_ids`` value of padding rows.
        temperature: the rollout's sampling temperature; logits are divided by it (vLLM's
            processed log-probs are temperature-scaled).
        return_full: also return the full-vocabulary log-prob.
        check: validate masks, ids and that each scored row contains its sampled id (raises
            ``ValueError`` with the first offending position). Costs a few device syncs; with
            ``check=False`` a row that misses its token gets ``-inf`` and invalid ids are
            undefined behaviour.
        chunk_size: rows per chunk of the full-vocabulary log-softmax (``return_full`` only).

    Returns:
        ``[T] float32`` kept-set log-probs, and with ``return_full`` a second ``[T] float32``
        of full-vocabulary log-probs. Padding rows are 0 and get no gradient. A row of size 1
        gives 0; computation is in fp32 whatever the logits' dtype.

    Differentiable w.r.t. ``logits``; the backward writes one ``[T, V]`` gradient in the
    logits' dtype and otherwise uses O(N) memory (plus ``[chunk_size, V]`` with
    ``return_full``). Raises ``TypeError`` on masks of no accepted form.
    """
    if logits.dim() != 2:
        raise ValueError(
            f"logits must be 2-D [T, V], got shape {tuple(logits.shape)}. Pass a [B, L, V] "
            f"batch as logits.view(B * L, V)."
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}.")
    rows = prepare_rows(token_ids, masks, logits.shape[1], logits.device, valid, ignore_index, check)
    full_chunk = chunk_size if return_full else None
    return _SupportLogprobs.apply(logits, rows, 1.0 / temperature, full_chunk)


class _SupportLogprobs(torch.autograd.Function):
    """Kept-set (and optionally full-vocabulary) log-probs with a single-buffer backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        logits: torch.Tensor,
        rows: ScoredRows,
        inv_temperature: float,
        full_chunk: int | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        num_rows = logits.shape[0]
        token_index = torch.arange(num_rows, device=logits.device)
        kept = logits[rows.kept_rows, rows.kept_ids].float() * inv_temperature  # [N]
        lse_kept = segment_logsumexp(kept, rows.kept_rows, num_rows)  # [T]
        token_logits = logits[token_index, rows.token_ids].float() * inv_temperature  # [T]
        kept_lp = torch.where(rows.has_token, token_logits - lse_kept, float("-inf"))
        kept_lp = torch.where(rows.scored, kept_lp, 0.0)

        # The kept-set backward needs only the logits' shape: keep the [T, V] tensor alive
        # (e.g. an fp32 upcast made for this call) only for the full-vocabulary one.
        ctx.save_for_backward(logits if full_chunk is not None else None)
        ctx.logits_spec = (logits.shape, logits.dtype, logits.device)
        ctx.rows = rows
        ctx.kept = kept
        ctx.lse_kept = lse_kept
        ctx.inv_temperature = inv_temperature
        ctx.full_chunk = full_chunk
        if full_chunk is None:
            return kept_lp
        full_lp = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
        for start in range(0, num_rows, full_chunk):
            end = min(start + full_chunk, num_rows)
            chunk_logprobs = torch.log_softmax(  # [chunk, V] fp32, one fused pass
                temperature_scaled(logits[start:end], inv_temperature), dim=-1,
                dtype=torch.float32)
            full_lp[start:end] = chunk_logprobs.gather(1, rows.token_ids[start:end, None])[:, 0]
        return kept_lp, torch.where(rows.scored, full_lp, 0.0)

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: FunctionCtx, grad_kept: torch.Tensor, grad_full: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None, None, None]:
        (logits,) = ctx.saved_tensors  # None without the full-vocabulary output
        (num_rows, vocab_size), dtype, device = ctx.logits_spec
        rows: ScoredRows = ctx.rows
        inv_temperature: float = ctx.inv_temperature
        # Rows whose output is a constant (padding: 0, token missing from its row: -inf)
        # pass no gradient.
        g_kept = torch.where(rows.scored & rows.has_token, grad_kept.float(), 0.0) * inv_temperature

        # Kept set: one-hot(token) - softmax over the row (the sampled id is in its row on every
        # row with g != 0), in fp32.
        kept_probs = torch.exp(ctx.kept - ctx.lse_kept[rows.kept_rows])  # [N]
        kept_grad = g_kept[rows.kept_rows] * (rows.kept_is_sampled.float() - kept_probs)  # [N]
        if ctx.full_chunk is None:
            grad = torch.zeros((num_rows, vocab_size), dtype=dtype, device=device)
            grad.view(-1).index_add_(0, rows.kept_rows * vocab_size + rows.kept_ids,
                                     kept_grad.to(dtype))
            return grad, None, None, None
        # Both outputs: each [chunk, V] slab sums its three terms in fp32 and is rounded to the
        # logits' dtype once (rounded separately, -p*g and +g cancel at a token with p ~ 1).
        grad = torch.empty((num_rows, vocab_size), dtype=dtype, device=device)
        g_full = torch.where(rows.scored, grad_full.float(), 0.0) * inv_temperature
        chunk = ctx.full_chunk
        starts = torch.arange(0, num_rows + chunk, chunk, device=rows.offsets.device)
        entry_bounds = rows.offsets[starts.clamp(max=num_rows)].tolist()  # kept entries by chunk
        for index, start in enumerate(range(0, num_rows, chunk)):
            end = min(start + chunk, num_rows)
            # d(full log-prob)/dz = one-hot(token) - softmax(z).
            slab = torch.softmax(temperature_scaled(logits[start:end], inv_temperature),
                                 dim=-1, dtype=torch.float32).mul_(-g_full[start:end, None])
            local_rows = torch.arange(end - start, device=device)
            slab[local_rows, rows.token_ids[start:end]] += g_full[start:end]
            lo, hi = entry_bounds[index], entry_bounds[index + 1]
            slab.view(-1).index_add_(
                0, (rows.kept_rows[lo:hi] - start) * vocab_size + rows.kept_ids[lo:hi],
                kept_grad[lo:hi])
            grad[start:end].copy_(slab)
        return grad, None, None, None


def support_logprobs_reference(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    masks: MasksLike,
    *,
    valid: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    return_full: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The dense recipe, computed in ``logits.dtype``: a ``[T, V]`` bool keep-mask,
    ``masked_fill(-inf)``, ``log_softmax``, ``gather``. Same arguments and outputs as
    ``support_logprobs`` (no validation), except that the outputs are in ``logits.dtype``;
    O(T x V) extra memory. For tests and benchmarks.
    """
    num_rows, vocab_size = logits.shape
    token_ids = token_ids.to(device=logits.device, dtype=torch.int64)
    scored = token_ids != ignore_index
    if valid is not None:
        scored = scored & valid.to(device=logits.device, dtype=torch.bool)
    safe_token_ids = torch.where(scored, token_ids, 0)[:, None]  # [T, 1]
    masks = PackedMasks.from_any(masks, device=logits.device)

    keep = torch.zeros((num_rows, vocab_size), dtype=torch.bool, device=logits.device)
    keep[masks.row_index(), masks.token_ids.long()] = True
    keep[~scored] = True  # padding rows: keep everything so the softmax stays finite
    scaled = logits / temperature
    kept_lp = scaled.masked_fill(~keep, float("-inf")).log_softmax(dim=-1)
    kept_lp = torch.where(scored, kept_lp.gather(1, safe_token_ids).squeeze(1), 0.0)
    if not return_full:
        return kept_lp
    full_lp = scaled.log_softmax(dim=-1).gather(1, safe_token_ids).squeeze(1)
    return kept_lp, torch.where(scored, full_lp, 0.0)
