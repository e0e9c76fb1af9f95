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
