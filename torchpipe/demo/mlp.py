"""Demo 1: a classifier trained with Pipe over 4 CPU partitions, GPipe and then 1F1B."""
from __future__ import annotations

import os

import torch
from torch import nn

from torchpipe import Pipe

from .progress import progress


def blobs(n: int, classes: int = 4, dim: int = 32, seed: int = 0) -> "tuple[torch.Tensor, torch.Tensor]":
    """Gaussian blobs: a synthetic classification task that a small MLP learns in seconds."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=generator) * 0.35  # overlapping: a task with some bite
    labels = torch.randint(0, classes, (n,), generator=generator)
    return centers[labels] + torch.randn(n, dim, generator=generator), labels


def run(out_dir: str, steps: int = 60) -> None:
    torch.manual_seed(0)
    x, y = blobs(4096)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 4),
    )
    loss_fn = nn.CrossEntropyLoss()
    with Pipe(model, balance=[2, 2, 3, 3], devices=["cpu"] * 4, chunks=8, checkpoint="except_last") as pipe:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
        print(f"model: {sum(p.numel() for p in pipe.parameters())} parameters, {pipe}")
        losses = []
        half = steps // 2
        for step in progress(half, "GPipe  pipe(x) + autograd"):
            batch = torch.randint(0, len(x), (256,))
            optimizer.zero_grad()
            loss = loss_fn(pipe(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            progress.postfix = f"loss {loss.item():.3f}"  # type: ignore[attr-defined]
        print("\nGPipe forward plan (autograd runs the backward):")
        print(pipe.plan(8, schedule="gpipe", backward=False).table())
        print(f"measured bubble of the last forward: {pipe.last_step.bubble_ratio:.2f}\n")
        for step in progress(steps - half, "1F1B   pipe.step(x, y)   "):
            batch = torch.randint(0, len(x), (256,))
            optimizer.zero_grad()
            loss = pipe.step(x[batch], y[batch], loss_fn, schedule="1f1b")
            optimizer.step()
            losses.append(loss.item())
            progress.postfix = f"loss {loss.item():.3f}"  # type: ignore[attr-defined]
        plan = pipe.plan(8, schedule="1f1b")
        print("\n1F1B plan, executed as printed (backward on the workers too):")
        print(plan.table())
        print(f"measured bubble {pipe.last_step.bubble_ratio:.2f} (simulated with unit costs: {plan.simulate().bubble_ratio:.2f});"
              f" peak micro-batches held per stage: {pipe.last_memory.peak_microbatches}")
        print(f"last step against its plan: {pipe.last_report()}")
        trace = os.path.join(out_dir, "mlp_1f1b_step.trace.json")
        pipe.last_step.save_chrome_trace(trace)
        pipe.eval()
        with torch.no_grad():
            accuracy = (pipe(x).argmax(1) == y).float().mean().item()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; accuracy {accuracy:.1%}; Chrome trace: {trace}")
    if not losses[-1] < losses[0]:
        raise SystemExit("the demo's loss did not fall")
