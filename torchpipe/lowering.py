"""Lower a schedule plan into a runtime program for a list of partitions.

This is the only bridge between the planning layer (actions such as ``2F5``) and the runtime
(jobs with dependencies): every job is made from exactly one action of the plan, on the
worker that the plan names, in the plan's order. So the plan that ``plan.table()`` prints is
the plan that runs.

Backward order on the ``forward()`` path (invariant 2: per partition, backward runs in the
reverse order of forward) needs no phony fork/join edges here, unlike torchgpipe. Every
autograd node of a partition — its copies included — is created by that partition's own
worker thread, micro-batch after micro-batch, so the nodes of micro-batch ``i + 1`` carry
higher sequence numbers than those of ``i``; autograd's ready queue runs the higher
sequence number first, and a partition receives the gradient of ``i + 1`` no later than the
one of ``i`` (by induction from the last partition, where the gathered output hands every
micro-batch its gradient at once). torchgpipe builds its copy nodes on the scheduler thread,
which breaks that numbering and is why it needs the phony edges; a join node per task costs
a Python autograd Function and a GIL hand-off (half of the per-task overhead on our CPU
box). ``tests/test_backward_order.py`` checks the invariant for every checkpoint mode.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .batchnorm import running_statistics_frozen, statistics_updating_norms
from .checkpoint import ForwardTensors, StageRNG, checkpoint, task_seed, tensor_slots
from .copy import mark_ready, receive
from .devices import Backend, get_backend
from .microbatch import NOT_A_BATCH, Batch, nested_tensors
from .notes import add_note
from .module_reads import modules_in_order, optional_attribute, parameters_in_order
from .runtime import Program
from .skip import Skippable, use_skip_tracker
from .skip.portal import PipelineSkipTracker, SkipStore, StageSkips, replay_context
from .workers import Worker

__all__ = ["StageRunner", "PartitionLayout", "ForwardContext", "lower_forward", "run_partition", "leaf_changed_in_place",
           "needs_receive"]


class StageRunner:
    """What one partition needs to run an action: its module, device, streams and RNG guard."""

    def __init__(self, index: int, partition: nn.Module, device: torch.device, worker: Worker, rng_shared: bool,
                 host_rng_shared: bool = False) -> None:
        self.index = index
        self.partition = partition
        self.device = device
        self.backend: Backend = get_backend(device)
        self.on_cpu = self.backend.type == "cpu"
        self.worker = worker
        self.stream = worker.stream
        self._copy_streams: Dict[torch.device, Any] = {}
        self.rng = StageRNG(device, shared=rng_shared, host_shared=host_rng_shared, name=f"partition {index}")
        # Shared with this stage's views on other workers (on_worker), and refreshed in place.
        self.layout = PartitionLayout(partition)

    def on_worker(self, host: "StageRunner") -> "StageRunner":
        """This stage run by ``host``'s worker (interleaved schedules share workers)."""
        if host is self:
            return self
        view = object.__new__(StageRunner)
        view.__dict__.update(self.__dict__)
        view.worker, view.stream, view._copy_streams = host.worker, host.stream, host._copy_streams
        return view

    def streams(self) -> List[Tuple[torch.device, Any]]:
        """Every stream this stage queues work on: its compute stream and its copy streams."""
        return [(self.device, self.stream), *self._copy_streams.items()]

    def copy_stream_for(self, device: torch.device) -> Any:
        """This stage's stream for incoming copies on ``device`` (created on first use)."""
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = get_backend(device).new_stream(device)
        return stream


class PartitionLayout:
    """What a partition's modules say about how to run it, read again when its modules change.

    Changes inside a layer between calls are the user's to make (a batch norm or a
    parametrization added to ``pipe[i]``, ``inplace`` turned on), and run; facts read only
    when the Pipe was built would miss them, and a batch norm added later would count its
    statistics twice under checkpointing. Before each step, under the Pipe's step lock,
    :meth:`changed` walks the modules once and compares them by identity (and the leading
    in-place flag, which changes no module); :meth:`read` reads the facts again when it says so.
    """

    __slots__ = ("modules", "has_skips", "norms", "starts_in_place", "checkpointed_function")

    def __init__(self, partition: nn.Module) -> None:
        self.modules: Tuple[nn.Module, ...] = ()
        self.read(partition)

    def changed(self, partition: nn.Module) -> bool:
        """Whether ``partition``'s modules, or whether it starts in place, differ from what was read."""
        modules = modules_in_order(partition)
        return modules != self.modules or _starts_in_place(modules) != self.starts_in_place

    def read(self, partition: nn.Module) -> None:
        """Read the facts from ``partition``'s modules as they are now."""
        modules = modules_in_order(partition)
        self.has_skips = any(isinstance(m, Skippable) for m in modules)
        # Batch norms a recompute must not update a second time (those that track statistics
        # then: running_statistics_frozen reads track_running_stats when it runs).
        self.norms = statistics_updating_norms(partition)
        # What checkpointing runs: the partition, on a private copy if it starts in place.
        # Pipe.step runs it so too: its stage inputs are leaves, which nothing may change in place.
        self.starts_in_place = _starts_in_place(modules)
        self.checkpointed_function = _on_private_copy(partition) if self.starts_in_place else partition
        self.modules = modules  # last: a read cut short leaves the layout changed, so it runs again


class ForwardContext:
    """Per-step data of a forward pass: the micro-batches and how to treat them."""

    __slots__ = ("batches", "input_events", "checkpoint_stop", "rng_sections", "rng_seed", "skips", "record",
                 "commit_marks")

    def __init__(self, batches: List[Batch], input_events: List[Any], checkpoint_stop: int) -> None:
        self.batches = batches
        self.input_events = input_events
        self.checkpoint_stop = checkpoint_stop
        # Checkpointing replays RNG: then forwards on a shared generator must not interleave draws.
        self.rng_sections = checkpoint_stop > 0
        self.rng_seed: Optional[int] = None  # a reproducible Pipe's step seed (see seed_rng)
        self.skips = SkipStore()
        self.record: Any = None  # the runtime's record of this step, once it ran (a StepRecord)
        self.commit_marks: Any = None  # deferred batch norm's commits of the step, once it ran


def seed_rng(ctx: Any, step_seed: int) -> None:
    """Make ``ctx``'s step reproducible: every forward runs in its generators' sections,
    drawing from states seeded by ``step_seed``, its stage and its micro-batch (on a shared
    generator, once the partition is seen to draw), so no draw depends on the order the
    worker threads run in."""
    ctx.rng_seed = step_seed
    ctx.rng_sections = True


def _forward_seed(ctx: Any, stage: int, microbatch: int) -> Optional[int]:
    return None if ctx.rng_seed is None else task_seed(ctx.rng_seed, stage, microbatch)


# Layers that hand on their input itself or a view of it: an in-place layer after them still
# overwrites the partition's input.
_PASS_THROUGH = (nn.Identity, nn.Flatten, nn.Unflatten)


def _starts_in_place(modules: Sequence[nn.Module]) -> bool:
    """Whether a partition, given as its ``modules()`` in order, overwrites its input first
    thing (``ReLU(inplace=True)`` and kin).

    Looks past leading layers that pass the input through (``Identity``, ``Flatten``).
    Anything this misses is caught after the fact by :func:`_check_input_untouched`.
    """
    for module in modules:
        if module._modules:  # a container (read per call: no generator, as children() would be)
            continue
        if _inplace_flag(module):
            return True
        if not isinstance(module, _PASS_THROUGH):
            return False
    return False


def _inplace_flag(module: nn.Module) -> Any:
    """``getattr(module, "inplace", False)``, without the AttributeError that a layer with no
    such attribute (most) raises inside ``nn.Module.__getattr__``: read before every call."""
    return optional_attribute(module, "inplace", False)


def _on_private_copy(partition: nn.Module, aliased_skip: Optional[Tuple[int, str]] = None) -> Callable[[Any], Any]:
    """Checkpointing saves the partition input for recompute; an in-place first layer would
    overwrite that saved input, so such a partition computes on a private copy.

    ``aliased_skip`` (partition index, skip name): the input is also a skip stashed for a
    later layer. The plain model's skip would see an in-place change of the input, the
    copy's would not, so a change of the copy is refused. A partition whose in-place layer
    does not touch the input (registered first, run later) passes.
    """

    def run(value: Any) -> Any:
        clones: List[Tensor] = []

        def private(tensor: Tensor) -> Tensor:
            if not (tensor.is_floating_point() or tensor.is_complex()):  # only these carry gradients
                return tensor
            clones.append(tensor.clone())
            return clones[-1]

        copied = Batch(value).map_tensors(private)
        versions = [t._version for t in clones]
        output = partition(copied.value)
        if aliased_skip is not None and [t._version for t in clones] != versions:
            _refuse_stashed_input(*aliased_skip)
        return output

    return run


def _input_versions(batch: Batch) -> Tuple[int, ...]:
    """The versions of every tensor in a partition's input, nested ones included (an LSTM's state)."""
    return tuple(t._version for t in nested_tensors(batch.values))


def _check_input_untouched(stage: StageRunner, batch: Batch, versions: Tuple[int, ...]) -> None:
    if _input_versions(batch) != versions:
        raise RuntimeError(
            f"partition {stage.index} modified its input in place while being checkpointed, so "
            "its recompute would start from the wrong values; make that layer out-of-place "
            "(e.g. inplace=False) or use checkpoint='never'"
        )


def _has_view(batch: Batch) -> bool:
    return any(t._is_view() for t in batch.tensors())


def _stashed_alias(skips: SkipStore, microbatch: int, batch: Batch) -> Optional[str]:
    """The name of a skip, stashed for a later layer, that is also one of ``batch``'s tensors."""
    for tensor in batch.tensors():
        key = skips.aliased_by(microbatch, tensor)
        if key is not None:
            return key[1]
    return None


def _refuse_stashed_input(index: int, skip: str) -> None:
    """A stage that starts in place works on a private copy; if its input is also a waiting skip,
    the plain model would change that skip through the alias, and the copy did not."""
    raise RuntimeError(
        f"partition {index} changes its input in place, and that input is also the skip "
        f"{skip!r} stashed for a later layer: the pipeline must give the partition a copy "
        "here (checkpointing, Pipe.step, or a chunked input), so the skip would not see the "
        "change as in the plain model; make the first layer out-of-place (inplace=False) or "
        "stash a copy (stash(name, x.clone()))"
    )


def needs_receive(stage: StageRunner, batch: Batch, event: Any) -> bool:
    """Whether a batch must go through :func:`receive` (streams or devices differ)."""
    if stage.on_cpu and event is None:
        for value in batch.values:
            if isinstance(value, Tensor):
                if not value.is_cpu:
                    return True
            elif isinstance(value, (tuple, list, dict)) and any(not t.is_cpu for t in nested_tensors(value)):
                return True  # moved to the CPU by receive (a nested CPU tensor stays where it is)
        return False
    return True


def leaf_changed_in_place(index: int, error: RuntimeError, record: StageSkips) -> Optional[RuntimeError]:
    """The error to raise instead of ``error`` when partition ``index`` changed a leaf in place
    under ``Pipe.step`` (whose partition inputs, and the skips it pops, are leaves of the stage's
    graph): one that says which leaves and what to do. None for any other error."""
    if "leaf Variable that requires grad" not in str(error):
        return None
    if record.popped:  # either may be the leaf: the error does not say which tensor
        return RuntimeError(
            f"partition {index}: {error} That leaf is the partition's input or a skip tensor it popped: Pipe.step "
            "makes each of them a leaf of the stage's graph (their gradients go to other partitions), and a leaf "
            "cannot be changed in place. Make that operation out-of-place (x = x + skip, not x += skip; "
            "skip * 0.5, not skip.mul_(0.5)), or train through pipe(x) and backward()"
        )
    return RuntimeError(
        f"partition {index}: {error} If that leaf is the partition's input: Pipe.step makes each partition's "
        "input a leaf of the stage's graph (its gradient goes to the previous stage), and a leaf cannot be "
        "changed in place. Make that operation out-of-place (torch.relu(x), not torch.relu_(x)), or start the "
        "partition with the in-place layer itself (nn.ReLU(inplace=True): Pipe gives it a copy), or train "
        "through pipe(x) and backward()"
    )


def _builds_a_graph(partition: nn.Module, batch: Batch) -> bool:
    """Whether ``partition`` on ``batch`` can record anything for backward.

    Without an input or a parameter that requires grad it keeps no activations, so there
    is nothing to checkpoint, and no backward would ever reach a recompute: such a partition
    (preprocessing in front of the first trained layer) runs plainly, neither checkpointing
    nor recomputing, which keeps ``is_checkpointing()`` and ``is_recomputing()`` paired.
    """
    if any(t.requires_grad for t in nested_tensors(batch.values)):  # an LSTM's state too
        return True
    return any(p.requires_grad for p in parameters_in_order(partition))


def name_the_partition(error: TypeError, stage: StageRunner) -> None:
    """Say which partition returned what a pipeline cannot pass on (a dict, say): the
    ``Batch`` error names only the type."""
    if str(error).startswith(NOT_A_BATCH):
        last = list(stage.partition.children())[-1:]
        layer = f" (its last layer: {type(last[0]).__name__})" if last else ""
        add_note(error, f"[torchpipe] returned by partition {stage.index}{layer}: return a tensor or a tuple "
                        "from a partition's last layer (a dict may pass between layers inside one partition)")


def run_partition(stage: StageRunner, ctx: Any, microbatch: int, batch: Batch, record: Optional[StageSkips]) -> Batch:
    """Run ``stage``'s partition on one micro-batch: checkpointed or not, RNG-safe, with skips.

    ``ctx`` provides ``checkpoint_stop``, ``rng_sections`` and ``skips`` (the step's
    :class:`SkipStore`); ``record`` collects stashes and pops for an explicit backward
    (``Pipe.step``, whose partition inputs are leaves: see :func:`leaf_changed_in_place`).
    """
    partition, layout = stage.partition, stage.layout
    checkpointed = microbatch < ctx.checkpoint_stop and _builds_a_graph(partition, batch)
    if layout.starts_in_place and (checkpointed or record is not None or _has_view(batch)):
        # Overwriting the input in place would break the checkpoint's saved input, Pipe.step's
        # leaves, or the sibling micro-batches that share a chunked input's version counter.
        skip = _stashed_alias(ctx.skips, microbatch, batch)
        if skip is None:
            partition = layout.checkpointed_function
        else:  # the copy must be checked for the alias
            partition = _on_private_copy(stage.partition, (stage.index, skip))
    if not (checkpointed or ctx.rng_sections or layout.has_skips):
        # The common case: nothing to set up around the call (``batch.value`` without its property call).
        return Batch(partition(batch.values[0] if batch.atomic else batch.values))
    training = stage.partition.training
    replay = stage.rng.new_replay(training) if checkpointed else None
    if replay is not None:
        # Where its parameters and buffers live, read per checkpointed forward (weight_norm or
        # pruning adds some to a module after the Pipe was built): the recompute runs with these.
        forward_tensors = ForwardTensors(tensor_slots(stage.partition), stage.partition, f"partition {stage.index}")
        replay.recompute_extras.append(forward_tensors.restored)
    if replay is not None and layout.norms:
        norms = layout.norms
        replay.recompute_extras.append(lambda: running_statistics_frozen(norms))
    tracker = None
    if layout.has_skips:
        memo: Optional[List[Optional[Tensor]]] = [] if replay is not None else None
        if replay is not None and memo is not None:
            replay.recompute_extras.append(replay_context(memo))
        tracker = PipelineSkipTracker(ctx.skips, microbatch, stage, record, memo)
    with use_skip_tracker(tracker) if tracker is not None else contextlib.nullcontext():
        if replay is not None:
            versions = _input_versions(batch)
            with stage.rng.forward_section(training, _forward_seed(ctx, stage.index, microbatch)):
                output = checkpoint(partition, batch, replay, f"recomputed for stage {stage.index}, micro-batch {microbatch}")
            _check_input_untouched(stage, batch, versions)
            if tracker is not None:
                tracker.check_popped_untouched()
        elif ctx.rng_sections:
            with stage.rng.forward_section(training, _forward_seed(ctx, stage.index, microbatch)):
                output = batch.call(partition)
        else:
            output = batch.call(partition)
    return output


def _forward_job(stage: StageRunner, microbatch: int) -> Callable[[ForwardContext, Tuple[Any, ...]], Any]:
    backend, stream = stage.backend, stage.stream
    on_cpu = backend.type == "cpu"

    def run(ctx: ForwardContext, inputs: Tuple[Any, ...]) -> Tuple[Batch, Any]:
        if inputs:
            batch, event = inputs[0]
        else:
            batch, event = ctx.batches[microbatch], ctx.input_events[microbatch]
            ctx.batches[microbatch] = None  # type: ignore[call-overload]  # the pipeline owns it now
        if needs_receive(stage, batch, event):
            batch = receive(batch, event, stage.device, stream, stage.copy_stream_for)
        try:
            output = run_partition(stage, ctx, microbatch, batch, None)
        except TypeError as exc:
            name_the_partition(exc, stage)
            raise
        return output, (None if on_cpu else mark_ready(backend, stream))

    return run


def lower_forward(plan: Any, stages: Sequence[StageRunner]) -> Program:
    """A program that runs the F actions of ``plan``; the last stage's outputs are kept, and
    come back from ``Runtime.run_kept`` in micro-batch order (ValueError for a plan whose last
    stage runs its forwards in another order)."""
    program = Program(plan.num_workers)
    last = plan.num_stages - 1
    outputs = [action.microbatch for actions in plan.worker_actions for action in actions
               if action.stage == last and action.kind == "F"]  # another kind is refused below
    if outputs != list(range(plan.num_microbatches)):
        raise ValueError(f"lower_forward needs the last stage's forwards in micro-batch order, got {outputs}")
    for worker, actions in enumerate(plan.worker_actions):
        for action in actions:
            if action.kind != "F":
                raise ValueError(f"lower_forward got a {action.kind} action ({action}); expected a forward-only plan")
            program.add(
                worker,
                action,
                _forward_job(stages[action.stage], action.microbatch),
                deps=plan.dependencies(action),
                label=f"stage {action.stage} F mb {action.microbatch}",
                keep=action.stage == last,
            )
    return program.freeze()
