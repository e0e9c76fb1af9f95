"""Per-call cost of the checks the eighteenth session added to every pipeline call: quoted in docs/benchmarks.md.

``refuse_untransferable_state`` (transforms, tracers and fake-tensor modes the workers cannot
join), ``_Modes.current`` (the caller's Python mode stacks) and ``_compiling`` (compile
against export), and the whole ``ThreadState`` capture they are part of. Best of 5 repeats
of 20,000 calls each, in microseconds per call. Then, in one process, ``pipe(x).sum().backward()``
at chunks = 1 (the ``overhead`` suite's model) with the new checks on and replaced by no-ops,
alternating, 8 rounds of 100 calls each: the median milliseconds per call of each.

    .venv/bin/python docs/probe_call_checks.py
"""
import statistics
import time
import timeit

import torch

import torchpipe.pipe as pipe_module
import torchpipe.thread_state as thread_state
from torchpipe import Pipe
from torchpipe.bench.overhead import make_model
from torchpipe.pipe import _compiling
from torchpipe.thread_state import ThreadState, _Modes, refuse_untransferable_state

CALLS = 20000


def main() -> None:
    cases = [
        ("refuse_untransferable_state", lambda: refuse_untransferable_state("pipe(x)")),
        ("_Modes.current", _Modes.current),
        ("_compiling", _compiling),
        ("ThreadState capture (includes _Modes.current)", lambda: ThreadState(("cpu",))),
        ("torch.compiler.is_compiling (for scale)", torch.compiler.is_compiling),
    ]
    for name, call in cases:
        seconds = min(timeit.repeat(call, number=CALLS, repeat=5)) / CALLS
        print(f"{name:48s} {seconds * 1e6:6.2f} us per call")
    toggled_call()


def toggled_call() -> None:
    torch.set_num_threads(1)
    real_refuse, real_current = pipe_module.refuse_untransferable_state, _Modes.current
    x = torch.randn(64, 16)
    times: dict = {True: [], False: []}
    with Pipe(make_model(), [1, 1, 1, 1], devices=["cpu"] * 4, chunks=1, checkpoint="never") as pipe:
        for _ in range(5):
            pipe(x).sum().backward()
        for round_ in range(16):
            on = round_ % 2 == 0
            pipe_module.refuse_untransferable_state = real_refuse if on else (lambda what: None)
            thread_state._Modes.current = real_current if on else classmethod(lambda cls: None)  # type: ignore
            start = time.perf_counter()
            for _ in range(100):
                pipe(x).sum().backward()
            times[on].append((time.perf_counter() - start) / 100 * 1e3)
    pipe_module.refuse_untransferable_state, thread_state._Modes.current = real_refuse, real_current
    for on in (True, False):
        print(f"pipe(x) + backward, chunks=1, checks {'on ' if on else 'off'}: median "
              f"{statistics.median(times[on]):.3f} ms per call, rounds {[round(t, 3) for t in times[on]]}")


if __name__ == "__main__":
    main()
