"""Candidate sampler (Triton) vs the torch reference of the kept sets, and its sampling law
(CPU: Triton interpreter; GPU: ``gpu`` marker)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from vllm_sampling_mask.worker.candidate_sampler import (
    MAX_CANDIDATES,
    kept_candidates_reference,
    sample_from_candidates,
    top_candidates,
)
from vllm_sampling_mask.worker.compaction import CompactSupport
from vllm_sampling_mask.worker.step_masks import DeviceStepMasks, MappedRows, uva_buffer

DEVICES = [pytest.param("cpu", id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def row_slots(rows: int, device: torch.device | str) -> torch.Tensor:
    """``[rows]`` request slot of each row: one per row, in reverse order (so the slot mapping
    is honoured, not the row order)."""
    return torch.arange(rows - 1, -1, -1, device=device)


def by_slot(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Per-row ``values`` as a per-slot tensor (``row_slots``' order)."""
    return torch.tensor(values[::-1], dtype=dtype, device=device)


def run(logits: torch.Tensor, top_k: list[int], top_p: list[float], *,
        seeds: list[int] | None = None, temperature: list[float] | None = None,
        pos: list[int] | None = None, num_candidates: int | None = None,
        write_processed: bool = True, num_logprobs: int | None = None,
        packed: torch.Tensor | None = None):
    """``sample_from_candidates`` with the rows' values laid out by ``row_slots``."""
    device = logits.device
    rows = logits.shape[0]
    return sample_from_candidates(
        logits, num_candidates or max(top_k), row_slots(rows, device),
        by_slot(top_k, torch.int32, device), by_slot(top_p, torch.float32, device),
        by_slot(temperature or [1.0] * rows, torch.float32, device),
        by_slot(seeds or list(range(rows)), torch.int64, device),
        torch.tensor(pos or [7] * rows, dtype=torch.int64, device=device), write_processed,
        num_logprobs, packed)


def rows_of(packed: torch.Tensor) -> list[list[int]]:
    packed = packed.cpu()
    return [packed[r, 1 : 1 + int(packed[r, 0])].tolist() for r in range(packed.shape[0])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [37, 1000])
def test_kept_sets_match_the_reference(device: str, dtype: torch.dtype, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    # Distinct values (a permutation, small integers: exact in bf16) so the top-k boundary has no
    # ties to break; steps of 1/4 give top-p boundaries inside the first 30.
    logits = torch.stack([torch.randperm(vocab, generator=gen).float() / 4 - vocab / 4
                          for _ in range(6)])
    logits[1, ::2] = float("-inf")  # fewer finite ids than top_k
    logits[2, 3] = float("nan")
    logits[3, 5] = float("inf")
    logits = logits.to(dtype).to(device)
    top_k = [5, 30, 1, 30, 17, 30]
    top_p = [1.0, 0.9, 0.5, 1.0, 0.3, 0.999]
    got = run(logits, top_k, top_p)
    rows = rows_of(got.packed)
    expected = kept_candidates_reference(logits.cpu(), top_k, top_p)
    # NaN and +inf are never kept; where they rank (and so whether they take a top-k slot)
    # depends on the top-k backend (torch.topk: first; FlashInfer's radix top-k on bf16 differs).
    assert 3 not in rows[2] and 5 not in rows[3]
    assert [row for r, row in enumerate(rows) if r not in (2, 3)] == [
        row for r, row in enumerate(expected) if r not in (2, 3)]
    sampled = got.sampled.cpu().tolist()
    for r, row in enumerate(rows):
        assert sampled[r] in row or not row, (r, sampled[r], row)
        processed = got.processed[r].cpu()
        assert torch.isfinite(processed).nonzero().flatten().tolist() == row
        assert torch.equal(processed[row], logits[r].cpu()[row])


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_the_largest_and_seeds_reproduce(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 500, generator=gen).to(device)
    args = dict(top_k=[50] * 4, top_p=[0.9] * 4, seeds=[3, 3, 4, 5],
                temperature=[1.0, 1.0, 0.0, 1.0])
    first = run(logits.clone(), **args)
    again = run(logits.clone(), **args)
    assert torch.equal(first.sampled, again.sampled)  # same seed, position and logits
    assert int(first.sampled[2]) == int(logits[2].argmax())
    # Without logprobs no processed logits are built; the sample and the rows are the same.
    bare = run(logits.clone(), **args, write_processed=False)
    assert bare.processed is None and torch.equal(bare.sampled, first.sampled)
    assert rows_of(bare.packed) == rows_of(first.packed)


@pytest.mark.parametrize("device", DEVICES)
def test_samples_follow_the_renormalised_kept_distribution(device: str) -> None:
    # One distribution in every row, a different position each: the empirical frequencies of the
    # kept ids approach their renormalised probabilities, and dropped ids never come up. The
    # interpreter runs a program in ~0.1 s: few rows there, a tolerance of ~3.5 sigma.
    rows, atol = (240, 0.11) if device == "cpu" else (200_000, 0.005)
    base = torch.full((64,), float("-inf"))
    base[[3, 10, 20, 40, 50]] = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    logits = base.repeat(rows, 1).to(device)
    got = run(logits, [4] * rows, [0.8] * rows, seeds=[11] * rows, pos=list(range(rows)))
    # top_k 4 drops id 50; top_p 0.8 over {.4, .3, .15, .1}/.95 keeps 3 (mass before: 0, .42, .74).
    assert rows_of(got.packed[:1]) == [[3, 10, 20]]
    counts = torch.bincount(got.sampled.cpu(), minlength=64).float() / rows
    expected = torch.zeros(64)
    expected[[3, 10, 20]] = torch.tensor([0.4, 0.3, 0.15]) / 0.85
    assert counts[[40, 50]].sum() == 0
    assert torch.allclose(counts, expected, atol=atol), counts[[3, 10, 20]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_seeded_rows_sample_what_vllms_gumbel_path_samples(device: str, dtype: torch.dtype) -> None:
    # A mask engine samples a step with the candidate sampler or, where it does not apply (a
    # top_k above 1024 in the batch) or no request of the step wants masks, with vLLM's own
    # path. For a seeded request that choice must not show: given the same kept set, vLLM's
    # Gumbel sampler (MRV2's gumbel_sample over the top-k/top-p-filtered logits) picks the same
    # token, so its tokens do not depend on which requests share its steps.
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    gen = torch.Generator().manual_seed(5)
    rows, vocab = 48, 1000
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    top_k = torch.randint(1, 60, (rows,), generator=gen).tolist()
    top_p = (torch.rand(rows, generator=gen) * 0.5 + 0.5).tolist()
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen).tolist()
    pos = torch.randint(0, 40_000, (rows,), generator=gen).tolist()
    temperature = [1.0] * (rows - 2) + [0.0, 0.0]  # greedy rows too (opted-out requests only)
    filtered = torch.full_like(logits, float("-inf"))
    for row, ids in enumerate(kept_candidates_reference(logits, top_k, top_p)):
        filtered[row, ids] = logits[row, ids]
    ours = run(logits.to(device), top_k, top_p, seeds=seeds, temperature=temperature, pos=pos,
               write_processed=False).sampled.cpu()
    vllms = gumbel_sample(
        filtered.to(device), row_slots(rows, device),
        by_slot(temperature, torch.float32, device), by_slot(seeds, torch.int64, device),
        torch.tensor(pos, dtype=torch.int64, device=device), apply_temperature=False).cpu()
    assert ours.tolist() == vllms.tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_logprobs", [0, 1, 5, 30])
def test_logprobs_match_vllms_over_the_processed_logits(
    device: str, dtype: torch.dtype, num_logprobs: int
) -> None:
    # The logprobs the kernel computes over the kept ids are what vLLM's compute_topk_scores
    # computes from the -inf-filled processed logits the same call writes: the sampled token's
    # logprob and rank, and the top-n logprobs; their ids too wherever the value is finite (past
    # a row's kept ids vLLM's topk picks any -inf id, the kernel the next dropped candidates).
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    gen = torch.Generator().manual_seed(num_logprobs)
    vocab = 300
    logits = torch.stack([torch.randperm(vocab, generator=gen).float() / 8 - 20
                          for _ in range(8)])
    logits[1, ::2] = float("-inf")  # fewer finite ids than top_k
    logits[2, 7] = float("nan")
    logits[3, :] = float("-inf")  # keeps nothing: vLLM's NaN logprobs, rank V
    logits[4, 9] = logits[4].max() + 1  # greedy below: takes a +inf id outside its row
    logits[4, 9] = float("inf")
    logits = logits.to(dtype).to(device)
    top_k = [5, 40, 1, 30, 17, 30, 30, 25]
    top_p = [1.0, 0.9, 0.5, 1.0, 0.3, 0.999, 0.2, 1.0]
    temperature = [1.0] * 4 + [0.0] + [1.0] * 3
    got = run(logits, top_k, top_p, temperature=temperature,
              num_candidates=max(max(top_k), num_logprobs), num_logprobs=num_logprobs)
    # (fp32: exact for bf16, whose rows vLLM's kernels also compute in fp32; its rank kernel
    # miscounts bf16 rows under the Triton interpreter.)
    expected = compute_topk_scores(got.processed.float(), num_logprobs, got.sampled)
    assert got.logprob_ids.shape == got.logprobs.shape == (8, 1 + num_logprobs)
    assert got.logprob_ids.dtype == torch.int64 and got.logprobs.dtype == torch.float32
    # A sampled id outside its row (row 3 keeps nothing, greedy row 4 took +inf; row 2 keeps
    # nothing where its NaN is the first candidate: torch.topk, FlashInfer's fp32 top-k; the
    # cast leaves it a NaN with the sign bit set, 0xFFFF, which FlashInfer's bf16 top-k ranks
    # last, as on the H200) is -inf in the processed logits: its rank is V here; vLLM's rank
    # kernel also counts its padding past V there (a multiple of its 8192-wide block).
    kept_rows = rows_of(got.packed)
    outside = [r for r in range(8) if got.sampled[r].item() not in kept_rows[r]]
    assert {3, 4} <= set(outside) <= {2, 3, 4}
    inside = [r for r in range(8) if r not in outside]
    assert torch.equal(got.ranks.cpu()[inside], expected.selected_token_ranks.cpu()[inside])
    assert got.ranks[outside].tolist() == [vocab] * len(outside)
    assert (expected.selected_token_ranks[outside] >= vocab).all()
    assert torch.allclose(got.logprobs.cpu(), expected.logprobs.cpu(), rtol=0, atol=1e-5,
                          equal_nan=True)
    finite = torch.isfinite(expected.logprobs.cpu())
    assert torch.equal(got.logprob_ids.cpu()[finite], expected.logprob_token_ids.cpu()[finite])
    assert got.logprob_ids[:, 0].tolist() == got.sampled.tolist()
    # Where a row keeps fewer ids than n, the columns past them name dropped candidates, once.
    for r, row in enumerate(kept_rows):
        ids = got.logprob_ids[r, 1:].tolist()
        assert ids[: len(row)] == sorted(row, key=lambda i: -float(logits[r, i]))[: len(ids)]
        assert len(set(ids)) == len(ids) and not set(ids[len(row):]) & set(row)


@pytest.mark.parametrize("device", DEVICES)
def test_candidate_count_bounds(device: str) -> None:
    logits = torch.randn(2, 100, device=device)
    with pytest.raises(ValueError, match="num_candidates"):
        run(logits, [5, 5], [1.0, 1.0], num_candidates=101)
    with pytest.raises(ValueError, match="num_candidates"):
        run(torch.randn(1, MAX_CANDIDATES + 10, device=device), [5], [1.0],
            num_candidates=MAX_CANDIDATES + 1)
    with pytest.raises(ValueError, match="num_logprobs"):
        run(logits, [5, 5], [1.0, 1.0], num_logprobs=6)
    empty = run(logits[:0], [5], [1.0], num_candidates=5, num_logprobs=2)
    assert empty.packed.shape == (0, 6) and empty.logprobs.shape == (0, 3)
    with pytest.raises(ValueError, match="packed must be"):
        run(logits, [5, 5], [1.0, 1.0], packed=torch.empty((2, 5), dtype=torch.int32,
                                                             device=device))


def cpu_buffer(words: int) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
    """A ``MappedRows`` buffer for the interpreter: host memory is the kernel's memory there."""
    buffer = torch.zeros(words, dtype=torch.int32)
    return buffer, buffer.numpy(), buffer


class Reader:
    """Stands for a step's masks holding a buffer (anything weakref-able)."""


def test_mapped_rows_take_the_copy_path_once_an_allocation_failed(
        caplog: pytest.LogCaptureFixture) -> None:
    allocations: list[int] = []

    def allocate(words: int) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        allocations.append(words)
        if len(allocations) > 1:
            raise RuntimeError("cudaHostAlloc failed")
        return cpu_buffer(words)

    mapped_rows = MappedRows(allocate)
    first = mapped_rows.take(2, 3)
    reader = Reader()
    first.hold(reader)
    assert mapped_rows.take(2, 3) is None  # a second buffer was not allocated: the copy path
    assert "not allocated" in caplog.text
    assert mapped_rows.take(2, 3) is None and len(allocations) == 2  # not tried again
    first.release()
    assert mapped_rows.take(2, 3) is first  # the buffer made before still serves
    assert mapped_rows.take(MappedRows.MIN_WORDS, 2) is None  # too small, and not replaced
    assert len(allocations) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_writes_rows_into_mapped_host_buffers(device: str) -> None:
    """Steps whose rows are written into mapped host buffers unpack to the rows the kernel
    writes to device memory, also with every buffer read late (a buffer is handed out again only
    once its step was unpacked or dropped); with all buffers busy a step gets none (the copy
    path); a larger step replaces a buffer too small for it."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    mapped_rows = MappedRows(uva_buffer if device == "cuda" else cpu_buffer)
    gen = torch.Generator().manual_seed(3)
    top_k, top_p = [4, 9, 1], [1.0, 0.8, 1.0]

    def step(logits: torch.Tensor):
        """One mapped step: (its host masks, the rows the kernel writes to device memory)."""
        slot = mapped_rows.take(logits.shape[0], 1 + max(top_k))
        assert slot is not None
        got = run(logits, top_k, top_p, packed=slot.device_rows(logits.shape[0], 1 + max(top_k)))
        masks = DeviceStepMasks(CompactSupport(got.packed, None, logits.shape[1]), mapped=slot)
        return masks.copy_to_host_nonblocking(), rows_of(run(logits, top_k, top_p).packed)

    steps = [step(torch.randn(3, 300, generator=gen).to(device))
             for _ in range(MappedRows.MAX_BUFFERS)]
    assert mapped_rows.take(3, 1 + max(top_k)) is None  # every buffer waits for its reader
    if device == "cuda":
        torch.cuda.synchronize()  # what the step's copy event is for
    for host, expected in steps:
        assert host.unpack(np.ones(3, dtype=np.int32)).rows == [
            np.asarray(row, dtype="<i4").tobytes() for row in expected]
    # Read: every buffer is free again, and each new step's rows are its own.
    host, expected = step(torch.randn(3, 300, generator=gen).to(device))
    dropped = step(torch.randn(3, 300, generator=gen).to(device))
    del dropped
    gc.collect()
    later, later_expected = step(torch.randn(3, 300, generator=gen).to(device))
    if device == "cuda":
        torch.cuda.synchronize()
    for host, expected in [(host, expected), (later, later_expected)]:
        assert [bytes(row) for row in host.unpack(np.ones(3, dtype=np.int32)).rows] == [
            np.asarray(row, dtype="<i4").tobytes() for row in expected]
    # A step larger than the buffers replaces one with a larger buffer.
    num_rows = MappedRows.MIN_WORDS // 100
    slot = mapped_rows.take(num_rows, 101)
    assert slot.host.size >= num_rows * 101 > MappedRows.MIN_WORDS
    assert slot.host_rows(num_rows, 101).shape == tuple(slot.device_rows(num_rows, 101).shape)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flashinfer_candidates_match_torch_topk(dtype: torch.dtype) -> None:
    """On CUDA the candidates come from FlashInfer's compiled radix top-k called directly: the
    same values as ``torch.topk``, descending, each id pointing at its value, repeatable."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = torch.randn(64, 151936, device="cuda").to(dtype)
    logits[:, 7] = logits[:, 11] = logits[:, 13] = 9.0  # ties at the top
    values, ids = top_candidates(logits, 50)
    expected, _ = torch.topk(logits, 50, dim=1)
    assert ids.dtype == torch.int32, "the radix top-k was not used (torch.topk gives int64)"
    assert torch.equal(values, expected)
    assert torch.equal(logits.gather(1, ids.long()), values)
    again_values, again_ids = top_candidates(logits, 50)
    assert torch.equal(again_ids, ids) and torch.equal(again_values, values)
