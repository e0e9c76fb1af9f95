"""The runtime: executes a :class:`Program` of jobs on worker threads.

A program is the lowered form of a plan: per worker, an ordered list of jobs, each naming the
jobs whose results it needs. The runtime queues each worker's jobs in plan order, all at once,
so no scheduling thread sits between two jobs: a job waits only for its own dependencies,
and the worker that finishes a job hands its result straight to the consumer. This is what
keeps the per-task cost low (torchgpipe's scheduler thread takes a round trip per task and a
barrier per clock cycle). A worker whose first job needs results is queued by the job that
completes the last of them, not at the start of the step: woken early it would only block
again on its input, one more thread wake-up on the critical path of a one-micro-batch call.
A program that is one chain (no two jobs could overlap) may instead run on the caller's
thread, job after job (``run(..., inline_chains=True)``): then no thread hand-off at all.

Failure handling: the first exception of any job, on any worker, aborts the step. Every wait
on a dependency wakes up on abort, the remaining jobs of the step are skipped, the runtime
waits until each worker has passed the step's last job (so no stale work leaks into the next
step), and the caller gets the original exception with its traceback. A ``KeyboardInterrupt``
in the caller's thread while it waits aborts the step the same way. Every wait of the caller's
is bounded: a step whose jobs do not leave it in time (one stuck in user code) stays
installed, and the next call ends it, or refuses while that job runs on.
"""
from __future__ import annotations

import _thread
import bisect
import contextlib
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import repeat, starmap
from typing import Any, Callable, ContextManager, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from . import call_chain
from .call_chain import adopt
from .checks import check_file_path
from .thread_state import ThreadState, autocast_active, leave_autocast, runs_outside_autocast
from .workers import STOP_TIMEOUT_S, Task, Worker, fork_generation, stop_workers

__all__ = ["Program", "Runtime", "StepRecord", "ThreadState", "StepAborted", "Latch"]

JobFunction = Callable[[Any, Tuple[Any, ...]], Any]

ABANDON_AFTER_S = 10.0
"""How long the caller waits, after an interrupt aborted its step, for every job to leave it.

A job stuck in user code cannot see the abort. Past this, the caller stops waiting and
raises the interrupt (as a second interrupt does at once), leaving the step installed for
the next call to end. A signal handler that raises once (pytest-timeout's) so still ends
the call instead of hanging it. The same bound holds for the wait after a step was half
queued (an interrupt, or a queue put that raised on a worker thread).
"""

WORKERS_CHECK_S = 1.0
"""How often a caller waiting for its step checks that the workers still run: one stopped
meanwhile (a ``close()`` on another thread that gave up waiting for this call) would never
run the tasks queued after its stop marker, and the wait would never end."""

LEFT_BEHIND_WAIT_S = 1.0
"""How long a call waits for the workers of a step an interrupted call left behind.

The call first aborts that step again (an interrupt can cut an abort short, before every
wait of the step was woken), then waits for each worker to pass what it was given. A job
still inside user code past this makes the call raise RuntimeError instead of hanging; a
later call tries again.
"""


# A step's locks are made and taken through these, both read here: a threading.Lock patched
# later (gevent, a lock tracer) does not mix its locks with this type's acquire.
_new_lock = _thread.allocate_lock
_LOCK_TYPE = type(_new_lock())


class StepAborted(Exception):
    """Internal: a job was skipped because its step was aborted."""


@dataclass
class _Job:
    index: int
    worker: int
    key: Hashable
    label: str
    function: JobFunction
    dep_keys: Tuple[Hashable, ...]
    deps: Tuple[int, ...] = ()
    keep: bool = False


class Program:
    """Per-worker ordered jobs with dependencies, ready to run on a :class:`Runtime`.

    ``add(worker, key, function, deps=..., label=...)`` appends a job to ``worker``'s list;
    ``deps`` are the keys of jobs (on any worker, added before or after) whose results the job
    receives, in order, as ``function(context, inputs)``. ``keep=True`` keeps a job's result
    for the caller after the step; other results are dropped once their last consumer took
    them, so activations are not held longer than the plan needs.
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.jobs: List[_Job] = []
        self.worker_jobs: List[List[_Job]] = [[] for _ in range(num_workers)]
        self._index: Dict[Hashable, int] = {}
        self._frozen = False

    def add(
        self,
        worker: int,
        key: Hashable,
        function: JobFunction,
        deps: Sequence[Hashable] = (),
        *,
        label: str = "",
        keep: bool = False,
    ) -> None:
        if self._frozen:
            raise RuntimeError("program is frozen")
        if not 0 <= worker < self.num_workers:
            raise ValueError(f"worker {worker} out of range for a program of {self.num_workers} workers")
        if key in self._index:
            raise ValueError(f"duplicate job key {key!r}")
        job = _Job(len(self.jobs), worker, key, label or str(key), function, tuple(deps), keep=keep)
        self._index[key] = job.index
        self.jobs.append(job)
        self.worker_jobs[worker].append(job)

    def index(self, key: Hashable) -> int:
        return self._index[key]

    def freeze(self) -> "Program":
        """Resolve dependencies and prove the program cannot deadlock."""
        if self._frozen:
            return self
        for job in self.jobs:
            try:
                job.deps = tuple(self._index[k] for k in job.dep_keys)
            except KeyError as exc:
                raise ValueError(f"job {job.label!r} depends on unknown job {exc.args[0]!r}") from None
        order = self._check_executable()
        # One chain: every job waits on the one before it (its input, or its worker's previous
        # job), so no two jobs could ever run at once, and threads would only add hand-offs.
        chained = all(
            b.worker == a.worker or a.index in b.deps for a, b in zip(order, order[1:])
        )
        self.chain_order: Optional[Tuple[_Job, ...]] = tuple(order) if chained else None
        self.consumers = [0] * len(self.jobs)
        for job in self.jobs:
            for dep in job.deps:
                self.consumers[dep] += 1
        # Per-step constants, computed once: what a step's record and its takes need.
        self.labels = tuple(job.label for job in self.jobs)
        self.keys = tuple(job.key for job in self.jobs)
        self.job_workers = tuple(job.worker for job in self.jobs)
        self.keep = [job.keep for job in self.jobs]
        # A result with a single consumer is dropped by that consumer without a shared count.
        self.drop_on_take = [n == 1 and not job.keep for n, job in zip(self.consumers, self.jobs)]
        self.kept = [(job.key, job.index) for job in self.jobs if job.keep]
        self.kept_indices = tuple(index for _, index in self.kept)
        # A worker whose first job needs results is queued only once they are all there (see
        # ``Runtime``): ``first_needs[w]`` counts them, ``unblocks[i]`` the workers job i counts for,
        # and the caller queues ``first_workers``, whose first job needs nothing.
        self.first_needs = [0] * self.num_workers
        self.unblocks: List[Tuple[int, ...]] = [() for _ in self.jobs]
        for w, jobs in enumerate(self.worker_jobs):
            needed = set(jobs[0].deps) if jobs else set()
            self.first_needs[w] = len(needed)
            for dep in needed:
                self.unblocks[dep] += (w,)
        self.first_workers = tuple(w for w, jobs in enumerate(self.worker_jobs) if jobs and not self.first_needs[w])
        self._frozen = True
        return self

    def _check_executable(self) -> List[_Job]:
        """Every job in an order it can run in (one at a time); ValueError if some never could."""
        done = [False] * len(self.jobs)
        cursor = [0] * self.num_workers
        order: List[_Job] = []
        while len(order) < len(self.jobs):
            progressed = False
            for w, jobs in enumerate(self.worker_jobs):
                while cursor[w] < len(jobs) and all(done[d] for d in jobs[cursor[w]].deps):
                    done[jobs[cursor[w]].index] = True
                    order.append(jobs[cursor[w]])
                    cursor[w] += 1
                    progressed = True
            if not progressed:
                stuck = [jobs[cursor[w]].label for w, jobs in enumerate(self.worker_jobs) if cursor[w] < len(jobs)]
                raise ValueError(f"program would deadlock: every worker waits ({', '.join(stuck)})")
        return order


@dataclass
class StepRecord:
    """Start and end time of every job of one step, for the bubble and a Chrome trace.

    ``starts``/``ends`` are ``time.perf_counter()`` readings, -1.0 for a job that did not run;
    the job that raised (``failed_job``) has its times up to the failure. They are the host's:
    on an accelerator a job ends once its kernels are queued, not run.
    """

    labels: List[str]
    workers: List[int]
    worker_names: List[str]
    starts: List[float]
    ends: List[float]
    wall_start: float
    wall_end: float
    keys: List[Hashable] = field(default_factory=list)
    """Each job's key, in the same order: for a ``Pipe``, the plan's actions."""
    error: Optional[str] = None
    """Why the call that ran this step raised (``"TypeName: message"``); None when it returned.

    A failed or interrupted step records the jobs that ran until it was stopped, the job
    that raised among them (its event in `chrome_trace` says so): its makespan and bubble
    describe that part, not a step. A call refused before anything ran records nothing.
    """
    failed_job: Optional[int] = None
    """Index (into ``labels``) of the job that raised, when a job did."""
    lock_waits: List[Tuple[int, float, float]] = field(default_factory=list)
    """(job index, start, end) of each wait, inside a job, for a random generator's lock: a
    forward that draws (dropout) under checkpointing, or with ``reproducible=True``, holds the
    generator's lock, so partitions sharing a generator (CPU ones) run such forwards one at a
    time. Counted as idle time, not work (`busy`, `job_seconds`)."""

    @property
    def makespan(self) -> float:
        """Seconds from the first job's start to the last job's end."""
        ran = [i for i, s in enumerate(self.starts) if s >= 0]
        if not ran:
            return 0.0
        return max(self.ends[i] for i in ran) - min(self.starts[i] for i in ran)

    def job_seconds(self) -> List[float]:
        """Each job's duration without its waits for a generator's lock (-1.0: it did not run)."""
        seconds = [e - s if s >= 0 else -1.0 for s, e in zip(self.starts, self.ends)]
        for index, start, end in self.lock_waits:
            seconds[index] -= end - start
        return seconds

    def busy(self) -> List[float]:
        """Seconds each worker spent in jobs, waits for a generator's lock left out."""
        busy = [0.0] * len(self.worker_names)
        for w, seconds in zip(self.workers, self.job_seconds()):
            if seconds >= 0:
                busy[w] += seconds
        return busy

    @property
    def bubble_ratio(self) -> float:
        """Share of worker time spent idle between the step's first start and last end.

        Only the workers the program gave jobs count: an interleaved plan of 4 stages on 2
        workers leaves the other 2 threads out of the step, not idle in it.
        """
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy()) / (len(set(self.workers)) * span)

    def chrome_trace(self) -> Dict[str, Any]:
        """The step as Chrome trace events (open in chrome://tracing or Perfetto).

        One track per worker that had jobs. A key with ``stage``/``microbatch``/``kind``
        fields (a plan's action) puts them in each event's ``args`` and ``cat``, with the
        key's text (``"2F0"``) as ``args["action"]``, as in ``Plan.chrome_trace()``: a planned
        and a measured trace can be matched action by action. A worker that ran several
        stages (interleaved plans), or another stage than its own number (a plan's placement),
        says which in its track's name.
        """
        events: List[Dict[str, Any]] = []
        stages: Dict[int, List[Any]] = {}
        for w, key in zip(self.workers, self.keys or [None] * len(self.workers)):
            on_worker = stages.setdefault(w, [])
            stage = getattr(key, "stage", None)
            if stage is not None and stage not in on_worker:
                on_worker.append(stage)
        for w in sorted(stages):
            name = self.worker_names[w]
            if len(stages[w]) > 1:
                name += f" (stages {', '.join(str(s) for s in sorted(stages[w]))})"
            elif stages[w] and stages[w] != [w]:  # a plan's own placement: threads are named by partition
                name += f" (stage {stages[w][0]})"
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": w, "args": {"name": name}})
        origin = min((s for s in self.starts if s >= 0), default=self.wall_start)
        keys = self.keys or [None] * len(self.labels)
        for index, (label, w, s, e, key) in enumerate(zip(self.labels, self.workers, self.starts, self.ends, keys)):
            if s < 0:
                continue
            event: Dict[str, Any] = {"ph": "X", "name": label, "pid": 0, "tid": w, "ts": (s - origin) * 1e6,
                                     "dur": (e - s) * 1e6}
            fields = _action_fields(key)
            if fields:
                event["cat"] = fields.pop("kind", "")
                event["args"] = {"action": str(key), **fields}
            if index == self.failed_job:
                event.setdefault("args", {})["error"] = self.error
            events.append(event)
        for index, start, end in self.lock_waits:  # nested in their job's event
            events.append({"ph": "X", "name": "wait: random generator's lock", "cat": "wait", "pid": 0,
                           "tid": self.workers[index], "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6,
                           "args": {"job": self.labels[index]}})
        trace: Dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
        if self.error is not None:
            trace["otherData"] = {"error": self.error}
        return trace

    def save_chrome_trace(self, path: Any) -> None:
        """Write :meth:`chrome_trace` as JSON, for chrome://tracing or Perfetto."""
        check_file_path(path, "save_chrome_trace")
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


def _jobs_lock_waits(program: Program, starts: List[float], ends: List[float], threads: List[Optional[int]],
                     waits: call_chain.LockWaits) -> List[Tuple[int, float, float]]:
    """(job index, start, end) of each of the step's ``waits`` for a random generator's lock
    that lies inside a job (a host task's, or one of a job a failure left running, does not)."""
    waits = list(waits)  # a copy: a job an interrupt left running may still add
    if not waits:
        return []
    by_thread: Dict[Optional[int], List[Tuple[float, int]]] = {}  # each thread's jobs by start
    for w, on_worker in enumerate(program.worker_jobs):
        by_thread.setdefault(threads[w], []).extend((starts[job.index], job.index) for job in on_worker
                                                    if starts[job.index] >= 0)
    for jobs in by_thread.values():
        jobs.sort()
    found: List[Tuple[int, float, float]] = []
    for ident, start, end in waits:
        jobs = by_thread.get(ident, [])
        at = bisect.bisect_right(jobs, (start, len(starts))) - 1  # the last job that started by then
        if at >= 0 and end <= ends[jobs[at][1]]:
            found.append((jobs[at][1], start, end))
    return sorted(found, key=lambda wait: wait[1])


def describe_error(error: BaseException) -> str:
    """``"TypeName: message"``, the way a traceback's last line names an exception (whose
    ``__str__`` may itself fail: the error is raised anyway, so describing it must not)."""
    try:
        message = str(error)
    except Exception:  # noqa: BLE001 - a user's exception class with a broken __str__
        message = "<str() of the error failed>"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _profiled(profiling: bool, label: str) -> ContextManager[Any]:
    """A profiler range named ``label`` while a profiler records; nothing otherwise."""
    return torch.profiler.record_function(label) if profiling else contextlib.nullcontext()


def _action_fields(key: Any) -> Dict[str, Any]:
    """A plan action's ``stage``, ``microbatch`` and ``kind``, where ``key`` has them."""
    return {name: getattr(key, name) for name in ("stage", "microbatch", "kind") if hasattr(key, name)}


class Latch:
    """A one-shot event for the caller's thread to wait on, interrupt-safe.

    ``threading.Event`` waits through a Python-level ``Condition``: a KeyboardInterrupt that
    lands between its lock operations can leave the condition's lock held or released twice,
    after which the next ``set()`` or ``wait()`` blocks for good (seen once in about 900
    random Ctrl-Cs). Here the wait is one C-level lock acquire, which an interrupt either
    leaves undone or lets complete: the latch is never left half-changed.
    """

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        self._set = True  # first: a waiter woken by the release finds it set
        try:
            self._lock.release()
        except RuntimeError:  # set already
            pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Return once ``set()`` was called (True), or after ``timeout`` seconds (False).

        May be called again after an interrupt.
        """
        if not self._set:
            # Never released once acquired: every later wait sees ``_set``.
            return self._lock.acquire(timeout=-1 if timeout is None else timeout)
        return True


class _Step:
    """The mutable state of one running step: result slots, abort flag, timings."""

    def __init__(self, program: Program, context: Any, state: ThreadState,
                 on_abort: Optional[Callable[[Optional[BaseException]], None]] = None,
                 launch: Optional[Callable[[int], None]] = None) -> None:
        n = len(program.jobs)
        self.context = context
        self.on_abort = on_abort
        # Each worker queued for the step counts down once, after its last job of the step. The
        # caller queues those whose first job needs nothing; a job that completes the inputs of
        # another worker's first job queues that worker, and counts it in first (``set``). A
        # worker never queued (the step aborted first) never counts, so an abort has nothing to
        # count out and may be repeated.
        self.remaining_workers = len(program.first_workers)
        self.finished = Latch()
        # Set by the workers, one each, once they passed every task the step gave them; queued
        # when the step must end without every worker counting out (``Runtime._try_end``).
        self.drain: List[Latch] = []
        self.owner = state.owner  # this step's token in the chains of the work it waits on
        if not self.remaining_workers:
            self.finished.set()
        self.state = state
        self.values: List[Any] = [None] * n
        self.remaining_consumers = list(program.consumers)
        # Created and taken in C loops: at the start of every step, on the critical path.
        self.locks = list(starmap(_new_lock, repeat((), n)))
        deque(map(_LOCK_TYPE.acquire, self.locks), 0)
        self.done = [False] * n
        self.keep = program.keep
        self.drop_on_take = program.drop_on_take
        self.guard = threading.Lock()
        self.aborted = False
        self.woken = False
        self.error: Optional[BaseException] = None
        self.failed_job: Optional[int] = None  # the job that raised ``error``, if a job did
        # Workers queued by the results their first job needs (``launch(w)`` queues them).
        self.launch = launch
        self.unblocks = program.unblocks
        self.missing_inputs = list(program.first_needs)
        self.half_launched = False
        self.starts = [-1.0] * n
        self.ends = [-1.0] * n

    def set(self, index: int, value: Any) -> None:
        with self.guard:
            if self.aborted:
                return
            self.values[index] = value
            self.done[index] = True
            self.locks[index].release()
            for worker in self.unblocks[index]:
                self.missing_inputs[worker] -= 1
                if not self.missing_inputs[worker]:
                    # Under the guard: an abort, which takes it too, either comes first (and this
                    # worker is never queued) or finds its tasks queued ahead of a drain marker.
                    # Counted in before its tasks go: its last one may count it out at once.
                    assert self.launch is not None
                    self.remaining_workers += 1
                    try:
                        self.launch(worker)
                    except BaseException:  # noqa: B902 - aborts the step, in the job that launched
                        # Some of its tasks may be queued, but not its last, which would count it
                        # out: take it back out, and have the caller drain the queues.
                        self.half_launched = True
                        self.remaining_workers -= 1
                        raise

    def take(self, index: int) -> Any:
        lock = self.locks[index]
        lock.acquire()
        lock.release()
        if self.aborted:
            raise StepAborted
        value = self.values[index]
        if self.drop_on_take[index]:  # the only consumer: nobody else reads the slot
            self.values[index] = None
            return value
        with self.guard:
            self.remaining_consumers[index] -= 1
            if self.remaining_consumers[index] == 0 and not self.keep[index]:
                self.values[index] = None
        return value

    def worker_finished(self) -> None:
        with self.guard:
            self.remaining_workers -= 1
            last = self.remaining_workers == 0
        if last:
            self.finished.set()

    def abort(self, error: Optional[BaseException], job: Optional[int] = None) -> None:
        """Stop the step for ``error`` (raised by ``job``, if a job raised it); the first error is kept."""
        # An interrupt (a second Ctrl-C) must not stop the release loop halfway: a job left
        # waiting on a lock nobody releases would hang the step, and the next call behind it.
        pending: Optional[BaseException] = None
        while True:
            try:
                self._release_all(error, job)
                if not self.woken:  # marked only once done: a cut-short wake runs again
                    self._wake_outside(error)
                    self.woken = True
                break
            except BaseException as exc:  # noqa: B902 - held until every wait is released
                pending = pending or exc
        if pending is not None:
            raise pending

    def _release_all(self, error: Optional[BaseException], job: Optional[int] = None) -> None:
        """Mark the step aborted and release every result lock (again, if a pass was cut short)."""
        with self.guard:
            if self.error is None and error is not None:
                self.error = error
                self.failed_job = job
            self.aborted = True
            self.state.cancel.cancelled = True  # a job waiting for a generator's lock gives up
            for i, lock in enumerate(self.locks):
                if not self.done[i]:
                    try:
                        lock.release()
                    except RuntimeError:  # released by a pass that an interrupt cut short
                        pass
                    self.done[i] = True

    def _wake_outside(self, error: Optional[BaseException]) -> None:
        if self.on_abort is not None:
            # Wake waits that live outside the runtime (a host-table lookup, say).
            try:
                self.on_abort(error)
            except BaseException:  # noqa: B902 - the first error is the one to report
                pass


class Runtime:
    """Runs programs on a fixed list of workers, one step at a time.

    Steps from several caller threads are serialised (each waits for the previous one). A
    job that calls back into the same runtime from a worker thread gets a RuntimeError
    instead of a deadlock.
    """

    def __init__(self, workers: Sequence[Worker]) -> None:
        self.workers = list(workers)
        self._lock = threading.Lock()
        self._step: Optional[_Step] = None
        self._tasks: Dict[int, Tuple[List[Task], List[Task]]] = {}
        self.last_step: Optional[StepRecord] = None
        self._worker_threads = {w.thread.ident for w in self.workers}
        self._built_in = fork_generation()
        self._inline_owner: Optional[int] = None  # the step running on its caller's thread, if one is

    def _try_end(self, step: _Step, wait_s: float, error: Optional[BaseException]) -> bool:
        """End ``step`` if its workers pass what it gave them within ``wait_s``; else leave it.

        A step whose every worker counted itself out is simply uninstalled: aborting it would
        call the on_abort hook, which tells the code around the runtime that a step failed.
        Any other is aborted first, with ``error`` unless it has one (again, if it was: an
        interrupt can cut an abort short), so that every job still waiting on a result, or
        on a wait outside the runtime (the hook needs an exception to raise there), wakes and
        skips. Which of its tasks are still queued is unknown: a marker behind them on every
        queue tells when none is left. Only then is the step uninstalled, so its tasks, which
        read ``self._step``, never meet the next step. Interrupts are not held: whatever they
        cut short, the step stays installed, and the next call ends it.
        """
        if not step.finished.is_set() or step.half_launched:
            step.abort(error if error is not None else StepAborted("the call that ran this step did not wait for it"))
            for worker in self.workers[len(step.drain):]:
                marker = Latch()
                # Queued before recorded: an interrupt in between leaves an orphan marker, and
                # the next pass queues another, which is harmless.
                worker.in_queue.put(Task(marker.set, None, "drain"))
                step.drain.append(marker)
            deadline = time.perf_counter() + wait_s
            for marker in step.drain:
                if not marker.wait(max(0.0, deadline - time.perf_counter())):
                    return False
        if self._step is step:
            self._step = None
        return True

    def refuse_if_forked(self) -> None:
        """RuntimeError in a process forked after this runtime was built: its worker threads
        stayed in the parent, and a step queued for them would wait forever."""
        if self._built_in != fork_generation():
            raise RuntimeError(
                "this pipeline was built in another process: this one was forked from it afterwards (a DataLoader "
                "worker, multiprocessing), and its worker threads did not come along, as threads never do. Build "
                "a new pipeline in this process (copy.deepcopy of a Pipe makes one), or use it in the process "
                "that built it")

    def refuse_worker_caller(
        self, message: str = "a pipeline stage called its own pipeline: re-entrant calls would deadlock"
    ) -> None:
        """RuntimeError(``message``) when called from work this runtime's step waits on.

        That is one of its workers, or any thread doing work for one of its steps (a host
        task a stage submitted, a stage of a pipeline a stage called): the call would wait
        for this runtime's lock, which the waiting step holds.
        """
        if threading.get_ident() in self._worker_threads:
            raise RuntimeError(message)
        step = self._step  # work that kept the chain of an ended step is free to call
        owners = call_chain.current().owners
        if step is not None and step.owner in owners or self._inline_owner in owners:
            raise RuntimeError(message)

    def _tasks_for(self, program: Program) -> List[List[Task]]:
        cached = self._tasks.get(id(program))
        if cached is not None and cached[0] is program:  # type: ignore[comparison-overlap]
            return cached[1]  # type: ignore[return-value]
        per_worker: List[List[Task]] = []
        for jobs in program.worker_jobs:
            per_worker.append([Task(self._compute_for(job, last=job is jobs[-1]), None, job.label) for job in jobs])
        if len(self._tasks) >= 32:  # programs are cached by their owner; keep this map bounded
            self._tasks.clear()
        self._tasks[id(program)] = (program, per_worker)  # type: ignore[assignment]
        return per_worker

    def _compute_for(self, job: _Job, last: bool) -> Callable[[], None]:
        """The task body of ``job``: wait for its inputs, run it, publish its result.

        It never raises: a failure aborts the step right here, on the worker, so this worker
        and every other one skip the rest of the step at once. The worker's last job of the
        step counts the worker out, whatever happened.
        """
        runtime = self
        index, deps, function, label = job.index, job.deps, job.function, job.label
        with_autocast = not runs_outside_autocast(function)  # a backward leaves the caller's autocast
        only_dep = deps[0] if len(deps) == 1 else None  # the common case, without a generator

        def compute() -> None:
            step = runtime._step
            assert step is not None
            start = -1.0
            try:
                if step.aborted:
                    return
                if only_dep is not None:
                    inputs: Tuple[Any, ...] = (step.take(only_dep),)
                elif deps:
                    inputs = tuple(map(step.take, deps))
                else:  # a job with no deps (a first stage's: its input is in the context)
                    inputs = ()
                state = step.state
                adopt(state.chain)
                torch._C._set_grad_enabled(state.grad_enabled)
                start = time.perf_counter()
                if state.plain:
                    value = function(step.context, inputs)
                else:
                    with state.contexts(label, with_autocast):
                        value = function(step.context, inputs)
                step.ends[index] = time.perf_counter()
                step.starts[index] = start
                step.set(index, value)
            except StepAborted:
                pass
            except BaseException as exc:  # noqa: B902 - KeyboardInterrupt in a stage reaches the caller too
                if start >= 0:  # the step's record shows the failed job, up to its failure
                    step.ends[index] = time.perf_counter()
                    step.starts[index] = start
                step.abort(exc, index)
            finally:
                if last:
                    step.worker_finished()

        return compute

    def _stopped_with_work_left(self, program: Program, step: _Step) -> List[str]:
        """The workers whose threads ended before their last job of ``step`` did."""
        return [worker.name for worker, jobs in zip(self.workers, program.worker_jobs)
                if jobs and step.ends[jobs[-1].index] < 0 and not worker.is_alive()]

    def _record(self, program: Program, step: _Step, wall_start: float, wall_end: float,
                error: Optional[BaseException]) -> StepRecord:
        """The record of ``step``: copies, since a job an interrupt left running may still write."""
        failed_job = step.failed_job if error is not None and error is step.error else None
        return self._timings_record(program, list(step.starts), list(step.ends), failed_job, wall_start, wall_end,
                                    error, [worker.thread.ident for worker in self.workers], step.state.lock_waits)

    def _timings_record(self, program: Program, starts: List[float], ends: List[float], failed_job: Optional[int],
                        wall_start: float, wall_end: float, error: Optional[BaseException],
                        threads: List[Optional[int]], waits: call_chain.LockWaits,
                        names: Optional[List[str]] = None) -> StepRecord:
        """A step's record from its jobs' times (kept as given) and how the call ended;
        ``threads``: the ident of the thread that ran each worker's jobs, ``waits`` the step's
        waits for a generator's lock, ``names``: the threads' names (the workers' by default)."""
        return StepRecord(
            labels=list(program.labels),
            workers=list(program.job_workers),
            worker_names=names if names is not None else [w.name for w in self.workers],
            starts=starts,
            ends=ends,
            wall_start=wall_start,
            wall_end=wall_end,
            keys=list(program.keys),
            error=None if error is None else describe_error(error),
            failed_job=failed_job,
            lock_waits=_jobs_lock_waits(program, starts, ends, threads, waits),
        )

    def stop(self, finalizer: Any) -> None:
        """Stop the workers through their owner's ``finalizer`` (`workers.stopped_with`): joined
        within `STOP_TIMEOUT_S`, or within `LEFT_BEHIND_WAIT_S` when a job of a step an
        interrupted call left behind is still running (it may never return, and the wait for
        it already ran out once), so that ``close()`` does not hang on it for long."""
        held = finalizer.peek()
        if held is None:  # stopped already
            return
        stuck = not self.end_left_behind()
        workers = held[2][0]
        for worker in workers:  # asked before the finalizer lets go: a close() cut short here
            worker.stop(join=False)  # by Ctrl-C leaves the workers stopping (or exit stops them)
        if finalizer.detach() is not None:
            stop_workers(workers, timeout=LEFT_BEHIND_WAIT_S if stuck else STOP_TIMEOUT_S)

    def end_left_behind(self, wait_s: float = LEFT_BEHIND_WAIT_S) -> bool:
        """End the step a failed or interrupted call left installed, now; True if none is left.

        The next call would end it anyway. Code around the runtime that cleans up after a
        failed call (the rec pipeline clears its host tables' abort) calls this first, so that
        the step's late abort, and the on_abort hook it may still call, come before that
        cleanup rather than poisoning the next call's step. Waits at most ``wait_s`` for the
        runtime's lock and for the step's jobs; a call in progress on another thread, or a job
        stuck in user code, makes it return False.
        """
        if not self._lock.acquire(timeout=wait_s):
            return False
        try:
            step = self._step
            return step is None or self._try_end(step, wait_s, None)
        finally:
            self._lock.release()

    def run(self, program: Program, context: Any, *args: Any, **kwargs: Any) -> Dict[Hashable, Any]:
        """Run one step of ``program``; returns the results of its ``keep`` jobs by key.

        Takes :meth:`run_kept`'s arguments, which returns the results as a list instead, in
        job order, without hashing a key: a caller that knows that order saves a call per result.
        """
        kept = self.run_kept(program, context, *args, **kwargs)
        return dict(zip([key for key, _ in program.kept], kept))

    def run_kept(
        self,
        program: Program,
        context: Any,
        device_types: Sequence[str] = ("cpu",),
        on_abort: Optional[Callable[[Optional[BaseException]], None]] = None,
        owner: Optional[int] = None,
        inline_chains: bool = False,
    ) -> List[Any]:
        """Run one step of ``program``; returns the results of its ``keep`` jobs, in job order.

        ``owner`` names the step in the chains of the work it waits on (a fresh token by
        default); a caller whose one call spans several steps passes one token to all.

        ``inline_chains=True``: a program that is one chain (no two of its jobs could ever run
        at once: a pipeline of one micro-batch) runs on the caller's thread, job after job,
        saving a thread hand-off per job. For workers whose thread adds nothing a job needs:
        CPU workers (the caller's intra-op thread count then applies), not accelerator ones.

        ``on_abort(error)`` is called once if the step aborts (a job failed, or the caller
        was interrupted), so that waits outside the runtime can be woken too.

        Raises the first exception any job raised, after every worker has left the step.
        """
        self.refuse_if_forked()
        self.refuse_worker_caller()
        if len(program.worker_jobs) > len(self.workers):
            raise ValueError(
                f"program needs {len(program.worker_jobs)} workers, runtime has {len(self.workers)}"
            )
        program.freeze()
        with self._lock:
            token = call_chain.new_owner() if owner is None else owner
            self._end_left_behind_or_refuse()
            if inline_chains and program.chain_order is not None:
                return self._run_inline(program, context, device_types, on_abort, token)
            return self._run_locked(program, context, ThreadState(device_types, token), on_abort)

    def _end_left_behind_or_refuse(self) -> None:
        """End the step an interrupted call left installed, or raise while one of its jobs runs on."""
        previous = self._step
        if previous is not None and not self._try_end(previous, LEFT_BEHIND_WAIT_S, None):
            raise RuntimeError(
                "a job of an earlier step, left behind when an interrupt or a failure stopped the wait for it, "
                "has not returned: a stage that is still running, or never returns (it waits for something that "
                "waits for this pipeline), holds its worker. Nothing can run here until it returns, and then this "
                "pipeline works again; if it never will, close() this pipeline and build a new one"
            )

    def _run_inline(self, program: Program, context: Any, device_types: Sequence[str],
                    on_abort: Optional[Callable[[Optional[BaseException]], None]], owner: int) -> List[Any]:
        """Run a one-chain program on this thread, in its order, as the workers would have.

        What a worker carries over is this thread's own state already; what differs is put
        around each job as the workers put it: the step's call chain (a stage that calls this
        pipeline again is refused, RNG locks pass down), the grad mode of the call (a job
        that changes it does not leak into the next), the caller's autocast left for a
        backward job, and a profiler range named by the job's label. Under autocast, the
        low-precision copies of the weights the step cast are dropped from this thread's cast
        cache when it ends: a worker's job casts in an autocast region of its own, which drops
        them, and a cache that outlived the step would hand the next step, in the same
        autocast block, copies of the weights as they were before the optimizer's update.
        A failure is the step's: the on_abort hook wakes waits outside the runtime, the record
        marks the failed job, and the error goes up as raised. Nothing is left running, so
        nothing stays installed.
        """
        jobs = program.chain_order
        assert jobs is not None
        n = len(program.jobs)
        values: List[Any] = [None] * n
        remaining = list(program.consumers)
        keep = program.keep
        starts, ends = [-1.0] * n, [-1.0] * n
        cancel = call_chain.Cancel()
        caller_chain = call_chain.current()
        waits: call_chain.LockWaits = []
        chain = caller_chain.serving(owner, cancel, waits)
        grad_enabled = torch.is_grad_enabled()
        profiling = bool(torch.autograd.profiler._is_profiler_enabled)
        failed: Optional[int] = None
        error: Optional[BaseException] = None
        wall_start = time.perf_counter()
        self._inline_owner = owner
        try:
            for job in jobs:
                index = job.index
                inputs = tuple([values[d] for d in job.deps])
                for d in job.deps:
                    remaining[d] -= 1
                    if not remaining[d] and not keep[d]:
                        values[d] = None
                adopt(chain)
                torch._C._set_grad_enabled(grad_enabled)
                start = time.perf_counter()
                try:
                    if runs_outside_autocast(job.function):
                        with leave_autocast(device_types), _profiled(profiling, job.label):
                            value = job.function(context, inputs)
                    elif profiling:
                        with torch.profiler.record_function(job.label):
                            value = job.function(context, inputs)
                    else:
                        value = job.function(context, inputs)
                except BaseException:  # noqa: B902 - the record shows the failed job, up to its failure
                    ends[index] = time.perf_counter()
                    starts[index] = start
                    failed = index
                    raise
                ends[index] = time.perf_counter()
                starts[index] = start
                values[index] = value
                del inputs, value
        except BaseException as exc:  # noqa: B902 - KeyboardInterrupt too: the step failed
            error = exc
            cancel.cancelled = True
            if on_abort is not None:
                try:
                    on_abort(exc)
                except BaseException:  # noqa: B902 - the first error is the one to report
                    pass
        finally:
            # An interrupt here must not leave this thread serving the step (its chain would
            # refuse every later call as re-entrant, and its set cancel give up every RNG lock
            # wait): the restore runs again until it is done, and the interrupt is raised after.
            # (Not in a function of its own: a pending signal is raised on entry to a call.)
            late: Optional[BaseException] = None
            while True:
                try:
                    self._inline_owner = None
                    adopt(caller_chain)
                    torch._C._set_grad_enabled(grad_enabled)
                    break
                except BaseException as exc:  # noqa: B902 - KeyboardInterrupt: restore first, raise after
                    late = late or exc
            wall_end = time.perf_counter()
        if late is not None and error is None:
            error = late  # the step ran, but the call was interrupted: it raises, as at any other point
        try:
            if autocast_active(device_types):
                torch.clear_autocast_cache()
        except BaseException as exc:  # noqa: B902 - an interrupt: the call raises it (the state is restored)
            error = error or exc
        caller = threading.current_thread().name  # the jobs ran here, not on the workers
        self.last_step = self._timings_record(program, starts, ends, failed, wall_start, wall_end, error,
                                              [threading.get_ident()] * len(self.workers), waits,
                                              [f"{caller} (the caller's thread, for {w.name})" for w in self.workers])
        if error is not None:
            values.clear()  # the traceback holds this frame: the step's activations must not stay with it
            context = None
            try:
                raise error.with_traceback(error.__traceback__)
            finally:  # this frame is in the traceback: its locals must not hold the error
                error = None
        return list(map(values.__getitem__, program.kept_indices))

    def _run_locked(
        self, program: Program, context: Any, state: ThreadState, on_abort: Optional[Callable[[Optional[BaseException]], None]]
    ) -> List[Any]:
        worker_tasks = self._tasks_for(program)
        queues = [worker.in_queue for worker in self.workers]

        def launch(w: int) -> None:
            put = queues[w].put
            for task in worker_tasks[w]:
                put(task)

        step = _Step(program, context, state, on_abort, launch)
        wall_start = time.perf_counter()
        try:
            self._step = step  # inside the try: an interrupt here still aborts and drains
            for w in program.first_workers:
                launch(w)
        except BaseException as exc:  # noqa: B902 - an interrupt while queueing: some workers lack tasks
            try:
                self._try_end(step, ABANDON_AFTER_S, exc)
            except BaseException:  # noqa: B902 - a second interrupt: the step stays, the next call ends it
                pass
            self.last_step = self._record(program, step, wall_start, time.perf_counter(), exc)
            raise
        # Any exception raised in the wait (Ctrl-C, a test timeout) aborts the step; the caller
        # then waits up to ABANDON_AFTER_S for the jobs to leave it. A second one, or the end of
        # that grace (a job that never returns), stops the wait: the step stays installed (its
        # jobs may still run) and the next call ends it, or refuses while a job runs on.
        interrupt: Optional[BaseException] = None
        abandoned = False  # the wait for the jobs was given up: they may still be running
        while True:
            try:
                if interrupt is None:
                    if step.finished.wait(WORKERS_CHECK_S):
                        break
                    stopped = self._stopped_with_work_left(program, step)
                    if stopped:
                        interrupt = RuntimeError(
                            f"worker threads {stopped} stopped while this call ran (the pipeline was closed on "
                            "another thread): the call is given up, its tasks there would never run")
                        continue  # the top of the loop aborts the step, as for an interrupt
                else:
                    step.abort(interrupt)
                    abandoned = not step.finished.wait(ABANDON_AFTER_S)
                    break
            except BaseException as exc:  # noqa: B902 - KeyboardInterrupt while waiting: abort, drain
                if interrupt is None:
                    interrupt = exc
                    try:  # here too: a signal can land on the back edge below, outside the try
                        step.abort(exc)
                    except BaseException:  # noqa: B902 - cut short: the top of the loop aborts again
                        pass
                    continue
                abandoned = True
                break
        wall_end = time.perf_counter()
        if abandoned:  # the step stays installed (the next call ends it); its record says so now
            self.last_step = self._record(program, step, wall_start, wall_end, interrupt)
            raise interrupt  # type: ignore[misc]
        if step.half_launched:
            # A worker got part of its tasks (a queue put raised on a worker thread): they must
            # pass before the next step. Uninstalled once drained; past the grace, the next call
            # ends the step instead.
            self._try_end(step, ABANDON_AFTER_S, None)
        else:
            self._step = None
        error = step.error if step.error is not None else interrupt
        self.last_step = self._record(program, step, wall_start, wall_end, error)
        if error is not None:
            # The error's traceback holds the failed job's frame, which holds ``step``: drop
            # what the step owns, so that its activations and the cycle through ``step.error``
            # do not outlive the caller's ``except`` block (waiting for the cycle collector).
            step.error = None
            step.values = []
            step.context = None
            try:
                raise error.with_traceback(error.__traceback__)
            finally:  # this frame is in the traceback: its locals must not hold the error
                error = interrupt = None
        return list(map(step.values.__getitem__, program.kept_indices))
