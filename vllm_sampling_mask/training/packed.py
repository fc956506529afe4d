"""CSR container for a batch of sampling masks, and helpers for padded trainer layouts.

A sampling mask is one row per generated token: the ascending vocabulary ids that were kept
(finite processed logit) when that token was sampled. ``PackedMasks`` stores ``T`` such rows
as two tensors::

    token_ids  [N]     int32   the rows, concatenated in token order
    offsets    [T + 1] int64   row t is token_ids[offsets[t]:offsets[t + 1]]; offsets[0] == 0

This is the layout of the compact HTTP wire format (``vllm_sampling_mask.compact_format``) and
what the log-prob functions consume: memory is O(total kept ids), never O(tokens x vocab).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Union

import numpy as np
import torch

from vllm_sampling_mask.compact_format import (
    COMPACT_ENCODING,
    decode_compact_arrays,
    encode_compact_arrays,
)

MaskRows = Sequence[Sequence[int]]
"""``T`` rows of ascending vocabulary ids (``SamplingMask.token_ids``, vLLM >= 0.28 output)."""


class HasTokenIds(Protocol):
    """A ``SamplingMask``-like object: ``token_ids`` holds rows or a compact wire-format dict."""

    token_ids: MaskRows | dict[str, Any]


OneMask = Union["PackedMasks", dict[str, Any], HasTokenIds]
"""One sequence's (or one streamed chunk's) mask, in any form but bare rows."""

MasksLike = Union[OneMask, MaskRows, Sequence[OneMask]]
"""Anything ``PackedMasks.from_any`` accepts (and so every function that takes ``masks``)."""

ACCEPTED_FORMS = (
    "a PackedMasks, rows as list[list[int]] (SamplingMask.token_ids), a SamplingMask (or any "
    "object with .token_ids), a compact wire-format dict {'encoding': 'csr-...', ...}, or a "
    "list of SamplingMask / compact dicts / PackedMasks (concatenated in order)"
)


def _as_int_tensor(
    values: torch.Tensor | np.ndarray | Sequence[int], dtype: torch.dtype,
    device: torch.device | str | None,
) -> torch.Tensor:
    """``values`` as a tensor of ``dtype`` on ``device`` (default: where it already is, or CPU)."""
    if not torch.is_tensor(values):
        values = torch.from_numpy(np.array(values, dtype=np.int64))
    return values.to(device=device, dtype=dtype)


@dataclass(frozen=True)
class PackedMasks:
    """``T`` sampling-mask rows in CSR form.

    Attributes:
        token_ids: ``[N] int32`` kept vocabulary ids, rows concatenated in token order.
        offsets: ``[T + 1] int64`` row boundaries; row ``t`` is
            ``token_ids[offsets[t]:offsets[t + 1]]``.

    Both tensors live on the same device. Construction checks dtypes and shapes only (no device
    sync); ``validate`` checks the values.
    """

    token_ids: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        if self.token_ids.dtype != torch.int32 or self.token_ids.dim() != 1:
            raise ValueError(
                f"PackedMasks.token_ids must be a 1-D int32 tensor, got {self.token_ids.dim()}-D "
                f"{self.token_ids.dtype}. Use PackedMasks.from_csr to convert."
            )
        if self.offsets.dtype != torch.int64 or self.offsets.dim() != 1 or self.offsets.numel() < 1:
            raise ValueError(
                f"PackedMasks.offsets must be a non-empty 1-D int64 tensor, got "
                f"{self.offsets.dim()}-D {self.offsets.dtype} with {self.offsets.numel()} elements."
            )
        if self.token_ids.device != self.offsets.device:
            raise ValueError(
                f"PackedMasks tensors must share a device, got token_ids on "
                f"{self.token_ids.device} and offsets on {self.offsets.device}."
            )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_csr(
        cls,
        row_lengths: torch.Tensor | np.ndarray | Sequence[int],
        token_ids: torch.Tensor | np.ndarray | Sequence[int],
        device: torch.device | str | None = None,
    ) -> PackedMasks:
        """Build from ``row_lengths [T]`` and ``token_ids [N]`` (any integer dtype).

        Raises ``ValueError`` if a length is negative or the lengths do not sum to ``N``.
        """
        lengths = _as_int_tensor(row_lengths, torch.int64, device)
        ids = _as_int_tensor(token_ids, torch.int32, device)
        if lengths.dim() != 1 or ids.dim() != 1:
            raise ValueError(
                f"row_lengths and token_ids must be 1-D, got shapes {tuple(lengths.shape)} and "
                f"{tuple(ids.shape)}."
            )
        if bool((lengths < 0).any()) or int(lengths.sum()) != ids.numel():
            raise ValueError(
                f"row_lengths must be non-negative and sum to len(token_ids) = {ids.numel()}, "
                f"got sum {int(lengths.sum())}."
            )
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths, dim=0, out=offsets[1:])
        return cls(token_ids=ids, offsets=offsets)

    @classmethod
    def from_rows(cls, rows: MaskRows, device: torch.device | str | None = None) -> PackedMasks:
        """Build from ``T`` rows of ids: ``SamplingMask.token_ids`` or vLLM >= 0.28's output.

        Rows may be lists, tuples or 1-D integer arrays. Raises ``TypeError`` if ``rows`` is not
        a sequence of sequences of integers.
        """
        try:
            lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
            ids = np.fromiter(map(operator.index, itertools.chain.from_iterable(rows)),
                              dtype=np.int32, count=int(lengths.sum()))
        except TypeError as exc:
            raise TypeError(f"masks must be {ACCEPTED_FORMS}, got {_describe(rows)}.") from exc
        return cls.from_csr(lengths, ids, device=device)

    @classmethod
    def from_compact(
        cls, encoded: dict[str, Any], device: torch.device | str | None = None
    ) -> PackedMasks:
        """Build from a compact HTTP wire-format dict (``{"encoding": "csr-...", ...}``, every
        encoding of ``compact_format.ENCODINGS``).

        Raises ``ValueError`` on an unknown encoding or inconsistent lengths.
        """
        row_lengths, token_ids = decode_compact_arrays(encoded)
        return cls.from_csr(row_lengths, token_ids, device=device)

    @classmethod
    def from_any(cls, masks: MasksLike, device: torch.device | str | None = None) -> PackedMasks:
        """Build from whichever form a mask arrives in: the one normalisation behind every
        function of this package that takes ``masks``.

        Accepts a ``PackedMasks`` (moved to ``device`` if given); a compact wire-format dict;
        our ``SamplingMask`` (read through ``csr()``, never as Python lists); an object with a
        ``.token_ids`` attribute (vLLM >= 0.28's ``SamplingMask``; its ``token_ids`` may itself
        be rows or a compact dict); a sequence of rows (``list[list[int]]``, rows may be 1-D
        integer arrays); or a sequence of the mask forms above (several completions, or one
        completion's streamed chunks), concatenated in order.

        Raises ``TypeError`` naming the accepted forms for anything else (``None`` included:
        a completion of an engine without the switch), ``ValueError`` on a malformed compact
        dict.
        """
        if isinstance(masks, PackedMasks):
            return masks if device is None else masks.to(device)
        if isinstance(masks, dict):
            return cls.from_compact(masks, device=device)
        if callable(getattr(masks, "csr", None)):
            return cls.from_csr(*masks.csr(), device=device)
        if hasattr(masks, "token_ids"):
            return cls.from_any(masks.token_ids, device=device)
        if isinstance(masks, (str, bytes)) or not isinstance(masks, (Sequence, np.ndarray)):
            hint = (" (a completion without sampling_mask: start the engine with "
                    "return_sampling_mask=True)" if masks is None else "")
            raise TypeError(f"masks must be {ACCEPTED_FORMS}, got {_describe(masks)}{hint}.")
        if len(masks) and _is_one_mask(masks[0]):
            return cls.concat(masks, device=device)
        return cls.from_rows(masks, device=device)

    @classmethod
    def concat(cls, masks: Sequence[MasksLike],
               device: torch.device | str | None = None) -> PackedMasks:
        """Concatenate several sequences' masks, in order, into one batch of rows.

        ``device`` defaults to the first element's device (CPU for non-tensor inputs).
        """
        packed = [cls.from_any(m, device=device) for m in masks]
        if not packed:
            return cls.from_csr([], [], device=device)
        target = packed[0].device
        packed = [p.to(target) for p in packed]
        lengths = torch.cat([p.row_lengths for p in packed])
        ids = torch.cat([p.token_ids for p in packed])
        return cls.from_csr(lengths, ids)

    # ------------------------------------------------------------------ views

    @property
    def num_rows(self) -> int:
        """``T``, the number of rows (generated tokens)."""
        return self.offsets.numel() - 1

    @property
    def num_ids(self) -> int:
        """``N``, the total number of kept ids over all rows."""
        return self.token_ids.numel()

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    @property
    def row_lengths(self) -> torch.Tensor:
        """``[T] int64`` number of kept ids of each row."""
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return self.num_rows

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedMasks:
        """Copy to ``device`` (returns ``self`` if already there)."""
        if torch.device(device) == self.device:
            return self
        return PackedMasks(
            token_ids=self.token_ids.to(device, non_blocking=non_blocking),
            offsets=self.offsets.to(device, non_blocking=non_blocking),
        )

    def row_index(self) -> torch.Tensor:
        """``[N] int64``: for each kept id, the row (token position) it belongs to."""
        return torch.repeat_interleave(
            torch.arange(self.num_rows, device=self.device), self.row_lengths,
            output_size=self.num_ids,
        )

    def padded(self, fill_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``[T, K_max]`` view: ``(ids int64, valid bool)``, ``K_max`` = longest row.

        ``ids[t, j]`` is the ``j``-th kept id of row ``t`` where ``valid[t, j]``, else
        ``fill_id``. Memory is ``T x K_max``: one full-vocabulary row makes it ``T x V``, so the
        log-prob functions use the CSR form instead. Syncs the device (reads ``K_max``).
        """
        lengths = self.row_lengths
        max_len = int(lengths.max()) if self.num_rows else 0
        columns = torch.arange(max_len, device=self.device)
        valid = columns[None, :] < lengths[:, None]  # [T, K_max]
        flat_index = (self.offsets[:-1, None] + columns[None, :]).clamp_(max=max(self.num_ids - 1, 0))
        ids = torch.full(valid.shape, fill_id, dtype=torch.int64, device=self.device)
        if self.num_ids:
            ids = torch.where(valid, self.token_ids.long()[flat_index], ids)
        return ids, valid

    def to_rows(self) -> list[list[int]]:
        """The rows as ``list[list[int]]`` (the ``SamplingMask.token_ids`` form)."""
        ids = self.token_ids.cpu().numpy()
        offsets = self.offsets.cpu().numpy()
        return [ids[offsets[t]:offsets[t + 1]].tolist() for t in range(self.num_rows)]

    def to_compact(self, encoding: str = COMPACT_ENCODING) -> dict[str, Any]:
        """The compact wire-format dict (any encoding of ``compact_format.ENCODINGS``)."""
        return encode_compact_arrays(self.row_lengths.cpu().numpy(), self.token_ids.cpu().numpy(),
                                     encoding=encoding)

    # ------------------------------------------------------------------ checks and layouts

    def validate(self, vocab_size: int) -> None:
        """Check offsets, id range ``[0, vocab_size)`` and strictly ascending rows.

        Raises ``ValueError`` naming the first offending row. Syncs the device.
        """
        offsets = self.offsets
        if int(offsets[0]) != 0 or int(offsets[-1]) != self.num_ids:
            raise ValueError(
                f"PackedMasks.offsets must start at 0 and end at len(token_ids) = {self.num_ids}, "
                f"got {int(offsets[0])} and {int(offsets[-1])}."
            )
        lengths = self.row_lengths
        if bool((lengths < 0).any()):
            row = int(torch.nonzero(lengths < 0)[0])
            raise ValueError(f"PackedMasks.offsets must be non-decreasing, got a drop at row {row}.")
        if self.num_ids == 0:
            return
        rows = self.row_index()
        ids = self.token_ids
        out_of_range = (ids < 0) | (ids >= vocab_size)
        if bool(out_of_range.any()):
            first = int(torch.nonzero(out_of_range)[0])
            raise ValueError(
                f"sampling-mask ids must lie in [0, vocab_size={vocab_size}), got {int(ids[first])} "
                f"in row {int(rows[first])}. Check that the masks belong to this model."
            )
        same_row = rows[1:] == rows[:-1]
        not_ascending = same_row & (ids[1:] <= ids[:-1])
        if bool(not_ascending.any()):
            first = int(torch.nonzero(not_ascending)[0])
            raise ValueError(
                f"sampling-mask rows must be strictly ascending, got {int(ids[first])} then "
                f"{int(ids[first + 1])} in row {int(rows[first])}."
            )

    def scatter_to_positions(self, positions: torch.Tensor) -> PackedMasks:
        """Spread the rows over a larger layout: row ``i`` goes to the ``i``-th True entry of
        ``positions`` (row-major order); every other position gets an empty row.

        Args:
            positions: ``[*] bool`` with exactly ``T`` True entries, e.g. a ``[B, L]`` response
                mask marking which positions score a generated token.

        Returns:
            ``PackedMasks`` with ``positions.numel()`` rows, on ``positions.device``.

        Raises ``ValueError`` if the number of True entries is not ``T``. Syncs the device.
        """
        flat = positions.reshape(-1).to(torch.bool)
        num_true = int(flat.sum())
        if num_true != self.num_rows:
            raise ValueError(
                f"positions must have one True entry per mask row ({self.num_rows}), got "
                f"{num_true}."
            )
        source = self.to(positions.device)
        lengths = torch.zeros(flat.numel(), dtype=torch.int64, device=positions.device)
        lengths[flat] = source.row_lengths
        return PackedMasks.from_csr(lengths, source.token_ids)


def _is_one_mask(value: Any) -> bool:
    return isinstance(value, (PackedMasks, dict)) or hasattr(value, "token_ids")


def _describe(value: Any) -> str:
    """``value``'s type, and for a sequence the type of its first element that is not a row
    of integers (error messages)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        return type(value).__name__
    for index, row in enumerate(value):
        if isinstance(row, (str, bytes)) or not isinstance(row, (Sequence, np.ndarray, torch.Tensor)):
            return f"{type(value).__name__} whose element {index} is {type(row).__name__}"
        for position, item in enumerate(row):
            try:
                operator.index(item)
            except TypeError:
                return (f"{type(value).__name__} whose row {index} holds "
                        f"{type(item).__name__} at position {position}")
    return type(value).__name__


def pack_padded_batch(sequence_masks: Sequence[MasksLike], positions: torch.Tensor) -> PackedMasks:
    """Lay ``B`` sequences' masks onto a padded ``[B, L]`` trainer layout.

    Args:
        sequence_masks: ``B`` masks (any form ``PackedMasks.from_any`` accepts), one per
            sequence; sequence ``b``'s rows belong to its generated tokens, in order.
        positions: ``[B, L] bool``; ``positions[b, l]`` is True where row ``l`` of sequence
            ``b``'s (flattened) logits scores a generated token. Sequence ``b`` must have as
            many True entries as its mask has rows.

    Returns:
        ``PackedMasks`` with ``B * L`` rows (row ``b * L + l``), empty rows at the other
        positions; pair it with ``logits.view(B * L, V)`` and ``token_ids.view(B * L)``.

    Raises ``ValueError`` naming the first sequence whose row count does not match. Syncs.
    """
    if positions.dim() != 2 or positions.shape[0] != len(sequence_masks):
        raise ValueError(
            f"positions must be [B, L] with B = len(sequence_masks) = {len(sequence_masks)}, got "
            f"shape {tuple(positions.shape)}."
        )
    packed = [PackedMasks.from_any(m, device=positions.device) for m in sequence_masks]
    per_sequence = positions.to(torch.bool).sum(dim=1).tolist()
    for b, (mask, count) in enumerate(zip(packed, per_sequence)):
        if mask.num_rows != count:
            raise ValueError(
                f"sequence {b} has {mask.num_rows} mask rows but {count} True positions; each "
                f"generated token needs exactly one row."
            )
    return PackedMasks.concat(packed).scatter_to_positions(positions)
