"""Straight calls into autograd's engine for the backward actions of ``Pipe.step``.

``torch.autograd.backward`` and ``torch.autograd.grad`` spend about half of a small call on
Python around the engine: normalising arguments, checking every gradient's shape against
its output, torch-function overrides. On the CI box a tiny call takes 77-89 us that way and
37-50 us straight into the engine (``docs/probes.sh``), and ``Pipe.step`` makes one to three
such calls per backward action. The gradients it passes are made by the pipeline itself to
match its outputs, and the engine still checks each one against the shapes and dtypes the
graph recorded, so the runtime calls the engine directly (the entry point Megatron-LM uses
for the same reason). Outputs and inputs may be
tensors or ``GradientEdge``\\ s, as for ``torch.autograd``.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["backward", "grad"]

_ENGINE: Any = getattr(torch.autograd.Variable, "_execution_engine", None)


def backward(outputs: Sequence[Any], grads: Sequence[Tensor], inputs: Optional[Sequence[Any]] = None, *,
             retain_graph: bool = False) -> None:
    """Accumulate into ``.grad`` of every leaf, or of ``inputs`` only; frees the graph unless retained."""
    if inputs is not None and len(inputs) == 0:  # the engine would read () as "every leaf"
        raise ValueError("inputs must name at least one tensor, or be None for every leaf")
    if _ENGINE is None:  # pragma: no cover - every torch we support has the engine binding
        torch.autograd.backward(list(outputs), list(grads), retain_graph=retain_graph,
                                inputs=None if inputs is None else list(inputs))
        return
    _ENGINE.run_backward(tuple(outputs), tuple(grads), retain_graph, False, tuple(inputs or ()), True, True)


def grad(outputs: Sequence[Any], inputs: Sequence[Any], grads: Sequence[Tensor], *,
         retain_graph: bool) -> Tuple[Optional[Tensor], ...]:
    """Gradients of ``outputs`` w.r.t. ``inputs`` (None where unused), without touching ``.grad``."""
    if _ENGINE is None:  # pragma: no cover
        return torch.autograd.grad(list(outputs), list(inputs), list(grads), retain_graph=retain_graph,
                                   allow_unused=True)
    return _ENGINE.run_backward(tuple(outputs), tuple(grads), retain_graph, False, tuple(inputs), True, False)
