"""Sampler-side decisions: the compact width, the overflow path, FlashInfer off, requests that
opt out (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_sampling_mask.worker.sampler import (
    SamplingMaskCapture,
    attach_capture,
    wrap_add_request,
    wrap_compute_topk_scores,
    wrap_rejection_sample,
    wrap_rejection_sampler_call,
    wrap_sample,
)
from vllm_sampling_mask.worker.compaction import CompactSupport
from vllm_sampling_mask.worker.step_masks import (
    NO_MASKS_WANTED,
    WIDE_UNPACK_WIDTH,
    DeviceStepMasks,
    expand_rows_to_host,
    tie_slack,
)


def slot_array(values: np.ndarray) -> SimpleNamespace:
    """A vLLM ``UvaBackedTensor`` stand-in: ``np`` and ``gpu`` share one CPU buffer."""
    tensor = torch.from_numpy(values)
    return SimpleNamespace(np=values, gpu=tensor)


def fake_sampler(vocab_size: int, max_num_reqs: int = 8) -> SimpleNamespace:
    """Sampling states by request slot (no top_k / top_p, temperature 1, no logprobs) and
    vLLM's transforms up to min-p as the identity."""
    num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)  # vLLM's NO_LOGPROBS
    num_token_ids = np.zeros(max_num_reqs, dtype=np.int32)  # logprob_token_ids per slot
    states = SimpleNamespace(
        vocab_size=vocab_size, max_num_reqs=max_num_reqs,
        top_k=slot_array(np.full(max_num_reqs, vocab_size, dtype=np.int32)),
        top_p=slot_array(np.ones(max_num_reqs, dtype=np.float32)),
        temperature=slot_array(np.ones(max_num_reqs, dtype=np.float32)),
        seeds=slot_array(np.arange(max_num_reqs, dtype=np.int64)),
        num_logprobs=num_logprobs,
        max_num_logprobs=lambda idx: int(num_logprobs[idx].max()))
    token_ids = SimpleNamespace(num_token_ids=num_token_ids,
                                max_num_token_ids=lambda idx: int(num_token_ids[idx].max()))
    return SimpleNamespace(use_flashinfer=True, sampling_states=states,
                           logprobs_mode="processed_logprobs", logprob_token_ids_state=token_ids,
                           apply_sampling_params=lambda logits, *args, **kwargs: logits)


def fake_config(enabled: bool, **extra) -> SimpleNamespace:
    return SimpleNamespace(additional_config={"return_sampling_mask": enabled, **extra})


def test_capture_turns_the_flashinfer_sampler_off() -> None:
    sampler = fake_sampler(1000)
    attach_capture(sampler, fake_config(True, sampling_mask_max_width=64))
    assert sampler.use_flashinfer is False
    capture = sampler.__dict__["sampling_mask_capture"]
    assert (capture.max_width, capture.vocab_size) == (64, 1000)
    assert capture.use_flashinfer is True  # vLLM's choice, for steps that capture nothing


def test_opted_out_rows_are_left_out_and_steps_without_masks_keep_vllms_sampler() -> None:
    vocab = 2000  # the opted-out row has no top_k: over MAX_CANDIDATES, vLLM's path + compaction
    sampler = fake_sampler(vocab)
    attach_capture(sampler, fake_config(True))
    flashinfer_seen: list[bool] = []

    def sample(self, logits, expanded_idx_mapping, idx_mapping_np, *args, **kwargs):
        flashinfer_seen.append(self.use_flashinfer)
        return None, logits

    add_request = wrap_add_request(lambda self, req_idx, prompt_len, params: None)
    sample = wrap_sample(sample)
    add_request(sampler, 2, 5, SimpleNamespace(extra_args=None))  # default: wants masks
    add_request(sampler, 5, 5, SimpleNamespace(extra_args={"return_sampling_mask": False}))
    sampler.sampling_states.top_k.np[[2, 5]] = [3, vocab]  # slot 5: no top_k (vocabulary size)
    logits = torch.full((2, vocab), float("-inf"))
    logits[0, [7, 8, 9]] = 0.0
    logits[1] = 0.0  # the opted-out row keeps the whole vocabulary

    sample(sampler, logits, None, np.array([2, 5]), None, None, None)
    step = sampler.__dict__.pop("_sampling_mask_pending")
    # The width follows the wanting row (3 + slack), not the opted-out row's vocabulary.
    assert step.support.ids.shape == (2, 3 + tie_slack(3))
    assert flashinfer_seen[-1] is False
    rows = step.copy_to_host_nonblocking().unpack(np.ones(2, dtype=np.int32)).rows
    assert rows[0] == np.array([7, 8, 9], dtype="<i4").tobytes() and rows[1] is None

    # Only the opted-out request, whose top_k (none) is over MAX_CANDIDATES: vLLM's sampler.
    sample(sampler, logits[1:], None, np.array([5]), None, None, None)
    assert sampler.__dict__.pop("_sampling_mask_pending") is NO_MASKS_WANTED
    assert flashinfer_seen[-1] is True  # vLLM's own choice of sampler
    assert NO_MASKS_WANTED.copy_to_host_nonblocking().unpack(np.ones(1)).rows == [None]


def test_switch_off_leaves_the_sampler_alone() -> None:
    sampler = fake_sampler(1000)
    attach_capture(sampler, fake_config(False))
    assert sampler.use_flashinfer is True and "sampling_mask_capture" not in sampler.__dict__


def test_width_is_the_batch_largest_top_k_plus_tie_slack_capped() -> None:
    capture = SamplingMaskCapture(max_width=64, vocab_size=500)
    logits = torch.randn(3, 500)
    step = capture.compact(logits, np.array([5, 20, 9], dtype=np.int32))
    assert step.support.ids.shape == (3, 20 + tie_slack(20))
    # "no top_k" is stored by vLLM as the vocabulary size: capped width, row 1 expanded from
    # the bitmap.
    step = capture.compact(logits, np.array([5, 500, 9], dtype=np.int32))
    assert step.support.ids.shape == (3, 64)
    host = step.copy_to_host_nonblocking().unpack(np.ones(3, dtype=np.int32))
    assert host.row(1).tolist() == list(range(500))  # exact beyond the cap


def test_rows_wider_than_the_width_are_fetched_from_the_bitmap() -> None:
    # Ties beyond the slack: the width is too small for row 1, which is expanded from the bitmap
    # (expand_rows_to_host; on a GPU on a side stream) and still exact.
    capture = SamplingMaskCapture(max_width=64, vocab_size=300)
    logits = torch.full((2, 300), float("-inf"))
    logits[0, :3] = 0.0
    logits[1, 100:200] = 1.0  # 100 ids tied, far beyond top_k 3 + slack 32
    step = capture.compact(logits, np.array([3, 3], dtype=np.int32))
    assert step.support.ids.shape == (2, 35)
    host = step.copy_to_host_nonblocking().unpack(np.ones(2, dtype=np.int32))
    assert host.row(0).tolist() == [0, 1, 2]
    assert host.row(1).tolist() == list(range(100, 200))
    ids = expand_rows_to_host(step.support, np.array([1, 0]), np.array([100, 3]))
    assert np.frombuffer(ids, dtype="<i4").tolist() == list(range(100, 200)) + [0, 1, 2]


def test_wide_compaction_steps_copy_counts_and_expand_every_row() -> None:
    # A compaction wider than WIDE_UNPACK_WIDTH (large top_k, top-p only) copies only the counts;
    # every row is expanded from the bitmap, and the step's rows are views of that one buffer.
    generator = torch.Generator().manual_seed(0)
    logits = torch.full((4, 2000), float("-inf"))
    kept = [torch.randperm(2000, generator=generator)[:n] for n in (600, 1, 300, 450)]
    for r, ids in enumerate(kept):
        logits[r, ids] = 0.0
    capture = SamplingMaskCapture(max_width=4096, vocab_size=2000)
    step = capture.compact(logits, np.full(4, 600, dtype=np.int32))
    assert step.support.ids.shape[1] > WIDE_UNPACK_WIDTH
    host = step.copy_to_host_nonblocking()
    assert host.packed.shape == (4, 1)
    rows = host.unpack(np.array([1, 1, 0, 1]))  # row 2 sampled nothing
    expected = [sorted(k.tolist()) for k in kept]
    expected[2] = []
    assert isinstance(rows.blob, memoryview)
    assert [rows.row(r).tolist() for r in range(4)] == expected
    assert rows.row_lengths() == [600, 1, 0, 450]
    assert all(type(row) is bytes for row in rows.rows)


def test_wide_candidate_steps_unpack_by_row_slices() -> None:
    # The candidate sampler's rows (no bitmap) wider than WIDE_UNPACK_WIDTH: copied whole, each
    # row's ids sliced out on the host.
    width = WIDE_UNPACK_WIDTH + 44
    packed = torch.full((3, 1 + width), -1, dtype=torch.int32)
    lengths = [width, 0, 7]
    for r, n in enumerate(lengths):
        packed[r, 0] = n
        packed[r, 1 : 1 + n] = torch.arange(n) * 3 + r
    support = CompactSupport(packed, None, 5000)
    rows = DeviceStepMasks(support, row_wants=np.array([True, True, False])
                           ).copy_to_host_nonblocking().unpack(np.ones(3, dtype=np.int32))
    assert rows.row(0).tolist() == [i * 3 for i in range(width)]
    assert rows.row_bytes(1) == b"" and rows.row_bytes(2) is None  # row 2 opted out


def test_steps_with_small_top_k_sample_with_the_candidates() -> None:
    # Every row's top_k <= MAX_CANDIDATES: vLLM's top-k/top-p path is not called; the rows come
    # from the candidate sampler (no bitmap), opted-out rows are sampled but not unpacked, and the
    # processed logits are the kept ids' only when vLLM computes the step's logprobs from them
    # (a request asks for the logprobs of given token ids).
    vocab = 300
    sampler = fake_sampler(vocab)
    attach_capture(sampler, fake_config(True))
    add_request = wrap_add_request(lambda self, req_idx, prompt_len, params: None)
    add_request(sampler, 1, 5, SimpleNamespace(extra_args=None))
    add_request(sampler, 4, 5, SimpleNamespace(extra_args={"return_sampling_mask": False}))
    sampler.sampling_states.top_k.np[[1, 4]] = [3, 40]
    sampler.sampling_states.top_p.np[4] = 0.5
    sampler.logprob_token_ids_state.num_token_ids[4] = 2

    def vllm_path(*args, **kwargs):
        raise AssertionError("vLLM's top-k/top-p path ran")

    sample = wrap_sample(vllm_path)
    logits = torch.arange(2 * vocab, dtype=torch.float32).reshape(2, vocab) % 97
    mapping = torch.tensor([1, 4], dtype=torch.int32)
    positions = torch.tensor([10, 11])
    sampled, processed = sample(sampler, logits.clone(), mapping, np.array([1, 4]), positions,
                                None, None, return_logprobs=True)
    step = sampler.__dict__.pop("_sampling_mask_pending")
    assert step.support.bits is None and step.support.ids.shape == (2, 40)
    rows = step.copy_to_host_nonblocking().unpack(np.ones(2, dtype=np.int32)).rows
    assert np.frombuffer(rows[0], dtype="<i4").tolist() == [96, 193, 290]  # the three 96s
    assert rows[1] is None
    assert int(sampled[0]) in (96, 193, 290)
    assert torch.isfinite(processed[0]).nonzero().flatten().tolist() == [96, 193, 290]
    _, unfiltered = sample(sampler, logits.clone(), mapping, np.array([1, 4]), positions,
                           None, None)
    assert torch.equal(unfiltered, logits)  # not read by Sampler.__call__ without logprobs


@pytest.mark.parametrize("num_logprobs", [0, 3, 60])
def test_candidate_steps_compute_processed_logprobs_themselves(num_logprobs: int) -> None:
    # A candidate step that returns processed logprobs: the kernel that samples computes them
    # (over the kept ids) and Sampler.__call__'s compute_topk_scores returns them instead of
    # reading the processed logits, which stay unfiltered; with more top logprobs than the
    # batch's top_k, more candidates are taken.
    vocab = 300
    sampler = fake_sampler(vocab)
    attach_capture(sampler, fake_config(True))
    sampler.sampling_states.top_k.np[[1, 4]] = [3, 40]
    sampler.sampling_states.top_p.np[4] = 0.5
    sampler.sampling_states.num_logprobs[[1, 4]] = [num_logprobs, 0]

    def vllm_path(*args, **kwargs):
        raise AssertionError("vLLM's path ran")

    logits = torch.arange(2 * vocab, dtype=torch.float32).reshape(2, vocab) % 97 / 10
    sampled, processed = wrap_sample(vllm_path)(
        sampler, logits.clone(), torch.tensor([1, 4], dtype=torch.int32), np.array([1, 4]),
        torch.tensor([10, 11]), None, None, return_logprobs=True)
    assert torch.equal(processed, logits)
    compute_topk_scores = wrap_compute_topk_scores(vllm_path)
    scores = compute_topk_scores(processed, num_logprobs, sampled, [0, 1, 2])
    assert scores.cu_num_generated_tokens == [0, 1, 2]
    assert scores.logprob_token_ids.shape == (2, 1 + num_logprobs)
    assert scores.logprob_token_ids[:, 0].tolist() == sampled.tolist()
    # Row 0 keeps the three 9.6s: each logprob log(1/3), rank 3; then dropped ids at -inf.
    assert scores.selected_token_ranks[0] == 3
    assert abs(float(scores.logprobs[0, 0]) + np.log(3.0)) < 1e-6
    kept = min(3, num_logprobs)
    assert torch.isfinite(scores.logprobs[0, 1:]).sum() == kept
    top_ids = scores.logprob_token_ids[0, 1:].tolist()
    assert set(top_ids[:kept]) <= {96, 193, 290} and not set(top_ids[kept:]) & {96, 193, 290}
    # Taken once: the next call (another step's tensor) is vLLM's again.
    with pytest.raises(AssertionError, match="vLLM's path ran"):
        compute_topk_scores(processed, num_logprobs, sampled, None)


def test_candidate_steps_leave_other_logprobs_to_vllm() -> None:
    # More top logprobs than the candidate sampler takes (logprobs=-1 is the vocabulary), or
    # logprobs of given token ids: vLLM computes them from the filtered processed logits.
    vocab = 2000
    sampler = fake_sampler(vocab)
    attach_capture(sampler, fake_config(True))
    sampler.sampling_states.top_k.np[1] = 5
    sampler.sampling_states.num_logprobs[1] = vocab
    logits = torch.randn(1, vocab)
    sample = wrap_sample(lambda *args, **kwargs: None)
    calls = []
    compute_topk_scores = wrap_compute_topk_scores(lambda *args, **kwargs: calls.append(args))
    for state in ("many", "token_ids"):
        if state == "token_ids":
            sampler.sampling_states.num_logprobs[1] = 1
            sampler.logprob_token_ids_state.num_token_ids[1] = 3
        sampled, processed = sample(sampler, logits.clone(), torch.tensor([1], dtype=torch.int32),
                                    np.array([1]), torch.tensor([0]), None, None,
                                    return_logprobs=True)
        assert torch.isfinite(processed).sum() == 5
        compute_topk_scores(processed, 1, sampled, None)
        assert calls.pop()[0] is processed


@pytest.mark.parametrize("return_logprobs", [False, True])
def test_steps_without_masks_sample_with_the_candidates_and_capture_nothing(
        return_logprobs: bool) -> None:
    # Only opted-out rows, every top_k <= MAX_CANDIDATES: the candidate sampler (vLLM's path is
    # not called) and nothing to copy.
    vocab = 300
    sampler = fake_sampler(vocab)
    attach_capture(sampler, fake_config(True))
    add_request = wrap_add_request(lambda self, req_idx, prompt_len, params: None)
    for slot in (2, 3):
        add_request(sampler, slot, 5, SimpleNamespace(extra_args={"return_sampling_mask": False}))
    sampler.sampling_states.top_k.np[[2, 3]] = [4, 10]

    def vllm_path(*args, **kwargs):
        raise AssertionError("vLLM's sampler ran")

    sample = wrap_sample(vllm_path)
    logits = torch.arange(2 * vocab, dtype=torch.float32).reshape(2, vocab)
    sampled, processed = sample(sampler, logits.clone(), torch.tensor([2, 3], dtype=torch.int32),
                                np.array([2, 3]), torch.tensor([0, 1]), None, None,
                                return_logprobs=return_logprobs)
    assert sampler.__dict__.pop("_sampling_mask_pending") is NO_MASKS_WANTED
    assert 296 <= int(sampled[0]) < 300 and 290 <= int(sampled[1]) < 300
    # Opted-out requests' logprobs are processed ones too (the engine's logprobs mode): computed
    # by the kernel that samples, so the processed logits stay unfiltered.
    assert torch.equal(processed, logits)


def test_a_failing_flashinfer_top_k_falls_back_to_torch_topk(monkeypatch, caplog) -> None:
    # FlashInfer's top-k JIT-compiles on first use, at engine load: if that fails (no CUDA
    # compiler, say), the engine still starts and takes the candidates with torch.topk.
    from vllm_sampling_mask.worker import candidate_sampler, sampler as sampler_module

    def broken_top_k(*args, **kwargs):
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(candidate_sampler, "_torch_top_k_only", False)  # restored afterwards
    monkeypatch.setattr(sampler_module, "top_candidates", lambda logits, k: broken_top_k())
    sampler = fake_sampler(100)
    with caplog.at_level("WARNING", logger="vllm_sampling_mask"):
        attach_capture(sampler, fake_config(True))
    assert "uses torch.topk" in caplog.text and "nvcc not found" in caplog.text
    assert candidate_sampler._torch_top_k_only
    values, ids = candidate_sampler.top_candidates(torch.tensor([[0.0, 3.0, 1.0]]), 2)
    assert ids.tolist() == [[1, 2]] and values.tolist() == [[3.0, 1.0]]


def test_speculative_steps_get_a_row_per_position_grouped_by_request() -> None:
    """Model Runner V2's rejection sampler: the processed logits of every position (two draft
    positions + the bonus one for slot 1, the bonus one alone for slot 4, one draft + bonus for
    the opted-out slot 6) are compacted as ``rejection_sample`` receives them, and each request
    gets the rows of the positions it sampled at."""
    vocab = 64
    sampler = fake_sampler(vocab)
    attach_capture(sampler, fake_config(True))
    add_request = wrap_add_request(lambda self, req_idx, prompt_len, params: None)
    for slot, extra in ((1, None), (4, None), (6, {"return_sampling_mask": False})):
        add_request(sampler, slot, 5, SimpleNamespace(extra_args=extra))
    sampler.sampling_states.top_k.np[[1, 4, 6]] = [2, 3, vocab]
    processed = torch.full((6, vocab), float("-inf"))
    kept = [[3, 9], [10, 11], [0, 63], [5, 6, 7], [1], [2]]
    for row, ids in enumerate(kept):
        processed[row, ids] = 0.0
    processed[4:] = 0.0  # the opted-out request's positions keep the whole vocabulary

    rejection_sample = wrap_rejection_sample(lambda logits, *args: ("sampled", "num_sampled"))

    def call(self, logits, input_batch, draft_logits=None):
        assert rejection_sample(processed, "draft", "cu") == ("sampled", "num_sampled")
        return SimpleNamespace(sampling_mask=None)

    call = wrap_rejection_sampler_call(call)
    batch = SimpleNamespace(idx_mapping_np=np.array([1, 4, 6]),
                            cu_num_logits_np=np.array([0, 3, 4, 6]))
    output = call(SimpleNamespace(sampler=sampler), None, batch)
    # Request 0 accepted one draft token (2 sampled), request 1 sampled its bonus token.
    step = output.sampling_mask.copy_to_host_nonblocking().unpack(np.array([2, 1, 2]))
    assert step.groups == [0, 3, 4, 6]
    assert step.rows[:4] == [np.array(ids, dtype="<i4").tobytes() for ids in
                             ([3, 9], [10, 11], [], [5, 6, 7])]  # position 2 was not sampled
    assert step.rows[4:] == [None, None]

    rejection_sample(processed, "draft", "cu")  # outside a mask step: nothing is compacted
    assert sampler.__dict__.get("_sampling_mask_pending") is None
    only_opted_out = SimpleNamespace(idx_mapping_np=np.array([6]),
                                     cu_num_logits_np=np.array([0, 2]))
    assert call(SimpleNamespace(sampler=sampler), None, only_opted_out).sampling_mask \
        is NO_MASKS_WANTED
