"""``Pipe``: GPipe pipeline parallelism for an ``nn.Sequential``, on worker threads.

A drop-in successor to torchgpipe's ``GPipe`` (and fairscale's / PyTorch's retired ``Pipe``):
``Pipe(model, balance, devices=..., chunks=...)(x)`` returns what ``model(x)`` returns, and
backward through the output gives the same gradients. Each partition runs on its own worker
thread, also when several partitions share a device, so pipelining happens on CPU too.
"""
from __future__ import annotations

import functools
import operator
import re
import sys
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin

from .batchnorm import (DeferredBatchNorm, commit_marks, converts, set_microbatches, unconvertible_norm,
                        undo_commits, undo_marked_commits)
from .call_chain import current as current_chain
from .call_chain import holds_rng_section
from .call_lock import CallLock
from .checkpoint import (draw_step_seed, generator_state, is_checkpointing, is_recomputing, lock_for_good,
                         settled_state)
from .copy import caller_waits_for_streams, mark_ready, streams_wait_for_caller
from .devices import DeviceLike, as_device, get_backend, usable_device
from .lowering import ForwardContext, StageRunner, lower_forward, seed_rng
from .microbatch import (Batch, BatchDim, TensorOrTensors, batch_size, check_batch_dim, common_batch_dim, gather,
                         nested_tensors, samples, scatter)
from .module_reads import parameters_in_order
from .partition import (BalanceError, SpreadingSequential, as_positive_int, fixed_partitions, infer_placement,
                        layers_fixed_error, split_module, verify_balance, verify_module, verify_unshared)
from .runtime import Program, Runtime, StepRecord, describe_error
from .schedule import SCHEDULES, InvalidPlanError, Plan, build, schedule_options
from .schedule.names import resolve as resolve_schedule
from .skip import inspect_skip_layout, verify_skippables
from .state_keys import check_not_renumbered, retired_pipe_state_dict
from .step import MemoryRecord, StepContext, lower_step
from .step_inputs import Upstream, loss_settings, microbatch_weights, scalar_loss, split_targets
from .step_report import StepReport, report
from .thread_state import (first_frame_outside_torchpipe, in_torch_checkpoint, leave_autocast, records_graphs,
                           refuse_untransferable_state, warn_if_the_profiler_records_this_thread_only)
from .workers import (STOP_TIMEOUT_S, ThreadBudget, Worker, available_cores, spawn_workers, stop_workers,
                      stopped_with)

__all__ = ["Pipe", "MovingDenied", "CHECKPOINT_MODES"]

CHECKPOINT_MODES = ("always", "except_last", "never")

_BALANCE_HINT = (
    "pass balance=[...] (layers per partition), place the children on devices first, or compute "
    "a balance with torchpipe.balance.balance_by_time(partitions, module, sample) or "
    "torchpipe.balance.balance_by_size(partitions, module, sample)"
)


_PARTITIONED_KEY = re.compile(r"partitions\.\d+\.")


def _accept_partitioned_keys(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """Load state dicts saved from torchgpipe's ``GPipe`` or fairscale's ``Pipe``.

    Those keep the layers under ``partitions.<i>.<name>``; a ``Pipe`` keeps the original
    model's names (``<name>``), so that its state dict also loads into the plain model. Keys
    renumbered per partition (the retired torch ``Pipe``'s) are refused before anything loads,
    except by ``torchpipe.retired.Pipe``, which is split as that ``Pipe`` was and converts them.
    """
    if "partitions" in module._modules:  # a layer of the model itself is called 'partitions'
        return
    if getattr(module, "_retired_layout", False):  # torchpipe.retired.Pipe: the layout it was split like
        converted = retired_pipe_state_dict(state_dict, module, module.balance, prefix)
        state_dict.clear()
        state_dict.update(converted)
        return
    check_not_renumbered(state_dict, prefix, module._modules)
    start = prefix + "partitions."
    for key in [k for k in state_dict if k.startswith(start)]:
        match = _PARTITIONED_KEY.match(key, len(prefix))
        if match is not None:
            name = key[match.end():]
            value = state_dict.pop(key)
            if not _deferred_batch_norm_accumulator(module, name):
                state_dict[prefix + name] = value


def _deferred_batch_norm_accumulator(module: nn.Module, name: str) -> bool:
    """Whether ``name`` is a ``sum``/``sum_squares`` buffer that torchgpipe's or fairscale's
    DeferredBatchNorm saved for a BatchNorm that is plain here. Those buffers only carry a
    step's running sums (emptied when the step commits them), so a checkpoint trained with
    ``deferred_batch_norm=True`` loads into a Pipe without it, for inference, say."""
    path, _, leaf = name.rpartition(".")
    if leaf not in ("sum", "sum_squares"):
        return False
    try:
        owner = module.get_submodule(path)
    except AttributeError:
        return False
    return isinstance(owner, nn.modules.batchnorm._BatchNorm) and leaf not in owner._buffers


def _watched_generators(stages: Sequence[StageRunner]) -> List[Tuple[torch.Generator, Tensor]]:
    """The generators whose draws this call must not make, with their states now.

    Only when the call runs inside a checkpointed forward and the pipeline has several
    partitions, and only generators that no one else can draw from meanwhile, so that a
    moved generator means this call drew: inside another Pipe's checkpointed stage, the
    generators whose lock the caller holds; inside ``torch.utils.checkpoint`` at the top
    (no pipeline step around it), every generator of the stages.
    """
    if len(stages) < 2:
        return []
    nested = is_checkpointing()
    if not nested and not (in_torch_checkpoint() and not current_chain().owners):
        return []  # the common case, checked before anything is collected
    generators = {id(g.generator): g.generator for stage in stages for g in stage.rng.guards}
    chosen = [g for g in generators.values() if holds_rng_section(g)] if nested else list(generators.values())
    return [(g, generator_state(g)) for g in chosen]


def _moved(watched: List[Tuple[torch.Generator, Tensor]]) -> bool:
    return any(not torch.equal(generator_state(g), before) for g, before in watched)


Watch = Tuple[torch.Generator, Tensor, int]


def _shared_generators(stages: Sequence[StageRunner]) -> List[Watch]:
    """The generators several partitions share, with their states now and the count of
    torchpipe's sections that moved them so far: a reproducible call's seeded forwards give
    each its state back, so one that moved by the call's end, while no other pipeline's
    section drew from it, was drawn from outside them (see `_warn_unseeded_draws`)."""
    shared = {id(g.generator): g.generator for stage in stages for g in stage.rng.guards if g.lock is not None}
    return [(g, *settled_state(g)) for g in shared.values()]


def _warn_unseeded_draws(watched: List[Watch]) -> None:
    """After a reproducible call: a shared generator that moved was drawn from outside every
    seeded forward, in thread order, so seeded runs may differ from here on. Say so, and seed
    every later forward on it (they then run one at a time, as under a replay error). Not
    checked where another pipeline's unseeded section or step seed drew meanwhile: those
    draws are torchpipe's own, made under the lock, and cannot be told apart."""
    moved = []
    for generator, before, sections in watched:
        now, sections_now = settled_state(generator)
        if sections_now == sections and not torch.equal(now, before):
            moved.append(generator)
    if not moved:
        return
    for generator in moved:
        lock_for_good(generator)
    kinds = sorted({g.device.type for g in moved})
    warnings.warn(
        f"reproducible=True: the {' and '.join(kinds)} random generator moved during this call outside its seeded "
        "forwards: a partition seen not to draw in the step's first forward drew on a later micro-batch (dropout on "
        "some micro-batches only, a layer compiling), or another thread drew from the generator meanwhile. Those "
        "draws followed the threads' order, so a seeded run may not repeat itself from this call on. Every later "
        "forward on that generator is seeded (one at a time); to repeat from the start, make such a layer draw on "
        "every micro-batch", RuntimeWarning, stacklevel=first_frame_outside_torchpipe())


_OWN_ATTRIBUTES = ("balance", "devices", "chunks", "checkpoint", "_chunks", "_checkpoint", "deferred_batch_norm",
                   "spread_tuples", "reproducible", "_reproducible", "intra_op_threads", "_balance", "_devices",
                   "_deferred_batch_norm", "_spread_tuples",
                   "last_memory", "_device_types", "_intra_op_threads", "_given_batch_dims", "_batch_dims")
#: Settings that decide how the layers were split, placed and converted when the Pipe was
#: built: read-only afterwards (see _built_setting).
_BUILD_SETTINGS = ("balance", "devices", "deferred_batch_norm", "spread_tuples", "intra_op_threads")


def _check_reproducible(value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"reproducible must be a bool, got {value!r}")


def _check_child_names(module: nn.Sequential) -> None:
    """ValueError for a child whose name is one of ``Pipe``'s own attributes.

    A ``Pipe`` keeps the model's child names (``pipe.<name>``, state dict keys), so a child
    called ``step`` or ``chunks`` would collide with the method or the setting; torchgpipe
    nests the layers under ``partitions.<i>`` and has no such clash. ``partitions`` itself
    is allowed (see ``_accept_partitioned_keys``).
    """
    taken = (set(dir(Pipe)) | set(_OWN_ATTRIBUTES) | set(Pipe._RUNTIME_STATE)) - {"partitions"}
    clashes = sorted(name for name in module._modules if name in taken)
    if clashes:
        raise ValueError(
            f"the module has children named {clashes}, which are also attributes of Pipe; a Pipe keeps "
            f"the children's names, so rename them (nn.Sequential(OrderedDict(...)) with other names)"
        )


_MOVE_DENIED = "denied to move parameters and buffers, because Pipe should manage device placement"


class MovingDenied(TypeError):
    """Raised when a ``Pipe`` is moved with ``.to()``, ``.cuda()`` or ``.cpu()``: it owns placement."""


def _check_chunks(chunks: Any) -> int:
    value = as_positive_int(chunks)
    if value is None:
        raise ValueError(f"number of chunks must be a positive integer, got {chunks!r}")
    if value > sys.maxsize:  # Tensor.chunk takes a C long: every call would fail naming nothing
        raise ValueError(f"number of chunks must be at most {sys.maxsize}, got {chunks!r}")
    return value


def _check_checkpoint(mode: Any) -> str:
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never' (got {mode!r})")
    return cast(str, mode)


def _resolve_batch_dims(given: Tuple[Any, Any, Any]) -> Tuple[BatchDim, BatchDim, BatchDim]:
    """The input's, output's and target's batch dims from what was given (None: follow the one before).

    The output follows an input batch dim that is one non-negative int, and the target
    follows the output's when that names one non-negative dim. Nothing else is guessed: a
    tuple's items need not come out in the same places, and a dim counted from the end is
    another dim in an output or target of another rank; a ValueError then asks for it.
    """
    input_dim = check_batch_dim(given[0], "batch_dim")
    if given[1] is not None:
        output_dim = check_batch_dim(given[1], "output_batch_dim")
    elif isinstance(input_dim, int) and input_dim >= 0:
        output_dim = input_dim
    else:
        why = ("counts from the end, and the output may have another rank" if isinstance(input_dim, int)
               else "is per item of the input tuple, and the output's items may be others")
        raise ValueError(f"batch_dim={input_dim!r} {why}, so the output's batch dim cannot follow it: pass "
                         "output_batch_dim= (an int, or one int or None per item of an output tuple)")
    if given[2] is not None:
        target_dim = check_batch_dim(given[2], "target_batch_dim")
    else:
        common = common_batch_dim(output_dim)
        if common is None or common < 0:
            raise ValueError(f"output_batch_dim={output_dim!r} names no single dim counted from the start, so the "
                             "target's batch dim cannot follow it: pass target_batch_dim= (an int, or one int or None "
                             "per item of a target tuple)")
        target_dim = common
    return input_dim, output_dim, target_dim


def _resolve_devices(devices: Optional[Sequence[DeviceLike]], partitions: int) -> List[torch.device]:
    if devices is None:
        cuda = get_backend("cuda")
        if cuda.is_available():
            devices = [torch.device("cuda", i) for i in range(cuda.device_count())]
        else:
            return [torch.device("cpu")] * partitions
    if isinstance(devices, (str, torch.device)):
        raise TypeError(f"devices must be a sequence of devices, one per partition, got {devices!r} "
                        f"(for one device: devices=[{str(devices)!r}] * {partitions})")
    if not isinstance(devices, Iterable):
        raise TypeError(f"devices must be a sequence of devices, one per partition, got {devices!r}")
    resolved = [as_device(d) for d in devices]  # every one named, before the count is checked
    if len(resolved) < partitions:
        raise IndexError(
            f"too few devices to hold given partitions (devices: {len(resolved)}, partitions: {partitions})"
        )
    resolved = [usable_device(device) for device in resolved[:partitions]]
    return [get_backend(device).canonical(device) for device in resolved]


def _foreign_skippable_library(layer: nn.Module) -> Optional[str]:
    """The package of a ``@skippable`` class from torchgpipe or fairscale, or None."""
    for cls in type(layer).__mro__:
        if cls.__name__ == "Skippable" and cls.__module__.endswith(".skip.skippable") \
                and not cls.__module__.startswith("torchpipe."):
            return cls.__module__.rsplit(".skip.skippable", 1)[0]
    return None


def _check_skip_routes(module: nn.Sequential, balance: Sequence[int]) -> None:
    """Every skip must be popped in the partition that stashes it or a later one.

    Layers made ``@skippable`` by torchgpipe or fairscale stash into their library's own
    tracker, which torchpipe's pipeline does not carry between partitions: across two or
    more partitions they fail at the first pop ("has not been stashed"), so they are refused
    here, naming the import to change."""
    if len(balance) > 1:
        for name, layer in module.named_modules():
            library = _foreign_skippable_library(layer)
            if library is not None:
                raise TypeError(
                    f"layer {name!r} ({type(layer).__name__}) was made skippable with {library}.skip, whose stashes "
                    f"do not travel between torchpipe's partitions; import skippable, stash, pop (and Namespace) "
                    f"from torchpipe.skip instead (the same API)"
                )
    children = list(module.children())
    groups, start = [], 0
    for size in balance:
        groups.append(nn.Sequential(*children[start : start + size]))
        start += size
    inspect_skip_layout(groups)


def _built_setting(name: str, doc: str, copy: bool = False) -> property:
    """A read-only ``Pipe`` setting, stored as ``_<name>``.

    Why read-only: the layers were split, placed, converted and their workers started with
    these settings; assigning one later would change what the Pipe reports, not what it runs
    (a lost batch-norm update, a balance that is not the real split). ``copy``: a list handed
    out as a copy, so that editing it cannot edit the Pipe's own."""

    def read(self: "Pipe") -> Any:
        value = self.__dict__[f"_{name}"]
        return list(value) if copy else value

    def refuse(self: "Pipe", value: Any) -> None:
        raise AttributeError(
            f"Pipe.{name} is fixed when the Pipe is built (it is {read(self)!r}); got {value!r}. "
            f"Build a new Pipe with {name}={value!r} (load_state_dict carries the parameters over). "
            "The settings that may change between steps are chunks, checkpoint, reproducible and the batch dims"
        )

    return property(read, refuse, doc=doc)


def _mark_failed(record: Optional[StepRecord], previous: Optional[StepRecord], error: BaseException) -> None:
    """Say in ``record``, the step a call ran (if it is not ``previous``: it ran one), that the
    call raised ``error`` in a check after a run that itself ended well: the step failed."""
    if record is not None and record is not previous and record.error is None:
        record.error = describe_error(error)


def _refuse_nested_norms(module: nn.Module) -> None:
    """ValueError for ``deferred_batch_norm=True`` over a ``Pipe`` nested in ``module`` that
    holds batch norms: each call of the inner Pipe (one per outer micro-batch) commits its own
    statistics, so they could not be deferred over the outer mini-batch; and its layers are
    fixed, so a plain norm there could not be converted either."""
    for name, inner in module.named_modules():
        if isinstance(inner, Pipe):
            norms = [n for n, m in inner.named_modules() if isinstance(m, DeferredBatchNorm) or converts(m)]
            if norms:
                raise ValueError(
                    f"deferred_batch_norm=True cannot defer the batch norms of the Pipe nested at {name!r} (its layer "
                    f"{norms[0]!r}{' and more' if len(norms) > 1 else ''}): that Pipe is called once per micro-batch of this "
                    "one and updates its statistics per call. Build the inner Pipe with deferred_batch_norm=True "
                    "and this one without (statistics per outer micro-batch), or nest a plain nn.Sequential")


class _failures_marked_in:
    """Mark ``record`` failed (`_mark_failed`) if the block, a call's work after its run, raises,
    and put back the running statistics the step committed in ``pipe`` (deferred batch norm),
    as a failure inside the run does.

    (A class, not a generator: entered on every call.)"""

    __slots__ = ("record", "pipe", "context")

    def __init__(self, record: Optional[StepRecord], pipe: Optional["Pipe"] = None, context: Any = None) -> None:
        self.record = record
        self.pipe = pipe
        self.context = context

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Optional[BaseException], traceback: Any) -> bool:
        if error is not None:
            _mark_failed(self.record, None, error)
            if self.pipe is not None:
                self.pipe._undo_commits_of(self.context)
        return False  # the error goes on up


class Pipe(nn.Module):
    """Wraps an ``nn.Sequential`` to run it as a GPipe pipeline over worker threads.

    Args:
        module: the ``nn.Sequential`` to split.
        balance: layers per partition. ``None`` groups consecutive children by the device
            they already live on (the constructor form of PyTorch's retired ``Pipe``).
        devices: one device per partition (repeats allowed; CPU partitions share ``'cpu'``).
            Defaults to every CUDA device, or ``'cpu'`` for every partition without CUDA.
        chunks: micro-batches per mini-batch.
        checkpoint: ``'always'``, ``'except_last'`` (default) or ``'never'``.
        deferred_batch_norm: track BatchNorm statistics over the whole mini-batch.
        intra_op_threads: intra-op threads per CPU worker (default: the cores, capped by the caller's own
            thread limit such as ``OMP_NUM_THREADS``, divided evenly). Given, it also keeps a call of one
            micro-batch on the workers; by default such a call on CPU stages runs on the caller's thread.
        batch_dim: where the batch is in the input: one dim for every tensor (``1`` for a
            sequence-first model), or one entry per item of an input tuple, ``None`` for an
            item passed whole to every micro-batch (a shared mask). Default 0.
        output_batch_dim: the same for the output, which is concatenated along it (``None``
            in a tuple: the first micro-batch's item). Default: ``batch_dim`` when that is
            one int >= 0 (checked against each micro-batch's samples); otherwise required.
        target_batch_dim: the same for ``step``'s target. Default: the output's batch dim
            when that names one dim >= 0; otherwise required.
        spread_tuples: a tuple between layers is spread over the next layer's positional
            arguments (PyTorch's retired ``Pipe``: ``forward(self, a, b)``), instead of passed
            as one argument (torchgpipe's convention, the default). ``torchpipe.retired.Pipe``
            sets it.
        reproducible: a seeded run repeats itself, dropout masks included, whatever order
            the worker threads run in. Each call draws one number from the CPU generator, and
            each forward (and ``step``'s loss) draws from states seeded by that number, its
            stage and its micro-batch, then gives the generator its state back. On a shared
            generator that covers the partitions that draw, whose forwards then run one at a
            time. The masks differ from the plain model's (they already do with ``chunks >
            1``). Off by default: partitions with dropout on one CPU then draw in thread order
            and pipeline freely.

    The parameter names stay those of ``module`` (``pipe.state_dict()`` loads into the
    original model and back). Workers start once and are reused; ``close()`` (or ``with``,
    or garbage collection) stops them.
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Optional[Iterable[int]] = None,
        *,
        devices: Optional[Sequence[DeviceLike]] = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        intra_op_threads: Optional[int] = None,
        batch_dim: BatchDim = 0,
        output_batch_dim: Optional[BatchDim] = None,
        target_batch_dim: Optional[BatchDim] = None,
        spread_tuples: bool = False,
        reproducible: bool = False,
    ) -> None:
        super().__init__()
        # Validate everything before touching the module: errors leave no state behind.
        chunks = _check_chunks(chunks)
        given_batch_dims = (batch_dim, output_batch_dim, target_batch_dim)
        batch_dims = _resolve_batch_dims(given_batch_dims)
        checkpoint = _check_checkpoint(checkpoint)
        if not isinstance(deferred_batch_norm, bool):
            raise TypeError(f"deferred_batch_norm must be a bool, got {deferred_batch_norm!r}")
        if not isinstance(spread_tuples, bool):
            raise TypeError(f"spread_tuples must be a bool, got {spread_tuples!r}")
        _check_reproducible(reproducible)
        verify_module(module, spread_tuples)
        _check_child_names(module)
        budget = ThreadBudget(intra_op_threads)
        if len(module) == 0:
            raise BalanceError("the module is an empty nn.Sequential: there are no layers to split into partitions")
        if balance is None:
            if devices is not None:
                raise ValueError(f"balance is required when devices are given: {_BALANCE_HINT}")
            balance_list, device_list = infer_placement(module)
            if len(balance_list) == 1:
                raise ValueError(
                    "balance is required: the module's children are all on one device, so there is "
                    f"nothing to split by placement; {_BALANCE_HINT}"
                )
        else:
            balance_list = verify_balance(balance, len(module))
            device_list = _resolve_devices(devices, len(balance_list))

        verify_skippables(module)
        _check_skip_routes(module, balance_list)

        if deferred_batch_norm:
            _refuse_nested_norms(module)
        undo_conversion = _undo_for(module) if deferred_batch_norm else None
        try:
            if deferred_batch_norm:
                module = DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
            partitions, named = split_module(module, balance_list, device_list, spread_tuples)
        except BaseException:
            if undo_conversion is not None:  # a refused Pipe leaves the user's model as it was
                undo_conversion()
            raise
        for name, layer in named:
            self.add_module(name, layer)
        self._balance: List[int] = list(balance_list)
        self._devices: List[torch.device] = list(device_list)
        self._device_types = sorted({d.type for d in device_list})
        self.chunks = chunks
        self.checkpoint = checkpoint
        self._deferred_batch_norm = deferred_batch_norm
        self._spread_tuples = spread_tuples
        self.reproducible = reproducible
        self._given_batch_dims = given_batch_dims
        self._batch_dims = batch_dims
        object.__setattr__(self, "partitions", fixed_partitions(partitions))

        self._intra_op_threads = budget.intra_op_threads
        self.last_memory: Optional[MemoryRecord] = None  # what the last Pipe.step saved for backward
        self.register_load_state_dict_pre_hook(_accept_partitioned_keys)
        self._start_workers()

    # What a running Pipe holds besides its model: threads, queues, locks, compiled programs.
    # Not copied or pickled; a copy (deepcopy, unpickling) starts workers of its own.
    _RUNTIME_STATE = ("_workers", "_runtime", "_stages", "_programs", "_last_run", "_step_lock", "_finalizer",
                      "_gradient_sync")

    def _start_workers(self) -> None:
        device_list = self._devices
        partitions = list(self.partitions)
        threads = self._intra_op_threads
        if threads is not None:
            # Checked against the cores when it was given; a copy or an unpickled Pipe may
            # start on a machine (or an affinity mask) with fewer: use at most those.
            threads = min(threads, available_cores())
        workers = spawn_workers(device_list, name="torchpipe-stage", budget=ThreadBudget(threads))
        try:
            self._workers: List[Worker] = workers
            self._runtime = Runtime(workers)
            counts: Dict[torch.device, int] = {}
            for device in device_list:
                counts[device] = counts.get(device, 0) + 1
            # Every partition may draw on the host (an accelerator one too): with two or more,
            # the CPU generator is shared.
            host_shared = len(device_list) > 1
            self._stages = [
                StageRunner(i, partition, device, worker,
                            rng_shared=counts[device] > 1 or (device.type == "cpu" and host_shared),
                            host_rng_shared=host_shared)
                for i, (partition, device, worker) in enumerate(zip(partitions, device_list, workers))
            ]
        except BaseException:  # no finalizer owns the threads yet: stop them here
            stop_workers(workers)
            raise
        self._programs: Dict[Tuple[Any, ...], Tuple[Plan, Program]] = {}
        self._last_run: Optional[Tuple[Plan, StepRecord]] = None  # set together, read by last_report
        self._step_lock = CallLock()
        self._gradient_sync: Any = None  # a torchpipe.GradientSync attaches itself here
        self._finalizer = stopped_with(self, workers)

    def __getstate__(self) -> Dict[str, Any]:
        """The model and settings, without threads: ``copy.deepcopy(pipe)`` (an EMA copy, say) and
        pickling work, and the copy runs on workers of its own."""
        state = self.__dict__.copy()
        for name in self._RUNTIME_STATE:
            state.pop(name, None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state.setdefault("_given_batch_dims", (0, None, None))  # pickled before batch dims existed
        state.setdefault("_batch_dims", (0, 0, 0))
        for name in _BUILD_SETTINGS:  # pickled while these were plain attributes
            if name in state:
                state[f"_{name}"] = state.pop(name)
        state.setdefault("_spread_tuples", False)
        super().__setstate__(state)
        object.__setattr__(self, "partitions", fixed_partitions(self.partitions))  # pickled before they were fixed
        self._start_workers()

    # ------------------------------------------------------------------ the layers are fixed
    def __setattr__(self, name: str, value: Any) -> None:
        if "partitions" in self.__dict__ and (isinstance(value, nn.Module) or name in self._modules):
            self._refuse_layer_change(name)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if "partitions" in self.__dict__ and name in self._modules:
            self._refuse_layer_change(name, "deleted")
        super().__delattr__(name)

    def add_module(self, name: str, module: Optional[nn.Module]) -> None:
        """Refused once the Pipe is built (see :meth:`_refuse_layer_change`); ``register_module`` too."""
        if "partitions" in self.__dict__:
            self._refuse_layer_change(name)
        super().add_module(name, module)

    def _refuse_layer_change(self, name: str, how: str = "") -> None:
        """Why: the partitions, and the worker that runs each, were built from the layers the
        Pipe was given. A module set, added or deleted on the Pipe later would show in
        ``pipe[i]``, ``parameters()`` and ``state_dict()`` but never run (an optimizer would
        train weights the pipeline does not use). Changes *inside* a layer do run."""
        known = name in self._modules
        what = f"layer {name!r}" if known else f"a module as attribute {name!r}"
        raise layers_fixed_error(what, how or ("replaced" if known else "added"))

    def __setitem__(self, index: Union[int, slice], module: Any) -> None:
        """Refused, as ``setattr`` of a layer is (see :meth:`_refuse_layer_change`)."""
        raise layers_fixed_error(self._described(index), "replaced")

    def __delitem__(self, index: Union[int, slice]) -> None:
        """Refused, as ``delattr`` of a layer is (see :meth:`_refuse_layer_change`)."""
        raise layers_fixed_error(self._described(index), "deleted")

    def _described(self, index: Any) -> str:
        """``pipe[index]`` with the names of the layers it selects, for a refusal that names them."""
        names = list(self._modules)
        try:
            selected = names[index] if isinstance(index, slice) else [names[operator.index(index)]]
        except (TypeError, IndexError):
            selected = []
        if isinstance(index, slice):
            shown = ":".join("" if part is None else str(part) for part in (index.start, index.stop, index.step))
            shown = shown[:-1] if index.step is None else shown
        else:
            shown = repr(index)
        named = f" (layer{'s' if len(selected) > 1 else ''} {', '.join(map(repr, selected))})" if selected else ""
        return f"pipe[{shown}]{named}"

    # ------------------------------------------------------------------ Sequential-like access
    def __len__(self) -> int:
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: Union[int, slice]) -> nn.Module:
        """The layer at ``index``; a slice gives the layers as a plain ``nn.Sequential`` (runs on the caller).

        With ``spread_tuples`` the slice is a :class:`SpreadingSequential`, which calls its
        layers the same way the pipeline does.
        """
        named = list(self._modules.items())  # the layers, under their names in the original model
        if isinstance(index, slice):
            container = SpreadingSequential if self.spread_tuples else nn.Sequential
            return container(OrderedDict(named[index]))
        position = operator.index(index)  # a TypeError for a str or float, as nn.Sequential gives
        if not -len(named) <= position < len(named):
            raise IndexError(f"index {index} is out of range for a Pipe of {len(named)} layers")
        return named[position][1]

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition

    def train(self, mode: bool = True) -> "Pipe":
        """Like ``nn.Module.train``; the partition containers (``pipe.partitions[i]``) follow too."""
        super().train(mode)
        self.partitions.train(mode)
        return self

    # ------------------------------------------------------------------ placement is ours
    def cuda(self, device: Any = None) -> "Pipe":  # type: ignore[override]
        raise MovingDenied(_MOVE_DENIED)

    def cpu(self) -> "Pipe":  # type: ignore[override]
        raise MovingDenied(_MOVE_DENIED)

    def xpu(self, device: Any = None) -> "Pipe":  # type: ignore[override]
        raise MovingDenied(_MOVE_DENIED)

    def mtia(self, device: Any = None) -> "Pipe":  # type: ignore[override]
        raise MovingDenied(_MOVE_DENIED)

    def ipu(self, device: Any = None) -> "Pipe":  # type: ignore[override]
        raise MovingDenied(_MOVE_DENIED)

    def to_empty(self, *, device: Any, recurse: bool = True) -> "Pipe":  # type: ignore[override]
        raise MovingDenied(_MOVE_DENIED)

    def to(self, *args: Any, **kwargs: Any) -> "Pipe":  # type: ignore[override]
        # Deny device moves; dtype casts (pipe.to(torch.float64)) are fine.
        if kwargs.get("device") is not None or "tensor" in kwargs:  # device=None moves nothing, as in to(None, ...)
            raise MovingDenied(_MOVE_DENIED)
        if args:
            first = args[0]
            if isinstance(first, (torch.device, int, str, Tensor)):
                raise MovingDenied(_MOVE_DENIED)
        return super().to(*args, **kwargs)

    # ------------------------------------------------------------------ planning
    def plan(self, num_microbatches: Optional[int] = None, schedule: Union[str, type] = "1f1b", **options: Any) -> Plan:
        """The plan ``step(..., schedule=schedule, **options)`` runs on ``num_microbatches``.

        The defaults are ``step``'s: ``chunks`` micro-batches and ``'1f1b'``. A batch may
        give fewer micro-batches than ``chunks`` (``Tensor.chunk`` rules: 6 samples in 4
        chunks give 3); its step runs ``plan(3, ...)``. The plan of a forward call ``pipe(x)``
        is ``plan(m, "gpipe", backward=False)``.
        """
        m = self.chunks if num_microbatches is None else num_microbatches
        return build(schedule, len(self.partitions), m, **options)

    def _forward_program(self, num_microbatches: int) -> Tuple[Plan, Program]:
        key = ("forward", num_microbatches)
        cached = self._programs.get(key)
        if cached is None:
            plan = build("gpipe", len(self.partitions), num_microbatches, backward=False)
            cached = self._programs[key] = (plan, lower_forward(plan, self._stages))
        return cached

    def _step_program(
        self, schedule: Union[str, Plan], num_microbatches: int, options: Dict[str, Any]
    ) -> Tuple[Plan, Program]:
        # Each value's type is part of the key: 2.0 == 2 and hash alike, but only build() may
        # say whether 2.0 is a valid virtual_stages, and a cached 2 must not answer for it.
        # A Plan is its own key (frozen, compared by value).
        key: Optional[Tuple[Any, ...]] = (
            ("plan", schedule) if isinstance(schedule, Plan)
            else ("step", schedule, num_microbatches, tuple(sorted((k, type(v), v) for k, v in options.items())))
        )
        if isinstance(schedule, Plan):  # its sizes against this batch, on every call: cached or not
            self._check_plan_fits(schedule, num_microbatches)
        try:
            cached = self._programs.get(key)  # type: ignore[arg-type]
        except TypeError:  # an unhashable option value: let build() name what it expected
            key, cached = None, None
        if cached is not None:
            return cached
        if isinstance(schedule, Plan):
            plan = schedule
            plan.validate()  # a Plan built directly has not been checked yet
            described = f"plan {plan.name!r}"
        else:
            plan = build(schedule, len(self.partitions), num_microbatches, **options)
            described = f"schedule {schedule!r} with options {options}"
        if not plan.has_backward:
            raise InvalidPlanError(f"{described} has no backward actions; Pipe.step needs one")
        for stage, worker in enumerate(plan.stage_to_worker):
            if self._devices[stage] != self._devices[worker]:
                raise InvalidPlanError(
                    f"{described} runs stage {stage} on the worker of partition {worker}, so both "
                    f"partitions must be on one device (got {self._devices[stage]} and {self._devices[worker]})"
                )
        stages = [stage.on_worker(self._stages[worker]) for stage, worker in zip(self._stages, plan.stage_to_worker)]
        program = lower_step(plan, stages)
        if key is not None:
            if len(self._programs) >= 64:  # plans of the caller's own: keep the cache bounded
                self._programs.clear()
            self._programs[key] = (plan, program)
        return plan, program

    def _check_plan_fits(self, plan: Plan, num_microbatches: int) -> None:
        """`InvalidPlanError` (a ValueError) unless this Pipe can run ``plan`` on ``num_microbatches``."""
        partitions = len(self.partitions)
        if plan.num_stages != partitions:
            raise InvalidPlanError(f"plan {plan.name!r} has {plan.num_stages} stages, but this Pipe has "
                                   f"{partitions} partitions: a plan runs one stage per partition")
        if plan.num_workers > partitions:
            raise InvalidPlanError(f"plan {plan.name!r} has {plan.num_workers} workers, but this Pipe has "
                                   f"{partitions} partitions, each with one worker thread")
        if plan.num_microbatches != num_microbatches:
            wanted = plan.num_microbatches
            if wanted > self.chunks:  # no batch splits into more than chunks micro-batches
                advice = f"set pipe.chunks = {wanted} (it may change between steps), or build the plan for " \
                         f"{num_microbatches}"
            else:
                advice = f"build the plan for {num_microbatches}, or pass a batch that gives {wanted}"
            raise InvalidPlanError(
                f"plan {plan.name!r} is for {wanted} micro-batches, but this batch splits into "
                f"{num_microbatches} (chunks={self.chunks}, Tensor.chunk rules); {advice}"
            )

    balance = _built_setting("balance", "Layers per partition, as built (a copy: the split is fixed once the Pipe "
                                        "exists).", copy=True)
    devices = _built_setting("devices", "Each partition's device, as built (a copy: placement is fixed once the "
                                        "Pipe exists).", copy=True)
    deferred_batch_norm = _built_setting("deferred_batch_norm", "Whether BatchNorm layers were converted to track "
                                                                "statistics over the mini-batch.")
    spread_tuples = _built_setting("spread_tuples", "Whether a tuple between layers is spread over the next layer's "
                                                    "arguments.")
    intra_op_threads = _built_setting("intra_op_threads", "Intra-op threads each CPU worker may use (the workers were "
                                                          "started with it).")

    @property
    def chunks(self) -> int:
        """Micro-batches per mini-batch (at most: ``Tensor.chunk`` rules); may be changed between steps."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: Any) -> None:
        self._chunks = _check_chunks(value)

    @property
    def checkpoint(self) -> str:
        """``'always'``, ``'except_last'`` or ``'never'``; may be changed between steps."""
        return self._checkpoint

    @checkpoint.setter
    def checkpoint(self, value: Any) -> None:
        self._checkpoint = _check_checkpoint(value)

    @property
    def reproducible(self) -> bool:
        """Whether seeded runs repeat themselves (see the class docstring); may be changed between steps."""
        return self.__dict__.get("_reproducible", False)  # a Pipe pickled before the option had it off

    @reproducible.setter
    def reproducible(self, value: Any) -> None:
        _check_reproducible(value)
        self._reproducible = value

    def _set_batch_dim(self, position: int, value: Any) -> None:
        given = list(self._given_batch_dims)
        given[position] = value
        self._batch_dims = _resolve_batch_dims((given[0], given[1], given[2]))  # nothing changes if it raises
        self._given_batch_dims = (given[0], given[1], given[2])

    @property
    def batch_dim(self) -> BatchDim:
        """Where the batch is in the input (see the class docstring); may be changed between steps."""
        return self._batch_dims[0]

    @batch_dim.setter
    def batch_dim(self, value: Any) -> None:
        self._set_batch_dim(0, value)

    @property
    def output_batch_dim(self) -> BatchDim:
        """Where the batch is in the output; set None to follow ``batch_dim`` again."""
        return self._batch_dims[1]

    @output_batch_dim.setter
    def output_batch_dim(self, value: Any) -> None:
        self._set_batch_dim(1, value)

    @property
    def target_batch_dim(self) -> BatchDim:
        """Where the batch is in ``step``'s target; set None to follow ``output_batch_dim`` again."""
        return self._batch_dims[2]

    @target_batch_dim.setter
    def target_batch_dim(self, value: Any) -> None:
        self._set_batch_dim(2, value)

    @property
    def last_step(self) -> Optional[StepRecord]:
        """Timings of the most recent step: ``bubble_ratio``, ``chrome_trace()``.

        Its ``error`` is None when the call returned; otherwise it names what the call raised,
        and the record holds the actions that ran until then. A call refused before its plan
        started (bad input) leaves the record of the step before it.
        """
        return self._runtime.last_step

    def last_report(self) -> StepReport:
        """The most recent completed step next to its plan fed the measured durations.

        Measured makespan and bubble beside the makespan and bubble the same plan reaches
        with these action durations and free hand-offs (see :class:`StepReport`). Raises
        RuntimeError before any step, ValueError if the last step failed (``last_step.error``;
        a call refused before its plan started is no step and leaves the report as it was).
        """
        last = self._last_run
        if last is None:
            raise RuntimeError("no step has run on this Pipe yet: call it or its step() first")
        return report(*last)

    # ------------------------------------------------------------------ running
    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """Run ``input`` through the pipeline: micro-batches, worker threads, gathered output
        (one micro-batch on CPU stages runs on this thread: nothing could overlap)."""
        if _compiling():
            return _outside_compile(Pipe.forward)(self, input)
        refuse_untransferable_state("pipe(x)")
        if not self._finalizer.alive:
            raise RuntimeError("this Pipe is closed")
        if self._gradient_sync is not None and self.training and records_graphs():
            self._gradient_sync.warn_forward_unsynchronised()
        input_dim, output_dim, _ = self._batch_dims
        batches = scatter(input, self.chunks, input_dim)
        sizes = self._followed_samples(batches)
        outputs, context = self._forward_batches(batches)
        if len(outputs) == 1:  # nothing to join
            return outputs[0].value
        with _failures_marked_in(context.record, self, context), leave_autocast(self._device_types):  # the join is no part of the forward
            return gather(outputs, output_dim, sizes)

    def _followed_samples(self, batches: List[Batch]) -> Optional[List[int]]:
        """Each micro-batch's samples, when the output's batch dim was not given but follows a
        batch dim other than 0 (see :func:`~torchpipe.microbatch.check_joins`); else None."""
        if self._given_batch_dims[1] is not None or self._batch_dims[1] == 0:
            return None
        return [samples(batch, self._batch_dims[0]) for batch in batches]

    def _forward_batches(self, batches: List[Batch]) -> Tuple[List[Batch], ForwardContext]:
        """Each micro-batch's output, in micro-batch order, ready on the caller's stream; and
        the step's context, with its record (for a check after the run to mark the step failed
        and undo its commits)."""
        m = len(batches)
        if self.training and records_graphs():
            stop = {"always": m, "except_last": m - 1, "never": 0}[self.checkpoint]
        else:
            stop = 0
        context = ForwardContext(batches, self._input_events(batches), stop)
        plan, program = self._forward_program(m)
        outputs = self._run(plan, program, context)  # in micro-batch order (lower_forward)
        if self._deferred_batch_norm and is_recomputing():
            # Another pipeline's checkpointed stage holds this Pipe and recomputes it: its first
            # forward committed the statistics already (this Pipe's workers cannot see the
            # caller's recompute, so its norms committed again).
            self._undo_commits_of(context)
        with _failures_marked_in(context.record, self, context):
            return self._hand_back(outputs), context

    def evaluate(
        self,
        input: TensorOrTensors,
        target: Any,
        loss_fn: Any,
        *,
        reduction: Optional[str] = None,
        return_outputs: bool = False,
        losses: Optional[List[Tensor]] = None,
        loss_kwargs: Optional[Dict[str, Any]] = None,
    ) -> Union[Tensor, Tuple[Tensor, TensorOrTensors]]:
        """The loss of a validation batch, pipelined like ``pipe(x)``, without gradients.

        What torch's pipelining schedules call ``eval(x, target=, losses=)`` (``nn.Module``
        already owns the name ``eval``): every micro-batch goes forward through the pipeline
        under ``no_grad`` and its loss is taken as it comes out, with the micro-batch weights
        of :meth:`step`, so the result equals ``loss_fn(model(input), target)`` and
        ``losses``/``return_outputs``/``loss_kwargs`` mean what they mean there. The train/eval mode is
        yours: call ``pipe.eval()`` first for dropout off and batch norm's running statistics.
        """
        if _compiling():
            return _outside_compile(Pipe.evaluate)(self, input, target, loss_fn, reduction=reduction,
                                                   return_outputs=return_outputs, losses=losses,
                                                   loss_kwargs=loss_kwargs)
        refuse_untransferable_state("Pipe.evaluate")
        if not self._finalizer.alive:
            raise RuntimeError("this Pipe is closed")
        self._refuse_own_hooks("Pipe.evaluate")
        reduction = _check_loss_arguments(loss_fn, reduction, return_outputs, losses, loss_kwargs,
                                          self._batch_dims[1])
        _refuse_dataless(target, "target", self._devices[-1])
        input_dim, output_dim, target_dim = self._batch_dims
        with torch.no_grad():
            batches = scatter(input, self.chunks, input_dim)
            targets = split_targets(target, batch_size(input, input_dim), len(batches), self.chunks, target_dim)
            scales = microbatch_weights(loss_fn, reduction, batches, targets, input_dim, loss_kwargs)
            sizes = self._followed_samples(batches)
            outputs, context = self._forward_batches(batches)
        with _failures_marked_in(context.record, self, context):  # its plan ran: a failure now fails the step
            each = self._evaluated_losses(outputs, targets, _loss_call(loss_fn, loss_kwargs))
            with leave_autocast(self._device_types):  # as after the recipe's autocast block
                total = _weighted_total(each, scales)
                gathered = gather(outputs, output_dim, sizes) if return_outputs else None  # may fail: before losses
        if losses is not None:
            losses[:] = each
        if return_outputs:
            return total, gathered
        return total

    def _evaluated_losses(self, outputs: List[Batch], targets: List[Any], loss_call: Callable[..., Any]) -> List[Tensor]:
        """``evaluate``'s loss of each micro-batch, on the caller's thread, without gradients."""
        each = []
        with torch.no_grad():
            for output, part in zip(outputs, targets):
                if isinstance(part, Tensor):  # where the output is (nested in it, or else the last stage's device)
                    part = part.to(next((t.device for t in nested_tensors(output.values)), self._devices[-1]))
                each.append(scalar_loss(loss_call(output.value, part), backward=False).detach())
        return each

    def step(
        self,
        input: TensorOrTensors,
        target: Any,
        loss_fn: Any,
        schedule: Union[str, type, Plan] = "1f1b",
        *,
        reduction: Optional[str] = None,
        return_outputs: bool = False,
        losses: Optional[List[Tensor]] = None,
        loss_kwargs: Optional[Dict[str, Any]] = None,
        **options: Any,
    ) -> Union[Tensor, Tuple[Tensor, TensorOrTensors]]:
        """Forward, loss and backward of every micro-batch, all on the workers, in plan order.

        Returns the loss of the whole mini-batch (detached) and leaves every parameter's
        ``.grad`` as ``loss_fn(model(input), target).backward()`` would. Micro-batch ``i``
        of ``n_i`` samples out of ``N`` is back-propagated with weight ``n_i / N`` when the loss
        averages over samples (``reduction='mean'``, the default, read from
        ``loss_fn.reduction`` when it has one) and with weight 1 when it sums
        (``reduction='sum'``). ``CrossEntropyLoss`` and ``NLLLoss`` (or their functional
        forms, configured through ``loss_kwargs``) with class-index targets
        average over their class-weighted targets that are not ``ignore_index``: their
        micro-batches are weighted by that count instead (see ``torchpipe.step_inputs``;
        read through ``torch.compile`` and a keywords-only ``functools.partial``); a
        custom loss that normalises otherwise should sum, with ``reduction='sum'``, and
        divide the result. ``target`` is split along ``target_batch_dim`` (dim 0, or the
        output's batch dim when that was set) and must have the input's batch size there;
        samples are counted along ``batch_dim``. ``schedule`` is one of
        ``torchpipe.schedule.SCHEDULES`` or torch's pipelining name or class for one of them
        (``"Interleaved1F1B"``, ``Schedule1F1B``: see ``torchpipe.schedule.schedule_name``);
        ``options`` go to the plan (``virtual_stages`` for interleaved schedules). It may
        also be a :class:`~torchpipe.schedule.Plan` of your own (``Plan.from_lists``,
        ``Plan.load_csv``, ``Plan.from_torch``): one stage per partition, and as many
        micro-batches as this batch gives; it runs exactly as written.

        With ``return_outputs=True`` it returns ``(loss, output)``: the model's output for
        the whole mini-batch, detached and gathered as ``pipe(x)`` gathers it (for metrics,
        without a second forward); the last stage then keeps its outputs until the step ends.

        ``losses``: a list that, once the step has succeeded, holds each micro-batch's own
        loss (detached, before its weight), in micro-batch order, as in torch's pipelining
        ``step(..., losses=)``; its old items are removed.

        ``loss_kwargs``: keyword arguments for every micro-batch's ``loss_fn(output, target,
        **loss_kwargs)``, passed as they are (not split: a per-sample tensor belongs in the
        target), as torch's pipelining ``step(..., loss_kwargs=)`` passes them.
        """
        if _compiling():
            return _outside_compile(Pipe.step)(self, input, target, loss_fn, schedule, reduction=reduction,
                                               return_outputs=return_outputs, losses=losses,
                                               loss_kwargs=loss_kwargs, **options)
        sync = self._gradient_sync
        ticket = sync.ticket() if sync is not None else None
        try:
            refuse_untransferable_state("Pipe.step")
            return self._step(input, target, loss_fn, schedule, reduction, return_outputs, losses, loss_kwargs,
                              options, ticket)
        finally:
            if ticket is not None:  # a call refused before it ran counts too: the ranks compare counts
                ticket.settle()

    def _step(self, input: TensorOrTensors, target: Any, loss_fn: Any, schedule: Union[str, type, Plan],
              reduction: Optional[str], return_outputs: bool, losses: Optional[List[Tensor]],
              loss_kwargs: Optional[Dict[str, Any]], options: Dict[str, Any],
              ticket: Any) -> Union[Tensor, Tuple[Tensor, TensorOrTensors]]:
        """``step``'s work; ``ticket``: its place in a `GradientSync`'s call count, or None."""
        if not self._finalizer.alive:
            raise RuntimeError("this Pipe is closed")
        self._refuse_own_hooks("Pipe.step")
        reduction = _check_loss_arguments(loss_fn, reduction, return_outputs, losses, loss_kwargs,
                                          self._batch_dims[1])
        if isinstance(schedule, Plan):
            if options:
                raise TypeError(f"options {sorted(options)} configure a named schedule; a Plan is already built, "
                                "so pass none with it")
        else:
            schedule = resolve_schedule(schedule, SCHEDULES, besides="a torchpipe.schedule.Plan")
            # gpipe's backward=False builds a forward-only plan, which a training step refuses:
            # accepted (backward=True is harmless), not advertised.
            takes = [option for option in schedule_options(schedule) if option != "backward"]
            unknown = sorted(set(options) - set(schedule_options(schedule)))
            if unknown:
                raise TypeError(f"Pipe.step got unexpected keyword argument(s) {unknown}: its own are reduction, "
                                f"return_outputs, losses and loss_kwargs, and schedule {schedule!r} takes "
                                f"{takes or 'no options'}")
        if not records_graphs():
            where = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
            raise RuntimeError(f"Pipe.step computes gradients; it cannot run under {where}")
        _refuse_dataless(target, "target", self._devices[-1])
        upstream = Upstream()
        input, target = upstream.cut(input), upstream.cut(target)
        if loss_kwargs:  # a tensor computed before the step, shared by every micro-batch's loss
            loss_kwargs = upstream.cut(loss_kwargs)
        input_dim, output_dim, target_dim = self._batch_dims
        batches = scatter(input, self.chunks, input_dim)
        size = batch_size(input, input_dim)
        if size == 0:
            raise ValueError(f"the input batch is empty (0 samples along batch_dim={input_dim!r}): there is no loss "
                             "to back-propagate")
        last_device = self._devices[-1]
        if isinstance(target, torch.Tensor) and target.device != last_device and target.device.type != "cpu":
            # An accelerator target goes to the loss's device here, on the caller's streams,
            # which the workers' streams wait for: a worker thread copying it would use its own
            # current stream of the target's device, unordered with the caller's.
            target = target.to(last_device)
        targets = split_targets(target, size, len(batches), self.chunks, target_dim)
        scales = microbatch_weights(loss_fn, reduction, batches, targets, input_dim, loss_kwargs)
        m = len(batches)
        stop = {"always": m, "except_last": m - 1, "never": 0}[self.checkpoint] if self.training else 0
        plan, program = self._step_program(schedule, m, options)
        context = StepContext(batches, targets, self._input_events(batches), _loss_call(loss_fn, loss_kwargs), scales, stop, len(self._stages),
                              keep_outputs=return_outputs, output_batch_dim=output_dim,
                              output_samples=self._followed_samples(batches) if return_outputs else None,
                              sync_ticket=ticket, stage_to_worker=plan.stage_to_worker)
        self._run(plan, program, context, step_leaves=self._step_leaves(input, target, loss_fn, loss_kwargs))
        # The recipe's backward and totals come after its autocast block.
        with _failures_marked_in(context.record, self, context), leave_autocast(self._device_types):
            return self._finish_step(context, upstream, scales, output_dim, losses, return_outputs)

    def _finish_step(self, context: StepContext, upstream: Upstream, scales: List[float], output_dim: BatchDim,
                     losses: Optional[List[Tensor]], return_outputs: bool) -> Any:
        """What ``step`` does once its plan ran: the loss total, the outputs, the input's backward."""
        if not any(context.loss_has_graph):
            # The plain model's loss.backward() refuses such a loss too; nothing was changed.
            raise RuntimeError(
                "loss_fn returned no loss with a graph in any micro-batch (none requires grad or has a "
                "grad_fn), so there is nothing to back-propagate: do the model's parameters or its input "
                "require grad? (a micro-batch whose loss is a constant, a fully masked one say, is "
                "allowed when another micro-batch's loss has a graph)")
        # Checked on the workers already (check_joins, why_not_gatherable), before any gradient was kept.
        gathered = gather(cast(List[Batch], context.outputs), output_dim) if return_outputs else None
        upstream.backward()
        object.__setattr__(self, "last_memory", context.memory)  # a plain attribute (see _last_run)
        each = cast(List[Tensor], context.losses)
        total = _weighted_total(each, scales)
        if losses is not None:
            losses[:] = each
        if return_outputs:
            return total, gathered
        return total

    def _refuse_own_hooks(self, method: str) -> None:
        """RuntimeError if hooks are registered on the Pipe itself: ``step`` and ``evaluate`` do
        not call the Pipe as a module (each micro-batch goes through the layers), so those hooks
        would be skipped silently, a pre-hook that transforms the input among them."""
        kinds = [kind for kind, hooks in (("forward pre-hook", self._forward_pre_hooks),
                                          ("forward hook", self._forward_hooks),
                                          ("backward pre-hook", self._backward_pre_hooks),
                                          ("full backward hook", self._backward_hooks)) if hooks]
        if kinds:
            raise RuntimeError(
                f"{method} cannot run this Pipe's own module hooks ({', '.join(kinds)} registered on the Pipe): it "
                "runs each micro-batch through the layers, not the Pipe as one module, so they would be skipped. "
                "Register them on a layer instead (pipe[0] sees the input, pipe[-1] the output), or remove them "
                "(the handle's remove()); pipe(x) does run them"
            )

    def _step_leaves(self, input: Any, target: Any, loss_fn: Any, loss_kwargs: Optional[Dict[str, Any]]) -> List[Tensor]:
        """What a ``Pipe.step`` may give a ``.grad``: the parameters, the loss module's, and
        the tensors that require grad in the input, the target and ``loss_kwargs``."""
        leaves = parameters_in_order(self)
        if isinstance(loss_fn, nn.Module):
            leaves += parameters_in_order(loss_fn)
        leaves += [tensor for tensor in _tensors_in((input, target, loss_kwargs)) if tensor.requires_grad and tensor.is_leaf]
        return leaves

    def _run(self, plan: Plan, program: Program, context: Any,
             step_leaves: Optional[List[Tensor]] = None) -> List[Any]:
        """Run one step's program with the worker streams fenced against the caller's stream;
        returns its kept results in job order (`Runtime.run_kept`).

        One step at a time per Pipe: what a step sets up on the Pipe (deferred batch norm's
        micro-batch count, the RNG guards, the plan ``last_report`` reads) is set under the
        same lock as the run, so a call from another thread cannot change it mid-step.

        On accelerators each worker computes on its own stream: those streams first wait for
        what the caller queued (parameter updates), and the caller's stream then waits for
        everything the step queued (gradients, losses, memory the step freed), also when
        the step fails. On the CPU the fences are no-ops.

        ``step_leaves`` (a ``Pipe.step``): a failure in a later micro-batch (a bad target,
        say) comes after earlier ones ran backward, where the plain model fails before any;
        the gradients the step created on these tensors go again (what it added to existing
        ``.grad`` tensors cannot be told apart). Read under the lock: another thread's
        step, done meanwhile, keeps its gradients.
        """
        inline = self._runs_on_the_callers_thread(program, context)
        if not inline:  # a profiler that records this thread sees the whole of an inline call
            warn_if_the_profiler_records_this_thread_only()  # before any state changes: it may be an error
        self._runtime.refuse_if_forked()  # before anything changes, as the next check
        self._runtime.refuse_worker_caller()  # before the lock: a stage calling its own Pipe
        return self._step_lock.call(self._run_holding_lock, plan, program, context, step_leaves, inline)

    def _runs_on_the_callers_thread(self, program: Program, context: Any) -> bool:
        """Whether this call's program runs on the calling thread (`Runtime.run`'s ``inline_chains``).

        Only a program that is one chain (no two jobs could overlap), on CPU stages (no streams
        to run on), when no ``intra_op_threads`` was given (that count applies on the workers),
        and not inside ``torch.utils.checkpoint`` (or another Pipe's checkpointed stage): there
        the stages would save their tensors through the checkpoint's hooks, whose early stop
        raises inside the recompute's last stage, and the Pipe keeps its own saved tensors on
        its workers instead (guide, section 7). Forwards that hold a generator's lock
        (checkpointing, ``reproducible``) may run here: a Ctrl-C, which lands on this thread
        only, gives the lock back (`call_chain.HeldLock`), as in a backward's recompute.
        """
        return (program.chain_order is not None and self._device_types == ["cpu"]
                and self._intra_op_threads is None
                and not in_torch_checkpoint())

    def _run_holding_lock(self, plan: Plan, program: Program, context: Any,
                          step_leaves: Optional[List[Tensor]], inline: bool) -> List[Any]:
        """``_run``'s step itself, under ``_step_lock``."""
        if not self._finalizer.alive:  # closed by another thread since the caller's check
            raise RuntimeError("this Pipe is closed")
        self._adopt_layer_changes()
        previous = self._runtime.last_step
        without_grad = []
        if step_leaves is not None:
            object.__setattr__(self, "last_memory", None)  # set again by a step that completes
            without_grad = [t for t in step_leaves if t.grad is None]
        self._prepare_batch_norm(plan.num_microbatches)
        shared: List[Watch] = []
        if self.reproducible:
            seed_rng(context, draw_step_seed())  # before the watch below: a draw made in order
            shared = _shared_generators(self._stages)
        if context.rng_sections:
            for stage in self._stages:
                stage.rng.begin_step()
        # Called by a checkpointed forward (a layer of another Pipe's checkpointed stage,
        # or inside torch.utils.checkpoint): its recompute will call this Pipe again and
        # must draw the same random numbers. Several partitions draw in an order that
        # depends on thread timing, so draws here cannot be replayed: refuse them.
        replayed = _watched_generators(self._stages)
        ticket = getattr(context, "sync_ticket", None)
        grad_round = None
        try:
            if ticket is not None:  # numbered here, under the lock: in the order the collectives go out
                grad_round = context.grad_round = ticket.sync.round(ticket.take())
            if grad_round is not None:
                grad_round.start()
            device_types = self._device_types
            if device_types == ["cpu"]:  # no streams, nothing to fence
                results = self._runtime.run_kept(program, context, device_types, inline_chains=inline)
            else:
                streams_wait_for_caller(self._worker_streams())
                try:
                    results = self._runtime.run_kept(program, context, device_types)
                finally:
                    caller_waits_for_streams(self._worker_streams())
            if replayed and _moved(replayed):
                raise RuntimeError(
                    f"this Pipe of {len(self._stages)} partitions drew random numbers inside a checkpointed "
                    "forward (another pipeline's checkpointed stage, or torch.utils.checkpoint); its partitions "
                    "draw in no fixed order, so the recompute would redraw differently and give wrong gradients. "
                    "Use checkpoint='never' around it, one partition here, reproducible=True on this Pipe (its draws then "
                    "follow no thread order), or no randomness (dropout) in it"
                )
            if shared:
                _warn_unseeded_draws(shared)
            if grad_round is not None:  # under the lock: the next step must not add to .grad meanwhile
                grad_round.finish(failed=not any(context.loss_has_graph))  # step() raises for that case
            if self._deferred_batch_norm:  # under the lock: what a failure after the run undoes
                context.commit_marks = commit_marks(self)
            return results
        except BaseException as exc:
            _mark_failed(self._runtime.last_step, previous, exc)  # a check after the run: the step failed
            if grad_round is not None:
                try:  # this rank's collectives still go out: the other ranks learn of the failure at once
                    grad_round.finish(failed=True)
                except BaseException:  # noqa: B902 - the step's own error is the one to raise
                    pass
            for tensor in without_grad:
                tensor.grad = None
            if self._deferred_batch_norm:
                undo_commits(self)
            raise
        finally:
            record = self._runtime.last_step
            if record is not None and record is not previous:  # this plan ran (part of it)
                # A plain attribute, set past nn.Module.__setattr__'s checks (once per call), as
                # last_memory is.
                object.__setattr__(self, "_last_run", (plan, record))
                context.record = record  # the call's own record, for a check after the run to mark

    def _undo_commits_of(self, context: Any) -> None:
        """Undo the deferred batch norm commits of the call of ``context`` once its run is over
        (a failure after it, or a recompute's second commit): under the step lock, and only
        in layers no later call committed to since (`commit_marks`)."""
        marks = getattr(context, "commit_marks", None)
        if marks:
            self._step_lock.call(undo_marked_commits, marks)

    def _adopt_layer_changes(self) -> None:
        """Take in what changed inside the layers since the last step (a batch norm added, say).

        Checked as the build checks, before anything changes: a parameter or buffer now shared
        by two layers (two workers would update a running statistic at once) is refused. Under
        ``deferred_batch_norm`` a batch norm added later, or one whose ``track_running_stats``
        was turned on since, is converted, as the build converts those it finds (same
        parameters and buffers); left plain, it would update its running statistics once per
        micro-batch. Then the partitions' layouts are read again.
        """
        deferred = self._deferred_batch_norm
        changed = [stage for stage in self._stages
                   if stage.layout.changed(stage.partition) or (deferred and any(map(converts, stage.layout.norms)))]
        if not changed:
            return
        verify_unshared(list(self._modules.items()), since="a layer changed inside since the Pipe was built: ")
        if deferred:
            self._convert_batch_norms_in(changed)
        for stage in changed:
            stage.layout.read(stage.partition)

    def _convert_batch_norms_in(self, stages: List[StageRunner]) -> None:
        """``deferred_batch_norm``'s conversion of what the layers of ``stages`` hold now; every
        layer is checked before any is converted."""
        layers = [(name, layer) for stage in stages for name, layer in stage.partition.named_children()]
        for name, layer in layers:
            refused = unconvertible_norm(layer)
            if refused is not None:
                inner, norm, why = refused
                if isinstance(norm, LazyModuleMixin):  # the build's advice, for a layer inside a built Pipe
                    index = list(self._modules).index(name)
                    why = (f"it is uninitialized; give it num_features, or run the layer once outside the Pipe in "
                           f"eval mode, which leaves its statistics alone (pipe[{index}].eval(); pipe[{index}](sample); "
                           f"pipe[{index}].train())")
                raise ValueError(f"layer {name!r} holds a {type(norm).__name__} ({name}.{inner}) added since the Pipe "
                                 f"was built, which deferred_batch_norm=True must convert, and cannot: {why}")
            if converts(layer):
                raise ValueError(
                    f"layer {name!r} is a {type(layer).__name__} that tracks running statistics now but did not when "
                    "the Pipe was built, so deferred_batch_norm=True did not convert it, and the layers are fixed once "
                    "built; build the Pipe with track_running_stats on (turned off later, a converted layer keeps "
                    "its statistics as they are)")
        for _, layer in layers:
            DeferredBatchNorm.convert_deferred_batch_norm(layer, self.chunks)

    def _worker_streams(self) -> List[Tuple[torch.device, Any]]:
        """Each distinct (device, stream) the stages queue work on, copy streams included."""
        seen: Dict[int, Tuple[torch.device, Any]] = {}
        for stage in self._stages:
            for device, stream in stage.streams():
                seen.setdefault(id(stream), (device, stream))
        return list(seen.values())

    def _prepare_batch_norm(self, num_microbatches: int) -> None:
        if self._deferred_batch_norm:
            set_microbatches(self, num_microbatches)

    def _input_events(self, batches: List[Batch]) -> List[Any]:
        """Per micro-batch, the event its first stage waits for (None for host tensors)."""
        first = batches[0]  # micro-batches are chunks of one input
        if first.values[0].is_cpu if first.atomic else all(t.is_cpu for t in nested_tensors(first.values)):
            return [None] * len(batches)
        # The first stage's copy streams for these inputs exist before the step fences the
        # workers' streams against the caller's: an input on a second accelerator is copied
        # on one of them, after the caller's work on that device.
        first = self._stages[0]
        for tensor in nested_tensors(batches[0].values):
            if not tensor.is_cpu and tensor.device != first.device:
                first.copy_stream_for(tensor.device)
                first.copy_stream_for(first.device)
        return [self._input_event(b) for b in batches]

    def _input_event(self, batch: Batch) -> Any:
        for tensor in nested_tensors(batch.values):
            if tensor.is_cpu:
                continue
            backend = get_backend(tensor.device)
            if backend.type != "cpu":
                return mark_ready(backend, backend.current_stream(tensor.device))
        return None

    def _hand_back(self, results: List[Tuple[Batch, Any]]) -> List[Batch]:
        """Make the last stage's outputs safe to use on the caller's current stream."""
        device = self._devices[-1]
        if device.type == "cpu":  # no events: host tensors are ready
            return [batch for batch, _ in results]
        outputs = []
        for batch, event in results:
            if event is not None:  # never on the CPU
                backend = get_backend(device)
                current = backend.current_stream(device)
                backend.wait_event(current, event)
                for tensor in nested_tensors(batch.values):
                    if tensor.device == device:
                        backend.record_stream(tensor, current)
            outputs.append(batch)
        return outputs

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop and join the worker threads (idempotent). The Pipe cannot run afterwards.

        A call in progress on another thread finishes first; one still running after
        ``STOP_TIMEOUT_S`` (a stage stuck in user code) is given up: the workers stop, and that
        call raises RuntimeError once it wakes (one micro-batch on CPU stages, which runs on
        its caller's thread and needs no worker, finishes instead). From inside one of the Pipe's own
        stages on a worker, close() raises RuntimeError: the stage's own step could never
        finish. Called on the thread that is running a call of this Pipe (a signal handler, say
        a SIGTERM handler that shuts down, or a stage of a call that runs on the caller's
        thread, which cannot be told from one), it cannot wait for that call, which resumes
        only once it returns: the Pipe then closes as soon as the call ends, failed or not.
        """
        if self._step_lock.held_here():
            self._step_lock.after_call(self.close)
            return
        if self._finalizer.alive:  # the workers' thread ids are current only while they run
            self._runtime.refuse_worker_caller(
                "close() was called from one of this Pipe's own stages; close it from outside the pipeline")
        # A step that never ends (a stage stuck in user code) must not block close() for good:
        # the workers' stop markers then queue behind that step's tasks.
        locked = self._step_lock.acquire(timeout=STOP_TIMEOUT_S)
        try:
            self._runtime.stop(self._finalizer)
        finally:
            if locked:
                self._step_lock.release()

    def __enter__(self) -> "Pipe":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.devices)
        return f"balance={self.balance}, devices=[{devices}], chunks={self.chunks}, checkpoint={self.checkpoint!r}"


def _check_loss_arguments(loss_fn: Any, reduction: Optional[str], return_outputs: Any, losses: Any,
                          loss_kwargs: Any, output_dim: BatchDim) -> str:
    """The reduction ``step``/``evaluate`` weigh micro-batches for; TypeError/ValueError for a bad argument.

    The reduction is ``reduction=``, else a ``reduction`` in ``loss_kwargs`` (a functional
    loss told to sum), else ``loss_fn.reduction``, else ``'mean'``. ``'batchmean'``
    (``KLDivLoss``) divides by the output's dim 0: a mean over samples when the output's
    batch dim (``output_dim``) is 0, and the same divisor in every micro-batch, so a sum of
    micro-batch losses, when it is another.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
    if losses is not None and not isinstance(losses, list):
        raise TypeError(f"losses must be a list to fill with each micro-batch's loss, or None; got {losses!r}")
    if loss_kwargs is not None and (not isinstance(loss_kwargs, dict)
                                    or not all(isinstance(key, str) for key in loss_kwargs)):
        raise TypeError(f"loss_kwargs must be a dict of keyword arguments for loss_fn, or None; got {loss_kwargs!r}")
    if reduction is not None and not isinstance(reduction, str):
        raise TypeError(f"reduction must be 'mean', 'batchmean', 'sum' or None, got {type(reduction).__name__}: "
                        f"{reduction!r}")
    if reduction not in (None, "mean", "batchmean", "sum"):
        raise ValueError(f"reduction must be 'mean', 'batchmean', 'sum' or None (read from the loss), got {reduction!r}")
    loss, keywords = loss_settings(loss_fn, loss_kwargs)  # through torch.compile and functools.partial
    from_kwargs = "reduction" in keywords
    own = keywords.get("reduction", getattr(loss, "reduction", None))
    if own == "none" and (from_kwargs or isinstance(loss, nn.modules.loss._Loss)):
        where = ("loss_kwargs['reduction']" if loss_kwargs and "reduction" in loss_kwargs
                 else "the partial's reduction='none'" if from_kwargs else f"{type(loss).__name__}(reduction='none')")
        raise ValueError(f"{where} makes the loss one value per element, but each micro-batch needs a scalar loss "
                         "to back-propagate: use reduction='mean' or 'sum' in the loss")
    if reduction is None:
        reduction = "mean" if own is None else own
    elif own in ("mean", "sum") and own != reduction:  # 'batchmean' may be told which it is
        raise ValueError(f"reduction={reduction!r}, but the loss itself reduces by {own!r} (its reduction, a "
                         "partial's or loss_kwargs'); give one reduction")
    if reduction == "batchmean":  # KLDivLoss: the sum over the output's dim 0 divided by its size
        if isinstance(output_dim, int) and output_dim >= 0:
            reduction = "mean" if output_dim == 0 else "sum"
        else:
            raise ValueError(f"reduction 'batchmean' divides by the output's dim 0, but output_batch_dim={output_dim!r} "
                             "does not say whether that is the batch: pass reduction='mean' if it is, 'sum' if not")
    if not isinstance(return_outputs, bool):
        raise TypeError(f"return_outputs must be a bool, got {return_outputs!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean', 'batchmean' or 'sum' (got {reduction!r}); "
                         "pass reduction= for a custom loss_fn")
    return cast(str, reduction)


def _loss_call(loss_fn: Callable[..., Tensor], loss_kwargs: Optional[Dict[str, Any]]) -> Callable[[Any, Any], Tensor]:
    """What each micro-batch's loss calls: ``loss_fn``, with ``loss_kwargs`` when there are any."""
    return functools.partial(loss_fn, **loss_kwargs) if loss_kwargs else loss_fn


def _undo_for(module: nn.Module) -> Callable[[], None]:
    """What puts ``module``'s children, and its deferred batch norms' ``chunks``, back as they
    are now (deferred batch norm's conversion replaces children in place)."""

    children = [(parent, name, child) for parent in module.modules() for name, child in parent._modules.items()]
    counts = [(norm, norm.chunks, norm.microbatches) for norm in module.modules() if isinstance(norm, DeferredBatchNorm)]

    def undo() -> None:
        for parent, name, child in children:
            if getattr(parent, name) is not child:
                setattr(parent, name, child)
        for norm, chunks, microbatches in counts:
            norm.chunks, norm.microbatches = chunks, microbatches

    return undo


def _refuse_dataless(value: Any, what: str, device: torch.device) -> None:
    """ValueError for a ``meta`` tensor bound for a stage on ``device`` that is not ``meta``:
    it has no values to copy there (torch would fail mid-step, or after ``evaluate``'s whole
    forward). An input on ``meta`` fails in its copy to the first stage, with torch's error,
    like any other copy fault."""
    if device.type == "meta":
        return
    for tensor in _tensors_in(value):
        if tensor.device.type == "meta":
            raise ValueError(f"the {what} has a tensor on the 'meta' device (shape {tuple(tensor.shape)}), which "
                             "holds no values to run the pipeline on: pass a tensor with data")


def _tensors_in(value: Any) -> Iterator[Tensor]:
    """Every tensor in ``value``, through tuples, lists and dicts."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)


def _weighted_total(each: List[Tensor], scales: List[float]) -> Tensor:
    """The mini-batch loss from its micro-batches' losses and weights."""
    device = each[-1].device
    # A micro-batch of weight 0 (every target ignored) has a NaN loss that must not count.
    counted = [(loss, scale) for loss, scale in zip(each, scales) if scale != 0] or list(zip(each, scales))
    return torch.stack([loss.to(device) * scale for loss, scale in counted]).sum()


def _compiling() -> bool:
    """Whether ``torch.compile`` is tracing this call; ``torch.export`` is refused instead.

    (Non-strict export reports itself as compiling too, also inside a ``torch._dynamo.disable``
    region, so running eagerly there would only call the method again.)
    """
    return torch.compiler.is_compiling() and not torch.compiler.is_exporting()


def _outside_compile(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run eagerly when ``torch.compile`` traces a call to it.

    A pipeline's step is threads, queues and locks, which torch's compiler cannot trace (it
    failed on a guard of its own); compiled, a ``Pipe`` therefore runs as it does uncompiled,
    with the layers inside compiled only where they are wrapped in ``torch.compile`` themselves.
    torch's compiler is imported only here, where it is running already.
    """
    import torch._dynamo

    return torch._dynamo.disable(method, recursive=True)
