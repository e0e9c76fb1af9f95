"""`StagedPipeline`: a train step declared as a list of stages, run clock by clock.

Like TorchRec's ``StagedTrainPipeline``, a pipeline is a list of `PipelineStage` (name,
runnable, where it runs) rather than a subclass that rewrites ``progress()``. Unlike it,
stages run on worker threads of the same `Runtime` as `Pipe`: a device compute worker,
a device copy worker (its own stream on an accelerator) and device-less host threads.

Each clock is one runtime step: a `Program` holding one job per busy stage, stage ``s``
on batch ``t - s`` (see `schedule.py`). Jobs of a clock are independent, so they overlap
on their workers; a batch's next stage runs in the next clock, after this one drained.
That gives both orders a stage pipeline needs without extra locks: stage ``i`` of batch
``b`` after stage ``i - 1`` of ``b``, and after stage ``i`` of ``b - 1``.

On an accelerator the threads finishing in order is not enough: each stage queues work on
its thread's stream. So each stage records an event after it, the next stage's stream
waits on that event before it runs (the first stage's waits on the caller's stream), the
input's device memory is recorded on the consumer's stream, and the caller's stream waits
for the last stage before ``progress`` returns.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .. import call_chain
from ..call_lock import CallLock
from ..copy import caller_waits_for_streams
from ..devices import Backend, get_backend, usable_device
from ..checks import as_int, check_bool, check_nonnegative_int
from ..runtime import Program, Runtime, StepRecord
from ..thread_state import refuse_untransferable_state, warn_if_the_profiler_records_this_thread_only
from ..workers import (STOP_TIMEOUT_S, OwnsThreads, Worker, check_intra_op_threads, intra_op_budget, stop_workers,
                       stopped_with)
from ..grad_sync import PeerStepFailed
from ..notes import add_note
from .schedule import Clock, ClockSchedule, schedule_table

__all__ = ["PipelineStage", "StagedPipeline", "PipelineFailure"]

WorkerSpec = Union[str, int]
_NAMED = ("device", "copy", "host")


_NO_BATCHES: Iterator[Any] = iter(())
"""The iterator ``flush()`` drains with: never asked for a batch."""


@dataclass(frozen=True)
class PipelineStage:
    """One stage: ``runnable(previous stage's output) -> output``, run on ``worker``.

    ``worker``: ``'device'`` (the compute worker, with the device's compute stream),
    ``'copy'`` (a second device worker with its own stream, for H2D/D2H), ``'host'`` (a
    device-less host thread; host stages are spread round-robin over the host threads), or
    an int index into ``StagedPipeline.worker_names``.

    ``local``: a failure of the stage leaves no collective (no call on a process group) of
    this rank unissued: the stage issues none, or, failing, still issues the ones the other
    ranks wait for. In a pipeline with ``agree`` (one rank of several), a local stage's
    failure does not cancel its clock's other jobs: they run on, so that their collectives
    still pair up with the other ranks', and ``agree`` fails the clock on every rank at its
    end. Ignored without ``agree``. An error marked with `fail_clock_now` (a collective that
    failed itself) cancels the clock at once, as a stage that is not local does.
    """

    name: str
    runnable: Callable[[Any], Any]
    worker: WorkerSpec = "device"
    local: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"stage name must be a non-empty string, got {type(self.name).__name__}: {self.name!r}")
        if not self.name:
            raise ValueError("stage name must be a non-empty string, got ''")
        if not callable(self.runnable):
            raise TypeError(f"stage {self.name!r}: runnable must be callable, got {type(self.runnable).__name__}")
        w = self.worker
        if isinstance(w, str):
            if w not in _NAMED:
                raise ValueError(f"stage {self.name!r}: worker must be one of {_NAMED} or a worker index, got {w!r}")
        else:
            index = as_int(w)  # a NumPy integer too, as chunks and balance take them
            if index is None:
                raise TypeError(f"stage {self.name!r}: worker must be one of {_NAMED} or a worker index (int), got "
                                f"{type(w).__name__}: {w!r}")
            if index < 0:
                raise ValueError(f"stage {self.name!r}: worker index must be >= 0, got {index}")
            object.__setattr__(self, "worker", index)  # a plain int from here on
        check_bool(f"stage {self.name!r}: local", self.local)


_FAIL_CLOCK_NOW = "_torchpipe_fail_clock_now"


def fail_clock_now(error: Exception) -> Exception:
    """Mark ``error``, raised by a ``local`` stage, to fail its clock at once instead of at the
    clock's end: what failed is a collective itself (a peer gone, the group's timeout), so no
    rank is left to pair up with, and a vote would only wait for the same peer. Returns it."""
    setattr(error, _FAIL_CLOCK_NOW, True)
    return error


def keep_unreturned_output(error: BaseException, output: Any) -> None:
    """Hand the output of a batch that finished in a failing clock, which the failing call will
    not return, to its caller: appended to ``error.finished_outputs``.

    Why: that batch's step happened (a train pipeline counts it in ``steps_done``, its updates
    stay), so a loop that collects outputs would otherwise be one short, silently."""
    kept = getattr(error, "finished_outputs", None)
    if not isinstance(kept, list):
        kept = []
        error.finished_outputs = kept  # type: ignore[attr-defined]
    kept.append(output)


def keep_flushed_outputs(error: BaseException, outputs: List[Any]) -> None:
    """Hand the outputs a failing ``flush()`` had finished to its caller: ``error.flushed_outputs``,
    those it had returned from its steps and the failing clock's finished batch, if any."""
    outputs = list(outputs) + list(getattr(error, "finished_outputs", None) or [])
    error.flushed_outputs = outputs  # type: ignore[attr-defined]
    if outputs:
        add_note(error, f"[torchpipe.train] flush() finished {len(outputs)} batches before or in the clock that "
                        "failed: their outputs are in this error's flushed_outputs")


class PipelineFailure:
    """What a failed clock left behind, for `StagedPipeline(on_failure=...)`.

    ``completed``: stage -> output of the jobs of the failed clock that did finish;
    ``dropped``: the batches that were in flight and will not be returned.
    """

    def __init__(self, error: BaseException, clock: Clock, completed: Dict[int, Any], dropped: List[int]) -> None:
        self.error = error
        self.clock = clock
        self.completed = completed
        self.dropped = dropped


class UnevenDataError(RuntimeError):
    """The data ended on some ranks of a sharded pipeline while others still had a batch.

    Why an error and not a hang: every rank takes part in each batch's collectives, so a rank
    whose data ran out leaves the others waiting in theirs until the group's timeout. Raised
    on every rank in the same ``progress()`` call (by the ``admit`` and ``data_ended`` hooks
    that vote on it); the pipeline then treats the data as ended on every rank, so further
    calls with the same iterator finish the batches in flight in step, then raise
    StopIteration.
    """


def _keep_unreturned(exc: BaseException, clock: Clock, outputs: Dict[int, Any], last: int) -> None:
    """``clock`` handed its outputs on, then ``exc`` was raised: its finished batch, if any,
    goes to the caller on the error (the rest stays in flight)."""
    if clock.finished is not None and last in outputs:
        keep_unreturned_output(exc, outputs[last])
        add_note(exc, f"[torchpipe.train] after clock {clock.index}: batch {clock.finished} did finish (its "
                      "output is in this error's finished_outputs); the batches in flight stay in flight")


class _FirstFailure:
    """Where the current clock failed first: ``"stage 'plan'"``, say (None: the caller was interrupted)."""

    __slots__ = ("where",)

    def __init__(self) -> None:
        self.where: Optional[str] = None

    def note(self, where: str) -> None:
        if self.where is None:
            self.where = where


class _ClockRun:
    """The context of one clock's runtime step: inputs per stage, outputs as they finish.

    On an accelerator, ``ready[s]`` is the event after which stage ``s``'s input may be
    read (recorded where it was made), and ``done[s]`` the event after stage ``s``'s work.

    ``deferred`` holds the failures of local stages that wait for the clock's end (`agree`),
    each with the stage (index, and where for the notes) it happened in, in the order they
    happened.
    """

    __slots__ = ("inputs", "outputs", "ready", "done", "deferred")

    def __init__(self, inputs: List[Any], ready: List[Any]) -> None:
        self.inputs = inputs
        self.outputs: Dict[int, Any] = {}
        self.ready = ready
        self.done: Dict[int, Any] = {}
        self.deferred: List[Tuple[int, str, Exception]] = []


def record_streams(value: Any, stream: Any, backend: Backend, device_type: str, depth: int = 0) -> None:
    """Tell the allocator that the device tensors in ``value`` are used on ``stream``.

    A stage's output was allocated on its producer's stream; once the consumer's stream is
    done with it, the allocator must not hand its memory back to the producer's stream
    early. Walks tensors (through ``backend.record_stream``), dataclasses field by field,
    sequences and mappings, a few levels deep; any other object with its own
    ``record_stream`` (a KeyedJaggedTensor) is handed ``stream`` as it is, so a backend's
    streams must be what its tensors' ``record_stream`` takes (torch streams are).
    """
    if depth > 4 or value is None:
        return
    if isinstance(value, torch.Tensor):
        if value.device.type == device_type:
            backend.record_stream(value, stream)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            record_streams(getattr(value, f.name), stream, backend, device_type, depth + 1)
    elif hasattr(value, "record_stream") and callable(value.record_stream):
        where = getattr(value, "device", None)  # a KeyedJaggedTensor's is a method
        where = where() if callable(where) else where
        if isinstance(where, torch.device) and where.type == device_type:
            value.record_stream(stream)
    elif isinstance(value, (list, tuple)):
        for item in value:
            record_streams(item, stream, backend, device_type, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            record_streams(item, stream, backend, device_type, depth + 1)


def check_pipeline_options(host_threads: Any, device_threads: Any, overlap: Any, keep_records: Any) -> None:
    """The thread and bookkeeping options every staged pipeline takes, checked before anything starts."""
    check_nonnegative_int("host_threads", host_threads)
    check_intra_op_threads(device_threads, "device_threads")
    check_bool("overlap", overlap)
    check_nonnegative_int("keep_records", keep_records)


class StagedPipeline(OwnsThreads):
    """Runs ``stages`` over a dataloader iterator; ``progress()`` returns one finished batch per call.

    ``device``: where the device workers run (``'cpu'`` gives plain threads, no streams).
    ``host_threads``: at most this many device-less threads for host stages; threads above
    the highest one a stage runs on are not started (a generous value costs nothing).
    ``overlap=False`` runs the jobs of a clock one after another (same work, same order, no
    concurrency): the serial baseline. ``admit(batch)`` runs on the caller's thread before a batch enters; if it
    raises, the batch is not admitted and nothing changes. ``data_ended(error)`` runs there
    instead when the data iterator had no batch: ``error`` is None when it ended, or what
    ``next()`` raised (an ``Exception``; re-raised after the hook), so that ranks that vote on
    every admission vote here too. If ``admit`` or ``data_ended`` raises `UnevenDataError`, the
    data counts as ended: the call raises it, and later calls with that iterator only drain.
    ``on_abort(exc)`` runs once as
    soon as a clock aborts, because a stage raised or the caller was interrupted (wake waits
    the other jobs may be blocked in); ``on_failure(PipelineFailure)`` and ``after_clock(clock, outputs)`` run on
    the caller's thread after the runtime drained the clock. ``before_call()`` runs on the
    caller's thread at the start of every ``progress()`` (so of ``flush()`` too), before
    any batch is admitted: where bookkeeping that an interrupted ``after_clock`` left
    undone is finished (if it raises, nothing else has happened in that call).

    ``agree(failure)``, for one rank of several: runs on the caller's thread after every
    clock's jobs returned, with the first failure of a ``local`` stage in that clock (None if
    none failed). It tells the other ranks, and returns a ``check`` callable that raises if
    any rank failed in that clock (this rank's ``failure`` too). The clock is handed on (its
    finished batch returned), and the pipeline calls ``check()`` before its next clock or
    admission, in this call or the next: then every rank raises in the same call, before
    any batch is admitted, drops the same batches (``on_failure``) and returns the same
    outputs, and no rank waits for the others at a clock's end. (An ``agree`` that raises,
    or returns None for a failure, fails the clock at once instead.) When the failed stage is
    the last one, the clock has no finished batch to hand on: it fails at its end, after
    ``check()``; a last stage that fails on every rank together (it agrees within itself, as
    `EmbCacheTrainPipeline`'s train stage does) so fails the same clock on every rank. A
    failure of a stage that is not local still cancels the clock at once: this rank never
    reaches ``agree``, and the other ranks wait in their collectives until the group's timeout.

    No finished batch is lost with an error: when a clock fails, or the call is interrupted,
    after the last stage finished a batch, that batch's output is in the error's
    ``finished_outputs`` list (its step happened). A ``flush()`` that fails part way keeps
    what it had finished: the error's ``flushed_outputs`` holds the outputs of the batches it
    finished, the failing clock's too, in order.
    """

    def __init__(self, stages: Sequence[PipelineStage], *, device: Union[str, torch.device] = "cpu",
                 host_threads: int = 1, device_threads: Optional[int] = None, overlap: bool = True,
                 admit: Optional[Callable[[Any], None]] = None,
                 data_ended: Optional[Callable[[Optional[Exception]], None]] = None,
                 on_abort: Optional[Callable[[BaseException], None]] = None,
                 on_failure: Optional[Callable[[PipelineFailure], None]] = None,
                 after_clock: Optional[Callable[[Clock, Dict[int, Any]], None]] = None,
                 before_call: Optional[Callable[[], None]] = None,
                 agree: Optional[Callable[[Optional[Exception]], Optional[Callable[[], Any]]]] = None,
                 name: str = "torchpipe-train", keep_records: int = 0) -> None:
        stages = list(stages)
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        for stage in stages:
            if not isinstance(stage, PipelineStage):
                raise TypeError(f"stages must be PipelineStage objects, got {type(stage).__name__}")
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        check_pipeline_options(host_threads, device_threads, overlap, keep_records)
        for hook, value in (("admit", admit), ("data_ended", data_ended), ("on_abort", on_abort),
                            ("on_failure", on_failure),
                            ("after_clock", after_clock), ("before_call", before_call), ("agree", agree)):
            if value is not None and not callable(value):
                raise TypeError(f"{hook} must be callable or None, got {value!r}")
        self.device = usable_device(device)
        self.stage_workers = self._assign(stages, int(host_threads))
        # Host threads above the highest one a stage runs on would only idle: not started (a
        # generous host_threads, a core count say, costs nothing).
        started_hosts = max((w - 1 for w in self.stage_workers if w >= 2), default=0)
        self.worker_names = [f"{name}-compute", f"{name}-copy"] + [f"{name}-host{i}" for i in range(started_hosts)]
        self.stages = stages
        self.overlap = overlap
        self._admit, self._on_abort, self._on_failure, self._after_clock = admit, on_abort, on_failure, after_clock
        self._before_call = before_call
        self._data_ended = data_ended
        self._agree = agree
        # The last clock's agree check, until it is asked (before the next clock or admission).
        self._unsettled: Optional[Tuple[Callable[[], Any], Clock, Optional[Exception], str]] = None

        cores = intra_op_budget()  # the cores, capped by the caller's own thread limit
        if device_threads is None:
            device_threads = max(1, cores - (1 if started_hosts else 0)) if self.device.type == "cpu" else 1
        workers: List[Worker] = []
        try:
            for i, wname in enumerate(self.worker_names):
                device_of = self.device if i < 2 else None
                workers.append(Worker(wname, device=device_of, intra_op_threads=device_threads if i < 2 else 1))
        except BaseException:
            stop_workers(workers)
            raise
        self._workers = workers
        self._runtime = Runtime(workers)
        self._finalizer = stopped_with(self, workers)
        self._schedule = ClockSchedule(len(stages))
        self._values: List[Any] = [None] * len(stages)
        self._backend = get_backend(self.device)
        self._streamed = self._backend.type != "cpu"  # stages hand over through events
        self._ready: List[Any] = [None] * len(stages)
        self._programs: Dict[Tuple[int, ...], Program] = {}
        self._lock = CallLock()  # one progress() at a time
        self._closed = False
        self._failure = _FirstFailure()
        self._call_owner: Optional[int] = None  # the token of the progress() call in flight
        # The last iterator that raised StopIteration: not asked again until another one is
        # passed (TorchRec's rule), so a stream that blocks or yields more after its end does
        # not stall or join a drain.
        self._exhausted: Optional[Iterator[Any]] = None
        self.stage_seconds = [0.0] * len(stages)
        self.clock_seconds = 0.0
        self.clocks_run = 0
        self._last_recorded: Optional[StepRecord] = None  # counted in the timings already
        self.records: Deque[StepRecord] = deque(maxlen=check_nonnegative_int("keep_records", keep_records))

    # -- configuration -------------------------------------------------------------
    def _assign(self, stages: Sequence[PipelineStage], host_threads: int) -> List[int]:
        assigned: List[int] = []
        next_host = 0
        for stage in stages:
            w = stage.worker
            if w == "device":
                assigned.append(0)
            elif w == "copy":
                assigned.append(1)
            elif w == "host":
                if host_threads == 0:
                    raise ValueError(f"stage {stage.name!r} runs on a host thread, but host_threads=0")
                assigned.append(2 + next_host % host_threads)
                next_host += 1
            else:
                if w >= 2 + host_threads:
                    hosts = {0: "", 1: " and 2 (host)"}.get(host_threads, f" and 2..{1 + host_threads} (host)")
                    raise ValueError(f"stage {stage.name!r}: worker {w} out of range; workers are 0 (compute), "
                                     f"1 (copy){hosts} with host_threads={host_threads}")
                assigned.append(int(w))
        return assigned

    def device_streams(self) -> List[Tuple[torch.device, Any]]:
        """The streams of the compute and copy workers (CPU streams on the CPU)."""
        return [(self.device, worker.stream) for worker in self._workers[:2]]

    @property
    def closed(self) -> bool:
        """Whether `close` has run: no batch runs here again."""
        return self._closed

    @property
    def depth(self) -> int:
        """How many stages there are: the number of batches in flight once the pipeline is full."""
        return len(self.stages)

    def in_flight(self) -> List[int]:
        """Numbers of the batches admitted and not yet returned, oldest first."""
        return self._schedule.in_flight()

    def schedule_table(self, num_batches: int) -> str:
        """Which batch each stage handles in each progress() call, for ``num_batches`` batches."""
        short = [n.rsplit("-", 1)[-1] for n in self.worker_names]
        return schedule_table([s.name for s in self.stages], [short[w] for w in self.stage_workers], num_batches)

    def print_schedule(self, num_batches: int) -> None:
        """Print `schedule_table` (a check, before training, that stages overlap as intended)."""
        print(self.schedule_table(num_batches))

    # -- execution -----------------------------------------------------------------
    def _program(self, active: Tuple[int, ...]) -> Program:
        program = self._programs.get(active)
        if program is not None:
            return program
        program = Program(len(self._workers))
        previous: Optional[Tuple[str, int]] = None
        # Serial mode chains the jobs last stage first: the order a synchronous loop would free them in.
        order = active if self.overlap else tuple(reversed(active))
        for s in order:
            deps = [previous] if (previous is not None and not self.overlap) else []
            program.add(self.stage_workers[s], ("stage", s), self._job(s), deps,
                        label=self.stages[s].name, keep=True)
            previous = ("stage", s)
        self._programs[active] = program.freeze()
        return program

    def _job(self, s: int) -> Callable[[Any, Tuple[Any, ...]], Any]:
        stage = self.stages[s]
        runnable = stage.runnable
        failure = self._failure  # not self: the cached programs hold these jobs (no cycle)
        where = f"stage {stage.name!r}"
        deferred = stage.local and self._agree is not None  # settled at the clock's end

        backend, device, streamed = self._backend, self.device, self._streamed

        def function(run: _ClockRun, _inputs: Tuple[Any, ...]) -> Any:
            try:
                if streamed:  # this thread's stream: a worker's own, or a host thread's default one
                    stream = backend.current_stream(device)
                    if run.ready[s] is not None:
                        backend.wait_event(stream, run.ready[s])
                    record_streams(run.inputs[s], stream, backend, device.type)
                out = runnable(run.inputs[s])
            except StopIteration as exc:  # would end the caller's loop silently
                error = RuntimeError(f"stage {stage.name!r} raised StopIteration")
                if deferred:
                    error.__cause__ = exc
                    run.deferred.append((s, where, error))
                    return None
                failure.note(where)
                raise error from exc
            except Exception as exc:  # noqa: BLE001 - raised here, or by agree at the clock's end
                if deferred and not getattr(exc, _FAIL_CLOCK_NOW, False):
                    run.deferred.append((s, where, exc))
                    return None
                failure.note(where)
                raise
            except BaseException:  # noqa: B902 - an interrupt is never deferred
                failure.note(where)
                raise
            if streamed:
                event = backend.new_event()
                backend.record_event(event, stream)
                run.done[s] = event
            run.outputs[s] = out
            return out

        return function

    def _wake(self, exc: Optional[BaseException]) -> None:
        """Runtime abort hook: a stage failed or the caller was interrupted; wake outside waits."""
        if self._on_abort is not None and exc is not None:
            self._on_abort(exc)

    def _run_clock(self, clock: Clock) -> Dict[int, Any]:
        """Run ``clock`` and hand its outputs on; on any exception, empty the pipeline.

        The schedule advanced to ``clock`` before this runs, so until the outputs are handed
        on (``ClockSchedule.close``) the stages' values lag behind it. An exception in that
        span, a stage's or a Ctrl-C's wherever it lands, drops every in-flight batch rather
        than letting the next call feed each stage the input it already handled.
        """
        run: Optional[_ClockRun] = None
        try:
            run = _ClockRun(list(self._values), list(self._ready))
            self._failure.where = None
            program = self._program(clock.stages)
            self._runtime.run(program, run, device_types=(self.device.type,), on_abort=self._wake,
                              owner=self._call_owner)
            if self._agree is not None:
                self._settle(clock, run)
            outputs = run.outputs
            if self.depth - 1 in outputs:
                self._caller_may_read(outputs[self.depth - 1], run)
            self._values = [None] + [outputs.get(s) for s in range(self.depth - 1)]
            self._ready = [None] + [run.done.get(s) for s in range(self.depth - 1)]
            self._record()
            self._schedule.close(clock)
        except BaseException as exc:  # noqa: B902
            if self._schedule.open is clock:
                self._abandon_clock(clock, run, exc)
            else:  # the outputs were handed on: nothing to undo
                _keep_unreturned(exc, clock, outputs, self.depth - 1)
            raise
        try:
            if self._after_clock is not None:
                self._after_clock(clock, outputs)
        except BaseException as exc:  # noqa: B902 - the pipeline is in step; hand on what finished
            _keep_unreturned(exc, clock, outputs, self.depth - 1)
            raise
        return outputs

    def _caller_may_read(self, output: Any, run: _ClockRun) -> None:
        """On an accelerator, the caller reads the last stage's output on its own stream: that
        stream waits for the last stage's work, and the output's memory is kept for it."""
        if self._streamed:
            caller = self._backend.current_stream(self.device)
            self._backend.wait_event(caller, run.done[self.depth - 1])
            record_streams(output, caller, self._backend, self.device.type)

    def _settle(self, clock: Clock, run: _ClockRun) -> None:
        """``agree`` on this clock's deferred failures, and keep the check it returns for the
        next clock (or raise the first failure at once if it returned none)."""
        assert self._agree is not None
        first: Optional[Exception] = None
        where = ""
        try:
            if run.deferred:
                # This rank's own failure first: one saying that another rank failed (a stage
                # that agreed within itself) yields to it.
                ordered = sorted(run.deferred, key=lambda failed: isinstance(failed[2], PeerStepFailed))
                _, where, first = ordered[0]
                for _, later_where, later in ordered[1:]:
                    add_note(first, f"[torchpipe.train] {later_where} failed in the same clock too: "
                                    f"{type(later).__name__}: {later}")
            try:
                check = self._agree(first)
            except BaseException:  # noqa: B902 - the clock fails here; say where
                self._failure.note(where or "agree (another rank failed)")
                raise
            last_failed = any(s == self.depth - 1 for s, _, _ in run.deferred)
            if check is not None and not last_failed:
                self._unsettled = (check, clock, first, where)
            elif first is not None:  # told the others, or no finished batch to hand on: this clock fails here
                self._failure.note(where)
                if check is not None:
                    check()  # raises this rank's failure, noted with the ranks that failed
                raise first
        finally:  # no cycle: the failures' tracebacks hold this frame and the jobs' (which hold run)
            run.deferred = []
            first = check = ordered = later = None

    def _settle_unsettled(self) -> None:
        """Before anything else runs: ask the last clock's ``agree`` check whether a rank (this
        one too) failed in it; if one did, drop every in-flight batch and raise the error."""
        unsettled = self._unsettled
        if unsettled is None:
            return
        check, clock, own, where = unsettled
        error: Optional[BaseException] = None
        try:
            check()
            error = own  # a check that let this rank's own failure through: still raised
        except Exception as exc:  # noqa: BLE001 - an interrupt leaves it to be asked again
            error = exc
        try:
            if error is None:
                self._unsettled = None
                return
            dropped = self._schedule.in_flight()
            self._empty(PipelineFailure(error, clock, {}, dropped))
            cause = f"in {where}" if own is not None else "on another rank"
            add_note(error, f"[torchpipe.train] clock {clock.index} failed {cause} (its finished batch, if any, "
                            f"was handed on); batches {dropped} were in flight and dropped; the pipeline is empty "
                            "and usable")
            self._unsettled = None  # only now: an interrupt above leaves it all to be done again
            raise error
        finally:
            error = own = check = unsettled = None  # no cycle through this frame

    def _empty(self, failure: PipelineFailure) -> None:
        """Drop every in-flight batch (``failure.dropped``) and tell ``on_failure``; then the
        caller's stream waits for the device streams, as after a clock that succeeds: what the
        caller does next (save, flush, read the error's outputs) comes after the clock's work
        and after what ``on_failure`` queued (the rows a failed step put back)."""
        self._schedule.reset()
        self._values = [None] * self.depth
        self._ready = [None] * self.depth
        try:
            if self._on_failure is not None:
                self._on_failure(failure)
        finally:
            if self._streamed:
                caller_waits_for_streams(self.device_streams())

    def _abandon_clock(self, clock: Clock, run: Optional[_ClockRun], exc: BaseException) -> None:
        """Empty the pipeline after ``clock`` failed or was interrupted before it handed its outputs on."""
        self._record()  # the clock's runtime step, if it got that far (an earlier one is counted already)
        completed = dict(run.outputs) if run is not None else {}
        dropped = [b for s, b in clock.active if not (s == self.depth - 1 and s in completed)]
        # A second Ctrl-C can leave the clock's step installed with its abort cut short: end it
        # before the failure hook cleans up, so its late on_abort call lands before that, too.
        try:
            self._runtime.end_left_behind()
        except BaseException:  # noqa: B902 - yet another interrupt: the clock's own error is raised anyway
            pass
        self._empty(PipelineFailure(exc, clock, completed, dropped))
        where = self._failure.where or "the caller (interrupted)"
        finished = [b for s, b in clock.active if s == self.depth - 1 and s in completed]
        done = ""
        if finished:  # its step happened: its output goes to the caller on the error
            try:
                self._caller_may_read(completed[self.depth - 1], run)  # type: ignore[arg-type]
                keep_unreturned_output(exc, completed[self.depth - 1])
                done = f"; batch {finished[0]} did finish (its output is in this error's finished_outputs)"
            except BaseException as again:  # noqa: B902 - the device failed too: the output is unreadable
                done = (f"; batch {finished[0]} did finish, but its output could not be handed on "
                        f"({type(again).__name__}: {again})")
        add_note(exc, f"[torchpipe.train] clock {clock.index} failed in {where}; "
                      f"batches {dropped} were in flight and dropped{done}; the pipeline is empty and usable")

    def _record(self) -> None:
        """Add the runtime's last step to the timings, once."""
        record = self._runtime.last_step
        if record is None or record is self._last_recorded:
            return
        self._last_recorded = record
        self.clocks_run += 1
        self.clock_seconds += record.wall_end - record.wall_start
        for label, s, e in zip(record.labels, record.starts, record.ends):
            if s >= 0:
                self.stage_seconds[self._stage_index(label)] += e - s
        if self.records.maxlen:
            self.records.append(record)

    def _stage_index(self, label: str) -> int:
        for i, stage in enumerate(self.stages):
            if stage.name == label:
                return i
        return 0  # pragma: no cover

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Admit batches until one finishes; return its last stage's output.

        Fills the pipeline on the first call. Raises StopIteration only when the iterator
        is exhausted *and* every in-flight batch was returned. An iterator that raised
        StopIteration is not asked for a batch again (the batches in flight drain) until
        this pipeline has raised StopIteration for it or another iterator is passed
        (TorchRec's rule); so the call after that StopIteration asks it again, which a
        DataLoader with ``persistent_workers=True`` needs: it returns that very iterator,
        reset, for each epoch. ``close()`` lets go of it.
        """
        if not callable(getattr(type(dataloader_iter), "__next__", None)):
            raise TypeError(f"progress() takes an iterator of batches (iter(dataloader)), got "
                            f"{type(dataloader_iter).__name__}: {dataloader_iter!r:.80}")
        self._refuse_own_work("progress()")
        refuse_untransferable_state("progress()")
        warn_if_the_profiler_records_this_thread_only()  # before any state changes: it may be an error
        # Before the lock: a child forked while another thread held it inherits it held.
        self._runtime.refuse_if_forked()
        return self._lock.call(self._progress_holding_lock, dataloader_iter)

    def _progress_holding_lock(self, dataloader_iter: Iterator[Any]) -> Any:
        """``progress``'s work, under ``_lock``."""
        if self._closed:
            raise RuntimeError("this pipeline is closed")
        if self._before_call is not None:
            self._before_call()

        def pull() -> bool:
            self._settle_unsettled()  # before every clock, and before its batch is admitted
            if dataloader_iter is self._exhausted or dataloader_iter is _NO_BATCHES:
                return False
            try:
                batch = next(dataloader_iter)
            except StopIteration:
                self._exhausted = dataloader_iter
                if self._data_ended is not None:
                    self._data_ended(None)
                return False
            except Exception as exc:
                if self._data_ended is not None:
                    self._vote(self._data_ended, exc, dataloader_iter)
                raise
            if self._admit is not None:
                self._vote(self._admit, batch, dataloader_iter)
            self._values[0] = batch
            if self._streamed:  # the batch may still be in the making on the caller's stream
                ready = self._backend.new_event()
                self._backend.record_event(ready, self._backend.current_stream(self.device))
                self._ready[0] = ready
            return True

        if dataloader_iter is not _NO_BATCHES:  # flush's own iterator leaves the caller's remembered
            if dataloader_iter is not self._exhausted:
                self._exhausted = None  # another iterator: forgotten, as TorchRec's _next_batch does
        self._call_owner = call_chain.new_owner()  # one token for every clock of this call
        try:
            for clock in self._schedule.progress_clocks(pull):
                if self._closed:  # by close() on another thread, which gave up waiting for this call
                    raise RuntimeError("this pipeline was closed on another thread while this call ran (close() "
                                       "waits for a call in progress only so long): its in-flight batches are dropped")
                outputs = self._run_clock(clock)
                if clock.finished is not None:
                    return outputs[self.depth - 1]
            if dataloader_iter is self._exhausted:
                # Its end is delivered, nothing is in flight: the next call asks it again. A
                # DataLoader with persistent_workers hands back this very iterator, reset, for
                # its next epoch; a spent iterator just raises StopIteration again.
                self._exhausted = None
            raise StopIteration
        except BaseException as exc:  # noqa: B902 - re-raised; only an open clock is undone
            opened = self._schedule.open
            if opened is not None:  # interrupted after the schedule advanced, before the clock ran
                self._abandon_clock(opened, None, exc)
            raise
        finally:
            self._call_owner = None

    def _vote(self, hook: Callable[[Any], None], argument: Any, dataloader_iter: Iterator[Any]) -> None:
        """``hook(argument)`` (``admit`` or ``data_ended``); if it says the data ended on another
        rank (`UnevenDataError`), it ends here too."""
        try:
            hook(argument)
        except UnevenDataError:
            self._exhausted = dataloader_iter
            raise

    def _refuse_own_work(self, what: str) -> None:
        """RuntimeError for a call from work a ``progress()`` in flight waits on (it would deadlock).

        That call spans several runtime steps, one per clock: work a stage started in one
        clock may be waited on by a later one, so the whole call has one token.
        """
        if self._lock.held_here():
            raise RuntimeError(
                f"{what} was called on the thread that is inside this pipeline's progress() (from admit, "
                "after_clock, on_failure, the data iterator or a signal handler): it would deadlock")
        message = f"a stage called {what} of its own pipeline (directly or through work it waits on): it would deadlock"
        self._runtime.refuse_worker_caller(message)
        owner = self._call_owner
        if owner is not None and owner in call_chain.current().owners:
            raise RuntimeError(message)

    def flush(self) -> List[Any]:
        """Run every in-flight batch to the end (admitting none); their outputs, in order."""
        self._refuse_own_work("flush()")
        outputs: List[Any] = []
        while True:
            try:
                outputs.append(self.progress(_NO_BATCHES))
            except StopIteration:
                return outputs
            except BaseException as exc:  # noqa: B902 - the batches finished so far are not lost
                keep_flushed_outputs(exc, outputs)
                raise

    def __iter__(self) -> Iterator[Any]:  # pragma: no cover - convenience
        raise TypeError("call progress(dataloader_iter) instead of iterating the pipeline")

    def defer_to_call_end(self, action: Callable[[], Any]) -> bool:
        """On the thread inside ``progress()``/``flush()``: leave ``action`` for the moment that
        call ends (a close from a callback, the data iterator or a signal handler) and return
        True. Elsewhere: False, and nothing is left."""
        if not self._lock.held_here():
            return False
        self._lock.after_call(action)
        return True

    def close(self) -> None:
        """Stop the worker threads (idempotent). In-flight batches are dropped; flush first.

        A ``progress()`` call on another thread finishes first, as long as it ends within
        ``STOP_TIMEOUT_S``; past that (a stuck stage, a data iterator that blocks) it is given
        up on, as ``Pipe.close`` does: the workers stop, and the call raises RuntimeError
        before its next clock (its in-flight batches are dropped). Called on the thread that is
        inside ``progress()`` (a callback, the data iterator, a signal handler), close() cannot
        wait for that call: the pipeline closes as soon as the call returns or fails.
        """
        if self.defer_to_call_end(self.close):
            return
        self._refuse_own_work("close()")
        locked = self._lock.acquire(timeout=STOP_TIMEOUT_S)
        try:
            self._closed = True
            self._exhausted = None
        finally:
            if locked:
                self._lock.release()
        self._runtime.stop(self._finalizer)

    def __enter__(self) -> "StagedPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
