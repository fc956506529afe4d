"""The V1 runner's capture without an engine: vLLM's real V1 ``Sampler`` (patched as in every
vLLM process) on hand-made logits, a custom logits processor, and the runner-side step
bookkeeping (opt-outs by request id, partial-prefill rows, the sync and async hand-over)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_sampling_mask.worker.step_masks import StepSamplingMasks, compact_step
from vllm_sampling_mask.worker.v1_model_runner import (
    PendingHostMasks,
    StepInputs,
    V1SamplingMaskCapture,
    wrap_async_get_output,
    wrap_sample_tokens,
)

VOCAB = 301  # not a multiple of 32 nor of the kernel's block


def v1_sampler(capture: V1SamplingMaskCapture | None):
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode="processed_logprobs")
    if capture is not None:
        sampler.__dict__["sampling_mask_capture"] = capture
    return sampler


def sampling_metadata(top_k: list[int], top_p: list[float], processors: list = ()):
    """V1 ``SamplingMetadata`` for a random batch asking for full-vocabulary logprobs (-1)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    rows = len(top_k)
    return SamplingMetadata(
        temperature=torch.full((rows,), 0.8), all_greedy=False, all_random=True,
        top_p=torch.tensor(top_p), top_k=torch.tensor(top_k, dtype=torch.int32),
        generators={}, max_num_logprobs=-1, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows), output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(processors),
    )


def ban_even_ids_in_row(row: int):
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from vllm_sampling_mask_testing.logits_processors import REQUEST_KEY, BanEvenTokenIds

    processor = BanEvenTokenIds(None, torch.device("cpu"), False)
    params = SamplingParams(extra_args={REQUEST_KEY: True})
    processor.update_state(BatchUpdate(batch_size=row + 1, removed=[], moved=[],
                                       added=[(row, params, None, [])]))
    return processor


def test_rows_are_the_finite_processed_logprobs_after_a_custom_processor() -> None:
    capture = V1SamplingMaskCapture(max_width=16)
    sampler = v1_sampler(capture)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    logits[1] *= 0.05  # a flat row: its top-p nucleus is wide
    top_k = [5, VOCAB, 12, 7]  # row 1: no top_k (vLLM stores the vocabulary size)
    metadata = sampling_metadata(top_k, [1.0, 0.5, 0.9, 1.0], [ban_even_ids_in_row(2)])
    capture.step = StepInputs(np.array(top_k, dtype=np.int32), None)
    output = sampler(logits.clone(), metadata)
    assert capture.step is None and capture.pending is not None
    rows = capture.pending.copy_to_host_nonblocking().unpack(np.ones(4, dtype=np.int32))
    logprobs = output.logprobs_tensors.logprobs
    for r in range(4):
        finite = torch.isfinite(logprobs[r]).nonzero().flatten().tolist()
        assert rows.row(r).tolist() == finite, r
        assert int(output.sampled_token_ids[r, 0]) in finite
        assert math.isclose(torch.logsumexp(logprobs[r, finite], 0).item(), 0.0, abs_tol=1e-5)
    assert len(rows.row(0)) >= 5 and len(rows.row(3)) >= 7
    assert len(rows.row(1)) > 16  # the top-p row is wider than the copy width: exact anyway
    assert rows.row(2).size and all(t % 2 for t in rows.row(2).tolist())  # the processor's ban


def test_sampler_calls_outside_a_step_capture_nothing() -> None:
    """Profiling and warm-up runs call the sampler too: no step set, nothing compacted."""
    capture = V1SamplingMaskCapture(max_width=16)
    sampler = v1_sampler(capture)
    sampler(torch.randn(2, VOCAB), sampling_metadata([4, 4], [1.0, 1.0]))
    assert capture.pending is None


def test_opt_outs_are_tracked_by_request_id() -> None:
    from vllm import SamplingParams

    capture = V1SamplingMaskCapture(max_width=16)

    def new(req_id: str, **extra) -> SimpleNamespace:
        return SimpleNamespace(req_id=req_id, sampling_params=SamplingParams(extra_args=extra))

    capture.note_requests(SimpleNamespace(finished_req_ids=set(), scheduled_new_reqs=[
        new("a"), new("b", return_sampling_mask=False), new("c", return_sampling_mask=0),
        SimpleNamespace(req_id="pooling", sampling_params=None)]))
    assert capture.opted_out == {"b", "c"}
    assert capture.row_wants(["c", "a", "b"], 3).tolist() == [False, True, False]
    capture.note_requests(SimpleNamespace(finished_req_ids={"b", "c"}, scheduled_new_reqs=[]))
    assert capture.row_wants(["a"], 1) is None  # no opt-out left: no per-row work


class FakeRunner:
    """The attributes of vLLM's V1 runner that ``sample_tokens`` reads, with a step that samples
    through the real (patched) V1 sampler."""

    def __init__(self, req_ids: list[str], top_k: list[int], discard: list[bool],
                 capture: V1SamplingMaskCapture):
        self.sampler = v1_sampler(capture)
        self.__dict__["sampling_mask_capture"] = capture
        top_k_cpu = np.full(8, VOCAB, dtype=np.int32)
        top_k_cpu[: len(top_k)] = top_k
        self.input_batch = SimpleNamespace(num_reqs=len(req_ids), req_ids=req_ids,
                                           top_k_cpu=top_k_cpu)
        mask = np.zeros(8, dtype=bool)
        mask[: len(discard)] = discard
        self.discard_request_mask = SimpleNamespace(np=mask)
        self.execute_model_state = SimpleNamespace(spec_decode_metadata=None)
        self.top_k = top_k

    def sample_tokens(self, grammar_output: object) -> object:
        from vllm.v1.outputs import ModelRunnerOutput

        rows = len(self.top_k)
        logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(1))
        out = self.sampler(logits, sampling_metadata(self.top_k, [1.0] * rows))
        req_ids = self.input_batch.req_ids
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=out.sampled_token_ids.tolist())


def test_sync_scheduling_rows_follow_req_ids() -> None:
    """Sync scheduling (the CPU engine's only mode): rows attached at once; a partial-prefill
    row yields b"", an opted-out row None."""
    capture = V1SamplingMaskCapture(max_width=16)
    capture.opted_out.add("out")
    runner = FakeRunner(["a", "prefill", "out", "b"], [3, 4, VOCAB, 6],
                        [False, True, False, False], capture)
    output = wrap_sample_tokens(FakeRunner.sample_tokens)(runner, None)
    masks = output.sampling_masks
    assert isinstance(masks, StepSamplingMasks) and len(masks.rows) == 4
    assert masks.rows[1] == b"" and masks.rows[2] is None
    for r, k in ((0, 3), (3, 6)):
        assert len(masks.row(r)) == k and output.sampled_token_ids[r][0] in masks.row(r)
    assert capture.step is None and capture.pending is None


def test_a_step_of_only_opted_out_requests_compacts_nothing() -> None:
    capture = V1SamplingMaskCapture(max_width=16)
    capture.opted_out.update({"x", "y"})
    runner = FakeRunner(["x", "y"], [VOCAB, VOCAB], [False, False], capture)
    output = wrap_sample_tokens(FakeRunner.sample_tokens)(runner, None)
    assert output.sampling_masks.rows == [None, None]


def test_a_step_whose_sampler_did_not_capture_is_an_error() -> None:
    capture = V1SamplingMaskCapture(max_width=16)
    runner = FakeRunner(["a"], [3], [False], capture)
    del runner.sampler.__dict__["sampling_mask_capture"]  # the sampler never sees the step
    with pytest.raises(RuntimeError, match="sampler did not run"):
        wrap_sample_tokens(FakeRunner.sample_tokens)(runner, None)


def test_async_output_unpacks_its_pending_rows() -> None:
    """``AsyncGPUModelRunnerOutput.get_output``: the host copy (here without a device event)
    becomes ``sampling_masks``."""
    logits = torch.full((2, VOCAB), float("-inf"))
    logits[0, [3, 9]] = 0.0
    logits[1, 5] = 0.0
    host = compact_step(logits, np.array([2, 1]), 16).copy_to_host_nonblocking()

    class AsyncOutput:
        def get_output(self) -> SimpleNamespace:
            return SimpleNamespace()

    pending_output = AsyncOutput()
    pending_output._sampling_mask_host = PendingHostMasks(
        host, None, np.array([1, 0], dtype=np.int32))
    get_output = wrap_async_get_output(AsyncOutput.get_output)
    output = get_output(pending_output)
    assert output.sampling_masks.rows == [np.array([3, 9], "<i4").tobytes(), b""]
    assert pending_output._sampling_mask_host is None  # taken: unpacked once
    assert not hasattr(get_output(pending_output), "sampling_masks")


def test_switch_off_runners_and_samplers_are_left_alone() -> None:
    """Without a capture (switch off), ``sample_tokens`` and ``Sampler.sample`` only pass
    through: no step state read, nothing attached."""
    from vllm.v1.outputs import ModelRunnerOutput

    sampler = v1_sampler(None)
    lookups: list[str] = []
    module_getattr = torch.nn.Module.__getattr__

    def counted_getattr(module: torch.nn.Module, name: str):
        lookups.append(name)
        return module_getattr(module, name)

    # The V1 Sampler is an nn.Module: an attribute it lacks would be looked up through
    # nn.Module.__getattr__ (slow) on every step of every switch-off engine.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.Module, "__getattr__", counted_getattr)
        output = sampler(torch.randn(2, VOCAB), sampling_metadata([4, 4], [1.0, 1.0]))
    assert "sampling_mask_capture" not in lookups, lookups
    assert output.sampled_token_ids.shape == (2, 1) and "sampling_mask_capture" not in sampler.__dict__
    stock = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[1]])
    runner = SimpleNamespace(execute_model_state=object())  # no input batch: must not be read
    result = wrap_sample_tokens(lambda self, grammar_output: stock)(runner, None)
    assert result is stock and "sampling_masks" not in vars(stock)
