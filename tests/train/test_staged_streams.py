"""StagedPipeline on an accelerator: each stage's stream waits for the one that made its input.

A fake backend (tests/test_devices.py) records every stream call; the stages themselves do
plain Python work, so what is checked is the protocol: the consumer's stream waits on the
producer's event before the stage runs, the input's memory is recorded on the consumer's
stream, and the caller's stream waits for the last stage before ``progress`` returns.
"""
import threading
import time

import pytest
import torch
from test_devices import FakeBackend

from torchpipe.devices import use_backend
from torchpipe.train import PipelineStage, StagedPipeline


@pytest.fixture
def fake():
    backend = FakeBackend()
    with use_backend("meta", backend):
        yield backend


def _stage(fake, name, log):
    def run(value):
        log.append((name, value[0], fake.current_stream(torch.device("meta"))))
        return (value[0], torch.empty(2, device="meta"))
    return run


def test_each_stage_waits_for_its_inputs_producer_and_the_caller_for_the_last(fake):
    log = []
    stages = [PipelineStage("h2d", _stage(fake, "h2d", log), "copy"),
              PipelineStage("dist", _stage(fake, "dist", log), "host"),
              PipelineStage("train", _stage(fake, "train", log), "device")]
    batches = iter([(b, torch.empty(2, device="meta")) for b in range(4)])
    with StagedPipeline(stages, device="meta", host_threads=1) as pipeline:
        outputs = []
        while True:
            before = len(fake.calls)
            try:
                outputs.append(pipeline.progress(batches))
            except StopIteration:
                break
            # The caller's stream (this thread's: the default one) waits for the last stage.
            mine = [c for c in fake.calls[before:] if c[0] == threading.current_thread().name]
            waited = [c[3] for c in mine if c[1] == "wait_event"]
            train_events = [c[2] for c in fake.calls[before:] if c[1] == "record_event" and c[0].endswith("compute")]
            assert train_events and train_events[-1] in waited
    assert [o[0] for o in outputs] == [0, 1, 2, 3]
    by_thread = {}
    for thread, kind, *rest in fake.calls:
        by_thread.setdefault(thread, []).append((kind, *rest))
    recorded = {c[2]: (c[0], c[3]) for c in fake.calls if c[1] == "record_event"}  # event -> (thread, stream)
    for consumer, producer in (("host0", "copy"), ("compute", "host0")):
        thread = next(t for t in by_thread if t.endswith(consumer))
        waits = [rest for kind, *rest in by_thread[thread] if kind == "wait_event"]
        # One wait per batch, each on an event the producer recorded on its own stream.
        producer_waits = [e for stream, e in waits if recorded[e][0].endswith(producer)]
        assert len(producer_waits) == 4, (consumer, waits)
        # On the consumer's own stream: the compute worker's, a host thread's default one.
        assert {stream.name for stream, _ in waits} == ({"default"} if consumer == "host0" else {"s0"})
        # The input's memory is recorded on the consumer's stream.
        assert sum(1 for kind, *rest in by_thread[thread] if kind == "record_stream") >= 4
    # The first stage waits for what the caller queued before admitting the batch.
    copy_thread = next(t for t in by_thread if t.endswith("copy"))
    copy_waits = [rest[1] for kind, *rest in by_thread[copy_thread] if kind == "wait_event"]
    assert len(copy_waits) == 4 and all(recorded[e][0] == threading.current_thread().name for e in copy_waits)


def test_a_cpu_pipeline_asks_for_no_events():
    stages = [PipelineStage("a", lambda b: b + 1, "copy"), PipelineStage("b", lambda b: b * 2, "device")]
    with StagedPipeline(stages, host_threads=0) as pipeline:
        assert pipeline._streamed is False
        assert pipeline.flush() == [] and pipeline.progress(iter([1])) == 4


def test_host_side_jagged_tensors_are_not_recorded_on_a_device_stream(fake):
    # The first stage's input is the dataloader's host batch: a KJT on the CPU has
    # record_stream too, which the CPU backend cannot run.
    kjt_module = pytest.importorskip("torchrec.sparse.jagged_tensor")
    kjt = kjt_module.KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([1, 2, 3]), torch.tensor([1, 2]))
    stages = [PipelineStage("h2d", lambda b: (b["id"], torch.empty(2, device="meta")), "copy"),
              PipelineStage("train", lambda v: v, "device")]
    with StagedPipeline(stages, device="meta", host_threads=0) as pipeline:
        outputs = [pipeline.progress(iter([{"id": 0, "sparse": kjt}]))]
    assert outputs[0][0] == 0


def test_a_stage_calling_its_own_pipeline_is_refused_not_a_deadlock():
    from torchpipe import HostPool

    pool = HostPool(1)
    refused = []

    def stage_b(value):
        for call in (lambda: pipeline.progress(iter([100])), pipeline.flush, pipeline.close,
                     lambda: pool.submit(pipeline.progress, iter([100])).result(10)):
            try:
                call()
            except RuntimeError as exc:
                refused.append("own pipeline" in str(exc))
        return value

    pipeline = StagedPipeline([PipelineStage("a", lambda v: v, "copy"), PipelineStage("b", stage_b, "device")])
    try:
        assert pipeline.progress(iter([1, 2])) == 1
        assert refused == [True] * 4
        assert pipeline.flush() == [2]
    finally:
        pipeline.close()
        pool.close()


def test_work_a_later_clock_of_the_same_call_waits_on_is_refused():
    """One progress() call runs several clocks: a host task a stage started in one of them
    may be waited on by the next, so it may not call progress() either."""
    from torchpipe import HostPool

    pool = HostPool(1)
    seen = []

    def task():
        time.sleep(0.2)  # the clock that started it has ended
        try:
            pipeline.progress(iter([100]))
            seen.append("not refused")
        except RuntimeError as exc:
            seen.append("refused" if "own pipeline" in str(exc) else repr(exc))

    def stage_a(value):
        return pool.submit(task) if value == 1 else None

    def stage_b(future):
        if future is not None:
            future.result(timeout=10)
        return future

    pipeline = StagedPipeline([PipelineStage("a", stage_a, "copy"), PipelineStage("b", stage_b, "device")])
    try:
        pipeline.progress(iter([1, 2]))
        assert seen == ["refused"]
    finally:
        pipeline.close()
        pool.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("caller", ["admit", "after_clock", "data iterator"])
def test_the_thread_inside_progress_calling_back_is_refused_or_closes_after_the_call(caller):
    # Callbacks and the data iterator run on the caller's thread while progress() holds the
    # pipeline: calling progress()/flush() from there deadlocked on that lock, and so did
    # close() (a signal handler's too). progress()/flush() are refused; close() waits for
    # the call to end.
    seen = []

    def call_back(batch):
        if batch != 1:
            return
        for call in (lambda: pipeline.progress(iter([100])), pipeline.flush):
            try:
                call()
                seen.append("ran")
            except RuntimeError as exc:
                seen.append("inside this pipeline's progress()" in str(exc))
        pipeline.close()
        seen.append("close returned")

    def data():
        for batch in range(4):
            if caller == "data iterator":
                call_back(batch)
            yield batch

    options = {}
    if caller == "admit":
        options["admit"] = call_back
    elif caller == "after_clock":
        options["after_clock"] = lambda clock, outputs: call_back(1) if clock.index == 1 else None
    pipeline = StagedPipeline([PipelineStage("a", lambda v: v, "copy"), PipelineStage("b", lambda v: v, "device")],
                              **options)
    threads = [worker._thread for worker in pipeline._workers]
    batches = data()
    first = pipeline.progress(batches)  # the call during which close() was asked for still ends
    assert first == 0 and seen == [True, True, "close returned"]
    with pytest.raises(RuntimeError, match="closed"):
        pipeline.progress(batches)
    assert not any(thread.is_alive() for thread in threads)  # closed when that call returned


def test_after_a_failed_clock_the_callers_stream_waits_for_the_device_streams(fake):
    """Review (s33): only a clock that succeeded ordered the caller's stream after the device
    streams; after a failed one, what the caller did next (save, flush) could overtake work
    still queued on them (the rows a failed rec step puts back, say)."""
    failing = [False]

    def train(value):
        if failing[0]:
            raise ValueError("train failed after queueing device work")
        return value

    stages = [PipelineStage("h2d", lambda b: torch.empty(2, device="meta"), "copy"),
              PipelineStage("train", train, "device")]
    with StagedPipeline(stages, device="meta", host_threads=0) as pipeline:
        batches = iter(range(10))
        pipeline.progress(batches)
        pipeline.progress(batches)
        failing[0] = True
        before = len(fake.calls)
        with pytest.raises(ValueError, match="train failed"):
            pipeline.progress(batches)
        me = threading.current_thread().name
        waited = {c[3] for c in fake.calls[before:] if c[0] == me and c[1] == "wait_stream"}
        assert waited >= {stream for _, stream in pipeline.device_streams()}, fake.calls[before:]


def test_a_train_pipelines_batch_is_recorded_through_the_backend(fake, monkeypatch):
    """Review (s33): TrainPipelineBase called Tensor.record_stream on the batch's device copy
    itself, with the backend's stream object: a backend whose streams are not torch's (a
    vendor's, this fake) failed with "unknown parameter type"."""
    from torch import nn

    from torchpipe.train import TrainPipelineBase

    direct = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: direct.append(stream))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 1, device="meta")

        def forward(self, batch):
            out = self.linear(batch)
            return out.sum(), out

    model = Model()
    with TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.1), device="meta") as pipeline:
        pipeline.progress(iter([torch.randn(2, 4), torch.randn(2, 4)]))
    assert direct == []
    assert any(c[1] == "record_stream" and c[2] == torch.device("meta") for c in fake.calls), fake.calls
