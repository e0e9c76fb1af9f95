"""Workers: Task, Worker, HostPool, ThreadBudget, spawn_workers/stop_workers.

Issue 3, "Workers and devices": compute runs on the worker thread, finalize on the scheduling
thread; workers catch BaseException; host pools order tasks by key and put every failure in
its future; thread budgets cap intra-op threads per worker; the caller's grad mode reaches
the workers.
"""
import gc
import inspect
import queue
import random
import threading
import time

import pytest
import torch
from thread_helpers import pretend_cores, wait_until_gone
from torch import nn

import torchpipe.profiling
import torchpipe.workers as workers_module
from torchpipe import HostPool, Pipe, Task, ThreadBudget
from torchpipe.runtime import Program, Runtime
from torchpipe.workers import Worker, spawn_workers, stop_workers

pytestmark = pytest.mark.timeout(60)


def new_runtime(workers, out_queue):
    """``Runtime(workers)``; older runtimes also took the workers' shared out_queue."""
    if len(inspect.signature(Runtime).parameters) >= 2:
        return Runtime(workers, out_queue)
    return Runtime(workers)


def get(q, timeout=5.0):
    return q.get(timeout=timeout)


def cores():
    return workers_module.available_cores()


# ------------------------------------------------------------------------------ Task / Worker
def test_task_fields_and_label():
    def compute():
        return 1

    task = Task(compute, label="stage 2 F mb 5")
    assert task.compute is compute and task.finalize is None
    assert "stage 2 F mb 5" in repr(task)


def test_compute_runs_on_the_worker_and_finalize_is_left_to_the_scheduling_thread():
    out = queue.SimpleQueue()
    worker = Worker("torchpipe-test-w", out)
    try:
        seen = {}

        def compute():
            seen["compute"] = threading.current_thread()
            return 42

        def finalize(result):
            seen["finalize"] = threading.current_thread()
            seen["result"] = result

        task = Task(compute, finalize, label="t")
        worker.put(task)
        ok, reported, result = get(out)
        assert ok and reported is task and result == 42
        assert seen["compute"] is worker.thread
        assert "finalize" not in seen, "the worker ran finalize itself"
        # The scheduling thread (here: this one) runs finalize with the result.
        reported.finalize(result)
        assert seen["finalize"] is threading.current_thread() and seen["result"] == 42
    finally:
        worker.stop()
    assert not worker.is_alive()


def test_a_task_without_finalize_reports_only_failures():
    out = queue.SimpleQueue()
    worker = Worker("torchpipe-test-w", out)
    try:
        ran = []
        for i in range(5):
            worker.put(Task(lambda i=i: ran.append(i)))
        marker = Task(lambda: "done", lambda r: None)
        worker.put(marker)
        ok, task, result = get(out)
        assert (ok, task, result) == (True, marker, "done"), "a task without finalize reported"
        assert ran == [0, 1, 2, 3, 4], "tasks ran out of order"
    finally:
        worker.stop()


class CustomBase(BaseException):
    pass


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt("k"), SystemExit(3), GeneratorExit(), CustomBase(), ValueError("v")]
)
def test_worker_catches_base_exceptions_and_reports_them(error):
    out = queue.SimpleQueue()
    worker = Worker("torchpipe-test-w", out)
    try:

        def explode_in_task():
            raise error

        failing = Task(explode_in_task, label="bad")
        worker.put(failing)
        ok, task, reported = get(out)
        assert not ok and task is failing and reported is error
        assert "explode_in_task" in [f.name for f in __import__("traceback").extract_tb(reported.__traceback__)]
        # The thread survived and runs the next task.
        worker.put(Task(lambda: "alive", lambda r: None))
        assert get(out)[2] == "alive"
        assert worker.is_alive()
    finally:
        worker.stop()
    assert not worker.is_alive()


def test_worker_stop_runs_queued_tasks_first_and_joins():
    out = queue.SimpleQueue()
    worker = Worker("torchpipe-test-w", out)
    ran = []
    for i in range(3):
        worker.put(Task(lambda i=i: (time.sleep(0.01), ran.append(i))))
    worker.stop()
    assert not worker.is_alive()
    assert ran == [0, 1, 2]
    worker.stop()  # idempotent


def test_spawn_and_stop_workers_one_thread_per_entry_even_on_one_device():
    out = queue.SimpleQueue()
    cpu = torch.device("cpu")
    workers = spawn_workers([cpu, cpu, None], out, name="torchpipe-spawn")
    try:
        assert len({w.thread for w in workers}) == 3
        assert [w.name for w in workers] == ["torchpipe-spawn-0", "torchpipe-spawn-1", "torchpipe-spawn-2"]
        assert workers[2].device is None and workers[2].stream is None
    finally:
        stop_workers(workers)
    assert not any(w.is_alive() for w in workers)
    stop_workers(workers)  # idempotent


def test_spawn_workers_stops_the_started_ones_when_one_fails(monkeypatch):
    out = queue.SimpleQueue()
    before = {t for t in threading.enumerate() if t.name.startswith("torchpipe-failspawn")}
    real_init = Worker.__init__
    count = {"n": 0}

    def flaky_init(self, *args, **kwargs):
        count["n"] += 1
        if count["n"] == 3:
            raise RuntimeError("no more threads")
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Worker, "__init__", flaky_init)
    with pytest.raises(RuntimeError, match="no more threads"):
        spawn_workers([torch.device("cpu")] * 4, out, name="torchpipe-failspawn")
    new = {t for t in threading.enumerate() if t.name.startswith("torchpipe-failspawn")} - before
    assert not wait_until_gone(new)


# -------------------------------------------------------------------------------- HostPool
def test_hostpool_submit_returns_futures_with_results():
    with HostPool(2) as pool:
        futures = [pool.submit(pow, i, 2) for i in range(10)]
        assert [f.result(timeout=5) for f in futures] == [i * i for i in range(10)]
        assert pool.num_threads == 2


def test_hostpool_threads_are_named_and_device_less():
    with HostPool(2, name="torchpipe-host-t") as pool:
        names = {pool.submit(lambda: threading.current_thread().name).result(timeout=5) for _ in range(6)}
        assert names == {"torchpipe-host-t-0", "torchpipe-host-t-1"}
        assert all(w.device is None and w.stream is None for w in pool.workers)


def test_hostpool_same_key_runs_in_submission_order_on_one_thread():
    rng = random.Random(0)
    log = []
    threads = set()

    def task(i):
        time.sleep(rng.random() * 0.002)
        threads.add(threading.current_thread())
        log.append(i)

    with HostPool(4) as pool:
        futures = [pool.submit(task, i, key=7) for i in range(60)]
        # Interleave other keys: they must not disturb key 7's order.
        others = [pool.submit(time.sleep, 0.001, key=k) for k in (1, 2, 3) for _ in range(5)]
        for f in futures + others:
            f.result(timeout=10)
    assert log == list(range(60))
    assert len(threads) == 1


def test_hostpool_different_keys_use_different_threads():
    with HostPool(3) as pool:
        names = [pool.submit(lambda: threading.current_thread().name, key=k).result(timeout=5) for k in range(3)]
        assert len(set(names)) == 3
        assert pool.submit(lambda: threading.current_thread().name, key=3).result(timeout=5) == names[0]


def test_hostpool_round_robin_without_key_runs_in_parallel():
    barrier = threading.Barrier(2, timeout=5)
    with HostPool(2) as pool:
        # Two tasks that wait for each other: only possible if they run on different threads.
        futures = [pool.submit(barrier.wait) for _ in range(2)]
        for f in futures:
            f.result(timeout=10)


@pytest.mark.parametrize("error", [ValueError("v"), KeyboardInterrupt(), SystemExit(2), CustomBase()])
def test_hostpool_failure_lands_in_its_future_and_the_pool_keeps_working(error):
    def explode_in_host_task():
        raise error

    with HostPool(1) as pool:
        failing = pool.submit(explode_in_host_task)
        later = pool.submit(lambda: "later")
        assert failing.exception(timeout=5) is error
        with pytest.raises(type(error)):
            failing.result(timeout=5)
        tb = __import__("traceback").extract_tb(error.__traceback__)
        assert "explode_in_host_task" in [f.name for f in tb]
        assert later.result(timeout=5) == "later"
        assert all(w.is_alive() for w in pool.workers)


def test_hostpool_close_finishes_queued_tasks_and_joins_every_thread():
    pool = HostPool(3)
    threads = [w.thread for w in pool.workers]
    futures = [pool.submit(time.sleep, 0.02, key=i % 3) for i in range(9)]
    pool.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError):
        pool.submit(lambda: None)
    pool.close()  # idempotent


def test_hostpool_context_manager_and_garbage_collection_join_threads():
    with HostPool(2) as pool:
        threads = [w.thread for w in pool.workers]
        pool.submit(lambda: None).result(timeout=5)
    assert not wait_until_gone(threads)

    pool = HostPool(2)
    threads = [w.thread for w in pool.workers]
    pool.submit(lambda: None).result(timeout=5)
    del pool
    gc.collect()
    assert not wait_until_gone(threads), "del pool; gc.collect() left host threads behind"


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError),
                                        ("2", TypeError), (None, TypeError)])
def test_hostpool_bad_num_threads(bad, error):
    with pytest.raises(error, match="num_threads must be a positive int, got"):
        HostPool(bad)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"intra_op_threads": -1}, ValueError, "intra_op_threads"),
    ({"intra_op_threads": "2"}, TypeError, "intra_op_threads"),
    ({"intra_op_threads": 2.5}, TypeError, "intra_op_threads"),
    ({"out_queue": []}, TypeError, "out_queue"),
])
def test_a_worker_refuses_bad_settings_before_its_thread_starts(kwargs, error, words):
    """They used to kill the thread at its start, silently: every task put on it then waited forever."""
    before = threading.active_count()
    with pytest.raises(error, match=words):
        Worker("bad-worker", **kwargs)
    assert threading.active_count() == before


@pytest.mark.parametrize("make", [lambda: Task(None), lambda: Task(5), lambda: Task(lambda: 1, finalize=3),
                                  lambda: HostPool(1).submit(None)])
def test_tasks_need_callables(make):
    with pytest.raises(TypeError, match="must be callable"):
        make()


def test_hostpool_stops_the_started_threads_when_one_fails_to_start(monkeypatch):
    before = {t for t in threading.enumerate() if t.name.startswith("torchpipe-failhost")}
    real_start = threading.Thread.start
    count = {"n": 0}

    def flaky_start(self):
        if self.name.startswith("torchpipe-failhost"):
            count["n"] += 1
            if count["n"] == 3:
                raise RuntimeError("can't start new thread")  # CPython at its thread limit
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", flaky_start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        HostPool(4, name="torchpipe-failhost")
    new = {t for t in threading.enumerate() if t.name.startswith("torchpipe-failhost")} - before
    assert not wait_until_gone(new)


def test_hostpool_passes_keyword_arguments_through():
    with HostPool(1) as pool:
        assert pool.submit(int, "ff", base=16).result(5) == 255
        assert pool.submit(sorted, [3, 1, 2], key=0).result(5) == [1, 2, 3]  # key= is the pool's


def test_hostpool_refuses_bad_keys_and_budgets_by_name():
    with HostPool(2) as pool:
        for key in ("a", 1.5, True):
            with pytest.raises(TypeError, match="key must be an int or None"):
                pool.submit(int, key=key)
        assert pool.submit(int, key=-3).result(5) == 0  # any int picks a thread
    with pytest.raises(TypeError, match="budget must be a ThreadBudget, got 4"):
        HostPool(2, budget=4)


def test_hostpool_tasks_run_under_the_submitters_thread_state():
    def state():
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
                (torch.ones(2, 2) @ torch.ones(2, 2)).dtype)

    with HostPool(1) as pool:
        assert pool.submit(state).result(5) == (True, False, False, torch.float32)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert pool.submit(state).result(5) == (False, False, True, torch.bfloat16)
        with torch.inference_mode():
            assert pool.submit(state).result(5)[1] is True
            with torch.enable_grad():
                assert pool.submit(state).result(5)[:2] == (True, True)
        assert pool.submit(state).result(5) == (True, False, False, torch.float32)  # nothing stays behind
        with torchpipe.profiling.profile() as prof:
            pool.submit(lambda: torch.ones(3).sum(), label="lookup table 0").result(5)
        assert any(event.name == "lookup table 0" for event in prof.events())


# ----------------------------------------------------------------------------- ThreadBudget
@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError),
                                        ("3", TypeError)])
def test_thread_budget_rejects_bad_values(bad, error):
    with pytest.raises(error, match="intra_op_threads must be a positive int or None, got"):
        ThreadBudget(bad)


def test_more_intra_op_threads_than_cores_is_refused_before_any_thread_starts(monkeypatch):
    pretend_cores(monkeypatch, 4)
    before = set(threading.enumerate())
    words = r"intra_op_threads must be at most the 4 cores this process may run on \(expected 1..4, or None"
    with pytest.raises(ValueError, match=words + r".*got 5"):
        ThreadBudget(5)
    with pytest.raises(ValueError, match=words + r".*got 64"):
        Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], intra_op_threads=64)
    with pytest.raises(ValueError, match=words + r".*got 5"):
        Worker("w", intra_op_threads=5)
    with pytest.raises(ValueError, match=words + r".*got 8"):
        HostPool(2, budget=ThreadBudget(8))
    assert set(threading.enumerate()) == before
    assert ThreadBudget(4).intra_op_threads == 4  # all the cores is allowed


def test_thread_budget_arithmetic(monkeypatch):
    pretend_cores(monkeypatch, 8)
    assert ThreadBudget(3).threads_per_worker(10) == 3
    assert ThreadBudget().threads_per_worker(1) == 8
    assert ThreadBudget().threads_per_worker(2) == 4
    assert ThreadBudget().threads_per_worker(3) == 2
    assert ThreadBudget().threads_per_worker(8) == 1
    assert ThreadBudget().threads_per_worker(20) == 1  # at least one each
    assert ThreadBudget().threads_per_worker(0) == 8
    with pytest.raises(ValueError, match="workers_sharing_cores must be an int >= 0, got -1"):
        ThreadBudget().threads_per_worker(-1)


class RecordThreads(nn.Module):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x):
        self.log[threading.current_thread().name] = torch.get_num_threads()
        return x * 1.0


def test_explicit_budget_caps_intra_op_threads_inside_each_worker(monkeypatch):
    pretend_cores(monkeypatch, 4)  # so that a cap of 3 is allowed on a smaller machine
    log = {}
    caller_threads = torch.get_num_threads()
    model = nn.Sequential(RecordThreads(log), RecordThreads(log), RecordThreads(log))
    with Pipe(model, [1, 1, 1], chunks=2, checkpoint="never", intra_op_threads=1) as pipe:
        pipe(torch.randn(4, 2))
    assert sorted(log.values()) == [1, 1, 1] and len(log) == 3
    assert torch.get_num_threads() == caller_threads, "the caller's intra-op threads changed"

    log.clear()
    with Pipe(model, [1, 1, 1], chunks=2, checkpoint="never", intra_op_threads=3) as pipe:
        pipe(torch.randn(4, 2))
    assert sorted(log.values()) == [3, 3, 3]
    assert torch.get_num_threads() == caller_threads


def test_default_budget_splits_the_cores_evenly_among_cpu_workers(monkeypatch):
    pretend_cores(monkeypatch, 8)
    caller_threads = torch.get_num_threads()
    for stages, expected in ((2, 4), (4, 2), (3, 2)):
        log = {}
        model = nn.Sequential(*[RecordThreads(log) for _ in range(stages)])
        with Pipe(model, [1] * stages, chunks=2, checkpoint="never") as pipe:
            pipe(torch.randn(4, 2))
        assert sorted(log.values()) == [expected] * stages, (stages, log)
    assert torch.get_num_threads() == caller_threads


def test_default_budget_on_this_machine_gives_at_least_one_thread():
    log = {}
    stages = cores() + 2
    model = nn.Sequential(*[RecordThreads(log) for _ in range(stages)])
    with Pipe(model, [1] * stages, chunks=2, checkpoint="never") as pipe:  # one micro-batch runs on this thread
        pipe(torch.randn(2, 2))
    assert sorted(log.values()) == [1] * stages


def test_hostpool_budget_caps_its_threads(monkeypatch):
    pretend_cores(monkeypatch, 2)
    with HostPool(2) as pool:  # default budget: one intra-op thread per host thread
        assert {pool.submit(torch.get_num_threads, key=k).result(timeout=5) for k in range(2)} == {1}
    with HostPool(2, budget=ThreadBudget(2)) as pool:
        assert {pool.submit(torch.get_num_threads, key=k).result(timeout=5) for k in range(2)} == {2}
    pretend_cores(monkeypatch, 8)
    with HostPool(4, budget=ThreadBudget()) as pool:
        assert {pool.submit(torch.get_num_threads, key=k).result(timeout=5) for k in range(4)} == {2}


# ------------------------------------------------------------------ caller's thread state
class RecordGradMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.modes = []

    def forward(self, x):
        self.modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return x * 2.0


def test_grad_mode_of_the_caller_reaches_every_worker():
    probes = [RecordGradMode() for _ in range(3)]
    model = nn.Sequential(nn.Linear(2, 2), probes[0], nn.Linear(2, 2), probes[1], nn.Linear(2, 2), probes[2])
    x = torch.randn(4, 2)
    with Pipe(model, [2, 2, 2], chunks=2) as pipe:
        with torch.no_grad():
            out = pipe(x)
        assert not out.requires_grad and out.grad_fn is None
        assert all(p.modes == [(False, False)] * 2 for p in probes), [p.modes for p in probes]

        for p in probes:
            p.modes.clear()
        out = pipe(x)  # grad mode back on: it must not stick to the workers
        assert out.requires_grad and out.grad_fn is not None
        assert all(p.modes == [(True, False)] * 2 for p in probes), [p.modes for p in probes]

        for p in probes:
            p.modes.clear()
        with torch.inference_mode():
            out = pipe(x)
        assert out.is_inference()
        assert all(p.modes == [(False, True)] * 2 for p in probes), [p.modes for p in probes]

        for p in probes:  # review: entering inference mode on a worker turned grad mode back off
            p.modes.clear()
        with torch.inference_mode(), torch.enable_grad():
            out = pipe(x)
        assert out.is_inference() and out.grad_fn is None
        assert all(p.modes == [(True, True)] * 2 for p in probes), [p.modes for p in probes]

        for p in probes:
            p.modes.clear()
        torch.set_grad_enabled(False)
        try:
            out = pipe(x)
        finally:
            torch.set_grad_enabled(True)
        assert out.grad_fn is None
        assert all(p.modes == [(False, False)] * 2 for p in probes)


def test_grad_mode_reaches_jobs_of_a_hand_made_program():
    out_queue = queue.SimpleQueue()
    workers = spawn_workers([torch.device("cpu")] * 2, out_queue, name="torchpipe-gradmode")
    try:
        runtime = new_runtime(workers, out_queue)
        program = Program(2)
        program.add(0, "a", lambda ctx, inputs: torch.is_grad_enabled(), keep=True)
        program.add(1, "b", lambda ctx, inputs: torch.is_grad_enabled(), deps=["a"], keep=True)
        with torch.no_grad():
            assert runtime.run(program, None) == {"a": False, "b": False}
        assert runtime.run(program, None) == {"a": True, "b": True}
    finally:
        stop_workers(workers)


def test_stopping_a_worker_stuck_in_a_task_warns_instead_of_hanging():
    import threading as _threading
    import warnings as _warnings

    from torchpipe.workers import Task, Worker, stop_workers

    release = _threading.Event()
    worker = Worker("torchpipe-stuck")
    worker.put(Task(lambda: release.wait(30)))
    try:
        with _warnings.catch_warnings(record=True) as caught:
            _warnings.simplefilter("always")
            stop_workers([worker], timeout=0.2)
        assert any("torchpipe-stuck" in str(w.message) for w in caught)
    finally:
        release.set()
        worker.thread.join(5)
    assert not worker.is_alive()


# Regression: submit() checked "closed" and queued the task in two steps, so a close() from
# another thread in between queued the stop marker first: the Future never completed.
def test_host_pool_submit_racing_close_runs_the_task_or_refuses_it():
    pool = HostPool(1)
    pick = pool._pick
    closer = threading.Thread(target=pool.close)

    def pick_then_let_close_start(key):
        worker = pick(key)
        closer.start()  # close() now runs in between the check and the put
        closer.join(0.2)
        return worker

    pool._pick = pick_then_let_close_start
    future = pool.submit(lambda: 42)
    closer.join(5)
    assert not closer.is_alive()
    assert future.result(timeout=5) == 42
    with pytest.raises(RuntimeError, match="HostPool is closed"):
        pool.submit(lambda: 0)


# Regression: a Pipe copied or unpickled where fewer cores are available than its
# intra_op_threads (a checkpoint from a bigger machine, a taskset) failed to start its workers.
SEEN_THREADS = []


class RecordThreadsGlobally(nn.Module):
    """Records into a module-level list, which a copied or unpickled layer still reaches."""

    def forward(self, x):
        SEEN_THREADS.append(torch.get_num_threads())
        return x * 1.0


def test_a_pipe_restored_with_fewer_cores_caps_its_workers_to_them(monkeypatch):
    import copy
    import pickle

    pretend_cores(monkeypatch, 4)
    pipe = Pipe(nn.Sequential(RecordThreadsGlobally(), RecordThreadsGlobally()), [1, 1], chunks=2,
                intra_op_threads=3)
    data = pickle.dumps(pipe)
    pretend_cores(monkeypatch, 2)
    for restored in (copy.deepcopy(pipe), pickle.loads(data)):
        with restored:
            SEEN_THREADS.clear()
            restored(torch.randn(4, 2))
            assert SEEN_THREADS and set(SEEN_THREADS) == {2}
    pipe.close()


def test_a_worker_refuses_a_task_it_would_never_run():
    """Review: put() on a stopped worker, or of something that is not a Task, was accepted and
    never reported: a caller waiting on its out_queue waited for good."""
    worker = Worker("torchpipe-put-test")
    with pytest.raises(TypeError, match="Worker.put takes a torchpipe.workers.Task, got function"):
        worker.put(lambda: 1)
    worker.put(Task(lambda: 1, finalize=lambda result: None))
    assert worker.out_queue.get(timeout=5) is not None
    worker.stop(join=False)  # stopping: refused already, before the thread has gone
    with pytest.raises(RuntimeError, match="worker 'torchpipe-put-test' has stopped"):
        worker.put(Task(lambda: 1))
    worker.stop()
    with pytest.raises(RuntimeError, match="has stopped: its tasks would never run"):
        worker.put(Task(lambda: 1))


def test_a_task_put_by_hand_runs_under_the_putting_threads_state():
    """Review (the retired torch Pipe's test_grad_mode[False]): Worker.put ran every task with
    grad mode on, whatever the putting thread's mode; HostPool.submit already carried it."""
    out = queue.SimpleQueue()
    worker = Worker("torchpipe-carry-test", out)

    def state():
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))

    try:
        with torch.no_grad():
            worker.put(Task(state, lambda r: None))
        assert get(out)[2][0] is False
        with torch.inference_mode():
            worker.put(Task(state, lambda r: None))
        assert get(out)[2][:2] == (False, True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            worker.put(Task(state, lambda r: None))
        assert get(out)[2] == (True, False, True, torch.bfloat16)
        worker.put(Task(state, lambda r: None))  # and back to the defaults
        assert get(out)[2][:3] == (True, False, False)
        with torch.no_grad():  # a failing task is reported as itself, under the same state
            failing = Task(lambda: 1 / 0, label="carried")
            worker.put(failing)
        ok, task, error = get(out)
        assert not ok and task is failing and isinstance(error, ZeroDivisionError)
        with torch.no_grad():  # a task queued on in_queue directly keeps the thread's defaults
            worker.in_queue.put(Task(state, lambda r: None))
        assert get(out)[2][0] is True
    finally:
        worker.stop()
