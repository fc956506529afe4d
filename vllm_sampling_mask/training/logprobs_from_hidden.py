"""Kept-set log-probs straight from the last hidden states and the LM head: no ``[T, V]`` logits.

Per chunk of ``C`` tokens, the logits are computed only for the union ``U`` of the chunk's kept
ids and sampled ids (``hidden_chunk @ weight[U].T``, a ``[C, |U|]`` matmul), gathered per row,
and reduced with a segment logsumexp. The backward recomputes each chunk (nothing ``[T, V]`` is
saved) and accumulates the weight gradient rows of ``U``. ``return_full`` adds a chunked
``[C, V]`` full-vocabulary logsumexp, also recomputed in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable

from vllm_sampling_mask.training._rows import (
    IGNORE_INDEX,
    ScoredRows,
    prepare_rows,
    segment_logsumexp,
)
from vllm_sampling_mask.training.packed import PackedMasks

DEFAULT_TOKEN_CHUNK = 256
"""Tokens per chunk: the chunk's logits are ``[C, |U|]`` with ``|U| <= C * (K + 1)``."""


def support_logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    masks: PackedMasks,
    *,
    lm_head_bias: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    temperature: float = 1.0,
    return_full: bool = False,
    check: bool = True,
    chunk_size: int = DEFAULT_TOKEN_CHUNK,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``support_logprobs(hidden @ lm_head_weight.T + lm_head_bias, ...)`` without the logits.

    Args:
        hidden: ``[T, H]`` float, the final hidden states (after the final norm) of the
            positions that score ``token_ids`` (for a causal LM: the position before each token).
        lm_head_weight: ``[V, H]``, same dtype as ``hidden``.
        token_ids: ``[T]`` integer sampled ids; ``ignore_index`` marks padding rows.
        masks: ``T`` rows, row ``t`` the kept set of ``token_ids[t]``.
        lm_head_bias: optional ``[V]``, same dtype as ``hidden``.
        valid, ignore_index, temperature, check: as in ``support_logprobs``.
        return_full: also return the full-vocabulary log-prob (adds a ``[C, V]`` matmul per
            chunk in the forward and again in the backward).
        chunk_size: tokens per chunk.

    Returns:
        ``[T] float32`` kept-set log-probs (and ``[T] float32`` full-vocabulary log-probs with
        ``return_full``); padding rows are 0 with no gradient.

    Differentiable w.r.t. ``hidden``, ``lm_head_weight`` and ``lm_head_bias``. Logits are
    computed in the inputs' dtype (as ``F.linear`` would) and reduced in fp32; the weight and
    bias gradients are accumulated chunk by chunk in their own dtype. Syncs the device once to
    plan the chunks (and once more with ``check``).
    """
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden must be [T, H] and lm_head_weight [V, H], got {tuple(hidden.shape)} and "
            f"{tuple(lm_head_weight.shape)}."
        )
    vocab_size = lm_head_weight.shape[0]
    dtypes = {hidden.dtype, lm_head_weight.dtype}
    if lm_head_bias is not None:
        if lm_head_bias.shape != (vocab_size,):
            raise ValueError(
                f"lm_head_bias must be [V] = [{vocab_size}], got {tuple(lm_head_bias.shape)}."
            )
        dtypes.add(lm_head_bias.dtype)
    if len(dtypes) != 1:
        raise ValueError(
            f"hidden, lm_head_weight and lm_head_bias must share a dtype, got "
            f"{sorted(str(d) for d in dtypes)}. Cast them as the model's forward would."
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}.")
    rows = prepare_rows(token_ids, masks, vocab_size, hidden.device, valid, ignore_index, check)
    chunks = _plan_chunks(rows, vocab_size, chunk_size)
    return _HiddenSupportLogprobs.apply(
        hidden, lm_head_weight, lm_head_bias, rows, chunks, 1.0 / temperature, return_full
    )


@dataclass(frozen=True)
class _Chunk:
    """Tokens ``[start, end)`` and the vocabulary ids whose logits they need.

    Attributes:
        union_ids: ``[U] int64`` ascending union of the chunk's kept ids and sampled ids.
        entry_rows: ``[n] int64`` chunk-local row of each of the chunk's kept ids.
        entry_cols: ``[n] int64`` position of each kept id in ``union_ids``.
        token_cols: ``[end - start] int64`` position of each sampled id in ``union_ids``.
    """

    start: int
    end: int
    union_ids: torch.Tensor
    entry_rows: torch.Tensor
    entry_cols: torch.Tensor
    token_cols: torch.Tensor


def _plan_chunks(rows: ScoredRows, vocab_size: int, chunk_size: int) -> list[_Chunk]:
    """Per-chunk unions of kept and sampled ids, from one global ``unique`` (one sync)."""
    num_rows = rows.num_rows
    device = rows.scored.device
    num_chunks = -(-num_rows // chunk_size)
    entry_chunk = rows.kept_rows // chunk_size  # [N]
    token_chunk = torch.arange(num_rows, device=device) // chunk_size  # [T]
    # Key (chunk, id) pairs so one sorted unique gives every chunk's union, chunk by chunk.
    keys = torch.cat([entry_chunk * vocab_size + rows.kept_ids,
                      token_chunk * vocab_size + rows.token_ids])
    unique_keys, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    chunk_index = torch.arange(num_chunks + 1, device=device)
    union_bounds = torch.searchsorted(unique_keys, chunk_index * vocab_size)  # [num_chunks + 1]
    entry_bounds = rows.offsets[(chunk_index * chunk_size).clamp(max=num_rows)]
    union_bounds_host, entry_bounds_host = torch.stack([union_bounds, entry_bounds]).tolist()

    num_entries = rows.kept_ids.numel()
    union_ids = unique_keys % vocab_size
    entry_cols = inverse[:num_entries] - union_bounds[entry_chunk]
    token_cols = inverse[num_entries:] - union_bounds[token_chunk]
    chunks = []
    for c in range(num_chunks):
        start, end = c * chunk_size, min((c + 1) * chunk_size, num_rows)
        e0, e1 = entry_bounds_host[c], entry_bounds_host[c + 1]
        chunks.append(_Chunk(
            start=start,
            end=end,
            union_ids=union_ids[union_bounds_host[c]:union_bounds_host[c + 1]],
            entry_rows=rows.kept_rows[e0:e1] - start,
            entry_cols=entry_cols[e0:e1],
            token_cols=token_cols[start:end],
        ))
    return chunks


def _scaled_logits(
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    inv_temperature: float,
) -> torch.Tensor:
    """``[C, rows of weight] float32`` logits ``(hidden_chunk @ weight.T + bias) / temperature``."""
    logits = F.linear(hidden_chunk, weight, bias).float()
    return logits if inv_temperature == 1.0 else logits.mul_(inv_temperature)


class _HiddenSupportLogprobs(torch.autograd.Function):
    """Chunked kept-set (and optionally full-vocabulary) log-probs; recomputes in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: ScoredRows,
        chunks: list[_Chunk],
        inv_temperature: float,
        return_full: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        num_rows = hidden.shape[0]
        lse_kept = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
        token_logits = torch.empty_like(lse_kept)
        lse_full = torch.empty_like(lse_kept) if return_full else None
        for chunk in chunks:
            hidden_chunk = hidden[chunk.start:chunk.end]
            union_logits = _scaled_logits(  # [C, U]
                hidden_chunk, weight.index_select(0, chunk.union_ids),
                None if bias is None else bias.index_select(0, chunk.union_ids), inv_temperature)
            kept = union_logits[chunk.entry_rows, chunk.entry_cols]
            lse_kept[chunk.start:chunk.end] = segment_logsumexp(
                kept, chunk.entry_rows, chunk.end - chunk.start)
            token_logits[chunk.start:chunk.end] = union_logits.gather(
                1, chunk.token_cols[:, None]).squeeze(1)
            if lse_full is not None:
                lse_full[chunk.start:chunk.end] = torch.logsumexp(
                    _scaled_logits(hidden_chunk, weight, bias, inv_temperature), dim=-1)

        ctx.save_for_backward(hidden, weight, bias)
        ctx.rows = rows
        ctx.chunks = chunks
        ctx.inv_temperature = inv_temperature
        ctx.lse_kept = lse_kept
        ctx.lse_full = lse_full
        kept_lp = torch.where(rows.has_token, token_logits - lse_kept, float("-inf"))
        kept_lp = torch.where(rows.scored, kept_lp, 0.0)
        if lse_full is None:
            return kept_lp
        return kept_lp, torch.where(rows.scored, token_logits - lse_full, 0.0)

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: FunctionCtx, grad_kept: torch.Tensor, grad_full: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias = ctx.saved_tensors
        rows: ScoredRows = ctx.rows
        inv_temperature: float = ctx.inv_temperature
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        # Constant outputs (padding rows, rows missing their token) pass no gradient.
        g_kept = torch.where(rows.scored & rows.has_token, grad_kept.float(), 0.0) * inv_temperature
        g_full = None
        if ctx.lse_full is not None:
            g_full = torch.where(rows.scored, grad_full.float(), 0.0) * inv_temperature

        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        for chunk in ctx.chunks:
            s, e = chunk.start, chunk.end
            hidden_chunk = hidden[s:e]
            weight_union = weight.index_select(0, chunk.union_ids)  # [U, H]
            union_logits = _scaled_logits(  # [C, U] fp32, recomputed
                hidden_chunk, weight_union,
                None if bias is None else bias.index_select(0, chunk.union_ids), inv_temperature)
            kept = union_logits[chunk.entry_rows, chunk.entry_cols]
            kept_probs = torch.exp(kept - ctx.lse_kept[s:e][chunk.entry_rows])
            # d(log-prob)/d(logits) over the union columns: one-hot(token) - softmax(kept set).
            grad_union = torch.zeros_like(union_logits)  # [C, U] fp32
            grad_union.view(-1).index_add_(
                0, chunk.entry_rows * grad_union.shape[1] + chunk.entry_cols,
                -g_kept[s:e][chunk.entry_rows] * kept_probs)
            g_token = g_kept[s:e] if g_full is None else g_kept[s:e] + g_full[s:e]
            grad_union.scatter_add_(1, chunk.token_cols[:, None], g_token[:, None])

            if g_full is None:
                grad_logits = grad_union.to(weight.dtype)  # [C, U]
                if need_hidden:
                    grad_hidden[s:e] = grad_logits @ weight_union
                if need_weight:
                    grad_weight.index_add_(0, chunk.union_ids, grad_logits.T @ hidden_chunk)
                if need_bias:
                    grad_bias.index_add_(0, chunk.union_ids, grad_union.sum(0).to(bias.dtype))
                continue
            # Full vocabulary: -g_full * softmax(all logits), plus the union columns.
            full_grad = _scaled_logits(hidden_chunk, weight, bias, inv_temperature)  # [C, V]
            full_grad.sub_(ctx.lse_full[s:e, None]).exp_().mul_(-g_full[s:e, None])
            full_grad.index_add_(1, chunk.union_ids, grad_union)
            if need_bias:
                grad_bias.add_(full_grad.sum(0).to(bias.dtype))
            grad_logits = full_grad.to(weight.dtype)  # [C, V]
            if need_hidden:
                grad_hidden[s:e] = grad_logits @ weight
            if need_weight:
                grad_weight.addmm_(grad_logits.T, hidden_chunk)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None
