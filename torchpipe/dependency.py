"""Autograd-only dependencies between micro-batches.

GPipe's forward pushes micro-batch ``i + 1`` through a partition after micro-batch ``i``. For
backward to run per partition in the reverse order (``i + 1`` before ``i``), the input of
micro-batch ``i + 1`` is *joined* with the output of micro-batch ``i``: the join node passes
gradients through unchanged, but autograd cannot run the backward of micro-batch ``i``'s
partition before the join, i.e. before micro-batch ``i + 1``'s backward has reached the
partition's input. This is torchgpipe's fork/join in one node: the output of micro-batch
``i`` needs no fork, because the join's edge into its graph already counts as a dependency.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["join", "first_grad_tensor"]


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor, after: Tensor) -> Tensor:  # type: ignore[override]
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def join(input: Tensor, after: Tensor) -> Tensor:
    """An alias of ``input`` whose backward must finish before ``after``'s producer runs backward."""
    return _Join.apply(input, after)


def first_grad_tensor(values: Tuple[Any, ...]) -> Optional[Tensor]:
    """The first tensor in ``values`` that autograd tracks, if any."""
    for value in values:
        if isinstance(value, Tensor) and value.grad_fn is not None:
            return value
    return None
