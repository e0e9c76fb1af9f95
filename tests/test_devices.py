"""The backend interface: the stream/event protocol through a fake backend, CPU no-ops, and
clear errors for missing accelerators, raised before the module is touched.

DESIGN.md invariant 4 ("Streams") and issue 3 ("Workers and devices"). The fake backend
serves the 'meta' device: meta tensors support Linear, so a Pipe over ['cpu', 'meta'] or
['meta', 'meta'] runs the accelerator code path (copy streams, events, record_stream) with
streams and events that only record what was asked of them.
"""
import contextlib
import importlib.util
import re
import threading

import pytest
import torch
from torch import nn

import torchpipe
from torchpipe import BackendUnavailableError, Pipe
from torchpipe.devices import (
    AcceleratorBackend,
    Backend,
    CPUBackend,
    as_device,
    get_backend,
    register_backend,
    use_backend,
)
from torchpipe.microbatch import Batch

pytestmark = pytest.mark.timeout(60)

META = torch.device("meta")


# --------------------------------------------------------------------------- fake backend
class FakeStream:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, name):
        self.name = name
        self.recorded_on = None

    def __repr__(self):
        return f"FakeEvent({self.name})"


class FakeBackend(Backend):
    """Records every call with the thread that made it; a thread-local current stream."""

    type = "meta"

    def __init__(self):
        self.calls = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self.default_stream = FakeStream("default")
        self.created = []
        self.events = []

    def log(self, *entry):
        with self._lock:
            self.calls.append((threading.current_thread().name,) + entry)

    def of(self, kind):
        return [c for c in self.calls if c[1] == kind]

    def is_available(self):
        return True

    def device_count(self):
        return 1

    def check(self, device):
        self.log("check", device)

    def current_stream(self, device):
        return getattr(self._local, "stream", self.default_stream)

    def new_stream(self, device):
        with self._lock:
            stream = FakeStream(f"s{len(self.created)}")
            self.created.append(stream)
        self.log("new_stream", stream)
        return stream

    @contextlib.contextmanager
    def use_stream(self, stream):
        previous = self.current_stream(META)
        self._local.stream = stream
        self.log("use_stream", stream)
        try:
            yield
        finally:
            self._local.stream = previous

    def use_device(self, device):
        self.log("use_device", device)
        return contextlib.nullcontext()

    def wait_stream(self, waiting, waited):
        self.log("wait_stream", waiting, waited)

    def record_stream(self, tensor, stream):
        self.log("record_stream", tensor.device, stream)

    def new_event(self):
        with self._lock:
            event = FakeEvent(f"e{len(self.events)}")
            self.events.append(event)
        return event

    def record_event(self, event, stream):
        event.recorded_on = stream
        self.log("record_event", event, stream)

    def wait_event(self, stream, event):
        self.log("wait_event", stream, event)

    def synchronize(self, device):
        self.log("synchronize", device)


class RecordCurrentStream(nn.Module):
    """Records, per call, the worker thread and the fake backend's current stream."""

    def __init__(self, backend):
        super().__init__()
        self.backend = backend
        self.seen = []

    def forward(self, x):
        self.seen.append((threading.current_thread().name, self.backend.current_stream(x.device)))
        return x


@pytest.fixture
def fake():
    backend = FakeBackend()
    with use_backend("meta", backend):
        yield backend
    assert get_backend("meta") is not backend, "use_backend did not restore the previous backend"


@pytest.fixture
def no_cpu_record_stream(monkeypatch):
    """Fail on any Tensor.record_stream call with a CPU tensor (wherever it comes from)."""
    calls = []
    original = torch.Tensor.record_stream

    def spy(self, stream):
        calls.append(self.device)
        if self.device.type == "cpu":
            raise AssertionError("record_stream called on a CPU tensor")
        return original(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", spy)
    yield calls
    assert all(d.type != "cpu" for d in calls)


# ------------------------------------------------------------------------ stream protocol
def test_cpu_to_accelerator_pipe_follows_the_stream_protocol(fake, no_cpu_record_stream):
    recorder = RecordCurrentStream(fake)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), recorder)
    with Pipe(model, [1, 2], devices=["cpu", "meta"], chunks=2, checkpoint="never") as pipe:
        assert pipe.devices == [torch.device("cpu"), META]
        assert next(pipe.partitions[1].parameters()).device == META
        worker_stream = pipe._workers[1].stream
        assert isinstance(worker_stream, FakeStream)
        worker_name = pipe._workers[1].name

        out = pipe(torch.randn(6, 4))
        assert out.device == META and out.shape == (6, 4)

    # Each micro-batch of stage 1 ran on its worker thread with the worker's own stream current.
    assert recorder.seen == [(worker_name, worker_stream)] * 2
    entered = [c for c in fake.of("use_stream") if c[2] is worker_stream]
    assert entered and all(c[0] == worker_name for c in entered)

    # The CPU->meta copy ran on a copy stream (not the compute stream), and the compute stream
    # waited for the copy stream before using the copied tensors.
    copy_streams = {c[2] for c in fake.of("use_stream") if c[2] is not worker_stream}
    assert copy_streams, "the copy did not run on a copy stream"
    waits = [c for c in fake.of("wait_stream") if c[0] != threading.current_thread().name]
    assert len(waits) == 2
    assert all(c[0] == worker_name and c[2] is worker_stream and c[3] in copy_streams for c in waits)

    # Tensors used on another stream are record_stream'ed; never CPU tensors.
    records = fake.of("record_stream")
    assert records and all(c[2] == META for c in records)
    assert any(c[0] == worker_name and c[3] is worker_stream for c in records)

    # The producer (stage 1) records an event per micro-batch on its stream; the caller's stream
    # waits on exactly those events before it may use the output.
    recorded = fake.of("record_event")
    assert len(recorded) == 2
    assert all(c[0] == worker_name and c[3] is worker_stream for c in recorded)
    caller = threading.current_thread().name
    waited = fake.of("wait_event")
    assert {id(c[3]) for c in waited if c[0] == caller} == {id(c[2]) for c in recorded}
    assert all(c[2] is fake.default_stream for c in waited if c[0] == caller)
    assert any(c[0] == caller and c[3] is fake.default_stream for c in records), (
        "the output was not record_stream'ed on the caller's stream"
    )


def test_accelerator_to_accelerator_pipe_waits_on_the_producers_events(fake, no_cpu_record_stream):
    recorders = [RecordCurrentStream(fake), RecordCurrentStream(fake)]
    model = nn.Sequential(nn.Linear(4, 4), recorders[0], nn.Linear(4, 4), recorders[1])
    with Pipe(model, [2, 2], devices=["meta", "meta"], chunks=3, checkpoint="never") as pipe:
        streams = [w.stream for w in pipe._workers]
        names = [w.name for w in pipe._workers]
        assert streams[0] is not streams[1], "two workers share one stream"
        x = torch.randn(6, 4, device="meta")
        out = pipe(x)
        assert out.shape == (6, 4)

    for recorder, name, stream in zip(recorders, names, streams):
        assert recorder.seen == [(name, stream)] * 3

    caller = threading.current_thread().name
    recorded = fake.of("record_event")
    by_thread = {}
    for thread, _, event, stream in recorded:
        by_thread.setdefault(thread, []).append((event, stream))
    # The caller marks its input ready on its own stream; each stage marks each output.
    assert [s for _, s in by_thread[caller]] == [fake.default_stream] * 3
    assert [s for _, s in by_thread[names[0]]] == [streams[0]] * 3
    assert [s for _, s in by_thread[names[1]]] == [streams[1]] * 3

    waited = fake.of("wait_event")
    stage0_waits = [(s, e) for t, _, s, e in waited if t == names[0]]
    stage1_waits = [(s, e) for t, _, s, e in waited if t == names[1]]
    caller_waits = [(s, e) for t, _, s, e in waited if t == caller]
    # Stage 0 waits (on its stream) for the caller's input events, stage 1 for stage 0's
    # events, the caller for stage 1's: each consumer waits on what its producer recorded.
    assert stage0_waits == [(streams[0], e) for e, _ in by_thread[caller]]
    assert stage1_waits == [(streams[1], e) for e, _ in by_thread[names[0]]]
    assert caller_waits == [(fake.default_stream, e) for e, _ in by_thread[names[1]]]

    # Each consumer record_streams the tensors it received on its own stream.
    records = fake.of("record_stream")
    for name, stream in zip(names, streams):
        assert any(t == name and s is stream for t, _, _, s in records), name
    assert all(d == META for _, _, d, _ in records)
    assert not fake.of("wait_stream") or all(c[2] is not c[3] for c in fake.of("wait_stream"))


def _fence_positions(fake, caller, streams):
    """Indexes in ``fake.calls`` of the caller's fence-in and fence-out waits for ``streams``."""
    fence_in = [i for i, c in enumerate(fake.calls)
                if c[0] == caller and c[1] == "wait_stream" and c[3] is fake.default_stream and c[2] in streams]
    fence_out = [i for i, c in enumerate(fake.calls)
                 if c[0] == caller and c[1] == "wait_stream" and c[2] is fake.default_stream and c[3] in streams]
    return fence_in, fence_out


@pytest.mark.parametrize("how", ["forward", "step", "failing step"])
def test_worker_streams_wait_for_the_caller_and_the_caller_waits_for_them(fake, how):
    """Parameters the caller updates on its stream are read by the workers only after the
    update, and the caller's stream sees every gradient and loss the workers wrote."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    caller = threading.current_thread().name
    with Pipe(model, [1, 1, 1], devices=["meta", "meta", "meta"], chunks=2, checkpoint="never") as pipe:
        worker_streams = [w.stream for w in pipe._workers]
        worker_names = {w.name for w in pipe._workers}
        fake.calls.clear()
        x, y = torch.randn(4, 4, device="meta"), torch.randn(4, 4, device="meta")
        if how == "forward":
            pipe(x)
        elif how == "step":
            pipe.step(x, y, nn.MSELoss())
        else:
            with pytest.raises(TypeError, match="scalar"):  # fails on the workers, mid-step
                pipe.step(x, y, lambda output, target: output - target, reduction="sum")
        fence_in, fence_out = _fence_positions(fake, caller, worker_streams)
        # Stream work of the workers (entering a stream at thread start queues nothing).
        worker_calls = [i for i, c in enumerate(fake.calls)
                        if c[0] in worker_names and c[1] not in ("use_device", "use_stream")]
        copy_streams = [s for stage in pipe._stages for _, s in stage.streams()[1:]]

    assert sorted(fake.calls[i][2].name for i in fence_in) == sorted(s.name for s in worker_streams)
    assert sorted(fake.calls[i][3].name for i in fence_out) == sorted(s.name for s in worker_streams)
    assert worker_calls and max(fence_in) < min(worker_calls), "a worker ran before its stream waited for the caller"
    assert min(fence_out) > max(worker_calls), "the caller's stream stopped waiting before the workers finished"
    _, copy_fence_out = _fence_positions(fake, caller, copy_streams)
    assert len(copy_fence_out) == len(copy_streams)


def test_accelerator_to_cpu_copy_waits_on_the_producer_on_the_copy_stream(fake, no_cpu_record_stream):
    recorder = RecordCurrentStream(fake)
    model = nn.Sequential(nn.Linear(4, 4), recorder, nn.Identity())
    # Stage 1 on the CPU gets meta tensors: the copy out of meta fails (no data), but only after
    # the consumer has made its copy stream wait for the producer's event.
    with Pipe(model, [2, 1], devices=["meta", "cpu"], chunks=1, checkpoint="never") as pipe:
        name0, name1 = pipe._workers[0].name, pipe._workers[1].name
        with pytest.raises(NotImplementedError):
            pipe(torch.randn(2, 4, device="meta"))
    produced = [c for c in fake.of("record_event") if c[0] == name0]
    assert len(produced) == 1
    event = produced[0][2]
    consumer_waits = [c for c in fake.of("wait_event") if c[0] == name1]
    assert len(consumer_waits) == 1 and consumer_waits[0][3] is event
    copy_stream = consumer_waits[0][2]
    assert copy_stream is not pipe._workers[0].stream and isinstance(copy_stream, FakeStream)


def test_each_worker_enters_its_own_device_and_stream_once_per_thread(fake):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    with Pipe(model, [1, 1, 1], devices=["meta", "meta", "meta"], checkpoint="never") as pipe:
        pipe(torch.randn(2, 2, device="meta"))
        for worker in pipe._workers:
            entries = [c for c in fake.of("use_stream") if c[0] == worker.name and c[2] is worker.stream]
            assert entries, worker.name
            assert any(c[0] == worker.name and c[2] == META for c in fake.of("use_device"))
        assert len({id(w.stream) for w in pipe._workers}) == 3


def test_a_pipe_runs_on_a_device_type_without_autocast():
    backend = FakeBackend()
    with use_backend("meta", backend):
        with Pipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=["cpu", "meta"]) as pipe:
            assert pipe(torch.randn(2, 2)).device == META


# ---------------------------------------------------------------------------- CPU no-ops
def test_cpu_backend_streams_and_events_are_no_ops(no_cpu_record_stream):
    backend = get_backend("cpu")
    assert isinstance(backend, CPUBackend) and backend.type == "cpu"
    cpu = torch.device("cpu")
    stream = backend.new_stream(cpu)
    assert stream is backend.current_stream(cpu)
    with backend.use_stream(stream), backend.use_device(cpu):
        pass
    tensor = torch.randn(3)
    backend.wait_stream(stream, backend.new_stream(cpu))
    backend.record_stream(tensor, stream)
    event = backend.new_event()
    backend.record_event(event, stream)
    backend.wait_event(stream, event)
    backend.synchronize(cpu)
    assert backend.is_available() and backend.device_count() >= 1
    assert no_cpu_record_stream == []


def test_accelerator_backend_never_record_streams_cpu_tensors(no_cpu_record_stream):
    backend = AcceleratorBackend("cuda")
    backend.record_stream(torch.randn(2), object())  # must not reach Tensor.record_stream
    assert no_cpu_record_stream == []


class SpyCPUBackend(CPUBackend):
    def __init__(self):
        self.calls = []

    def record_stream(self, tensor, stream):
        self.calls.append(("record_stream", tensor.device))

    def new_event(self):
        self.calls.append(("new_event",))
        return None

    def wait_event(self, stream, event):
        self.calls.append(("wait_event",))

    def wait_stream(self, waiting, waited):
        self.calls.append(("wait_stream",))


def test_a_cpu_pipe_asks_for_no_stream_work(no_cpu_record_stream):
    spy = SpyCPUBackend()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with use_backend("cpu", spy):
        with Pipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=3) as pipe:
            out = pipe(torch.randn(6, 4))
            out.sum().backward()
    assert [c for c in spy.calls if c[0] == "record_stream"] == []
    assert ("new_event",) not in spy.calls
    assert no_cpu_record_stream == []


# -------------------------------------------------------------------- registration helpers
def test_use_backend_restores_or_removes():
    original = get_backend("cpu")
    fake = FakeBackend()
    with use_backend("cpu", fake):
        assert get_backend("cpu") is fake
    assert get_backend("cpu") is original

    with use_backend("xla", fake):
        assert get_backend("xla:0") is fake
    with pytest.raises(BackendUnavailableError):
        get_backend("xla:0")

    previous = register_backend("cpu", fake)
    try:
        assert previous is original and get_backend("cpu") is fake
    finally:
        register_backend("cpu", previous)


def test_unknown_device_strings_are_a_value_error():
    with pytest.raises(ValueError, match="banana"):
        as_device("banana:0")


def test_integer_devices_are_checked_by_name():
    with pytest.raises(ValueError, match="invalid device -1: a CUDA index must be >= 0"):
        as_device(-1)
    with pytest.raises(TypeError, match="invalid device True"):
        as_device(True)
    for bad in (None, 1.5, ["cpu"]):  # were ValueErrors, unlike True
        with pytest.raises(TypeError, match=re.escape(f"invalid device {bad!r}: expected a str")):
            as_device(bad)
    assert as_device(1) == torch.device("cuda", 1)


# -------------------------------------------------------------- missing accelerators
needs_no_torch_npu = pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed"
)
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")


def snapshot(module):
    return (
        [(name, id(child)) for name, child in module.named_children()],
        [(name, p.device, id(p)) for name, p in module.named_parameters()],
        [(name, type(m).__name__) for name, m in module.named_modules()],
    )


def make_model():
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4))


@needs_no_torch_npu
def test_npu_without_torch_npu_names_the_package():
    with pytest.raises(BackendUnavailableError, match="torch_npu"):
        as_device("npu:0")
    with pytest.raises(BackendUnavailableError, match="torch_npu"):
        get_backend("npu:0")
    assert not AcceleratorBackend("npu", import_name="torch_npu").is_available()


@needs_no_torch_npu
@pytest.mark.parametrize("devices", [["npu:0"], ["cpu", "npu:0"], ["npu:0", "cpu"]])
@pytest.mark.parametrize("deferred_batch_norm", [False, True])
def test_pipe_on_npu_without_torch_npu_fails_before_touching_the_module(devices, deferred_batch_norm):
    model = make_model()
    before = snapshot(model)
    threads = set(threading.enumerate())
    balance = [4] if len(devices) == 1 else [2, 2]
    with pytest.raises(BackendUnavailableError, match="torch_npu"):
        Pipe(model, balance, devices=devices, deferred_batch_norm=deferred_batch_norm)
    assert snapshot(model) == before
    assert set(threading.enumerate()) <= threads, "a failed Pipe() left threads behind"


@needs_no_cuda
@pytest.mark.parametrize("devices", [["cuda:0"], ["cpu", "cuda:0"], [torch.device("cuda", 0), "cpu"], [0, 1]])
def test_pipe_on_cuda_without_cuda_fails_before_touching_the_module(devices):
    model = make_model()
    before = snapshot(model)
    threads = set(threading.enumerate())
    balance = [4] if len(devices) == 1 else [2, 2]
    with pytest.raises(BackendUnavailableError, match="cuda"):
        Pipe(model, balance, devices=devices, deferred_batch_norm=True)
    assert snapshot(model) == before
    assert set(threading.enumerate()) <= threads


@pytest.mark.parametrize("devices,partitions", [(["cpu", "cpu"], 3), (["cpu"], 2), ([], 1)])
def test_too_few_devices_is_an_index_error_naming_the_numbers(devices, partitions):
    model = make_model()
    before = snapshot(model)
    balance = {1: [4], 2: [2, 2], 3: [1, 1, 2]}[partitions]
    with pytest.raises(IndexError) as info:
        Pipe(model, balance, devices=devices)
    message = str(info.value)
    assert f"devices: {len(devices)}" in message and f"partitions: {partitions}" in message
    assert snapshot(model) == before


def test_a_backend_whose_check_fails_leaves_the_module_untouched():
    class Refuses(FakeBackend):
        def check(self, device):
            raise BackendUnavailableError("device lost")

    model = make_model()
    before = snapshot(model)
    threads = set(threading.enumerate())
    with use_backend("meta", Refuses()):
        with pytest.raises(BackendUnavailableError, match="device lost"):
            Pipe(model, [2, 2], devices=["cpu", "meta"])
    assert snapshot(model) == before
    assert set(threading.enumerate()) <= threads


def test_a_backend_failing_to_make_a_stream_leaks_no_thread():
    class NoStreams(FakeBackend):
        def new_stream(self, device):
            raise RuntimeError("out of streams")

    model = make_model()
    threads = set(threading.enumerate())
    with use_backend("meta", NoStreams()):
        with pytest.raises(RuntimeError, match="out of streams"):
            Pipe(model, [2, 2], devices=["cpu", "meta"])
    alive = [t for t in set(threading.enumerate()) - threads if t.name.startswith("torchpipe")]
    for t in alive:
        t.join(5)
    assert not any(t.is_alive() for t in alive)


def test_a_task_with_its_own_stream_runs_inside_it():
    import contextlib

    import torch as _torch

    from torchpipe.devices import Backend, use_backend
    from torchpipe.workers import Task, Worker, stop_workers

    active = []

    class Streams(Backend):
        type = "meta"

        def new_stream(self, device):
            return "worker-stream"

        def use_stream(self, stream):
            @contextlib.contextmanager
            def scope():
                active.append(stream)
                try:
                    yield
                finally:
                    active.pop()

            return scope()

    done = []
    with use_backend("meta", Streams()):
        worker = Worker("torchpipe-stream-task", device=_torch.device("meta"))
        try:
            worker.put(Task(lambda: done.append(list(active)), stream="copy-stream"))
            worker.put(Task(lambda: done.append(list(active))))
        finally:
            stop_workers([worker])
    assert done == [["worker-stream", "copy-stream"], ["worker-stream"]]


def test_a_mixed_batch_waits_for_the_producer_of_the_tensors_already_on_the_device(fake):
    """Regression: only the copied tensors were ordered after the producer; the ones already on
    the consumer's device were used on its stream without waiting for the producer's event."""
    from torchpipe.copy import receive
    from torchpipe.microbatch import Batch

    stream, copy_stream, event = FakeStream("consumer"), FakeStream("copy"), FakeEvent("ready")
    batch = Batch((torch.randn(2, 4, device="meta"), torch.randn(2, 4)))
    moved = receive(batch, event, META, stream, lambda device: copy_stream)
    assert [t.device for t in moved.tensors()] == [META, META]
    assert ("wait_event", stream, event) in [c[1:] for c in fake.calls]
    assert ("wait_stream", stream, copy_stream) in [c[1:] for c in fake.calls]


class HostDrawingLayer(nn.Module):
    """A layer on the (fake) accelerator that draws its random numbers on the host."""

    def __init__(self, log):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, device="meta"))
        self.log = log

    def forward(self, x):
        self.log.append((torchpipe.is_recomputing(), torch.rand(3)))
        return x * self.weight


def test_host_random_numbers_of_an_accelerator_partition_are_replayed(fake):
    """torchgpipe replays the CPU generator for GPU partitions too: a recompute must redraw them."""
    fake.default_generator = lambda device: device_generator
    device_generator = torch.Generator()
    logs = [[], []]
    model = nn.Sequential(HostDrawingLayer(logs[0]), HostDrawingLayer(logs[1]))
    with Pipe(model, [1, 1], devices=["meta", "meta"], chunks=2, checkpoint="always") as pipe:
        pipe(torch.randn(4, 4, device="meta")).sum().backward()
    for log in logs:
        forward = [draw for recomputing, draw in log if not recomputing]
        recompute = [draw for recomputing, draw in log if recomputing]
        assert len(forward) == len(recompute) == 2
        for again in recompute:
            assert any(torch.equal(again, first) for first in forward), "the recompute drew other host numbers"


# ------------------------------------------------------------------ tensors nested in a batch
class ForkNested(nn.Module):
    """``x -> (x, (2x, [x + 1]), 'tag')``: an LSTM-like output whose state sits in a tuple and a list."""

    def forward(self, x):
        return x, (x * 2, [x + 1]), "tag"


class ReadNested(nn.Module):
    """Records where the nested tensors arrived (and on which worker); returns the sum of the
    tensors on the top-level one's device."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, batch):
        x, (doubled, [plus_one]), tag = batch
        self.seen.append((threading.current_thread().name, tag, type(batch[1][1]),
                          [t.device for t in (x, doubled, plus_one)]))
        return x + doubled.to(x.device) + plus_one.to(x.device)


def _records_by(fake, thread, stream):
    return [c for c in fake.of("record_stream") if c[0] == thread and c[3] is stream]


def test_tensors_nested_on_the_cpu_stay_there_when_the_batch_moves(fake, no_cpu_record_stream):
    """Only the top-level tensor goes to the accelerator: a nested CPU tensor may have to stay
    (pack_padded_sequence's lengths), and the consumer can move one itself safely."""
    reader = ReadNested()
    with Pipe(nn.Sequential(ForkNested(), reader), [1, 1], devices=["cpu", "meta"], chunks=2,
              checkpoint="never") as pipe:
        consumer = pipe._workers[1]
        out = pipe(torch.randn(6, 4))
    assert out.device == META and out.shape == (6, 4)
    cpu = torch.device("cpu")
    assert reader.seen == [(consumer.name, "tag", list, [META, cpu, cpu])] * 2
    assert len(_records_by(fake, consumer.name, consumer.stream)) == 2  # the top-level tensor, never a CPU one


def test_tensors_nested_in_a_tuple_are_fenced_on_the_consumers_stream_on_one_device(fake, no_cpu_record_stream):
    """Regression: only top-level tensors were record_stream'ed. On one device nothing is
    copied, but the consumer's stream reads the nested tensors too: without record_stream the
    allocator could hand their memory to the producer's stream while the consumer's kernels
    still read it."""
    reader = ReadNested()
    model = nn.Sequential(nn.Linear(4, 4), ForkNested(), reader)
    with Pipe(model, [2, 1], devices=["meta", "meta"], chunks=3, checkpoint="never") as pipe:
        consumer = pipe._workers[1]
        pipe(torch.randn(6, 4, device="meta"))
    assert reader.seen == [(consumer.name, "tag", list, [META] * 3)] * 3
    assert len(_records_by(fake, consumer.name, consumer.stream)) == 3 * 3


def test_tensors_nested_in_the_output_are_fenced_on_the_callers_stream(fake, no_cpu_record_stream):
    model = nn.Sequential(nn.Linear(4, 4), ForkNested())
    caller = threading.current_thread().name
    with Pipe(model, [1, 1], devices=["meta", "meta"], chunks=1, checkpoint="never") as pipe:
        out, (doubled, [plus_one]), tag = pipe(torch.randn(2, 4, device="meta"))
    assert tag == "tag" and doubled.device == plus_one.device == META
    assert len(_records_by(fake, caller, fake.default_stream)) == 3


def test_a_nested_accelerator_tensor_is_copied_after_its_producer(fake, monkeypatch):
    """Regression: a nested tensor on an accelerator reached a partition on another device as
    it was. The consumer could only move it on its own thread's streams, unordered with the
    producer's stream; ``receive`` copies it on the copy stream that waited for the producer."""
    from torchpipe.copy import receive

    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):  # meta has no data to copy out: stand in zeros of its shape
        target = torch.device(args[0] if args else kwargs["device"])
        if self.device == META and target.type == "cpu":
            return torch.zeros(self.shape, dtype=self.dtype)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    source_copy, event = FakeStream("source copy"), FakeEvent("ready")
    lengths = torch.tensor([3, 2])
    kept = [torch.randn(2)]  # nothing to move in it: the consumer gets this very list
    batch = Batch((torch.randn(2, 4, device="meta"), (torch.randn(1, 2, 4, device="meta"), lengths), kept))
    moved = receive(batch, event, torch.device("cpu"), None, lambda device: source_copy)
    out, (h, lengths_after), kept_after = moved.value
    assert out.device.type == h.device.type == "cpu" and h.shape == (1, 2, 4)
    assert lengths_after is lengths and kept_after is kept
    assert ("wait_event", source_copy, event) in [c[1:] for c in fake.calls]
    assert len([c for c in fake.of("record_stream") if c[3] is source_copy]) == 2  # what the copies read


def test_a_list_handed_on_without_tensors_to_move_is_the_same_list(fake):
    """Regression: a cross-device hand-off rebuilt every nested container, so a list the next
    partition appended to was a copy, and the caller never saw the appends."""

    class Appends(nn.Module):
        def forward(self, batch):
            x, log = batch
            log.append("ran")
            return x

    log = []
    with Pipe(nn.Sequential(nn.Identity(), Appends()), [1, 1], devices=["cpu", "meta"], chunks=2,
              checkpoint="never", batch_dim=(0, None), output_batch_dim=0) as pipe:
        pipe((torch.randn(4, 4), log))
    assert log == ["ran", "ran"]


def test_a_cpu_partition_receives_nested_accelerator_tensors_through_a_copy(fake, no_cpu_record_stream):
    """A CPU stage skips ``receive`` when nothing needs moving; a nested accelerator tensor does."""
    from torchpipe.lowering import needs_receive

    class CPUStage:
        on_cpu = True

    nested = Batch((torch.randn(2), (torch.randn(2, device="meta"),)))
    assert needs_receive(CPUStage(), nested, None)
    assert not needs_receive(CPUStage(), Batch((torch.randn(2), (torch.randn(2),), "tag")), None)


def test_a_registered_type_torch_does_not_know_says_what_is_missing():
    """Review (s33): a backend registered for a type torch does not know (its library not
    imported) got the generic "expected e.g. 'cpu', 'cuda:0' or 'npu:0'"."""
    with use_backend("mydev", Backend()):
        with pytest.raises(ValueError, match="torchpipe has a backend for 'mydev', but torch does not know"):
            as_device("mydev:0")
    with pytest.raises(ValueError, match="expected e.g. 'cpu', 'cuda:0' or 'npu:0'"):
        as_device("mydev:0")
