"""A process that used a Pipe and torch.distributed can tear its process group down.

torch's checkpoint imports ``torch._dynamo`` on first use, which imports
``torch.distributed.nn.functional``; imported after ``init_process_group``, that module's
``group=group.WORLD`` defaults keep the default group alive past ``destroy_process_group()``,
and its gloo threads then race the interpreter's teardown (an abort at exit about once in
20-60 runs: ``docs/probe_exit_abort.py``). ``import torchpipe`` imports the module first.
"""
from __future__ import annotations

import datetime
import importlib
import os

import pytest
import torch
import torch.distributed as dist
from spawn_helpers import spawn_ranks
from torch import nn

from torchpipe import Pipe

TASKS = "/proc/self/task"


def native_thread_names() -> list:
    names = []
    for task in os.listdir(TASKS):
        try:
            with open(os.path.join(TASKS, task, "comm")) as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return names


def teardown_worker(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    pipe = Pipe(model, balance=[2, 1], devices=["cpu"] * 2, chunks=2, checkpoint="always")
    pipe(torch.randn(6, 4, dtype=torch.double)).sum().backward()
    importlib.import_module("torch._dynamo")  # what the checkpoint, or a torch.compile, imports after the group exists
    assert [n for n in native_thread_names() if "gloo" in n], "the test needs gloo's threads to be visible"
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    left = [n for n in native_thread_names() if "gloo" in n]
    assert not left, f"destroy_process_group() left the default group's threads running: {left}"
    pipe.close()


@pytest.mark.skipif(not os.path.isdir(TASKS), reason="lists native threads through Linux's /proc")
def test_destroy_process_group_ends_the_groups_threads_after_a_checkpointed_pipe(tmp_path) -> None:
    spawn_ranks(teardown_worker, str(tmp_path / "init"))
