"""Host side of one step's masks: device results -> async copy -> one int32 bytes row per request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_sampling_mask.worker.compaction import CompactSupport, compact_support


@dataclass
class StepSamplingMasks:
    """The kept ids of every row (request) of one step, on the host.

    rows: ``R`` entries; row ``r`` holds its ascending kept ids as little-endian int32 bytes
          (``4 * n`` bytes for ``n`` ids: the wire format of one output's row), ``b""`` for
          rows that sampled nothing (partial prefill chunks), ``None`` for requests that opted
          out of masks. The engine core hands each request its row as is, so a step costs one
          bytes object per row and no decoding.
    """

    rows: list[bytes | None]

    @classmethod
    def from_id_lists(cls, rows: Sequence[Sequence[int]]) -> StepSamplingMasks:
        """From Python lists of ids (tests, benchmarks)."""
        return cls([np.asarray(row, dtype="<i4").tobytes() for row in rows])

    def row(self, index: int) -> np.ndarray:
        """``[n]`` int32 read-only view of one row."""
        return np.frombuffer(self.rows[index], dtype="<i4")

    def row_lengths(self) -> list[int]:
        """Number of ids of every row (0 for opted-out rows)."""
        return [len(row or b"") >> 2 for row in self.rows]


class NoStepMasks:
    """A step in which no request wants masks: nothing was captured or copied."""

    def copy_to_host_nonblocking(self) -> NoStepMasks:
        return self

    def unpack(self, num_sampled: np.ndarray) -> StepSamplingMasks:
        """Every row ``None`` (``num_sampled`` ``[R]``)."""
        return StepSamplingMasks([None] * len(num_sampled))


NO_MASKS_WANTED = NoStepMasks()


# Up to this width, unpacking copies the whole [R, 1 + W] buffer once and slices each row's bytes
# from it; wider buffers copy only each row's ids (the whole copy would move mostly unused slots).
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
    ``row_wants`` (``[R]`` bool, None: all rows) marks the rows whose requests want masks; the
    others were compacted with the batch but are never read.
    """

    support: CompactSupport
    overflow_expected: bool
    row_wants: np.ndarray | None = None

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
        """Every row's bytes; ``num_sampled`` ``[R]`` int, rows with 0 sampled tokens yield
        ``b""``, rows of requests that opted out ``None``."""
        packed = self.packed.numpy().astype("<i4", copy=False)  # a view on little-endian hosts
        num_rows, row_words = packed.shape
        width = row_words - 1
        counts = packed[:, 0].copy()
        counts[np.asarray(num_sampled[:num_rows]) == 0] = 0
        opted_out = None if self.device.row_wants is None else ~self.device.row_wants
        if opted_out is not None:
            counts[opted_out] = 0  # never read: any width, even the whole vocabulary
        overflow = np.flatnonzero(counts > width)
        np.minimum(counts, width, out=counts)  # overflow rows are replaced below
        stride = 4 * row_words
        starts = range(4, num_rows * stride, stride)  # byte offset of each row's first id
        rows: list[bytes | None]
        if width <= WIDE_UNPACK_WIDTH:
            # One copy of the whole buffer, then a bytes slice per row.
            blob = packed.tobytes()
            rows = [blob[start : start + 4 * n] for start, n in zip(starts, counts.tolist())]
        else:
            # Wide buffers (large top_k, top-p only) are mostly unused slots: copy only the ids.
            view = memoryview(packed).cast("B")
            rows = [bytes(view[start : start + 4 * n]) for start, n in zip(starts, counts.tolist())]
        if overflow.size:
            self._read_overflow_rows(rows, overflow)
        if opted_out is not None:
            for r in np.flatnonzero(opted_out).tolist():
                rows[r] = None
        return StepSamplingMasks(rows)

    def _read_overflow_rows(self, rows: list[bytes | None], overflow: np.ndarray) -> None:
        """Replace ``rows[r]`` for every ``r`` in ``overflow`` (rows wider than W) with its ids
        read from the bitmap."""
        vocab_size = self.device.support.vocab_size
        if self.device.support.bits is None:
            raise RuntimeError(f"rows {overflow.tolist()} have more ids than the width and no "
                               "bitmap. This is a bug in vllm-sampling-mask.")
        if self.bits is not None:
            bits = self.bits.numpy()[overflow]
        else:
            # Rare (boundary ties wider than the width's slack): fetch only those rows.
            bits = fetch_rows(self.device.support.bits, overflow)
        for r, words in zip(overflow.tolist(), bits.view(np.uint8)):  # one row's bits at a time
            kept = np.unpackbits(words, bitorder="little")[:vocab_size]
            rows[r] = np.flatnonzero(kept).astype("<i4").tobytes()


def tie_slack(top_k: int) -> int:
    """Extra width beyond ``top_k`` for ids tied with the k-th logit."""
    return max(32, top_k // 4)


def compact_step(processed_logits: torch.Tensor, top_k_np: np.ndarray, max_width: int,
                 row_wants: np.ndarray | None = None) -> DeviceStepMasks:
    """Launch the compaction of one step's processed logits (no host sync; both runners).

    ``processed_logits`` ``[R, V]`` (finite = kept); ``top_k_np`` ``[R]`` int, the host-side
    per-request top_k (vLLM stores "no top_k" as the vocabulary size); ``max_width`` the
    engine's ``sampling_mask_max_width``; ``row_wants`` ``[R]`` bool, the rows that want masks
    (None: all).
    """
    if row_wants is not None:
        top_k_np = top_k_np[row_wants]  # opted-out rows (any top_k) don't set the width
    # The batch's largest top_k bounds every row except for ties at the top-k boundary. Those
    # are common (bf16 logits; an H200 engine at batch 256 had a row over top_k in 126 of 131
    # steps), and a row over the width is read from the bitmap, so the width leaves room for them.
    max_top_k = int(top_k_np.max()) if top_k_np.size else 1
    width = max(1, min(max_top_k + tie_slack(max_top_k), processed_logits.shape[1], max_width))
    support = compact_support(processed_logits, width)
    return DeviceStepMasks(support, overflow_expected=max_top_k > width, row_wants=row_wants)
