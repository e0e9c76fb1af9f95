"""Worker thread caps stay on the workers: the caller's threads keep their intra-op threads."""
import threading

import torch
from thread_helpers import pretend_cores
from torch import nn

from torchpipe import Pipe


def threads_of_a_new_thread():
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_pipe_workers_do_not_change_the_callers_thread_settings():
    before_main, before_new = torch.get_num_threads(), threads_of_a_new_thread()
    seen_in_stage = []

    class Probe(nn.Module):
        def forward(self, x):
            seen_in_stage.append(torch.get_num_threads())
            return x

    with Pipe(nn.Sequential(Probe(), Probe()), [1, 1], chunks=2, intra_op_threads=1) as pipe:
        pipe(torch.randn(4, 2))
        assert seen_in_stage and set(seen_in_stage) == {1}
        assert torch.get_num_threads() == before_main
        assert threads_of_a_new_thread() == before_new
    assert threads_of_a_new_thread() == before_new


def test_a_budget_above_the_callers_setting_stays_on_the_workers(monkeypatch):
    # torch sets a new thread's OpenMP count from its process-wide default the first time the
    # thread asks; a worker that capped itself before that got the default back and then set
    # its cap with torch.set_num_threads, which is process-wide: threads the caller started
    # later ran with the worker's count.
    pretend_cores(monkeypatch, 4)  # so that 3 is allowed on a smaller machine
    original = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen_in_stage = []

        class Probe(nn.Module):
            def forward(self, x):
                seen_in_stage.append(torch.get_num_threads())
                return x

        for budget in (2, 3):
            with Pipe(nn.Sequential(Probe(), nn.Linear(2, 2)), [2], devices=["cpu"], intra_op_threads=budget) as pipe:
                pipe(torch.randn(4, 2))
            assert seen_in_stage[-1] == budget
            assert torch.get_num_threads() == 1
            assert threads_of_a_new_thread() == 1
    finally:
        torch.set_num_threads(original)


def test_the_even_split_stays_within_the_callers_own_thread_limit(monkeypatch):
    # Review (s30): the split counted the cores only, so under torch.set_num_threads(1),
    # threadpool_limits(1) or OMP_NUM_THREADS=1 (torchrun's setting for several processes per
    # node) a one-partition Pipe's worker still ran on every core.
    from threadpoolctl import threadpool_limits

    import torchpipe.workers as workers_module

    monkeypatch.setattr(workers_module.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(workers_module.os, "cpu_count", lambda: 8)
    seen_in_stage = []

    class Probe(nn.Module):
        def forward(self, x):
            seen_in_stage.append(torch.get_num_threads())
            return x

    def worker_threads(balance):
        with Pipe(nn.Sequential(Probe(), nn.Linear(2, 2), nn.Identity(), nn.Identity()), balance,
                  devices=["cpu"] * len(balance), chunks=2) as pipe:  # one micro-batch runs on this thread
            pipe(torch.randn(4, 2))
        return seen_in_stage[-1]

    original = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert worker_threads([4]) == 1
        torch.set_num_threads(4)
        assert worker_threads([4]) == 4 and worker_threads([2, 2]) == 2  # four threads, split in two
        with threadpool_limits(limits=2, user_api="openmp"):
            assert worker_threads([4]) == 2
        assert torch.get_num_threads() == 4  # the caller's setting is its own
    finally:
        torch.set_num_threads(original)
