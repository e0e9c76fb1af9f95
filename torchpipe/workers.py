"""Worker threads: where pipeline work runs (a one-chain step of CPU stages may run on its caller).

A :class:`Worker` owns one thread, an ``in_queue`` of :class:`Task` objects and (for a device
worker) one device and compute stream. Tasks run in the order they were queued. A task's
``compute`` runs on the worker thread; if it has a ``finalize``, the result travels back
through ``out_queue`` and ``finalize`` runs on the scheduling thread. A task without
``finalize`` only reports when it fails, which keeps the per-task cost to one queue hop.

Host workers are device-less threads (no device, no stream) for host-side work such as
embedding lookups; :class:`HostPool` groups them. :class:`ThreadBudget` caps the intra-op
threads each worker may start, so that N workers do not oversubscribe the machine's cores.
Workers catch ``BaseException``: a ``KeyboardInterrupt`` raised inside a stage reaches the
caller instead of killing the thread silently and hanging the pipeline.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .call_chain import Chain, adopt
from .checks import check_nonnegative_int, check_positive_int
from .devices import Backend, get_backend
from .thread_state import (ThreadState, first_frame_outside_torchpipe, refuse_untransferable_state,
                           warn_if_the_profiler_records_this_thread_only)

__all__ = [
    "Task",
    "Worker",
    "HostPool",
    "ThreadBudget",
    "available_cores",
    "intra_op_budget",
    "spawn_workers",
    "stop_workers",
    "stopped_with",
    "OwnsThreads",
    "fork_generation",
    "Report",
]

# (ok, task, result-or-exception) as put on an out_queue.
Report = Tuple[bool, "Task", Any]

_STOP = object()


class Task:
    """A unit of work for one worker.

    ``compute`` runs on the worker thread, inside the worker's device and stream (or inside
    ``stream``, when the task names one: a copy stream, say). ``finalize``, when given, runs
    on the scheduling thread with ``compute``'s result. ``label`` names the task in errors,
    profiler traces and step records ("stage 2 F mb 5").
    """

    __slots__ = ("compute", "finalize", "label", "stream")

    def __init__(
        self,
        compute: Callable[[], Any],
        finalize: Optional[Callable[[Any], None]] = None,
        label: str = "",
        stream: Any = None,
    ) -> None:
        if not callable(compute):
            raise TypeError(f"compute must be callable, got {compute!r}")
        if finalize is not None and not callable(finalize):
            raise TypeError(f"finalize must be callable or None, got {finalize!r}")
        self.compute = compute
        self.finalize = finalize
        self.label = label
        self.stream = stream

    def __repr__(self) -> str:
        return f"Task({self.label!r})"




# How many times this process was forked into (0 in the process that imported torchpipe). A
# pipeline's worker threads live in the process that built it only: a forked child (a
# DataLoader worker, multiprocessing) has copies of the objects but none of the threads.
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


def fork_generation() -> int:
    """Changes in a child process after ``fork``: workers started before it are not there."""
    return _forks


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS reports one, else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _caller_threads() -> int:
    """``torch.get_num_threads()`` on this thread (apart, so that tests can pretend a machine)."""
    return torch.get_num_threads()


def intra_op_budget() -> int:
    """The intra-op threads the workers may share: the cores this process may run on, capped
    by the caller's own limit (``torch.set_num_threads``, ``OMP_NUM_THREADS``, threadpoolctl's
    ``threadpool_limits`` around the call), read on the thread that builds the pipeline.

    torchrun sets ``OMP_NUM_THREADS=1`` when it starts several processes per node: split
    the cores instead, and every process's workers would oversubscribe them."""
    return max(1, min(available_cores(), _caller_threads()))


def check_intra_op_threads(value: Any, name: str = "intra_op_threads") -> Optional[int]:
    """A positive int up to :func:`available_cores`, or None; else TypeError/ValueError.

    More threads than cores is refused: the cap exists so that workers do not oversubscribe
    the cores, and OpenMP would start that many threads in each worker that asked.
    """
    threads = check_positive_int(name, value, allow_none=True)
    cores = available_cores()
    if threads is not None and threads > cores:
        raise ValueError(f"{name} must be at most the {cores} cores this process may run on "
                         f"(expected 1..{cores}, or None for an even split), got {value!r}")
    return threads


@dataclass(frozen=True)
class ThreadBudget:
    """How many intra-op threads each worker thread may use.

    ``None`` splits :func:`intra_op_budget` (the cores, capped by the caller's thread limit)
    evenly among the workers that share them (at least 1 each). The cap is applied per thread with threadpoolctl's OpenMP limit (see
    :func:`_limit_intra_op_threads`), so the caller's own threads keep their setting.
    """

    intra_op_threads: Optional[int] = None

    def __post_init__(self) -> None:
        # A plain int: threadpoolctl takes nothing else (a NumPy int would fail in the thread).
        object.__setattr__(self, "intra_op_threads", check_intra_op_threads(self.intra_op_threads))

    def threads_per_worker(self, workers_sharing_cores: int) -> int:
        """Intra-op threads for each of ``workers_sharing_cores`` workers: the given count, or
        the budget divided evenly (at least one each; no sharer leaves it all to one)."""
        check_nonnegative_int("workers_sharing_cores", workers_sharing_cores)
        if self.intra_op_threads is not None:
            return self.intra_op_threads
        return max(1, intra_op_budget() // max(1, workers_sharing_cores))


def _limit_intra_op_threads(threads: int) -> Any:
    """Cap this thread's intra-op parallelism; returns the limiter to keep alive.

    threadpoolctl sets the OpenMP thread count of *this* thread only, which is what torch's
    OpenMP builds read. ``torch.set_num_threads`` would also change the default that every
    thread created later starts from (the caller's threads included), so it is used only
    when no OpenMP runtime can be controlled (then the cap is process-wide).

    torch sets up a thread's OpenMP count from its process-wide default the first time the
    thread asks for it, which would undo a limit set before: so ask first, then limit.
    """
    torch.get_num_threads()  # torch's lazy per-thread set-up, before the limit, not after
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - threadpoolctl is a declared dependency
        limiter = None
    else:
        limiter = threadpool_limits(limits=threads, user_api="openmp")
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return limiter


class Worker:
    """One thread with an ``in_queue``; optionally bound to a device and a compute stream."""

    def __init__(
        self,
        name: str,
        out_queue: "Optional[queue.SimpleQueue[Report]]" = None,
        device: Optional[torch.device] = None,
        *,
        stream: Any = None,
        intra_op_threads: Optional[int] = None,
    ) -> None:
        intra_op_threads = check_intra_op_threads(intra_op_threads)
        if out_queue is not None and not callable(getattr(out_queue, "put", None)):
            raise TypeError(f"out_queue must be a queue (with put), got {out_queue!r}")
        self.name = name
        self.device = device
        self.backend: Optional[Backend] = get_backend(device) if device is not None else None
        if self.backend is not None and device is not None:
            self.backend.check(device)
            if stream is None:
                stream = self.backend.new_stream(device)
        self.stream = stream
        self.in_queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        # Reports of failed tasks and of tasks with a finalize (a private queue if none given).
        self.out_queue: "queue.SimpleQueue[Report]" = out_queue if out_queue is not None else queue.SimpleQueue()
        self.intra_op_threads = intra_op_threads
        self._stopping = False  # stop() was called: put() refuses from then on
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def put(self, task: Task) -> None:
        """Queue ``task``; tasks run in the order they are put.

        The task runs under the putting thread's state, as a pipeline's jobs and
        ``HostPool.submit``'s tasks do: grad mode, inference mode, autocast (CPU and the
        worker's device), saved-tensor hooks, Python modes, and under a profiler a
        ``record_function`` named by its label. (A task put on ``in_queue`` directly runs
        under the thread's defaults: the runtime's own jobs carry their state themselves.)
        Refused at once, rather than reported never: a task that is not a `Task` (TypeError),
        one for a worker whose thread has stopped, and one put under a ``torch.func``
        transform or a tracer, which cannot follow it to the worker (RuntimeError).
        """
        if not isinstance(task, Task):
            raise TypeError(f"Worker.put takes a torchpipe.workers.Task, got {type(task).__name__}")
        self._refuse_if_stopped()
        refuse_untransferable_state("Worker.put")
        warn_if_the_profiler_records_this_thread_only()
        device_types = ("cpu",) if self.device is None or self.device.type == "cpu" else ("cpu", self.device.type)
        self.in_queue.put(_Carried(task, ThreadState(device_types)))

    def _refuse_if_stopped(self) -> None:
        if self._stopping or not self._thread.is_alive():
            raise RuntimeError(f"worker {self.name!r} has stopped: its tasks would never run")

    def stop(self, join: bool = True, timeout: Optional[float] = None) -> None:
        """Ask the thread to exit after the tasks already queued, and (by default) join it."""
        self._stopping = True
        if self._thread.is_alive():
            self.in_queue.put(_STOP)
            if join and threading.current_thread() is not self._thread:
                self._thread.join(timeout)

    def _run(self) -> None:
        limiter = _limit_intra_op_threads(self.intra_op_threads) if self.intra_op_threads else None
        backend, device, stream = self.backend, self.device, self.stream
        if backend is not None and device is not None:
            with backend.use_device(device), backend.use_stream(stream):
                self._loop()
        else:
            self._loop()
        del limiter

    def _loop(self) -> None:
        get, put = self.in_queue.get, self.out_queue.put
        while True:
            task = get()
            if task is _STOP:
                return
            carried = None
            if type(task) is _Carried:  # put by hand: run it under the putting thread's state
                carried, task = task, task.task
            try:
                if carried is None and task.stream is None:  # no stream of its own (the runtime's jobs)
                    result = task.compute()
                elif carried is None:
                    result = self._compute(task)
                else:
                    with torch.set_grad_enabled(carried.state.grad_enabled), carried.state.contexts(task.label):
                        result = self._compute(task)
            except BaseException as exc:  # noqa: B902 - KeyboardInterrupt must reach the caller too
                put((False, task, exc))
                del exc, carried
                continue
            if task.finalize is not None:
                put((True, task, result))
            del task, result, carried

    def _compute(self, task: Task) -> Any:
        if task.stream is None or self.backend is None:
            return task.compute()
        with self.backend.use_stream(task.stream):
            return task.compute()


class _Carried:
    """A task put with :meth:`Worker.put`, with the putting thread's state to run it under."""

    __slots__ = ("task", "state")

    def __init__(self, task: Task, state: ThreadState) -> None:
        self.task = task
        self.state = state


def spawn_workers(
    devices: Sequence[Optional[torch.device]],
    out_queue: "Optional[queue.SimpleQueue[Report]]" = None,
    *,
    name: str = "torchpipe",
    budget: ThreadBudget = ThreadBudget(),
) -> List[Worker]:
    """One worker per entry of ``devices`` (repeats allowed: one thread per partition).

    Workers on the CPU (and host workers, ``None``) share the cores, so the budget divides
    the cores among them; accelerator workers keep a single intra-op thread each.
    """
    cpu_sharers = sum(1 for d in devices if d is None or d.type == "cpu")
    per_cpu_worker = budget.threads_per_worker(cpu_sharers)
    workers = []
    try:
        for index, device in enumerate(devices):
            on_cpu = device is None or device.type == "cpu"
            workers.append(
                Worker(
                    f"{name}-{index}",
                    out_queue,
                    device,
                    intra_op_threads=per_cpu_worker if on_cpu else 1,
                )
            )
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


STOP_TIMEOUT_S = 30.0


def stop_workers(workers: Sequence[Worker], timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop and join every worker (idempotent).

    A worker stuck in a task that never returns cannot be stopped from outside; rather than
    hang ``close()`` or interpreter exit, the join gives up after ``timeout`` seconds and
    warns, naming the thread (worker threads are daemons, so they do not block exit).
    """
    for worker in workers:
        if worker.is_alive():
            worker.in_queue.put(_STOP)
    deadline = time.monotonic() + timeout
    stuck = []
    for worker in workers:
        if threading.current_thread() is not worker.thread:
            worker.thread.join(max(0.0, deadline - time.monotonic()))
            if worker.thread.is_alive():
                stuck.append(worker.name)
    if stuck:
        with _live_groups_lock:  # exit joins them too: the task may yet return (see _stop_every_group)
            _left_behind[:] = [worker for worker in (*_left_behind, *workers) if worker.thread.is_alive()]
        warnings.warn(f"worker threads {stuck} did not stop within {timeout:g} s (a task is still running); "
                      "they are left behind as daemon threads", RuntimeWarning,
                      stacklevel=first_frame_outside_torchpipe())


# Interpreter exit stops every live group of workers at once, within one shared grace: each
# group joined with its own STOP_TIMEOUT_S would add up (three pipelines with a stuck stage
# took 97 s to exit). The workers are daemon threads, so exit need not wait for them at all;
# the grace lets a running task finish rather than be frozen mid-way by the interpreter. That
# goes for workers an earlier stop left behind too (a close() while a stage was stuck): a task
# released just before exit would otherwise still be running torch's C++ code when the
# interpreter ends its thread, and the process aborts after all its work ("terminate called
# without an active exception").
EXIT_GRACE_S = 5.0
_live_groups: "dict[int, weakref.finalize]" = {}
_left_behind: List["Worker"] = []
_live_groups_lock = threading.Lock()


def stopped_with(owner: Any, workers: Sequence[Worker]) -> "weakref.finalize":
    """A finalizer that stops ``workers`` when ``owner`` is collected or closed (call it),
    with `STOP_TIMEOUT_S` to spare; at interpreter exit `_stop_every_group` stops them instead."""
    finalizer = weakref.finalize(owner, stop_workers, list(workers))
    finalizer.atexit = False
    with _live_groups_lock:
        for key in [key for key, group in _live_groups.items() if not group.alive]:
            del _live_groups[key]
        _live_groups[id(finalizer)] = finalizer
    return finalizer


@atexit.register
def _stop_every_group() -> None:
    """At exit: every group still running gets its stop marker, then all are joined together,
    with the workers an earlier stop left behind, within `EXIT_GRACE_S` (one warning names any
    worker still in a task)."""
    workers: List[Worker] = []
    with _live_groups_lock:
        groups = list(_live_groups.values())
        _live_groups.clear()
        workers.extend(worker for worker in _left_behind if worker.thread.is_alive())
        _left_behind.clear()
    for finalizer in groups:
        detached = finalizer.detach()  # None if it ran already
        if detached is not None:
            workers.extend(detached[2][0])
    if workers:
        try:
            stop_workers(workers, timeout=EXIT_GRACE_S)
        except KeyboardInterrupt:  # a second Ctrl-C while exiting: the user wants out, not a traceback
            pass


class OwnsThreads:
    """Refuses ``copy.deepcopy`` and pickling with a TypeError that says why, rather than a
    bare "cannot pickle '_thread.lock' object": an object that runs worker threads (and, for a
    train pipeline, holds batches in flight) has nothing a copy could carry over."""

    COPY_ADVICE = "build a new one"

    def __getstate__(self) -> Any:
        raise TypeError(f"this {type(self).__name__} cannot be copied or pickled: it runs worker threads; "
                        f"{self.COPY_ADVICE}")


class HostPool(OwnsThreads):
    """A fixed group of device-less worker threads for host-side work.

    Host tasks (embedding lookups and updates, swap planning) need no device or stream, but
    must not oversubscribe the cores that device workers also use, so the pool is sized by
    its own :class:`ThreadBudget`. ``submit`` returns a :class:`concurrent.futures.Future`;
    tasks given the same ``key`` run in submission order on the same thread, which is how
    callers get ordering (a shared pool alone is not an ordering).
    """

    def __init__(
        self,
        num_threads: int = 1,
        *,
        name: str = "torchpipe-host",
        budget: ThreadBudget = ThreadBudget(intra_op_threads=1),
    ) -> None:
        check_positive_int("num_threads", num_threads)
        if not isinstance(budget, ThreadBudget):
            raise TypeError(f"budget must be a ThreadBudget, got {budget!r}")
        self._out: "queue.SimpleQueue[Report]" = queue.SimpleQueue()
        self.workers = spawn_workers([None] * num_threads, self._out, name=name, budget=budget)
        self._next = 0
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = stopped_with(self, self.workers)

    @property
    def num_threads(self) -> int:
        """How many host threads the pool runs (each capped to its share of intra-op threads)."""
        return len(self.workers)

    def worker_for(self, key: Optional[int] = None) -> Worker:
        """The worker that runs tasks of ``key`` (round-robin when ``key`` is None)."""
        with self._lock:
            return self._pick(key)

    def _pick(self, key: Optional[int]) -> Worker:
        if key is not None and (not isinstance(key, int) or isinstance(key, bool)):
            raise TypeError(f"key must be an int or None, got {key!r}")
        if self._closed:
            raise RuntimeError("HostPool is closed")
        if key is None:
            key = self._next
            self._next += 1
        return self.workers[key % len(self.workers)]

    def submit(self, fn: Callable[..., Any], *args: Any, key: Optional[int] = None, label: str = "",
               **kwargs: Any) -> "Future[Any]":
        """Run ``fn(*args, **kwargs)`` on a host thread; exceptions (any BaseException) land in the future.

        The task runs under the submitting thread's state, as a pipeline's jobs do: grad
        mode, inference mode, CPU autocast, saved-tensor hooks, Python modes, and under a
        profiler a ``record_function`` named ``label`` (default: ``fn``'s name). A ``torch.func``
        transform or a tracer cannot follow it there, and is refused (RuntimeError).
        """
        from concurrent.futures import Future

        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        refuse_untransferable_state("HostPool.submit")
        warn_if_the_profiler_records_this_thread_only()
        future: "Future[Any]" = Future()
        state = ThreadState(("cpu",))
        # The steps it serves, but no RNG sub-lock: a nested pipeline's stages may use the
        # caller's sub-lock because the caller waits for them; a host task may outlive the
        # section (its draws would then interleave with the caller's), so it takes the
        # generator's own lock.
        chain = Chain(state.chain.owners, cancels=state.chain.cancels)
        name = label or getattr(fn, "__name__", "host task")

        def compute() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                adopt(chain)
                with torch.set_grad_enabled(state.grad_enabled), state.contexts(name):
                    result = fn(*args, **kwargs)
                future.set_result(result)
            except BaseException as exc:  # noqa: B902
                future.set_exception(exc)

        task = Task(compute, label=name)
        with self._lock:  # queued before close() can queue the stop marker, or refused
            worker = self._pick(key)
            worker._refuse_if_stopped()
            worker.in_queue.put(task)  # not put(): compute carries the state already
        return future

    def close(self) -> None:
        """Finish queued tasks, then stop and join every thread."""
        with self._lock:
            self._closed = True
        self._finalizer()

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


from concurrent.futures import Future  # noqa: E402  (type name used in annotations above)
