"""The compact wire formats: exact round trips on edge cases, and clear errors on bad input."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from vllm_sampling_mask.compact_format import (
    COMPACT_ENCODING,
    DELTA_VARINT_ENCODING,
    ENCODINGS,
    decode_compact,
    decode_compact_arrays,
    encode_compact,
    encode_compact_arrays,
)

INT32_MAX = 2**31 - 1
VARINT_EDGES = [0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28 - 1, 2**28, INT32_MAX]


def _top_k_rows(num_rows: int, k: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [sorted(rng.choice(vocab, k, replace=False).tolist()) for _ in range(num_rows)]


CASES = {
    "no_rows": [],
    "one_empty_row": [[]],
    "empty_rows_between": [[3], [], [], [0, 5], []],
    "single_zero": [[0]],
    "varint_edges_as_ids": [[v] for v in VARINT_EDGES],
    "varint_edges_as_gaps": [[0, 127, 255, 16638, 16639, 2**21 + 16639, INT32_MAX]],
    "whole_small_vocab": [list(range(4096))],
    "top_k_50_qwen_vocab": _top_k_rows(64, 50, 151936),
    "ragged_widths": [list(range(w)) for w in (1, 2, 7, 8, 9, 1000)],
}


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("rows", CASES.values(), ids=CASES.keys())
def test_round_trip_is_exact(rows: list[list[int]], encoding: str) -> None:
    encoded = encode_compact(rows, encoding=encoding)
    assert encoded["encoding"] == encoding
    assert set(encoded) == {"encoding", "row_lengths", "token_ids"}
    json.dumps(encoded)  # JSON-ready
    assert decode_compact(encoded) == rows
    lengths, ids = decode_compact_arrays(encoded)
    assert lengths.dtype == np.int32 and ids.dtype == np.int32
    assert lengths.tolist() == [len(r) for r in rows]
    assert ids.tolist() == [i for r in rows for i in r]


def test_default_encoding_is_the_int32_layout_numpy_reads_directly() -> None:
    rows = [[1, 2], [70000]]
    encoded = encode_compact(rows)
    assert encoded["encoding"] == COMPACT_ENCODING
    ids = np.frombuffer(base64.b64decode(encoded["token_ids"]), "<i4")
    assert ids.tolist() == [1, 2, 70000]


def test_delta_varint_wire_bytes_are_unsigned_leb128_of_each_rows_first_id_and_gaps() -> None:
    # Pinned bytes, so a client in another language can decode from this spec alone.
    encoded = encode_compact([[0, 300], [2**31 - 1], [127, 128]], encoding=DELTA_VARINT_ENCODING)
    assert base64.b64decode(encoded["token_ids"]) == (
        b"\x00" b"\xac\x02"            # row 0: 0, then the gap 300
        b"\xff\xff\xff\xff\x07"       # row 1: 2**31 - 1
        b"\x7f" b"\x01")                # row 2: 127, then the gap 1
    assert np.frombuffer(base64.b64decode(encoded["row_lengths"]), "<i4").tolist() == [2, 1, 2]


def test_delta_varint_is_far_smaller_than_json_for_top_k_50() -> None:
    def size(value: object) -> int:  # as vLLM's JSONResponse serialises
        return len(json.dumps(value, separators=(",", ":")))

    rows = CASES["top_k_50_qwen_vocab"]
    as_json = size(rows)
    int32 = size(encode_compact(rows, encoding=COMPACT_ENCODING))
    varint = size(encode_compact(rows, encoding=DELTA_VARINT_ENCODING))
    assert varint * 2 < as_json and varint < int32 < as_json


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _int32(*values: int) -> str:
    return _b64(np.asarray(values, dtype="<i4").tobytes())


GOOD = encode_compact([[1, 2], [3]], encoding=DELTA_VARINT_ENCODING)
BAD_INPUTS = {
    "not_a_dict": ([[1, 2]], "must be a dict"),
    "unknown_encoding": ({**GOOD, "encoding": "csr-int64"}, "encoding must be one of"),
    "missing_encoding": ({k: v for k, v in GOOD.items() if k != "encoding"}, "encoding must be one of"),
    "missing_field": ({k: v for k, v in GOOD.items() if k != "token_ids"}, "'token_ids' must be a base64"),
    "field_not_a_string": ({**GOOD, "row_lengths": [2, 1]}, "'row_lengths' must be a base64"),
    "invalid_base64": ({**GOOD, "token_ids": "@@@@"}, "not valid base64"),
    "lengths_not_int32": ({**GOOD, "row_lengths": _b64(b"\x01\x02\x03")}, "not int32s"),
    "negative_length": ({**GOOD, "row_lengths": _int32(4, -1)}, "negative row length"),
    "lengths_too_long": ({**GOOD, "row_lengths": _int32(2, 2)}, "inconsistent"),
    "truncated_varint": ({**GOOD, "row_lengths": _int32(1), "token_ids": _b64(b"\x81")}, "truncated"),
    "overlong_varint": ({**GOOD, "row_lengths": _int32(1), "token_ids": _b64(b"\x80" * 5 + b"\x01")},
                        "longer than 5 bytes"),
    "varint_above_int32": ({**GOOD, "row_lengths": _int32(1), "token_ids": _b64(b"\xff\xff\xff\xff\x0f")},
                           "above 2\\*\\*31"),
    "int32_inconsistent": ({"encoding": COMPACT_ENCODING, "row_lengths": _int32(3),
                            "token_ids": _int32(1, 2)}, "inconsistent"),
}


@pytest.mark.parametrize("encoded,match", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_decode_rejects_malformed_input(encoded, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_compact(encoded)


def test_delta_decode_rejects_ids_that_overflow_int32() -> None:
    encoded = encode_compact([[INT32_MAX]], encoding=DELTA_VARINT_ENCODING)
    two_gaps = encode_compact([[INT32_MAX - 1, INT32_MAX]], encoding=DELTA_VARINT_ENCODING)
    # Re-label one row of two gaps as one row whose running sum exceeds 2**31 - 1.
    overflow = {**two_gaps, "token_ids": _b64(base64.b64decode(encoded["token_ids"]) * 2)}
    with pytest.raises(ValueError, match="above 2\\*\\*31"):
        decode_compact(overflow)


@pytest.mark.parametrize("rows,match", [
    ([[3, 3]], "strictly ascending"),
    ([[5, 4]], "strictly ascending"),
    ([[-1]], "must lie in"),
    ([[2**31]], "must lie in"),
], ids=["duplicate", "descending", "negative", "above_int32"])
def test_delta_encode_rejects_rows_it_cannot_represent(rows, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_compact(rows, encoding=DELTA_VARINT_ENCODING)


def test_encode_rejects_unknown_encoding() -> None:
    with pytest.raises(ValueError, match="encoding must be one of"):
        encode_compact([[1]], encoding="json")


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_int32_arrays_encode_as_int64_arrays_do(encoding: str) -> None:
    # A SamplingMask hands over int32 ids, read without a widening copy: the same bytes, the
    # same refusals.
    rows = CASES["varint_edges_as_gaps"] + CASES["empty_rows_between"]
    lengths = np.array([len(row) for row in rows])
    ids = np.array([i for row in rows for i in row], dtype=np.int64)
    assert (encode_compact_arrays(lengths, ids.astype(np.int32), encoding)
            == encode_compact_arrays(lengths, ids, encoding))
    with pytest.raises(ValueError, match="must lie in"):
        encode_compact_arrays(np.array([2]), np.array([-5, 3], dtype=np.int32), encoding)


@pytest.mark.parametrize("rows", CASES.values(), ids=CASES.keys())
def test_delta_varint_payloads_of_blocks_concatenate(rows: list[list[int]]) -> None:
    """Rows encoded a block at a time (as a request's rows arrive) join into the payload of all
    of them, which decodes back to the rows; the dict made from it is ``encode_compact``'s."""
    from vllm_sampling_mask.compact_format import (
        decode_delta_varint_payload,
        delta_varint_payload,
        encode_delta_varint_payload,
    )

    def payload_of(block: list[list[int]]) -> bytes:
        return delta_varint_payload(np.array([len(r) for r in block], dtype=np.int64),
                                    np.array([i for r in block for i in r], dtype=np.int32))

    lengths, ids = [len(r) for r in rows], [i for r in rows for i in r]
    for cut in sorted({0, len(rows) // 3, len(rows) // 2, len(rows)}):
        payload = payload_of(rows[:cut]) + payload_of(rows[cut:])
        assert payload == payload_of(rows)
        assert decode_delta_varint_payload(lengths, payload).tolist() == ids
        assert encode_delta_varint_payload(lengths, payload) == encode_compact(
            rows, encoding=DELTA_VARINT_ENCODING)
    with pytest.raises(ValueError, match="inconsistent"):
        decode_delta_varint_payload([*lengths, 1], payload_of(rows))
