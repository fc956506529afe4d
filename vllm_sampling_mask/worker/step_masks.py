"""Host side of one step's masks: device results -> async copy (or the kernel's own writes into
mapped host memory) -> one host buffer of every request's row (int32 ids) with per-row offsets."""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_sampling_mask.worker.compaction import CompactSupport, compact_support, expand_rows

logger = logging.getLogger("vllm_sampling_mask")


@dataclass
class StepSamplingMasks:
    """The kept ids of every row (request) of one step, on the host.

    blob: every row's ascending kept ids as little-endian int32 (the wire format of one
          output's row), with unused bytes between rows; a ``memoryview`` of the host copy when
          the step's rows were expanded on the device (its rows are copied out one by one).
    starts, ends: ``R`` byte offsets each: row ``r`` is ``blob[starts[r]:ends[r]]`` (``4 * n``
          bytes for ``n`` ids; empty for rows that sampled nothing: partial prefill chunks);
          ``starts[r] == -1`` for requests that opted out of masks.
    none_wanted: no request of the step wants masks (every row opted out): the scheduler hands
          out vLLM's outputs as they are.
    groups: ``None`` when row ``r`` belongs to batch request ``r`` (one sampled position per
          request); else, for a speculative-decoding step, ``R + 1`` row boundaries: request
          ``i``'s rows are ``groups[i]:groups[i + 1]``, one per position it sampled at (its
          draft positions, then the bonus position), and its accepted tokens take a prefix.
    The engine core slices each output's row from the blob as it hands it out, so a step costs
    one bytes object per output and no decoding.
    """

    blob: bytes | memoryview
    starts: Sequence[int]
    ends: list[int]
    none_wanted: bool = False
    groups: list[int] | None = None

    @classmethod
    def from_rows(cls, rows: Sequence[bytes | None]) -> StepSamplingMasks:
        """From one bytes row per request (``None``: opted out)."""
        lengths = [len(row or b"") for row in rows]
        ends = np.cumsum(lengths).tolist()
        starts = [-1 if row is None else end - n for row, end, n in zip(rows, ends, lengths)]
        return cls(b"".join(row or b"" for row in rows), starts, ends)

    @classmethod
    def from_id_lists(cls, rows: Sequence[Sequence[int]]) -> StepSamplingMasks:
        """From Python lists of ids (tests, benchmarks)."""
        return cls.from_rows([np.asarray(row, dtype="<i4").tobytes() for row in rows])

    def row_bytes(self, index: int) -> bytes | None:
        """Row ``index`` as wire bytes (``None``: opted out)."""
        start = self.starts[index]
        return None if start < 0 else bytes(self.blob[start : self.ends[index]])

    @property
    def rows(self) -> list[bytes | None]:
        """Every row as wire bytes (``None``: opted out)."""
        return [self.row_bytes(r) for r in range(len(self.starts))]

    def row(self, index: int) -> np.ndarray:
        """``[n]`` int32 copy of one row (empty if opted out)."""
        return np.frombuffer(self.row_bytes(index) or b"", dtype="<i4").copy()

    def row_lengths(self) -> list[int]:
        """Number of ids of every row (0 for opted-out rows)."""
        return [0 if s < 0 else (e - s) >> 2 for s, e in zip(self.starts, self.ends)]


class NoStepMasks:
    """A step in which no request wants masks: nothing was captured or copied."""

    def copy_to_host_nonblocking(self) -> NoStepMasks:
        return self

    def unpack(self, num_sampled: np.ndarray) -> StepSamplingMasks:
        """Every row opted out (``num_sampled`` ``[R]``)."""
        return StepSamplingMasks(b"", [-1] * len(num_sampled), [-1] * len(num_sampled),
                                 none_wanted=True)


NO_MASKS_WANTED = NoStepMasks()


# Up to this width the host takes the whole [R, 1 + W] buffer as it is and rows are sliced from
# it. A wider compaction copies only its counts and expands the rows on the device; a wider
# candidate buffer (top_k in (256, 1024]) is copied whole, each row's ids joined on the host.
WIDE_UNPACK_WIDTH = 256

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def expand_rows_to_host(support: CompactSupport, rows: np.ndarray,
                        counts: np.ndarray) -> np.ndarray:
    """Every kept id of ``rows`` (``[n]`` int, with ``counts`` ``[n]`` ids each) as one
    ``[sum(counts)]`` little-endian int32 host array: each row's ids ascending, row after row.

    Call only once the kernel that wrote ``support`` finished (after the step's copy event). The
    ids are expanded from the bitmap on the device and copied on a side stream: on the current
    stream the copy would wait for the next step's forward pass that async scheduling has
    already queued there, i.e. serialise the host with the GPU (measured: -30% decode throughput
    with CUDA graphs when every step overflowed).
    """
    counts = np.asarray(counts, dtype=np.int64)
    starts = torch.from_numpy(np.cumsum(counts) - counts)
    index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    total = int(counts.sum())
    device = support.packed.device
    if device.type != "cuda":
        return expand_rows(support, index, starts, total).numpy().astype("<i4", copy=False)
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        ids = expand_rows(support, index.to(device, non_blocking=True),
                          starts.to(device, non_blocking=True), total)
        host = ids.to("cpu", non_blocking=True)
    side.synchronize()
    return host.numpy().astype("<i4", copy=False)


class MappedRowsSlot:
    """One pinned host buffer that the device can write (vLLM's ``UvaBuffer``): ``device`` and
    ``host`` are ``[words]`` int32 views of the same memory. Busy from the step whose kernel
    writes it until that step's rows were unpacked (or its masks garbage collected)."""

    __slots__ = ("device", "host", "_owner", "_reader", "_shape", "_device_rows", "_host_rows")

    def __init__(self, buffer: tuple[torch.Tensor, np.ndarray, object]):
        self.device, self.host, self._owner = buffer  # _owner keeps the pinned memory alive
        self._reader: weakref.ref[object] | None = None
        self._shape: tuple[int, int] | None = None

    @property
    def busy(self) -> bool:
        reader = self._reader
        return reader is not None and reader() is not None

    def hold(self, reader: object) -> None:
        """``reader`` (a step's ``DeviceStepMasks``, then its ``HostStepMasks``) uses the buffer."""
        self._reader = weakref.ref(reader)

    def release(self) -> None:
        self._reader = None

    def device_rows(self, num_rows: int, row_words: int) -> torch.Tensor:
        """``[num_rows, row_words]`` int32 device view of the buffer's start."""
        self._reshape(num_rows, row_words)
        return self._device_rows

    def host_rows(self, num_rows: int, row_words: int) -> np.ndarray:
        """``[num_rows, row_words]`` int32 host view of the same memory."""
        self._reshape(num_rows, row_words)
        return self._host_rows

    def _reshape(self, num_rows: int, row_words: int) -> None:
        # The views of the last shape are kept: a batch keeps its shape for many steps.
        if self._shape != (num_rows, row_words):
            words = num_rows * row_words
            self._device_rows = self.device[:words].view(num_rows, row_words)
            self._host_rows = self.host[:words].reshape(num_rows, row_words)
            self._shape = (num_rows, row_words)


class MappedRows:
    """Up to ``MAX_BUFFERS`` mapped host buffers that the candidate kernel writes a step's
    packed rows into: the host reads them in place after the step's copy event, so a step issues
    no device->host copy and allocates no pinned block. A step that finds every buffer busy
    (more steps in flight than buffers) gets ``None`` and takes the copy path.

    ``allocate(words)`` returns ``(device view [words] int32, host view [words] int32, owner)``
    of one new buffer (``uva_buffer`` on CUDA); a buffer too small for a step is replaced by
    one twice its size or the step's, whichever is larger.
    """

    MAX_BUFFERS = 4
    MIN_WORDS = 1 << 16  # 256 KiB: 63 rows of top_k 1024, 326 of top_k 200

    def __init__(self, allocate: Callable[[int], tuple[torch.Tensor, np.ndarray, object]]):
        self._allocate = allocate
        self._slots: list[MappedRowsSlot] = []
        self._allocation_failed = False

    def take(self, num_rows: int, row_words: int) -> MappedRowsSlot | None:
        """The first free buffer of at least ``num_rows * row_words`` int32 words, or None (every
        buffer busy, or a new one could not be allocated)."""
        words = num_rows * row_words
        slots = self._slots
        for index, slot in enumerate(slots):
            if not slot.busy:
                if slot.host.size >= words:
                    return slot
                grown = self._new_slot(max(words, 2 * slot.host.size))
                if grown is not None:
                    slots[index] = grown
                return grown
        if len(slots) < self.MAX_BUFFERS:
            new = self._new_slot(max(words, self.MIN_WORDS))
            if new is not None:
                slots.append(new)
            return new
        return None

    def _new_slot(self, words: int) -> MappedRowsSlot | None:
        """A new buffer, or None: after a failed allocation (pinned memory is a limited resource)
        no more are tried, and steps the buffers already made can't hold take the copy path."""
        if self._allocation_failed:
            return None
        try:
            return MappedRowsSlot(self._allocate(words))
        except (RuntimeError, MemoryError) as exc:
            self._allocation_failed = True
            logger.warning("sampling masks: mapped host buffer of %d bytes not allocated (%s: %s); "
                           "steps that need a new one copy their rows from device memory.",
                           4 * words, type(exc).__name__, exc)
            return None


def uva_buffer(words: int) -> tuple[torch.Tensor, np.ndarray, object]:
    """A ``MappedRows`` buffer of ``words`` int32 on CUDA: vLLM's ``UvaBuffer`` (pinned host
    memory and its device mapping)."""
    from vllm.v1.worker.gpu.buffer_utils import UvaBuffer

    buffer = UvaBuffer(words, torch.int32)
    return buffer.uva, buffer.np, buffer


@dataclass
class DeviceStepMasks:
    """One step's masks on the device, kept alive until its host copy is consumed.

    ``row_wants`` (``[R]`` bool, None: all rows) marks the rows whose requests want masks; the
    others were sampled with the batch but are never read. ``mapped``: the mapped host buffer
    ``support.packed`` was written into (``MappedRows``), held by this step until unpacked.
    """

    support: CompactSupport
    row_wants: np.ndarray | None = None
    mapped: MappedRowsSlot | None = None

    def __post_init__(self) -> None:
        if self.mapped is not None:
            self.mapped.hold(self)

    def copy_to_host_nonblocking(self) -> HostStepMasks:
        """Issue the device->host copy of ``packed`` on the current stream (none where the
        kernel wrote it into mapped host memory). A compaction wider than ``WIDE_UNPACK_WIDTH``
        (top_k above it, top-p only) copies only the counts: its rows are expanded on the
        device when unpacked, which copies exactly their ids instead of mostly unused slots and
        needs no host-side joining."""
        if self.mapped is not None:
            return HostStepMasks(self.mapped.host_rows(*self.support.packed.shape), self,
                                 self.mapped)
        packed = self.support.packed
        if self.support.bits is not None and packed.shape[1] - 1 > WIDE_UNPACK_WIDTH:
            packed = packed[:, :1]  # [R, 1]: width 0, every row with ids is expanded
        return HostStepMasks(packed.to("cpu", non_blocking=True).numpy(), self)


@dataclass
class HostStepMasks:
    """A step's packed rows on the host, being filled by the async copy or by the kernel itself
    (``mapped``); read only after the copy event fired."""

    packed: np.ndarray  # [R, 1 + W] int32: count, then ids (see CompactSupport); W may be 0
    device: DeviceStepMasks
    mapped: MappedRowsSlot | None = None

    def __post_init__(self) -> None:
        if self.mapped is not None:
            self.mapped.hold(self)

    def unpack(self, num_sampled: np.ndarray) -> StepSamplingMasks:
        """The step's rows; ``num_sampled`` ``[R]`` int, rows with 0 sampled tokens are empty,
        rows of requests that opted out ``None``. Rows wider than W are expanded on the device
        and copied in one piece (``expand_rows_to_host``). The rows are copied out of
        ``packed``, whose mapped buffer is free for another step afterwards (or, where this
        raises, once this object is dropped)."""
        packed = self.packed.astype("<i4", copy=False)  # a view on little-endian hosts
        num_rows, row_words = packed.shape
        width = row_words - 1
        counts = packed[:, 0].astype(np.int64)
        sampled = np.asarray(num_sampled[:num_rows])
        if not sampled.all():
            counts[sampled == 0] = 0
        opted_out = None if self.device.row_wants is None else ~self.device.row_wants
        if opted_out is not None:
            counts[opted_out] = 0  # never read: any width, even the whole vocabulary
        overflow = np.flatnonzero(counts > width) if num_rows and counts.max() > width else None
        stride = 4 * row_words
        if width <= WIDE_UNPACK_WIDTH:
            # One copy of the whole buffer; each row is sliced from it when handed out.
            blob = packed.tobytes()
            starts, starts_list = _row_starts(num_rows, stride)
        else:
            # A wide candidate buffer (top_k in (256, 1024]) is mostly slots past each row's
            # top-p cut: copy only the ids.
            narrow = np.minimum(counts, width)
            view = memoryview(packed).cast("B")
            blob = b"".join([view[start : start + 4 * n] for start, n in
                             zip(range(4, num_rows * stride, stride), narrow.tolist())])
            starts, starts_list = 4 * (np.cumsum(narrow) - narrow), None
        if overflow is not None:
            if self.device.support.bits is None:
                raise RuntimeError(f"rows {overflow.tolist()} have more ids than the width and no "
                                   "bitmap. This is a bug in vllm-sampling-mask.")
            wide_counts = counts[overflow]
            ids = expand_rows_to_host(self.device.support, overflow, wide_counts)
            if width == 0:  # counts-only copy: every row is in ids (a view, no step-sized copy)
                blob, base = memoryview(ids).cast("B"), 0
            else:
                blob, base = b"".join((blob, ids)), len(blob)
            starts, starts_list = _writable(starts), None
            starts[overflow] = base + 4 * (np.cumsum(wide_counts) - wide_counts)
        ends = starts + (counts << 2)
        if opted_out is not None:
            starts, starts_list = _writable(starts), None
            starts[opted_out] = -1
        if self.mapped is not None:
            self.mapped.release()  # blob, starts and ends are copies
        return StepSamplingMasks(blob, starts.tolist() if starts_list is None else starts_list,
                                 ends.tolist())


@functools.lru_cache(maxsize=64)
def _row_starts(num_rows: int, stride: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """The byte offsets of each row's ids in a ``[num_rows, stride / 4]`` int32 buffer (after
    its count word), as a ``[num_rows]`` int64 array and a tuple: the same every step of a batch
    size, so made once and shared by the steps, hence both read only."""
    starts = 4 + stride * np.arange(num_rows, dtype=np.int64)
    starts.flags.writeable = False
    return starts, tuple(starts.tolist())


def _writable(starts: np.ndarray) -> np.ndarray:
    """``starts`` itself, or a copy where it is ``_row_starts``' shared array."""
    return starts if starts.flags.writeable else starts.copy()


@dataclass
class SpeculativeStepMasks:
    """One speculative-decoding step's masks on the device (V1 runner; Model Runner V2's are
    ``GroupedStepMasks``).

    bonus: one row per request, the bonus position's (from the sampler's call for it).
    drafts: ``sum(num_draft)`` rows, the draft positions' target distributions as rejection
        sampling used them, request after request (None: the step has no draft position).
    num_draft: ``[R]`` int, each request's draft positions.
    """

    bonus: DeviceStepMasks
    drafts: DeviceStepMasks | None
    num_draft: np.ndarray

    def copy_to_host_nonblocking(self) -> HostSpeculativeStepMasks:
        return HostSpeculativeStepMasks(
            self.bonus.copy_to_host_nonblocking(),
            None if self.drafts is None else self.drafts.copy_to_host_nonblocking(),
            self.num_draft)


@dataclass
class HostSpeculativeStepMasks:
    """``SpeculativeStepMasks`` being copied; read only after the copy event fired."""

    bonus: HostStepMasks
    drafts: HostStepMasks | None
    num_draft: np.ndarray

    def unpack(self, num_sampled: np.ndarray) -> StepSamplingMasks:
        """The step's rows grouped by request (``StepSamplingMasks.groups``): each request's
        draft rows, then its bonus row (``num_sampled`` ``[R]``: 0 empties the bonus row)."""
        bonus = self.bonus.unpack(num_sampled)
        num_draft = self.num_draft.tolist()
        drafts = (StepSamplingMasks(b"", [], []) if self.drafts is None
                  else self.drafts.unpack(np.ones(sum(num_draft), dtype=np.int32)))
        base = len(bonus.blob)
        starts: list[int] = []
        ends: list[int] = []
        groups = [0]
        first = 0
        for request, count in enumerate(num_draft):
            for row in range(first, first + count):
                start = drafts.starts[row]
                starts.append(start if start < 0 else base + start)
                ends.append(base + drafts.ends[row])
            first += count
            starts.append(bonus.starts[request])
            ends.append(bonus.ends[request])
            groups.append(len(starts))
        return StepSamplingMasks(b"".join((bonus.blob, drafts.blob)), starts, ends,
                                 groups=groups)


@dataclass
class GroupedStepMasks:
    """One speculative-decoding step's masks on the device (Model Runner V2): one compaction of
    every sampled position's target distribution, request after request.

    positions: ``cu_positions[-1]`` rows: each request's draft positions, then its bonus position.
    cu_positions: ``[R + 1]`` int, request ``i``'s rows are ``cu_positions[i]:cu_positions[i + 1]``
        (vLLM's ``InputBatch.cu_num_logits_np``).
    """

    positions: DeviceStepMasks
    cu_positions: np.ndarray

    def copy_to_host_nonblocking(self) -> HostGroupedStepMasks:
        return HostGroupedStepMasks(self.positions.copy_to_host_nonblocking(), self.cu_positions)


@dataclass
class HostGroupedStepMasks:
    """``GroupedStepMasks`` being copied; read only after the copy event fired."""

    positions: HostStepMasks
    cu_positions: np.ndarray

    def unpack(self, num_sampled: np.ndarray) -> StepSamplingMasks:
        """The step's rows grouped by request (``StepSamplingMasks.groups``); ``num_sampled``
        ``[R]``: the tokens each request sampled (accepted drafts + 1, 0 for a partial prefill
        chunk), so only its first ``num_sampled[i]`` positions' rows are unpacked."""
        cu = self.cu_positions.astype(np.int64)
        counts = np.diff(cu)
        position = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], counts)
        used = position < np.repeat(np.asarray(num_sampled[: counts.size], np.int64), counts)
        rows = self.positions.unpack(used.astype(np.int32))
        rows.groups = cu.tolist()
        return rows


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
    # steps), and a row over the width is expanded from the bitmap, so the width leaves room.
    max_top_k = int(top_k_np.max()) if top_k_np.size else 1
    width = max(1, min(max_top_k + tie_slack(max_top_k), processed_logits.shape[1], max_width))
    return DeviceStepMasks(compact_support(processed_logits, width), row_wants=row_wants)
