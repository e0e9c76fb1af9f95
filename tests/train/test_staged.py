"""StagedPipeline with toy stages: order, fill/drain, StopIteration, flush, schedule, faults."""

from __future__ import annotations

import threading
import time
from typing import Any, List, Tuple

import numpy
import pytest

from train_helpers import drain

from torchpipe.train import PipelineStage, StagedPipeline

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """Stages that tag a batch value and log (stage, batch, thread name, sequence number)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.log: List[Tuple[int, int, str, int]] = []
        self.running = 0
        self.max_running = 0

    def stage(self, index: int, sleep: float = 0.0, fail_at: Any = None, error: type = ValueError):
        def run(item: Tuple[int, List[int]]) -> Tuple[int, List[int]]:
            batch = item[0] if isinstance(item, tuple) else item
            trail = item[1] if isinstance(item, tuple) else []
            with self.lock:
                self.running += 1
                self.max_running = max(self.max_running, self.running)
            try:
                if fail_at is not None and batch == fail_at:
                    raise error(f"injected into stage {index} at batch {batch}")
                if sleep:
                    time.sleep(sleep)
                with self.lock:
                    self.log.append((index, batch, threading.current_thread().name, len(self.log)))
                return batch, trail + [index]
            finally:
                with self.lock:
                    self.running -= 1
        return run


WORKERS = ["copy", "host", "host", "device"]


def make(rec: Recorder, depth: int = 4, host_threads: int = 2, **kw: Any) -> StagedPipeline:
    fail = kw.pop("fail", {})
    sleep = kw.pop("sleep", 0.0)
    stages = [PipelineStage(f"s{i}", rec.stage(i, sleep, *fail.get(i, (None,))), WORKERS[i % len(WORKERS)])
              for i in range(depth)]
    return StagedPipeline(stages, host_threads=host_threads, device_threads=1, **kw)


def test_order_per_stage_and_across_stages() -> None:
    rec = Recorder()
    with make(rec) as pipe:
        out = drain(pipe, iter(range(9)))
    assert out == [(b, [0, 1, 2, 3]) for b in range(9)]
    for s in range(4):
        assert [b for st, b, _, _ in rec.log if st == s] == list(range(9))  # in order per stage
    seq = {(st, b): n for st, b, _, n in rec.log}
    for b in range(9):
        for s in range(1, 4):
            assert seq[(s, b)] > seq[(s - 1, b)]  # stage i after stage i-1 of the same batch
    threads = {st: {name for s2, _, name, _ in rec.log if s2 == st} for st in range(4)}
    assert threads[0] == {"torchpipe-train-copy"} and threads[3] == {"torchpipe-train-compute"}
    assert threads[1] == {"torchpipe-train-host0"} and threads[2] == {"torchpipe-train-host1"}


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5])
def test_short_streams_and_stop_iteration_only_after_all(n: int) -> None:
    rec = Recorder()
    with make(rec) as pipe:
        it = iter(range(n))
        out = []
        for _ in range(n):
            out.append(pipe.progress(it)[0])  # never StopIteration while a batch is in flight
        assert out == list(range(n))
        assert pipe.in_flight() == []
        for _ in range(2):  # and StopIteration again, not a hang or a stale batch
            with pytest.raises(StopIteration):
                pipe.progress(it)
        assert drain(pipe, iter(range(100, 103))) == [(b, [0, 1, 2, 3]) for b in range(100, 103)]


class Rearmed:
    """An iterator that raises StopIteration once, then yields more (a re-armed stream)."""

    def __init__(self, first: List[int], after: List[int]) -> None:
        self.first, self.after, self.stopped, self.calls_after_stop = list(first), list(after), False, 0

    def __iter__(self) -> "Rearmed":
        return self

    def __next__(self) -> int:
        if self.stopped:
            self.calls_after_stop += 1
            if self.after:
                return self.after.pop(0)
            raise StopIteration
        if self.first:
            return self.first.pop(0)
        self.stopped = True
        raise StopIteration


def test_an_iterator_that_ended_is_not_asked_again_until_its_end_was_delivered() -> None:
    """TorchRec's rule: an exhausted dataloader is not called again while the batches in flight
    drain (a stream that blocks after its end would stall every drain clock; one that yields
    more would slip batches into it), nor after a flush, until the pipeline's StopIteration
    for it; the call after that asks it again (review, helper-143: a DataLoader with
    persistent_workers returns the same iterator every epoch, which then trained nothing)."""
    rec = Recorder()
    with make(rec) as pipe:
        it = Rearmed([0, 1, 2], [100, 101])
        assert [pipe.progress(it)[0] for _ in range(3)] == [0, 1, 2]
        assert it.calls_after_stop == 0  # not asked in the three drain calls
        assert pipe.flush() == []
        with pytest.raises(StopIteration):  # flush's own empty iterator did not replace it
            pipe.progress(it)
        assert it.calls_after_stop == 0
        other = iter(range(7, 20))
        assert pipe.progress(other)[0] == 7  # another iterator is read, and makes the pipeline forget `it`
        # TorchRec's rule: `it` is asked again once another iterator was passed (here it yields more)
        assert [o[0] for o in drain(pipe, it)] == [8, 9, 10, 100, 101]  # other's batches in flight first
        assert it.calls_after_stop == 3


def test_a_dataloader_with_persistent_workers_trains_every_epoch() -> None:
    """Review (helper-143): ``iter(loader)`` returns the same iterator object every epoch when
    ``persistent_workers=True`` (reset by the loader); remembered as exhausted, it trained
    nothing from the second epoch on."""
    import torch.utils.data

    loader = torch.utils.data.DataLoader(list(range(6)), batch_size=2, num_workers=1, persistent_workers=True)
    rec = Recorder()
    with make(rec) as pipe:
        epochs = []
        for _ in range(3):
            it = iter(loader)
            epochs.append([int(o[0][0]) for o in drain(pipe, it)])
        assert iter(loader) is it  # the premise: one iterator object for every epoch
    assert epochs == [[0, 2, 4]] * 3


def test_host_threads_beyond_the_host_stages_are_not_started() -> None:
    """A generous host_threads (a core count, or far more) starts only the threads a stage uses."""
    rec = Recorder()
    for host_threads in (2, 64, 10 ** 12):
        with make(rec, host_threads=host_threads) as pipe:  # two host stages
            assert [n.rsplit("-", 1)[-1] for n in pipe.worker_names] == ["compute", "copy", "host0", "host1"]
            assert [o[0] for o in drain(pipe, iter(range(3)))] == [0, 1, 2]
    with StagedPipeline([PipelineStage("a", abs, "host"), PipelineStage("b", abs, 4)], host_threads=3) as pipe:
        assert len(pipe.worker_names) == 5  # host0 for "a", worker 4 = host2 pinned; host1 idles between
        assert drain(pipe, iter([-1])) == [1]
    for host_threads, workers in ((3, r"1 \(copy\) and 2\.\.4 \(host\) with host_threads=3"),
                                  (1, r"1 \(copy\) and 2 \(host\) with host_threads=1"),
                                  (0, r"1 \(copy\) with host_threads=0")):
        with pytest.raises(ValueError, match=rf"worker 5 out of range; workers are 0 \(compute\), {workers}$"):
            StagedPipeline([PipelineStage("a", abs, 5)], host_threads=host_threads)


def test_flush_drains_in_order_and_admits_nothing() -> None:
    rec = Recorder()
    with make(rec) as pipe:
        it = iter(range(10))
        assert pipe.progress(it)[0] == 0
        assert pipe.progress(it)[0] == 1
        assert pipe.in_flight() == [2, 3, 4]
        assert [o[0] for o in pipe.flush()] == [2, 3, 4]
        assert pipe.in_flight() == [] and pipe.flush() == []
        assert pipe.progress(it)[0] == 5  # the iterator was not consumed by flush


def test_schedule_table_is_what_runs() -> None:
    rec = Recorder()
    with make(rec, depth=3) as pipe:
        table = pipe.schedule_table(4)
        executed: List[List[Tuple[int, int]]] = []
        it = iter(range(4))
        while True:
            before = len(rec.log)
            try:
                pipe.progress(it)
            except StopIteration:
                break
            executed.append(sorted((st, b) for st, b, _, _ in rec.log[before:]))
    lines = table.splitlines()
    assert lines[0].split() == ["call", "clock", "s0@copy", "s1@host0", "s2@host1", "returns"]
    printed: dict = {}
    for line in lines[2:]:
        cells = line.split()
        if cells[-1] == "StopIteration":
            assert int(cells[0]) == len(executed) + 1
            continue
        call = int(cells[0])
        batches = [c for c in cells[2:5]]
        printed.setdefault(call, []).extend((s, int(b)) for s, b in enumerate(batches) if b != ".")
    assert [sorted(printed[c]) for c in sorted(printed)] == executed
    assert ["1", "2", "2", "1", "0", "0"] in [line.split() for line in lines]


@pytest.mark.parametrize("stage", [0, 1, 2, 3], ids=["copy", "host0", "host1", "device"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_error_in_any_stage_surfaces_and_pipeline_restarts(stage: int, overlap: bool) -> None:
    class Injected(Exception):
        pass

    rec = Recorder()
    threads_before = threading.active_count()
    pipe = make(rec, fail={stage: (5, Injected)}, overlap=overlap)
    try:
        it = iter(range(20))
        got = []
        started = time.monotonic()
        with pytest.raises(Injected, match=f"stage {stage} at batch 5") as info:
            while True:
                got.append(pipe.progress(it)[0])
        assert time.monotonic() - started < 10
        assert got == list(range(len(got))) and len(got) >= 5 - 3
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "dropped" in notes and "usable" in notes
        assert pipe.in_flight() == []
        # restart with a fresh iterator: everything runs, in order
        assert [o[0] for o in drain(pipe, iter(range(30, 37)))] == list(range(30, 37))
    finally:
        pipe.close()
    assert threading.active_count() <= threads_before


def local_stages(rec: Recorder, fail: dict, local: Tuple[int, ...] = (0, 1, 2)) -> List[PipelineStage]:
    """``make``'s four stages, those in ``local`` marked local (no collective)."""
    return [PipelineStage(f"s{i}", rec.stage(i, 0.0, *fail.get(i, (None,))), WORKERS[i], local=i in local)
            for i in range(4)]


class Votes:
    """An ``agree`` for one rank of several: logs what it was given; raises as a peer's failure when told."""

    def __init__(self, peer_fails_at_call: int = -1) -> None:
        self.given: List[Any] = []
        self.peer_fails_at_call = peer_fails_at_call

    def __call__(self, failure: Any) -> None:
        self.given.append(failure)
        if failure is not None:
            raise failure
        if len(self.given) == self.peer_fails_at_call:
            raise RuntimeError("rank 1 failed")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_a_local_stage_failure_lets_the_clocks_other_jobs_finish_then_agree_fails_the_clock(overlap: bool) -> None:
    """Across processes, a stage without collectives that fails must not cancel the clock's
    other jobs (the other ranks wait for their collectives): they all run, then ``agree`` gets
    the failure and the clock fails as a stage's error would."""
    rec, votes = Recorder(), Votes()
    with StagedPipeline(local_stages(rec, {1: (5,)}), host_threads=2, device_threads=1, overlap=overlap,
                        agree=votes) as pipe:
        it, got = iter(range(20)), []
        with pytest.raises(ValueError, match="stage 1 at batch 5") as info:
            while True:
                got.append(pipe.progress(it)[0])
        # Stage 1 failed on batch 5 in the clock where stage 3 trains batch 3 and stage 0 copies 6:
        # both ran (without the deferral, the runtime cancels jobs not started yet).
        ran = {(stage, batch) for stage, batch, _, _ in rec.log}
        assert {(0, 6), (2, 4), (3, 3)} <= ran, sorted(ran)
        assert votes.given[-1] is info.value and all(v is None for v in votes.given[:-1])
        assert got == [0, 1, 2]
        notes = " ".join(info.value.__notes__)
        assert "clock 6 failed in stage 's1'" in notes and "batch 3 did finish" in notes, notes
        assert pipe.in_flight() == []
        assert [o[0] for o in drain(pipe, iter(range(30, 34)))] == list(range(30, 34))


def test_another_ranks_failure_raised_by_agree_fails_the_clock_and_names_agree() -> None:
    rec, votes = Recorder(), Votes(peer_fails_at_call=5)
    failures = []
    with StagedPipeline(local_stages(rec, {}), host_threads=2, device_threads=1, agree=votes,
                        on_failure=failures.append) as pipe:
        it, got = iter(range(20)), []
        with pytest.raises(RuntimeError, match="rank 1 failed") as info:
            while True:
                got.append(pipe.progress(it)[0])
        notes = " ".join(info.value.__notes__)
        assert "clock 4 failed in agree (another rank failed)" in notes and "batch 1 did finish" in notes, notes
        assert got == [0] and [sorted(f.dropped) for f in failures] == [[2, 3, 4]] and pipe.in_flight() == []
        assert [o[0] for o in drain(pipe, iter(range(30, 34)))] == list(range(30, 34))


def test_a_check_agree_returns_is_asked_before_the_next_clock_and_drops_the_batches_in_flight() -> None:
    """A rank whose clock went well need not wait for the others at the clock's end: ``agree``
    returns a check, asked before the next clock or admission. An interrupt leaves it to be
    asked again; the failure it reports drops the batches in flight, before any is admitted."""
    asked: List[int] = []
    pulled: List[int] = []
    interrupt_once = [True]

    def agree(failure: Any) -> Any:
        assert failure is None
        clock = len(asked)
        asked.append(clock)

        def check() -> None:
            if clock == 4 and interrupt_once[0]:
                interrupt_once[0] = False
                raise KeyboardInterrupt
            if clock == 4:
                raise RuntimeError("rank 1 failed in clock 4")
        return check

    def batches(n: int):
        for b in range(n):
            pulled.append(b)
            yield b

    failures = []
    with StagedPipeline(local_stages(Recorder(), {}), host_threads=2, device_threads=1, agree=agree,
                        on_failure=failures.append) as pipe:
        it, got = batches(20), []
        for _ in range(2):
            got.append(pipe.progress(it)[0])
        assert got == [0, 1] and pulled == [0, 1, 2, 3, 4]  # clock 4 returned batch 1 here
        with pytest.raises(KeyboardInterrupt):
            pipe.progress(it)
        assert pulled == [0, 1, 2, 3, 4] and pipe.in_flight() == [2, 3, 4] and failures == []
        with pytest.raises(RuntimeError, match="rank 1 failed in clock 4") as info:
            pipe.progress(it)
        notes = " ".join(info.value.__notes__)
        assert "clock 4 failed on another rank" in notes and "batches [2, 3, 4]" in notes, notes
        assert pulled == [0, 1, 2, 3, 4], "a batch was admitted before the check"
        assert [f.dropped for f in failures] == [[2, 3, 4]] and pipe.in_flight() == []
        assert [o[0] for o in drain(pipe, it)] == list(range(5, 20))


@pytest.mark.parametrize("check_raises", [True, False], ids=["check-raises", "check-lets-it-through"])
def test_a_local_failure_with_a_check_hands_the_clock_on_and_raises_before_the_next_admission(
        check_raises: bool) -> None:
    """Every rank raises in the same call: the failing one too returns the clock's finished
    batch, then raises its own error (its check's) before the next batch is admitted."""
    pulled: List[int] = []
    told: List[Any] = []

    def agree(failure: Any) -> Any:
        told.append(failure)

        def check() -> None:
            if failure is not None and check_raises:
                raise failure
        return check

    def batches(n: int):
        for b in range(n):
            pulled.append(b)
            yield b

    with StagedPipeline(local_stages(Recorder(), {1: (5,)}), host_threads=2, device_threads=1,
                        agree=agree) as pipe:
        it, got = batches(20), []
        for _ in range(4):  # clock 6 (stage 1 on batch 5) returns batch 3
            got.append(pipe.progress(it)[0])
        assert got == [0, 1, 2, 3] and pulled == list(range(7)) and told[-1] is not None
        with pytest.raises(ValueError, match="stage 1 at batch 5") as info:
            pipe.progress(it)
        notes = " ".join(info.value.__notes__)
        assert "clock 6 failed in stage 's1' (its finished batch, if any, was handed on)" in notes, notes
        assert "batches [4, 5, 6]" in notes and pulled == list(range(7)) and pipe.in_flight() == []
        assert [o[0] for o in drain(pipe, it)] == list(range(7, 20))


def test_a_failed_local_last_stage_fails_its_own_clock_after_the_check_and_prefers_this_ranks_error() -> None:
    """A last stage that is local (it pairs its collectives, failing) has no finished batch to
    hand on when it fails: the clock still lets its other jobs finish and tells ``agree``, then
    fails at its end, in this call, with the check's error. A failure saying that another rank
    failed (``PeerStepFailed``) yields to this rank's own in the same clock."""
    from torchpipe.grad_sync import PeerStepFailed

    told: List[Any] = []
    checked: List[Any] = []

    def agree(failure: Any) -> Any:
        told.append(failure)

        def check() -> None:
            checked.append(failure)
            if failure is not None:
                raise failure
        return check

    rec = Recorder()
    stages = local_stages(rec, {1: (5,), 3: (3, PeerStepFailed)}, local=(0, 1, 2, 3))
    with StagedPipeline(stages, host_threads=2, device_threads=1, agree=agree) as pipe:
        it, got = iter(range(20)), []
        for _ in range(3):
            got.append(pipe.progress(it)[0])
        with pytest.raises(ValueError, match="stage 1 at batch 5") as info:  # clock 6: stage 3 on 3, stage 1 on 5
            got.append(pipe.progress(it)[0])
        assert got == [0, 1, 2] and checked[-1] is info.value and told[-1] is info.value and len(told) == 7
        notes = " ".join(info.value.__notes__)
        assert "stage 's3' failed in the same clock too: PeerStepFailed" in notes, notes
        assert "clock 6 failed in stage 's1'" in notes and "batches [6, 5, 4, 3]" in notes, notes
        ran = {(stage, batch) for stage, batch, _, _ in rec.log}
        assert {(0, 6), (2, 4)} <= ran, sorted(ran)  # the clock's other jobs ran
        assert pipe.in_flight() == [] and [o[0] for o in drain(pipe, it)] == list(range(7, 20))
    rec, told = Recorder(), []
    with StagedPipeline(local_stages(rec, {3: (3,)}, local=(0, 1, 2, 3)), host_threads=2, device_threads=1,
                        agree=agree) as pipe:
        it, got = iter(range(20)), []
        with pytest.raises(ValueError, match="stage 3 at batch 3") as info:
            while True:
                got.append(pipe.progress(it)[0])
        assert got == [0, 1, 2] and "clock 6 failed in stage 's3'" in " ".join(info.value.__notes__)
        assert {(0, 6), (1, 5), (2, 4)} <= {(stage, batch) for stage, batch, _, _ in rec.log}


def test_what_agree_does_not_defer() -> None:
    """A stage that is not local, any stage without ``agree``, and an interrupt cancel the clock
    at once; an ``agree`` that lets a failure through does not lose it; two local failures in one
    clock are both told."""
    def run(stages: List[PipelineStage], **kw: Any) -> BaseException:
        with StagedPipeline(stages, host_threads=2, device_threads=1, **kw) as pipe:
            with pytest.raises(BaseException) as info:
                drain(pipe, iter(range(20)))
            assert pipe.in_flight() == []
        return info.value

    votes = Votes()
    error = run(local_stages(Recorder(), {3: (2,)}), agree=votes)  # the device stage is not local
    assert isinstance(error, ValueError) and votes.given == [None] * 5  # clocks 0-4; not clock 5
    rec = Recorder()
    error = run(local_stages(rec, {1: (5,)}, local=()), agree=Votes())
    assert isinstance(error, ValueError) and "failed in stage 's1'" in " ".join(error.__notes__)
    rec = Recorder()
    assert isinstance(run(local_stages(rec, {1: (5,)})), ValueError)  # local, no agree: as before
    rec, votes = Recorder(), Votes()
    assert isinstance(run(local_stages(rec, {1: (5, KeyboardInterrupt)}), agree=votes), KeyboardInterrupt)
    assert all(v is None for v in votes.given)
    rec, given = Recorder(), []  # an agree that returns no check fails the clock at once
    error = run(local_stages(rec, {1: (5,)}), agree=given.append)
    assert isinstance(error, ValueError) and given[-1] is error
    assert "clock 6 failed in stage 's1'" in " ".join(error.__notes__)
    rec = Recorder()
    error = run(local_stages(rec, {0: (6,), 2: (4,)}), agree=Votes())
    notes = " ".join(error.__notes__)
    assert "injected into stage" in notes and "failed in the same clock too" in notes, notes
    with pytest.raises(TypeError, match="stage 'a': local must be a bool, got 'yes'"):
        PipelineStage("a", abs, local="yes")
    with pytest.raises(TypeError, match="agree must be callable or None"):
        StagedPipeline([PipelineStage("a", abs)], agree=5)


def test_stop_iteration_inside_a_stage_is_not_mistaken_for_the_end() -> None:
    def bad(x: int) -> int:
        if x == 2:
            raise StopIteration
        return x

    with StagedPipeline([PipelineStage("a", bad, "host"), PipelineStage("b", lambda x: x)]) as pipe:
        it = iter(range(5))
        got = []
        with pytest.raises(RuntimeError, match="raised StopIteration"):
            while True:
                got.append(pipe.progress(it))
        assert got == [0]


def test_stages_of_a_clock_overlap_and_serial_mode_does_not() -> None:
    rec = Recorder()
    with make(rec, sleep=0.03) as pipe:
        drain(pipe, iter(range(6)))
    assert rec.max_running >= 3
    rec = Recorder()
    with make(rec, sleep=0.01, overlap=False) as pipe:
        assert [o[0] for o in drain(pipe, iter(range(6)))] == list(range(6))
    assert rec.max_running == 1


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        StagedPipeline([PipelineStage("a", abs), PipelineStage("a", abs)])
    with pytest.raises(ValueError, match="host_threads=0"):
        StagedPipeline([PipelineStage("a", abs, "host")], host_threads=0)
    with pytest.raises(ValueError, match="worker must be one of .* got 'gpu'"):
        PipelineStage("a", abs, "gpu")
    with pytest.raises(ValueError, match="worker index must be >= 0, got -1"):
        PipelineStage("a", abs, -1)
    for wrong in (True, 1.0, None):  # a wrong type is a TypeError (review)
        with pytest.raises(TypeError, match=f"worker must be .* got {type(wrong).__name__}: {wrong!r}"):
            PipelineStage("a", abs, wrong)
    with pytest.raises(TypeError, match="stage name must be a non-empty string, got int: 5"):
        PipelineStage(5, abs)
    with pytest.raises(ValueError, match="worker index must be >= 0, got -1"):
        PipelineStage("a", abs, numpy.int64(-1))
    with pytest.raises(ValueError, match="stage name must be a non-empty string, got ''"):
        PipelineStage("", abs)
    with pytest.raises(ValueError, match="at least one"):
        StagedPipeline([])


def test_a_numpy_worker_index_is_taken_as_an_int() -> None:
    """Review: chunks and balance take NumPy integers; a stage's worker index refused them."""
    stage = PipelineStage("a", abs, numpy.int64(0))
    assert type(stage.worker) is int and stage.worker == 0
    with StagedPipeline([stage, PipelineStage("b", abs, numpy.int32(0))]) as pipe:
        assert [output for output in drain(pipe, iter([-1, -2]))] == [1, 2]


def test_closed_pipeline_says_so() -> None:
    pipe = StagedPipeline([PipelineStage("a", abs)])
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.progress(iter([1]))


def test_progress_under_a_profiler_that_records_the_caller_only_says_so(monkeypatch) -> None:
    """Review: Pipe and HostPool.submit warned, a train pipeline's progress() did not, and its
    stages were missing from the trace without a word."""
    import warnings

    import torch

    import torchpipe.thread_state

    monkeypatch.setattr(torchpipe.thread_state, "_warned_profiler_misses_workers", False)
    with StagedPipeline([PipelineStage("double", lambda b: b * 2, "host")], host_threads=1) as pipe:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.profiler.profile():
                outputs = drain(pipe, iter(range(3)))
    assert outputs == [0, 2, 4]
    told = [w for w in caught if "records only the thread that started it" in str(w.message)]
    # At the user's call: drain()'s progress() in train_helpers.py, not inside torchpipe.
    assert [w.filename.rsplit("/", 1)[-1] for w in told] == ["train_helpers.py"], [str(w.message) for w in caught]


@pytest.mark.parametrize("where", ["before the hand-over", "after the hand-over"])
def test_a_ctrl_c_around_a_clocks_hand_over_says_what_is_lost_and_counts_the_clock(where: str) -> None:
    """Review: an interrupt once a clock had run but before it handed its outputs on left the
    clock out of ``clocks_run``; one just after lost the clock's finished batch without a word."""
    failures: List[Any] = []
    pipe = StagedPipeline([PipelineStage("a", lambda b: b, "host"), PipelineStage("b", lambda b: b, "device"),
                           PipelineStage("c", lambda b: b, "host")], on_failure=failures.append)
    with pipe:
        it = iter(range(10))
        assert pipe.progress(it) == 0
        schedule, close = pipe._schedule, pipe._schedule.close

        def interrupted_close(clock):
            if where == "after the hand-over":
                close(clock)
            raise KeyboardInterrupt("Ctrl-C")

        schedule.close = interrupted_close
        with pytest.raises(KeyboardInterrupt) as caught:
            pipe.progress(it)
        schedule.close = close
        assert pipe.clocks_run == 4  # three to fill and return batch 0, and the interrupted one
        notes = "".join(getattr(caught.value, "__notes__", []))
        assert "batch 1 did finish (its output is in this error's finished_outputs)" in notes
        assert caught.value.finished_outputs == [1]
        if where == "after the hand-over":
            assert not failures and pipe.in_flight() == [2, 3]
            assert drain(pipe, it) == list(range(2, 10))
        else:
            assert len(failures) == 1 and failures[0].dropped == [3, 2] and pipe.in_flight() == []
            assert drain(pipe, it) == list(range(4, 10))


def test_a_clock_whose_abort_two_interrupts_cut_short_is_ended_before_the_failure_hook(monkeypatch) -> None:
    """Review: a second Ctrl-C can leave a clock's step installed with its abort cut short, its
    on_abort hook not yet called. The next call's runtime ended it, calling the hook then, after
    the failure hook had cleaned up: the rec pipeline's tables stayed aborted, and that next
    clock failed too. Now the step is ended before the failure hook runs."""
    import torchpipe.runtime as runtime

    real_abort, cuts = runtime._Step.abort, []

    def abort_cut_short(step, error):  # twice: the handler's abort and the loop's retry
        if len(cuts) < 2:
            cuts.append(error)
            with step.guard:
                step.aborted = True
            raise KeyboardInterrupt("second Ctrl-C")
        return real_abort(step, error)

    class CallerInterrupted(runtime.Latch):  # the first Ctrl-C, while the caller waits for the clock
        armed = False

        def wait(self, timeout=None):
            if CallerInterrupted.armed:  # the caller's first wait for the clock
                CallerInterrupted.armed = False
                raise KeyboardInterrupt("first Ctrl-C")
            return super().wait(timeout)

    aborted: List[BaseException] = []  # stands for the host tables' abort, which on_failure clears

    def lookup(batch):
        if aborted:
            raise RuntimeError(f"host tables aborted by {aborted[0]!r}")
        return batch

    def slow(batch):
        if CallerInterrupted.armed or cuts:
            time.sleep(0.2)
        return batch

    pipe = StagedPipeline([PipelineStage("lookup", lookup, "host"), PipelineStage("dense", slow, "device"),
                           PipelineStage("update", lambda b: b, "host")],
                          on_abort=aborted.append, on_failure=lambda failure: aborted.clear())
    with pipe:
        it = iter(range(20))
        assert pipe.progress(it) == 0
        monkeypatch.setattr(runtime._Step, "abort", abort_cut_short)
        monkeypatch.setattr(runtime, "Latch", CallerInterrupted)
        CallerInterrupted.armed = True
        with pytest.raises(KeyboardInterrupt):
            pipe.progress(it)
        assert len(cuts) == 2 and not aborted  # the hook ran (or not yet), then the failure hook cleared
        assert pipe.progress(it) == 4  # batches 1-3 were in flight and dropped
        assert pipe._runtime._step is None


def failing_at(value: int, after: threading.Event):
    """A stage that fails on batch ``value`` once ``after`` is set (the last stage finished the
    clock's other batch: a failure aborts the clock's jobs that have not started)."""
    def stage(batch: int) -> int:
        if batch == value:
            after.wait(10)
            raise ValueError(f"stage b failed on batch {batch}")
        return batch
    return stage


def finishing(before: int, done: threading.Event):
    def stage(batch: int) -> int:
        if batch == before:
            done.set()
        return batch
    return stage


@pytest.mark.parametrize("call", ["progress", "flush"])
def test_a_batch_finished_beside_a_failure_is_handed_on_with_the_error(call: str) -> None:
    """Review (s28): when a clock failed in an earlier stage after its last stage had finished a
    batch, that batch's step had happened (a train pipeline counted it) but its output was
    only named in a note; a flush lost it the same way."""
    c_finished_5 = threading.Event()
    stages = [PipelineStage("a", lambda b: b, "host"), PipelineStage("b", failing_at(6, c_finished_5), "host"),
              PipelineStage("c", finishing(5, c_finished_5), "host")]
    with StagedPipeline(stages, host_threads=3) as pipe:
        it = iter(range(10))
        returned = [pipe.progress(it) for _ in range(4)]  # 0..3; 4 and 5 in flight
        assert returned == [0, 1, 2, 3] and pipe.in_flight() == [4, 5]
        if call == "progress":
            returned.append(pipe.progress(it))  # 4; 6 enters
            with pytest.raises(ValueError, match="batch 6") as caught:
                pipe.progress(it)  # c finishes 5 while b fails on 6
            assert caught.value.finished_outputs == [5]
        else:
            pipe.progress(iter([6]))  # 4 returned, 6 enters; the iterator is done
            with pytest.raises(ValueError, match="batch 6") as caught:
                pipe.flush()
            assert caught.value.flushed_outputs == [5]
        notes = "".join(getattr(caught.value, "__notes__", []))
        assert "batch 5 did finish (its output is in this error's finished_outputs)" in notes
        assert pipe.in_flight() == []


def test_an_after_clock_hook_that_raises_hands_the_clocks_batch_on_with_the_error() -> None:
    calls = {"n": 0}

    def after_clock(clock, outputs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise ValueError("after_clock failed")

    with StagedPipeline([PipelineStage("a", lambda b: b, "host"), PipelineStage("b", lambda b: b, "host")],
                        after_clock=after_clock) as pipe:
        it = iter(range(8))
        returned = [pipe.progress(it) for _ in range(3)]
        with pytest.raises(ValueError, match="after_clock failed") as caught:
            pipe.progress(it)
        assert caught.value.finished_outputs == [3]
        returned += caught.value.finished_outputs + drain(pipe, it)
    assert returned == list(range(8))
