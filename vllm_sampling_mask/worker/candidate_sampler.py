"""Top-k / top-p sampling that returns the kept set it sampled from (Triton + torch reference).

A mask step whose requests all have a ``top_k`` of at most ``MAX_CANDIDATES`` samples here
instead of in vLLM's top-k/top-p + Gumbel path followed by the ``[R, V]`` compaction:

1. ``top_candidates`` takes each row's ``K`` largest processed logits (``K`` = the batch's
   largest top_k), sorted descending: the candidates. NaN and +inf rank first (but FlashInfer's
   bf16 top-k ranks a NaN with its sign bit set last) and are never kept (a row whose top_k
   candidates are all non-finite keeps nothing and takes its first candidate; one with some
   samples among its finite ones, where vLLM's Gumbel path would take a +inf id. Mask requests
   with a non-finite logit_bias are refused, so only a broken model or an opted-out request
   gets there);
2. one Triton program per row keeps the first ``top_k`` finite candidates, then the top-p prefix
   of those (top-k first, then top-p over the renormalised top-k, vLLM's order), samples one of
   the kept ids with Gumbel noise seeded by the request's seed and position, sorts the kept ids
   ascending into the row's ``packed`` mask and, when logprobs are returned, either computes
   them itself (processed logprobs: the log-softmax over the kept ids, which vLLM would compute
   from a ``-inf``-filled ``[R, V]`` tensor) or writes the kept logits into such a tensor for
   vLLM (the logprobs of given token ids, or more top logprobs than candidates).

So the sampled token is drawn from exactly the ids written to its row, whatever the top-k does
with ties (it keeps exactly ``K``); a step costs the top-k and one kernel; the mask is
``[R, 1 + K]`` int32 with no bitmap; and the work after the top-k touches ``K`` ids per row
instead of the vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.triton_utils import tl, triton

# Largest top_k sampled here: a program sorts its row's candidates in registers.
MAX_CANDIDATES = 1024
_NO_ID = tl.constexpr(2**31 - 1)  # sorts after every vocabulary id


@dataclass
class CandidateSample:
    """Result of ``sample_from_candidates`` (tensors on the logits' device).

    sampled:   ``[R]`` int64, the sampled token of each row.
    packed:    ``[R, 1 + K]`` int32: column 0 the number of kept ids (<= K), then the kept ids
               ascending (slots past the count are unspecified).
    processed: ``[R, V]`` the logits' dtype, the processed logits at the kept ids and ``-inf``
               elsewhere (None unless asked for).
    logprob_ids, logprobs, ranks: with ``num_logprobs`` ``n``, what vLLM's
               ``compute_topk_scores`` returns for ``processed``: ``[R, 1 + n]`` int64 ids (the
               sampled token, then the ``n`` largest kept, descending, then dropped candidates),
               ``[R, 1 + n]`` float32 their processed logprobs (``-inf`` where dropped), ``[R]``
               int64 the sampled token's rank (kept ids at least as likely); None otherwise.
    """

    sampled: torch.Tensor
    packed: torch.Tensor
    processed: torch.Tensor | None = None
    logprob_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None


@triton.jit
def _log1p(x):
    """log(1 + x), accurate for tiny |x| (Goldberg: log(y) * x / (y - 1) with y = 1 + x); no
    libdevice, so it also runs in the interpreter."""
    y = 1.0 + x
    return tl.where(y == 1.0, x, tl.log(y) * (x / tl.where(y == 1.0, 1.0, y - 1.0)))


@triton.jit
def _sample_candidates_kernel(
    values_ptr,
    ids_ptr,
    candidates_stride,
    row_to_req_ptr,
    top_k_ptr,
    top_p_ptr,
    temperature_ptr,
    seeds_ptr,
    pos_ptr,
    sampled_ptr,
    packed_ptr,
    packed_stride,
    processed_ptr,
    processed_stride,
    logprob_ids_ptr,
    logprobs_ptr,
    ranks_ptr,
    num_logprobs,
    num_candidates,
    vocab_size,
    WRITE_PROCESSED: tl.constexpr,
    WRITE_LOGPROBS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    req = tl.load(row_to_req_ptr + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    in_range = offs < num_candidates
    values = tl.load(values_ptr + row * candidates_stride + offs, mask=in_range,
                     other=float("-inf")).to(tl.float32)
    ids = tl.load(ids_ptr + row * candidates_stride + offs, mask=in_range, other=0)
    # Top-k: the first top_k candidates (sorted descending), finite only (v - v is 0 exactly for
    # finite v, NaN for +-inf and NaN).
    top_k = tl.load(top_k_ptr + req)
    kept = in_range & (offs < top_k) & ((values - values) == 0.0)
    # Top-p over the renormalised top-k: keep a candidate while the mass before it is below p
    # (the first is always kept). p >= 1 keeps all: the fp32 running sum can reach 1 before the
    # last candidates.
    top_p = tl.load(top_p_ptr + req)
    if top_p < 1.0:
        largest = tl.max(tl.where(kept, values, float("-inf")), axis=0)
        weights = tl.where(kept, tl.exp(values - largest), 0.0)
        probs = weights / tl.sum(weights, axis=0)
        kept = kept & ((tl.cumsum(probs, axis=0) - probs) < top_p)
    # Sample: argmax of logit + Gumbel noise over the kept ids (the processed logits already
    # carry the temperature). Greedy rows (temperature 0, only requests without masks) take the
    # largest. The noise of a token depends on its id, the seed and the position only, so a
    # seeded request samples the same token whatever order topk returns ties in. Noise is
    # -log(E) with E = -log(1 - u): small E (the winners) comes from small u, where fp32 is fine.
    seed = tl.load(seeds_ptr + req)
    pos = tl.load(pos_ptr + row)
    u = tl.maximum(tl.rand(tl.randint(seed, pos), ids.to(tl.int32)), 1e-10)
    noise = -tl.log(-_log1p(-u))
    best = tl.argmax(tl.where(kept, values + noise, float("-inf")), axis=0)
    best = tl.where(tl.load(temperature_ptr + req) == 0.0, 0, best)
    chosen = offs == best
    sampled_id = tl.sum(tl.where(chosen, ids, 0), axis=0)
    tl.store(sampled_ptr + row, sampled_id)
    # The row's mask: kept ids ascending.
    out = packed_ptr + row * packed_stride
    num_kept = tl.sum(kept.to(tl.int32), axis=0)
    tl.store(out, num_kept)
    sorted_ids = tl.sort(tl.where(kept, ids.to(tl.int32), _NO_ID))
    tl.store(out + 1 + offs, sorted_ids, mask=in_range)
    if WRITE_PROCESSED:
        tl.store(processed_ptr + row * processed_stride + ids, values, mask=kept)
    if WRITE_LOGPROBS:
        # vLLM's processed logprobs of the row with -inf outside the kept ids: a log-softmax over
        # the kept ids, and the rank counts the ids at least as large as the sampled one. Where
        # the sampled id is not kept (a greedy row whose largest logit is NaN or +inf) it is -inf
        # there, so its rank is V; a row that keeps nothing is all -inf, which vLLM turns into
        # NaN logprobs. So here too.
        largest = tl.max(tl.where(kept, values, float("-inf")), axis=0)
        log_total = tl.log(tl.sum(tl.where(kept, tl.exp(values - largest), 0.0), axis=0))
        logprobs = tl.where(kept, values - largest - log_total, float("-inf"))
        logprobs = tl.where(num_kept > 0, logprobs, float("nan"))
        chosen_value = tl.sum(tl.where(chosen, values, 0.0), axis=0)
        chosen_kept = tl.sum((chosen & kept).to(tl.int32), axis=0) > 0
        rank = tl.sum((kept & (values >= chosen_value)).to(tl.int32), axis=0)
        tl.store(ranks_ptr + row, tl.where(chosen_kept, rank, vocab_size).to(tl.int64))
        ids_out = logprob_ids_ptr + row * (1 + num_logprobs)
        logprobs_out = logprobs_ptr + row * (1 + num_logprobs)
        tl.store(ids_out, sampled_id.to(tl.int64))
        tl.store(logprobs_out, tl.sum(tl.where(chosen, logprobs, 0.0), axis=0))
        # Columns 1..n: the kept candidates in their (descending) order, then the dropped ones.
        dropped = in_range & (kept == 0)
        column = tl.where(kept, tl.cumsum(kept.to(tl.int32), axis=0) - 1,
                          num_kept + tl.cumsum(dropped.to(tl.int32), axis=0) - 1)
        write = in_range & (column < num_logprobs)
        tl.store(ids_out + 1 + column, ids.to(tl.int64), mask=write)
        tl.store(logprobs_out + 1 + column, logprobs, mask=write)


# FlashInfer's radix row-state scratch (zeroed once; the kernel leaves it zeroed), by device.
_RADIX_ROW_STATES_BYTES = 1 << 20
_radix_row_states: dict[torch.device, torch.Tensor] = {}


@functools.cache
def _flashinfer_radix_top_k() -> Callable[..., None] | None:
    """FlashInfer's compiled radix top-k (``radix_topk(input, ids_out int32, values_out,
    row_states, k, sorted, deterministic, tie_break, dsa_graph_safe)``), or None without it.

    Called directly rather than through ``flashinfer.top_k``, whose wrapper (a torch custom op,
    a device query, an int32 -> int64 copy of the ids) costs more host time on every step than
    the kernel call itself; the candidate kernel reads int32 ids as they are. Any mismatch with the installed
    FlashInfer raises at the engine's probe call (``attach_capture``), which falls back to
    ``torch.topk``.
    """
    try:
        from flashinfer.jit.topk import gen_topk_module
    except ImportError:
        return None
    return gen_topk_module().build_and_load().radix_topk


_torch_top_k_only = False  # set by use_torch_top_k


def use_torch_top_k() -> None:
    """Take the candidates with ``torch.topk`` from now on in this process (FlashInfer's top-k
    failed, e.g. its JIT compilation on a machine without a CUDA compiler)."""
    global _torch_top_k_only
    _torch_top_k_only = True


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [R, k], ids [R, k])``: each row's ``k`` largest logits, descending; ids int32
    from FlashInfer, int64 from ``torch.topk``.

    On CUDA with FlashInfer (a requirement of vLLM 0.26) its radix top-k, sorted and
    deterministic (the same input gives the same ids in the same order, ties included);
    elsewhere ``torch.topk`` (several launches and ~4x the device time at 151936 ids:
    docs/benchmarks.md). ``logits`` must be contiguous.
    """
    radix_top_k = (_flashinfer_radix_top_k() if logits.is_cuda and not _torch_top_k_only
                   else None)
    if radix_top_k is None:
        return torch.topk(logits, k, dim=1)
    device = logits.device
    row_states = _radix_row_states.get(device)
    if row_states is None:
        row_states = _radix_row_states[device] = torch.zeros(
            _RADIX_ROW_STATES_BYTES, dtype=torch.uint8, device=device)
    num_rows = logits.shape[0]
    values = torch.empty((num_rows, k), dtype=logits.dtype, device=device)
    ids = torch.empty((num_rows, k), dtype=torch.int32, device=device)
    radix_top_k(logits, ids, values, row_states, k, True, True, 0, False)
    return values, ids


def sample_from_candidates(
    logits: torch.Tensor,
    num_candidates: int,
    row_to_req: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    pos: torch.Tensor,
    write_processed: bool,
    num_logprobs: int | None = None,
    packed: torch.Tensor | None = None,
) -> CandidateSample:
    """Top-k / top-p sample each row and return its kept set (no host sync).

    Args:
        logits: ``[R, V]`` float32 / bfloat16 / float16 processed logits (temperature, penalties,
            min-p applied), last dim contiguous. Read only.
        num_candidates: ``K``, ``1 <= K <= min(V, MAX_CANDIDATES)``: at least every row's top_k.
        row_to_req: ``[R]`` int, the request slot of each row (vLLM's ``expanded_idx_mapping``).
        top_k, top_p, temperature, seeds: ``[max_num_reqs]`` by request slot: int32 (the
            vocabulary size for "no top_k"), float32 (1.0: no top_p), float32, int64.
        pos: ``[R]`` int64, each row's position (with the seed, picks the Gumbel noise).
        write_processed: also return the ``[R, V]`` processed logits of the kept ids.
        num_logprobs: ``n``, ``0 <= n <= K``: also return the sampled token's processed logprob
            and rank and the ``n`` top processed logprobs (None: not).
        packed: ``[R, 1 + K]`` int32, contiguous, where the kernel writes the kept ids (e.g. a
            ``MappedRows`` buffer in host memory); None: a new tensor on the logits' device.
    """
    num_rows, vocab_size = logits.shape
    if not 1 <= num_candidates <= min(vocab_size, MAX_CANDIDATES):
        raise ValueError(f"num_candidates must be in [1, {min(vocab_size, MAX_CANDIDATES)}], "
                         f"got {num_candidates}")
    if num_logprobs is not None and not 0 <= num_logprobs <= num_candidates:
        raise ValueError(f"num_logprobs must be in [0, num_candidates={num_candidates}], got "
                         f"{num_logprobs}")
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have a contiguous last dim, got strides {logits.stride()}")
    device = logits.device
    if packed is None:
        packed = torch.empty((num_rows, 1 + num_candidates), dtype=torch.int32, device=device)
    elif (packed.shape != (num_rows, 1 + num_candidates) or packed.dtype != torch.int32
          or not packed.is_contiguous()):
        raise ValueError(f"packed must be a contiguous [{num_rows}, {1 + num_candidates}] int32 "
                         f"tensor, got {packed.dtype} {tuple(packed.shape)}")
    sampled = torch.empty(num_rows, dtype=torch.int64, device=device)
    result = CandidateSample(sampled, packed)
    if write_processed:
        result.processed = torch.full_like(logits, float("-inf"))
    if num_logprobs is not None:
        result.logprob_ids = torch.empty((num_rows, 1 + num_logprobs), dtype=torch.int64,
                                         device=device)
        result.logprobs = torch.empty((num_rows, 1 + num_logprobs), dtype=torch.float32,
                                      device=device)
        result.ranks = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return result
    values, ids = top_candidates(logits, num_candidates)
    block = max(triton.next_power_of_2(num_candidates), 16)
    # Outputs not asked for are never written: any tensor stands in for their pointers.
    _sample_candidates_kernel[(num_rows,)](
        values, ids, values.stride(0), row_to_req, top_k, top_p, temperature, seeds, pos,
        sampled, packed, packed.stride(0),
        logits if result.processed is None else result.processed, logits.stride(0),
        sampled if result.logprob_ids is None else result.logprob_ids,
        logits if result.logprobs is None else result.logprobs,
        sampled if result.ranks is None else result.ranks,
        num_logprobs or 0, num_candidates, vocab_size,
        WRITE_PROCESSED=write_processed, WRITE_LOGPROBS=num_logprobs is not None,
        BLOCK=block, num_warps=4 if block <= 256 else 8,
    )
    return result


def kept_candidates_reference(
    logits: torch.Tensor, top_k: list[int], top_p: list[float]
) -> list[list[int]]:
    """Plain torch reference of the kept sets (fp32, one row at a time): of the top_k largest
    logits (NaN ranks above +inf, as in ``torch.topk``; ties at the boundary: any of them) the
    finite ones, then the shortest prefix in descending order whose mass before each kept id is
    below top_p. Returns each row's ids ascending."""
    rows = []
    for row, k, p in zip(logits.float(), top_k, top_p):
        values, ids = torch.sort(row, descending=True)
        values, ids = values[:k], ids[:k]
        finite = torch.isfinite(values)
        values, ids = values[finite], ids[finite]
        if p < 1.0 and ids.numel():
            probs = torch.softmax(values, dim=0)
            ids = ids[(torch.cumsum(probs, dim=0) - probs) < p]
        rows.append(sorted(ids.tolist()))
    return rows
