"""The caller's thread-local state, captured once and re-entered by the threads that work for it.

Grad mode, inference mode, autocast, saved-tensor hooks, Python modes (``with
torch.device(...)``, ``FlopCounterMode``) and the profiler are all thread-local in PyTorch,
so a worker thread would otherwise run with its own defaults; the call chain
(:mod:`torchpipe.call_chain`) travels the same way. What cannot travel (a ``torch.func``
transform, a tracer) is refused before a call starts: :func:`refuse_untransferable_state`.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple, TypeVar

import torch

from .call_chain import Cancel, Chain, LockWaits
from .call_chain import current as current_chain

__all__ = ["ThreadState", "CHECKPOINT_HOOK_MARK", "autocast_active", "current_saved_tensors_hooks", "in_torch_checkpoint", "leave_autocast",
           "outside_autocast", "records_graphs", "refuse_untransferable_state", "runs_outside_autocast",
           "warn_if_the_profiler_records_this_thread_only"]

_Job = TypeVar("_Job", bound=Callable[..., Any])


def records_graphs() -> bool:
    """Whether autograd records what runs on this thread now.

    Grad mode alone does not say: ``torch.enable_grad()`` inside ``torch.inference_mode()``
    turns grad mode on, yet inference tensors record nothing (and cannot be checkpointed).
    """
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


_TOP_SAVED_TENSORS_HOOKS: Optional[Callable[[bool], Any]] = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def current_saved_tensors_hooks() -> Optional[Tuple[Callable[[Any], Any], Callable[[Any], Any]]]:
    """The innermost ``saved_tensors_hooks`` (pack, unpack) active on this thread, if any.

    Thread-local in autograd, like grad mode: ``save_on_cpu`` around a call must reach the
    workers too. Read through a private binding (looked up once: ``Pipe.step`` asks on every
    forward job); without it, no hooks are carried.
    """
    top = _TOP_SAVED_TENSORS_HOOKS
    return None if top is None else top(False)


CHECKPOINT_HOOK_MARK = "_torchpipe_packs_for_a_checkpoint"
"""Set on a pack hook of ours that passes tensors on to a checkpoint's: still inside it."""


def in_torch_checkpoint() -> bool:
    """Whether this thread runs inside ``torch.utils.checkpoint`` (its forward or recompute)."""
    hooks = current_saved_tensors_hooks()
    if hooks is None:
        return False
    pack = hooks[0]
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint" or hasattr(pack, CHECKPOINT_HOOK_MARK)


def _carried_saved_tensors_hooks() -> Optional[Tuple[Callable[[Any], Any], Callable[[Any], Any]]]:
    """The caller's saved-tensor hooks that other threads may use: not a checkpoint's.

    ``torch.utils.checkpoint`` (non-reentrant) matches the tensors a recompute saves to those
    of the forward by their order on the checkpointing thread. Tensors saved by several
    workers at once come in no fixed order, so a pipeline called inside a checkpointed region
    (a ``Pipe`` nested in another ``Pipe``'s stage) keeps its own saved tensors instead; its
    graph then backpropagates as it is, and the recompute's second call is only extra work.
    """
    return None if in_torch_checkpoint() else current_saved_tensors_hooks()


_FOLLOWS_ONE_THREAD = ("it follows only the thread it started on, and torchpipe runs the stages on worker threads, "
                      "so they would run outside it and the result would be silently wrong")


def _untransferable_state() -> Optional[Tuple[str, str]]:
    """The transform, tracer or mode on this thread that no worker thread can take part in,
    and why: ``(name, reason)``, or None."""
    if torch.compiler.is_exporting():
        return "torch.export", _FOLLOWS_ONE_THREAD
    if torch._C._get_tracing_state() is not None:
        return "torch.jit.trace", _FOLLOWS_ONE_THREAD
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "a torch.func transform (grad, vjp, jvp, vmap, jacrev, ...)", _FOLLOWS_ONE_THREAD
    keys = torch._C._TorchDispatchModeKey
    modes = torch._C._len_torch_dispatch_stack() > 0  # counts the slots read below: none, the common case
    if modes and torch._C._get_dispatch_mode(keys.PROXY) is not None:
        return "make_fx (a proxy tracing mode)", _FOLLOWS_ONE_THREAD
    if _pre_dispatch_tracing():
        return "make_fx(pre_dispatch=True) (a pre-dispatch tracing mode)", _FOLLOWS_ONE_THREAD
    if modes and torch._C._get_dispatch_mode(keys.FUNCTIONAL) is not None:
        return "functionalization (AOT autograd)", _FOLLOWS_ONE_THREAD
    if modes and torch._C._get_dispatch_mode(keys.FAKE) is not None:
        return "FakeTensorMode", ("it keeps the state of the op it runs on the mode object, which stages running "
                                  "at once on several worker threads would share")
    return None


def _pre_dispatch_tracing() -> bool:
    """Whether a pre-dispatch tracer (``make_fx(..., pre_dispatch=True)``, export) holds its modes
    on this thread's pre-dispatch stack, which the dispatch-mode slots do not show."""
    count = _PRE_DISPATCH_STACK_LENGTH
    return count is not None and count() > 0


_PRE_DISPATCH_STACK_LENGTH: Optional[Callable[[], int]] = getattr(torch._ops, "_len_torch_dispatch_stack_pre_dispatch", None)


def refuse_untransferable_state(what: str) -> None:
    """Raise before a call when the caller runs under state no worker thread can take part in.

    ``torch.func`` transforms and tracers keep their state on the thread that started them:
    the stages, run on other threads, would escape them silently (``grad`` of a pipelined
    model came out as zeros, ``make_fx`` recorded the result as a constant). A fake-tensor
    mode keeps the state of the op it runs on the mode object, which stages running at once
    would share. Checked before anything changes; ``what`` names the call in the message.
    """
    found = _untransferable_state()
    if found is not None:
        name, reason = found
        raise RuntimeError(
            f"{what} cannot run under {name}: {reason}. Apply it to the plain model (pipe[:] is an "
            "nn.Sequential of the same layers, run on your thread), or to the layers inside the stages"
        )


_PROFILER_ON_THIS_THREAD: Optional[Callable[[], bool]] = getattr(torch._C._autograd, "_profiler_enabled", None)
_warned_profiler_misses_workers = False


def warn_if_the_profiler_records_this_thread_only() -> None:
    """Warn, once, that a plain ``torch.profiler.profile()`` will not show the workers' jobs.

    A plain profiler keeps its state on the thread that started it, so events on any other
    thread (every pipeline job, every host task) are dropped, and a trace shows the caller
    waiting and nothing else. Recording every thread (``torchpipe.profiling.profile``) keeps
    the state process-wide instead, and this thread then reports none of its own. Read
    through a private binding; without it, nothing is said. Call it before changing any
    state: under ``-W error`` the warning is an exception.
    """
    global _warned_profiler_misses_workers
    if (_warned_profiler_misses_workers or not torch.autograd.profiler._is_profiler_enabled
            or _PROFILER_ON_THIS_THREAD is None or not _PROFILER_ON_THIS_THREAD()):
        return
    _warned_profiler_misses_workers = True
    warnings.warn(
        "this profiler records only the thread that started it, so work on torchpipe's worker and host "
        "threads is missing from its trace; profile with torchpipe.profiling.profile(...) (it takes "
        "torch.profiler.profile's arguments), or pass torch.profiler.profile an experimental_config built "
        "with profile_all_threads=True, to record it as 'stage 2 F mb 5' events",
        UserWarning, stacklevel=first_frame_outside_torchpipe())


def first_frame_outside_torchpipe() -> int:
    """The ``stacklevel`` that points a warning at the caller's code.

    It skips torchpipe's frames and torch's (``nn.Module.__call__``, ``torch.utils.checkpoint``
    and other wrappers a call may pass through).
    """
    packages = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(packages):
        frame, level = frame.f_back, level + 1
    return level


def _single_threaded_mode(mode: Any) -> bool:
    """A dispatch mode of torch's own that works for one thread only: not carried.

    torch's selective checkpoint caches op results in the order one thread runs them.
    Infrastructure modes (fake tensors, proxy tracing, functionalization) are refused before
    a call gets here (:func:`refuse_untransferable_state`), and skipped here as well.
    """
    if getattr(mode, "_mode_key", None) is not None:
        return True
    names = ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
    return type(mode).__module__ == "torch.utils.checkpoint" and type(mode).__name__ in names


class _Modes:
    """The caller's Python modes (``TorchFunctionMode`` and ``TorchDispatchMode`` stacks).

    ``with torch.device("meta")`` (a function mode), ``FlopCounterMode``, a user's logging or
    numerics mode and ``allow_mutation_on_saved_tensors`` (a dispatch mode beside its
    saved-tensor hooks) act on every op the caller's thread runs, and only there. A job
    pushes the very same mode objects onto its own thread's stacks for its run and pops them
    after: entering them again would reset their state (a flop counter's counts). So a mode
    sees the stages' ops from several threads at once. Not carried: torch's modes that work
    for one thread only (:func:`_single_threaded_mode`).
    """

    __slots__ = ("function_modes", "dispatch_modes")

    def __init__(self, function_modes: List[Any], dispatch_modes: List[Any]) -> None:
        self.function_modes = function_modes
        self.dispatch_modes = dispatch_modes

    @classmethod
    def current(cls) -> Optional["_Modes"]:
        if not torch._C._len_torch_function_stack() and not torch._C._len_torch_dispatch_stack():
            return None  # the common case, without building lists
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        dispatch = [m for m in _get_current_dispatch_mode_stack() if not _single_threaded_mode(m)]
        function = list(_get_current_function_mode_stack())
        return cls(function, dispatch) if function or dispatch else None

    def __enter__(self) -> None:
        pushed_function = pushed_dispatch = 0
        try:
            for mode in self.function_modes:
                torch._C._push_on_torch_function_stack(mode)
                pushed_function += 1
            for mode in self.dispatch_modes:
                torch._C._push_on_torch_dispatch_stack(mode)
                pushed_dispatch += 1
        except BaseException:  # noqa: B902 - the caller will not call __exit__: undo what was pushed
            self._pop(pushed_function, pushed_dispatch)
            raise

    def __exit__(self, *exc: Any) -> None:
        self._pop(len(self.function_modes), len(self.dispatch_modes))

    def _pop(self, function_count: int, dispatch_count: int) -> None:
        for _ in range(dispatch_count):
            torch._C._pop_torch_dispatch_stack(None)
        for _ in range(function_count):
            torch._C._pop_torch_function_stack()


def outside_autocast(job: _Job) -> _Job:
    """Mark ``job`` to run outside the caller's autocast, even when the caller's call runs inside
    one: a backward, which torch's AMP recipe calls after the autocast block (a backward under
    autocast casts differently: ``scaled_dot_product_attention``'s, a custom Function's)."""
    job.outside_autocast = True  # type: ignore[attr-defined]
    return job


def runs_outside_autocast(job: Callable[..., Any]) -> bool:
    """Whether ``job`` was marked by `outside_autocast`."""
    return getattr(job, "outside_autocast", False)


@functools.lru_cache(maxsize=None)
def _autocast_defaults(device_type: str) -> Tuple[torch.dtype, bool]:
    """The autocast dtype and cache flag of a thread that never entered autocast (both are
    thread-local): what the recipe's code after an autocast block runs with, unless the
    caller set its own before the block (``torch.set_autocast_dtype``), which cannot be read
    from inside the block."""
    found: List[Tuple[torch.dtype, bool]] = []
    probe = threading.Thread(target=lambda: found.append(
        (torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled())), name="torchpipe-autocast-probe")
    probe.start()
    probe.join()
    return found[0]


@functools.lru_cache(maxsize=None)
def _autocast_types(device_types: Tuple[str, ...]) -> Tuple[str, ...]:
    """The device types with autocast among cpu, cuda (an encoder in front may be on it) and
    ``device_types``: asked once, since `leave_autocast` runs on every call."""
    return tuple(t for t in dict.fromkeys(("cpu", "cuda", *device_types)) if torch.amp.is_autocast_available(t))


def autocast_active(device_types: Sequence[str]) -> bool:
    """Whether autocast is on, on this thread, for cpu, cuda or any of ``device_types``."""
    return any(torch.is_autocast_enabled(t) for t in _autocast_types(tuple(device_types)))


def leave_autocast(device_types: Sequence[str]) -> ContextManager[Any]:
    """Leave every autocast active on this thread for the block, back to the thread defaults,
    as code after the recipe's autocast block runs: the caller's share of a call (gathering the
    outputs, the backward into the input's own graph) is no part of the model's forward."""
    active = [t for t in _autocast_types(tuple(device_types)) if torch.is_autocast_enabled(t)]
    if not active:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    try:
        for device_type in active:
            dtype, cache = _autocast_defaults(device_type)
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=False, cache_enabled=cache))
    except BaseException:  # noqa: B902 - an interrupt half way: the caller's autocast is put back
        stack.close()
        raise
    return stack


class ThreadState:
    """The caller's thread-local state that each job must run under.

    Grad mode, inference mode, autocast, saved-tensor hooks (``save_on_cpu``), Python modes
    (:class:`_Modes`) and whether a profiler records: all thread-local in PyTorch, so a worker
    thread would otherwise silently run with its own defaults.
    """

    __slots__ = ("grad_enabled", "inference", "autocast", "saved_hooks", "modes", "profiling", "plain", "chain",
                 "owner", "cancel", "lock_waits")

    def __init__(self, device_types: Sequence[str], owner: Optional[int] = None) -> None:
        # Whom the jobs work for: the caller's chain, one level down for step ``owner``, whose
        # abort sets ``cancel`` (the jobs' waits for a generator's lock then give up).
        self.owner = owner
        self.cancel = Cancel()
        # A step's jobs note their waits for a generator's lock here, for the step's record.
        self.lock_waits: LockWaits = []
        self.chain: Chain = (current_chain() if owner is None
                             else current_chain().serving(owner, self.cancel, self.lock_waits))
        self.grad_enabled = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast: List[Tuple[str, torch.dtype, bool]] = []
        for device_type in device_types:
            if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
                self.autocast.append(
                    (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled())
                )
        self.saved_hooks = _carried_saved_tensors_hooks()
        self.modes = _Modes.current()
        self.profiling = bool(torch.autograd.profiler._is_profiler_enabled)
        # Nothing to enter around a job: the per-job fast path.
        self.plain = not (self.inference or self.autocast or self.saved_hooks or self.modes or self.profiling)

    def contexts(self, label: str, autocast: bool = True) -> contextlib.ExitStack:
        """The state to enter around job ``label``; ``autocast=False`` leaves the caller's autocast
        out (an `outside_autocast` job), so the job runs with the thread's autocast defaults."""
        stack = contextlib.ExitStack()
        if self.inference:
            stack.enter_context(torch.inference_mode())
            if self.grad_enabled:  # ``enable_grad()`` inside it: entering inference mode turned grad mode off
                stack.enter_context(torch.enable_grad())
        for device_type, dtype, cache in self.autocast if autocast else ():
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
        if self.saved_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.saved_hooks))
        if self.modes is not None:
            stack.enter_context(self.modes)
        if self.profiling:
            stack.enter_context(torch.profiler.record_function(label))
        return stack
