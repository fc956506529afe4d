"""The engine switch, carried in ``VllmConfig.additional_config`` (vLLM's configs forbid new fields).

Keys (all optional; the CLI flag and the ``LLM``/``EngineArgs`` keyword write the first):

``return_sampling_mask`` (bool, default False)
    Record, for every generated token, the ascending vocabulary ids whose processed logit was
    finite, and return them as ``CompletionOutput.sampling_mask``.
``sampling_mask_max_width`` (int, default ``DEFAULT_MAX_WIDTH``)
    Cap on the compact per-row width W the GPU copies back each step. Rows wider than W (top-k
    boundary ties, top_k above the cap) are still returned exactly, through a bit-packed fallback.
``sampling_mask_allow_top_p_only`` (bool, default False)
    Also accept requests without top_k (``top_k`` unset, 0 or -1) whose ``top_p`` is below 1: the
    nucleus then bounds the kept set. Such rows can be thousands of ids wide (flat
    distributions), so every step of a batch holding one copies W ids per row plus the
    ``[rows, V / 32]`` bitmap: W is ``sampling_mask_max_width``.

Per request, ``SamplingParams.extra_args["return_sampling_mask"]`` (bool, default True on an engine
whose switch is on; 0 / 1 are accepted as well, since the OpenAI requests' ``vllm_xargs`` parse
JSON booleans as ints): ``False`` opts that request out. It is then not checked (greedy, no
top_k: anything vLLM accepts), its row neither sets the step's copy width nor is sent, and its
outputs carry no mask; a step of only such requests compacts and copies nothing (it samples as
a mask step would where every top_k is <= 1024, else with vLLM's own sampler). The HTTP
endpoints set it from their request fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENABLE_KEY = "return_sampling_mask"
MAX_WIDTH_KEY = "sampling_mask_max_width"
TOP_P_ONLY_KEY = "sampling_mask_allow_top_p_only"
DEFAULT_MAX_WIDTH = 4096
REQUIRED_LOGPROBS_MODE = "processed_logprobs"
REQUEST_KEY = "return_sampling_mask"
"""Key of ``SamplingParams.extra_args`` by which one request opts in (True) or out (False)."""


def rows_held_until_finish(params: Any, resumable: bool) -> bool:
    """Whether the engine core holds a request's rows and sends them every ``HELD_STEPS`` (64) steps
    and with its last output, instead of one per step: a FINAL_ONLY request (``LLM.generate``,
    non-streaming HTTP) is handed its mask only at the end, so the frontend, the bound of an engine
    returning logprobs, need not touch its rows every step. Not for requests with stop strings (the
    frontend finishes those itself, on text the engine core never sees) or streaming-input sessions
    (their outputs go on after a finish). Asked with the same ``SamplingParams`` on both sides of
    the transport, so they agree."""
    from vllm.sampling_params import RequestOutputKind

    return params.output_kind == RequestOutputKind.FINAL_ONLY and not params.stop and not resumable


def is_request_choice(value: Any) -> bool:
    """Whether ``value`` is a valid ``extra_args["return_sampling_mask"]``: a bool, or 0 / 1 (the
    OpenAI requests' ``vllm_xargs`` turn JSON booleans into ints)."""
    return isinstance(value, bool) or (type(value) is int and value in (0, 1))


def request_wants_masks(params: Any) -> bool:
    """Whether a request's ``SamplingParams`` asks for masks on an engine whose switch is on:
    anything but an explicit ``extra_args["return_sampling_mask"]`` of ``False`` (or ``0``: the
    OpenAI requests' ``vllm_xargs`` turn JSON booleans into ints) does. Values other than
    bools and 0 / 1 are refused by the engine's input checks before this is asked."""
    extra_args = params.extra_args
    if not extra_args:
        return True
    asked = extra_args.get(REQUEST_KEY)
    return asked is None or bool(asked)


@dataclass(frozen=True)
class SamplingMaskConfig:
    """Parsed sampling-mask settings of one engine."""

    enabled: bool = False
    max_width: int = DEFAULT_MAX_WIDTH
    allow_top_p_only: bool = False

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> SamplingMaskConfig:
        """Parse and validate our keys; raises ``ValueError`` naming the bad key. A non-dict
        ``additional_config`` (vLLM also accepts any hashable object) holds none of them."""
        if not isinstance(additional_config, dict):
            return cls()
        enabled = additional_config.get(ENABLE_KEY, False)
        if not isinstance(enabled, bool):
            raise ValueError(
                f"additional_config[{ENABLE_KEY!r}] must be a bool, got {enabled!r}. "
                f"Use --return-sampling-mask or {{\"{ENABLE_KEY}\": true}}."
            )
        max_width = additional_config.get(MAX_WIDTH_KEY, DEFAULT_MAX_WIDTH)
        if isinstance(max_width, bool) or not isinstance(max_width, int) or max_width < 1:
            raise ValueError(
                f"additional_config[{MAX_WIDTH_KEY!r}] must be a positive int, got {max_width!r}."
            )
        allow_top_p_only = additional_config.get(TOP_P_ONLY_KEY, False)
        if not isinstance(allow_top_p_only, bool):
            raise ValueError(
                f"additional_config[{TOP_P_ONLY_KEY!r}] must be a bool, got {allow_top_p_only!r}."
            )
        return cls(enabled=enabled, max_width=max_width, allow_top_p_only=allow_top_p_only)

    @classmethod
    def of(cls, vllm_config: Any) -> SamplingMaskConfig:
        """Settings of the engine described by a ``VllmConfig``."""
        return cls.from_additional_config(getattr(vllm_config, "additional_config", None))
