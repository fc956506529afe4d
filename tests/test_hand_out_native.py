"""The scheduler's row hand-out in C (``core/_hand_out_native.c``) against its Python reference.

Random steps mix every kind of output the loop meets: streamed, held, opted-out, several tokens
(speculative decoding's bug case), no token with and without a finish, flush steps. Both loops
run on copies of the same step; every output's row and every held list must be the same.
``tests/test_scheduler_slicing.py`` runs the whole scheduler with each loop.
"""

from __future__ import annotations

import os
import shutil
import sysconfig

import numpy as np
import pytest

from vllm.v1.engine import EngineCoreOutputs, FinishReason

from vllm_sampling_mask.core import scheduler as scheduler_module
from vllm_sampling_mask.engine.transport import EngineCoreOutputWithMask
from vllm_sampling_mask.worker.step_masks import StepSamplingMasks

native = scheduler_module._hand_out_rows_native
needs_native = pytest.mark.skipif(native is None, reason="core/_hand_out_native.c is not built")


def test_the_c_loop_is_built_where_it_can_be() -> None:
    """setup.py's extension is optional: only a machine without a compiler or Python's headers
    may lack it (CI has both, so a broken build fails here)."""
    headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not (os.path.exists(headers) and shutil.which(compiler)):
        pytest.skip("no C compiler or no Python headers here")
    assert native is not None


def random_step(seed: int, num_requests: int = 64):
    """One step: outputs (in an order other than the batch's), the step's rows, the batch
    index, the held table (each held request with some earlier rows) and the flush flag."""
    rng = np.random.default_rng(seed)
    request_ids = [f"req-{seed}-{i}" for i in range(num_requests)]
    batch = rng.permutation(num_requests)
    index = {request_ids[i]: int(r) for i, r in enumerate(batch)}
    kinds = rng.choice(["streamed", "held", "opted_out", "several", "none", "none_finish",
                        "held_finish", "held_none_finish"], num_requests,
                       p=[0.3, 0.3, 0.1, 0.05, 0.05, 0.05, 0.1, 0.05])
    rows: list[bytes | None] = [None] * num_requests
    outputs, held = [], {}
    for i, kind in enumerate(kinds):
        rid = request_ids[i]
        if kind != "opted_out":
            width = int(rng.integers(0, 9))  # an empty row too: a token no id was kept for
            rows[index[rid]] = rng.integers(0, 1 << 31, width).astype("<i4").tobytes()
        num_new = {"several": 3, "none": 0, "none_finish": 0, "held_none_finish": 0}.get(kind, 1)
        finish = FinishReason.STOP if kind.endswith("finish") else None
        outputs.append(EngineCoreOutputWithMask(rid, list(range(num_new)), finish_reason=finish))
        if kind.startswith("held"):
            held[rid] = [bytes([i]) * 4] * int(rng.integers(0, 3))
    return outputs, StepSamplingMasks.from_rows(rows), index, held, bool(rng.integers(0, 4) == 0)


def hand_out(loop_is_native: bool, seed: int, monkeypatch: pytest.MonkeyPatch):
    outputs, step, index, held, flush = random_step(seed)
    monkeypatch.setattr(scheduler_module, "_hand_out_rows_native", native if loop_is_native else None)
    several = scheduler_module._hand_out_rows({0: EngineCoreOutputs(outputs=outputs)}, step,
                                              index, held, flush)
    return ([(o.request_id, o.sampling_mask) for o in outputs],
            [o.request_id for o in several], held)


@needs_native
@pytest.mark.parametrize("seed", range(40))
def test_the_c_loop_hands_out_what_the_python_loop_does(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert hand_out(True, seed, monkeypatch) == hand_out(False, seed, monkeypatch)


@needs_native
def test_the_random_steps_meet_every_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeds above reach each kind of output (so the comparison can fail on each)."""
    seen = set()
    for seed in range(40):
        outputs, step, index, held, flush = random_step(seed)
        rows, several, after = hand_out(True, seed, monkeypatch)
        masks = dict(rows)
        seen |= {"flush"} if flush else set()
        seen |= {"held sent" if isinstance(m, list) else "streamed" if isinstance(m, bytes)
                 else "no row" for m in masks.values()}
        seen |= {"several"} if several else set()
        seen |= {"held kept"} if any(after.values()) else set()
    assert seen == {"flush", "held sent", "streamed", "no row", "several", "held kept"}


@needs_native
@pytest.mark.parametrize("start, end", [(0, 10**6), (-4, 4), (8, 4)])
def test_a_row_outside_its_step_raises_instead_of_a_wrong_row(start: int, end: int) -> None:
    """Python's slicing would clip a bad row silently; the C loop refuses it (a bug's sign)."""
    output = EngineCoreOutputWithMask("a", [1])
    held = {"a": []} if start < 0 else {}  # a negative start is only "opted out" if not held
    with pytest.raises(IndexError, match="outside the step"):
        native([output], {"a": 0}, held, [start], [end], bytes(16), False)
    assert output.sampling_mask is None and held.get("a", []) == []


@needs_native
def test_a_batch_row_past_the_step_and_an_unknown_request_raise() -> None:
    with pytest.raises(IndexError, match="batch row 3 of a step with 1 rows"):
        native([EngineCoreOutputWithMask("a", [1])], {"a": 3}, {}, [0], [4], bytes(4), False)
    with pytest.raises(KeyError, match="b"):
        native([EngineCoreOutputWithMask("b", [1])], {"a": 0}, {}, [0], [4], bytes(4), False)


@needs_native
def test_the_c_loop_takes_only_the_types_it_was_written_for() -> None:
    """Other row containers go to the Python loop (``_hand_out_rows`` checks first); called
    with them anyway, the C loop raises TypeError rather than reading them as something else."""
    output = EngineCoreOutputWithMask("a", [1])
    with pytest.raises(TypeError):
        native([output], {"a": 0}, {}, [0], [4], memoryview(bytes(4)), False)
    with pytest.raises(TypeError):
        native([output], {"a": 0}, {}, np.zeros(1, dtype=np.int64), [4], bytes(4), False)
    with pytest.raises(TypeError, match="must be a list"):
        native([output], {"a": 0}, {"a": ()}, [0], [4], bytes(4), False)
