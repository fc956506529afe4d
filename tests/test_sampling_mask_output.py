"""``SamplingMask`` (``vllm.outputs.SamplingMask``): lazy rows from the wire bytes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from vllm_sampling_mask.outputs import SamplingMask

ROWS = [[3, 7, 2**31 - 1], [], [0]]


def wire(rows: list[list[int]]) -> SamplingMask:
    blob = np.array([i for row in rows for i in row], dtype="<i4").tobytes()
    return SamplingMask.from_wire([len(row) for row in rows], blob)


@pytest.mark.parametrize("make", [wire, SamplingMask], ids=["wire", "lists"])
def test_rows_and_csr_agree(make) -> None:
    mask = make([list(row) for row in ROWS])
    lengths, ids = mask.csr()
    assert lengths.dtype == np.int64 and ids.dtype == np.int32
    assert lengths.tolist() == [3, 0, 1] and ids.tolist() == [3, 7, 2**31 - 1, 0]
    assert len(mask) == 3
    assert mask.token_ids == ROWS
    assert mask.csr()[1].tolist() == ids.tolist()  # also after decoding
    assert mask == SamplingMask(ROWS) and mask != SamplingMask(ROWS[:2])


@pytest.mark.parametrize("row", ROWS, ids=["three", "empty", "one"])
def test_a_single_wire_row(row: list[int]) -> None:
    mask = SamplingMask.from_wire_row(np.array(row, dtype="<i4").tobytes())
    assert len(mask) == 1
    assert mask.csr()[0].tolist() == [len(row)] and mask.csr()[1].tolist() == row
    assert mask.token_ids == [row]
    assert pickle.loads(pickle.dumps(mask)) == mask


def test_concat_stays_undecoded_and_mixes_with_lists() -> None:
    joined = SamplingMask.concat([wire(ROWS[:1]), wire(ROWS[1:])])
    assert joined.csr()[0].tolist() == [3, 0, 1]
    assert joined.token_ids == ROWS
    mixed = SamplingMask.concat([SamplingMask([[1]]), wire([[2, 5]])])
    assert mixed.token_ids == [[1], [2, 5]]
    assert SamplingMask.concat([]).token_ids == []


def test_setter_pickle_and_default() -> None:
    mask = wire(ROWS)
    restored = pickle.loads(pickle.dumps(mask))
    assert restored.token_ids == ROWS
    mask.token_ids = [[9]]
    assert mask.csr()[1].tolist() == [9] and len(mask) == 1
    assert SamplingMask().token_ids == [] and len(SamplingMask()) == 0
    assert SamplingMask() and wire([])  # empty, yet a mask (not None) when tested for truth
    assert repr(SamplingMask([[1, 2]])) == "SamplingMask(token_ids=[[1, 2]])"


def delta_varint(rows: list[list[int]]) -> SamplingMask:
    from vllm_sampling_mask.compact_format import delta_varint_payload

    payload = delta_varint_payload(np.array([len(row) for row in rows], dtype=np.int64),
                                   np.array([i for row in rows for i in row], dtype=np.int32))
    return SamplingMask.from_delta_varint([len(row) for row in rows], payload)


def test_a_mask_held_as_delta_varints_reads_like_any_other() -> None:
    """A mask whose rows were kept encoded (an HTTP compact response's) hands the encoding out
    as it is and reads, compares, joins and pickles as the same rows in int32 bytes do."""
    from vllm_sampling_mask.compact_format import encode_compact, encode_delta_varint_payload

    mask = delta_varint(ROWS)
    assert wire(ROWS).delta_varint() is None and SamplingMask(ROWS).delta_varint() is None
    assert encode_delta_varint_payload(*mask.delta_varint()) == encode_compact(
        ROWS, encoding="csr-delta-varint-base64")
    lengths, ids = mask.csr()
    assert lengths.tolist() == [3, 0, 1] and ids.dtype == np.int32
    assert ids.tolist() == [3, 7, 2**31 - 1, 0]
    assert len(mask) == 3 and mask == wire(ROWS)
    assert pickle.loads(pickle.dumps(mask)).token_ids == ROWS
    assert SamplingMask.concat([wire(ROWS[:1]), delta_varint(ROWS[1:])]).token_ids == ROWS
    assert mask.token_ids == ROWS and mask.delta_varint() is None  # decoded: lists from now on
    mask.token_ids = [[9]]
    assert mask.csr()[1].tolist() == [9]
