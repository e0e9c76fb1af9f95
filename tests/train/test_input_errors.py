"""Bad constructor arguments of the train pipelines: a clear exception of the right type, naming
the argument, raised before any thread starts and before the collection is claimed or hooked."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from thread_helpers import pretend_cores
from torch import nn
from train_helpers import assert_same_outputs, build, drain, make_batches, make_tables, reference_run, window_minimum

from torchpipe.devices import BackendUnavailableError
from torchpipe.rec import SGD
from torchpipe.train import (EmbCacheTrainPipeline, PipelineStage, StagedPipeline, TrainPipelineBase,
                             TrainPipelineSparseDist, schedule_table)

pytestmark = pytest.mark.timeout(60)

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
KINDS = ["staged", "base", "sparse_dist", "emb_cache"]


def construct(kind: str, **kwargs):
    """Build a pipeline of ``kind`` with ``kwargs``; returns the collection it would hook (or None)."""
    if kind == "staged":
        StagedPipeline([PipelineStage("a", lambda x: x, "host"), PipelineStage("b", lambda x: x)], **kwargs)
        return None
    if kind == "emb_cache":
        model, opt = build(make_tables(), 16, SGD(lr=0.5))
        collection = model.ebc
        try:
            EmbCacheTrainPipeline(model, opt, **kwargs)
        finally:
            # Refused before the collection was hooked: it is untouched and free for a pipeline.
            assert not collection._forward_pre_hooks and not collection._forward_hooks
            assert collection.in_flight() == 0
        return collection
    model, opt = build(make_tables(), None, SGD(lr=0.5), cached=False)
    pipeline = TrainPipelineBase if kind == "base" else TrainPipelineSparseDist
    pipeline(model, opt, **kwargs)
    return None


def refused(kind: str, error: type, words: str, **kwargs) -> None:
    before = set(threading.enumerate())
    with pytest.raises(error, match=words):
        construct(kind, **kwargs)
    started = [t.name for t in set(threading.enumerate()) - before]
    assert not started, f"threads started before the refusal: {started}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value, error", [(-1, ValueError), (0, ValueError), ("2", TypeError), (2.5, TypeError)])
def test_device_threads_must_be_a_positive_int_or_none(kind: str, value, error: type) -> None:
    refused(kind, error, f"device_threads must be a positive int or None, got {value!r}", device_threads=value)


@pytest.mark.parametrize("kind", KINDS)
def test_device_threads_above_the_cores_is_refused(kind: str, monkeypatch) -> None:
    pretend_cores(monkeypatch, 2)
    refused(kind, ValueError, r"device_threads must be at most the 2 cores this process may run on .*got 3",
            device_threads=3)


@pytest.mark.parametrize("kind", ["staged", "sparse_dist", "emb_cache"])
@pytest.mark.parametrize("value, error", [(-1, ValueError), ("1", TypeError), (1.0, TypeError)])
def test_host_threads_must_be_an_int_of_at_least_zero(kind: str, value, error: type) -> None:
    refused(kind, error, f"host_threads must be an int >= 0, got {value!r}", host_threads=value)


@pytest.mark.parametrize("kind", ["staged", "emb_cache"])
@pytest.mark.parametrize("value, error", [(-1, ValueError), ("3", TypeError), (2.5, TypeError)])
def test_keep_records_is_checked_before_the_workers_start(kind: str, value, error: type) -> None:
    refused(kind, error, f"keep_records must be an int >= 0, got {value!r}", keep_records=value)


@pytest.mark.parametrize("kind", ["staged", "emb_cache"])
def test_counts_of_numpy_and_tensor_integer_types_are_accepted(kind: str) -> None:
    """Review (helper-143): keep_records=np.int64(2) passed the check, then failed in deque()
    with "an integer is required" after the threads had started."""
    import numpy
    import torch

    for value in (numpy.int64(2), torch.tensor(2)):
        construct(kind, keep_records=value, host_threads=numpy.int64(3), device_threads=numpy.int64(1))


@pytest.mark.parametrize("kind", ["staged", "emb_cache"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_overlap_must_be_a_bool(kind: str, value) -> None:
    refused(kind, TypeError, f"overlap must be a bool, got {value!r}", overlap=value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device, error, words", [
    ("npu:0", BackendUnavailableError, "device type 'npu' needs the package 'torch_npu'"),
    pytest.param("cuda:0", BackendUnavailableError, "'cuda:0' was requested but no cuda device", marks=NO_CUDA),
    ("gpu", ValueError, "invalid device 'gpu'"),
])
def test_device_is_resolved_like_pipes(kind: str, device: str, error: type, words: str) -> None:
    refused(kind, error, words, device=device)


@pytest.mark.parametrize("kind", ["base", "sparse_dist", "emb_cache"])
def test_model_and_optimizer_are_checked(kind: str) -> None:
    pipeline = {"base": TrainPipelineBase, "sparse_dist": TrainPipelineSparseDist,
                "emb_cache": EmbCacheTrainPipeline}[kind]
    before = set(threading.enumerate())
    with pytest.raises(TypeError, match="model must be callable as losses, output = model.batch. .*got NoneType"):
        pipeline(None, None)
    model, _ = build(make_tables(), 16, SGD(lr=0.5), cached=kind == "emb_cache")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer .*got str"):
        pipeline(model, "sgd")
    if kind == "emb_cache":  # the collection is looked up among the model's modules
        with pytest.raises(TypeError, match="not an nn.Module whose modules hold .*pass collection="):
            pipeline(lambda batch: model(batch), None)
    assert not set(threading.enumerate()) - before


@pytest.mark.parametrize("kind", ["base", "emb_cache"])
def test_a_plain_callable_model_trains(kind: str) -> None:
    """Only nn.Module models were accepted after the argument checks came in; a function
    calling the model is what the pipelines call too."""
    tables = make_tables()
    batches = make_batches(tables, 4, seed=2)
    model, opt = build(tables, 40, SGD(lr=0.5), cached=kind == "emb_cache")
    reference, ref_opt, ref_outputs = reference_run(tables, batches, SGD(lr=0.5))
    extra = {"collection": model.ebc} if kind == "emb_cache" else {}
    pipeline = TrainPipelineBase if kind == "base" else EmbCacheTrainPipeline
    with pipeline(lambda batch: model(batch), opt, **extra) as pipe:
        outputs = drain(pipe, iter(batches))
    assert len(outputs) == 4
    for (loss, _), (ref_loss, _) in zip(outputs, ref_outputs):
        assert torch.equal(loss, ref_loss)


@pytest.mark.parametrize("collection", [nn.Linear(1, 1), "ebc"])
def test_emb_cache_collection_must_be_a_cached_collection(collection) -> None:
    refused("emb_cache", TypeError, "collection must be a CachedEmbeddingBagCollection or None .*got "
            + type(collection).__name__, collection=collection)


@pytest.mark.parametrize("sharding", [["t0", "t1"], "table-wise"])
def test_emb_cache_sharding_must_be_a_table_wise_sharding(sharding) -> None:
    """Review: a list failed with an AttributeError, after the collection had been claimed."""
    refused("emb_cache", TypeError, "sharding must be a torchpipe.train.dist.TableWiseSharding or None, got "
            + type(sharding).__name__, sharding=sharding)


def test_callbacks_must_be_callable() -> None:
    refused("sparse_dist", TypeError, "input_dist must be callable or None, got 3", input_dist=3)
    refused("staged", TypeError, "admit must be callable or None, got 'x'", admit="x")
    refused("staged", TypeError, "on_failure must be callable or None, got 1", on_failure=1)
    refused("staged", TypeError, "before_call must be callable or None, got 1", before_call=1)


@pytest.mark.parametrize("value, error", [("3", TypeError), (None, TypeError), (2.5, TypeError), (-1, ValueError)])
def test_schedule_table_needs_a_batch_count(value, error: type) -> None:
    words = f"num_batches must be an int >= 0, got {value!r}"
    with pytest.raises(error, match=words):
        schedule_table(["a", "b"], ["copy", "compute"], value)
    with StagedPipeline([PipelineStage("a", lambda x: x)], host_threads=0, device_threads=1) as pipeline:
        with pytest.raises(error, match=words):
            pipeline.schedule_table(value)
        assert "StopIteration" in pipeline.schedule_table(0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("given", [None, [1, 2], 3])
def test_progress_takes_an_iterator(kind: str, given) -> None:
    # None used to read as "no more batches": a loop given it ended after 0 steps, silently.
    tables = make_tables()
    if kind == "staged":
        pipeline = StagedPipeline([PipelineStage("a", lambda x: x, "host"), PipelineStage("b", lambda x: x)])
    elif kind == "emb_cache":
        model, opt = build(tables, 16, SGD(lr=0.5))
        pipeline = EmbCacheTrainPipeline(model, opt)
    else:
        model, opt = build(tables, None, SGD(lr=0.5), cached=False)
        pipeline = (TrainPipelineBase if kind == "base" else TrainPipelineSparseDist)(model, opt)
    with pipeline:
        with pytest.raises(TypeError, match=rf"progress\(\) takes an iterator of batches \(iter\(dataloader\)\), "
                                            rf"got {type(given).__name__}: {re.escape(repr(given))}"):
            pipeline.progress(given)
        if kind == "staged":
            assert pipeline.progress(iter([5])) == 5  # nothing was admitted or remembered
        else:
            assert len(drain(pipeline, iter(make_batches(tables, 2)))) == 2


def test_schedule_table_needs_a_worker_per_stage() -> None:
    with pytest.raises(ValueError, match=r"one worker per stage: 3 stage names \['h2d', 'plan', 'train'\] but 1 "
                                         r"workers \['copy'\]"):
        schedule_table(["h2d", "plan", "train"], ["copy"], 1)
    from torchpipe.train.schedule import ClockSchedule

    with pytest.raises(TypeError, match="depth must be an int .*got '3'"):
        ClockSchedule("3")


class _Unmovable:
    """A batch with the fields a model reads but no ``.to()``: the copy stage could not move it."""

    def __init__(self, batch) -> None:
        self.dense_features, self.sparse_features, self.labels = (batch.dense_features, batch.sparse_features,
                                                                  batch.labels)


@pytest.mark.parametrize("kind", ["base", "sparse_dist", "emb_cache"])
def test_a_batch_without_to_is_refused_at_admission_and_the_batches_in_flight_are_kept(kind: str) -> None:
    # Review: it passed admission and failed on the copy worker with an AttributeError, after
    # the pipeline had taken it and the batch behind it.
    tables = make_tables()
    batches = make_batches(tables, 10, seed=3)
    if kind == "emb_cache":
        model, opt = build(tables, window_minimum(tables, batches), SGD(lr=0.5))
        pipe = EmbCacheTrainPipeline(model, opt, host_threads=2, device_threads=1)
    else:
        model, opt = build(tables, None, SGD(lr=0.5), cached=False)
        pipeline = TrainPipelineBase if kind == "base" else TrainPipelineSparseDist
        pipe = pipeline(model, opt, device_threads=1)
    with pipe:
        fed = batches[:6] + [_Unmovable(batches[6])] + batches[6:]
        it, outputs = iter(fed), []
        with pytest.raises(TypeError, match=r"a batch must have \.to\(device, non_blocking=\.\.\.\).*got _Unmovable"):
            while True:
                in_flight = pipe.pipeline.in_flight()
                outputs.append(pipe.progress(it))
        assert outputs and pipe.pipeline.in_flight() == in_flight  # refused before it entered
        outputs += drain(pipe, it)
    _, _, ref_outputs = reference_run(tables, batches, SGD(lr=0.5))
    assert_same_outputs(outputs, ref_outputs)
