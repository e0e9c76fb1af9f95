"""Runtime.run(on_abort=...) wakes waits that live outside the runtime."""
import queue
import threading
import time

import pytest

from torchpipe.runtime import Program, Runtime
from torchpipe.workers import spawn_workers, stop_workers


def test_on_abort_wakes_a_job_blocked_outside_the_runtime():
    out = queue.SimpleQueue()
    workers = spawn_workers([None, None], out)
    try:
        runtime = Runtime(workers)
        external = threading.Event()  # stands for a host-table lookup waiting on another batch
        calls = []

        def blocked(ctx, inputs):
            assert external.wait(timeout=30), "on_abort never woke the external wait"
            return "woken"

        def failing(ctx, inputs):
            time.sleep(0.05)
            raise ValueError("boom")

        program = Program(2)
        program.add(0, "blocked", blocked)
        program.add(1, "failing", failing)

        def on_abort(error):
            calls.append(error)
            external.set()

        started = time.perf_counter()
        with pytest.raises(ValueError, match="boom"):
            runtime.run(program, None, on_abort=on_abort)
        assert time.perf_counter() - started < 10
        assert len(calls) == 1 and isinstance(calls[0], ValueError)
        # Usable afterwards, and on_abort is not called for a clean step.
        external.clear()
        ok = Program(1)
        ok.add(0, "ok", lambda ctx, inputs: 1, keep=True)
        assert runtime.run(ok, None, on_abort=on_abort) == {"ok": 1}
        assert len(calls) == 1
    finally:
        stop_workers(workers)


# Regression: an interrupt landing after a step finished, before the caller uninstalled it, left
# it for the next call, which aborted it and so called on_abort for a step that never failed
# (the rec pipeline's hook then failed the next clock's host-table lookups).
def test_a_finished_step_left_installed_is_ended_without_calling_on_abort():
    from torchpipe.runtime import ThreadState, _Step

    out = queue.SimpleQueue()
    workers = spawn_workers([None], out)
    try:
        runtime = Runtime(workers)
        calls = []
        program = Program(1)
        program.add(0, "ok", lambda ctx, inputs: 1, keep=True)
        program.freeze()
        finished = _Step(program, None, ThreadState(["cpu"]), on_abort=calls.append)
        finished.finished.set()  # every worker counted itself out
        runtime._step = finished
        assert runtime.run(program, None, on_abort=calls.append) == {"ok": 1}
        assert calls == [] and not finished.aborted

        # One that did not finish is aborted, and its hook gets an exception to raise.
        unfinished = _Step(program, None, ThreadState(["cpu"]), on_abort=calls.append)
        runtime._step = unfinished
        assert runtime.run(program, None, on_abort=calls.append) == {"ok": 1}
        assert unfinished.aborted and len(calls) == 1 and isinstance(calls[0], BaseException)
    finally:
        stop_workers(workers)
