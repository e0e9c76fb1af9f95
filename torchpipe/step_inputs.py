"""What ``Pipe.step`` is given, checked and split: the target, and each micro-batch's share of the loss.

``Pipe.step`` back-propagates every micro-batch's loss on its own, so it must weigh them so
that their sum is the loss of the whole mini-batch. With ``reduction='sum'`` each weighs 1.
With ``reduction='mean'`` the weight is the micro-batch's share of the loss's denominator:
its share of the samples for most losses, but for ``CrossEntropyLoss`` and ``NLLLoss`` (or
``F.cross_entropy``/``F.nll_loss`` given their settings in ``loss_kwargs`` or a partial's
keywords; compiled ones too) with class-index targets the denominator is the
(class-weighted) count of targets that are not ``ignore_index``, so padding in one
micro-batch must not skew the others.

An input or target that is itself the output of a graph built before the step (an encoder
run outside the pipeline) is cut from that graph for the step (:class:`Upstream`):
every micro-batch's backward would otherwise walk the shared upstream graph, and the second
one would find its buffers freed. The step's gradients for it are summed on a stand-in
leaf and sent upstream once, after the step, as one ``loss.backward()`` would.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .microbatch import Batch, BatchDim, batch_size, rebuild, samples, scatter
from .module_reads import optional_attribute

__all__ = ["split_targets", "microbatch_weights", "Upstream", "scalar_loss", "loss_settings"]


class Upstream:
    """The step's inputs and targets that carry a graph from before the step, and their stand-ins."""

    def __init__(self) -> None:
        self._leaves: Dict[int, Tuple[Tensor, Tensor]] = {}  # id(original) -> (original, stand-in leaf)

    def cut(self, value: Any) -> Any:
        """``value`` (a tensor, or tuples, lists and dicts of them) with each non-leaf tensor that
        requires grad replaced by a leaf of the same data; the same tensor twice gets one leaf,
        so its gradients add up."""
        if isinstance(value, Tensor):
            return self._cut_one(value)
        if isinstance(value, tuple):
            return rebuild(value, [self.cut(v) for v in value])
        if isinstance(value, list):
            return [self.cut(v) for v in value]
        if isinstance(value, dict):
            return {key: self.cut(v) for key, v in value.items()}
        return value

    def _cut_one(self, tensor: Tensor) -> Tensor:
        if not tensor.requires_grad or tensor.grad_fn is None:
            return tensor
        known = self._leaves.get(id(tensor))
        if known is None:
            known = self._leaves[id(tensor)] = (tensor, tensor.detach().requires_grad_(True))
        return known[1]

    def backward(self) -> None:
        """Send what the step accumulated on the stand-ins into the graph before the step, once."""
        pairs = [(original, leaf.grad) for original, leaf in self._leaves.values() if leaf.grad is not None]
        self._leaves.clear()
        if pairs:
            torch.autograd.backward([original for original, _ in pairs], [grad for _, grad in pairs])


def split_targets(target: Any, size: int, num_microbatches: int, chunks: int, batch_dim: BatchDim = 0) -> List[Any]:
    """``target`` split like the input; ValueError/TypeError, naming the target, if it cannot be.

    Every tensor split from the target must have the input's batch size along its batch dim
    (``batch_dim``, :data:`~torchpipe.microbatch.BatchDim`): a shorter one would otherwise
    split into the same number of micro-batches and broadcast silently. ``None`` (a model
    whose last stage computes its own loss) is passed to every micro-batch's ``loss_fn`` as it is.
    """
    if target is None:
        return [None] * num_microbatches
    along = f"dim {batch_dim}" if isinstance(batch_dim, int) else f"target_batch_dim={batch_dim!r}"
    if not isinstance(target, (Tensor, tuple)):
        raise TypeError(f"target must be a tensor, a tuple of tensors (split along {along} like the input) or None; "
                        f"got {type(target).__name__}")
    if isinstance(target, tuple) and not any(isinstance(v, Tensor) for v in target):
        nested = sorted({f"{type(v).__name__}s" for v in target if isinstance(v, (tuple, list, dict))})
        why = (f" at its top level (it holds {' and '.join(nested)}, which are not looked into: put the tensors "
               "in the tuple itself)" if nested else "")
        raise TypeError(f"target is a tuple without tensors{why}: it needs one to split along {along} like the input")
    if isinstance(target, Tensor) and target.dim() == 0:
        raise ValueError(f"target has no batch dimension (a 0-dim tensor); it must split along {along} like the "
                         f"input of {size} samples")
    target_size = batch_size(target, batch_dim, "target_batch_dim", "target")
    if target_size != size:
        raise ValueError(f"target has {target_size} samples along {along} but the input has {size}; they must match")
    targets = [b.value for b in scatter(target, chunks, batch_dim)]
    if len(targets) != num_microbatches:  # pragma: no cover - equal sizes split alike
        raise ValueError(f"target split into {len(targets)} micro-batches, the input into {num_microbatches}")
    return targets


_UNWRAP_DEPTH = 16  # a compiled partial of a compiled module, say; a cycle stops here


def loss_settings(loss_fn: Any, loss_kwargs: Optional[Dict[str, Any]]) -> Tuple[Any, Dict[str, Any]]:
    """The loss ``loss_fn`` computes and the keywords it gets: wrappers that keep a loss's
    arithmetic are looked through.

    ``torch.compile`` of a loss module or function, and ``functools.partial`` with keywords
    only (``partial(F.cross_entropy, reduction='sum')``), hide the reduction and the
    ``ignore_index`` that weigh the micro-batches: read through the wrapper, a sum is not
    taken for a mean, nor padding for samples. A partial's keywords come first, then
    ``loss_kwargs`` (given at the call, as ``partial`` itself merges them).
    """
    keywords = dict(loss_kwargs or {})
    for _ in range(_UNWRAP_DEPTH):
        if isinstance(loss_fn, functools.partial) and not loss_fn.args:
            keywords = {**loss_fn.keywords, **keywords}
            loss_fn = loss_fn.func
        elif isinstance(optional_attribute(loss_fn, "_orig_mod"), nn.Module):  # torch.compile(module)
            loss_fn = loss_fn._orig_mod
        elif callable(optional_attribute(loss_fn, "_torchdynamo_orig_callable")):  # torch.compile(function)
            loss_fn = loss_fn._torchdynamo_orig_callable
        elif _dynamo_frame_wrapper(loss_fn):  # what torch.compile put around a torch function or a partial
            loss_fn = loss_fn.__wrapped__
        elif _bound_forward(loss_fn):  # loss.forward or loss.__call__ (a compiled module compiled again, say)
            loss_fn = loss_fn.__self__
        else:
            break
    return loss_fn, keywords


def _dynamo_frame_wrapper(fn: Any) -> bool:
    """Whether ``fn`` is the pass-through frame ``torch.compile`` wraps some callables in
    (``torch._dynamo.external_utils.wrap_inline``): it calls ``fn.__wrapped__`` as it is."""
    code = optional_attribute(fn, "__code__")
    return (code is not None and hasattr(fn, "__wrapped__") and code.co_name == "inner"
            and code.co_filename.endswith(os.path.join("_dynamo", "external_utils.py")))


def _bound_forward(fn: Any) -> bool:
    """Whether ``fn`` is a module's own ``forward`` or ``__call__``, bound to it (``loss.forward``,
    ``loss.__call__``): what the module computes when called, hooks aside for ``forward``."""
    if not (inspect.ismethod(fn) and isinstance(fn.__self__, nn.Module)):
        return False
    own = type(fn.__self__)
    return getattr(fn, "__func__", None) in (getattr(own, "forward", None), getattr(own, "__call__", None))


_COUNTING_FORWARDS = (nn.CrossEntropyLoss.forward, nn.NLLLoss.forward)


def _counted_targets(loss_fn: Any, loss_kwargs: Optional[Dict[str, Any]]) -> Optional[Tuple[int, Optional[Tensor]]]:
    """``(ignore_index, class weights)`` when ``loss_fn`` averages over its (class-weighted,
    non-ignored) class-index targets, or None: a module's own settings, or those the
    functional form gets through ``loss_kwargs`` (or a partial's keywords)."""
    loss_fn, loss_kwargs = loss_settings(loss_fn, loss_kwargs)
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and type(loss_fn).forward in _COUNTING_FORWARDS:
        # A subclass with a forward of its own (shifted labels, an added term) averages over
        # what it chooses: weighed as any other callable.
        return loss_fn.ignore_index, loss_fn.weight
    if loss_fn is F.cross_entropy or loss_fn is F.nll_loss:
        given = loss_kwargs or {}
        return given.get("ignore_index", -100), given.get("weight")
    return None


def _target_weight(ignore_index: int, weight: Optional[Tensor], target: Tensor) -> float:
    """The denominator a class-index loss uses for ``target`` under ``reduction='mean'``."""
    target = target.long()  # torch takes uint8 class indices too; indexing with them would mask
    kept = target != ignore_index
    if weight is None:
        return float(kept.sum())
    classes = torch.where(kept, target, torch.zeros_like(target))
    weights = weight.to(target.device)[classes]
    return float((weights * kept).sum())


def microbatch_weights(loss_fn: Any, reduction: str, batches: Sequence[Batch], targets: Sequence[Any],
                       batch_dim: BatchDim = 0, loss_kwargs: Optional[Dict[str, Any]] = None) -> List[float]:
    """Per micro-batch, the factor its loss is scaled by so that the weighted sum is the whole loss.

    ``batch_dim`` is the input's: a micro-batch's samples are counted along it."""
    if reduction == "sum":
        return [1.0] * len(batches)
    first_target = targets[0]
    counted = _counted_targets(loss_fn, loss_kwargs)
    if counted is not None and isinstance(first_target, Tensor) and not first_target.is_floating_point():
        shares = [_target_weight(*counted, t) for t in targets]
    else:
        shares = [float(samples(b, batch_dim)) for b in batches]
    total = sum(shares)
    if total == 0:  # every target ignored: the loss is NaN and no gradient flows, as unpipelined
        return [0.0] * len(batches)
    return [share / total for share in shares]


def scalar_loss(loss: Any, *, backward: bool = True) -> Tensor:
    """A micro-batch's loss as a 0-dim tensor; TypeError if ``loss_fn`` returned anything else.

    A one-element loss of another shape (``(1,)``) is taken too, as ``loss.backward()`` takes it;
    a complex one only where no backward starts from it (``backward=False``).
    """
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, Tensor) else ""
        raise TypeError(f"loss_fn must return a scalar tensor (one element), got {type(loss).__name__} {shape}")
    if backward and loss.is_complex():  # loss.backward() refuses one too: its implicit gradient is real
        raise TypeError(f"loss_fn must return a real loss, got a {loss.dtype} one ({loss.detach().item()!r}): "
                        "backward starts from a real scalar, as loss.backward() does; take its .real or .abs()")
    return loss if loss.dim() == 0 else loss.reshape(())
