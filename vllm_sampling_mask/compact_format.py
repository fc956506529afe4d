"""Compact wire format for a completion's sampling mask (no vLLM, no torch needed).

A mask is ``T`` rows (one per generated token) of ascending vocabulary ids. As JSON lists it
costs ~5-7 bytes per id; the compact form is a CSR layout of little-endian int32 arrays, each
base64-encoded (standard alphabet, with padding)::

    {"encoding": "csr-int32le-base64",
     "row_lengths": b64(int32le[T]),      # number of kept ids of each token's row
     "token_ids":   b64(int32le[sum(row_lengths)])}   # the rows, concatenated

Row ``i`` is ``token_ids[offsets[i]:offsets[i + 1]]`` with ``offsets = [0, *cumsum(row_lengths)]``.
Decoding needs only base64 and an int32 reader, e.g. in numpy::

    lengths = np.frombuffer(base64.b64decode(m["row_lengths"]), "<i4")
    ids = np.frombuffer(base64.b64decode(m["token_ids"]), "<i4")
    rows = np.split(ids, np.cumsum(lengths)[:-1])
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

COMPACT_ENCODING = "csr-int32le-base64"


def encode_compact(rows: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Encode ``T`` rows of vocabulary ids into the compact JSON-ready dict above."""
    lengths = np.fromiter((len(r) for r in rows), dtype="<i4", count=len(rows))
    flat = np.fromiter((i for r in rows for i in r), dtype="<i4", count=int(lengths.sum()))
    return encode_compact_arrays(lengths, flat)


def encode_compact_arrays(row_lengths: np.ndarray, token_ids: np.ndarray) -> dict[str, Any]:
    """Encode CSR arrays (``row_lengths`` ``[T]``, ``token_ids`` ``[N]``, any int dtype)."""
    return {
        "encoding": COMPACT_ENCODING,
        "row_lengths": base64.b64encode(np.asarray(row_lengths, dtype="<i4").tobytes()).decode(),
        "token_ids": base64.b64encode(np.asarray(token_ids, dtype="<i4").tobytes()).decode(),
    }


def decode_compact_arrays(encoded: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Decode to CSR arrays: ``row_lengths`` ``[T]`` int32 and ``token_ids`` ``[N]`` int32.

    Raises ``ValueError`` on an unknown encoding or inconsistent lengths.
    """
    if encoded.get("encoding") != COMPACT_ENCODING:
        raise ValueError(
            f"sampling mask encoding must be {COMPACT_ENCODING!r}, got {encoded.get('encoding')!r}."
        )
    lengths = np.frombuffer(base64.b64decode(encoded["row_lengths"]), dtype="<i4")
    ids = np.frombuffer(base64.b64decode(encoded["token_ids"]), dtype="<i4")
    if (lengths < 0).any() or int(lengths.sum()) != ids.size:
        raise ValueError(
            f"compact sampling mask is inconsistent: row_lengths sum to {int(lengths.sum())} "
            f"but token_ids holds {ids.size} ids."
        )
    return lengths.astype(np.int32), ids.astype(np.int32)


def decode_compact(encoded: dict[str, Any]) -> list[list[int]]:
    """Decode the compact dict back to ``T`` rows of ascending ids (``list[list[int]]``)."""
    lengths, ids = decode_compact_arrays(encoded)
    if lengths.size == 0:
        return []
    return [row.tolist() for row in np.split(ids, np.cumsum(lengths)[:-1])]
