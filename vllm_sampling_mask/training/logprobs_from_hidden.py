"""Kept-set log-probs straight from the last hidden states and the LM head: no ``[T, V]`` logits.

Per chunk of ``C`` tokens, the logits are computed only for the union ``U`` of the chunk's kept
ids and sampled ids (``hidden_chunk @ weight[U].T``, a ``[C, |U|]`` matmul) and the ``N`` kept
logits are gathered and kept (``[N] float32``); a segment logsumexp reduces them per row. The
backward scatters the ``[N]`` logit gradients back into ``[C, |U|]`` per chunk and runs the
hidden and weight matmuls; nothing ``[T, V]`` is ever allocated. ``return_full`` adds a
``[C, V]`` full-vocabulary log-softmax per chunk, recomputed in the backward.
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
    temperature_scaled,
)
from vllm_sampling_mask.training.packed import MasksLike

DEFAULT_TOKEN_CHUNK = 256
"""Tokens per chunk: the chunk's logits are ``[C, |U|]`` with ``|U| <= C * (K + 1)``."""


def support_logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    masks: MasksLike,
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
        masks: ``T`` rows, row ``t`` the kept set of ``token_ids[t]``, in any form
            ``PackedMasks.from_any`` accepts (as in ``support_logprobs``).
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
    bias gradients are accumulated chunk by chunk in their own dtype. Syncs the device to plan
    the chunks (and to validate, with ``check``). Raises ``TypeError`` on masks of no accepted
    form.
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
    """Tokens ``[start, end)``, their kept ids ``[entry_start, entry_end)`` of the CSR, and the
    vocabulary ids whose logits they need.

    Attributes:
        union_ids: ``[U] int64`` ascending union of the chunk's kept ids and sampled ids.
        entry_flat: ``[entry_end - entry_start] int64`` index of each kept id's logit in the
            chunk's flattened ``[end - start, U]`` logits.
        token_flat: ``[end - start] int64`` index of each sampled id's logit there.
    """

    start: int
    end: int
    entry_start: int
    entry_end: int
    union_ids: torch.Tensor
    entry_flat: torch.Tensor
    token_flat: torch.Tensor


def _plan_chunks(rows: ScoredRows, vocab_size: int, chunk_size: int) -> list[_Chunk]:
    """Per-chunk unions of kept and sampled ids, from one global ``unique`` (one sync)."""
    num_rows = rows.num_rows
    device = rows.scored.device
    num_chunks = -(-num_rows // chunk_size)
    token_rows = torch.arange(num_rows, device=device)
    entry_chunk = rows.kept_rows // chunk_size  # [N]
    token_chunk = token_rows // chunk_size  # [T]
    # Key (chunk, id) pairs so one sorted unique gives every chunk's union, chunk by chunk.
    keys = torch.cat([entry_chunk * vocab_size + rows.kept_ids,
                      token_chunk * vocab_size + rows.token_ids])
    unique_keys, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    chunk_index = torch.arange(num_chunks + 1, device=device)
    union_bounds = torch.searchsorted(unique_keys, chunk_index * vocab_size)  # [chunks + 1]
    union_sizes = union_bounds[1:] - union_bounds[:-1]  # [chunks]
    entry_bounds = rows.offsets[(chunk_index * chunk_size).clamp(max=num_rows)]  # [chunks + 1]
    union_bounds_host, entry_bounds_host = torch.stack([union_bounds, entry_bounds]).tolist()

    num_entries = rows.kept_ids.numel()
    union_ids = unique_keys % vocab_size
    # Flat position in the chunk's [C, U] logits: local row * U + column in the union.
    entry_flat = ((rows.kept_rows - entry_chunk * chunk_size) * union_sizes[entry_chunk]
                  + inverse[:num_entries] - union_bounds[entry_chunk])
    token_flat = ((token_rows - token_chunk * chunk_size) * union_sizes[token_chunk]
                  + inverse[num_entries:] - union_bounds[token_chunk])
    chunks = []
    for c in range(num_chunks):
        start, end = c * chunk_size, min((c + 1) * chunk_size, num_rows)
        e0, e1 = entry_bounds_host[c], entry_bounds_host[c + 1]
        chunks.append(_Chunk(
            start=start,
            end=end,
            entry_start=e0,
            entry_end=e1,
            union_ids=union_ids[union_bounds_host[c]:union_bounds_host[c + 1]],
            entry_flat=entry_flat[e0:e1],
            token_flat=token_flat[start:end],
        ))
    return chunks


class _HiddenSupportLogprobs(torch.autograd.Function):
    """Chunked kept-set (and optionally full-vocabulary) log-probs.

    The forward keeps the ``N`` kept logits (fp32), so the kept-set backward needs no logits
    recompute: per chunk it scatters the ``[N]`` logit gradients into ``[C, U]`` and runs the
    two weight/hidden matmuls. The full-vocabulary part recomputes ``[C, V]`` per chunk.
    """

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
        kept = torch.empty(rows.kept_ids.numel(), dtype=torch.float32, device=hidden.device)
        token_logits = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
        full_lp = torch.empty_like(token_logits) if return_full else None
        for chunk in chunks:
            hidden_chunk = hidden[chunk.start:chunk.end]
            union_logits = F.linear(  # [C, U], in the inputs' dtype
                hidden_chunk, weight.index_select(0, chunk.union_ids),
                None if bias is None else bias.index_select(0, chunk.union_ids)).view(-1)
            kept[chunk.entry_start:chunk.entry_end] = union_logits[chunk.entry_flat]
            token_logits[chunk.start:chunk.end] = union_logits[chunk.token_flat]
            if full_lp is not None:
                logprobs = torch.log_softmax(  # [C, V] fp32
                    temperature_scaled(F.linear(hidden_chunk, weight, bias), inv_temperature),
                    dim=-1, dtype=torch.float32)
                full_lp[chunk.start:chunk.end] = logprobs.gather(
                    1, rows.token_ids[chunk.start:chunk.end, None])[:, 0]
        kept.mul_(inv_temperature)
        token_logits.mul_(inv_temperature)
        lse_kept = segment_logsumexp(kept, rows.kept_rows, num_rows)

        ctx.save_for_backward(hidden, weight, bias)
        ctx.rows = rows
        ctx.chunks = chunks
        ctx.inv_temperature = inv_temperature
        ctx.kept = kept
        ctx.lse_kept = lse_kept
        ctx.return_full = return_full
        kept_lp = torch.where(rows.has_token, token_logits - lse_kept, float("-inf"))
        kept_lp = torch.where(rows.scored, kept_lp, 0.0)
        if full_lp is None:
            return kept_lp
        return kept_lp, torch.where(rows.scored, full_lp, 0.0)

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: FunctionCtx, grad_kept: torch.Tensor, grad_full: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias = ctx.saved_tensors
        rows: ScoredRows = ctx.rows
        inv_temperature: float = ctx.inv_temperature
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        vocab_size = weight.shape[0]
        # Constant outputs (padding rows, rows missing their token) pass no gradient.
        g_kept = torch.where(rows.scored & rows.has_token, grad_kept.float(), 0.0) * inv_temperature
        # d(kept log-prob)/d(kept logit) = one-hot(token) - softmax over the row, [N] fp32.
        kept_grad = g_kept[rows.kept_rows] * (
            rows.kept_is_sampled.float() - torch.exp(ctx.kept - ctx.lse_kept[rows.kept_rows]))
        g_full = None
        if ctx.return_full:
            g_full = torch.where(rows.scored, grad_full.float(), 0.0) * inv_temperature

        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) \
            if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        for chunk in ctx.chunks:
            s, e = chunk.start, chunk.end
            hidden_chunk = hidden[s:e]
            num_union = chunk.union_ids.numel()
            grad_union = torch.zeros((e - s) * num_union, dtype=torch.float32,
                                     device=hidden.device)
            grad_union.index_add_(0, chunk.entry_flat,
                                  kept_grad[chunk.entry_start:chunk.entry_end])
            grad_union = grad_union.view(e - s, num_union)  # [C, U] fp32

            if g_full is None:
                if need_bias:
                    grad_bias.index_add_(0, chunk.union_ids, grad_union.sum(0).to(bias.dtype))
                grad_logits = grad_union.to(weight.dtype)
                if need_hidden:
                    grad_hidden[s:e] = grad_logits @ weight.index_select(0, chunk.union_ids)
                if need_weight:
                    grad_weight.index_add_(0, chunk.union_ids, grad_logits.T @ hidden_chunk)
                continue
            # Full vocabulary: (one-hot(token) - softmax(all logits)) * g_full, plus the union.
            full_grad = torch.softmax(  # [C, V] fp32, recomputed
                temperature_scaled(F.linear(hidden_chunk, weight, bias), inv_temperature),
                dim=-1, dtype=torch.float32).mul_(-g_full[s:e, None])
            local_rows = torch.arange(e - s, device=hidden.device)
            full_grad.view(-1).index_add_(0, local_rows * vocab_size + rows.token_ids[s:e],
                                          g_full[s:e])
            full_grad.index_add_(1, chunk.union_ids, grad_union)
            if need_bias:
                grad_bias.add_(full_grad.sum(0).to(bias.dtype))
            grad_logits = full_grad.to(weight.dtype)  # [C, V]
            if need_hidden:
                grad_hidden[s:e] = grad_logits @ weight
            if need_weight:
                grad_weight.addmm_(grad_logits.T, hidden_chunk)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None
