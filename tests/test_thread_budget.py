"""Worker thread caps stay on the workers: the caller's threads keep their intra-op threads."""
import threading

import torch
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
