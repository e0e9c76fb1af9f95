"""TrainPipelineBase / TrainPipelineSparseDist: same training as the plain loop, step by step."""

from __future__ import annotations

import threading

import pytest
import torch
from train_helpers import build, drain, make_batches, make_tables, reference_run

from torchpipe.rec import RowWiseAdagrad
from torchpipe.train import TrainPipelineBase, TrainPipelineSparseDist

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind", ["base", "sparse_dist"])
def test_ready_pipeline_equals_plain_loop(kind: str) -> None:
    tables = make_tables()
    batches = make_batches(tables, 30, seed=4)
    model, opt = build(tables, None, RowWiseAdagrad(lr=0.5), cached=False)
    reference, _, ref_outputs = reference_run(tables, batches, RowWiseAdagrad(lr=0.5))
    seen = []

    def input_dist(batch):
        seen.append(threading.current_thread().name)
        return batch

    if kind == "base":
        pipe = TrainPipelineBase(model, opt, device_threads=1)
        depth = 2
    else:
        pipe = TrainPipelineSparseDist(model, opt, input_dist=input_dist, device_threads=1)
        depth = 3
    with pipe:
        assert pipe.pipeline.depth == depth
        outputs = drain(pipe, iter(batches))
        table = pipe.schedule_table(3)
    assert "h2d@copy" in table and "train@compute" in table
    assert len(outputs) == len(ref_outputs) == pipe.steps_done
    assert all(torch.equal(a[1], b[1]) for a, b in zip(outputs, ref_outputs))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    for layout in model.ebc.layouts:
        assert torch.equal(model.ebc.full_weight(layout.name), reference.ebc.full_weight(layout.name))
    if kind == "sparse_dist":
        assert set(seen) == {"torchpipe-train-host0"} and len(seen) == 30


@pytest.mark.parametrize("kind", ["base", "sparse_dist"])
def test_without_overlap_a_run_that_draws_repeats_the_step_by_step_loop(kind: str) -> None:
    """Review (helper-143): the guide's remedy for stages that draw random numbers,
    ``overlap=False``, was taken by EmbCacheTrainPipeline only: these two refused it."""
    torch.manual_seed(0)
    data = [torch.randn(8, 16) for _ in range(6)]

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)
            self.dropout = torch.nn.Dropout(0.5)

        def forward(self, batch):
            out = self.dropout(self.linear(batch))
            return out.pow(2).sum(), out.detach()

    def noisy(batch):
        return batch + torch.randn_like(batch) * 0.01

    def run(pipelined: bool):
        torch.manual_seed(1)
        model = Model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        torch.manual_seed(42)
        if not pipelined:  # the step-by-step loop: copy, input_dist, forward, backward, step
            outputs = []
            for batch in data:
                batch = batch if kind == "base" else noisy(batch)
                optimizer.zero_grad()
                loss, out = model(batch)
                loss.backward()
                optimizer.step()
                outputs.append(out)
            return outputs, model
        if kind == "base":
            pipe = TrainPipelineBase(model, optimizer, device_threads=1, overlap=False)
        else:
            pipe = TrainPipelineSparseDist(model, optimizer, input_dist=noisy, device_threads=1, overlap=False)
        with pipe:
            return drain(pipe, iter(data)), model

    expected, reference = run(pipelined=False)
    outputs, model = run(pipelined=True)
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        assert torch.equal(got, want)
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got, want)
