"""Batch norm whose running statistics follow the mini-batch, not each micro-batch.

A pipeline splits a mini-batch into micro-batches. A plain ``BatchNorm`` would update its
running statistics once per micro-batch with that micro-batch's statistics, so after
training the running statistics differ from those of the un-pipelined model.
:class:`DeferredBatchNorm` normalises each micro-batch with its own statistics in training
(as any pipeline must: the forward of micro-batch 0 cannot wait for micro-batch 7), but
accumulates the statistics of all micro-batches of a mini-batch and updates
``running_mean``, ``running_var`` and ``num_batches_tracked`` once, with the statistics of
the whole mini-batch -- exactly what a plain batch norm run on the whole batch does.

Per step, the pipe calls :func:`set_microbatches` with the number of micro-batches the
mini-batch was actually split into (a batch smaller than ``chunks`` gives fewer), so that the
update happens after the last one. Forwards under checkpoint recomputation are not counted.

Threading: a layer belongs to one partition, whose micro-batches run one after another on one
worker thread (recomputation, on the autograd thread, does not touch the accumulators), so
the accumulators need no lock.
"""
from __future__ import annotations

import inspect
import weakref
from numbers import Real
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Type, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from torchpipe.checkpoint import is_recomputing
from torchpipe.checks import check_positive_int

__all__ = ["DeferredBatchNorm", "DeferredBatchNorm1d", "DeferredBatchNorm2d", "DeferredBatchNorm3d",
           "set_microbatches", "undo_commits", "commit_marks", "undo_marked_commits", "statistics_updating_norms",
           "running_statistics_frozen", "converts", "unconvertible_norm"]

TModule = TypeVar("TModule", bound=nn.Module)

# Input ranks each plain batch norm accepts; a converted layer keeps its source's check.
# torch 2.13 added ``bias=`` to batch norm; older versions always have a bias when affine.
_BATCH_NORM_HAS_BIAS = "bias" in inspect.signature(_BatchNorm.__init__).parameters

_INPUT_DIMS: Dict[Type[_BatchNorm], Tuple[int, ...]] = {
    nn.BatchNorm1d: (2, 3),
    nn.BatchNorm2d: (4,),
    nn.BatchNorm3d: (5,),
}



def _moving_average(running: Tensor, batch: Tensor, factor: float) -> Tensor:
    """``running = (1 - factor) * running + factor * batch``, as torch's kernel updates a running
    statistic: in float32 (float64 for float64 buffers) and rounded to a half-precision
    buffer once, where two in-place ops on it would round twice."""
    if running.dtype in (torch.float32, torch.float64):
        return running.mul_(1 - factor).add_(batch.to(running.dtype), alpha=factor)
    updated = running.float().mul_(1 - factor).add_(batch.float(), alpha=factor)
    return running.copy_(updated)

class DeferredBatchNorm(_BatchNorm):
    """Batch norm that updates its running statistics once per mini-batch of micro-batches.

    Training forward: normalise the micro-batch with its own mean and biased variance (same
    output and gradients as a plain batch norm on that micro-batch), and, unless recomputing
    for a checkpoint, merge its count, mean and sum of squared deviations into the pending
    mini-batch statistics. After ``microbatches`` micro-batches the pending statistics are
    committed exactly as ``_BatchNorm`` would commit those of the whole batch: unbiased
    variance with the whole-batch count, ``momentum`` as the exponential factor, or the
    cumulative average ``1 / num_batches_tracked`` when ``momentum`` is ``None``.

    Statistics are merged with Chan et al.'s pairwise update (count, mean, M2) in at least
    float32, which is the sum / sum-of-squares accumulation without its cancellation error.

    Eval forward: the running statistics, as usual. ``state_dict`` keys are those of
    ``nn.BatchNorm*d``; the pending statistics are transient and not saved.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, chunks: int = 1, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None, *, bias: bool = True) -> None:
        if _BATCH_NORM_HAS_BIAS:
            extra = {"bias": bias}
        elif affine and not bias:
            raise ValueError(f"bias=False needs torch >= 2.13's batch norm; torch {torch.__version__} has no such option")
        else:
            extra = {}
        if momentum is not None and (isinstance(momentum, bool) or not isinstance(momentum, Real)):
            raise TypeError(f"momentum must be a float or None (cumulative average), got {momentum!r}")
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True,
                         device=device, dtype=dtype, **extra)
        chunks = _check_microbatches(chunks)
        self.chunks = chunks
        self.microbatches = chunks
        self.input_dims: Optional[Tuple[int, ...]] = None
        self._reset_pending()
        self._before_commit: Optional[Tuple[Tensor, Tensor, Tensor]] = None  # see undo_commits
        self._commits = 0  # commits so far (and undos): see commit_marks

    # -- per-step API -------------------------------------------------------------------

    def set_microbatches(self, microbatches: int) -> None:
        """Commit after ``microbatches`` micro-batches from now on; drop pending statistics.

        Why drop: the pipe calls this before each step, and statistics left pending by a step
        that failed halfway must not leak into the next one.
        """
        self.microbatches = _check_microbatches(microbatches)
        self._reset_pending()
        self._before_commit = None

    # -- nn.Module ----------------------------------------------------------------------

    def _check_input_dim(self, input: Tensor) -> None:
        if self.input_dims is not None:
            if input.dim() not in self.input_dims:
                expected = " or ".join(f"{d}D" for d in self.input_dims)
                raise ValueError(f"expected {expected} input (got {input.dim()}D input)")
        elif input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, training=False, momentum=0.0, eps=self.eps)
        # Normalise first: it rejects a micro-batch with one value per channel before that
        # micro-batch could corrupt the pending statistics.
        output = F.batch_norm(input, None, None, self.weight, self.bias, training=True,
                              momentum=0.0, eps=self.eps)
        if self.track_running_stats:  # turned off (frozen statistics), a plain batch norm updates nothing
            self._track(input)
        return output

    @torch.compiler.disable
    def _track(self, input: Tensor) -> None:
        """Count the micro-batch toward the pending statistics; commit after the last one.

        Kept out of ``torch.compile``: traced, the pending counters would become guards, so a
        compiled layer would compile anew for every micro-batch of a step, and past the
        recompile limit a checkpointed micro-batch's forward and its recompute would run
        different code (torch's checkpoint then refuses the recompute). Out of the graph,
        forward and recompute compile to the same normalisation.
        """
        if not is_recomputing():
            self._accumulate(input)
            if self._pending_microbatches >= self.microbatches:
                self._commit()

    # -- statistics ---------------------------------------------------------------------

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        # torchgpipe's and fairscale's DeferredBatchNorm save their per-step accumulators as
        # buffers; ours are transient. Their state dicts must still load with strict=True.
        for transient in ("sum", "sum_squares"):
            state_dict.pop(prefix + transient, None)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _reset_pending(self) -> None:
        self._pending_microbatches = 0
        self._pending_count = 0
        self._pending_mean: Optional[Tensor] = None
        self._pending_m2: Optional[Tensor] = None

    def _accumulate(self, input: Tensor) -> None:
        """Merge one micro-batch's (count, mean, M2) into the pending mini-batch statistics."""
        reduce_dims = [0, *range(2, input.dim())]
        count = input.numel() // input.size(1)
        with torch.no_grad():
            values = input.detach()
            if values.dtype != torch.float64:
                values = values.float()
            variance, mean = torch.var_mean(values, dim=reduce_dims, correction=0)
            m2 = variance * count
            if self._pending_mean is None or self._pending_m2 is None:
                self._pending_mean, self._pending_m2 = mean, m2
            else:
                total = self._pending_count + count
                delta = mean - self._pending_mean
                self._pending_mean = self._pending_mean + delta * (count / total)
                self._pending_m2 = (self._pending_m2 + m2
                                    + delta * delta * (self._pending_count * count / total))
        self._pending_count += count
        self._pending_microbatches += 1

    def _commit(self) -> None:
        """Update the running statistics with the pending mini-batch, as ``_BatchNorm`` does."""
        assert self._pending_mean is not None and self._pending_m2 is not None
        count = self._pending_count  # > 1: F.batch_norm refused smaller micro-batches
        with torch.no_grad():
            # What undo_commits puts back if the step this commit belongs to fails.
            self._before_commit = (self.running_mean.clone(), self.running_var.clone(),
                                   self.num_batches_tracked.clone())
            self._commits = getattr(self, "_commits", 0) + 1  # (a layer unpickled from before it counted)
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
            unbiased_var = self._pending_m2 / (count - 1)
            _moving_average(self.running_mean, self._pending_mean, factor)
            _moving_average(self.running_var, unbiased_var, factor)
        self._reset_pending()

    # -- conversion ---------------------------------------------------------------------

    @classmethod
    def convert_deferred_batch_norm(cls, module: TModule, chunks: int = 1) -> TModule:
        """Return ``module`` with every batch norm that tracks running statistics made deferred.

        Nested ``BatchNorm1d/2d/3d`` (any ``_BatchNorm`` that tracks running statistics) are
        replaced in place in their parents, in every slot that holds one; a batch norm passed
        directly is returned replaced. The replacement keeps the SAME ``Parameter`` objects
        (``weight``, ``bias``) and the same buffer tensors, so an optimizer built before the
        conversion still updates the converted model, and its ``training`` flag; it follows
        ``track_running_stats`` as a plain batch norm does (turned off, the statistics stay as
        they are). An existing ``DeferredBatchNorm`` is kept and its ``chunks`` updated.
        """
        chunks = _check_microbatches(chunks)
        if not isinstance(module, nn.Module):
            raise TypeError(f"convert_deferred_batch_norm takes an nn.Module, got {module!r}")
        # Refuse before replacing anything: a failure halfway would leave a half-converted model.
        refused = unconvertible_norm(module)
        if refused is not None:
            name, norm, why = refused
            state = "uninitialized " if isinstance(norm, LazyModuleMixin) else ""
            raise ValueError(f"cannot convert the {state}{type(norm).__name__} {name or 'module'!r}: {why}")
        return cls._convert(module, chunks, {})

    @classmethod
    def _convert(cls, module: TModule, chunks: int, done: Dict[int, nn.Module]) -> TModule:
        """``module`` converted; ``done`` maps the modules met so far to what they became, so a
        batch norm held in two slots (``self.a = self.b = norm``) is one deferred layer in both."""
        converted = done.get(id(module))
        if converted is not None:
            return cast(TModule, converted)
        if converts(module):
            done[id(module)] = replacement = cls._from_batch_norm(module, chunks)
            return cast(TModule, replacement)
        done[id(module)] = module  # before the children: a module that holds itself ends here
        if isinstance(module, DeferredBatchNorm):
            module.chunks = chunks
            module.set_microbatches(chunks)
        for name, child in list(module._modules.items()):  # every slot: named_children() skips repeats
            if child is not None:
                replaced = cls._convert(child, chunks, done)
                if replaced is not child:
                    setattr(module, name, replaced)
        return module

    @classmethod
    def _from_batch_norm(cls, source: _BatchNorm, chunks: int) -> "DeferredBatchNorm":
        assert source.running_mean is not None
        # Built on "meta" (no memory): every tensor is replaced by the source's own below.
        kind = next((kind for kind in _INPUT_DIMS if isinstance(source, kind)), None)
        # Called on DeferredBatchNorm or one of its per-kind classes: the source's kind decides.
        plain = cls is DeferredBatchNorm or cls in _DEFERRED_KIND.values()
        made = (_DEFERRED_KIND[kind] if kind is not None else DeferredBatchNorm) if plain else cls
        deferred = made(source.num_features, source.eps, source.momentum, source.affine, chunks,
                        device=torch.device("meta"), dtype=source.running_mean.dtype,
                        bias=source.bias is not None)
        if source.affine:
            deferred.weight = source.weight
            deferred.bias = source.bias
        deferred.running_mean = source.running_mean
        deferred.running_var = source.running_var
        deferred.num_batches_tracked = source.num_batches_tracked
        deferred.input_dims = _INPUT_DIMS[kind] if kind is not None else None
        deferred.train(source.training)
        # The very hook dicts, not copies: the user's handles (``handle.remove()``) still work.
        for hooks in _CARRIED_HOOKS:
            setattr(deferred, hooks, getattr(source, hooks))
        for hook in deferred._load_state_dict_pre_hooks.values():
            # A public load_state_dict pre-hook holds its module (weakly), to call it with:
            # from now on the deferred layer (the source is gone once replaced).
            if getattr(hook, "with_module", False) and hook.module() is source:
                hook.module = weakref.ref(deferred)
        return deferred


class DeferredBatchNorm1d(DeferredBatchNorm, nn.BatchNorm1d):
    """A converted ``nn.BatchNorm1d``, still an instance of it: code that picks layers by
    ``isinstance`` (no weight decay on norms) finds it after the conversion too."""


class DeferredBatchNorm2d(DeferredBatchNorm, nn.BatchNorm2d):
    """A converted ``nn.BatchNorm2d``, still an instance of it (see :class:`DeferredBatchNorm1d`)."""


class DeferredBatchNorm3d(DeferredBatchNorm, nn.BatchNorm3d):
    """A converted ``nn.BatchNorm3d``, still an instance of it (see :class:`DeferredBatchNorm1d`)."""


_DEFERRED_KIND: Dict[Type[_BatchNorm], Type[DeferredBatchNorm]] = {
    nn.BatchNorm1d: DeferredBatchNorm1d,
    nn.BatchNorm2d: DeferredBatchNorm2d,
    nn.BatchNorm3d: DeferredBatchNorm3d,
}


def converts(module: nn.Module) -> bool:
    """Whether conversion replaces ``module``: a plain batch norm that tracks running statistics.

    One with the flag off (statistics frozen, or none kept) is left as it is, with its own
    forward and hooks, as torchgpipe and fairscale leave it; the Pipe converts it if the flag
    is turned on later. A converted layer follows the flag from then on.
    """
    return (isinstance(module, _BatchNorm) and not isinstance(module, DeferredBatchNorm)
            and module.track_running_stats and module.running_mean is not None)


# A batch norm's hooks, which its deferred replacement takes over (with the flags that go with them).
_CARRIED_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
                  "_backward_hooks", "_is_full_backward_hook", "_state_dict_pre_hooks", "_state_dict_hooks",
                  "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def unconvertible_norm(module: nn.Module) -> Optional[Tuple[str, _BatchNorm, str]]:
    """A batch norm in ``module`` that conversion would replace but cannot, with its qualified
    name and why; or None. Checked before anything is replaced."""
    for name, norm in module.named_modules():
        if not isinstance(norm, _BatchNorm):
            continue
        if isinstance(norm, LazyModuleMixin) and norm.has_uninitialized_params():
            return name, norm, "run one forward first to set num_features"
        if not converts(norm):
            continue
        if parametrize.is_parametrized(norm):
            return name, norm, ("its parameters are parametrized (computed from others), and the deferred layer "
                                "takes over the parameters themselves: register the parametrization on the converted "
                                "layer (after building the Pipe), or build without deferred_batch_norm")
        if type(norm).forward is not _BatchNorm.forward:
            return name, norm, (f"{type(norm).__name__} has a forward of its own, which the deferred layer would "
                                "replace (a SyncBatchNorm's statistics also span the processes, a deferred layer's "
                                "the mini-batch of this process): build without deferred_batch_norm, or make its "
                                "extra work a layer of its own")
        if norm.affine and not isinstance(getattr(norm, "weight", None), nn.Parameter):
            return name, norm, ("its weight is computed from other parameters (torch.nn.utils.weight_norm or "
                                "spectral_norm), and the deferred layer takes over the parameters themselves: "
                                "register it on the converted layer (after building the Pipe), or build without "
                                "deferred_batch_norm")
    return None


def set_microbatches(module: nn.Module, microbatches: int) -> None:
    """Tell every :class:`DeferredBatchNorm` in ``module`` how many micro-batches this step has.

    The pipe calls it before each step with the number of micro-batches the mini-batch was
    actually split into, which is fewer than ``chunks`` for a small last batch. It also drops
    statistics left pending by an interrupted step.
    """
    microbatches = _check_microbatches(microbatches)
    for layer in module.modules():
        if isinstance(layer, DeferredBatchNorm):
            layer.set_microbatches(microbatches)


def undo_commits(module: nn.Module) -> None:
    """Put back the running statistics that a failed step committed.

    A partition commits its batch norms' statistics once it has run the last micro-batch's
    forward, while later partitions may still fail; which layers got that far depends on
    the schedule and the threads' timing. Undone, a failed step leaves every running
    statistic as it was before the step, whatever the timing. Called while the step still
    holds the Pipe, so every commit found is the step's own.
    """
    undo_marked_commits(commit_marks(module))


CommitMarks = List[Tuple["DeferredBatchNorm", int, Tuple[Tensor, Tensor, Tensor]]]


def commit_marks(module: nn.Module) -> CommitMarks:
    """The commits the step that just ran made in ``module``: each layer, its commit count and
    the statistics the commit replaced. Taken while no other step can run, so that a failure
    after the run (`undo_marked_commits`) undoes this step's commits and no later call's."""
    return [(layer, getattr(layer, "_commits", 0), layer._before_commit) for layer in module.modules()
            if isinstance(layer, DeferredBatchNorm) and getattr(layer, "_before_commit", None) is not None]


def undo_marked_commits(marks: CommitMarks) -> None:
    """Put back the statistics ``marks`` says its step committed, in each layer no commit has
    changed since (another call's commit builds on this one's: both stay)."""
    with torch.no_grad():
        for layer, count, (mean, var, tracked) in marks:
            if getattr(layer, "_commits", 0) == count:
                layer.running_mean.copy_(mean)
                layer.running_var.copy_(var)
                layer.num_batches_tracked.copy_(tracked)
                layer._commits = count + 1
                if layer._before_commit is not None and layer._before_commit[0] is mean:
                    layer._before_commit = None  # undone: nothing left to undo


def _check_microbatches(microbatches: int) -> int:
    """``microbatches`` as a plain int (a NumPy or one-element tensor integer too, as ``chunks``
    elsewhere); TypeError for another type, ValueError unless >= 1."""
    return cast(int, check_positive_int("the number of micro-batches", microbatches))


def statistics_updating_norms(module: nn.Module) -> List[_BatchNorm]:
    """The plain batch norms in ``module``: they update running statistics on every training forward.

    A checkpointed partition runs its training forward twice (once more to recompute in
    backward). :class:`DeferredBatchNorm` skips the recompute by itself; these need
    :func:`running_statistics_frozen` around it, which reads ``track_running_stats`` (and the
    train mode) when it runs: a flag turned on later counts.
    """
    return [m for m in module.modules() if isinstance(m, _BatchNorm) and not isinstance(m, DeferredBatchNorm)]


@contextmanager
def running_statistics_frozen(norms: Sequence[_BatchNorm]) -> Iterator[None]:
    """Run a recompute without it counting as a second update of the running statistics.

    The forward must be repeated with the same arguments (checkpointing checks that it saves
    the same tensors), so the layers run as they are and their buffers are put back
    afterwards: ``running_mean``, ``running_var`` and ``num_batches_tracked`` as before the
    recompute. Written through ``.data``, so autograd does not see an in-place change of
    tensors the layer saved for backward. Layers in eval mode update nothing and are left
    alone.
    """
    saved = [(buffer, buffer.clone())
             for norm in norms if norm.training and norm.track_running_stats
             for buffer in (norm.running_mean, norm.running_var, norm.num_batches_tracked) if buffer is not None]
    try:
        yield
    finally:
        for buffer, before in saved:
            buffer.data.copy_(before)
