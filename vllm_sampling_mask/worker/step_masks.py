"""Host side of one step's masks: device results -> async copy -> CSR rows (numpy, vectorised)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_sampling_mask.worker.compaction import CompactSupport


@dataclass
class StepSamplingMasks:
    """The kept ids of every row (request) of one step, as CSR on the host.

    row_lengths: ``[R]`` int32; 0 for rows that sampled nothing (partial prefill chunks).
    token_ids:   ``[sum(row_lengths)]`` int32, rows concatenated in batch order.
    offsets:     ``[R + 1]`` int64, row ``r`` is ``token_ids[offsets[r]:offsets[r + 1]]``.
    """

    row_lengths: np.ndarray
    token_ids: np.ndarray
    offsets: np.ndarray
    _row_bytes: list[bytes] | None = None

    @classmethod
    def from_lengths(cls, row_lengths: np.ndarray, token_ids: np.ndarray) -> StepSamplingMasks:
        offsets = np.zeros(row_lengths.size + 1, dtype=np.int64)
        np.cumsum(row_lengths, out=offsets[1:])
        return cls(row_lengths, token_ids, offsets)

    def row(self, index: int) -> np.ndarray:
        """``[row_lengths[index]]`` int32 view of one row."""
        return self.token_ids[self.offsets[index] : self.offsets[index + 1]]

    def row_bytes(self) -> list[bytes]:
        """Every row as little-endian int32 bytes (the wire format of one output's row), built
        once per step: the engine core hands one to every request every step."""
        if self._row_bytes is None:
            blob = self.token_ids.astype("<i4", copy=False).tobytes()
            bounds = (4 * self.offsets).tolist()
            self._row_bytes = [blob[a:b] for a, b in zip(bounds, bounds[1:])]
        return self._row_bytes


# Above this width, unpacking slices each row instead of masking the whole [R, W] block (the
# mask costs ~R * W element operations, the slices ~R Python steps; they cross near W = 300).
WIDE_UNPACK_WIDTH = 256

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def fetch_rows(bits: torch.Tensor, rows: np.ndarray) -> np.ndarray:
    """``bits[rows]`` on the host, without waiting for work queued after ``bits`` was written.

    Call only once the kernel that wrote ``bits`` finished (after the step's copy event). The
    copy then runs on a side stream: on the current stream it would wait for the next step's
    forward pass that async scheduling has already queued there, i.e. serialise the host with
    the GPU (measured: -30% decode throughput with CUDA graphs when every step overflowed).
    """
    index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    if bits.device.type != "cuda":
        return bits.index_select(0, index).numpy()
    side = _SIDE_STREAMS.get(bits.device)
    if side is None:
        side = _SIDE_STREAMS[bits.device] = torch.cuda.Stream(bits.device)
    with torch.cuda.stream(side):
        selected = bits.index_select(0, index.to(bits.device, non_blocking=True))
        host = selected.to("cpu", non_blocking=True)
    side.synchronize()
    return host.numpy()


@dataclass
class DeviceStepMasks:
    """One step's compaction on the device, kept alive until its host copy is consumed.

    ``overflow_expected`` is known on the host from the requests' top_k (some top_k exceeds the
    width): the whole bitmap is then copied with the ids instead of being fetched afterwards.
    """

    support: CompactSupport
    overflow_expected: bool

    def copy_to_host_nonblocking(self) -> HostStepMasks:
        """Issue device->host copies on the current stream (the caller's copy stream)."""
        s = self.support
        bits = s.bits.to("cpu", non_blocking=True) if self.overflow_expected else None
        return HostStepMasks(packed=s.packed.to("cpu", non_blocking=True), bits=bits, device=self)


@dataclass
class HostStepMasks:
    """Host tensors being filled by the async copy; read only after the copy event fired."""

    packed: torch.Tensor  # [R, 1 + W] int32: count, then ids (see CompactSupport)
    bits: torch.Tensor | None
    device: DeviceStepMasks

    def unpack(self, num_sampled: np.ndarray) -> StepSamplingMasks:
        """CSR rows; ``num_sampled`` ``[R]`` int, rows with 0 sampled tokens yield nothing."""
        packed = self.packed.numpy()
        ids = packed[:, 1:]
        counts = packed[:, 0].astype(np.int32, copy=True)
        counts[np.asarray(num_sampled[: counts.size]) == 0] = 0
        width = ids.shape[1]
        overflow = np.flatnonzero(counts > width)
        if overflow.size == 0 and width <= WIDE_UNPACK_WIDTH:
            # Boolean indexing of [R, W] walks rows in order, i.e. concatenates them.
            token_ids = ids[np.arange(width)[None, :] < counts[:, None]]
            return StepSamplingMasks.from_lengths(counts, token_ids.astype(np.int32, copy=False))
        # Row by row: wide buffers (large top_k, top-p only) are mostly unused slots, and rows
        # wider than W come from the bitmap.
        rows = [ids[r, :n] for r, n in enumerate(counts.tolist())]
        if overflow.size:
            self._read_overflow_rows(rows, overflow)
        token_ids = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int32)
        return StepSamplingMasks.from_lengths(counts, token_ids.astype(np.int32, copy=False))

    def _read_overflow_rows(self, rows: list[np.ndarray], overflow: np.ndarray) -> None:
        """Replace ``rows[r]`` for every ``r`` in ``overflow`` (rows wider than W) with its ids
        read from the bitmap."""
        vocab_size = self.device.support.vocab_size
        if self.bits is not None:
            bits = self.bits.numpy()[overflow]
        else:
            # Rare (boundary ties wider than the width's slack): fetch only those rows.
            bits = fetch_rows(self.device.support.bits, overflow)
        for r, words in zip(overflow.tolist(), bits.view(np.uint8)):  # one row's bits at a time
            kept = np.unpackbits(words, bitorder="little")[:vocab_size]
            rows[r] = np.flatnonzero(kept).astype(np.int32)
