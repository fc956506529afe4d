"""PackedMasks: constructors, round trips, views, validation and padded-batch layouts."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_sampling_mask.compact_format import ENCODINGS, decode_compact, encode_compact
from vllm_sampling_mask.outputs import SamplingMask
from vllm_sampling_mask.training import PackedMasks, pack_padded_batch

ROWS = [[3], [0, 1, 2, 3, 4, 5, 6], [], [2, 5], [6]]  # single, whole vocab (V=7), empty


def test_from_rows_layout_and_round_trip() -> None:
    masks = PackedMasks.from_rows(ROWS)
    assert masks.token_ids.dtype == torch.int32 and masks.offsets.dtype == torch.int64
    assert masks.offsets.tolist() == [0, 1, 8, 8, 10, 11]
    assert masks.row_lengths.tolist() == [1, 7, 0, 2, 1]
    assert (masks.num_rows, masks.num_ids, len(masks)) == (5, 11, 5)
    assert masks.to_rows() == ROWS
    assert masks.row_index().tolist() == [0] + [1] * 7 + [3, 3, 4]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_compact_round_trips(encoding: str) -> None:
    masks = PackedMasks.from_compact(encode_compact(ROWS, encoding=encoding))
    assert masks.to_rows() == ROWS
    assert masks.to_compact(encoding)["encoding"] == encoding
    assert decode_compact(masks.to_compact(encoding)) == ROWS


def test_compact_rejects_inconsistent_lengths() -> None:
    encoded = encode_compact(ROWS)
    encoded["row_lengths"] = encode_compact([[1, 2, 3]])["row_lengths"]  # 1 row of 3, not 11 ids
    with pytest.raises(ValueError, match="inconsistent"):
        PackedMasks.from_compact(encoded)


@pytest.mark.parametrize("form", ["packed", "rows", "numpy_rows", "compact", "sampling_mask",
                                  "sampling_mask_compact", "our_sampling_mask_undecoded"])
def test_from_any_accepts_every_form(form: str) -> None:
    source = {
        "packed": PackedMasks.from_rows(ROWS),
        "rows": ROWS,
        "numpy_rows": [np.asarray(r, dtype=np.int64) for r in ROWS],
        "compact": encode_compact(ROWS),
        "sampling_mask": SimpleNamespace(token_ids=ROWS),
        "sampling_mask_compact": SimpleNamespace(
            token_ids=encode_compact(ROWS, encoding="csr-delta-varint-base64")),
        "our_sampling_mask_undecoded": SamplingMask.from_wire(
            [len(r) for r in ROWS], np.array([i for r in ROWS for i in r], dtype="<i4").tobytes()),
    }[form]
    assert PackedMasks.from_any(source).to_rows() == ROWS


def test_concat_keeps_token_order() -> None:
    first, second = [[1, 2], []], [[0], [4, 5, 6]]
    batch = PackedMasks.concat([first, PackedMasks.from_rows(second), encode_compact([[9]])])
    assert batch.to_rows() == first + second + [[9]]
    assert PackedMasks.concat([]).num_rows == 0


def test_padded_view() -> None:
    ids, valid = PackedMasks.from_rows(ROWS).padded(fill_id=-1)
    assert ids.shape == (5, 7) and ids.dtype == torch.int64
    assert valid.sum(dim=1).tolist() == [1, 7, 0, 2, 1]
    assert ids[3].tolist() == [2, 5, -1, -1, -1, -1, -1]
    assert ids[2].tolist() == [-1] * 7
    rebuilt = [ids[t][valid[t]].tolist() for t in range(5)]
    assert rebuilt == ROWS
    empty_ids, empty_valid = PackedMasks.from_rows([[], []]).padded()
    assert empty_ids.shape == (2, 0) and empty_valid.shape == (2, 0)


def test_from_csr_and_constructor_checks() -> None:
    with pytest.raises(ValueError, match="sum to len"):
        PackedMasks.from_csr([2, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="non-negative"):
        PackedMasks.from_csr([-1, 2], [1])
    with pytest.raises(ValueError, match="int32"):
        PackedMasks(token_ids=torch.zeros(2, dtype=torch.int64), offsets=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="int64"):
        PackedMasks(token_ids=torch.zeros(2, dtype=torch.int32),
                    offsets=torch.tensor([0, 2], dtype=torch.int32))


def test_validate() -> None:
    PackedMasks.from_rows(ROWS).validate(vocab_size=7)
    with pytest.raises(ValueError, match=r"vocab_size=6\).*got 6 in row 1"):
        PackedMasks.from_rows(ROWS).validate(vocab_size=6)
    with pytest.raises(ValueError, match="strictly ascending.*5 then 2 in row 1"):
        PackedMasks.from_rows([[1], [0, 5, 2]]).validate(vocab_size=7)
    with pytest.raises(ValueError, match="strictly ascending.*2 then 2 in row 0"):
        PackedMasks.from_rows([[2, 2]]).validate(vocab_size=7)
    # Rows are checked separately: a descending step across a row boundary is fine.
    PackedMasks.from_rows([[5, 6], [0, 1]]).validate(vocab_size=7)
    bad_offsets = PackedMasks(token_ids=torch.tensor([1, 2, 3], dtype=torch.int32),
                              offsets=torch.tensor([0, 2, 1, 3]))
    with pytest.raises(ValueError, match="non-decreasing.*row 1"):
        bad_offsets.validate(vocab_size=7)


def test_scatter_to_positions_and_pack_padded_batch() -> None:
    seq0, seq1 = [[1], [2, 3]], [[4, 5, 6]]
    positions = torch.tensor([[False, True, True, False],
                              [False, False, False, True]])
    batch = pack_padded_batch([seq0, SimpleNamespace(token_ids=seq1)], positions)
    assert batch.num_rows == 8
    assert batch.to_rows() == [[], [1], [2, 3], [], [], [], [], [4, 5, 6]]
    assert PackedMasks.concat([seq0, seq1]).scatter_to_positions(positions).to_rows() == \
        batch.to_rows()


def test_pack_padded_batch_rejects_mismatched_counts() -> None:
    positions = torch.tensor([[True, True, False], [True, False, False]])
    with pytest.raises(ValueError, match="sequence 1 has 2 mask rows but 1 True positions"):
        pack_padded_batch([[[1], [2]], [[1], [2]]], positions)
    with pytest.raises(ValueError, match=r"B = len\(sequence_masks\) = 1"):
        pack_padded_batch([[[1]]], positions)
    with pytest.raises(ValueError, match="one True entry per mask row"):
        PackedMasks.from_rows([[1]]).scatter_to_positions(positions)
