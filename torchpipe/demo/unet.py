"""Demo 2: a small U-Net-like model with skips and batch norm, balanced automatically."""
from __future__ import annotations

import torch
from torch import nn

from torchpipe import Pipe
from torchpipe.balance import balance_by_time
from torchpipe.skip import Namespace, pop, skippable, stash

from .progress import progress


@skippable(stash=["skip"])
class Down(nn.Module):
    """Conv + BN + ReLU, downsample; stashes its input for the matching Up block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
        self.pool = nn.AvgPool2d(2)

    def forward(self, x):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        return self.pool(self.block(x))


@skippable(pop=["skip"])
class Up(nn.Module):
    """Upsample + conv; adds the skip stashed by the matching Down block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.up = nn.Upsample(scale_factor=2)
        self.block = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())

    def forward(self, x):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return self.block(self.up(x)) + skip


def unet(channels: int = 8, levels: int = 3) -> nn.Sequential:
    namespaces = [Namespace() for _ in range(levels)]
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1),
        *[Down(channels).isolate(ns) for ns in namespaces],
        nn.Conv2d(channels, channels, 3, padding=1),
        *[Up(channels).isolate(ns) for ns in reversed(namespaces)],
        nn.Conv2d(channels, 1, 1),
    )


def run(steps: int = 20) -> None:
    torch.manual_seed(0)
    model = unet()
    images = torch.rand(64, 1, 16, 16)
    targets = images.flip(-1)  # learn to mirror the image: needs the skips to be sharp
    balance = balance_by_time(4, model, images[:8], timeout=0.5)
    print(f"\nU-Net with {len(model)} layers; balance_by_time -> {balance}")
    with Pipe(model, balance, devices=["cpu"] * len(balance), chunks=4, checkpoint="except_last",
              deferred_batch_norm=True) as pipe:
        optimizer = torch.optim.Adam(pipe.parameters(), lr=3e-3)
        first = last = None
        for _ in progress(steps, "U-Net  pipe.step(zb-h1)   "):
            optimizer.zero_grad()
            loss = pipe.step(images, targets, nn.MSELoss(), schedule="zb-h1")
            optimizer.step()
            first = loss.item() if first is None else first
            last = loss.item()
            progress.postfix = f"loss {last:.4f}"  # type: ignore[attr-defined]
    print(f"U-Net loss {first:.4f} -> {last:.4f} (skips crossed partitions through the step's store; "
          "BatchNorm statistics tracked over whole mini-batches)")
