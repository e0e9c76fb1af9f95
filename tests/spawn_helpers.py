"""Run a test's worker function on local ranks, in processes of their own (torch.multiprocessing)."""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import Any, Callable

import torch.multiprocessing as mp


# Before the suite's 120 s timeout ends the test (and with it the only trace of a hung rank):
# a rank still running then writes every thread's stack to stderr, which the failure shows.
STACKS_AFTER_S = 100


def _run_then_exit(rank: int, worker: Callable[..., None], *args: Any) -> None:
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False)
    worker(rank, *args)
    faulthandler.cancel_dump_traceback_later()
    # A worker that returned has done and reported everything: leave without the interpreter's
    # teardown. A process group still alive there can abort the process after its work
    # ("terminate called without an active exception": docs/probe_exit_abort.py explains it).
    # torchpipe removes the cause it knew of (tests/test_dist_teardown.py checks that), but a
    # worker that fails an assertion before destroy_process_group() still leaves its group alive.
    # A worker that raised still goes through spawn's own error path.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(worker: Callable[..., None], *args: Any, nprocs: int = 2) -> None:
    """``worker(rank, *args)`` on ranks ``0..nprocs-1``, each in its own process; raises if one fails."""
    mp.spawn(_run_then_exit, args=(worker, *args), nprocs=nprocs, join=True)
