"""Micro-batches: split a mini-batch into chunks and put the outputs back together.

:class:`Batch` hides the difference between a single tensor and a tuple of values, so that
the runtime, copies and checkpointing handle both the same way. The batch is along dim 0
unless a :data:`BatchDim` says otherwise (a sequence-first model splits along dim 1), and a
tuple item may be passed whole to every micro-batch instead of being split (a shared mask).
Non-tensor values in a tuple are passed unchanged to every micro-batch. A namedtuple stays a namedtuple on its way
through the pipeline. Anything else between partitions (a list, a dict) is refused with a
TypeError rather than silently turned into a tuple of its items or keys.
"""
from __future__ import annotations

import copy

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "Batch", "BatchDim", "scatter", "gather", "rebuild", "why_not_gatherable", "TensorOrTensors", "batch_size",
    "samples", "check_batch_dim", "common_batch_dim", "check_joins", "nested_tensors",
    "nested_tensor_paths", "items_of", "map_nested", "NOT_A_BATCH",
]

TensorOrTensors = Union[Tensor, Tuple[Any, ...]]


NOT_A_BATCH = "a pipeline partition takes and returns a Tensor or a tuple (of tensors and other values)"


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
            raise TypeError(f"{NOT_A_BATCH}, got {type(values).__name__}")

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


def items_of(container: Any) -> Any:
    """(index or key, value) pairs of a tuple, list or dict."""
    return container.items() if isinstance(container, dict) else enumerate(container)


def nested_tensor_paths(values: Any, prefix: Tuple[Any, ...] = ()) -> Iterator[Tuple[Tuple[Any, ...], Tensor]]:
    """(path, tensor) for every tensor in ``values``, also inside nested tuples, lists and dicts.

    A path is the tensor's index in ``values``, then its indices or keys in the containers
    around it (``(1, 0)``: the first item of the second value, an LSTM's ``h_n``).
    """
    for key, value in items_of(values):
        if isinstance(value, Tensor):
            yield prefix + (key,), value
        elif isinstance(value, (tuple, list, dict)):
            yield from nested_tensor_paths(value, prefix + (key,))


def nested_tensors(values: Any) -> Iterator[Tensor]:
    """Every tensor in ``values``, also those inside nested tuples, lists and dicts."""
    return (tensor for _, tensor in nested_tensor_paths(values))


def rebuild(template: Tuple[Any, ...], items: Sequence[Any]) -> Tuple[Any, ...]:
    """``items`` as a tuple of ``template``'s kind.

    A namedtuple keeps its type and fields, and so does a struct sequence such as
    ``torch.return_types.max`` (what ``x.max(dim)`` returns: a later layer reads ``.values``)
    or any other tuple subclass built from one sequence or from the items one by one; one
    that is built otherwise becomes a tuple.
    """
    kind = type(template)
    if kind is tuple:
        return tuple(items)
    if hasattr(template, "_fields"):
        return kind(*items)
    items = tuple(items)
    # A struct sequence, or another subclass built like tuple itself, takes one sequence; a
    # subclass whose __new__ takes the items one by one would wrap that sequence as its only
    # item, so each guess counts only if it holds exactly the items, in order.
    for arguments in ((items,), items):
        try:
            rebuilt = kind(*arguments)
            if len(rebuilt) == len(items) and all(new is old for new, old in zip(rebuilt, items)):
                return rebuilt
        except Exception:  # noqa: BLE001 - not built this way: try the next, else a plain tuple
            pass
    return items


def map_nested(values: Any, function: Callable[[Tensor], Any]) -> Any:
    """``values`` with ``function`` applied to every tensor, also inside nested tuples, lists
    and dicts; other items kept.

    A container in which nothing changed is returned itself, not a copy: a later layer may
    append to a list it was handed, or compare it by identity. One that changed is rebuilt
    of its kind: a tuple as :func:`rebuild` does, a list or dict subclass as a shallow copy
    with the new items (a ``defaultdict`` keeps its factory, a ``Counter`` stays one).
    """
    if isinstance(values, Tensor):
        return function(values)
    if isinstance(values, (tuple, list)):
        items = [map_nested(value, function) for value in values]
        if all(new is old for new, old in zip(items, values)):
            return values
        if isinstance(values, tuple):
            return rebuild(values, items)
        return _copy_with(values, list(enumerate(items)), list)
    if isinstance(values, dict):
        pairs = [(key, map_nested(value, function)) for key, value in values.items()]
        if all(new is old for (_, new), old in zip(pairs, values.values())):
            return values
        return _copy_with(values, pairs, dict)
    return values


def _copy_with(container: Any, items: List[Tuple[Any, Any]], plain: type) -> Any:
    """A shallow copy of a list or dict ``container`` with ``items`` ((index or key, value)
    pairs) set in it; a subclass that cannot be copied that way gives a ``plain`` one."""
    if type(container) is not plain:
        try:
            copied = copy.copy(container)
            for key, value in items:
                copied[key] = value
            return copied
        except Exception:  # noqa: BLE001 - a subclass of its own making: the plain container
            pass
    return [value for _, value in items] if plain is list else dict(items)


BatchDim = Union[int, Tuple[Optional[int], ...]]
"""Where the batch is: one dim for every tensor, or one entry per item of a tuple (``None``:
the item is not split but passed whole to every micro-batch)."""


def check_batch_dim(value: Any, name: str = "batch_dim") -> BatchDim:
    """``value`` if it is a :data:`BatchDim`; TypeError naming ``name`` and the value otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, tuple) and value and all(
            v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in value):
        if all(v is None for v in value):
            raise ValueError(f"{name}={value!r} splits nothing: at least one item needs a batch dim (an int)")
        return value
    raise TypeError(f"{name} must be an int (the batch dim of every tensor) or a non-empty tuple with one int or None "
                    f"per item of the tuple (None: passed whole to every micro-batch); got {value!r}")


def common_batch_dim(spec: BatchDim) -> Optional[int]:
    """The one dim ``spec`` splits along, or None when its items disagree."""
    if isinstance(spec, int):
        return spec
    dims = {d for d in spec if d is not None}
    return dims.pop() if len(dims) == 1 else None


def _item_dims(value: TensorOrTensors, spec: BatchDim, name: str, what: str) -> List[Optional[int]]:
    """Per item of ``value`` (a tensor is one item): its batch dim, or None if it is passed whole."""
    if isinstance(value, Tensor):
        if isinstance(spec, tuple):
            if len(spec) != 1 or spec[0] is None:
                raise ValueError(f"{name}={spec!r} is for a tuple of {len(spec)} items, but the {what} is a "
                                 "single tensor")
            return [spec[0]]
        return [spec]
    if isinstance(spec, int):
        return [spec if isinstance(v, Tensor) else None for v in value]
    if len(spec) != len(value):
        raise ValueError(f"{name}={spec!r} has {len(spec)} entries, but the {what} tuple has {len(value)} items; "
                         "give one per item (None for an item passed whole to every micro-batch)")
    for i, (dim, item) in enumerate(zip(spec, value)):
        if dim is not None and not isinstance(item, Tensor):
            raise TypeError(f"{name}[{i}] is {dim}, but item {i} of the {what} is a {type(item).__name__}, not a "
                            f"tensor to split; use None to pass it whole to every micro-batch")
    return list(spec)


def batch_size(value: TensorOrTensors, spec: BatchDim = 0, name: str = "batch_dim", what: str = "input") -> int:
    """The samples in ``value`` along its batch dims; ValueError/TypeError naming what does not fit.

    Every tensor that is split must have a dim at its batch dim, and all of them the same
    size there: a shorter one would otherwise split into other micro-batches than the rest.
    """
    if type(spec) is int and isinstance(value, Tensor):  # the common case, read before every call
        ndim = value.dim()
        if ndim and -ndim <= spec < ndim:
            return value.size(spec)  # what the checks below find, without their lists; else they say why
    if not isinstance(value, (Tensor, tuple)):
        raise TypeError(f"expected a Tensor or a tuple of Tensors as {what}, got {type(value).__name__}")
    dims = _item_dims(value, spec, name, what)
    items = (value,) if isinstance(value, Tensor) else value
    split = [(i, t, d) for i, (t, d) in enumerate(zip(items, dims)) if d is not None]
    if not split:
        raise TypeError(f"the {what} tuple holds no Tensor to split into micro-batches")
    sizes = set()
    for i, tensor, dim in split:
        where = f"the {what} tensor" if isinstance(value, Tensor) else f"item {i} of the {what}"
        if tensor.dim() == 0:
            error = TypeError if isinstance(value, Tensor) else ValueError
            raise error(f"{where} has no batch dimension (0-dim tensor); expected one at dim {dim}")
        if not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(f"{name} {dim} is out of range for {where} of shape {tuple(tensor.shape)}")
        sizes.add(tensor.size(dim))
    if len(sizes) != 1:
        shapes = [f"{tuple(t.shape)} at dim {d}" for _, t, d in split]
        raise ValueError(f"every tensor of the {what} tuple needs the same batch size along its batch dim ({name}), "
                         f"got shapes {shapes}")
    return sizes.pop()


def scatter(input: TensorOrTensors, chunks: int, batch_dim: BatchDim = 0) -> List[Batch]:
    """Split ``input`` along its batch dims (``batch_dim``, dim 0 by default) into at most ``chunks`` micro-batches.

    Like ``Tensor.chunk``: a batch of 10 in 4 chunks gives 3, 3, 3 and 1; a batch of 2 in 4
    chunks gives 2 micro-batches. With ``chunks == 1`` the input itself is the micro-batch,
    so the un-pipelined arithmetic is reproduced bitwise. An item whose batch dim is None
    (and any non-tensor) goes whole to every micro-batch.
    """
    batch_size(input, batch_dim)
    if chunks == 1:
        return [Batch(input)]
    if not isinstance(input, Tensor) or input.is_nested or input.layout != torch.strided:
        _check_splittable(input, batch_dim, chunks)  # a plain tensor splits: no loop over its items
    if isinstance(input, Tensor):
        return [Batch(part) for part in input.chunk(chunks, batch_dim if isinstance(batch_dim, int) else batch_dim[0])]
    dims = _item_dims(input, batch_dim, "batch_dim", "input")
    pieces = [v.chunk(chunks, d) if d is not None else None for v, d in zip(input, dims)]
    count = min(len(p) for p in pieces if p is not None)
    return [Batch(rebuild(input, [p[i] if p is not None else v for p, v in zip(pieces, input)])) for i in range(count)]


def _check_splittable(input: TensorOrTensors, batch_dim: BatchDim, chunks: int) -> None:
    """ValueError naming a split item of a layout ``Tensor.chunk`` cannot cut along its batch
    dim (sparse, or a nested tensor other than a jagged one at dim 0), instead of torch's
    dispatcher dump from inside the split."""
    items = (input,) if isinstance(input, Tensor) else input
    for i, (item, dim) in enumerate(zip(items, _item_dims(input, batch_dim, "batch_dim", "input"))):
        if dim is None:
            continue
        jagged_at_0 = item.is_nested and item.layout == torch.jagged and dim % item.dim() == 0
        if item.layout == torch.strided and not item.is_nested or jagged_at_0:
            continue
        where = "the input" if isinstance(input, Tensor) else f"item {i} of the input"
        kind = f"a nested tensor of layout {item.layout}" if item.is_nested else f"a {item.layout} tensor"
        raise ValueError(f"chunks={chunks} splits {where} along dim {dim}, but it is {kind}, which cannot be split "
                         "there (only strided tensors, and jagged nested tensors at dim 0, can); convert it to a "
                         "strided one (e.g. .to_dense()), give it batch_dim None in a tuple to pass it whole to "
                         "every micro-batch, or use chunks=1")


def samples(batch: Batch, batch_dim: BatchDim = 0) -> int:
    """The samples in one micro-batch: the size of its first split tensor along its batch dim."""
    dims = _item_dims(batch.value, batch_dim, "batch_dim", "input")
    return next(v.size(d) for v, d in zip(batch.values, dims) if d is not None)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def why_not_gatherable(output: Batch, batch_dim: BatchDim = 0) -> Optional[str]:
    """Why micro-batch outputs shaped like ``output`` cannot be concatenated, or None.

    A 0-dim tensor (a per-micro-batch scalar) has no batch dimension, and a container
    holding tensors would keep only the first micro-batch's. ``batch_dim`` is the output's
    (:data:`BatchDim`); one that does not fit the output (out of range, an entry too many)
    is a ValueError (TypeError: an int entry for a non-tensor) raised here.
    """
    dims = _item_dims(output.value, batch_dim, "output_batch_dim", "output")
    for i, (value, dim) in enumerate(zip(output.values, dims)):
        if dim is not None and isinstance(value, Tensor) and value.is_nested:
            where = "the pipeline's output" if output.atomic else f"output {i} of the pipeline"
            return (f"{where} is a nested tensor ({value.layout}) per micro-batch, and torch cannot concatenate "
                    "nested tensors along their batch dim; return a padded one (e.g. .to_padded_tensor(0.0)) "
                    "from the last layer, or use chunks=1")
    if output.atomic:
        tensor, dim = output.tensor, dims[0]
        if tensor.dim() == 0:
            return ("the pipeline's output is a 0-dim tensor per micro-batch, which cannot be "
                    "concatenated into the mini-batch's output; return it with a batch dimension")
        if not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(f"output_batch_dim {dim} is out of range for the pipeline's output of shape "
                             f"{tuple(tensor.shape)}")
        return None
    for i, (value, dim) in enumerate(zip(output.values, dims)):
        if dim is None:
            if isinstance(batch_dim, tuple) or not _holds_tensor(value):
                continue  # passed on from the first micro-batch, by the caller's own spec
            return (f"output {i} of the pipeline is a {type(value).__name__} holding tensors; only tensors "
                    "at the top level of the output tuple are concatenated across micro-batches: return them "
                    "there, or give that item None in output_batch_dim (a tuple, one entry per item) to keep "
                    "the first micro-batch's")
        if value.dim() == 0:
            return (f"output {i} of the pipeline is a 0-dim tensor per micro-batch, which cannot be "
                    "concatenated into the mini-batch's output; return it with a batch dimension "
                    "(e.g. aux.reshape(1)), reduce it inside the model, or give it None in output_batch_dim "
                    "to keep the first micro-batch's")
        if not -value.dim() <= dim < value.dim():
            raise ValueError(f"output_batch_dim {dim} is out of range for output {i} of shape {tuple(value.shape)}")
    return None


_MIXED_OUTPUTS = ("the pipeline's output is a tensor in one micro-batch and a tuple in another: they cannot be "
                  "put together; return the same kind from every micro-batch")


def check_joins(output: Batch, batch_dim: BatchDim, first: Optional[Batch], samples: Optional[int] = None) -> None:
    """ValueError unless ``output`` can be concatenated after ``first`` along its batch dims
    (TypeError when one is a tensor and the other a tuple).

    ``gather`` takes each item's treatment from ``first``: a tensor item with a batch dim is
    concatenated, so ``output`` must have a tensor of the same rank and shape there but
    along that dim; anything else is taken from ``first``, whatever ``output`` holds there.
    With ``samples`` (an output batch dim that was not given but follows the input's) each
    concatenated item must hold that many samples along its batch dim: a pooled ``(N, C)``
    output following ``batch_dim=1`` would otherwise be concatenated along its classes,
    silently when the sizes allow it.
    """
    template = output if first is None else first
    if output.atomic != template.atomic:
        raise TypeError(_MIXED_OUTPUTS)
    dims = _item_dims(template.value, batch_dim, "output_batch_dim", "output")
    if len(output.values) != len(template.values):
        raise ValueError(f"the pipeline's output has {len(output.values)} items in one micro-batch and "
                         f"{len(template.values)} in another: they cannot be put together")
    for i, (reference, value, dim) in enumerate(zip(template.values, output.values, dims)):
        if dim is None or not isinstance(reference, Tensor):
            continue  # taken from the first micro-batch
        where = "the pipeline's output" if output.atomic else f"output {i} of the pipeline"
        if not isinstance(value, Tensor) or value.dim() != reference.dim() or value.dim() == 0:
            got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{where} is a tensor of shape {tuple(reference.shape)} in one micro-batch and {got} in "
                             f"another: they cannot be concatenated along dim {dim}")
        if not -value.dim() <= dim < value.dim():
            raise ValueError(f"output_batch_dim {dim} is out of range for {where} of shape {tuple(value.shape)}")
        if samples is not None and value.size(dim) != samples:
            raise ValueError(f"{where} has shape {tuple(value.shape)}: {value.size(dim)} along dim {dim}, where its "
                             f"micro-batch has {samples} samples; output_batch_dim follows batch_dim, which does not "
                             "fit this output: pass output_batch_dim= (0 for an output pooled over a sequence-first "
                             "input, None in a tuple for an item that is the same in every micro-batch)")
        axis = dim % value.dim()
        if any(a != b for k, (a, b) in enumerate(zip(reference.shape, value.shape)) if k != axis):
            raise ValueError(f"{where} has shape {tuple(value.shape)} in one micro-batch and "
                             f"{tuple(reference.shape)} in another: they differ outside dim {dim}, its "
                             "output_batch_dim, so they cannot be concatenated along it; is output_batch_dim right?")


def gather(outputs: Sequence[Batch], batch_dim: BatchDim = 0, samples: Optional[Sequence[int]] = None) -> TensorOrTensors:
    """Concatenate micro-batch outputs along their batch dims (dim 0 by default), in micro-batch order.

    Other values of an output tuple, and items whose batch dim is None, are taken from the
    first micro-batch. What cannot be put back together is refused with a TypeError naming
    its position (see :func:`why_not_gatherable`), or a ValueError for shapes that do not
    join (:func:`check_joins`; ``samples``: each micro-batch's, to check them against).
    """
    if len(outputs) == 1:
        return outputs[0].value
    first = outputs[0]
    if len({b.atomic for b in outputs}) > 1:
        raise TypeError(_MIXED_OUTPUTS)
    problem = why_not_gatherable(first, batch_dim)
    if problem is not None:
        raise TypeError(problem)
    if samples is not None:
        for output, size in zip(outputs, samples):
            check_joins(output, batch_dim, first, size)
    dims = _item_dims(first.value, batch_dim, "output_batch_dim", "output")
    try:
        if first.atomic:  # every output is (checked above): read without a property call each
            return torch.cat([b.values[0] for b in outputs], dims[0])
        gathered = [
            torch.cat([b.values[i] for b in outputs], dim) if dim is not None else value
            for i, (value, dim) in enumerate(zip(first.values, dims))
        ]
    except (RuntimeError, TypeError):  # torch.cat refused: name what does not join, if that is it
        for output in outputs:
            check_joins(output, batch_dim, first)
        raise
    return rebuild(first.values, gathered)
