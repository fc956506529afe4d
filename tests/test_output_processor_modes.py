"""Rows accumulated per request and attached to completions (``engine/output_processor.py``).

A real vLLM 0.26 ``OutputProcessor`` (real tokenizer, real detokenizer) is fed hand-built
``EngineCoreOutputWithMask``es, as the core client hands them over, in every output kind. Each
token ``i`` of request ``k`` carries a recognisable row (the token plus ids from
``2048 + 512 * k + 8 * i``), so every assertion compares exact rows with exact token ids.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from copy import copy
from dataclasses import dataclass, field

import numpy as np
import pytest

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.tokenizers import TokenizerLike, get_tokenizer
from vllm.v1.engine import EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector, RequestState
from vllm.v1.engine.parallel_sampling import ParentRequest

from vllm_builders import (
    engine_core_output,
    engine_core_request,
    joined_mask_rows,
    mask_row,
    sampling_params,
)
from vllm_sampling_mask.engine import output_processor as output_processor_module
from vllm_sampling_mask.engine.output_processor import enable_masks
from vllm_sampling_mask.engine.transport import EngineCoreOutputWithMask, JoinedMaskRows
from vllm_sampling_mask_testing.native_loops import loop_fixture
from vllm_sampling_mask_testing.object_layout import attributes_in_a_dict_of_their_own

DELTA = RequestOutputKind.DELTA
CUMULATIVE = RequestOutputKind.CUMULATIVE
FINAL_ONLY = RequestOutputKind.FINAL_ONLY
PROMPT = [1003, 283, 70]

Row = list[int]


# --------------------------------------------------------------------------- builders


# Every test runs with the C loop, then with the Python loop alone.
take_rows_loop = loop_fixture(output_processor_module, "_take_rows_native")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> TokenizerLike:
    return get_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def text_tokens(tokenizer: TokenizerLike) -> list[int]:
    """Token ids of a text whose detokenization contains the stop string ``STOP``."""
    return tokenizer.encode("hello world. The end STOP here and more", add_special_tokens=False)


def make_processor(
    tokenizer: TokenizerLike, *, enabled: bool = True, stream_interval: int = 1
) -> OutputProcessor:
    """An output processor as ``LLMEngine``/``AsyncLLM`` build it, with the engine's switch."""
    processor = OutputProcessor(tokenizer, log_stats=False, stream_interval=stream_interval)
    enable_masks(processor, enabled)
    return processor


# A stop string the test texts never contain: a FINAL_ONLY request with it gets its rows every
# step (the frontend may finish it), not all at its end.
EVERY_STEP = {"stop": ["<never in the text>"]}


@dataclass
class FakeEngineCore:
    """Emits engine-core outputs with recognisable rows; remembers every row it sent. Rows of
    the requests in ``held`` are kept until ``held_rows`` of them or their last output, which
    carries them joined (``JoinedMaskRows``), as the scheduler does for FINAL_ONLY requests."""

    sent_rows: dict[str, list[Row]] = field(default_factory=dict)
    with_masks: bool = True
    held: dict[str, list[Row]] = field(default_factory=dict)
    held_rows: int = 64  # rows go out once a request has this many (HELD_STEPS, one a step)

    def row(self, request_id: str, token: int) -> Row:
        """Row of the request's next token: ``k`` is 1, 2, 3, 1, ... in order of first output."""
        sent = self.sent_rows.setdefault(request_id, [])
        k = 1 + list(self.sent_rows).index(request_id) % 3  # dicts keep insertion order
        i = len(sent)
        return sorted({token} | {2048 + 512 * k + 8 * i + j for j in range(1 + i % 3)})

    def output(
        self,
        request_id: str,
        tokens: Sequence[int],
        finish_reason: FinishReason | None = None,
        stop_reason: int | str | None = None,
    ) -> EngineCoreOutputWithMask:
        """One step's output: at most one token, so at most one row (as the scheduler sends)."""
        assert len(tokens) <= 1, "an engine step delivers one token per request"
        row = None
        if tokens:
            row = self.row(request_id, tokens[0])
            self.sent_rows[request_id].append(row)
        output = engine_core_output(
            request_id, tokens, row if self.with_masks else None,
            finish_reason=finish_reason, stop_reason=stop_reason,
        )
        if request_id in self.held:
            held = self.held[request_id]
            held += [row] if row is not None else []
            output.sampling_mask = None
            if (finish_reason is not None or len(held) >= self.held_rows) and held:
                output.sampling_mask = joined_mask_rows(held)
                held.clear()
        return output


def add(
    processor: OutputProcessor,
    request_id: str,
    kind: RequestOutputKind,
    *,
    queue: RequestOutputCollector | None = None,
    **params: object,
) -> EngineCoreRequest:
    request = engine_core_request(request_id, PROMPT, sampling_params(output_kind=kind, **params))
    processor.add_request(request, None, queue=queue)
    return request


def add_children(
    processor: OutputProcessor,
    parent_id: str,
    kind: RequestOutputKind,
    *,
    queue: RequestOutputCollector | None = None,
) -> list[str]:
    """An n=2 request fanned out into children as ``LLMEngine``/``AsyncLLM.add_request`` do."""
    parent_request = engine_core_request(parent_id, PROMPT, sampling_params(output_kind=kind, n=2))
    parent = ParentRequest(parent_request)
    child_ids = []
    for index in range(2):
        child_id, child_params = parent.get_child_info(index)
        child = copy(parent_request)
        child.request_id, child.sampling_params = child_id, child_params
        processor.add_request(child, None, parent, index, queue)
        child_ids.append(child_id)
    return child_ids


def process(processor: OutputProcessor, *outputs: EngineCoreOutputWithMask) -> list[RequestOutput]:
    return processor.process_outputs(list(outputs)).request_outputs


def feed(processor: OutputProcessor, engine: FakeEngineCore, request_id: str, tokens: Sequence[int],
         finish_reason: FinishReason | None = None) -> list[RequestOutput]:
    """One step per token (the last one finishing with ``finish_reason``); all outputs."""
    outputs = []
    for i, token in enumerate(tokens):
        finish = finish_reason if i == len(tokens) - 1 else None
        outputs += process(processor, engine.output(request_id, [token], finish))
    return outputs


def only_completion(outputs: list[RequestOutput]) -> CompletionOutput:
    (output,) = outputs
    (completion,) = output.outputs
    return completion


def assert_aligned(completion: CompletionOutput) -> None:
    """One row per token id, and row i contains token i."""
    assert completion.sampling_mask is not None
    rows = completion.sampling_mask.token_ids
    assert len(rows) == len(completion.token_ids)
    assert all(token in row for token, row in zip(completion.token_ids, rows))


# --------------------------------------------------------------------------- cases


def test_final_only_returns_all_rows_once(tokenizer: TokenizerLike, text_tokens: list[int]) -> None:
    """FINAL_ONLY: nothing until the request finishes, then one output with every row, in order."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    add(processor, "a", FINAL_ONLY)
    assert process(processor, engine.output("a", text_tokens[0:1])) == []
    assert feed(processor, engine, "a", text_tokens[1:3]) == []
    final = only_completion(process(
        processor, engine.output("a", text_tokens[3:4], FinishReason.LENGTH)
    ))

    assert list(final.token_ids) == text_tokens[:4]
    assert final.sampling_mask.token_ids == engine.sent_rows["a"]
    assert_aligned(final)
    assert "a" not in processor.request_states


def test_held_rows_come_with_the_last_output(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """FINAL_ONLY without stop strings: the engine core holds the rows and sends them a few at
    a time and with the last output; the frontend looks up only outputs that carry rows or
    finish (no request with rows every step is remembered), and a request with stop strings
    brings the every-step pass back."""
    processor, engine = make_processor(tokenizer), FakeEngineCore(held_rows=3)
    add(processor, "a", FINAL_ONLY)
    add(processor, "b", FINAL_ONLY)
    engine.held.update(a=[], b=[])
    assert processor.__dict__["sampling_mask_lockstep"] == set()
    for i, token in enumerate(text_tokens[:3]):
        outputs = [engine.output("a", [token]), engine.output("b", [token])]
        assert all((o.sampling_mask is None) == (i < 2) for o in outputs)  # 3 rows: sent
        assert process(processor, *outputs) == []
    [final_a] = process(processor, engine.output("a", text_tokens[3:4], FinishReason.LENGTH),
                        engine.output("b", text_tokens[3:4]))
    [final_b] = process(processor, engine.output("b", text_tokens[4:5], FinishReason.STOP))
    for final, request_id, num_tokens in ((final_a, "a", 4), (final_b, "b", 5)):
        completion = final.outputs[0]
        assert list(completion.token_ids) == text_tokens[:num_tokens]
        assert completion.sampling_mask.token_ids == engine.sent_rows[request_id]
        assert_aligned(completion)
    add(processor, "s", FINAL_ONLY, **EVERY_STEP)
    assert processor.__dict__["sampling_mask_lockstep"] == {"s"}


def test_final_only_request_holds_its_rows_in_blocks(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """A long FINAL_ONLY request whose rows come every step (stop strings) keeps its
    rows as they came and joins every COMPACT_ROWS of them into one block: ~4 bytes per kept id
    (issue 11: <= 1.25 x), no buffer grown a row at a time; the final mask has every row, in
    order, including a speculative step's several rows across a block's end."""
    import sys

    from vllm_sampling_mask.engine.output_processor import COMPACT_ROWS

    processor = make_processor(tokenizer)
    add(processor, "a", FINAL_ONLY, max_tokens=1000, **EVERY_STEP)
    tokens = (text_tokens * 300)[:3 * COMPACT_ROWS + 7]
    sent: list[Row] = []
    step = 0
    while step < len(tokens):
        width = 3 if step == COMPACT_ROWS - 1 else 1  # one step of 3 tokens across the block end
        chunk = tokens[step:step + width]
        rows = [sorted({t} | set(range(3000 + i, 3050 + i))) for i, t in enumerate(chunk)]
        sent += rows
        finish = FinishReason.LENGTH if step + width >= len(tokens) else None
        output = engine_core_output("a", chunk, None, finish_reason=finish)
        output.sampling_mask = (mask_row(rows[0]) if width == 1
                                else [mask_row(row) for row in rows])
        if finish is None:
            assert process(processor, output) == []
            holder = processor.request_states["a"].sampling_mask_rows
            held, blocks = len(holder), len(holder.blocks)
            held_bytes = (sum(sys.getsizeof(block) for block in holder.blocks)
                          + sum(sys.getsizeof(row) for row in holder.pending)
                          + sys.getsizeof(holder.lengths))
        else:
            final = only_completion(process(processor, output))
        step += width
    assert held == len(tokens) - 1 and blocks == 3
    assert held_bytes <= 1.25 * 4 * sum(len(row) for row in sent[:held]), held_bytes
    assert list(final.token_ids) == tokens
    assert final.sampling_mask.token_ids == sent
    assert "a" not in processor.request_states


@pytest.mark.parametrize("broken, logged", [
    (lambda engine, sent: joined_mask_rows(engine.sent_rows["a"][:1]),
     "it finished after 2 token(s) with 1 row(s)"),
    (lambda engine, sent: JoinedMaskRows(sent.lengths, sent.ids[:-4]), "its 2 joined rows hold"),
], ids=["a_row_short", "lengths_disagree_with_ids"])
def test_a_held_request_whose_last_rows_are_broken_fails_alone(
    tokenizer: TokenizerLike, text_tokens: list[int], caplog: pytest.LogCaptureFixture,
    broken: Callable[[FakeEngineCore, JoinedMaskRows], JoinedMaskRows], logged: str,
) -> None:
    """A held request's last output with fewer rows than its tokens, or with joined rows whose
    lengths don't add up to their ids (which would shift every row after the first bad one): a
    bug. That request finishes with vLLM's per-request error and no mask; the other one gets its
    rows."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    add(processor, "a", FINAL_ONLY)
    add(processor, "b", FINAL_ONLY)
    engine.held.update(a=[], b=[])
    process(processor, engine.output("a", text_tokens[0:1]), engine.output("b", text_tokens[0:1]))
    last = engine.output("a", text_tokens[1:2], FinishReason.LENGTH)
    last.sampling_mask = broken(engine, last.sampling_mask)
    result = processor.process_outputs(
        [last, engine.output("b", text_tokens[1:2], FinishReason.LENGTH)])
    by_id = {o.request_id: o.outputs[0] for o in result.request_outputs}
    assert by_id["a"].finish_reason == "error" and by_id["a"].sampling_mask is None
    assert f"sampling mask of request a: {logged}" in caplog.text
    assert by_id["b"].sampling_mask.token_ids == engine.sent_rows["b"]
    assert result.reqs_to_abort == []  # finished in the engine core already


def test_final_only_rows_read_as_one_sequence() -> None:
    """A FINAL_ONLY holder's blocks and pending rows read as one sequence: the last n rows, as
    they are now or taken (which drops them all); the same for a held request's rows, which
    come many at a time, joined, each message's rows one block (delta varints too)."""
    from vllm_sampling_mask.engine.output_processor import COMPACT_ROWS, RequestMaskRows

    rows = [[i, 5000 + i] + list(range(6000, 6000 + i % 4)) for i in range(COMPACT_ROWS + 9)]
    holder = RequestMaskRows(final_only=True)
    for row in rows:
        holder.append(mask_row(row))
    assert len(holder) == len(rows) and len(holder.blocks) == 1
    assert holder.snapshot_last(3).token_ids == rows[-3:]
    assert holder.take_last(len(rows) - 1).token_ids == rows[1:] and len(holder) == 0

    for varint in (False, True):
        held = RequestMaskRows(final_only=True, held=True, varint=varint)
        held.append(mask_row(rows[0]))  # a row that came alone, before the joined ones
        for part in (rows[1:4], rows[4:]):
            joined = joined_mask_rows(part)
            held.add_joined(joined.row_lengths(), joined.ids)
        assert len(held) == len(rows) and len(held.blocks) == 3 and held.pending == []
        assert held.snapshot_last(2).token_ids == rows[-2:]
        assert held.take_last(len(rows)).token_ids == rows and len(held) == 0
    with pytest.raises(ValueError, match="FINAL_ONLY"):
        RequestMaskRows(streaming=True, held=True)


def test_rows_of_an_http_compact_request_are_kept_as_delta_varints(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """FINAL_ONLY requests added inside ``rows_kept_as_delta_varint`` (an HTTP request answered
    in ``csr-delta-varint-base64``) encode their rows a block at a time as they arrive, held or
    every step; the final mask hands out that encoding and reads as the rows sent. Requests of
    other kinds, or added outside the block, keep int32 bytes."""
    from vllm_sampling_mask.compact_format import delta_varint_payload
    from vllm_sampling_mask.engine.output_processor import COMPACT_ROWS, rows_kept_as_delta_varint

    processor = make_processor(tokenizer)
    engine = FakeEngineCore(held_rows=COMPACT_ROWS)
    with rows_kept_as_delta_varint():
        add(processor, "held", FINAL_ONLY, max_tokens=1000)
        add(processor, "step", FINAL_ONLY, max_tokens=1000, **EVERY_STEP)
        add(processor, "delta", DELTA, max_tokens=1000)
        add(processor, "cumulative", CUMULATIVE, max_tokens=1000)
    add(processor, "outside", FINAL_ONLY, max_tokens=1000)
    engine.held.update(held=[], outside=[])
    holders = {rid: state.sampling_mask_rows
               for rid, state in processor.request_states.items()}
    assert {rid for rid, h in holders.items() if h.varint} == {"held", "step"}
    tokens = (text_tokens * 100)[:2 * COMPACT_ROWS + 5]
    finals = {}
    for i, token in enumerate(tokens):
        finish = FinishReason.LENGTH if i == len(tokens) - 1 else None
        for request_output in process(processor, *(engine.output(rid, [token], finish)
                                                    for rid in holders)):
            finals[request_output.request_id] = request_output.outputs[0]
        if i == 2 * COMPACT_ROWS:  # two blocks each, encoded: ~2 bytes an id here, not 4
            for rid in ("held", "step"):
                assert len(holders[rid].blocks) == 2
                rows = engine.sent_rows[rid][:2 * COMPACT_ROWS]
                assert b"".join(holders[rid].blocks) == delta_varint_payload(
                    np.array([len(r) for r in rows]), np.array([t for r in rows for t in r],
                                                              dtype=np.int32))
    for rid, completion in finals.items():
        if rid == "delta":
            continue
        mask = completion.sampling_mask
        assert (mask.delta_varint() is not None) == (rid in ("held", "step"))
        assert mask.token_ids == engine.sent_rows[rid]
        assert_aligned(completion)


def test_only_http_compact_requests_keep_their_rows_as_delta_varints(
    tokenizer: TokenizerLike
) -> None:
    """``request_options`` (the HTTP entries' block around vLLM's call) makes the FINAL_ONLY row
    list of a request added inside it keep delta varints when its masks go out compact; JSON
    requests, and requests added outside, keep int32 bytes."""
    from vllm_sampling_mask.entrypoints.mask_fields import MaskOptions
    from vllm_sampling_mask.entrypoints.serving import request_options

    processor = make_processor(tokenizer)
    with request_options(MaskOptions(True, "compact")):
        add(processor, "compact", FINAL_ONLY)
        add(processor, "compact_cumulative", CUMULATIVE)
    with request_options(MaskOptions(True, "json")):
        add(processor, "json", FINAL_ONLY)
    add(processor, "outside", FINAL_ONLY)
    varint = {rid for rid, state in processor.request_states.items()
              if state.sampling_mask_rows.varint}
    assert varint == {"compact"}


def test_a_row_the_varint_encoding_refuses_leaves_the_rows_in_int32() -> None:
    """Rows the delta encoding refuses (not ascending: a bug upstream) turn the holder's blocks
    back into int32 bytes, so the response's own encoding reports the problem; every row is
    kept, and a snapshot of fewer rows than held works from the same blocks."""
    from vllm_sampling_mask.engine.output_processor import COMPACT_ROWS, RequestMaskRows

    rows = [[i, 5000 + i] for i in range(COMPACT_ROWS)] + [[9, 3]] + [[1, 2]] * COMPACT_ROWS
    holder = RequestMaskRows(final_only=True, varint=True)
    for row in rows[:COMPACT_ROWS]:
        holder.append(mask_row(row))
    assert holder.varint and len(holder.blocks) == 1
    assert holder.snapshot_last(2).token_ids == rows[COMPACT_ROWS - 2:COMPACT_ROWS]
    for row in rows[COMPACT_ROWS:]:
        holder.append(mask_row(row))
    assert not holder.varint
    mask = holder.take_last(len(rows))
    assert mask.delta_varint() is None and mask.token_ids == rows
    with pytest.raises(ValueError, match="FINAL_ONLY"):
        RequestMaskRows(streaming=True, varint=True)


def test_cumulative_outputs_carry_all_rows_so_far(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """CUMULATIVE: every output holds all rows so far, aligned with its token ids (checked when
    it is produced: vLLM's CUMULATIVE ``token_ids`` is the detokenizer's live list)."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    add(processor, "a", CUMULATIVE)
    steps = [(text_tokens[i:i + 1], None) for i in range(5)]
    steps.append((text_tokens[5:6], FinishReason.STOP))
    sent = 0
    for tokens, finish in steps:
        completion = only_completion(process(processor, engine.output("a", tokens, finish)))
        sent += len(tokens)
        assert list(completion.token_ids) == text_tokens[:sent]
        assert completion.sampling_mask.token_ids == engine.sent_rows["a"][:sent]
        assert_aligned(completion)
    assert completion.finished() and "a" not in processor.request_states


def test_held_cumulative_output_stays_aligned(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """A CUMULATIVE output kept by a consumer while later steps are processed (an AsyncLLM
    consumer awaiting between outputs) still has one row per token id."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    add(processor, "a", CUMULATIVE)
    held = only_completion(process(processor, engine.output("a", text_tokens[:1])))
    feed(processor, engine, "a", text_tokens[1:3])
    assert len(held.sampling_mask.token_ids) == len(held.token_ids)


def test_delta_outputs_carry_only_their_rows(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """DELTA: each output carries exactly the rows of its new tokens; the concatenation of the
    deltas' masks is every row."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    add(processor, "a", DELTA)
    sizes = [1] * 7  # one token per step (several per output: the stream_interval test)
    deltas, start = [], 0
    for i, size in enumerate(sizes):
        finish = FinishReason.LENGTH if i == len(sizes) - 1 else None
        deltas.append(only_completion(process(
            processor, engine.output("a", text_tokens[start:start + size], finish)
        )))
        start += size
        if finish is None:  # rows handed out in a DELTA are not held any longer
            assert len(processor.request_states["a"].sampling_mask_rows) == 0

    start = 0
    for size, delta in zip(sizes, deltas):
        assert list(delta.token_ids) == text_tokens[start:start + size]
        rows = engine.sent_rows["a"][start:start + size]
        lengths, ids = delta.sampling_mask.csr()  # before token_ids: read from the wire bytes
        assert lengths.tolist() == [len(r) for r in rows]
        assert ids.tolist() == [i for r in rows for i in r]
        assert delta.sampling_mask.token_ids == rows
        start += size
    assert [r for d in deltas for r in d.sampling_mask.token_ids] == engine.sent_rows["a"]


def test_delta_collector_merges_masks_like_token_ids(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """DELTA through ``RequestOutputCollector``: deltas put before a get are coalesced by
    ``RequestOutput.add``; the merged mask is the merged token ids' rows, and the next get
    starts after them."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    collector = RequestOutputCollector(DELTA, "a")
    add(processor, "a", DELTA, queue=collector)
    for i in range(3):  # three deltas queued while the consumer is busy
        assert process(processor, engine.output("a", text_tokens[i:i + 1])) == []
    merged = only_completion([collector.get_nowait()])
    assert list(merged.token_ids) == text_tokens[:3]
    assert merged.sampling_mask.token_ids == engine.sent_rows["a"][:3]

    feed(processor, engine, "a", text_tokens[3:6], FinishReason.LENGTH)
    last = collector.get_nowait()
    assert last.finished
    assert list(last.outputs[0].token_ids) == text_tokens[3:6]
    assert last.outputs[0].sampling_mask.token_ids == engine.sent_rows["a"][3:6]


def test_cumulative_collector_keeps_the_latest_mask(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """CUMULATIVE through the collector: ``add`` replaces rather than merges, and the mask
    follows (all rows so far, not doubled)."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    collector = RequestOutputCollector(CUMULATIVE, "a")
    add(processor, "a", CUMULATIVE, queue=collector)
    for i in range(3):
        process(processor, engine.output("a", text_tokens[i:i + 1]))
    latest = only_completion([collector.get_nowait()])
    assert list(latest.token_ids) == text_tokens[:3]
    assert latest.sampling_mask.token_ids == engine.sent_rows["a"]


@pytest.mark.parametrize("kind", [FINAL_ONLY, DELTA], ids=["final_only", "delta"])
def test_n2_children_each_carry_their_own_mask(
    tokenizer: TokenizerLike, text_tokens: list[int], kind: RequestOutputKind
) -> None:
    """n=2 (``ParentRequest`` fan-out as ``LLMEngine.add_request`` does it): each completion's
    mask is its own child's rows, never the sibling's."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    first, second = add_children(processor, "p", kind)
    a, b = text_tokens[0:3], text_tokens[5:8]

    outputs = process(processor, engine.output(first, a[:1]), engine.output(second, b[:1]))
    outputs += process(processor, engine.output(second, b[1:2]))
    outputs += feed(processor, engine, first, a[1:], FinishReason.LENGTH)
    outputs += feed(processor, engine, second, b[2:], FinishReason.LENGTH)

    completions: dict[int, list[CompletionOutput]] = {0: [], 1: []}
    for output in outputs:
        assert output.request_id == "p"
        for completion in output.outputs:
            completions[completion.index].append(completion)
    if kind == FINAL_ONLY:
        assert len(outputs) == 1 and len(outputs[0].outputs) == 2
    for index, (child_id, tokens) in enumerate([(first, a), (second, b)]):
        got_tokens = [t for c in completions[index] for t in c.token_ids]
        got_rows = [r for c in completions[index] for r in c.sampling_mask.token_ids]
        assert got_tokens == tokens
        assert got_rows == engine.sent_rows[child_id]
        for completion in completions[index]:
            assert_aligned(completion)


def test_n2_delta_collector_merges_each_childs_mask(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """n=2 DELTA through the parent's one collector (as ``AsyncLLM`` does): coalescing merges
    each child's rows into that child's completion only."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    collector = RequestOutputCollector(DELTA, "p")
    child_ids = add_children(processor, "p", DELTA, queue=collector)
    first, second = child_ids
    process(processor, engine.output(second, text_tokens[5:6]))  # index 1 arrives first
    process(processor, engine.output(first, text_tokens[0:1]),
            engine.output(second, text_tokens[6:7]))
    feed(processor, engine, first, text_tokens[1:3])

    merged = collector.get_nowait()
    by_index = {c.index: c for c in merged.outputs}
    assert sorted(by_index) == [0, 1]
    assert list(by_index[0].token_ids) == text_tokens[0:3]
    assert by_index[0].sampling_mask.token_ids == engine.sent_rows[first]
    assert list(by_index[1].token_ids) == text_tokens[5:7]
    assert by_index[1].sampling_mask.token_ids == engine.sent_rows[second]


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA], ids=["cumulative", "delta"])
def test_abort_midway_final_output_aligned_and_state_freed(
    tokenizer: TokenizerLike, text_tokens: list[int], kind: RequestOutputKind
) -> None:
    """Abort mid-way: the final (ABORT) output's mask is aligned with its token ids (all of them
    in CUMULATIVE, none in DELTA); the request state holding the rows is dropped and freed; a
    late engine output for it is ignored."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    collector = RequestOutputCollector(kind, "a")
    add(processor, "a", kind, queue=collector)
    for i in range(3):
        process(processor, engine.output("a", text_tokens[i:i + 1]))
    collector.get_nowait()
    state = weakref.ref(processor.request_states["a"])

    assert processor.abort_requests(["a"], internal=True) == ["a"]
    final = collector.get_nowait()
    completion = final.outputs[0]
    assert final.finished and completion.finish_reason == "abort"
    expected = 3 if kind == CUMULATIVE else 0
    assert list(completion.token_ids) == text_tokens[:expected]
    assert completion.sampling_mask.token_ids == engine.sent_rows["a"][:expected]
    assert "a" not in processor.request_states
    assert state() is None  # freed by reference counting: nothing else holds it

    assert process(processor, engine.output("a", text_tokens[3:4])) == []
    assert "a" not in processor.request_states


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA], ids=["cumulative", "delta"])
def test_stop_string_finishes_with_aligned_mask(
    tokenizer: TokenizerLike, text_tokens: list[int], kind: RequestOutputKind
) -> None:
    """A stop string found by the detokenizer (the engine did not stop): the output finishes
    with stop_reason "STOP", its mask is aligned with its token ids, the request is handed back
    for abort in the engine, and its state is gone."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    add(processor, "a", kind, stop=["STOP"])
    stop_end = next(
        n for n in range(1, len(text_tokens) + 1)
        if "STOP" in tokenizer.decode(text_tokens[:n])
    )
    completions: list[CompletionOutput] = []
    aborts: list[str] = []
    for i in range(stop_end):
        result = processor.process_outputs([engine.output("a", text_tokens[i:i + 1])])
        for output in result.request_outputs:
            assert_aligned(output.outputs[0])  # when produced (CUMULATIVE token_ids is live)
            completions.append(output.outputs[0])
        aborts += result.reqs_to_abort
    assert process(processor, engine.output("a", text_tokens[stop_end:stop_end + 1])) == []

    final = completions[-1]
    assert (final.finish_reason, final.stop_reason) == ("stop", "STOP")
    assert "STOP" not in final.text
    assert aborts == ["a"] and "a" not in processor.request_states
    if kind == CUMULATIVE:
        assert list(final.token_ids) == text_tokens[:stop_end]
        assert final.sampling_mask.token_ids == engine.sent_rows["a"][:stop_end]
    else:
        deltas = [r for c in completions for r in c.sampling_mask.token_ids]
        assert deltas == engine.sent_rows["a"][:stop_end]


def test_delta_with_stream_interval_batches_rows_with_tokens(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """DELTA with ``stream_interval=3``: outputs come at the first token, every 3 tokens and at
    the finish; each carries exactly the rows of the tokens it batches."""
    processor, engine = make_processor(tokenizer, stream_interval=3), FakeEngineCore()
    add(processor, "a", DELTA)
    deltas: list[CompletionOutput] = []
    for i in range(8):
        finish = FinishReason.LENGTH if i == 7 else None
        deltas += [o.outputs[0] for o in process(
            processor, engine.output("a", text_tokens[i:i + 1], finish)
        )]

    assert [len(d.token_ids) for d in deltas] == [1, 3, 3, 1]
    start = 0
    for delta in deltas:
        n = len(delta.token_ids)
        assert list(delta.token_ids) == text_tokens[start:start + n]
        assert delta.sampling_mask.token_ids == engine.sent_rows["a"][start:start + n]
        start += n


def _all_completions(processor: OutputProcessor, engine: FakeEngineCore,
                     text_tokens: list[int]) -> list[CompletionOutput]:
    """One request per output kind (plus a stop string), fed the same steps."""
    for request_id, kind in [("c", CUMULATIVE), ("d", DELTA), ("f", FINAL_ONLY)]:
        add(processor, request_id, kind)
    add(processor, "s", CUMULATIVE, stop=["STOP"])
    completions = []
    for i in range(10):
        finish = FinishReason.LENGTH if i == 9 else None
        outputs = process(processor, *(engine.output(r, text_tokens[i:i + 1], finish)
                                       for r in "cdfs"))
        completions += [c for o in outputs for c in o.outputs]
    return completions


@pytest.mark.parametrize("engine_sends_masks", [False, True])
def test_switch_off_no_completion_has_a_mask(
    tokenizer: TokenizerLike, text_tokens: list[int], engine_sends_masks: bool
) -> None:
    """Switch off: ``sampling_mask`` is None in every output kind (even if outputs carry rows),
    request states keep vLLM's class (no per-output wrapper), and every other field equals what
    the switch-on processor returns."""
    off_processor, on_processor = make_processor(tokenizer, enabled=False), make_processor(tokenizer)
    for processor in (off_processor, on_processor):
        add(processor, "probe", CUMULATIVE)
    assert type(off_processor.request_states["probe"]) is RequestState
    assert type(on_processor.request_states["probe"]) is not RequestState
    assert isinstance(on_processor.request_states["probe"], RequestState)
    off = _all_completions(make_processor(tokenizer, enabled=False),
                           FakeEngineCore(with_masks=engine_sends_masks), text_tokens)
    on = _all_completions(make_processor(tokenizer), FakeEngineCore(), text_tokens)

    assert len(off) == len(on) > 10
    assert all(c.sampling_mask is None for c in off)
    assert all(c.sampling_mask is not None for c in on)
    for c_off, c_on in zip(off, on):
        assert (c_off.index, c_off.text, list(c_off.token_ids), c_off.finish_reason,
                c_off.stop_reason) == (c_on.index, c_on.text, list(c_on.token_ids),
                                       c_on.finish_reason, c_on.stop_reason)


BAD_OUTPUTS = {  # one output of request "a" whose rows don't match its tokens
    "tokens_without_row": lambda tokens: engine_core_output("a", tokens[1:2]),
    "row_without_token": lambda tokens: engine_core_output("a", [], [5, 6]),
    "two_tokens_one_row": lambda tokens: engine_core_output("a", tokens[1:3], [tokens[1]]),
}


@pytest.mark.parametrize("bad", list(BAD_OUTPUTS))
@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY], ids=["cumulative", "delta", "final"])
def test_an_output_whose_rows_dont_match_its_tokens_fails_that_request_only(
    tokenizer: TokenizerLike, text_tokens: list[int], kind: RequestOutputKind, bad: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lost row, an extra row, or one row for two tokens: that request finishes with vLLM's
    per-request error (HTTP 500 for it alone), what it returned stays aligned, the engine core is
    told to abort it, and the other request of the same batch goes on with its rows."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    every_step = EVERY_STEP if kind == FINAL_ONLY else {}  # held requests: test_held_...
    add(processor, "a", kind, **every_step)
    add(processor, "b", kind, **every_step)
    process(processor, engine.output("a", text_tokens[0:1]), engine.output("b", text_tokens[0:1]))
    result = processor.process_outputs(
        [BAD_OUTPUTS[bad](text_tokens), engine.output("b", text_tokens[1:2])])

    assert result.reqs_to_abort == ["a"]
    assert "a" not in processor.request_states
    assert "sampling mask of request a" in caplog.text
    by_id = {o.request_id: o.outputs[0] for o in result.request_outputs}
    failed = by_id["a"]
    assert failed.finish_reason == "error"
    assert_aligned(failed)
    assert list(failed.token_ids) == ([] if kind == DELTA else text_tokens[:1])
    assert failed.sampling_mask.token_ids == ([] if kind == DELTA else engine.sent_rows["a"])
    (last,) = feed(processor, engine, "b", text_tokens[2:3], FinishReason.LENGTH)
    completion = last.outputs[0]
    assert_aligned(completion)
    first = 2 if kind == DELTA else 0
    assert completion.sampling_mask.token_ids == engine.sent_rows["b"][first:]


@pytest.mark.parametrize("kind", [FINAL_ONLY, CUMULATIVE, DELTA], ids=str)
def test_a_speculative_steps_tokens_bring_one_row_each(
    tokenizer: TokenizerLike, text_tokens: list[int], kind: RequestOutputKind
) -> None:
    """Outputs with several tokens and their list of rows (speculative decoding) grow the rows
    in lock step, in every output kind; a list one row short fails that request only."""
    processor = make_processor(tokenizer)
    every_step = EVERY_STEP if kind == FINAL_ONLY else {}  # held requests: test_held_...
    add(processor, "a", kind, **every_step)
    add(processor, "b", kind, **every_step)
    steps = [text_tokens[0:3], text_tokens[3:4], text_tokens[4:6]]
    rows = [[[t, 5000 + t] for t in tokens] for tokens in steps]
    delivered = []
    for i, (tokens, step_rows) in enumerate(zip(steps, rows)):
        output = engine_core_output("a", tokens,
                                    finish_reason=FinishReason.LENGTH if i == 2 else None)
        output.sampling_mask = ([mask_row(r) for r in step_rows] if len(tokens) > 1
                                else mask_row(step_rows[0]))
        delivered += [c for o in process(processor, output) for c in o.outputs]
    bad = engine_core_output("b", text_tokens[0:2])
    bad.sampling_mask = [mask_row([text_tokens[0]])]
    (failed,) = process(processor, bad)
    assert failed.outputs[0].finish_reason == "error"
    all_rows = [row for step_rows in rows for row in step_rows]
    if kind is DELTA:
        assert [c.sampling_mask.token_ids for c in delivered] == rows
    else:
        assert delivered[-1].sampling_mask.token_ids == all_rows
    for completion in delivered:
        assert_aligned(completion)


def test_opted_out_request_keeps_vllms_state_and_gets_no_mask(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """``extra_args["return_sampling_mask"] = False`` on a mask engine: vLLM's request state (no
    row list, no per-output wrapper) and no mask; the engine core sends it no rows."""
    processor = make_processor(tokenizer)
    add(processor, "out", CUMULATIVE, extra_args={"return_sampling_mask": False})
    add(processor, "in", CUMULATIVE)
    assert type(processor.request_states["out"]) is RequestState
    assert type(processor.request_states["in"]) is not RequestState
    engine = FakeEngineCore()
    opted_out = engine_core_output("out", text_tokens[:1])  # no row: None on the wire
    outputs = process(processor, opted_out, engine.output("in", text_tokens[:1]))
    by_id = {o.request_id: o.outputs[0] for o in outputs}
    assert by_id["out"].sampling_mask is None
    assert by_id["in"].sampling_mask.token_ids == engine.sent_rows["in"]


def test_mask_request_states_keep_cpythons_fast_attribute_layout(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """vLLM reads ~25 attributes of a request state per output and step, and the output
    processor's for every step: the plugin neither moves a state into another class nor
    touches ``__dict__``, so neither object's attributes leave CPython's inline layout. A mask
    request's state is made as the subclass with the mask-attaching method; an opted-out one
    stays vLLM's class."""
    processor = make_processor(tokenizer)
    engine = FakeEngineCore(held={"held": []})
    add(processor, "held", FINAL_ONLY)
    add(processor, "every_step", DELTA)
    add(processor, "out", DELTA, extra_args={"return_sampling_mask": False})
    states = dict(processor.request_states)
    assert type(states["out"]) is RequestState
    for request_id in ("held", "every_step"):
        assert type(states[request_id]).__mro__[1] is RequestState
    tokens = text_tokens[:3]
    outputs: list[RequestOutput] = []
    for i, token in enumerate(tokens):
        finish = FinishReason.LENGTH if i == len(tokens) - 1 else None
        step = [engine.output(rid, [token], finish) for rid in ("held", "every_step")]
        step.append(engine_core_output("out", [token], finish_reason=finish))
        outputs += process(processor, *step)
    final = [o.outputs[0] for o in outputs if o.request_id == "held"]
    assert len(final) == 1 and final[0].sampling_mask.token_ids == engine.sent_rows["held"]
    for request_id, state in states.items():
        assert not attributes_in_a_dict_of_their_own(state, "request_id"), request_id
    assert not attributes_in_a_dict_of_their_own(processor, "request_states")


def test_the_frontends_cached_switch_keeps_cpythons_fast_attribute_layout() -> None:
    """The switch the plugin caches on vLLM's ``InputProcessor``, ``LLM`` and serving objects
    (every engine's, switch off included) is kept as an attribute: the object's attributes stay
    inline, and the cached value is what the engine's config says."""
    from types import SimpleNamespace

    from vllm_sampling_mask.engine.input_processor import _mask_config
    from vllm_sampling_mask.entrypoints.serving import engine_masks_enabled

    class VllmObject:  # a plain class, as those three are
        def __init__(self, vllm_config: object) -> None:
            self.vllm_config = vllm_config
            self.engine_client = SimpleNamespace(vllm_config=vllm_config)

    for enabled in (False, True):
        config = SimpleNamespace(additional_config={"return_sampling_mask": enabled})
        holder = VllmObject(config)
        assert _mask_config(holder, config).enabled is enabled
        assert _mask_config(holder, None).enabled is enabled  # cached: the config is not read
        assert engine_masks_enabled(holder) is enabled
        assert not attributes_in_a_dict_of_their_own(holder, "vllm_config")


@pytest.mark.parametrize("first_wants", [True, False])
def test_a_streaming_input_session_keeps_its_choice_of_masks(
    tokenizer: TokenizerLike, text_tokens: list[int], first_wants: bool
) -> None:
    """Streaming input (``AsyncLLM.generate`` of an input stream) adds one resumable request per
    chunk under one id. A chunk that keeps the session's choice is queued as vLLM does; one that
    changes it is refused, since its tokens' rows would not line up with the session's."""
    processor = make_processor(tokenizer)

    def chunk(wants: bool) -> EngineCoreRequest:
        extra_args = None if wants else {"return_sampling_mask": False}
        request = engine_core_request("s", PROMPT, sampling_params(
            output_kind=DELTA, extra_args=extra_args))
        request.resumable = True
        return request

    processor.add_request(chunk(first_wants), None)
    state = processor.request_states["s"]
    processor.add_request(chunk(first_wants), None)  # the same choice: vLLM queues the update
    assert processor.request_states["s"] is state and len(state.input_chunk_queue) == 1
    with pytest.raises(ValueError, match="streaming-input session sets extra_args"):
        processor.add_request(chunk(not first_wants), None)
    assert len(state.input_chunk_queue) == 1  # the refused chunk was not queued
    engine = FakeEngineCore(with_masks=first_wants)
    output = engine.output("s", text_tokens[:1]) if first_wants else engine_core_output(
        "s", text_tokens[:1])
    (result,) = process(processor, output)
    if first_wants:
        assert result.outputs[0].sampling_mask.token_ids == engine.sent_rows["s"]
    else:
        assert result.outputs[0].sampling_mask is None


def test_cumulative_request_holds_its_rows_as_bytes(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """A non-streaming HTTP request (CUMULATIVE) holds ~4 bytes per kept id, however long: the
    rows stay in one buffer that every output's live mask reads; a mask read midway keeps up
    with later rows (issue 11: <= 1.25 x 4 bytes per id; before, Python lists, ~36 bytes)."""
    import sys

    processor = make_processor(tokenizer)
    add(processor, "a", CUMULATIVE)
    row_ids = 50
    tokens = (text_tokens * 200)[:1000]
    outputs = []
    for i, token in enumerate(tokens):
        row = sorted({token} | set(range(3000, 3000 + row_ids - 1)))
        outputs += process(processor, engine_core_output("a", [token], row))
        if i == 10:
            midway = outputs[-1].outputs[0]
            assert_aligned(midway)  # decoded now, while the request keeps going
    holder = processor.request_states["a"].sampling_mask_rows
    held_bytes = sys.getsizeof(holder.blob) + sys.getsizeof(holder.lengths)
    assert held_bytes <= 1.25 * 4 * row_ids * len(tokens), held_bytes
    latest = outputs[-1].outputs[0]
    assert latest.sampling_mask._rows is None  # nothing decoded until a user reads it
    assert_aligned(latest)
    assert_aligned(midway)  # the live token list and rows both grew
    assert len(midway.sampling_mask.token_ids) == len(tokens)


def test_steps_without_a_mask_request_in_flight_are_vllms_alone(
    tokenizer: TokenizerLike, text_tokens: list[int]
) -> None:
    """The processor remembers which requests were given a row list; once those have finished or
    were aborted (forgotten at the next step that carries none of them), steps of opted-out
    requests skip the per-output pass; a new mask request brings it back."""
    processor, engine = make_processor(tokenizer), FakeEngineCore()
    in_flight = processor.__dict__["sampling_mask_requests"]
    add(processor, "out", CUMULATIVE, extra_args={"return_sampling_mask": False})
    assert in_flight == set()
    add(processor, "done", FINAL_ONLY)
    add(processor, "aborted", CUMULATIVE)
    assert in_flight == {"done", "aborted"}
    outputs = process(processor, engine_core_output("out", text_tokens[:1]),
                      engine.output("done", text_tokens[:1], FinishReason.LENGTH),
                      engine.output("aborted", text_tokens[:1]))
    by_id = {o.request_id: o.outputs[0] for o in outputs}
    assert by_id["done"].sampling_mask.token_ids == engine.sent_rows["done"]
    processor.abort_requests(["aborted"], internal=True)
    assert in_flight == {"done", "aborted"}  # forgotten lazily, not on the abort path
    process(processor, engine_core_output("out", text_tokens[1:2]))
    assert in_flight == set()
    add(processor, "late", CUMULATIVE)
    [late] = process(processor, engine.output("late", text_tokens[:1]),
                     engine_core_output("out", text_tokens[2:3]))[:1]
    assert late.request_id == "late" and in_flight == {"late"}
    assert late.outputs[0].sampling_mask.token_ids == engine.sent_rows["late"]


def test_a_processor_of_an_engine_without_the_switch_tracks_nothing(
        tokenizer: TokenizerLike) -> None:
    processor = make_processor(tokenizer, enabled=False)
    add(processor, "a", CUMULATIVE)
    assert "sampling_mask_requests" not in processor.__dict__
    assert type(processor.request_states["a"]) is RequestState
