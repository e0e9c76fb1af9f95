"""A ready pipeline dropped without close() goes at once, by reference counting alone.

Its stages must reach it weakly: before, TrainPipelineBase / TrainPipelineSparseDist built
them from a lambda and bound methods holding the pipeline, a cycle with its StagedPipeline,
so a dropped pipeline kept its worker threads and its in-flight batch until the cycle
collector ran (never, with gc disabled: 200 dropped pipelines left 400 threads running).
EmbCacheTrainPipeline, which always reached itself weakly, is the control.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import weakref

import pytest
from thread_helpers import torchpipe_threads, wait_until_gone
from train_helpers import build, make_batches, make_tables, window_minimum

from torchpipe.rec import SGD, Adam, RowWiseAdagrad
from torchpipe.train import (EmbCacheTrainPipeline, PipelineStage, StagedPipeline, TrainPipelineBase,
                             TrainPipelineSparseDist)

pytestmark = pytest.mark.timeout(60)


def make_pipeline(kind: str, tables, batches):
    if kind == "base":
        model, opt = build(tables, None, RowWiseAdagrad(lr=0.5), cached=False)
        return TrainPipelineBase(model, opt, device_threads=1)
    if kind == "sparse_dist":
        model, opt = build(tables, None, RowWiseAdagrad(lr=0.5), cached=False)
        return TrainPipelineSparseDist(model, opt, input_dist=lambda batch: batch, device_threads=1)
    model, opt = build(tables, window_minimum(tables, batches), Adam(lr=0.5))
    return EmbCacheTrainPipeline(model, opt, host_threads=3, device_threads=1)


@pytest.mark.parametrize("kind", ["base", "sparse_dist", "emb_cache"])
def test_a_pipeline_dropped_without_close_is_freed_at_once_with_its_threads_and_batches(kind: str) -> None:
    tables = make_tables()
    batches = make_batches(tables, 8, seed=6)
    taken = [weakref.ref(batch.dense_features) for batch in batches]
    # Handed over one by one and not kept: the batches the pipeline took are held by it alone.
    it = (batches.pop(0) for _ in range(len(batches)))
    before = torchpipe_threads()
    pipe = make_pipeline(kind, tables, batches)
    started = torchpipe_threads() - before
    assert len(started) == {"base": 2, "sparse_dist": 3, "emb_cache": 5}[kind]
    pipe.progress(it)
    pipe.progress(it)
    assert pipe.steps_done == 2
    in_flight = taken[2:len(taken) - len(batches)]  # admitted, not trained yet
    assert in_flight and all(ref() is not None for ref in in_flight)
    dropped = weakref.ref(pipe)
    gc.disable()  # so only reference counting can free it (checked before gc runs again)
    try:
        del pipe
        assert dropped() is None, "a pipeline dropped without close() was kept alive by a reference cycle"
        assert not wait_until_gone(started, timeout=2.0), "a dropped pipeline left its threads running"
        assert all(ref() is None for ref in taken[:len(taken) - len(batches)]), "a dropped pipeline's batch lives on"
    finally:
        gc.enable()
        gc.collect()  # a failed run must not leave its threads to the next tests


@pytest.mark.parametrize("kind", ["emb_cache", "base", "staged", "host_pool"])
@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy, pickle.dumps], ids=["copy", "deepcopy", "pickle"])
def test_an_object_that_runs_threads_refuses_copies_saying_why(kind: str, copier) -> None:
    # Review (s30): "cannot pickle '_thread.lock' object", "Can't pickle local object '_weakly...'".
    from torchpipe.workers import HostPool

    tables = make_tables()
    if kind == "emb_cache":
        model, opt = build(tables, 16, SGD(lr=0.5))
        owner = EmbCacheTrainPipeline(model, opt)
    elif kind == "base":
        owner = TrainPipelineBase(*build(tables, None, SGD(lr=0.5), cached=False))
    elif kind == "staged":
        owner = StagedPipeline([PipelineStage("a", lambda x: x)])
    else:
        owner = HostPool(1)
    try:
        threads = threading.active_count()
        with pytest.raises(TypeError, match=f"this {type(owner).__name__} cannot be copied or pickled: it runs "
                                            "worker threads; (copy or save its model|build a new one)"):
            copier(owner)
        assert threading.active_count() == threads
    finally:
        owner.close()


@pytest.mark.parametrize("where", ["hand_back", "defer_swaps", "end_left_behind"])
def test_a_close_cut_short_by_ctrl_c_finishes_when_called_again(monkeypatch, where: str) -> None:
    # Review (s30): the finalizer counted as run before its hand-back finished, and the workers'
    # finalizer let go before they were asked to stop: a second close() (a with block's exit)
    # returned at once, the collection refused every flush and save, and threads ran on.
    import torchpipe.runtime
    import torchpipe.train.pipelines
    from train_helpers import assert_same_state, reference_run

    owners = {"hand_back": torchpipe.train.pipelines._InFlight,
              "defer_swaps": torchpipe.rec.CachedEmbeddingBagCollection,
              "end_left_behind": torchpipe.runtime.Runtime}
    original, calls = getattr(owners[where], where), []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt(f"Ctrl-C in {where}")
        return original(*args, **kwargs)

    tables = make_tables()
    batches = make_batches(tables, 10, seed=7)
    model, opt = build(tables, window_minimum(tables, batches), Adam(lr=0.5))
    before = torchpipe_threads()
    pipe = EmbCacheTrainPipeline(model, opt, host_threads=2, device_threads=1)
    it = iter(batches)
    for _ in range(6):
        pipe.progress(it)
    assert pipe.pipeline.in_flight()  # batches planned, some swapped: the close must hand them back
    ours = torchpipe_threads() - before
    monkeypatch.setattr(owners[where], where, interrupted_once)
    with pytest.raises(KeyboardInterrupt, match=where):
        pipe.close()
    pipe.close()
    assert calls, "the injection point was not reached"
    assert not wait_until_gone(ours)
    model.ebc.flush()  # refused while keys stayed protected
    reference, _, _ = reference_run(tables, batches, Adam(lr=0.5), steps=pipe.steps_done)
    assert_same_state(model, reference)


def test_a_close_that_gave_up_waiting_and_the_call_it_left_release_each_batch_once() -> None:
    """Review: close() from another thread gives up on a call after STOP_TIMEOUT_S and hands the
    batches in flight back, while that call may be releasing its trained batches: both saw a
    plan unreleased, and one raised "swap plan ... released twice". The two paths are raced here
    directly: the call's release starts, and the hand-back meets it while each table's release
    is slowed down, so that both paths pass their checks before either releases."""
    import time

    from torchpipe.rec import CachedEmbeddingBagCollection
    from torchpipe.train.pipelines import _InFlight, _Item

    tables = make_tables()
    batches = make_batches(tables, 4, seed=5)
    collection = CachedEmbeddingBagCollection(tables, window_minimum(tables, batches) * 2, optimizer=SGD(lr=0.1))
    for cache in collection.caches.values():
        def slow_release(plan, *args, _release=cache.release, **kwargs):
            time.sleep(0.002)  # the window between a check of plan.released and the release
            return _release(plan, *args, **kwargs)

        cache.release = slow_release
    errors: list = []
    for _ in range(20):
        in_flight = _InFlight(collection)
        for batch in batches[:1]:  # swapped in, as the pipeline's swap stage leaves it
            plan = collection.plan(collection.prepare(batch.sparse_features))
            collection.write_back(plan, collection.gather_out(plan))
            collection.scatter_in(plan, collection.fetch_in(plan))
            in_flight.add(_Item(batch, plan=plan, trained=True))
        start = threading.Barrier(2)

        def race(work) -> None:
            start.wait()
            try:
                work()
            except BaseException as exc:  # noqa: B902 - reported below
                errors.append(exc)

        def drop_all_soon_after() -> None:  # the call's release goes first, the hand-back meets it
            time.sleep(0.0005)
            in_flight.drop_all()

        threads = [threading.Thread(target=race, args=(work,)) for work in (in_flight.release_trained,
                                                                            drop_all_soon_after)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not errors, errors[0]
        assert collection.in_flight() == 0, collection.in_flight()


def test_a_close_that_gave_up_waiting_makes_the_call_raise_instead_of_hanging(monkeypatch) -> None:
    """Review (helper-143): close() on another thread gives up on a progress() call blocked in
    its data iterator after STOP_TIMEOUT_S and stops the workers; when the data came, the call
    queued its next clock on the stopped workers and never returned."""
    import time

    import torch

    import torchpipe.train.staged

    monkeypatch.setattr(torchpipe.train.staged, "STOP_TIMEOUT_S", 0.2)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x):
            y = self.linear(x)
            return y.pow(2).sum(), y.detach()

    release = threading.Event()

    def stream():
        for index in range(6):
            if index == 3:
                release.wait(10)  # a streaming source waiting for records
            yield torch.randn(2, 4)

    model = Model()
    pipe = TrainPipelineBase(model, torch.optim.SGD(model.parameters(), lr=0.1), device_threads=1)
    outcome: list = []

    def train() -> None:
        batches = stream()
        try:
            for _ in range(5):
                pipe.progress(batches)
            outcome.append("returned")
        except Exception as exc:  # noqa: B902 - the outcome is the test's
            outcome.append(f"{type(exc).__name__}: {exc}")

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    time.sleep(0.3)
    pipe.close()
    release.set()
    trainer.join(10)
    assert not trainer.is_alive(), "progress() waits forever on workers that close() stopped"
    assert len(outcome) == 1 and outcome[0].startswith("RuntimeError: this pipeline was closed on another thread")
