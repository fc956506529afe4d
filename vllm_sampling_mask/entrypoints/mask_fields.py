"""The HTTP request fields that ask for sampling masks, and how a mask is put on the wire.

No vLLM import: the serving wrappers (``token_in_token_out.py``, ``completion.py``,
``chat_completion.py``) call these, and unit tests call them directly.

Request fields (top level of the JSON body, on every endpoint):

``return_sampling_mask`` (bool or null)
    ``true``: every choice carries ``token_ids`` (the generated ids) and ``sampling_mask`` (one
    row per id). Default: ``false`` on ``/v1/completions`` and ``/v1/chat/completions``; on
    ``/inference/v1/generate``, whatever the server's ``--return-sampling-mask`` switch says.
``sampling_mask_format`` (``"json"``, ``"compact"`` or null; default ``"json"``)
    ``"json"``: ``sampling_mask`` is ``list[list[int]]``. ``"compact"``: it is the dict of
    ``vllm_sampling_mask.compact_format`` (``csr-delta-varint-base64``). Validated on every
    request, used only when masks are returned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_sampling_mask.compact_format import (
    DELTA_VARINT_ENCODING,
    encode_compact,
    encode_compact_arrays,
    encode_delta_varint_payload,
)
from vllm_sampling_mask.outputs import SamplingMask

RETURN_FIELD = "return_sampling_mask"
FORMAT_FIELD = "sampling_mask_format"
JSON_FORMAT = "json"
COMPACT_FORMAT = "compact"
FORMATS = (JSON_FORMAT, COMPACT_FORMAT)
HTTP_COMPACT_ENCODING = DELTA_VARINT_ENCODING
"""The compact encoding the server sends (``decode_compact`` reads every encoding)."""

SWITCH_OFF_MESSAGE = (
    f"{RETURN_FIELD} requires a server started with --return-sampling-mask "
    "(and --logprobs-mode processed_logprobs); this server was started without it. Restart it "
    "with those flags, or drop the field."
)


class MaskFieldError(ValueError):
    """A bad mask field of one request (HTTP 400); ``parameter`` names the field."""

    def __init__(self, message: str, parameter: str):
        super().__init__(message)
        self.parameter = parameter


@dataclass(frozen=True)
class MaskOptions:
    """What one request asked for."""

    enabled: bool = False
    format: str = JSON_FORMAT

    @property
    def renders_delta_varint(self) -> bool:
        """Whether masks go out as ``csr-delta-varint-base64`` (a mask that already holds its
        rows in that form is sent as it is)."""
        return self.enabled and self.format == COMPACT_FORMAT and (
            HTTP_COMPACT_ENCODING == DELTA_VARINT_ENCODING)

    def render(self, rows: SamplingMask | Sequence[Sequence[int]]) -> Any:
        """``rows`` (a whole completion's ``SamplingMask``, or a chunk's rows) as the JSON value
        of ``sampling_mask``: nested lists, or the compact dict. A mask goes to the compact
        dict from its CSR arrays, or its encoded rows, never through Python lists."""
        if isinstance(rows, SamplingMask):
            if self.format == COMPACT_FORMAT:
                encoded = rows.delta_varint() if self.renders_delta_varint else None
                if encoded is not None:
                    return encode_delta_varint_payload(*encoded)
                return encode_compact_arrays(*rows.csr(), encoding=HTTP_COMPACT_ENCODING)
            return rows.token_ids
        if self.format == COMPACT_FORMAT:
            return encode_compact(rows, encoding=HTTP_COMPACT_ENCODING)
        return rows if isinstance(rows, list) else [list(row) for row in rows]


DISABLED = MaskOptions()


def parse_mask_options(fields: Mapping[str, Any] | None, *, engine_enabled: bool,
                       default_enabled: bool = False) -> MaskOptions:
    """Read and validate the mask fields of one request body.

    ``fields``: the request's top-level JSON fields (missing and ``null`` mean "not given").
    ``engine_enabled``: the server's ``--return-sampling-mask`` switch. ``default_enabled``: what
    a request that does not say gets (``engine_enabled`` for the token-in/token-out endpoint).
    Raises ``MaskFieldError`` (-> HTTP 400) on a malformed field, or when a request asks for masks
    from a server whose switch is off.
    """
    fields = fields or {}
    asked = fields.get(RETURN_FIELD)
    if asked is not None and not isinstance(asked, bool):
        raise MaskFieldError(
            f"{RETURN_FIELD} must be a boolean (true or false), got {asked!r} "
            f"({type(asked).__name__}).", RETURN_FIELD)
    fmt = fields.get(FORMAT_FIELD)
    if fmt is not None and (not isinstance(fmt, str) or fmt not in FORMATS):
        raise MaskFieldError(
            f"{FORMAT_FIELD} must be one of {', '.join(repr(f) for f in FORMATS)}, got {fmt!r}.",
            FORMAT_FIELD)
    if asked and not engine_enabled:
        raise MaskFieldError(SWITCH_OFF_MESSAGE, RETURN_FIELD)
    enabled = (default_enabled if asked is None else asked) and engine_enabled
    if not enabled:
        return DISABLED
    return MaskOptions(enabled=True, format=fmt or JSON_FORMAT)
