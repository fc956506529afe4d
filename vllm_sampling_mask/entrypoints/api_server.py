"""Two gauges on the server's ``/metrics`` (extends ``vllm/entrypoints/openai/api_server.py``).

Mask rows of in-flight requests live on vLLM's per-request ``RequestState`` in the API server's
output processor (``RequestState.sampling_mask_rows``), and are freed with it when
the request finishes, is aborted, or its client disconnects. On a server started with
``--return-sampling-mask`` these gauges, computed when ``/metrics`` is scraped, show what is held:

``vllm_sampling_mask:held_requests``
    request states that hold a row list (every in-flight request of a mask engine that wants
    masks);
``vllm_sampling_mask:held_rows``
    the mask rows they hold in total: every row so far of a non-streaming request, only the rows
    not yet handed out of a streaming one (rows are dropped once a chunk carries them). A
    non-streaming request without stop strings gets its rows from the engine core every 64 steps
    and at its end (the engine core holds the others: ``core/scheduler.py``).

Both return to 0 once no request is in flight; a value that stays above
``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` would be a leak. Not exported when
vLLM uses Prometheus' multiprocess mode (``--api-server-count`` > 1 or
``PROMETHEUS_MULTIPROC_DIR`` set): that registry only aggregates metric files.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from vllm_sampling_mask.config import SamplingMaskConfig

HELD_REQUESTS = "vllm_sampling_mask:held_requests"
HELD_ROWS = "vllm_sampling_mask:held_rows"
_ROWS_ATTR = "sampling_mask_rows"  # set by vllm_sampling_mask.engine.output_processor


def held_mask_state(output_processor: Any) -> tuple[int, int]:
    """``(request states holding rows, rows held)`` of one vLLM ``OutputProcessor``."""
    for _ in range(3):  # a concurrent insert/removal (another thread) can interrupt the copy
        try:
            states = list(output_processor.request_states.values())
            break
        except RuntimeError:
            continue
    else:
        return 0, 0
    requests = rows = 0
    for state in states:
        held = getattr(state, _ROWS_ATTR, None)
        if held is not None:
            requests += 1
            rows += len(held)
    return requests, rows


class HeldMaskStateCollector:
    """Prometheus collector of ``held_mask_state`` over the output processors it watches."""

    def __init__(self) -> None:
        self._processors: weakref.WeakSet[Any] = weakref.WeakSet()

    def watch(self, output_processor: Any) -> None:
        self._processors.add(output_processor)

    def _families(self, requests: int, rows: int) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily(HELD_REQUESTS, "Request states holding sampling-mask rows "
                                "(vllm-sampling-mask).", value=requests)
        yield GaugeMetricFamily(HELD_ROWS, "Sampling-mask rows held for in-flight requests "
                                "(vllm-sampling-mask).", value=rows)

    def describe(self) -> Iterator[Any]:
        return self._families(0, 0)

    def collect(self) -> Iterator[Any]:
        requests = rows = 0
        for processor in list(self._processors):
            held_requests, held_rows = held_mask_state(processor)
            requests += held_requests
            rows += held_rows
        return self._families(requests, rows)


_collector: HeldMaskStateCollector | None = None
_lock = threading.Lock()


def watch_output_processor(output_processor: Any) -> HeldMaskStateCollector:
    """Export the gauges for ``output_processor`` (registers the collector once per process)."""
    global _collector
    with _lock:
        if _collector is None:
            from prometheus_client import REGISTRY

            collector = HeldMaskStateCollector()
            REGISTRY.register(collector)
            _collector = collector
        _collector.watch(output_processor)
        return _collector


def wrap_init_app_state(original: Any) -> Any:
    """``init_app_state``: on a mask server, export the gauges for its engine client."""

    @functools.wraps(original)
    async def init_app_state(engine_client: Any, *args: Any, **kwargs: Any) -> Any:
        result = await original(engine_client, *args, **kwargs)
        output_processor = getattr(engine_client, "output_processor", None)
        if output_processor is not None and SamplingMaskConfig.of(engine_client.vllm_config).enabled:
            watch_output_processor(output_processor)
        return result

    return init_app_state
