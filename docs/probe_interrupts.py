"""Where a Ctrl-C can land in the runtime's abort, and whether a Pipe recovers from any of them.

Twenty-first session. Three modes:

``lines``  A trace function raises KeyboardInterrupt at each line event of
           ``_Step._release_all`` (1st, 2nd and 3rd hit). Two placements leave the step's guard
           held, and the retrying ``abort()`` then blocks on it: the ``try:`` line inside the
           lock loop (a NOP that the ``with`` block's handler does not cover in 3.11) and the
           ``with`` line's second event (its exit, before ``__exit__`` is called). A real
           signal cannot land at either: CPython runs signal handlers only at its eval-breaker
           checks (function entry, backward jumps, after calls), and neither a NOP nor the
           instructions before the C-level ``__exit__`` call check it.
``abort``  Real SIGINTs, every 0-200 us, while the main thread aborts fresh 64-job steps in a
           loop; the handler raises only inside ``abort()``. Prints how many steps were left
           with a wait unreleased: a signal can land at ``abort()``'s entry, before it did
           anything, or escape at the back edge of its retry loop, which lies outside its
           ``try``. The runtime does not rely on ``abort()`` finishing: a second interrupt
           leaves the step installed, and the next call aborts it again (``Runtime._try_end``).
``storm``  Real SIGINTs (1-3 per call, 0-20 ms apart) at a 4-stage Pipe's caller for 300
           calls (``forward`` and ``step``); after each, with signals stopped, the Pipe must
           give the plain model's output within 15 s, and grad mode must be on.

    .venv/bin/python docs/probe_interrupts.py lines
    .venv/bin/python docs/probe_interrupts.py abort      # SECONDS=3
    .venv/bin/python docs/probe_interrupts.py storm      # SEED=0 ITERS=300 SPREAD=0.02
"""
from __future__ import annotations

import copy
import os
import random
import signal
import sys
import threading
import time

import torch
from torch import nn

from torchpipe import Pipe
from torchpipe.runtime import Program, ThreadState, _Step


def _aborted_program(jobs: int) -> Program:
    program = Program(1)
    for key in range(jobs):
        program.add(0, key, lambda context, inputs: None)
    return program.freeze()


def _watchdog(seconds: float) -> None:
    def fire() -> None:
        time.sleep(seconds)
        print("HANG", flush=True)
        os._exit(3)

    threading.Thread(target=fire, daemon=True).start()


def lines() -> None:
    code = _Step._release_all.__code__
    numbers = sorted({line for _, _, line in code.co_lines() if line is not None})
    program = _aborted_program(4)
    for target in numbers:
        for hit in (1, 2, 3):
            step = _Step(program, None, ThreadState(["cpu"]))
            seen = [0]

            def local(frame, event, arg, target=target, hit=hit, seen=seen):
                if event == "line" and frame.f_lineno == target:
                    seen[0] += 1
                    if seen[0] == hit:
                        raise KeyboardInterrupt
                return local

            def tracer(frame, event, arg, local=local):
                return local if frame.f_code is code else None

            def body(step=step, tracer=tracer):
                sys.settrace(tracer)
                try:
                    step.abort(None)
                except KeyboardInterrupt:
                    pass
                finally:
                    sys.settrace(None)

            thread = threading.Thread(target=body, daemon=True)
            thread.start()
            thread.join(2)
            fired = "raised" if seen[0] >= hit else "no such hit"
            if thread.is_alive():
                print(f"line {target} hit {hit}: {fired}; abort() blocked (the guard is held)")
                continue
            released = all(lock.acquire(blocking=False) for lock in step.locks)
            print(f"line {target} hit {hit}: {fired}; " + ("every wait released" if released else "A WAIT LEFT LOCKED"))


def abort() -> None:
    inside = [False]
    landed = [0]

    def handler(signum, frame):
        if inside[0]:
            landed[0] += 1
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    program = _aborted_program(64)
    main = threading.main_thread().ident
    stop = threading.Event()

    def send() -> None:
        rng = random.Random(0)
        while not stop.wait(rng.uniform(0, 2e-4)):
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=send, daemon=True).start()
    _watchdog(60)
    deadline = time.perf_counter() + float(os.environ.get("SECONDS", "3"))
    steps = interrupted = left_locked = 0
    while time.perf_counter() < deadline:
        step = _Step(program, None, ThreadState(["cpu"]))
        inside[0] = True
        try:
            step.abort(RuntimeError("a stage failed"))
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            inside[0] = False
        steps += 1
        if not all(lock.acquire(blocking=False) for lock in step.locks):
            left_locked += 1
    stop.set()
    print(f"{steps} aborts, {landed[0]} signals raised inside abort(), {interrupted} aborts interrupted, "
          f"{left_locked} left a wait locked")


class _Sleep(nn.Module):
    def forward(self, x):
        time.sleep(0.0005)
        return x


def storm() -> None:
    armed = [False]

    def handler(signum, frame):
        if armed[0]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    torch.set_num_threads(1)
    _watchdog(600)
    torch.manual_seed(0)
    pipe = Pipe(nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), _Sleep())]),
                [2, 2, 2, 2], chunks=4, checkpoint="never")
    x = torch.randn(16, 8)
    main = threading.main_thread().ident
    rng = random.Random(int(os.environ.get("SEED", "0")))
    spread = float(os.environ.get("SPREAD", "0.02"))
    counts = {"interrupted": 0, "clean": 0, "refused then worked": 0}
    for it in range(int(os.environ.get("ITERS", "300"))):
        delays = [rng.uniform(0, spread) for _ in range(rng.choice([1, 2, 2, 3]))]
        stop = threading.Event()

        def send(delays=delays, stop=stop) -> None:
            for delay in delays:
                if stop.wait(delay):
                    return
                signal.pthread_kill(main, signal.SIGINT)

        sender = threading.Thread(target=send)
        sender.start()
        try:
            armed[0] = True
            try:
                if it % 2:
                    pipe.step(x, torch.zeros(16, 8), nn.MSELoss())
                else:
                    pipe(x)
                time.sleep(0.008)  # late signals land here
                armed[0] = False
                counts["clean"] += 1
            except KeyboardInterrupt:
                armed[0] = False
                counts["interrupted"] += 1
        except KeyboardInterrupt:  # one that landed in the handler above
            armed[0] = False
            counts["interrupted"] += 1
        armed[0] = False
        stop.set()
        sender.join()
        assert torch.is_grad_enabled(), "an interrupted call left grad mode off"
        deadline = time.perf_counter() + 15
        refused = False
        while True:
            try:
                with torch.no_grad():
                    got = pipe(x)
                break
            except RuntimeError as exc:
                if "has not returned" not in str(exc) or time.perf_counter() > deadline:
                    print(f"call {it}: still refused after 15 s: {exc}", flush=True)
                    os._exit(4)
                refused = True
                time.sleep(0.05)
        counts["refused then worked"] += refused
        with torch.no_grad():
            torch.testing.assert_close(got, nn.Sequential(*[copy.deepcopy(layer) for layer in pipe])(x))
    pipe.close()
    print("after every call the Pipe worked again:", counts)


if __name__ == "__main__":
    modes = {"lines": lines, "abort": abort, "storm": storm}
    if len(sys.argv) != 2 or sys.argv[1] not in modes:
        raise SystemExit("usage: probe_interrupts.py lines|abort|storm")
    modes[sys.argv[1]]()
