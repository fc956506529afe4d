"""User-facing output type (also exported as ``vllm.outputs.SamplingMask`` and
``vllm.sampling_mask.SamplingMask``). No vLLM import."""

from __future__ import annotations

import importlib.machinery
import types
from collections.abc import Sequence

import numpy as np

from vllm_sampling_mask.compact_format import decode_delta_varint_payload, delta_varint_as_int32le


_new_object = object.__new__


class SamplingMask:
    """The kept support of every generated token of one completion.

    ``token_ids[i]`` lists, in ascending order, the vocabulary ids whose processed logit was
    finite when ``CompletionOutput.token_ids[i]`` was sampled (after logit bias, penalties, bad
    words, temperature, min-p and top-k/top-p). The sampled token is always in its row.

    The engine hands over the rows as the int32 bytes they travelled in and builds the Python
    lists of ``token_ids`` on first access, so streaming a mask costs no list building per step.
    ``csr()`` reads them as numpy arrays without building the lists at all (what
    ``vllm_sampling_mask.training.PackedMasks.from_any`` uses). The mask of a CUMULATIVE output
    (non-streaming HTTP) is live: it reads the request's row buffer, which keeps growing with the
    request like the output's ``token_ids`` list. The mask of a request the HTTP server answers
    in ``csr-delta-varint-base64`` holds its rows in that form (``delta_varint()``), encoded as
    they arrived.
    """

    __slots__ = ("_rows", "_row_lengths", "_blob", "_varint")

    def __init__(self, token_ids: list[list[int]] | None = None) -> None:
        self._rows: list[list[int]] | None = [] if token_ids is None else token_ids
        self._row_lengths: Sequence[int] | None = None
        self._blob: bytes | bytearray | None = None
        self._varint: bytes | None = None  # the rows as delta_varint_payload (_blob is None)

    @classmethod
    def from_wire(cls, row_lengths: Sequence[int], blob: bytes | bytearray) -> SamplingMask:
        """Rows of ``row_lengths[i]`` ids each, concatenated in ``blob`` as little-endian int32
        (decoded lazily). A ``bytearray`` blob (with its lengths) is read live: rows appended to
        both later are part of the mask."""
        mask = cls.__new__(cls)
        mask._rows, mask._row_lengths, mask._blob, mask._varint = None, row_lengths, blob, None
        return mask

    @classmethod
    def from_delta_varint(cls, row_lengths: Sequence[int], payload: bytes) -> SamplingMask:
        """Rows of ``row_lengths[i]`` ids each, as ``compact_format.delta_varint_payload``
        encoded them (decoded lazily; ``delta_varint()`` hands them out as they are)."""
        mask = cls.__new__(cls)
        mask._rows, mask._row_lengths, mask._blob, mask._varint = None, row_lengths, None, payload
        return mask

    @classmethod
    def from_wire_row(cls, row: bytes) -> SamplingMask:
        """One row (``from_wire((len(row) // 4,), row)``), the mask of every streamed token:
        built without the general path's calls, since the frontend builds one per request per
        step."""
        mask = _new_object(cls)
        mask._rows, mask._row_lengths, mask._blob, mask._varint = None, (len(row) >> 2,), row, None
        return mask

    @classmethod
    def concat(cls, masks: Sequence[SamplingMask]) -> SamplingMask:
        """The rows of ``masks``, in order (stays undecoded if every one holds int32 bytes)."""
        if all(mask._blob is not None and mask._rows is None for mask in masks):
            return cls.from_wire([n for mask in masks for n in mask._row_lengths],
                                 b"".join(mask._blob for mask in masks))
        return cls([row for mask in masks for row in mask.token_ids])

    @property
    def token_ids(self) -> list[list[int]]:
        if self._varint is not None:
            self._blob = delta_varint_as_int32le(self._row_lengths, self._varint)
            self._varint = None
        if self._blob is not None and (self._rows is None
                                       or len(self._rows) < len(self._row_lengths)):
            self._decode()
        return self._rows

    @token_ids.setter
    def token_ids(self, rows: list[list[int]]) -> None:
        self._rows, self._row_lengths, self._blob, self._varint = rows, None, None, None

    def _decode(self) -> None:
        """Decode the rows not decoded yet; keep the bytes only while they are live."""
        rows = [] if self._rows is None else self._rows
        lengths = self._row_lengths
        start = 4 * sum(lengths[: len(rows)])
        flat = np.frombuffer(self._blob, dtype="<i4", offset=start).tolist()
        offset = 0
        for length in lengths[len(rows):]:
            rows.append(flat[offset:offset + length])
            offset += length
        self._rows = rows
        if not isinstance(self._blob, bytearray):
            self._row_lengths, self._blob = None, None

    def delta_varint(self) -> tuple[Sequence[int], bytes] | None:
        """``(row_lengths, payload)`` of a mask that holds its rows as
        ``compact_format.delta_varint_payload`` (see the class docstring), else ``None``."""
        return None if self._varint is None else (self._row_lengths, self._varint)

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """``(row_lengths [T] int64, token_ids [N] int32)``: the rows as CSR arrays (read-only
        views of the engine's bytes when ``token_ids`` was never accessed)."""
        if self._varint is not None:
            return (np.asarray(self._row_lengths, dtype=np.int64),
                    decode_delta_varint_payload(self._row_lengths, self._varint))
        if self._blob is not None:
            # A live buffer is copied: a view would stop the request from appending to it.
            blob = bytes(self._blob) if isinstance(self._blob, bytearray) else self._blob
            return (np.asarray(self._row_lengths, dtype=np.int64),
                    np.frombuffer(blob, dtype="<i4").astype(np.int32, copy=False))
        rows = self._rows
        lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
        ids = np.fromiter((i for row in rows for i in row), dtype=np.int32,
                          count=int(lengths.sum()))
        return lengths, ids

    def __len__(self) -> int:
        return len(self._rows) if self._row_lengths is None else len(self._row_lengths)

    def __bool__(self) -> bool:
        # A mask of 0 rows (a completion of 0 tokens) is still a mask: ``if out.sampling_mask:``
        # tells "masks returned" from ``None`` as with upstream's dataclass.
        return True

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingMask):
            return NotImplemented
        return self.token_ids == other.token_ids

    __hash__ = None  # mutable, like the dataclass it replaces

    def __repr__(self) -> str:
        return f"SamplingMask(token_ids={self.token_ids!r})"

    def __getstate__(self) -> tuple[list[list[int]] | None, list[int] | None, bytes | None]:
        if self._varint is not None:
            return None, list(self._row_lengths), delta_varint_as_int32le(self._row_lengths,
                                                                          self._varint)
        if self._blob is None:
            return self._rows, None, None
        if self._rows is not None and len(self._rows) == len(self._row_lengths):
            return self._rows, None, None
        return None, list(self._row_lengths), bytes(self._blob)  # a live mask, as it is now

    def __setstate__(self, state: tuple[list[list[int]] | None, list[int] | None,
                                        bytes | None]) -> None:
        self._rows, self._row_lengths, self._blob = state
        self._varint = None


UPSTREAM_MODULE = "vllm.sampling_mask"


def make_upstream_module(original: None) -> types.ModuleType:
    """The module ``vllm.sampling_mask`` (upstream vLLM >= 0.28 defines ``SamplingMask`` there),
    holding this module's class. Installed by the patch list (``patches.py``); it has no file."""
    module = types.ModuleType(UPSTREAM_MODULE, "Per-token sampling masks (vllm-sampling-mask plugin).")
    module.__spec__ = importlib.machinery.ModuleSpec(UPSTREAM_MODULE, loader=None)
    module.SamplingMask = SamplingMask
    module.__all__ = ["SamplingMask"]
    return module
