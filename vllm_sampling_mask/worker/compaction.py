"""Compaction of processed logits into each row's kept vocabulary ids (Triton + torch reference).

Kept = finite (NaN, +inf and -inf are not kept). For ``logits`` ``[R, V]`` and a width ``W`` the
result is, per row ``r``:

- ``packed[r, 0]``: the exact number of kept ids (may exceed ``W``);
- ``packed[r, 1 : 1 + min(count, W)]``: the first kept ids, ascending (slots past the count are
  unspecified);
- ``bits[r]``: all kept ids as a little-endian bitmap, bit ``v % 32`` of word ``v // 32``.

So a row of at most ``W`` ids is read from ``packed``, and a wider one (top-k boundary ties, top_k
above the width cap, top-p only) is expanded from ``bits`` on the device by ``expand_rows``: the
host copies ``[R, 1 + W]`` int32 each step and, only when some row overflows, those rows' ids.

Two launches, each over ``(ceil(V / BLOCK), R)`` programs, so a batch of one row still spreads
the vocabulary over the whole GPU instead of walking it serially:

1. ``_count_and_pack_kernel`` reads each ``BLOCK`` of logits once (the whole cost: it runs at
   the copy bandwidth) and writes its bitmap words and its kept count;
2. ``_scatter_ids_kernel`` sums the counts of the row's blocks before its own (its output
   offset); if its block kept anything and that offset is below ``W``, it expands its bitmap
   words (1/32 of the logits bytes, from L2) into ids. Block 0 also writes the row's total.

An H200 comparison (issue 6) of this against one launch whose last program per row does the
scatter (a ticket per row) found the two launches 2-5 us faster in device time (the single
launch needs a row-wide scan in one program, which lowers the occupancy of the whole read) for
~35 us more host time per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.triton_utils import tl, triton

BITS_PER_WORD = 32
MAX_ROWS = 65535  # CUDA's limit of the grid's second axis


@dataclass
class CompactSupport:
    """Result of ``compact_support`` (all tensors on the logits' device).

    packed: ``[R, 1 + W]`` int32, column 0 the exact kept count of each row, columns 1.. its
            ascending kept ids (valid up to ``min(count, W)``): one contiguous block, so the
            per-step device->host transfer is a single copy.
    bits:   ``[R, ceil(V / 32)]`` int32, bitmap of the kept ids of each row; None where no
            count exceeds W (the candidate sampler's masks).
    block_counts: ``[R, ceil(V / block)]`` int32, kept ids per vocabulary block of ``block``
            entries (``expand_rows`` starts each block's ids at their sum before it); None with
            ``bits``.
    """

    packed: torch.Tensor
    bits: torch.Tensor | None
    vocab_size: int
    block_counts: torch.Tensor | None = None
    block: int = 0

    @property
    def counts(self) -> torch.Tensor:
        """``[R]`` int32 view: exact kept count of each row (may exceed W)."""
        return self.packed[:, 0]

    @property
    def ids(self) -> torch.Tensor:
        """``[R, W]`` int32 view: the first ``min(count, W)`` kept ids of each row."""
        return self.packed[:, 1:]


@triton.jit
def _popcount(words):
    """Number of set bits of each 32-bit word (SWAR; no libdevice, so it also runs in the
    interpreter). Returns int32."""
    u = words.to(tl.uint32, bitcast=True)
    u = u - ((u >> 1) & 0x55555555)
    u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
    u = (u + (u >> 4)) & 0x0F0F0F0F
    return ((u * 0x01010101) >> 24).to(tl.int32)


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
    # Blocks are the fast grid axis in both kernels, so a row's programs run together.
    block = tl.program_id(0)
    # int64: row * logits_stride passes 2**31 from R * V >= 2**31 (e.g. 8192 rows of 262144).
    row = tl.program_id(1).to(tl.int64)
    WORDS: tl.constexpr = BLOCK // 32
    # Load the block as a [WORDS, 32] tile: each word's 32 logits lie along the fast axis, so
    # the bit packing below is a reduction along axis 1 with no layout conversion.
    word_offs = block * WORDS + tl.arange(0, WORDS)
    bit = tl.arange(0, 32)
    offs = word_offs[:, None] * 32 + bit[None, :]
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=offs < vocab_size,
                other=float("-inf")).to(tl.float32)
    # x - x is 0 exactly for finite x, NaN for +-inf and NaN (no libdevice needed); the
    # out-of-vocabulary padding is -inf, so it is not kept.
    kept = ((x - x) == 0.0).to(tl.int32)
    # Distinct powers of two never carry, so the sum is the bitwise OR of the word.
    words = tl.sum(kept << bit[None, :], axis=1)
    tl.store(bits_ptr + row * scratch_stride + word_offs, words, mask=word_offs < num_words)
    tl.store(block_counts_ptr + row * scratch_stride + block, tl.sum(_popcount(words), axis=0))


@triton.jit
def _store_block_ids(bits_row_ptr, block, num_words, offset, limit, out_ptr,
                     BLOCK: tl.constexpr):
    """Write the kept ids of vocabulary block ``block`` (from its bitmap words) to
    ``out_ptr[offset + j]``, ascending, for the ``j`` with ``offset + j < limit``."""
    WORDS: tl.constexpr = BLOCK // 32
    word_offs = block * WORDS + tl.arange(0, WORDS)
    words = tl.load(bits_row_ptr + word_offs, mask=word_offs < num_words,
                    other=0).to(tl.uint32, bitcast=True)
    word_counts = _popcount(words)
    # Output position of each word's lowest kept id.
    position = offset + tl.cumsum(word_counts, axis=0) - word_counts
    # Peel one kept id (the lowest set bit) off every word per iteration: as many iterations as
    # the densest word has bits (1-2 for top-k rows, 32 for a dense row), and never more than
    # the slots left below the limit.
    num_peels = tl.minimum(tl.max(word_counts, axis=0), limit - offset)
    for _ in range(num_peels):
        rest = words & (words - 1)  # the word without its lowest set bit
        vocab_ids = word_offs * 32 + _popcount((words ^ rest) - 1)
        tl.store(out_ptr + position, vocab_ids, mask=(words != 0) & (position < limit))
        words = rest
        position += 1


@triton.jit
def _block_offset(block_counts_row_ptr, block, num_blocks, NUM_BLOCKS_POW2: tl.constexpr):
    """``(kept ids of the row's blocks before block, of the block, of the whole row)``."""
    block_ids = tl.arange(0, NUM_BLOCKS_POW2)
    row_counts = tl.load(block_counts_row_ptr + block_ids, mask=block_ids < num_blocks, other=0)
    offset = tl.sum(tl.where(block_ids < block, row_counts, 0), axis=0)
    own_count = tl.sum(tl.where(block_ids == block, row_counts, 0), axis=0)
    return offset, own_count, tl.sum(row_counts, axis=0)


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
    block = tl.program_id(0)
    # int64: row * (width + 1) and row * scratch_stride pass 2**31 as the first kernel's offsets do.
    row = tl.program_id(1).to(tl.int64)
    offset, own_count, row_count = _block_offset(block_counts_ptr + row * scratch_stride, block,
                                                 num_blocks, NUM_BLOCKS_POW2)
    out_row = packed_ptr + row * (width + 1)
    if block == 0:
        tl.store(out_row, row_count)
    # Sparse rows (top-k of a large vocabulary) leave many blocks empty: those stop here.
    if (offset < width) & (own_count > 0):
        _store_block_ids(bits_ptr + row * scratch_stride, block, num_words, offset, width,
                         out_row + 1, BLOCK)


@triton.jit
def _expand_rows_kernel(
    block_counts_ptr,
    bits_ptr,
    rows_ptr,
    out_starts_ptr,
    out_ptr,
    scratch_stride,
    num_blocks,
    num_words,
    BLOCK: tl.constexpr,
    NUM_BLOCKS_POW2: tl.constexpr,
):
    block = tl.program_id(0)
    row = tl.load(rows_ptr + tl.program_id(1))  # int64
    offset, own_count, row_count = _block_offset(block_counts_ptr + row * scratch_stride, block,
                                                 num_blocks, NUM_BLOCKS_POW2)
    if own_count > 0:
        out_row = out_ptr + tl.load(out_starts_ptr + tl.program_id(1))
        _store_block_ids(bits_ptr + row * scratch_stride, block, num_words, offset, row_count,
                         out_row, BLOCK)


@dataclass(frozen=True)
class CompactionLaunch:
    """Launch configuration of ``compact_support``.

    block: vocabulary entries per program (a power of two >= 32), the same in both kernels.
    count_warps / scatter_warps: ``num_warps`` of the count-and-pack / scatter kernel.
    """

    block: int
    count_warps: int = 16
    scatter_warps: int = 2

    @staticmethod
    def default_for(logits: torch.Tensor) -> CompactionLaunch:
        if logits.device.type == "cpu":
            # Triton's interpreter costs milliseconds per program: use few, large blocks.
            return CompactionLaunch(min(max(triton.next_power_of_2(logits.shape[1]), 32), 1 << 16))
        # H200 sweep (benchmarks/bench_compaction.py --launches): the read runs at the copy
        # bandwidth for every block from 1024 to 16384; larger blocks leave the scatter fewer,
        # fuller programs (13 us at 2048, 5 us at 8192 for B=256, V=151936).
        return CompactionLaunch(8192)


def compact_support(
    logits: torch.Tensor, width: int, launch: CompactionLaunch | None = None
) -> CompactSupport:
    """Compact each row's finite entries (Triton; no host sync).

    Args:
        logits: ``[R, V]`` float32 / bfloat16 / float16, last dim contiguous, ``R <= 65535``.
            Read only.
        width: ``W >= 1``, the number of ids per row kept in ``ids``.
        launch: block size and warps (default ``CompactionLaunch.default_for(logits)``).
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be 2-D with a contiguous last dim, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    launch = launch or CompactionLaunch.default_for(logits)
    if launch.block < BITS_PER_WORD or launch.block & (launch.block - 1):
        raise ValueError(f"launch.block must be a power of two >= 32, got {launch.block}")
    num_rows, vocab_size = logits.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows per call (the grid's second axis), got {num_rows}")
    block = launch.block
    num_blocks = triton.cdiv(vocab_size, block)
    num_words = triton.cdiv(vocab_size, BITS_PER_WORD)
    device = logits.device
    packed = torch.empty((num_rows, width + 1), dtype=torch.int32, device=device)
    # One scratch allocation for the bitmap (returned) and the per-block counts (internal).
    scratch = torch.empty((num_rows, num_words + num_blocks), dtype=torch.int32, device=device)
    bits, block_counts = scratch[:, :num_words], scratch[:, num_words:]
    if num_rows == 0:
        return CompactSupport(packed, bits, vocab_size, block_counts, block)
    row_stride = scratch.stride(0)
    grid = (num_blocks, num_rows)
    _count_and_pack_kernel[grid](
        logits, logits.stride(0), block_counts, bits, row_stride, vocab_size, num_words,
        BLOCK=block, num_warps=launch.count_warps,
    )
    _scatter_ids_kernel[grid](
        block_counts, bits, packed, row_stride, num_blocks, num_words, width,
        BLOCK=block, NUM_BLOCKS_POW2=triton.next_power_of_2(num_blocks),
        num_warps=launch.scatter_warps,
    )
    return CompactSupport(packed, bits, vocab_size, block_counts, block)


def expand_rows(support: CompactSupport, rows: torch.Tensor,
                out_starts: torch.Tensor, total: int) -> torch.Tensor:
    """Every kept id of the given rows, on the support's device (one launch, no host sync).

    Args:
        support: a ``compact_support`` result (with ``bits`` and ``block_counts``).
        rows: ``[n]`` int64, row indices (same device).
        out_starts: ``[n]`` int64, where each row's ids start in the output: the exclusive
            prefix sum of the rows' counts (same device).
        total: the sum of the rows' counts (the output length).
    Returns:
        ``[total]`` int32: the ids of ``rows[0]`` ascending, then those of ``rows[1]``, ...
    """
    bits, block_counts = support.bits, support.block_counts
    if bits is None or block_counts is None:
        raise ValueError("expand_rows needs a support with bits and block_counts")
    out = torch.empty(total, dtype=torch.int32, device=bits.device)
    if rows.numel() == 0 or total == 0:
        return out
    num_blocks, num_words = block_counts.shape[1], bits.shape[1]
    _expand_rows_kernel[(num_blocks, rows.numel())](
        block_counts, bits, rows, out_starts, out, bits.stride(0), num_blocks, num_words,
        BLOCK=support.block, NUM_BLOCKS_POW2=triton.next_power_of_2(num_blocks),
        num_warps=CompactionLaunch.scatter_warps,
    )
    return out


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
    block = CompactionLaunch.default_for(logits).block
    num_blocks = -(-vocab_size // block)
    by_block = torch.zeros((num_rows, num_blocks * block), dtype=torch.int32, device=logits.device)
    by_block[:, :vocab_size] = kept.to(torch.int32)
    block_counts = by_block.view(num_rows, num_blocks, block).sum(dim=2, dtype=torch.int32)
    return CompactSupport(packed, bits, vocab_size, block_counts, block)


def expand_rows_reference(support: CompactSupport, rows: list[int]) -> list[list[int]]:
    """Plain torch reference of ``expand_rows``: each row's kept ids, read from ``bits``."""
    shifts = torch.arange(BITS_PER_WORD, device=support.bits.device)
    result = []
    for row in rows:
        bit_set = (support.bits[row].to(torch.int64).unsqueeze(1) >> shifts) & 1  # [words, 32]
        result.append(bit_set.flatten()[: support.vocab_size].nonzero().flatten().tolist())
    return result
