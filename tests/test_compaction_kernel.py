"""Triton compaction vs the torch reference (CPU: Triton interpreter; GPU: ``gpu`` marker)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_sampling_mask.worker.compaction import (
    CompactionLaunch,
    compact_support,
    compact_support_reference,
    expand_rows,
    expand_rows_reference,
)
from vllm_sampling_mask.worker.step_masks import DeviceStepMasks

DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_logits(vocab: int, sizes: list[int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """One row per entry of ``sizes``: that many finite logits at random ids, -inf elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for size in sizes:
        row = torch.full((vocab,), float("-inf"))
        ids = torch.randperm(vocab, generator=gen)[:size]
        row[ids] = torch.randn(size, generator=gen)
        rows.append(row)
    return torch.stack(rows).to(dtype)


def assert_matches_reference(
    logits: torch.Tensor, width: int, launch: CompactionLaunch | None = None
) -> None:
    got = compact_support(logits, width, launch)
    ref = compact_support_reference(logits.cpu(), width)
    counts = got.counts.cpu()
    assert torch.equal(counts, ref.counts), (counts.tolist(), ref.counts.tolist())
    assert torch.equal(got.bits.cpu(), ref.bits)
    ids = got.ids.cpu()
    for row in range(logits.shape[0]):
        n = min(int(ref.counts[row]), width)
        assert torch.equal(ids[row, :n], ref.ids[row, :n]), f"row {row}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [33, 111, 1000, 4097])
def test_support_sizes_around_the_width(device: str, dtype: torch.dtype, vocab: int) -> None:
    width = min(16, vocab - 1)
    sizes = [0, 1, width - 1, width, width + 1, vocab // 2, vocab]
    assert_matches_reference(make_logits(vocab, sizes, dtype).to(device), width)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("vocab", "launch"), [
    # 333 = 10 * 32 + 13 = 5 * 64 + 13: a partial last block (the interpreter runs each
    # block's program on its own, so a wider vocabulary only adds time)
    (333, CompactionLaunch(32, count_warps=1, scatter_warps=1)),
    (333, CompactionLaunch(64, count_warps=2, scatter_warps=1)),
    (4097, CompactionLaunch(256, count_warps=4, scatter_warps=2)),
    (4097, CompactionLaunch(2048, count_warps=8, scatter_warps=4)),
], ids=["333-block32", "333-block64", "4097-block256", "4097-block2048"])
def test_many_blocks_per_row(device: str, launch: CompactionLaunch, vocab: int) -> None:
    # The CPU default puts a whole row in one block; small blocks exercise the offsets across
    # blocks, blocks that start past the width, and dense words (32 peels) in the interpreter.
    width = 40
    sizes = [0, 1, width - 1, width, width + 1, 3 * width, vocab // 2, vocab]
    logits = make_logits(vocab, sizes, torch.float32, seed=vocab)
    logits[len(sizes) - 2, :64] = 0.0  # two dense words in the first block
    assert_matches_reference(logits.to(device), width, launch)
    assert_matches_reference(logits.to(device), vocab, launch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("vocab", "launch"), [
    (1000, None),  # the device's default block
    (333, CompactionLaunch(32, count_warps=1, scatter_warps=1)),
    (4097, CompactionLaunch(256, count_warps=4, scatter_warps=2)),
], ids=["1000-default", "333-block32", "4097-block256"])
def test_expand_rows_matches_reference(device: str, vocab: int,
                                       launch: CompactionLaunch | None) -> None:
    # Any subset of rows, in any order, repeated: each row's ids whole (no width), row after row.
    sizes = [0, 1, 40, 41, vocab // 2, vocab, 7]
    logits = make_logits(vocab, sizes, torch.bfloat16, seed=vocab + 1)
    logits[3, :64] = 0.0  # dense words across a block boundary at block 32
    logits[3, 64:70] = float("nan")
    support = compact_support(logits.to(device), 8, launch)
    rows = [5, 0, 3, 4, 1, 6, 5]
    counts = support.counts.cpu()[rows].to(torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    got = expand_rows(support, torch.tensor(rows, device=device), starts.to(device),
                      int(counts.sum())).cpu()
    expected = expand_rows_reference(support, rows)
    assert expected == expand_rows_reference(compact_support_reference(logits, 8), rows)
    assert got.tolist() == [i for row in expected for i in row]
    assert expand_rows(support, torch.tensor([], dtype=torch.int64, device=device),
                       torch.tensor([], dtype=torch.int64, device=device), 0).numel() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_infinities_are_never_kept(device: str) -> None:
    logits = make_logits(257, [40, 40, 257], torch.float32)
    logits[0, :5] = float("nan")
    logits[1, 10:20] = float("inf")
    logits[2, 100] = float("nan")
    logits[2, 101] = float("-inf")
    logits[2, 102] = float("inf")
    logits = logits.to(device)
    assert_matches_reference(logits, 64)
    got = compact_support(logits, 257)
    kept_last = set(got.ids[2, : got.counts[2]].tolist())
    assert {100, 101, 102}.isdisjoint(kept_last) and len(kept_last) == 254


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_boundary_ties_overflow_the_width_exactly(device: str) -> None:
    # vLLM's PyTorch top-k keeps every logit equal to the k-th: rows wider than top_k.
    vocab, top_k = 1000, 8
    logits = torch.randn(3, vocab)
    logits[:, 500:520] = 10.0  # 20 tied maxima, top_k = 8 keeps all 20
    logits[:, :500] = float("-inf")
    logits[:, 520:] = float("-inf")
    device_masks = DeviceStepMasks(compact_support(logits.to(device), top_k))
    host = device_masks.copy_to_host_nonblocking()
    step = host.unpack(np.ones(3, dtype=np.int32))
    assert step.row_lengths() == [20, 20, 20]
    for row in range(3):
        assert step.row(row).tolist() == list(range(500, 520))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [24, 400])  # narrow (whole-buffer copy) and wide unpack
def test_host_unpack_matches_reference_rows(device: str, width: int) -> None:
    vocab = 3001
    sizes = [0, 1, 23, 24, 25, 600, vocab, 7]
    logits = make_logits(vocab, sizes, torch.bfloat16, seed=3).to(device)
    num_sampled = np.array([1, 1, 1, 1, 1, 1, 1, 0], dtype=np.int32)  # last row: partial prefill
    step = DeviceStepMasks(compact_support(logits, width)).copy_to_host_nonblocking()
    if device == "cuda":
        torch.cuda.synchronize()
    masks = step.unpack(num_sampled)
    finite = torch.isfinite(logits.float().cpu())
    for row, sampled in enumerate(num_sampled):
        expected = finite[row].nonzero().flatten().tolist() if sampled else []
        assert masks.row(row).tolist() == expected, f"row {row}"
    assert len(masks.rows) == len(sizes)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_empty_batch(device: str) -> None:
    base = make_logits(300, [5, 0, 300, 17], torch.float32).to(device)
    wide = torch.full((4, 512), 0.0, device=device)
    wide[:, :300] = base
    assert_matches_reference(wide[:, :300], 8)  # row stride 512, vocab 300
    empty = compact_support(torch.empty(0, 300, device=device), 8)
    assert empty.ids.shape == (0, 8) and empty.counts.shape == (0,)


def test_invalid_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="width"):
        compact_support(torch.zeros(2, 10), 0)
    with pytest.raises(ValueError, match="contiguous"):
        compact_support(torch.zeros(10, 2).t(), 4)
    with pytest.raises(ValueError, match="power of two"):
        compact_support(torch.zeros(2, 10), 4, CompactionLaunch(48))


@pytest.mark.gpu
def test_repeated_large_batches_match_a_vectorised_reference() -> None:
    # Every row of many full-size calls, in the sampler's shape (programs finish in any order on
    # a GPU; the interpreter runs them one by one).
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab, rows = 151936, 512
    for call in range(40):
        logits = torch.randn(rows, vocab, device="cuda", generator=gen)
        top_k = torch.randint(1, 600, (rows,), device="cuda", generator=gen)
        top_k[call % rows] = vocab  # a dense row
        threshold = logits.sort(dim=1, descending=True).values.gather(1, (top_k - 1)[:, None])
        logits = logits.masked_fill(logits < threshold, float("-inf"))
        width = 512
        got = compact_support(logits, width)
        kept = torch.isfinite(logits)
        assert torch.equal(got.counts, kept.sum(dim=1, dtype=torch.int32)), f"call {call}"
        ids = torch.where(kept, torch.arange(vocab, device="cuda"), vocab).sort(dim=1).values
        valid = torch.arange(width, device="cuda")[None, :] < got.counts[:, None]
        assert torch.equal(torch.where(valid, got.ids, -1),
                           torch.where(valid, ids[:, :width].int(), -1)), f"call {call}"


# Rows whose offsets pass 2**31 elements: row 64 of a [65, 2**25 + 1] buffer. Both buffers are
# 8.6 GB of address space of which the kernels touch a few pages (never the whole: the
# reference is not run). Before int64 rows the scatter kernel wrote at a wrapped, negative
# offset (a segfault under the interpreter), so it runs in a subprocess.
_HUGE_OFFSETS = """
import sys
import torch
from vllm.triton_utils import triton
from vllm_sampling_mask.worker import compaction

device = sys.argv[1]
rows, vocab, width = 65, 64, 1 << 25
logits = torch.full((rows, vocab), float("-inf"), device=device)
logits[:, 3] = 0.0
logits[-1, 7] = 0.0
got = compaction.compact_support(logits, width)  # row * (width + 1) >= 2**31
print(got.packed[0, :2].tolist(), got.packed[-1, :3].tolist())  # [count, ids...]

# row * scratch_stride >= 2**31: the launcher's scratch, with a huge row stride.
scratch = torch.empty((rows, width), dtype=torch.int32, device=device)
bits, block_counts = scratch[:, :2], scratch[:, 2:3]
packed = torch.empty((rows, 4), dtype=torch.int32, device=device)
compaction._count_and_pack_kernel[(1, rows)](
    logits, logits.stride(0), block_counts, bits, scratch.stride(0), vocab, 2, BLOCK=64)
compaction._scatter_ids_kernel[(1, rows)](
    block_counts, bits, packed, scratch.stride(0), 1, 2, 3, BLOCK=64, NUM_BLOCKS_POW2=1)
print(packed[0, :2].tolist(), packed[-1, :3].tolist())
"""


@pytest.mark.parametrize("device", DEVICES)
def test_row_offsets_past_two_to_the_31(device: str, subprocess_env: dict[str, str]) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _HUGE_OFFSETS, device], capture_output=True,
                            text=True, env=subprocess_env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == ["[1, 3] [2, 3, 7]"] * 2
