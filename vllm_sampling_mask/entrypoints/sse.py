"""Put mask rows into a streamed (server-sent events) response, chunk by chunk. No vLLM import.

vLLM's stream generators build each chunk themselves and yield it as ``"data: {json}\\n\\n"``;
we do not copy them. Instead the engine outputs they consume are observed on the way in
(``StreamMasks.add``: the new token ids and their rows, per choice index) and every chunk they
yield is rewritten on the way out (``StreamMasks.rewrite``): a choice that reports generated
tokens receives ``token_ids`` = the tokens observed for it since its previous such chunk and
``sampling_mask`` = their rows. Tokens of an engine output that vLLM emits no chunk for (a chat
parser holding a control token back) therefore ride in the next chunk of that choice, so the
chunks' ``token_ids`` and ``sampling_mask`` concatenate to the completion's.

Which choices "report generated tokens": exactly those whose JSON has a ``token_ids`` key. vLLM
0.26 sets that key (possibly ``null``) on every chunk built from an engine output and on no
other (the chat role and echo chunks, usage chunks, errors): ``exclude_unset`` omits it there.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from vllm_sampling_mask.entrypoints.mask_fields import MaskOptions

logger = logging.getLogger("vllm_sampling_mask")

_DATA = "data: "


class StreamMasks:
    """Pending ``(token_ids, rows)`` per choice index of one streamed response."""

    def __init__(self, options: MaskOptions):
        self._options = options
        self._pending: dict[int, tuple[list[int], list[Sequence[int]]]] = {}

    def add(self, index: int, token_ids: Sequence[int], rows: Sequence[Sequence[int]]) -> None:
        """Record the new tokens of choice ``index`` and their rows (one row per token)."""
        if len(rows) != len(token_ids):
            raise RuntimeError(
                f"sampling mask has {len(rows)} rows for {len(token_ids)} new tokens of choice "
                f"{index}. This is a bug in vllm-sampling-mask."
            )
        if not token_ids:
            return
        tokens, kept = self._pending.setdefault(index, ([], []))
        tokens.extend(token_ids)
        kept.extend(rows)

    @property
    def pending_rows(self) -> int:
        """Rows observed but not yet sent (0 once a stream has ended normally)."""
        return sum(len(kept) for _, kept in self._pending.values())

    def rewrite(self, event: str) -> str:
        """One SSE event with the pending rows of the choices it reports; others unchanged."""
        if not event.startswith(_DATA) or event.startswith("data: [DONE]"):
            return event
        try:
            chunk = json.loads(event[len(_DATA):])
        except ValueError:
            return event
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not choices:
            return event
        changed = False
        for choice in choices:
            if not isinstance(choice, dict) or "token_ids" not in choice:
                continue
            tokens, rows = self._pending.pop(choice.get("index"), ([], []))
            choice["token_ids"] = tokens
            choice["sampling_mask"] = self._options.render(rows)
            changed = True
        if not changed:
            return event
        return f"{_DATA}{json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def rewrite_stream(self, events: AsyncIterator[str]) -> AsyncGenerator[str, None]:
        """``rewrite`` applied to every event of ``events``; closing this closes ``events``."""
        finished = False
        try:
            async for event in events:
                yield self.rewrite(event)
            finished = True
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()
            if finished and self.pending_rows:
                logger.warning("sampling mask: %d rows of a finished stream were never sent.",
                               self.pending_rows)


def wrap_request_output_stream(original: Any) -> Any:
    """A serving method streaming from ``result_generator`` (``RequestOutput``s, one chunk per
    engine output): every chunk it yields carries the rows of the tokens it carries. Used for
    the TITO and the chat-completion stream generators."""
    from vllm_sampling_mask.entrypoints.serving import Arguments, current_options, observe, rows_of

    @functools.wraps(original)
    def stream_generator(self: Any, *args: Any, **kwargs: Any) -> Any:
        options = current_options()
        if not options.enabled:
            return original(self, *args, **kwargs)
        call = Arguments(original, (self, *args), kwargs)
        masks = StreamMasks(options)

        def seen(result: Any) -> None:
            for output in result.outputs:
                masks.add(output.index, output.token_ids, rows_of(output))

        call["result_generator"] = observe(call["result_generator"], seen)
        return masks.rewrite_stream(call.call(original))

    return stream_generator
