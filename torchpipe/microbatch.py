"""Micro-batches: split a mini-batch into chunks and put the outputs back together.

:class:`Batch` hides the difference between a single tensor and a tuple of values, so that
the runtime, copies and checkpointing handle both the same way. Non-tensor values in a tuple
are passed unchanged to every micro-batch. A namedtuple stays a namedtuple on its way
through the pipeline. Anything else between partitions (a list, a dict) is refused with a
TypeError rather than silently turned into a tuple of its items or keys.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["Batch", "scatter", "gather", "rebuild", "why_not_gatherable", "TensorOrTensors"]

TensorOrTensors = Union[Tensor, Tuple[Any, ...]]


class Batch:
    """One micro-batch: either a single tensor (``atomic``) or a tuple of values."""

    __slots__ = ("values", "atomic")

    def __init__(self, values: TensorOrTensors) -> None:
        self.atomic = isinstance(values, Tensor)
        if self.atomic:
            self.values: Tuple[Any, ...] = (values,)
        elif isinstance(values, tuple):
            self.values = values
        else:
            raise TypeError(
                "a pipeline partition takes and returns a Tensor or a tuple (of tensors and other "
                f"values), got {type(values).__name__}"
            )

    @property
    def value(self) -> TensorOrTensors:
        """The tensor, or the tuple, as the partition receives and returns it."""
        return self.values[0] if self.atomic else self.values

    @property
    def tensor(self) -> Tensor:
        if not self.atomic:
            raise AttributeError("not an atomic batch: it holds a tuple")
        return self.values[0]

    def tensors(self) -> Iterator[Tensor]:
        return (v for v in self.values if isinstance(v, Tensor))

    def call(self, function: Callable[..., Any]) -> "Batch":
        """Apply ``function`` to the value and wrap what it returns."""
        return Batch(function(self.value))

    def map_tensors(self, function: Callable[[Tensor], Tensor]) -> "Batch":
        mapped = [function(v) if isinstance(v, Tensor) else v for v in self.values]
        return Batch(mapped[0] if self.atomic else rebuild(self.values, mapped))

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.values)

    def __getitem__(self, index: int) -> Any:
        return self.values[index]

    def __repr__(self) -> str:
        return f"Batch[atomic={self.atomic}]({self.values!r})"


def rebuild(template: Tuple[Any, ...], items: Sequence[Any]) -> Tuple[Any, ...]:
    """``items`` as a tuple of ``template``'s kind: a namedtuple keeps its type and fields."""
    if type(template) is not tuple and hasattr(template, "_fields"):
        return type(template)(*items)
    return tuple(items)


def _check_input(input: TensorOrTensors) -> None:
    if isinstance(input, Tensor):
        if input.dim() == 0:
            raise TypeError("the input tensor has no batch dimension (0-dim tensor); expected shape (N, ...)")
        return
    if not isinstance(input, tuple):
        raise TypeError(f"expected a Tensor or a tuple of Tensors as input, got {type(input).__name__}")
    tensors = [v for v in input if isinstance(v, Tensor)]
    if not tensors:
        raise TypeError("the input tuple holds no Tensor to split into micro-batches")
    sizes = {t.size(0) if t.dim() else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"every tensor of the input tuple needs the same batch size in dim 0, got shapes {shapes}")


def scatter(input: TensorOrTensors, chunks: int) -> List[Batch]:
    """Split ``input`` along dim 0 into at most ``chunks`` micro-batches.

    Like ``Tensor.chunk``: a batch of 10 in 4 chunks gives 3, 3, 3 and 1; a batch of 2 in 4
    chunks gives 2 micro-batches. With ``chunks == 1`` the input itself is the micro-batch,
    so the un-pipelined arithmetic is reproduced bitwise.
    """
    _check_input(input)
    if chunks == 1:
        return [Batch(input)]
    if isinstance(input, Tensor):
        return [Batch(part) for part in input.chunk(chunks)]
    pieces = [v.chunk(chunks) if isinstance(v, Tensor) else None for v in input]
    count = min(len(p) for p in pieces if p is not None)
    return [Batch(rebuild(input, [p[i] if p is not None else v for p, v in zip(pieces, input)])) for i in range(count)]


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def why_not_gatherable(output: Batch) -> Optional[str]:
    """Why micro-batch outputs shaped like ``output`` cannot be concatenated, or None.

    A 0-dim tensor (a per-micro-batch scalar) has no batch dimension, and a container
    holding tensors would keep only the first micro-batch's.
    """
    if output.atomic:
        if output.tensor.dim() == 0:
            return ("the pipeline's output is a 0-dim tensor per micro-batch, which cannot be "
                    "concatenated into the mini-batch's output; return it with a batch dimension")
        return None
    for i, value in enumerate(output.values):
        if isinstance(value, Tensor):
            if value.dim() == 0:
                return (f"output {i} of the pipeline is a 0-dim tensor per micro-batch, which cannot be "
                        "concatenated into the mini-batch's output; return it with a batch dimension "
                        "(e.g. aux.reshape(1)) or reduce it inside the model")
        elif _holds_tensor(value):
            return (f"output {i} of the pipeline is a {type(value).__name__} holding tensors; only tensors "
                    "at the top level of the output tuple are concatenated across micro-batches")
    return None


def gather(outputs: Sequence[Batch]) -> TensorOrTensors:
    """Concatenate micro-batch outputs along dim 0, in micro-batch order.

    Other values of an output tuple are taken from the first micro-batch, as they were
    passed in. What cannot be put back together is refused with a TypeError naming its
    position (see :func:`why_not_gatherable`).
    """
    if len(outputs) == 1:
        return outputs[0].value
    first = outputs[0]
    problem = why_not_gatherable(first)
    if problem is not None:
        raise TypeError(problem)
    if first.atomic:
        return torch.cat([b.tensor for b in outputs])
    gathered = [
        torch.cat([b.values[i] for b in outputs]) if isinstance(value, Tensor) else value
        for i, value in enumerate(first.values)
    ]
    return rebuild(first.values, gathered)
