"""Lower a forward+backward plan for ``Pipe.step``: backward runs on the workers too.

In torchgpipe, backward is left to autograd's engine, which on CPU runs every partition's
backward serially on the caller's thread. Here each stage's graph is cut at its input (the
input becomes a leaf), and the plan's backward actions run autograd (see engine.py) on
the stage's outputs with the gradient received from the next stage, on the stage's own
worker. So backward pipelines on every backend, and the plan decides when activations are
freed: 1F1B holds at most ``p - s`` micro-batches on stage ``s``, GPipe holds all ``m``.

Action kinds: ``F`` forward (the last stage also computes the loss), ``B`` full backward,
``I`` input-gradient backward (keeps the graph), ``W`` weight-gradient backward, which
starts from the gradients ``I`` left at the parameter branches (see split_backward.py).
"""
from __future__ import annotations

import contextlib
import operator

from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import engine
from .checkpoint import explain_hooks_refusal, task_seed
from .copy import mark_ready, receive
from .lowering import StageRunner, leaf_changed_in_place, name_the_partition, needs_receive, run_partition
from .notes import add_note
from .microbatch import (Batch, BatchDim, check_joins, items_of, map_nested, nested_tensor_paths, rebuild,
                         why_not_gatherable)
from .runtime import Program
from .saved_versions import check_unchanged
from .skip.portal import SkipStore, StageSkips
from .split_backward import WeightSplit
from .step_inputs import scalar_loss
from .thread_state import current_saved_tensors_hooks, outside_autocast

__all__ = ["StepContext", "lower_step", "MemoryRecord"]


class MemoryRecord:
    """Activations a step kept alive, per stage: micro-batches and bytes saved for backward.

    ``freed_output_bytes[s]``: bytes of stage ``s``'s outputs freed as soon as stage ``s + 1``
    had its own copy of them (a hand-off across devices), summed over the step; see
    :func:`_free_sent_outputs`. ``peak_worker_bytes[w]``: the most bytes worker ``w``'s stages
    held at once. Under interleaved schedules a worker hosts several stages, which peak at
    different times, so this is less than the sum of their ``peak_bytes``.
    """

    def __init__(self, num_stages: int, stage_to_worker: Optional[Sequence[int]] = None) -> None:
        self.live_microbatches = [0] * num_stages
        self.peak_microbatches = [0] * num_stages
        self.live_bytes = [0] * num_stages
        self.peak_bytes = [0] * num_stages
        self.freed_output_bytes = [0] * num_stages
        self._worker_of = list(stage_to_worker) if stage_to_worker is not None else list(range(num_stages))
        num_workers = max(self._worker_of, default=-1) + 1
        self.live_worker_bytes = [0] * num_workers
        self.peak_worker_bytes = [0] * num_workers

    def kept(self, stage: int, nbytes: int) -> None:
        """A micro-batch's activations of ``stage`` are alive until :meth:`released` (called on its worker)."""
        self.live_microbatches[stage] += 1
        self.live_bytes[stage] += nbytes
        self.peak_microbatches[stage] = max(self.peak_microbatches[stage], self.live_microbatches[stage])
        self.peak_bytes[stage] = max(self.peak_bytes[stage], self.live_bytes[stage])
        worker = self._worker_of[stage]
        self.live_worker_bytes[worker] += nbytes
        self.peak_worker_bytes[worker] = max(self.peak_worker_bytes[worker], self.live_worker_bytes[worker])

    def released(self, stage: int, nbytes: int) -> None:
        self.live_microbatches[stage] -= 1
        self.live_bytes[stage] -= nbytes
        self.live_worker_bytes[self._worker_of[stage]] -= nbytes

    def __repr__(self) -> str:
        return (f"MemoryRecord(peak_microbatches={self.peak_microbatches}, peak_bytes={self.peak_bytes}, "
                f"peak_worker_bytes={self.peak_worker_bytes}, freed_output_bytes={self.freed_output_bytes})")


class StepContext:
    """Per-step data of ``Pipe.step``."""

    def __init__(
        self,
        batches: List[Batch],
        targets: List[Any],
        input_events: List[Any],
        loss_fn: Callable[[Any, Any], Tensor],
        scales: List[float],
        checkpoint_stop: int,
        num_stages: int,
        keep_outputs: bool = False,
        output_batch_dim: BatchDim = 0,
        output_samples: Optional[List[int]] = None,
        sync_ticket: Any = None,
        stage_to_worker: Optional[Sequence[int]] = None,
    ) -> None:
        self.commit_marks: Any = None  # deferred batch norm's commits of the step, once it ran (Pipe._run)
        self.batches = batches
        self.targets = targets
        self.input_events = input_events
        self.loss_fn = loss_fn
        self.scales = scales
        self.checkpoint_stop = checkpoint_stop
        self.rng_sections = checkpoint_stop > 0
        self.rng_seed: Optional[int] = None  # a reproducible Pipe's step seed (lowering.seed_rng)
        self.losses: List[Optional[Tensor]] = [None] * len(batches)
        # Whether each micro-batch's loss has a graph; one without (a constant for a fully
        # masked micro-batch) contributes nothing to the gradients, as a constant term would.
        self.loss_has_graph: List[bool] = [False] * len(batches)
        self.record: Any = None  # the runtime's record of this step, once it ran (a StepRecord)
        # The last stage's outputs, detached, for ``Pipe.step(..., return_outputs=True)``.
        self.keep_outputs = keep_outputs
        self.output_batch_dim = output_batch_dim
        self.output_samples = output_samples  # checked against, when the output's batch dim follows the input's
        self.outputs: List[Optional[Batch]] = [None] * len(batches)
        self.memory = MemoryRecord(num_stages, stage_to_worker)
        self.skips = SkipStore()
        # With a GradientSync: this call's place in its call count (see grad_sync.py), and the
        # step's all-reduces, set under the step lock (None inside no_sync()).
        self.sync_ticket = sync_ticket
        self.grad_round: Any = None


def _gradients_final(ctx: StepContext, index: int) -> None:
    """Partition ``index`` ran its last backward action of the step: its gradients may go."""
    if ctx.grad_round is not None:
        ctx.grad_round.partition_done(index)


class _Saved:
    """What a stage keeps from its forward of one micro-batch until its backward."""

    __slots__ = ("leaves", "outputs", "grad_positions", "grads", "bytes", "skips", "split", "aliased")

    def __init__(self, leaves: List[Tensor], outputs: List[Tensor], nbytes: int, skips: StageSkips,
                 aliased: bool = False, grad_positions: Tuple[Tuple[int, ...], ...] = ()) -> None:
        self.aliased = aliased  # autograd saved aliases, not these outputs: they may be freed
        self.grad_positions = grad_positions  # where ``outputs`` sit in the batch sent on
        self.leaves = leaves
        self.skips = skips  # stashed tensors are extra outputs, popped leaves extra inputs
        self.outputs = outputs
        self.grads: Optional[List[Optional[Tensor]]] = None
        self.bytes = nbytes
        self.split: Optional[WeightSplit] = None  # set by I, used by W


class _Handoff:
    """A job's result: what the neighbour stage receives, its ready event, and own state."""

    __slots__ = ("batch", "event", "saved")

    def __init__(self, batch: Optional[Batch], event: Any, saved: Optional[_Saved]) -> None:
        self.batch = batch
        self.event = event
        self.saved = saved


class _CountSaved:
    """Saved-tensor hooks that add up the bytes autograd keeps for backward.

    Installed hooks turn off autograd's own check that a saved tensor was not changed in
    place before backward, so these check it themselves (:mod:`torchpipe.saved_versions`).
    Under the caller's own hooks, autograd checks nothing either, and neither do these.
    """

    def __init__(self, parameter_ids: FrozenSet[int], stage: int, microbatch: int) -> None:
        self.nbytes = 0
        self.parameter_ids = parameter_ids
        self.stage = stage
        self.microbatch = microbatch
        # The caller's own hooks (``save_on_cpu``), which these would otherwise shadow.
        self.outer = current_saved_tensors_hooks()

    # Wrapped in torch.compiler.disable, as torch wraps its checkpoint's hooks: autograd calls
    # them from inside whatever runs, and after a graph break inside a compiled layer
    # torch.compile would otherwise try to compile the hook itself, on fake tensors.
    @torch.compiler.disable
    def pack(self, tensor: Tensor) -> Tensor:
        # Parameters (a Linear saves its weight, maybe as a view) are not activations. Known
        # by id: ``isinstance(t, nn.Parameter)`` runs a Python metaclass check, tens of us here.
        base = tensor._base
        if base is None:
            base = tensor
        if id(base) not in self.parameter_ids and type(base) is not nn.Parameter:
            self.nbytes += tensor.nbytes
        # Saved as an alias, never the tensor itself: a layer that saves its own output
        # (tanh) would otherwise close a cycle output -> grad_fn -> output through C++, which
        # only a backward breaks, so a failed step would leak the graph for good. And when the
        # next stage is on another device, the outputs it copies get freed (``_drop_storage``
        # swaps their data); the alias keeps the values saved.
        packed = tensor.detach()
        return (packed, packed._version) if self.outer is None else self.outer[0](packed)

    @torch.compiler.disable
    def unpack(self, packed: Any) -> Tensor:
        if self.outer is not None:
            return self.outer[1](packed)
        alias, version = packed
        check_unchanged(alias, version, self._where)
        return alias

    def _where(self) -> str:
        return f"saved in stage {self.stage}'s forward of micro-batch {self.microbatch}"


Path = Tuple[Any, ...]
"""Where a value sits in a batch: its index, then indices or keys into nested tuples, lists and dicts."""


_WHOLE_BATCH: Tuple[Path, ...] = ((0,),)
"""The grad positions of an atomic batch whose tensor requires grad (the common case, taken
without the nested walk: these run in every forward job of a step)."""


def _grad_positions(output: Batch) -> Tuple[Path, ...]:
    """Where in a stage's output the tensors that carry a gradient back are.

    Nested tuples, lists and dicts are searched too (an LSTM's ``(out, (h, c))``): a tensor
    in one that kept the producer's graph would let the consumer's backward run into the
    producer's.
    """
    if output.atomic:
        return _WHOLE_BATCH if output.values[0].requires_grad else ()
    return tuple(path for path, tensor in nested_tensor_paths(output.values) if tensor.requires_grad)


def _value_at(values: Sequence[Any], path: Path) -> Any:
    for i in path:
        values = values[i]
    return values


def _values_at(values: Sequence[Any], positions: Sequence[Path]) -> List[Any]:
    if positions is _WHOLE_BATCH:
        return [values[0]]
    return [_value_at(values, path) for path in positions]


def _as_leaves(batch: Batch, positions: Sequence[Path]) -> Tuple[Batch, List[Tensor]]:
    """Cut the graph at the stage input: the values at ``positions`` become leaves.

    ``positions`` are the producer's (:func:`_grad_positions`), so the leaves' gradients line
    up one for one with the outputs the producer runs its backward from, whatever else the
    batch holds (a mask, an integer tensor, a float tensor that needs no gradient).
    """
    if not positions:
        return batch, []
    if batch.atomic:  # then ``positions`` is the batch itself: an atomic batch has no other path
        leaf = batch.values[0].detach().requires_grad_(True)
        return Batch(leaf), [leaf]
    leaves = [_value_at(batch.values, path).detach().requires_grad_(True) for path in positions]
    values = _with_leaves(batch.values, (), dict(zip(positions, leaves)))
    return Batch(values[0] if batch.atomic else rebuild(batch.values, values)), leaves


def _with_leaves(values: Any, prefix: Path, leaf_at: Dict[Path, Tensor]) -> Any:
    """``values`` with the leaf for each path in ``leaf_at``; containers on a path rebuilt as their kind.

    Returns a list for a tuple or list (the caller rebuilds the kind), a dict for a dict.
    """
    out = dict(values) if isinstance(values, dict) else list(values)
    for i, value in items_of(values):
        path = prefix + (i,)
        leaf = leaf_at.get(path)
        if leaf is not None:
            out[i] = leaf
        elif isinstance(value, (tuple, list, dict)) and any(p[: len(path)] == path for p in leaf_at):
            inner = _with_leaves(value, path, leaf_at)
            if isinstance(value, tuple):
                inner = rebuild(value, inner)
            elif type(value) not in (list, dict):  # a subclass (an OrderedDict): keep it where it allows
                try:
                    inner = type(value)(inner)
                except Exception:  # noqa: BLE001 - a constructor of its own: the plain container
                    pass
            out[i] = inner
    return out


def explain_saved_attribute(error: AttributeError) -> None:
    """Add a note to an AttributeError that a backward raised reading an attribute of a tensor:
    likely one a custom ``autograd.Function`` set on a parameter and read back from
    ``ctx.saved_tensors``, which under any saved-tensor hooks (these, torch's ``save_on_cpu``
    and non-reentrant checkpoint) hands back plain tensors, not the objects saved."""
    if "'Tensor' object has no attribute" in str(error):
        add_note(error, "[torchpipe] Pipe.step runs each stage's forward under saved-tensor hooks of its own (they "
                        "count what backward keeps, for last_memory), and under any saved-tensor hooks (torch's "
                        "save_on_cpu and non-reentrant checkpoint too) ctx.saved_tensors gives back plain tensors, "
                        "not the Parameter objects saved: an attribute set on a parameter (weight.main_grad) is not "
                        "on them. Keep what the backward needs on ctx in forward (ctx.main_grad = weight.main_grad), "
                        "or train this model with pipe(x) and backward()")


def _copies_between(producer: StageRunner, consumer: StageRunner) -> bool:
    """Whether the consumer gets its own copy of what the producer sends (another device)."""
    return producer.device != consumer.device


def _forward(stage: StageRunner, microbatch: int, last: bool, sends_copies: bool) -> Callable[[StepContext, Tuple[Any, ...]], _Handoff]:
    device, stream, backend = stage.device, stage.stream, stage.backend
    on_cpu = backend.type == "cpu"
    index = stage.index
    parameter_ids = frozenset(id(p) for p in stage.partition.parameters())

    def run(ctx: StepContext, inputs: Tuple[Any, ...]) -> _Handoff:
        positions: Tuple[Path, ...] = ()
        if inputs:
            handoff: _Handoff = inputs[0]
            batch, event = handoff.batch, handoff.event
            assert handoff.saved is not None
            positions = handoff.saved.grad_positions
        else:
            batch, event = ctx.batches[microbatch], ctx.input_events[microbatch]
            ctx.batches[microbatch] = None  # type: ignore[call-overload]
        assert batch is not None
        if needs_receive(stage, batch, event):
            received = receive(batch, event, device, stream, stage.copy_stream_for)
            if inputs and received is not batch:
                ctx.memory.freed_output_bytes[index - 1] += _free_sent_outputs(handoff, received)
            batch = received
        batch, leaves = _as_leaves(batch, positions)
        counter = _CountSaved(parameter_ids, index, microbatch)
        skips = StageSkips()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            try:
                output = run_partition(stage, ctx, microbatch, batch, skips)
            except TypeError as exc:
                name_the_partition(exc, stage)
                raise
            except RuntimeError as exc:
                changed = leaf_changed_in_place(index, exc, skips)
                if changed is not None:
                    raise changed from exc
                explain_hooks_refusal(
                    exc, "Pipe.step runs each stage's forward under saved-tensor hooks of its own (they count what "
                         "backward keeps, for last_memory, and let a failed step free its graph)",
                    "In the layer, take the inner gradient with torch.autograd.grad(..., create_graph=True), or "
                    "train this model with pipe(x) and backward() under checkpoint='never'")
                raise
            if leaves and not all(leaf.requires_grad for leaf in leaves):
                # The plain model (and pipe(x)) refuses this on a non-leaf: here the input is a
                # leaf cut for the step, so it would silently cut the earlier stages' gradients.
                raise RuntimeError(
                    f"partition {index}: a layer called requires_grad_(False) on the partition's input, which the plain "
                    "model refuses (you can only change requires_grad flags of leaf variables): under Pipe.step the "
                    "earlier partitions would get no gradient. Use x.detach() for a part that must not train them")
            if last:
                target = ctx.targets[microbatch]
                if isinstance(target, Tensor) and target.device != device:
                    target = target.to(device)
                # A loss that draws random numbers must not interleave with a checkpointed
                # forward of another stage on the same generator (its replay would differ).
                loss_seed = None if ctx.rng_seed is None else task_seed(ctx.rng_seed, index, microbatch, 1)
                with stage.rng.hold(loss_seed) if ctx.rng_sections else contextlib.nullcontext():
                    loss = scalar_loss(ctx.loss_fn(output.value, target))
                ctx.losses[microbatch] = loss.detach()
                ctx.loss_has_graph[microbatch] = loss.requires_grad
                if ctx.keep_outputs:
                    if len(ctx.outputs) > 1:  # now, while the failed step can still be undone
                        problem = why_not_gatherable(output, ctx.output_batch_dim)
                        if problem is not None:
                            raise TypeError(f"return_outputs=True: {problem}")
                        first = next((kept for kept in ctx.outputs if kept is not None), None)
                        expected = None if ctx.output_samples is None else ctx.output_samples[microbatch]
                        check_joins(output, ctx.output_batch_dim, first, expected)
                    ctx.outputs[microbatch] = Batch(map_nested(output.value, Tensor.detach))
        grad_positions = () if last else _grad_positions(output)
        outputs = [loss] if last else _values_at(output.values, grad_positions)
        if skips.stashed:
            outputs += [tensor for _, tensor in skips.stashed]
        ctx.memory.kept(index, counter.nbytes)
        saved = _Saved(leaves, outputs, counter.nbytes, skips, aliased=sends_copies, grad_positions=grad_positions)
        if last:
            return _Handoff(None, None, saved)
        return _Handoff(output, None if on_cpu else mark_ready(backend, stream), saved)

    return run


def _free_sent_outputs(handoff: _Handoff, received: Batch) -> int:
    """Release what the producer sent once the consumer holds its own copy; returns the bytes.

    Megatron's ``deallocate_output_tensor`` idea: the producer's backward needs its outputs'
    autograd graph and shapes, not their values. So each output the consumer copied keeps its
    ``grad_fn`` and shape but points at a single element (a stride-0 view), and its memory goes
    back to the allocator (on an accelerator after the copy stream is done with it: ``receive``
    called ``record_stream``). Skipped: leaves and views (their storage belongs to someone
    else), tensors stashed for a skip connection, and anything not copied. On one device the
    consumer's input *is* the producer's output, so there is nothing to free. Tensors nested
    in the output's containers (an RNN's ``(h_n, c_n)``) are left alone too: a layer often
    keeps its state for its next call, and freeing it would wipe what the layer kept.
    """
    sent = handoff.batch
    assert sent is not None and handoff.saved is not None
    if not handoff.saved.aliased:  # autograd may hold these very tensors: freeing would corrupt it
        return 0
    handoff.batch = None  # the producer's own backward reads only ``saved``
    stashed = {id(tensor) for _, tensor in handoff.saved.skips.stashed}
    freed = 0
    for old, new in zip(sent.values, received.values):
        if (not isinstance(old, Tensor) or new is old or old.grad_fn is None or old._base is not None
                or id(old) in stashed or old.numel() <= 1):
            continue
        freed += _drop_storage(old)
    return freed


def _drop_storage(tensor: Tensor) -> int:
    """Point ``tensor`` at one element, keeping its shape and graph; the bytes actually freed.

    Freed means the old storage died: not when an autograd node saved this output for its own
    backward (a ``tanh`` saves its result), which then keeps the memory, correctly.
    """
    storage = tensor.untyped_storage()
    nbytes, ref = storage.nbytes(), storage._weak_ref()
    del storage
    try:
        tensor.data = torch.empty(1, dtype=tensor.dtype, device=tensor.device).expand(tensor.shape)
        return nbytes if torch.UntypedStorage._expired(ref) else 0
    finally:
        torch.UntypedStorage._free_weak_ref(ref)


def _received_grads(stage: StageRunner, saved: _Saved, handoff: Optional[_Handoff], last: bool, microbatch: int, ctx: StepContext) -> List[Optional[Tensor]]:
    """Gradients for ``saved.outputs``: from the next stage (or the loss scale), then skips."""
    if last:
        loss = saved.outputs[0]
        grads = [torch.full_like(loss, ctx.scales[microbatch]) if loss.requires_grad else None]
    else:
        assert handoff is not None and handoff.batch is not None
        batch = handoff.batch
        if needs_receive(stage, batch, handoff.event):
            batch = receive(batch, handoff.event, stage.device, stage.stream, stage.copy_stream_for)
        grads = list(batch.values)
    for key, _ in saved.skips.stashed:
        grad, event = ctx.skips.take_grad(key, microbatch)
        if grad is not None and (event is not None or grad.device != stage.device):
            grad = receive(Batch(grad), event, stage.device, stage.stream, stage.copy_stream_for).tensor
        grads.append(grad)
    return grads


def _send_skip_grads(stage: StageRunner, ctx: StepContext, microbatch: int, saved: _Saved, grads: Sequence[Optional[Tensor]]) -> None:
    popped = saved.skips.popped
    if not popped:
        return
    event = None if stage.backend.type == "cpu" else mark_ready(stage.backend, stage.stream)
    for (key, _), grad in zip(popped, grads):
        ctx.skips.put_grad(key, microbatch, grad, event)


def _release(ctx: StepContext, index: int, saved: _Saved) -> None:
    ctx.memory.released(index, saved.bytes)
    saved.leaves = []
    saved.outputs = []
    saved.grads = None
    saved.split = None


def _pairs(saved: _Saved, grads: Sequence[Optional[Tensor]]) -> Tuple[List[Tensor], List[Tensor]]:
    outputs, grad_outputs = [], []
    for output, grad in zip(saved.outputs, grads):
        if grad is not None:
            outputs.append(output)
            grad_outputs.append(grad)
    return outputs, grad_outputs


_grad_of = operator.attrgetter("grad")  # a leaf's gradient, read in C (once per leaf and backward job)


def _leaf_grads(stage: StageRunner, saved: _Saved, grads: List[Optional[Tensor]]) -> _Handoff:
    on_cpu = stage.backend.type == "cpu"
    return _Handoff(Batch(tuple(grads)), None if on_cpu else mark_ready(stage.backend, stage.stream), None)


def _backward(stage: StageRunner, microbatch: int, first: bool, last: bool,
              final: bool) -> Callable[[StepContext, Tuple[Any, ...]], Optional[_Handoff]]:
    index = stage.index

    @outside_autocast
    def run(ctx: StepContext, inputs: Tuple[Any, ...]) -> Optional[_Handoff]:
        saved: _Saved = inputs[0].saved
        grads = _received_grads(stage, saved, inputs[1] if len(inputs) > 1 else None, last, microbatch, ctx)
        outputs, grad_outputs = _pairs(saved, grads)
        if outputs:
            try:
                engine.backward(outputs, grad_outputs)
            except AttributeError as exc:
                explain_saved_attribute(exc)
                raise
        if saved.skips.popped:
            _send_skip_grads(stage, ctx, microbatch, saved, [leaf.grad for _, leaf in saved.skips.popped])
        result = None if first else _leaf_grads(stage, saved, list(map(_grad_of, saved.leaves)))
        _release(ctx, index, saved)
        if final:
            _gradients_final(ctx, index)
        return result

    return run


def _input_grad(stage: StageRunner, microbatch: int, first: bool, last: bool) -> Callable[[StepContext, Tuple[Any, ...]], _Handoff]:
    """Gradients for the stage inputs (and popped skips) only; the graph is kept for ``W``."""

    owned = frozenset(id(p) for p in stage.partition.parameters())  # no other stage has them (verify_unshared)

    @outside_autocast
    def run(ctx: StepContext, inputs: Tuple[Any, ...]) -> _Handoff:
        saved: _Saved = inputs[0].saved
        grads = _received_grads(stage, saved, inputs[1] if len(inputs) > 1 else None, last, microbatch, ctx)
        outputs, grad_outputs = _pairs(saved, grads)
        saved.grads = list(grads)
        wanted = saved.leaves + [leaf for _, leaf in saved.skips.popped]
        if not wanted or not outputs:
            all_grads: List[Optional[Tensor]] = [None] * len(wanted)
        else:
            # A checkpointed micro-batch recomputes its forward once per backward call W makes.
            saved.split = WeightSplit(outputs, wanted, checkpointed=microbatch < ctx.checkpoint_stop, owned=owned)
            try:
                all_grads = saved.split.input_grads(outputs, grad_outputs, wanted)
            except AttributeError as exc:
                explain_saved_attribute(exc)
                raise
        leaf_grads = all_grads[: len(saved.leaves)]
        _send_skip_grads(stage, ctx, microbatch, saved, all_grads[len(saved.leaves):])
        handoff = _leaf_grads(stage, saved, leaf_grads)
        handoff.saved = saved
        return handoff

    return run


def _weight_grad(stage: StageRunner, microbatch: int, final: bool) -> Callable[[StepContext, Tuple[Any, ...]], None]:
    index = stage.index

    @outside_autocast
    def run(ctx: StepContext, inputs: Tuple[Any, ...]) -> None:
        saved: _Saved = inputs[0].saved
        assert saved.grads is not None
        outputs, grad_outputs = _pairs(saved, saved.grads)
        try:
            if outputs and saved.split is not None:
                saved.split.weight_grads(outputs, grad_outputs)
            elif outputs:
                # I had no input to differentiate (the first stage, or inputs that need no gradient):
                # W is the whole backward, into the caller's input too when that requires one.
                engine.backward(outputs, grad_outputs)
        except AttributeError as exc:
            explain_saved_attribute(exc)
            raise
        _release(ctx, index, saved)
        if final:
            _gradients_final(ctx, index)

    return run


def lower_step(plan: Any, stages: Sequence[StageRunner]) -> Program:
    """A program that runs every action of a forward+backward ``plan`` on the workers."""
    program = Program(plan.num_workers)
    last = plan.num_stages - 1
    # Each stage's last action that adds to its parameters' gradients, in its worker's order.
    final = {action.stage: action for actions in plan.worker_actions for action in actions if action.kind in ("B", "W")}
    for worker, actions in enumerate(plan.worker_actions):
        for action in actions:
            s, m, kind = action.stage, action.microbatch, action.kind
            stage = stages[s]
            first, is_last = s == 0, s == last
            deps = plan.dependencies(action)
            if kind == "F":
                function: Any = _forward(stage, m, is_last,
                                         sends_copies=not is_last and _copies_between(stage, stages[s + 1]))
            elif kind == "B":
                function = _backward(stage, m, first, is_last, final=action == final[s])
            elif kind == "I":
                function = _input_grad(stage, m, first, is_last)
            elif kind == "W":
                function = _weight_grad(stage, m, final=action == final[s])
            else:  # pragma: no cover - Action rejects other kinds
                raise ValueError(f"unknown action kind in {action}")
            # Own state first, then the gradient from the next stage (if any).
            own = [d for d in deps if d.stage == s]
            upstream = [d for d in deps if d.stage != s]
            program.add(worker, action, function, deps=own + upstream, label=f"stage {s} {kind} mb {m}")
    return program.freeze()
