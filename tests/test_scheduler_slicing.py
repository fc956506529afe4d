"""The scheduler cuts each step's mask rows per request (``core/scheduler.py``), engine-free.

A hand-built vLLM 0.26 ``Scheduler`` is driven through ``schedule()`` / ``update_from_output()``
by a fake model runner that samples scripted tokens and attaches, as the MRV2 worker does, a
``StepSamplingMasks`` CSR whose rows are recognisable: the row of request ``k`` at step ``s``
holds the sampled token plus ids ``100_000 * k + 100 * s + j``. Every test asserts the exact rows
each ``EngineCoreOutput`` carries: the rows of the tokens vLLM kept, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import torch

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, FinishReason
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.utils.hashing import get_hash_fn_by_name

from vllm_builders import EOS_TOKEN_ID, engine_core_request, sampling_params
from vllm_sampling_mask.core import scheduler as scheduler_module
from vllm_sampling_mask.engine.transport import (
    EngineCoreOutputWithMask,
    JoinedMaskRows,
    rows_mask,
)
from vllm_sampling_mask.outputs import SamplingMask
from vllm_sampling_mask.worker.step_masks import StepSamplingMasks
from vllm_sampling_mask_testing.native_loops import loop_fixture

MAX_MODEL_LEN = 64
TOKEN_BUDGET = 16  # max_num_batched_tokens: prompts longer than this are chunked
BLOCK_SIZE = 16
ROW_STRIDE = 100_000  # ids of request k's rows start at ROW_STRIDE * k (> any scripted token)

Row = list[int]


# --------------------------------------------------------------------------- builders


# Every test runs with the C loop, then with the Python loop alone.
hand_out_loop = loop_fixture(scheduler_module, "_hand_out_rows_native")


def _engine_config(model: str, **kwargs: object) -> VllmConfig:
    return EngineArgs(
        model=model,
        logprobs_mode="processed_logprobs",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=TOKEN_BUDGET,
        max_num_seqs=4,
        block_size=BLOCK_SIZE,
        **kwargs,
    ).create_engine_config()


@pytest.fixture(scope="module")
def configs(tiny_model_dir: str) -> dict[bool, VllmConfig]:
    """``{switch: VllmConfig}``; both select Model Runner V2 (the switch forces it anyway)."""
    with pytest.MonkeyPatch.context() as mp:  # create_engine_config exports the MRV2 env var
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        return {
            True: _engine_config(tiny_model_dir, return_sampling_mask=True),
            False: _engine_config(tiny_model_dir),
        }


def build_scheduler(
    config: VllmConfig, *, num_blocks: int = 64, cls: type[Scheduler] = Scheduler
) -> Scheduler:
    """A scheduler over a single full-attention KV cache group of ``num_blocks`` blocks."""
    model_config = config.model_config
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=model_config.get_total_num_kv_heads(),
        head_size=model_config.get_head_size(),
        dtype=torch.float32,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )


def add_request(
    scheduler: Scheduler, request_id: str, prompt_len: int, **params: object
) -> Request:
    """Queue a request with a ``prompt_len``-token prompt (ids 1..prompt_len)."""
    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    core_request = engine_core_request(
        request_id, range(1, prompt_len + 1), sampling_params(**params),
        arrival_time=float(len(scheduler.requests)),
    )
    request = Request.from_engine_core_request(
        core_request, get_request_block_hasher(BLOCK_SIZE, hash_fn)
    )
    scheduler.add_request(request)
    return request


@dataclass
class FakeRunner:
    """Plays the MRV2 model runner: scripted tokens, one recognisable mask row per sampled token.

    Request ``k`` (1-based, in ``scripts`` order) gets rows ``[token, 100_000*k + 100*step + j]``.

    ``scripts[req_id]`` lists the tokens the request samples, in order (tokens of dropped frames
    are consumed too). Batch rows are ordered by *descending* request id, so a batch index never
    equals the position of the request's output in ``update_from_output``'s result.
    """

    scripts: dict[str, list[int]]
    attach_masks: bool = True
    step: int = 0
    rows: dict[tuple[str, int], Row] = field(default_factory=dict)  # (req_id, step) -> row
    _sampled: dict[str, int] = field(default_factory=dict)

    def row(self, req_id: str, step: int, token: int) -> Row:
        number = list(self.scripts).index(req_id) + 1
        width = 1 + (number + step) % 3
        return [token] + [ROW_STRIDE * number + 100 * step + j for j in range(width)]

    def execute(self, scheduler: Scheduler, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step's output, built from the scheduler's state right after ``schedule()``."""
        req_ids = sorted(scheduler_output.num_scheduled_tokens, reverse=True)
        sampled: list[list[int]] = []
        rows: list[Row] = []
        for req_id in req_ids:
            if scheduler.requests[req_id].is_prefill_chunk:  # partial prefill: nothing sampled
                sampled.append([])
                rows.append([])
                continue
            n = self._sampled.get(req_id, 0)
            self._sampled[req_id] = n + 1
            token = self.scripts[req_id][n]
            sampled.append([token])
            rows.append(self.row(req_id, self.step, token))
            self.rows[(req_id, self.step)] = rows[-1]
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        if self.attach_masks:
            output.sampling_masks = StepSamplingMasks.from_id_lists(rows)
        self.step += 1
        return output


Outputs = dict[str, EngineCoreOutputWithMask]


def run_step(
    scheduler: Scheduler,
    runner: FakeRunner,
    *,
    before_update: Callable[[], object] | None = None,
) -> Outputs:
    """One engine step; ``before_update`` runs while the model "executes" (e.g. an abort)."""
    scheduler_output = scheduler.schedule()
    model_runner_output = runner.execute(scheduler, scheduler_output)
    if before_update is not None:
        before_update()
    return update(scheduler, scheduler_output, model_runner_output)


def update(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
) -> Outputs:
    """``update_from_output``'s outputs (one client) by request id."""
    by_client = scheduler.update_from_output(scheduler_output, model_runner_output)
    assert set(by_client) <= {0}
    outputs = by_client[0].outputs if by_client else []
    # Mask engines build our subclass; others vLLM's own class (vLLM's exact wire bytes).
    expected = EngineCoreOutputWithMask if scheduler.__dict__["sampling_mask_enabled"] else EngineCoreOutput
    assert all(type(o) is expected for o in outputs)
    return {o.request_id: o for o in outputs}


def run_steps(scheduler: Scheduler, runner: FakeRunner, n: int) -> list[Outputs]:
    return [run_step(scheduler, runner) for _ in range(n)]


def mask_of(output: EngineCoreOutput) -> list[Row] | None:
    row = getattr(output, "sampling_mask", None)
    return None if row is None else rows_mask([row]).token_ids


def history(steps: list[Outputs], req_id: str) -> tuple[list[int], list[Row]]:
    """All tokens and rows a request received, in order (outputs without tokens add none)."""
    tokens: list[int] = []
    rows: list[Row] = []
    for outputs in steps:
        if (output := outputs.get(req_id)) is not None:
            tokens += output.new_token_ids
            rows += mask_of(output) or []
    return tokens, rows


def assert_rows_match_runner(steps: list[Outputs], runner: FakeRunner, first_step: int = 0) -> None:
    """Every output with a token carries exactly its step's row; outputs without tokens, none."""
    for step, outputs in enumerate(steps, first_step):
        for req_id, output in outputs.items():
            if output.new_token_ids:
                assert mask_of(output) == [runner.rows[(req_id, step)]], (req_id, step)
            else:
                assert output.sampling_mask is None, (req_id, step)


# --------------------------------------------------------------------------- cases


def test_decode_rows_follow_each_request(configs: dict[bool, VllmConfig]) -> None:
    """Normal decode: each step's output carries its own request's row (looked up by batch index),
    and max_tokens ends the request after exactly max_tokens rows."""
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, 12, 13, 14], "b": [21, 22, 23, 24]})
    add_request(scheduler, "a", 5, max_tokens=4)
    add_request(scheduler, "b", 7, max_tokens=3)
    steps = run_steps(scheduler, runner, 5)

    assert [sorted(s) for s in steps] == [["a", "b"]] * 3 + [["a"], []]
    assert_rows_match_runner(steps, runner)
    # Request 1 ("a") is batch row 1, request 2 ("b") batch row 0 (descending ids).
    assert mask_of(steps[0]["a"]) == [[11, 100_000, 100_001]]
    assert mask_of(steps[0]["b"]) == [[21, 200_000, 200_001, 200_002]]
    assert history(steps, "a") == ([11, 12, 13, 14], [runner.rows[("a", s)] for s in range(4)])
    assert history(steps, "b") == ([21, 22, 23], [runner.rows[("b", s)] for s in range(3)])
    assert steps[3]["a"].finish_reason == FinishReason.LENGTH
    assert steps[2]["b"].finish_reason == FinishReason.LENGTH


def test_eos_finishes_with_its_row(configs: dict[bool, VllmConfig]) -> None:
    """EOS: the EOS token is kept with its row, the request stops; the other request's rows stay
    right although its batch index changes once the finished one leaves the batch."""
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, EOS_TOKEN_ID, 13, 14], "b": [21, 22, 23, 24]})
    add_request(scheduler, "a", 5, max_tokens=10)
    add_request(scheduler, "b", 5, max_tokens=4)
    steps = run_steps(scheduler, runner, 4)

    assert_rows_match_runner(steps, runner)
    assert steps[1]["a"].finish_reason == FinishReason.STOP
    assert history(steps, "a") == (
        [11, EOS_TOKEN_ID], [runner.rows[("a", 0)], runner.rows[("a", 1)]]
    )
    assert history(steps, "b") == ([21, 22, 23, 24], [runner.rows[("b", s)] for s in range(4)])


def test_stop_token_finishes_with_its_row(configs: dict[bool, VllmConfig]) -> None:
    """stop_token_ids: the stop token is kept with its row; stop_reason names it."""
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, 12, 42, 14]})
    add_request(scheduler, "a", 5, max_tokens=10, stop_token_ids=[42])
    steps = run_steps(scheduler, runner, 4)

    assert_rows_match_runner(steps, runner)
    assert (steps[2]["a"].finish_reason, steps[2]["a"].stop_reason) == (FinishReason.STOP, 42)
    assert history(steps, "a") == ([11, 12, 42], [runner.rows[("a", s)] for s in range(3)])
    assert steps[3] == {}


def test_max_model_len_caps_with_its_row(configs: dict[bool, VllmConfig]) -> None:
    """max_model_len: a 61-token prompt (chunked 16+16+16+13) may grow by 3 tokens; the last one
    finishes the request with its row."""
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, 12, 13, 14, 15]})
    add_request(scheduler, "a", MAX_MODEL_LEN - 3, max_tokens=100)
    steps = run_steps(scheduler, runner, 7)

    assert steps[:3] == [{}, {}, {}]
    assert_rows_match_runner(steps, runner)
    assert history(steps, "a") == ([11, 12, 13], [runner.rows[("a", s)] for s in (3, 4, 5)])
    assert steps[5]["a"].finish_reason == FinishReason.LENGTH
    assert steps[6] == {}


def test_chunked_prefill_emits_no_rows_until_its_last_chunk(
    configs: dict[bool, VllmConfig],
) -> None:
    """Chunked prefill next to a decoding request: the partial chunks' zero-length CSR rows emit
    no output and no rows; the decode request's rows are unaffected; the last chunk samples the
    first token and carries its row."""
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, 12, 13, 14, 15], "b": [21, 22]})
    add_request(scheduler, "a", 4, max_tokens=5)
    run_step(scheduler, runner)  # a's prefill
    add_request(scheduler, "b", 40, max_tokens=2)  # 15 + 15 + 10 tokens next to a's decodes
    steps = run_steps(scheduler, runner, 4)

    assert [sorted(s) for s in steps] == [["a"], ["a"], ["a", "b"], ["a", "b"]]
    assert_rows_match_runner(steps, runner, first_step=1)
    assert history(steps, "b") == ([21, 22], [runner.rows[("b", 3)], runner.rows[("b", 4)]])
    assert steps[3]["b"].finish_reason == FinishReason.LENGTH


def test_aborted_request_stale_row_is_ignored(configs: dict[bool, VllmConfig]) -> None:
    """A request aborted while its step executes: its row in the step is dropped with its token;
    the surviving request (a different batch index) gets exactly its own row."""
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, 12, 13], "b": [21, 22, 23]})
    add_request(scheduler, "a", 5, max_tokens=3)
    add_request(scheduler, "b", 5, max_tokens=3)
    steps = [run_step(scheduler, runner)]
    steps.append(run_step(
        scheduler, runner,
        before_update=lambda: scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED),
    ))
    steps.append(run_step(scheduler, runner))

    assert ("b", 1) in runner.rows  # the runner did produce b's row in step 1 ...
    assert sorted(steps[1]) == ["a"]  # ... and it reached no output
    assert_rows_match_runner(steps, runner)
    assert history(steps, "b") == ([21], [runner.rows[("b", 0)]])
    assert history(steps, "a") == ([11, 12, 13], [runner.rows[("a", s)] for s in range(3)])


def test_preempted_request_resumes_with_the_right_rows(configs: dict[bool, VllmConfig]) -> None:
    """Preemption (KV cache too small for both requests): the preempted request gets no output
    while it waits, is recomputed, then continues with its new steps' rows; every kept token of
    both requests has exactly one row, in order."""
    scheduler = build_scheduler(configs[True], num_blocks=5)  # 4 usable blocks of 16 tokens
    runner = FakeRunner({"a": list(range(101, 121)), "b": list(range(201, 221))})
    add_request(scheduler, "a", 17, max_tokens=20)
    b = add_request(scheduler, "b", 17, max_tokens=20)
    steps = run_steps(scheduler, runner, 30)

    assert b.num_preemptions == 1, "b was not preempted: adjust the KV cache size"
    assert scheduler.requests == {}
    b_steps = [step for step, outputs in enumerate(steps) if "b" in outputs]
    gaps = [later - earlier for earlier, later in zip(b_steps, b_steps[1:])]
    assert max(gaps) > 1  # b had no output while preempted
    assert_rows_match_runner(steps, runner)
    for req_id in ("a", "b"):
        tokens, rows = history(steps, req_id)
        assert tokens == runner.scripts[req_id][:20]
        made = sorted((step, row) for (r, step), row in runner.rows.items() if r == req_id)
        assert rows == [row for _, row in made]


def test_async_stale_frame_is_dropped_with_its_row(configs: dict[bool, VllmConfig]) -> None:
    """AsyncScheduler, forced preemption (``reset_prefix_cache(reset_running_requests=True)``)
    while a frame is in flight: that frame's token and row are discarded
    (``async_tokens_to_discard``); after re-prefill the rows continue with the new frames."""
    scheduler = build_scheduler(configs[True], cls=AsyncScheduler)
    runner = FakeRunner({"a": [11, 12, 13, 14, 15, 16]})
    add_request(scheduler, "a", 5, max_tokens=4)

    # Async: step n+1 is scheduled before step n's output is processed.
    first = scheduler.schedule()
    first_out = runner.execute(scheduler, first)
    second = scheduler.schedule()
    second_out = runner.execute(scheduler, second)
    steps = [update(scheduler, first, first_out)]
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert scheduler.requests["a"].async_tokens_to_discard == 1
    steps.append(update(scheduler, second, second_out))
    steps += run_steps(scheduler, runner, 4)

    assert mask_of(steps[0]["a"]) == [runner.rows[("a", 0)]]
    assert steps[1] == {}  # the stale frame: no token, no row
    assert_rows_match_runner(steps, runner)
    tokens, rows = history(steps, "a")
    assert tokens == [11, 13, 14, 15]
    assert rows == [runner.rows[("a", s)] for s in (0, 2, 3, 4)]


FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def held_rows(output: EngineCoreOutput) -> list[Row]:
    """The rows a held request's output carries (joined: ``JoinedMaskRows``)."""
    joined = output.sampling_mask
    assert joined.__class__ is JoinedMaskRows
    return SamplingMask.from_wire(joined.row_lengths(), joined.ids).token_ids


def test_final_only_rows_are_held_until_the_last_output(configs: dict[bool, VllmConfig]) -> None:
    """FINAL_ONLY without stop strings (``LLM.generate``): no row per step; the last output (EOS
    or max_tokens) carries every row, in order. A FINAL_ONLY request with stop strings (the
    frontend may finish it) and a CUMULATIVE one get their row every step."""
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, EOS_TOKEN_ID, 13], "b": [21, 22, 23, 24],
                         "s": [31, 32, 33], "c": [41, 42, 43]})
    add_request(scheduler, "a", 5, max_tokens=10, output_kind=FINAL_ONLY)
    add_request(scheduler, "b", 5, max_tokens=4, output_kind=FINAL_ONLY)
    add_request(scheduler, "s", 5, max_tokens=3, output_kind=FINAL_ONLY, stop=["x"])
    add_request(scheduler, "c", 5, max_tokens=3)
    assert set(scheduler.__dict__["sampling_mask_held"]) == {"a", "b"}
    steps = run_steps(scheduler, runner, 4)

    for req_id, last in (("a", 1), ("b", 3)):
        assert all(steps[step][req_id].sampling_mask is None for step in range(last))
        assert steps[last][req_id].finish_reason is not None
        assert held_rows(steps[last][req_id]) == [runner.rows[(req_id, s)] for s in range(last + 1)]
    assert_rows_match_runner([{r: o for r, o in step.items() if r in ("s", "c")} for step in steps],
                             runner)
    for req_id in ("s", "c"):
        assert len(history(steps, req_id)[1]) == 3
    assert scheduler.__dict__["sampling_mask_held"] == {} and scheduler.requests == {}


def test_held_rows_reach_the_last_output_with_async_scheduling(
    configs: dict[bool, VllmConfig]
) -> None:
    """AsyncScheduler, each step scheduled before the previous one's output is processed: held
    requests that finish get all their rows with their last output, one by EOS (a frame was
    already in flight for it, which adds no row) and one by max_tokens (which the scheduler saw
    coming: no frame after it)."""
    scheduler = build_scheduler(configs[True], cls=AsyncScheduler)
    runner = FakeRunner({"a": [11, EOS_TOKEN_ID, 13, 14], "b": [21, 22, 23, 24, 25]})
    add_request(scheduler, "a", 5, max_tokens=10, output_kind=FINAL_ONLY)
    add_request(scheduler, "b", 5, max_tokens=3, output_kind=FINAL_ONLY)
    in_flight = [(out := scheduler.schedule(), runner.execute(scheduler, out))]
    steps: list[Outputs] = []
    while scheduler.requests:
        following = scheduler.schedule()
        in_flight.append((following, runner.execute(scheduler, following)))
        steps.append(update(scheduler, *in_flight.pop(0)))
    for req_id, last in (("a", 1), ("b", 2)):
        assert all(steps[step][req_id].sampling_mask is None for step in range(last))
        assert steps[last][req_id].finish_reason is not None
        assert held_rows(steps[last][req_id]) == [runner.rows[(req_id, s)] for s in range(last + 1)]
        assert all(req_id not in step for step in steps[last + 1:])
    assert ("a", 2) in runner.rows  # the frame in flight when "a" sampled EOS: its row went nowhere
    assert ("b", 3) not in runner.rows
    assert scheduler.__dict__["sampling_mask_held"] == {}


def test_a_long_held_request_sends_its_rows_every_held_steps(
    configs: dict[bool, VllmConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held rows go out every ``HELD_STEPS`` steps, the rest with the last output: no message
    carries a long rollout's rows at once."""
    from vllm_sampling_mask.core import scheduler as mask_scheduler

    monkeypatch.setattr(mask_scheduler, "HELD_STEPS", 2)
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, 12, 13, 14, 15]})
    add_request(scheduler, "a", 5, max_tokens=5, output_kind=FINAL_ONLY)
    steps = run_steps(scheduler, runner, 5)
    sent = [held_rows(s["a"]) if s["a"].sampling_mask is not None else None for s in steps]
    rows = [runner.rows[("a", s)] for s in range(5)]
    assert sent == [None, rows[0:2], None, rows[2:4], rows[4:5]]


def test_an_aborted_held_requests_rows_are_dropped(configs: dict[bool, VllmConfig]) -> None:
    """A held request aborted mid-generation (client gone): its rows leave the table at the
    next step; the other held request still gets all of its own."""
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, 12, 13, 14], "b": [21, 22, 23]})
    add_request(scheduler, "a", 5, max_tokens=4, output_kind=FINAL_ONLY)
    add_request(scheduler, "b", 5, max_tokens=3, output_kind=FINAL_ONLY)
    steps = run_steps(scheduler, runner, 2)
    held = scheduler.__dict__["sampling_mask_held"]
    assert [len(held[r]) for r in ("a", "b")] == [2, 2]  # rows held
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    steps += run_steps(scheduler, runner, 1)
    assert held == {}
    assert held_rows(steps[2]["b"]) == [runner.rows[("b", s)] for s in range(3)]


def test_a_failed_held_request_keeps_its_earlier_rows(
    configs: dict[bool, VllmConfig], caplog: pytest.LogCaptureFixture
) -> None:
    """A held request failed in a step without masks: vLLM's per-request error, and its output
    carries the rows of the tokens it had before (aligned with what it returns)."""
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, 12, 13]})
    add_request(scheduler, "a", 5, max_tokens=3, output_kind=FINAL_ONLY)
    run_steps(scheduler, runner, 2)
    runner.attach_masks = False
    failed = run_step(scheduler, runner)["a"]
    assert (failed.finish_reason, failed.new_token_ids) == (FinishReason.ERROR, [])
    assert held_rows(failed) == [runner.rows[("a", s)] for s in range(2)]
    assert "sampling masks lost for request a" in caplog.text
    assert scheduler.__dict__["sampling_mask_held"] == {}


def assert_failed_alone(outputs: Outputs, scheduler: Scheduler, req_id: str) -> None:
    """``req_id`` ended with vLLM's per-request error: no token, no row, freed in the scheduler."""
    output = outputs[req_id]
    assert (output.finish_reason, output.new_token_ids, output.sampling_mask) == (
        FinishReason.ERROR, [], None)
    assert output.new_logprobs is None and req_id not in scheduler.requests


def test_missing_step_masks_fail_the_steps_requests_not_the_engine(
    configs: dict[bool, VllmConfig], caplog: pytest.LogCaptureFixture
) -> None:
    """Switch on, tokens sampled, but the step carries no ``sampling_masks``: each request with a
    token in it finishes with an error (logged), not with a token without a row; the engine
    keeps scheduling the others."""
    scheduler = build_scheduler(configs[True])
    runner = FakeRunner({"a": [11, 12], "b": [21, 22], "c": [31, 32]})
    add_request(scheduler, "a", 5, max_tokens=2)
    add_request(scheduler, "b", 5, max_tokens=2)
    runner.attach_masks = False
    steps = [run_step(scheduler, runner)]
    for req_id in ("a", "b"):
        assert_failed_alone(steps[0], scheduler, req_id)
    assert "sampling masks lost for request a: the step carries no masks" in caplog.text
    runner.attach_masks = True
    add_request(scheduler, "c", 5, max_tokens=2)
    steps += run_steps(scheduler, runner, 2)
    assert history(steps, "c") == ([31, 32], [runner.rows[("c", s)] for s in (1, 2)])
    assert scheduler.requests == {}


def test_a_row_count_other_than_the_batch_fails_the_steps_requests(
    configs: dict[bool, VllmConfig]
) -> None:
    """One row too many (or too few) for the step's batch: its rows can't be matched with its
    requests, so none is handed out; the requests with a token fail, the engine goes on."""
    for extra_rows in ([[5]], []):
        scheduler = build_scheduler(configs[True])
        add_request(scheduler, "a", 5, max_tokens=3)
        add_request(scheduler, "b", 5, max_tokens=3)
        scheduler_output = scheduler.schedule()
        model_runner_output = ModelRunnerOutput(
            req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[11], [12]])
        rows = [[11], [12]] + extra_rows if extra_rows else [[11]]
        model_runner_output.sampling_masks = StepSamplingMasks.from_id_lists(rows)
        outputs = update(scheduler, scheduler_output, model_runner_output)
        for req_id in ("a", "b"):
            assert_failed_alone(outputs, scheduler, req_id)


def test_more_than_one_token_per_step_fails_that_request_only(
    configs: dict[bool, VllmConfig]
) -> None:
    """Two tokens for one request in a step with one row per request (only a speculative step
    carries several, in row groups) would need one row per token: that request fails; the other
    of the step keeps its row."""
    scheduler = build_scheduler(configs[True])
    add_request(scheduler, "a", 5, max_tokens=3)
    add_request(scheduler, "b", 5, max_tokens=3)
    scheduler_output = scheduler.schedule()
    model_runner_output = ModelRunnerOutput(
        req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[11, 12], [21]]
    )
    model_runner_output.sampling_masks = StepSamplingMasks.from_id_lists([[11, 12], [21, 22]])
    outputs = update(scheduler, scheduler_output, model_runner_output)
    assert_failed_alone(outputs, scheduler, "a")
    assert (outputs["b"].new_token_ids, mask_of(outputs["b"])) == ([21], [[21, 22]])
    assert scheduler.requests["b"].status == RequestStatus.RUNNING


def test_a_speculative_step_gives_each_output_a_prefix_of_its_row_group(
    configs: dict[bool, VllmConfig]
) -> None:
    """Row groups (draft rows, then the bonus row): ``a`` kept 2 of its 3 positions' tokens and
    gets their 2 rows as a list; ``b`` one token, one row, as in a plain step; ``c``
    opted out (no row); ``d`` has more tokens than rows: it fails alone."""
    scheduler = build_scheduler(configs[True])
    for req_id in "abcd":
        add_request(scheduler, req_id, 5, max_tokens=8)
    scheduler_output = scheduler.schedule()
    model_runner_output = ModelRunnerOutput(
        req_ids=list("dcba"), req_id_to_index={r: i for i, r in enumerate("dcba")},
        sampled_token_ids=[[41, 42, 43], [31, 32], [21], [11, 12]])
    # One row per position, by batch row (d: 1, c: 2, opted out, b: 2, a: 3).
    rows = [[41, 5], None, None, [21, 7], [22], [11, 1, 2], [12], [13, 3]]
    step = StepSamplingMasks.from_rows(
        [None if row is None else np.asarray(row, dtype="<i4").tobytes() for row in rows])
    step.groups = [0, 1, 3, 5, 8]
    model_runner_output.sampling_masks = step
    outputs = update(scheduler, scheduler_output, model_runner_output)
    a = outputs["a"]
    assert a.new_token_ids == [11, 12] and rows_mask(a.sampling_mask).token_ids == [[11, 1, 2], [12]]
    assert (outputs["b"].new_token_ids, mask_of(outputs["b"])) == ([21], [[21, 7]])
    assert outputs["c"].new_token_ids == [31, 32] and outputs["c"].sampling_mask is None
    assert_failed_alone(outputs, scheduler, "d")


def test_a_held_requests_speculative_rows_go_into_its_buffers(
    configs: dict[bool, VllmConfig]
) -> None:
    """A held (FINAL_ONLY) request in speculative steps: each step's accepted prefix of its row
    group is held, in order, and its last output carries every row, joined."""
    scheduler = build_scheduler(configs[True])
    add_request(scheduler, "a", 5, max_tokens=3, output_kind=FINAL_ONLY)
    sent = []
    for tokens, rows in (([11, 12], [[11, 1], [12], [13, 9]]), ([13], [[2, 13], [14]])):
        scheduler_output = scheduler.schedule()
        model_runner_output = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0},
                                                sampled_token_ids=[tokens])
        step = StepSamplingMasks.from_rows([np.asarray(row, dtype="<i4").tobytes()
                                            for row in rows])
        step.groups = [0, len(rows)]
        model_runner_output.sampling_masks = step
        sent.append(update(scheduler, scheduler_output, model_runner_output)["a"])
    assert sent[0].sampling_mask is None and sent[1].finish_reason is not None
    assert held_rows(sent[1]) == [[11, 1], [12], [2, 13]]


def _script_scenario(scheduler: Scheduler, runner: FakeRunner) -> Iterator[Outputs]:
    """EOS, a stop token, chunked prefill and an abort, step by step."""
    add_request(scheduler, "a", 5, max_tokens=10)
    add_request(scheduler, "b", 30, max_tokens=10, stop_token_ids=[42])
    add_request(scheduler, "c", 3, max_tokens=3)
    def abort_c() -> None:
        scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)

    for step in range(8):
        yield run_step(scheduler, runner, before_update=abort_c if step == 3 else None)


SCENARIO_SCRIPTS = {
    "a": [11, 12, 13, 14, EOS_TOKEN_ID, 16],
    "b": [21, 22, 42, 24],
    "c": [31, 32, 33],
}


@pytest.mark.parametrize("off_runner_attaches_masks", [False, True])
def test_switch_off_outputs_carry_no_mask_and_are_otherwise_identical(
    configs: dict[bool, VllmConfig], off_runner_attaches_masks: bool
) -> None:
    """Switch off: no output carries a mask (even if a step has masks) and no RuntimeError without
    them; with the switch on, the outputs differ from the switch-off ones only by the mask."""
    on, off = build_scheduler(configs[True]), build_scheduler(configs[False])
    assert on.__dict__["sampling_mask_enabled"] and not off.__dict__["sampling_mask_enabled"]
    on_runner = FakeRunner(dict(SCENARIO_SCRIPTS))
    off_runner = FakeRunner(dict(SCENARIO_SCRIPTS), attach_masks=off_runner_attaches_masks)
    on_steps = list(_script_scenario(on, on_runner))
    off_steps = list(_script_scenario(off, off_runner))

    assert_rows_match_runner(on_steps, on_runner)
    assert [history(on_steps, r)[0] for r in "abc"] == [
        [11, 12, 13, 14, EOS_TOKEN_ID], [21, 22, 42], [31]
    ]
    for on_outputs, off_outputs in zip(on_steps, off_steps, strict=True):
        assert sorted(on_outputs) == sorted(off_outputs)
        for req_id, off_output in off_outputs.items():
            on_fields = msgspec.structs.asdict(on_outputs[req_id])
            off_fields = msgspec.structs.asdict(off_output)
            assert "sampling_mask" not in off_fields
            assert (on_fields.pop("sampling_mask") is not None) == bool(off_output.new_token_ids)
            assert on_fields == off_fields
    assert on.requests == off.requests == {}


def two_request_step(config: VllmConfig, held_a: bool = False,
                     ) -> tuple[Scheduler, SchedulerOutput, ModelRunnerOutput]:
    """Requests ``a`` and ``b`` scheduled, and a runner output giving them tokens 11 and 12;
    ``held_a``: ``a`` is FINAL_ONLY (its rows held) with ``max_tokens=1``, so it finishes in
    that step, carrying its held rows."""
    scheduler = build_scheduler(config)
    if held_a:
        add_request(scheduler, "a", 5, max_tokens=1, output_kind=FINAL_ONLY)
    else:
        add_request(scheduler, "a", 5, max_tokens=3)
    add_request(scheduler, "b", 5, max_tokens=3)
    scheduler_output = scheduler.schedule()
    model_runner_output = ModelRunnerOutput(
        req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[11], [12]]
    )
    return scheduler, scheduler_output, model_runner_output


@pytest.mark.parametrize("held", [False, True], ids=["streamed", "held"])
@pytest.mark.parametrize("view", [False, True], ids=["bytes", "memoryview"])
def test_rows_of_opted_out_requests_are_none(configs: dict[bool, VllmConfig], view: bool,
                                             held: bool) -> None:
    """A ``None`` row (the worker's mark for a request that opted out of masks) gives that
    request's output no mask; the other request of the step keeps its row, a copy also when
    the step's buffer is a view (rows expanded on the device), sent at once (bytes) or held
    (then its last output carries its request's buffers)."""
    scheduler, scheduler_output, model_runner_output = two_request_step(configs[True], held)
    row = np.array([3, 11], dtype="<i4").tobytes()
    step = StepSamplingMasks.from_rows([row, None])
    if view:
        step.blob = memoryview(bytearray(step.blob))
    model_runner_output.sampling_masks = step
    outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
    by_id = {o.request_id: o for o in outputs[0].outputs}
    sent = by_id["a"].sampling_mask
    if held:  # copied into the request's buffers (msgspec sends a bytearray as bytes)
        assert sent == JoinedMaskRows(np.array([2], dtype="<i4").tobytes(), row)
        assert type(sent.ids) is bytearray
    else:
        assert type(sent) is bytes and sent == row
    assert by_id["a"].finish_reason is not None if held else by_id["a"].finish_reason is None
    assert by_id["b"].sampling_mask is None


def test_a_step_no_request_wants_masks_for_gets_vllms_own_outputs(
        configs: dict[bool, VllmConfig]) -> None:
    """Every request of the step opted out (the worker's ``NoStepMasks``): the outputs are vLLM's
    own class, so they cost and encode exactly as on a stock engine."""
    from vllm_sampling_mask.worker.step_masks import NO_MASKS_WANTED

    scheduler, scheduler_output, model_runner_output = two_request_step(configs[True])
    model_runner_output.sampling_masks = NO_MASKS_WANTED.unpack(np.ones(2, dtype=np.int32))
    outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
    assert [type(o) for o in outputs[0].outputs] == [EngineCoreOutput, EngineCoreOutput]
    assert [o.new_token_ids for o in outputs[0].outputs] == [[11], [12]]
