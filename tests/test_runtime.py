"""The runtime: Program validation, execution of hand-made programs, value lifetime,
StepRecord timings and abort propagation."""
import inspect
import json
import queue
import signal
import threading
import time
import weakref

import pytest
import torch

from torchpipe.runtime import Latch, Program, Runtime, StepRecord
from torchpipe.workers import spawn_workers, stop_workers

pytestmark = pytest.mark.timeout(60)


def new_runtime(workers, out_queue):
    """``Runtime(workers)``; older runtimes also took the workers' shared out_queue."""
    if len(inspect.signature(Runtime).parameters) >= 2:
        return Runtime(workers, out_queue)
    return Runtime(workers)


class Boom(Exception):
    pass


@pytest.fixture
def make_runtime():
    made = []

    def make(num_workers):
        out_queue = queue.SimpleQueue()
        workers = spawn_workers([torch.device("cpu")] * num_workers, out_queue, name="torchpipe-rt")
        made.append(workers)
        return new_runtime(workers, out_queue)

    yield make
    for workers in made:
        stop_workers(workers)
        assert not any(w.is_alive() for w in workers)


def const(value):
    return lambda ctx, inputs: value


# --------------------------------------------------------------------------- Program errors
def test_duplicate_key_is_rejected():
    program = Program(2)
    program.add(0, "a", const(1))
    with pytest.raises(ValueError, match="duplicate.*'a'"):
        program.add(1, "a", const(2))


@pytest.mark.parametrize("worker", [-1, 2, 5])
def test_worker_out_of_range_is_rejected(worker):
    with pytest.raises(ValueError, match=str(worker)):
        Program(2).add(worker, "a", const(1))


def test_unknown_dependency_names_the_job_and_the_key():
    program = Program(2)
    program.add(0, "a", const(1))
    program.add(1, "b", const(2), deps=["a", "ghost"], label="job b")
    with pytest.raises(ValueError) as info:
        program.freeze()
    assert "job b" in str(info.value) and "ghost" in str(info.value)


def test_dependency_cycle_would_deadlock():
    program = Program(2)
    program.add(0, "a", const(1), deps=["b"], label="job a")
    program.add(1, "b", const(2), deps=["a"], label="job b")
    with pytest.raises(ValueError, match="deadlock") as info:
        program.freeze()
    assert "job a" in str(info.value) and "job b" in str(info.value)


def test_self_dependency_would_deadlock():
    program = Program(1)
    program.add(0, "a", const(1), deps=["a"], label="loner")
    with pytest.raises(ValueError, match="deadlock.*loner"):
        program.freeze()


def test_worker_order_deadlock_without_a_dependency_cycle():
    """No cycle in the dependency graph, but a1 needs b2 (queued behind b1 on worker 1) and b1
    needs a2 (queued behind a1 on worker 0): executing in worker order would deadlock."""
    program = Program(2)
    program.add(0, "a1", const(1), deps=["b2"], label="a1")
    program.add(0, "a2", const(2), label="a2")
    program.add(1, "b1", const(3), deps=["a2"], label="b1")
    program.add(1, "b2", const(4), label="b2")
    with pytest.raises(ValueError, match="deadlock") as info:
        program.freeze()
    message = str(info.value)
    assert "a1" in message and "b1" in message
    assert "a2" not in message and "b2" not in message


def test_a_frozen_program_cannot_grow_and_freeze_is_idempotent():
    program = Program(1)
    program.add(0, "a", const(1))
    assert program.freeze() is program
    assert program.freeze() is program
    with pytest.raises(RuntimeError, match="frozen"):
        program.add(0, "b", const(2))


def test_forward_references_across_workers_are_fine():
    program = Program(2)
    program.add(0, "a", const(1), deps=["b"])  # b is added later
    program.add(1, "b", const(2))
    program.freeze()


def test_runtime_rejects_a_program_for_another_number_of_workers(make_runtime):
    runtime = make_runtime(2)
    program = Program(3)
    program.add(0, "a", const(1))
    with pytest.raises(ValueError, match="3"):
        runtime.run(program, None)


# ------------------------------------------------------------------------------ execution
def test_hand_made_program_with_cross_worker_dependencies(make_runtime):
    runtime = make_runtime(3)
    where = {}

    def job(name, fn):
        def run(ctx, inputs):
            where[name] = threading.current_thread()
            return fn(ctx, *inputs)

        return run

    program = Program(3)
    program.add(0, "x", job("x", lambda ctx: ctx["base"]))
    program.add(1, "y", job("y", lambda ctx, x: x * 10), deps=["x"])
    program.add(2, "z", job("z", lambda ctx, x, y: (x, y)), deps=["x", "y"], keep=True)
    program.add(0, "w", job("w", lambda ctx, z, x: z[1] + x + 1), deps=["z", "x"], keep=True)
    for base in (1, 2, 3):  # the same program runs many steps
        result = runtime.run(program, {"base": base})
        assert result == {"z": (base, base * 10), "w": base * 10 + base + 1}
    for name, worker in zip("xyzw", (0, 1, 2, 0)):
        assert where[name] is runtime.workers[worker].thread, name


def test_run_kept_returns_the_kept_results_in_job_order_and_run_the_same_by_key(make_runtime):
    # run_kept serves Pipe's forward, which reads its outputs by position (lower_forward keeps
    # them in micro-batch order); run builds its dict from the same list.
    runtime = make_runtime(2)
    program = Program(2)
    program.add(1, "late", const("on worker 1"), keep=True)
    program.add(0, "dropped", const("not kept"))
    program.add(0, "early", lambda ctx, inputs: inputs[0] + "!", deps=["dropped"], keep=True)
    program.add(1, "last", lambda ctx, inputs: inputs, deps=["late", "early"], keep=True)
    assert runtime.run_kept(program, None) == ["on worker 1", "not kept!", ("on worker 1", "not kept!")]
    assert runtime.run(program, None) == {"late": "on worker 1", "early": "not kept!",
                                          "last": ("on worker 1", "not kept!")}
    chain = Program(2)  # one chain, run on the caller's thread: job order, not the order run in
    chain.add(1, "b", lambda ctx, inputs: inputs[0] + 1, deps=["a"], keep=True)
    chain.add(0, "a", const(1), keep=True)
    assert [job.key for job in chain.freeze().chain_order] == ["a", "b"]
    assert runtime.run_kept(chain, None, inline_chains=True) == [2, 1]
    assert runtime.run_kept(chain, None) == [2, 1]


def test_jobs_of_one_worker_run_in_program_order(make_runtime):
    runtime = make_runtime(2)
    log = []
    program = Program(2)
    # Worker 1's jobs become ready in reverse order, but must run in their listed order.
    program.add(0, "slow", lambda ctx, inputs: time.sleep(0.05))
    program.add(1, "first", lambda ctx, inputs: log.append("first"), deps=["slow"])
    program.add(1, "second", lambda ctx, inputs: log.append("second"))
    runtime.run(program, None)
    assert log == ["first", "second"]


def test_an_empty_worker_list_entry_is_fine(make_runtime):
    runtime = make_runtime(3)
    program = Program(3)
    program.add(2, "only", const("v"), keep=True)
    assert runtime.run(program, None) == {"only": "v"}


class Payload:
    """A weak-referenceable value."""

    def __init__(self, name):
        self.name = name


def test_values_are_dropped_after_their_last_consumer(make_runtime):
    runtime = make_runtime(3)
    refs = {}
    observed = {}

    def produce(name):
        def run(ctx, inputs):
            value = Payload(name)
            refs[name] = weakref.ref(value)
            return value

        return run

    def consume(ctx, inputs):
        return len(inputs)

    def check_dropped(ctx, inputs):
        # a has two consumers (b, c), both finished before d: a's value must be gone. A consumer's
        # frame may still hold its inputs for an instant after it reported, so poll briefly.
        deadline = time.monotonic() + 2
        while refs["a"]() is not None and time.monotonic() < deadline:
            time.sleep(0.001)
        observed["a during step"] = refs["a"]() is None
        return Payload("kept")

    program = Program(3)
    program.add(0, "a", produce("a"))
    program.add(1, "b", consume, deps=["a"])
    program.add(2, "c", consume, deps=["a"])
    program.add(0, "d", check_dropped, deps=["b", "c"], keep=True)
    program.add(1, "orphan", produce("orphan"))  # no consumer, not kept
    program.add(2, "kept", produce("kept"), keep=True)
    result = runtime.run(program, None)
    assert observed["a during step"], "a's value outlived its last consumer during the step"
    assert refs["orphan"]() is None, "a non-kept value without consumers outlived the step"
    assert refs["kept"]() is result["kept"]
    assert set(result) == {"d", "kept"}


def test_tensor_values_are_freed_after_the_step(make_runtime):
    runtime = make_runtime(2)
    refs = []

    def produce(ctx, inputs):
        t = torch.randn(1000)
        refs.append(weakref.ref(t))
        return t

    program = Program(2)
    program.add(0, "a", produce)
    program.add(1, "b", lambda ctx, inputs: inputs[0] + 1, keep=True, deps=["a"])
    result = runtime.run(program, None)
    assert refs[0]() is None
    assert isinstance(result["b"], torch.Tensor)


def test_a_job_calling_its_own_runtime_gets_runtime_error(make_runtime):
    runtime = make_runtime(1)
    inner = Program(1)
    inner.add(0, "i", const(0))

    def reenter(ctx, inputs):
        return runtime.run(inner, None)

    program = Program(1)
    program.add(0, "outer", reenter)
    caught = {}

    def call():
        try:
            runtime.run(program, None)
        except BaseException as exc:  # noqa: B902
            caught["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "re-entrant run deadlocked"
    assert isinstance(caught["error"], RuntimeError)
    assert runtime.run(inner, None) == {}


# ------------------------------------------------------------------------- abort and errors
def explode_in_job():
    raise Boom("job failed")


def test_a_worker_gets_its_tasks_once_its_first_job_has_all_its_inputs(make_runtime):
    """Queued up front, a worker would wake once for its queue and again for its input: one more
    thread hand-off per step on the critical path of a one-micro-batch call. So a worker whose
    first job needs results is handed its tasks by the job that completes the last of them."""
    runtime = make_runtime(3)
    queued = {}

    def look(name, value):
        def run(ctx, inputs):
            queued[name] = [runtime.workers[w].in_queue.qsize() for w in (1, 2)]
            return value + sum(inputs)
        return run

    program = Program(3)
    program.add(0, "a", look("during a", 1))
    program.add(1, "b", look("during b", 10), deps=["a"])
    program.add(1, "b2", look("during b2", 100))  # no inputs, but queued behind b
    program.add(2, "c", look("during c", 1000), deps=["a", "b"], keep=True)
    assert runtime.run(program, None) == {"c": 1012}
    # While a runs, neither worker has tasks; while b runs, worker 2 still waits for b, and b2 is
    # queued behind b on worker 1.
    assert queued["during a"] == [0, 0]
    assert queued["during b"] == [1, 0]


def test_abort_wakes_jobs_waiting_on_a_failed_dependency(make_runtime):
    runtime = make_runtime(3)
    ran = []

    def fail(ctx, inputs):
        time.sleep(0.1)  # the other workers wait for this job meanwhile (not yet given their tasks)
        explode_in_job()

    def record(name):
        return lambda ctx, inputs: ran.append(name)

    program = Program(3)
    program.add(0, "fail", fail)
    program.add(0, "after", record("after"))
    program.add(1, "wait1", record("wait1"), deps=["fail"])
    program.add(1, "then1", record("then1"))
    program.add(2, "wait2", record("wait2"), deps=["wait1"])
    program.add(2, "indep", record("indep"))
    start = time.monotonic()
    with pytest.raises(Boom) as info:
        runtime.run(program, None)
    assert time.monotonic() - start < 2.0
    assert "explode_in_job" in [f.name for f in __import__("traceback").extract_tb(info.value.__traceback__)]
    assert "wait1" not in ran and "wait2" not in ran and "then1" not in ran


def test_the_failing_worker_runs_none_of_its_later_jobs(make_runtime):
    runtime = make_runtime(2)
    ran = []
    program = Program(2)
    program.add(0, "fail", lambda ctx, inputs: explode_in_job())
    for i in range(10):
        program.add(0, f"after{i}", lambda ctx, inputs, i=i: ran.append(i))
    program.add(1, "wait", lambda ctx, inputs: ran.append("wait"), deps=["after9"])
    with pytest.raises(Boom):
        runtime.run(program, None)
    assert ran == [], f"jobs of the aborted step ran after the failure: {ran}"


def test_failure_while_another_worker_is_busy_returns_after_that_job_only(make_runtime):
    runtime = make_runtime(3)
    ran = []

    def slow(ctx, inputs):
        time.sleep(0.3)
        ran.append("slow")

    def fail(ctx, inputs):
        explode_in_job()

    program = Program(3)
    program.add(0, "slow", slow)
    for i in range(20):
        program.add(0, f"more{i}", lambda ctx, inputs, i=i: (time.sleep(0.3), ran.append(i)))
    program.add(1, "fail", fail)
    program.add(2, "consume", lambda ctx, inputs: ran.append("consume"), deps=["more19"])
    start = time.monotonic()
    with pytest.raises(Boom):
        runtime.run(program, None)
    elapsed = time.monotonic() - start
    assert elapsed < 1.5, f"{elapsed:.2f}s: the rest of the step was not cancelled"
    assert "consume" not in ran and 19 not in ran


def test_the_next_step_is_clean_after_a_failed_step(make_runtime):
    runtime = make_runtime(2)
    should_fail = {"on": True}

    def maybe_fail(ctx, inputs):
        if should_fail["on"]:
            explode_in_job()
        return ctx

    program = Program(2)
    program.add(0, "a", maybe_fail)
    program.add(1, "slow", lambda ctx, inputs: time.sleep(0.05))
    program.add(1, "b", lambda ctx, inputs: inputs[0] * 2, deps=["a"], keep=True)
    with pytest.raises(Boom):
        runtime.run(program, 5)
    failed = runtime.last_step
    assert failed is not None
    should_fail["on"] = False
    for value in range(5):
        assert runtime.run(program, value) == {"b": value * 2}
    assert runtime.last_step is not failed


def test_base_exception_in_a_job_reaches_the_caller(make_runtime):
    runtime = make_runtime(2)
    for error in (KeyboardInterrupt("k"), SystemExit(4)):
        program = Program(2)

        def fail(ctx, inputs, error=error):
            raise error

        program.add(0, "a", fail)
        program.add(1, "b", const(1), deps=["a"], keep=True)
        with pytest.raises(type(error)) as info:
            runtime.run(program, None)
        assert info.value is error
    ok = Program(2)
    ok.add(0, "a", const(3))
    ok.add(1, "b", lambda ctx, inputs: inputs[0], deps=["a"], keep=True)
    assert runtime.run(ok, None) == {"b": 3}


def test_first_error_wins_when_several_jobs_fail(make_runtime):
    runtime = make_runtime(2)
    first = Boom("first")

    def fail_first(ctx, inputs):
        raise first

    def fail_later(ctx, inputs):
        time.sleep(0.05)
        raise ValueError("later")

    program = Program(2)
    program.add(0, "a", fail_first)
    program.add(1, "b", fail_later)
    with pytest.raises(Boom) as info:
        runtime.run(program, None)
    assert info.value is first


# ----------------------------------------------------------------------------- StepRecord
def test_step_record_of_a_real_step_is_consistent(make_runtime):
    runtime = make_runtime(2)
    program = Program(2)
    program.add(0, "a", lambda ctx, inputs: time.sleep(0.02), label="A")
    program.add(1, "b", lambda ctx, inputs: time.sleep(0.02), deps=["a"], label="B")
    program.add(0, "c", lambda ctx, inputs: time.sleep(0.02), label="C")
    runtime.run(program, None)
    record = runtime.last_step
    assert record.labels == ["A", "B", "C"]
    assert record.workers == [0, 1, 0]
    assert record.worker_names == [w.name for w in runtime.workers]
    assert all(0 <= e - s for s, e in zip(record.starts, record.ends))
    assert all(e - s >= 0.015 for s, e in zip(record.starts, record.ends))
    assert record.wall_start <= min(record.starts) and max(record.ends) <= record.wall_end
    # B starts after A ended (dependency); C starts after A ended (same worker).
    assert record.starts[1] >= record.ends[0] and record.starts[2] >= record.ends[0]
    makespan = max(record.ends) - min(record.starts)
    assert record.makespan == pytest.approx(makespan)
    busy = record.busy()
    assert busy[0] == pytest.approx((record.ends[0] - record.starts[0]) + (record.ends[2] - record.starts[2]))
    assert busy[1] == pytest.approx(record.ends[1] - record.starts[1])
    assert record.bubble_ratio == pytest.approx(1 - sum(busy) / (2 * makespan))
    assert 0 <= record.bubble_ratio < 1

    trace = json.loads(json.dumps(record.chrome_trace()))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == set(record.worker_names)
    assert sorted(e["name"] for e in spans) == ["A", "B", "C"]
    origin = min(record.starts)
    for e in spans:
        i = record.labels.index(e["name"])
        assert e["tid"] == record.workers[i]
        assert e["ts"] == pytest.approx((record.starts[i] - origin) * 1e6)
        assert e["dur"] == pytest.approx((record.ends[i] - record.starts[i]) * 1e6)
    assert min(e["ts"] for e in spans) == 0
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(makespan * 1e6)


def test_step_record_arithmetic_by_hand(tmp_path):
    record = StepRecord(
        labels=["a", "b", "skipped"],
        workers=[0, 1, 1],
        worker_names=["w0", "w1"],
        starts=[10.0, 11.0, -1.0],
        ends=[11.0, 12.0, -1.0],
        wall_start=9.5,
        wall_end=12.5,
    )
    assert record.makespan == pytest.approx(2.0)
    assert record.busy() == pytest.approx([1.0, 1.0])
    assert record.bubble_ratio == pytest.approx(0.5)
    trace = record.chrome_trace()
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in spans] == [("a", 0.0, 1e6), ("b", 1e6, 1e6)]
    path = tmp_path / "trace.json"
    record.save_chrome_trace(str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))
    record.save_chrome_trace(path)  # an os.PathLike too
    with open(tmp_path / "mine.txt", "w") as mine:
        # open() would take an int as a file descriptor, write into it and close it under its owner.
        with pytest.raises(TypeError, match=rf"save_chrome_trace takes a file path \(str or os.PathLike\), got int: "
                                            rf"{mine.fileno()}"):
            record.save_chrome_trace(mine.fileno())
        mine.write("still open")
    assert (tmp_path / "mine.txt").read_text() == "still open"

    empty = StepRecord([], [], ["w0"], [], [], 0.0, 1.0)
    assert empty.makespan == 0.0 and empty.bubble_ratio == 0.0
    assert [e for e in empty.chrome_trace()["traceEvents"] if e["ph"] == "X"] == []


def test_step_record_of_an_aborted_step_skips_jobs_that_never_ran(make_runtime):
    runtime = make_runtime(2)
    program = Program(2)
    program.add(0, "a", lambda ctx, inputs: explode_in_job(), label="A")
    program.add(1, "b", const(1), deps=["a"], label="B")
    with pytest.raises(Boom):
        runtime.run(program, None)
    record = runtime.last_step
    assert record.starts[1] == -1.0
    # The job that raised ran until it raised: it is in the record, marked (s33).
    assert record.starts[0] >= 0 and record.failed_job == 0 and record.error.startswith("Boom")
    events = [e for e in record.chrome_trace()["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["args"]["error"]) for e in events] == [("A", record.error)]
    assert record.busy()[1] == 0.0


def test_a_latch_set_before_or_during_a_wait_releases_it():
    latch = Latch()
    assert not latch.is_set()
    threading.Timer(0.05, latch.set).start()
    latch.wait()
    assert latch.is_set()
    latch.set()  # again: nothing changes
    latch.wait()
    ready = Latch()
    ready.set()
    ready.wait()


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_a_ctrl_c_during_a_latch_wait_leaves_it_usable():
    """The step's caller waits on a Latch: an interrupt must not leave it half-changed."""
    assert threading.current_thread() is threading.main_thread()
    latch = Latch()
    main = threading.main_thread().ident
    caught = threading.Event()

    def interrupt_until_caught():
        # Again until it lands: a signal handled just before the wait's lock acquire starts
        # blocking is only seen at the next one, as for any lock (seen once in CI, s33).
        while not caught.wait(0.05):
            signal.pthread_kill(main, signal.SIGINT)

    def once(signum, frame):  # a signal sent after the first one landed does nothing
        if not caught.is_set():
            caught.set()
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, once)
    interrupter = threading.Thread(target=interrupt_until_caught)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            latch.wait()
    finally:
        caught.set()
        interrupter.join()
        signal.signal(signal.SIGINT, previous)
    assert not latch.is_set()
    threading.Timer(0.05, latch.set).start()
    latch.wait()
    assert latch.is_set()


# --------------------------------------------------------------------------- one chain, on the caller's thread
def chain_program(functions):
    """Job i on worker i, each taking the one before it: a one-micro-batch pipeline."""
    program = Program(len(functions))
    for i, function in enumerate(functions):
        program.add(i, i, function, deps=[i - 1] if i else [], label=f"job {i}", keep=i == len(functions) - 1)
    return program


def test_a_program_is_one_chain_only_when_no_two_jobs_could_overlap():
    assert [j.key for j in chain_program([const(1)] * 3).freeze().chain_order] == [0, 1, 2]
    # Ordered by their worker alone: a worker's jobs never overlap.
    program = Program(2)
    program.add(0, "a", const(1))
    program.add(0, "b", const(2))
    program.add(1, "c", const(3), deps=["b"])
    assert [j.key for j in program.freeze().chain_order] == ["a", "b", "c"]
    # Two micro-batches: stage 1 of the first can overlap stage 0 of the second.
    program = Program(2)
    for mb in range(2):
        program.add(0, ("F", 0, mb), const(mb))
        program.add(1, ("F", 1, mb), const(mb), deps=[("F", 0, mb)])
    assert program.freeze().chain_order is None
    # Two independent jobs on two workers.
    program = Program(2)
    program.add(0, "a", const(1))
    program.add(1, "b", const(2))
    assert program.freeze().chain_order is None
    # A join after a fork is no chain either.
    program = Program(3)
    program.add(0, "a", const(1))
    program.add(1, "b", const(2), deps=["a"])
    program.add(2, "c", const(3), deps=["a"])
    assert program.freeze().chain_order is None


def test_a_chain_runs_on_the_callers_thread_only_when_asked(make_runtime):
    runtime = make_runtime(3)
    seen = []

    def step(ctx, inputs):
        seen.append(threading.get_ident())
        return (inputs[0] if inputs else 0) + 1

    program = chain_program([step] * 3)
    assert runtime.run(program, None, inline_chains=True) == {2: 3}
    assert seen == [threading.get_ident()] * 3
    record = runtime.last_step
    assert record.labels == ["job 0", "job 1", "job 2"] and record.workers == [0, 1, 2]
    assert all(s >= 0 for s in record.starts) and record.ends[0] <= record.starts[1] <= record.ends[1] <= record.starts[2]
    assert record.error is None and record.failed_job is None
    seen.clear()
    assert runtime.run(program, None) == {2: 3}  # not asked: the workers run it
    assert threading.get_ident() not in seen and len(set(seen)) == 3


def test_an_inline_chain_drops_each_result_once_its_consumer_took_it(make_runtime):
    runtime = make_runtime(3)
    alive = []

    class Activation:
        pass

    def make(ctx, inputs):
        value = Activation()
        alive.append(weakref.ref(value))
        return value

    def check_the_first_is_gone(ctx, inputs):
        assert alive[0]() is None, "job 0's result outlived its only consumer"
        return 1

    program = chain_program([make, make, check_the_first_is_gone])
    assert runtime.run(program, None, inline_chains=True) == {2: 1}
    assert all(ref() is None for ref in alive)


def test_an_inline_failure_keeps_its_type_traceback_and_record_and_the_runtime_works_after(make_runtime):
    runtime = make_runtime(3)
    aborted = []

    def boom(ctx, inputs):
        raise Boom("stage 1 failed")

    def never(ctx, inputs):
        raise AssertionError("a job after the failure ran")

    program = chain_program([const(1), boom, never])
    with pytest.raises(Boom, match="stage 1 failed") as info:
        runtime.run(program, None, on_abort=aborted.append, inline_chains=True)
    assert info.traceback[-1].name == "boom"
    assert len(aborted) == 1 and isinstance(aborted[0], Boom)
    record = runtime.last_step
    assert record.failed_job == 1 and record.error == "Boom: stage 1 failed"
    assert record.starts[0] >= 0 and record.starts[1] >= 0 and record.starts[2] == -1.0
    assert runtime.run(chain_program([const(1), const(2)]), None, inline_chains=True) == {1: 2}


def test_an_interrupt_in_an_inline_job_reaches_the_caller_and_the_runtime_works_after(make_runtime):
    runtime = make_runtime(2)

    def interrupted(ctx, inputs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runtime.run(chain_program([const(1), interrupted]), None, inline_chains=True)
    assert runtime.last_step.failed_job == 1 and runtime.last_step.error == "KeyboardInterrupt"
    assert runtime.run(chain_program([const(1), const(5)]), None, inline_chains=True) == {1: 5}


def test_an_inline_job_that_calls_its_own_runtime_is_refused_not_deadlocked(make_runtime):
    runtime = make_runtime(2)
    refused = []

    def calls_back(ctx, inputs):
        try:
            runtime.run(chain_program([const(1)]), None, inline_chains=True)
        except RuntimeError as exc:
            refused.append(str(exc))
        return 1

    result = {}
    caller = threading.Thread(target=lambda: result.update(runtime.run(
        chain_program([const(0), calls_back]), None, inline_chains=True)), daemon=True)
    caller.start()
    caller.join(10)
    assert not caller.is_alive(), "a job calling its own runtime deadlocked"
    assert result == {1: 1} and refused and "re-entrant" in refused[0]
    # Once the step is over, the same call from the same thread is no longer refused.
    runtime.refuse_worker_caller()


def test_an_inline_job_runs_under_the_calls_grad_mode_and_a_backward_job_outside_autocast(make_runtime):
    from torchpipe.thread_state import outside_autocast

    runtime = make_runtime(3)
    seen = []

    def turns_grad_off(ctx, inputs):
        seen.append(("grad", torch.is_grad_enabled()))
        torch.set_grad_enabled(False)
        return 1

    def looks(ctx, inputs):
        seen.append(("grad", torch.is_grad_enabled()))
        seen.append(("autocast", torch.is_autocast_enabled("cpu")))
        return 2

    program = chain_program([turns_grad_off, looks, outside_autocast(lambda ctx, inputs: looks(ctx, inputs))])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runtime.run(program, None, device_types=["cpu"], inline_chains=True)
        assert torch.is_autocast_enabled("cpu")
    assert torch.is_grad_enabled()
    assert seen == [("grad", True), ("grad", True), ("autocast", True), ("grad", True), ("autocast", False)]
