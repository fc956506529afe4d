"""Compaction of processed logits into each row's kept vocabulary ids (Triton + torch reference).

Kept = finite (NaN, +inf and -inf are not kept). For ``logits`` ``[R, V]`` and a width ``W`` the
result is, per row ``r``:

- ``packed[r, 0]``: the exact number of kept ids (may exceed ``W``);
- ``packed[r, 1 : 1 + min(count, W)]``: the first kept ids, ascending (slots past the count are
  unspecified);
- ``bits[r]``: all kept ids as a little-endian bitmap, bit ``v % 32`` of word ``v // 32``.

So a row of at most ``W`` ids is read from ``packed``, and a wider one (top-k boundary ties, top_k
above the width cap) from ``bits``: the host copies ``[R, 1 + W]`` int32 each step and touches a
``[R, ceil(V / 32)]`` bitmap only when some row overflows.

Two launches, each over ``(R, ceil(V / BLOCK))`` programs, so a batch of one row still spreads
the vocabulary over the whole GPU instead of walking it serially:

1. ``_count_and_pack_kernel`` reads each ``BLOCK`` of logits once, writes its kept count and
   its bitmap words;
2. ``_scatter_ids_kernel`` sums the counts of the blocks before it (its output offset), and if
   its block kept anything and that offset is still below ``W``, expands its bitmap words (1/32
   of the logits bytes) and writes its ids. Block 0 also writes the row total.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.triton_utils import tl, triton

BITS_PER_WORD = 32


@dataclass
class CompactSupport:
    """Result of ``compact_support`` (all tensors on the logits' device).

    packed: ``[R, 1 + W]`` int32, column 0 the exact kept count of each row, columns 1.. its
            ascending kept ids (valid up to ``min(count, W)``): one contiguous block, so the
            per-step device->host transfer is a single copy.
    bits:   ``[R, ceil(V / 32)]`` int32, bitmap of the kept ids of each row.
    """

    packed: torch.Tensor
    bits: torch.Tensor
    vocab_size: int

    @property
    def counts(self) -> torch.Tensor:
        """``[R]`` int32 view: exact kept count of each row (may exceed W)."""
        return self.packed[:, 0]

    @property
    def ids(self) -> torch.Tensor:
        """``[R, W]`` int32 view: the first ``min(count, W)`` kept ids of each row."""
        return self.packed[:, 1:]


@triton.jit
def _count_and_pack_kernel(
    logits_ptr,
    logits_stride,
    block_counts_ptr,
    bits_ptr,
    scratch_stride,
    vocab_size,
    num_words,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    block = tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab_size
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=in_vocab, other=float("-inf"))
    x = x.to(tl.float32)
    # x - x is 0 exactly for finite x, NaN for +-inf and NaN (no libdevice needed).
    kept = ((x - x) == 0.0) & in_vocab
    kept_i32 = kept.to(tl.int32)
    tl.store(block_counts_ptr + row * scratch_stride + block, tl.sum(kept_i32, axis=0))

    WORDS: tl.constexpr = BLOCK // 32
    # Distinct powers of two never carry, so the sum is the bitwise OR of the word.
    shifted = tl.reshape(kept_i32, (WORDS, 32)) << tl.arange(0, 32)[None, :]
    words = tl.sum(shifted, axis=1)
    word_offs = block * WORDS + tl.arange(0, WORDS)
    tl.store(bits_ptr + row * scratch_stride + word_offs, words, mask=word_offs < num_words)


@triton.jit
def _scatter_ids_kernel(
    block_counts_ptr,
    bits_ptr,
    packed_ptr,
    scratch_stride,
    num_blocks,
    num_words,
    width,
    BLOCK: tl.constexpr,
    NUM_BLOCKS_POW2: tl.constexpr,
):
    row = tl.program_id(0)
    block = tl.program_id(1)
    block_ids = tl.arange(0, NUM_BLOCKS_POW2)
    row_counts = tl.load(
        block_counts_ptr + row * scratch_stride + block_ids, mask=block_ids < num_blocks, other=0
    )
    offset = tl.sum(tl.where(block_ids < block, row_counts, 0), axis=0)
    own_count = tl.sum(tl.where(block_ids == block, row_counts, 0), axis=0)
    out_row = packed_ptr + row * (width + 1)
    if block == 0:
        tl.store(out_row, tl.sum(row_counts, axis=0))
    # Sparse rows (top-k of a large vocabulary) leave most blocks empty: skip their scan.
    if (offset < width) & (own_count > 0):
        WORDS: tl.constexpr = BLOCK // 32
        word_offs = block * WORDS + tl.arange(0, WORDS)
        words = tl.load(bits_ptr + row * scratch_stride + word_offs, mask=word_offs < num_words,
                        other=0)
        kept = tl.reshape((words[:, None] >> tl.arange(0, 32)[None, :]) & 1, (BLOCK,))
        position = offset + tl.cumsum(kept, axis=0) - 1
        vocab_ids = block * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_row + 1 + position, vocab_ids, mask=(kept != 0) & (position < width))


def _block_size(logits: torch.Tensor) -> int:
    if logits.device.type == "cpu":
        # Triton's interpreter costs milliseconds per program: use few, large blocks.
        return min(max(triton.next_power_of_2(logits.shape[1]), 32), 1 << 16)
    return 2048


def compact_support(logits: torch.Tensor, width: int) -> CompactSupport:
    """Compact each row's finite entries (Triton; no host sync).

    Args:
        logits: ``[R, V]`` float32 / bfloat16 / float16, last dim contiguous. Read only.
        width: ``W >= 1``, the number of ids per row kept in ``ids``.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be 2-D with a contiguous last dim, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    num_rows, vocab_size = logits.shape
    block = _block_size(logits)
    num_blocks = triton.cdiv(vocab_size, block)
    num_words = triton.cdiv(vocab_size, BITS_PER_WORD)
    device = logits.device
    packed = torch.empty((num_rows, width + 1), dtype=torch.int32, device=device)
    # One scratch allocation for the bitmap (returned) and the per-block counts (internal).
    scratch = torch.empty((num_rows, num_words + num_blocks), dtype=torch.int32, device=device)
    bits, block_counts = scratch[:, :num_words], scratch[:, num_words:]
    if num_rows == 0:
        return CompactSupport(packed, bits, vocab_size)
    row_stride = scratch.stride(0)
    grid = (num_rows, num_blocks)
    _count_and_pack_kernel[grid](
        logits, logits.stride(0), block_counts, bits, row_stride, vocab_size, num_words,
        BLOCK=block, num_warps=8,
    )
    _scatter_ids_kernel[grid](
        block_counts, bits, packed, row_stride, num_blocks, num_words, width,
        BLOCK=block, NUM_BLOCKS_POW2=triton.next_power_of_2(num_blocks), num_warps=8,
    )
    return CompactSupport(packed, bits, vocab_size)


def compact_support_reference(logits: torch.Tensor, width: int) -> CompactSupport:
    """Plain torch reference of ``compact_support`` (unused ``ids`` slots are -1)."""
    num_rows, vocab_size = logits.shape
    kept = torch.isfinite(logits.float())
    counts = kept.sum(dim=1, dtype=torch.int32)
    packed = torch.full((num_rows, width + 1), -1, dtype=torch.int32, device=logits.device)
    packed[:, 0] = counts
    for row in range(num_rows):
        row_ids = kept[row].nonzero().flatten()[:width].to(torch.int32)
        packed[row, 1 : 1 + row_ids.numel()] = row_ids
    num_words = -(-vocab_size // BITS_PER_WORD)
    padded = torch.zeros((num_rows, num_words * BITS_PER_WORD), dtype=torch.int64,
                         device=logits.device)
    padded[:, :vocab_size] = kept.to(torch.int64)
    weights = torch.ones(BITS_PER_WORD, dtype=torch.int64, device=logits.device) << torch.arange(
        BITS_PER_WORD, device=logits.device)
    words = (padded.view(num_rows, num_words, BITS_PER_WORD) * weights).sum(dim=2)
    bits = (((words + (1 << 31)) % (1 << 32)) - (1 << 31)).to(torch.int32)  # wrap to int32
    return CompactSupport(packed, bits, vocab_size)
