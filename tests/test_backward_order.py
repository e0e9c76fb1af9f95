"""Invariant 2: per partition, backward runs in the reverse order of forward (forward() path)."""
import pytest
import torch
from torch import nn

from torchpipe import Pipe


class Log(torch.autograd.Function):
    """Identity that logs (partition, micro-batch id) in forward and in backward."""

    @staticmethod
    def forward(ctx, x, partition, forward_log, backward_log):
        ctx.partition, ctx.log = partition, backward_log
        ctx.mark = float(x.detach()[0, 0])  # tells the micro-batches apart within a partition
        forward_log.append((partition, ctx.mark))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append((ctx.partition, ctx.mark))
        return grad, None, None, None


class Tag(nn.Module):
    def __init__(self, partition, forward_log, backward_log):
        super().__init__()
        self.args = (partition, forward_log, backward_log)

    def forward(self, x):
        return Log.apply(x, *self.args)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("extra", [[0, 0, 0, 0], [0, 3, 0, 6]])
def test_backward_per_partition_runs_in_reverse_micro_batch_order(checkpoint, requires_grad, extra):
    # No phony edges enforce this (see torchpipe/lowering.py): it must follow from every
    # partition building its nodes on its own thread, in micro-batch order. Uneven partitions
    # (``extra`` layers) change which nodes are ready when.
    forward_log, backward_log = [], []
    partitions, m = 4, 8
    layers, balance = [], []
    for p in range(partitions):
        block = [nn.Linear(8, 8), Tag(p, forward_log, backward_log), nn.Tanh()]
        block += [nn.Linear(8, 8) for _ in range(extra[p])]
        layers += block
        balance.append(len(block))
    model = nn.Sequential(*layers)
    x = torch.randn(m * 2, 8, requires_grad=requires_grad)
    with Pipe(model, balance, chunks=m, checkpoint=checkpoint) as pipe:
        for _ in range(3):
            forward_log.clear()
            backward_log.clear()
            pipe(x).sum().backward()
            for p in range(partitions):
                # First forward of each micro-batch (recomputes log again, later).
                order = []
                for part, mark in forward_log:
                    if part == p and mark not in order:
                        order.append(mark)
                backward = [mark for part, mark in backward_log if part == p]
                assert len(order) == m
                assert backward == list(reversed(order)), (p, backward, order)
