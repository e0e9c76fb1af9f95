"""Input dist across 2 local processes (gloo): table-wise key all-to-all, then the owner's
lookup and the output all-to-all equal the single-process lookup; training through
EmbCacheTrainPipeline with sharding equals single-process full-table training."""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from spawn_helpers import spawn_ranks

pytestmark = pytest.mark.timeout(90)

WORLD = 2
STEPS = 30


def concat_kjts(kjts):
    """One KJT holding the samples of ``kjts`` in order (the global batch), weights included."""
    from torchrec import KeyedJaggedTensor
    keys = kjts[0].keys()
    parts = [kjt[f] for f in keys for kjt in kjts]
    weighted = kjts[0].weights_or_none() is not None
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.cat([p.values() for p in parts]), torch.cat([p.lengths() for p in parts]),
        weights=torch.cat([p.weights().float() for p in parts]) if weighted else None)


def concat_samples(batches):
    """One batch holding the samples of ``batches`` in order (the global batch)."""
    from torchpipe.train import RecBatch
    return RecBatch(torch.cat([b.dense_features for b in batches]), concat_kjts([b.sparse_features for b in batches]),
                    torch.cat([b.labels for b in batches]))


def join(rank: int, init_file: str, tests_dir: str, timeout_s: Optional[float] = None) -> None:
    """A rank's set-up: the tests' helper modules importable, one intra-op thread, the gloo group."""
    sys.path.insert(0, tests_dir)
    sys.path.insert(0, os.path.join(os.path.dirname(tests_dir), "rec"))  # rec_helpers, as tests/conftest.py does
    torch.set_num_threads(1)
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, **timeout)


def run_ranks(worker, tmp_path, *args) -> None:
    """``worker(rank, init_file, tests_dir, *args)`` on every rank, each in a process of its own."""
    spawn_ranks(worker, str(tmp_path / "init"), os.path.dirname(os.path.abspath(__file__)), *args, nprocs=WORLD)


class SparseAndDense(torch.nn.Module):
    """Pooled embeddings plus a replicated dense layer; integer weights keep the sums exact."""

    def __init__(self, ebc, dense_in):
        super().__init__()
        self.ebc = ebc
        self.dense = torch.nn.Linear(dense_in, 1)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in self.dense.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=g).float())

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features).values()
        score = pooled.sum(dim=1) + self.dense(batch.dense_features).squeeze(1)
        loss = (score * batch.labels).sum()
        return loss, score.detach()


def own_samples(rank: int) -> slice:
    """This rank's samples in the global batch: rank r's batches hold 3 + r, in rank order."""
    lo = sum(3 + r for r in range(rank))
    return slice(lo, lo + 3 + rank)


def rank_batches(tables, steps: int, seed: int):
    """Every rank's ``steps`` batches (rank r's of 3 + r samples), and the global batches they make."""
    from train_helpers import make_batches
    per_rank = [make_batches(tables, steps, batch_size=3 + r, seed=seed + r) for r in range(WORLD)]
    return per_rank, [concat_samples([per_rank[r][i] for r in range(WORLD)]) for i in range(steps)]


def reference_training(tables, weights, batches, rank: int, evaluating: bool = False):
    """Single-process full-table training of the global ``batches`` (row SGD at lr 1, dense SGD at
    2**-6 on summed gradients: exact with the integer data), as the failure tests' pipelines train:
    the reference model, this rank's samples' output of every step, and the dense parameters after
    every step. ``evaluating``: forward-only steps of the model in eval mode."""
    from train_helpers import DENSE_IN

    from torchpipe.rec import SGD, FullTableEmbeddingBagCollection

    reference = SparseAndDense(FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0), weights=weights),
                               DENSE_IN)
    ref_opt = torch.optim.SGD(reference.dense.parameters(), lr=2.0 ** -6)
    reference.train(not evaluating)
    scores, dense = [], []
    for batch in batches:
        if evaluating:
            with torch.no_grad():
                score = reference(batch)[1]
        else:
            ref_opt.zero_grad()
            loss, score = reference(batch)
            loss.backward()
            ref_opt.step()
        scores.append(score[own_samples(rank)])
        dense.append([p.detach().clone() for p in reference.dense.parameters()])
    return reference, scores, dense


def failure_test_setup(output_timeout_s: Optional[float] = None) -> SimpleNamespace:
    """What the train-failure tests share: tables, a sharding with an output group of its own
    (``output_timeout_s``: that group's timeout), every rank's 10 batches and 6 more (``before``,
    ``after``, and the global batches they make), integer weights, and this rank's collection,
    its cache as small as 3 consecutive global batches allow."""
    from train_helpers import integer_weights, make_tables, window_minimum

    from torchpipe.rec import SGD, CachedEmbeddingBagCollection
    from torchpipe.train import TableWiseSharding

    timeout = {} if output_timeout_s is None else {"timeout": datetime.timedelta(seconds=output_timeout_s)}
    tables = make_tables()
    sharding = TableWiseSharding(tables, output_group=dist.new_group(list(range(WORLD)), **timeout))
    mine = sharding.local_tables
    before, global_before = rank_batches(tables, 10, seed=70)
    after, global_after = rank_batches(tables, 6, seed=80)
    weights = integer_weights(tables)
    ebc = CachedEmbeddingBagCollection(mine, window_minimum(mine, global_before + global_after),
                                       optimizer=SGD(lr=1.0), weights=weights)
    return SimpleNamespace(tables=tables, sharding=sharding, mine=mine, before=before, after=after,
                           global_before=global_before, global_after=global_after, weights=weights, ebc=ebc)


def progress_until_it_fails(pipe, batches, outputs: list) -> Optional[Exception]:
    """``pipe.progress`` over ``batches``, each output appended to ``outputs``, until a call
    raises: that error (None if the batches ran out first)."""
    it = iter(batches)
    while True:
        try:
            outputs.append(pipe.progress(it))
        except StopIteration:
            return None
        except Exception as exc:  # noqa: BLE001 - the caller checks it
            return exc


def assert_same_state(rank: int, ebc, model, reference) -> None:
    """This rank's tables (flushed) and dense replica equal the reference's, bitwise."""
    ebc.flush()
    for name in ebc.hosts:
        assert torch.equal(ebc.full_weight(name), reference.ebc.full_weight(name)), f"rank {rank}: {name} differs"
    for got, want in zip(model.dense.parameters(), reference.dense.parameters()):
        assert torch.equal(got, want), f"rank {rank}: dense parameters differ"


def lookups_train_as_in_one_process(rank: int, sharding, ebc, full, local_kjts, global_kjts,
                                    expected_keys=None) -> None:
    """Sharded lookups of this rank's ``local_kjts``, each followed by a backward, equal
    ``full``'s lookups of the ``global_kjts``: every step's output, then the owned rows."""
    mine = own_samples(rank)
    for step, (local, whole) in enumerate(zip(local_kjts, global_kjts)):
        got = sharding.lookup(ebc, local)
        want = full(whole)
        assert got.keys() == want.keys() == (expected_keys or want.keys()), got.keys()
        assert torch.equal(got.values(), want.values()[mine]), f"rank {rank}: step {step} differs"
        g = torch.Generator().manual_seed(step)
        coefficients = torch.randint(-2, 3, want.values().shape, generator=g).float()
        (got.values() * coefficients[mine]).sum().backward()  # the owners' rows get every rank's grads
        (want.values() * coefficients).sum().backward()
    ebc.flush()
    for t in sharding.local_tables:
        assert torch.equal(ebc.full_weight(t.name), full.full_weight(t.name)), f"rank {rank}: {t.name} differs"


def train_through_the_pipeline(rank: int, sharding, tables, per_rank, global_batches) -> None:
    """EmbCacheTrainPipeline with ``sharding`` (a small LFU cache) on every rank == the
    single-process full-table loop over the global batches: each rank's outputs, its tables'
    rows, and the dense replica. A batch one rank refuses is skipped by every rank."""
    from train_helpers import DENSE_IN, integer_weights, window_minimum
    from torchrec import KeyedJaggedTensor

    from torchpipe.rec import SGD, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection, RecInputError
    from torchpipe.train import EmbCacheTrainPipeline, RecBatch

    mine, weighted = sharding.local_tables, sharding.is_weighted()
    weights = integer_weights(tables)
    ebc = CachedEmbeddingBagCollection(mine, window_minimum(mine, global_batches), optimizer=SGD(lr=1.0),
                                       weights=weights, policy="lfu", is_weighted=weighted)
    model = SparseAndDense(ebc, DENSE_IN)
    if rank == 1:  # a replica that starts off: the pipeline broadcasts rank 0's dense weights
        with torch.no_grad():
            model.dense.weight.add_(5)
    reference = SparseAndDense(FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0), weights=weights,
                                                               is_weighted=weighted), DENSE_IN)
    lr = 2.0 ** -6  # exact in float32 with the integer data
    ref_opt = torch.optim.SGD(reference.dense.parameters(), lr=lr)
    opt = torch.optim.SGD(model.dense.parameters(), lr=lr)
    with EmbCacheTrainPipeline(model, opt, collection=ebc, sharding=sharding, host_threads=2,
                               device_threads=1, dense_grads="sum") as pipe:
        outputs = []
        it = iter(per_rank[rank])
        while True:
            try:
                outputs.append(pipe.progress(it))
            except StopIteration:
                break
        # Rank 1's next batch has a key out of range for t0, which rank 0 owns; rank 0's is
        # good. Rank 1 refuses its batch before any collective of it, and the ranks vote at
        # admission: rank 0 refuses its batch too, so both skip this step and stay in step
        # (review: rank 0 admitted its batch, and the ranks exchanged keys of different steps).
        extra = per_rank[rank][0]
        features = extra.sparse_features
        if rank == 1:
            values = features.values().clone()
            values[features.length_per_key()[0] - 1] = 10 ** 6  # the last key of t0's feature
            features = KeyedJaggedTensor.from_lengths_sync(features.keys(), values, features.lengths(),
                                                           weights=features.weights_or_none())
        try:
            pipe.progress(iter([RecBatch(extra.dense_features, features, extra.labels)]))
        except RecInputError as exc:
            expected = "out of range" if rank == 1 else "ranks [1] refused their batch (see their error)"
            assert expected in str(exc), str(exc)
        else:
            raise AssertionError(f"rank {rank}: a batch refused on rank 1 was admitted")
        pipe.flush()
    assert len(outputs) == len(global_batches)
    for step, batch in enumerate(global_batches):
        ref_opt.zero_grad()
        loss, score = reference(batch)
        loss.backward()
        ref_opt.step()
        assert torch.equal(outputs[step], score[own_samples(rank)]), f"rank {rank}: step {step} differs"
    for t in mine:
        assert torch.equal(ebc.full_weight(t.name), reference.ebc.full_weight(t.name)), f"rank {rank}: {t.name}"
    # The dense replica saw every rank's samples through the gradient all-reduce.
    for got, want in zip(model.dense.parameters(), reference.dense.parameters()):
        assert torch.equal(got, want), f"rank {rank}: dense parameters differ"
    assert ebc.cache_stats()[mine[0].name].swapped_out > 0


def worker(rank: int, init_file: str, tests_dir: str) -> None:
    join(rank, init_file, tests_dir)
    from train_helpers import integer_weights, make_batches, make_tables

    from torchpipe.rec import SGD, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection
    from torchpipe.train import TableWiseSharding

    try:
        output_group = dist.new_group(list(range(WORLD)))
        tables = make_tables()
        weights = integer_weights(tables)
        sharding = TableWiseSharding(tables, input_group=None, output_group=output_group)
        mine = sharding.local_tables
        assert [t.name for t in mine] == [f"t{rank}"]
        per_rank = [make_batches(tables, STEPS, batch_size=3 + r, seed=10 + r) for r in range(WORLD)]
        global_batches = [concat_samples([per_rank[r][i] for r in range(WORLD)]) for i in range(STEPS)]

        # 1. one synchronous lookup: distributed == single process
        ebc = CachedEmbeddingBagCollection(mine, 40, optimizer=SGD(lr=1.0), weights=weights)
        full = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0), weights=weights)
        with torch.no_grad():
            got = sharding.lookup(ebc, per_rank[rank][0].sparse_features)
            want = full(global_batches[0].sparse_features)
        assert got.keys() == want.keys()
        assert torch.equal(got.values(), want.values()[own_samples(rank)])

        # 2. training through the pipeline (small cache) == single-process full-table training
        train_through_the_pipeline(rank, sharding, tables, per_rank, global_batches)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_process_table_wise_dist_equals_single_process(tmp_path) -> None:
    run_ranks(worker, tmp_path)



class ReplicaWithStateOfItsOwn(torch.nn.Module):
    """A dense part whose replicas DDP keeps equal but a gradient all-reduce alone does not: a
    frozen layer, a batch norm's running statistics, and a layer unfrozen during training."""

    def __init__(self, ebc, dense_in):
        super().__init__()
        self.ebc = ebc
        self.frozen = torch.nn.Linear(dense_in, dense_in).requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(dense_in)
        self.late = torch.nn.Linear(dense_in, dense_in).requires_grad_(False)
        self.top = torch.nn.Linear(dense_in, 1)
        self.register_buffer("seen", torch.zeros(0))  # replaced by one of each rank's batch size

    def forward(self, batch):
        self.seen = torch.arange(float(batch.dense_features.shape[0]))  # a cache that grows with the batch
        pooled = self.ebc(batch.sparse_features).values()
        score = pooled.sum(dim=1) + self.top(self.late(self.norm(self.frozen(batch.dense_features)))).squeeze(1)
        return (score * batch.labels).sum(), score.detach()


def replica_worker(rank: int, init_file: str, tests_dir: str) -> None:
    """Each rank builds its dense part from its own seed; after training (the late layer
    unfrozen halfway) every parameter and buffer equals rank 0's, and the unfrozen layer trained."""
    join(rank, init_file, tests_dir, timeout_s=30)
    from train_helpers import DENSE_IN, drain, make_tables

    from torchpipe.rec import SGD, CachedEmbeddingBagCollection
    from torchpipe.train import EmbCacheTrainPipeline, TableWiseSharding

    try:
        tables = make_tables()
        sharding = TableWiseSharding(tables)
        per_rank, _ = rank_batches(tables, 8, seed=90)
        ebc = CachedEmbeddingBagCollection(sharding.local_tables, 64, optimizer=SGD(lr=0.1))
        torch.manual_seed(rank)
        model = ReplicaWithStateOfItsOwn(ebc, DENSE_IN)
        dense = [p for name, p in model.named_parameters() if not name.startswith("ebc")]
        opt = torch.optim.SGD(dense, lr=0.05)
        with EmbCacheTrainPipeline(model, opt, collection=ebc, sharding=sharding, host_threads=1,
                                   device_threads=1) as pipe:
            assert len(drain(pipe, iter(per_rank[rank][:4]))) == 4
            late_before = model.late.weight.detach().clone()
            model.late.requires_grad_(True)  # between steps (none in flight), alike on every rank
            assert len(drain(pipe, iter(per_rank[rank][4:]))) == 4
        # helper-123: buffers read at every step paired "seen" (3 samples here, 4 on rank 1)
        # with the batch norm's statistics: shifted statistics, or gloo aborting. As in DDP,
        # the buffers are those the model had when the pipeline was built.
        assert model.seen.numel() == 3 + rank
        state = {name: t for name, t in model.state_dict().items() if not name.startswith("ebc") and name != "seen"}
        flat = torch.cat([t.detach().double().reshape(-1) for t in state.values()])
        everyone = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(everyone, flat)
        assert torch.equal(everyone[0], everyone[1]), f"rank {rank}: the dense replicas differ"
        assert not torch.equal(model.late.weight, late_before), "the unfrozen layer did not train"
        assert model.norm.num_batches_tracked.item() == 8
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_dense_part_stays_one_replica_frozen_layers_buffers_and_unfrozen_ones_too(tmp_path) -> None:
    """helper-121: the pipeline broadcast and all-reduced only the parameters that required grad
    when it was built, so a frozen layer kept each rank's own init, batch norm statistics drifted
    apart, and a layer unfrozen later was never averaged: replicas diverged without an error."""
    run_ranks(replica_worker, tmp_path)

def weighted_worker(rank: int, init_file: str, tests_dir: str) -> None:
    """Per-sample weights travel with their keys (rank 0 sends float32 weights, rank 1 float64):
    direct lookups with backward, then the pipeline, equal single-process weighted training."""
    join(rank, init_file, tests_dir, timeout_s=20)
    from train_helpers import integer_weights, make_batches, make_tables, with_weights
    from torchrec import KeyedJaggedTensor, PoolingType

    from torchpipe.rec import SGD, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection, RecInputError
    from torchpipe.train import TableWiseSharding

    try:
        tables = make_tables(num_rows=(40, 24, 16), pooling=(PoolingType.SUM,))  # t0, t2 on rank 0; t1 on 1
        # The groups left to their defaults (helper-121: one group for both exchanges, which the
        # pipeline runs on two threads, and gloo aborted the process): the sharding makes the
        # output group, with the default group's timeout.
        sharding = TableWiseSharding(tables, is_weighted=True)
        from torchpipe.train.dist import group_timeout
        assert sharding.output_group is not None and sharding.input_group is None
        assert group_timeout(sharding.output_group) == group_timeout(None) == datetime.timedelta(seconds=20)
        mine = sharding.local_tables
        per_rank = [with_weights(make_batches(tables, STEPS, batch_size=3 + r, seed=30 + r), seed=40 + r,
                                 dtype=(torch.float32, torch.float64)[r]) for r in range(WORLD)]
        global_batches = [concat_samples([per_rank[r][i] for r in range(WORLD)]) for i in range(STEPS)]

        # 1. direct lookups and backward: the owners' rows get every rank's weighted gradients
        weights = integer_weights(tables)
        ebc = CachedEmbeddingBagCollection(mine, 24, optimizer=SGD(lr=1.0), weights=weights, is_weighted=True)
        full = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0), weights=weights, is_weighted=True)
        lookups_train_as_in_one_process(rank, sharding, ebc, full, [b.sparse_features for b in per_rank[rank][:8]],
                                        [b.sparse_features for b in global_batches[:8]])

        # 2. weights that require grad on one rank: refused on both, before any key moves
        kjt = per_rank[rank][0].sparse_features
        if rank == 1:
            kjt = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(),
                                                      weights=kjt.weights().clone().requires_grad_())
        try:
            sharding.lookup(ebc, kjt)
        except RecInputError as exc:
            expected = ("per-sample weights require grad" if rank == 1
                        else "ranks [1] refused their batch (see their error)")
            assert expected in str(exc), str(exc)
        else:
            raise AssertionError(f"rank {rank}: weights that require grad were sent")

        # 3. training through the pipeline
        train_through_the_pipeline(rank, sharding, tables, per_rank, global_batches)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_per_sample_weights_travel_with_their_keys_and_train_as_in_one_process(tmp_path) -> None:
    run_ranks(weighted_worker, tmp_path)


class FailingOnRankZero(SparseAndDense):
    """`SparseAndDense` whose call number ``fail_call`` raises at ``where`` (rank 0 only):
    before the lookup, in the lookup itself (a hook run after the pipeline's own), after the
    output exchange, or in backward before the exchange's backward (a hook on the pooled rows)."""

    def __init__(self, ebc, dense_in, where: str, fail_call: Optional[int]):
        super().__init__(ebc, dense_in)
        self.where, self.fail_call, self.calls = where, fail_call, 0

    def failing(self, where: str) -> bool:
        return self.where == where and self.calls == self.fail_call

    def forward(self, batch):
        self.calls += 1
        if self.failing("before the lookup"):
            raise ValueError("injected on rank 0 before the lookup")
        pooled = self.ebc(batch.sparse_features).values()
        if self.failing("in backward") and pooled.requires_grad:
            pooled.register_hook(lambda grad: (_ for _ in ()).throw(ValueError("injected on rank 0 in backward")))
        score = pooled.sum(dim=1) + self.dense(batch.dense_features).squeeze(1)
        loss = (score * batch.labels).sum()
        if self.failing("after the exchange"):
            raise ValueError("injected on rank 0 after the exchange")
        return loss, score.detach()


TRAIN_FAILURES = ["before the step", "before the lookup", "in the lookup", "after the exchange", "in backward",
                  "in eval mode"]


def train_failure_worker(rank: int, init_file: str, tests_dir: str, where: str) -> None:
    """Rank 0's train step of its 5th batch fails ``where``; rank 1's does not. Both ranks raise in
    that call, long before the group's 20 s timeout: rank 0 its own error, rank 1 PeerStepFailed.
    Neither takes the step (rows put back, no dense optimizer step), both drop the same batches,
    and they go on in step: what they trained equals single-process training of the batches
    trained before the failure and of every batch after it (in eval mode: nothing changes, and
    the outputs are the reference's)."""
    join(rank, init_file, tests_dir, timeout_s=20)
    from train_helpers import DENSE_IN, drain

    from torchpipe.grad_sync import PeerStepFailed
    from torchpipe.train import EmbCacheTrainPipeline

    try:
        setup = failure_test_setup()
        ebc, before, after, global_before, global_after = (setup.ebc, setup.before, setup.after, setup.global_before,
                                                           setup.global_after)
        fail_call = 5 if rank == 0 else None
        model = FailingOnRankZero(ebc, DENSE_IN, where, fail_call)
        evaluating = where == "in eval mode"
        if evaluating:
            model.eval()
            model.where = "after the exchange"
        opt = torch.optim.SGD(model.dense.parameters(), lr=2.0 ** -6)
        outputs: list = []
        with EmbCacheTrainPipeline(model, opt, collection=ebc, sharding=setup.sharding, host_threads=2,
                                   device_threads=1, dense_grads="sum") as pipe:
            if where == "before the step":  # the rows' snapshot, before the model runs
                snapshot_rows, snapshots = ebc.snapshot_rows, [0]

                def failing_snapshot(plan):
                    snapshots[0] += 1
                    if snapshots[0] == fail_call:
                        raise ValueError("injected on rank 0 before the step")
                    return snapshot_rows(plan)

                ebc.snapshot_rows = failing_snapshot
            if where == "in the lookup":
                lookups = [0]

                def fail_in_the_lookup(module, args):
                    lookups[0] += 1
                    if lookups[0] == fail_call:
                        raise ValueError("injected on rank 0 in the lookup")

                ebc.register_forward_pre_hook(fail_in_the_lookup)  # after the pipeline's: the plan is armed
            error = progress_until_it_fails(pipe, before[rank], outputs)
            steps_before, returned_before = pipe.steps_done, len(outputs)
            assert pipe.pipeline.in_flight() == [], pipe.pipeline.in_flight()
            notes = "\n".join(getattr(error, "__notes__", []))
            if rank == 0:
                assert isinstance(error, ValueError) and "injected on rank 0" in str(error), repr(error)
                assert "ranks [0] failed this batch's train step" in notes, notes
            else:
                assert isinstance(error, PeerStepFailed), repr(error)
                assert "ranks [0] failed this batch's train step (see their error)" in str(error), str(error)
            # In eval mode the other rank's own step went well: the clock's vote failed its clock.
            assert ("failed in agree (another rank failed)" if evaluating and rank == 1
                    else "failed in stage 'train'") in notes, notes
            # Both ranks raised in the call that ran the failed step: the same outputs, the same steps.
            counts = [None] * WORLD
            dist.all_gather_object(counts, (steps_before, returned_before))
            assert counts[0] == counts[1] == (4, 4), counts
            outputs += drain(pipe, iter(after[rank]))
            assert pipe.steps_done == steps_before + len(global_after)

        reference, expected, _ = reference_training(setup.tables, setup.weights,
                                                    global_before[:steps_before] + global_after, rank, evaluating)
        assert len(expected) == len(outputs)
        for step, (got, want) in enumerate(zip(outputs, expected)):
            assert torch.equal(got, want), f"rank {rank}: output {step} differs"
        assert_same_state(rank, ebc, model, reference)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("where", TRAIN_FAILURES)
def test_a_train_step_that_fails_on_one_rank_fails_on_every_rank_and_they_go_on_in_step(tmp_path, where) -> None:
    run_ranks(train_failure_worker, tmp_path, where)


class _FailsOnce:
    """An iterator over ``batches`` whose ``failing`` item raises OSError instead (that item is lost,
    as a record that cannot be read is), then goes on."""

    def __init__(self, batches, failing: Optional[int]):
        self.batches, self.failing, self.index = list(batches), failing, 0

    def __iter__(self):
        return self

    def __next__(self):
        index = self.index
        if index >= len(self.batches):
            raise StopIteration
        self.index += 1
        if index == self.failing:
            raise OSError(f"injected: item {index} cannot be read")
        return self.batches[index]


def uneven_data_worker(rank: int, init_file: str, tests_dir: str, case: str) -> None:
    """Review: a rank whose data ended (or whose data iterator raised) left the other rank in its
    admission vote, paired with the next batch's key exchange, until the group's timeout (gloo's
    30 minutes by default). Now every rank raises in the same call, well within the 20 s timeout:
    for uneven data an UnevenDataError on both, after which the same iterators drain in step;
    for a failed read the failing rank its own error and the other a RecInputError, and both skip
    that batch. What they trained equals single-process training of the global batches formed."""
    join(rank, init_file, tests_dir, timeout_s=20)
    from train_helpers import DENSE_IN

    from torchpipe.rec import RecInputError
    from torchpipe.train import EmbCacheTrainPipeline, UnevenDataError

    try:
        setup = failure_test_setup()
        mine = setup.before[rank]
        if case == "uneven":
            data = _FailsOnce(mine[:8] if rank == 0 else mine[:6], None)
            trained = list(range(6))
        else:
            data = _FailsOnce(mine[:8], 2 if rank == 1 else None)
            trained = [0, 1, 3, 4, 5, 6, 7]
        model = SparseAndDense(setup.ebc, DENSE_IN)
        opt = torch.optim.SGD(model.dense.parameters(), lr=2.0 ** -6)
        outputs: list = []
        started = time.monotonic()
        with EmbCacheTrainPipeline(model, opt, collection=setup.ebc, sharding=setup.sharding, host_threads=2,
                                   device_threads=1, dense_grads="sum") as pipe:
            error = progress_until_it_fails(pipe, data, outputs)
            calls = [None] * WORLD
            dist.all_gather_object(calls, len(outputs))
            assert calls[0] == calls[1], calls  # the same call raised on both ranks
            assert time.monotonic() - started < 15, "a rank waited for the group's timeout"
            if case == "uneven":
                assert isinstance(error, UnevenDataError), repr(error)
                assert "the data ended on ranks [1] while ranks [0] still had a batch" in str(error), str(error)
                assert ("this rank's batch was not admitted" if rank == 0 else "this rank's data ended too") in str(error)
            elif rank == 1:
                assert isinstance(error, OSError) and "injected" in str(error), repr(error)
                assert "the data iterator of ranks [1] failed" in "".join(error.__notes__), error.__notes__
            else:
                assert isinstance(error, RecInputError), repr(error)
                assert "the data iterator of ranks [1] failed (see their error)" in str(error), str(error)
            rest = progress_until_it_fails(pipe, data, outputs)
            assert rest is None, repr(rest)  # the same iterator: drained (uneven) or on to its end, in step
            assert pipe.steps_done == len(trained), (pipe.steps_done, trained)
        global_batches = [concat_samples([setup.before[r][i] for r in range(WORLD)]) for i in trained]
        reference, expected, _ = reference_training(setup.tables, setup.weights, global_batches, rank)
        assert len(outputs) == len(expected), (len(outputs), len(expected))
        for step, (got, want) in enumerate(zip(outputs, expected)):
            assert torch.equal(got, want), f"rank {rank}: output {step} differs"
        assert_same_state(rank, setup.ebc, model, reference)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["uneven", "failed read"])
def test_uneven_data_or_a_failed_read_on_one_rank_raises_on_every_rank_instead_of_a_timeout(tmp_path, case) -> None:
    run_ranks(uneven_data_worker, tmp_path, case)


class FailingStep(torch.optim.SGD):
    """SGD whose step number ``fail_call`` raises before it changes anything."""

    def __init__(self, params, lr, fail_call: Optional[int]):
        super().__init__(params, lr=lr)
        self.fail_call, self.calls = fail_call, 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == self.fail_call:
            raise ValueError("injected on rank 0 in the dense optimizer's step")
        return super().step(closure)


def optimizer_failure_worker(rank: int, init_file: str, tests_dir: str) -> None:
    """The dense optimizer's own step() fails on rank 0 after the ranks agreed on the train step
    (documented): rank 0 raises in that call, rank 1, which took the step, raises PeerStepFailed
    in its next one, before admitting a batch. Neither waits for the group's timeout. The step
    is every rank's: rank 0 keeps its rows and counts it too, so the tables on both ranks equal
    single-process training of the 5 batches (rank 0's dense replica missed one step). Both then
    train on in step (the clock vote keeps their collectives paired)."""
    join(rank, init_file, tests_dir, timeout_s=20)
    from train_helpers import DENSE_IN, drain

    from torchpipe.grad_sync import PeerStepFailed
    from torchpipe.train import EmbCacheTrainPipeline

    try:
        setup = failure_test_setup()
        ebc, before, after = setup.ebc, setup.before, setup.after
        model = SparseAndDense(ebc, DENSE_IN)
        opt = FailingStep(model.dense.parameters(), 2.0 ** -6, 5 if rank == 0 else None)
        outputs: list = []
        with EmbCacheTrainPipeline(model, opt, collection=ebc, sharding=setup.sharding, host_threads=2,
                                   device_threads=1, dense_grads="sum") as pipe:
            error = progress_until_it_fails(pipe, before[rank], outputs)
            notes = "\n".join(getattr(error, "__notes__", []))
            if rank == 0:
                assert isinstance(error, ValueError) and "dense optimizer's step" in str(error), repr(error)
                assert "ranks [0] failed in this clock" in notes and "failed in stage 'train'" in notes, notes
                assert "its rows are kept and it counts in steps_done" in notes, notes
                assert (pipe.steps_done, len(outputs)) == (5, 4), (pipe.steps_done, len(outputs))
            else:
                assert isinstance(error, PeerStepFailed), repr(error)
                assert "or in the dense optimizer's step" in str(error), str(error)
                assert (pipe.steps_done, len(outputs)) == (5, 5), (pipe.steps_done, len(outputs))
            assert pipe.pipeline.in_flight() == [], pipe.pipeline.in_flight()
            reference, _, dense_after = reference_training(setup.tables, setup.weights, setup.global_before[:5], rank)
            for t in setup.mine:  # every rank kept the agreed step's rows
                assert torch.equal(ebc.full_weight(t.name), reference.ebc.full_weight(t.name)), f"rank {rank}: {t.name}"
            dense_steps = 4 if rank == 0 else 5
            for got, want in zip(model.dense.parameters(), dense_after[dense_steps - 1]):
                assert torch.equal(got, want), f"rank {rank}: dense parameters differ"
            steps = pipe.steps_done
            drain(pipe, iter(after[rank]))
            assert pipe.steps_done == steps + 6
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_dense_optimizer_that_fails_on_one_rank_fails_every_rank_without_a_timeout(tmp_path) -> None:
    run_ranks(optimizer_failure_worker, tmp_path)


def broken_group_worker(rank: int, init_file: str, tests_dir: str) -> None:
    """Rank 1 stalls longer than the output group's 4 s timeout before its 5th lookup: rank 0's
    output exchange itself fails. That error fails rank 0's clock at once (nothing to pair up
    with, and a vote would only wait for the same peer again): no second collective is tried.
    (The default group, which the set-up uses while the ranks import at different speeds, keeps
    a long timeout.)"""
    join(rank, init_file, tests_dir, timeout_s=60)
    import time

    from train_helpers import DENSE_IN

    from torchpipe.train import EmbCacheTrainPipeline

    try:
        setup = failure_test_setup(output_timeout_s=4)
        ebc, batches, sharding = setup.ebc, setup.before, setup.sharding
        model = FailingOnRankZero(ebc, DENSE_IN, "nowhere", None)
        forward = model.forward

        def stalling(batch):
            if rank == 1 and model.calls == 4:
                time.sleep(10)
            return forward(batch)

        model.forward = stalling
        opt = torch.optim.SGD(model.dense.parameters(), lr=2.0 ** -6)
        with EmbCacheTrainPipeline(model, opt, collection=ebc, sharding=sharding, host_threads=2,
                                   device_threads=1) as pipe:
            with pytest.raises(RuntimeError) as info:
                for _ in range(10):
                    pipe.progress(iter(batches[rank]))
            assert pipe.steps_done == 4, pipe.steps_done
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "failed in stage 'train'" in notes, notes
        # Failed at once: not deferred to the clock's vote, no exchange or all-reduce tried after it.
        assert "failed in this clock" not in notes and "telling the other ranks" not in notes, notes
    finally:
        dist.destroy_process_group()


def test_a_train_step_whose_exchange_itself_fails_fails_its_clock_at_once(tmp_path) -> None:
    run_ranks(broken_group_worker, tmp_path)


def plan_failure_worker(rank: int, init_file: str, tests_dir: str, mode: str) -> None:
    """Batch 6 gives table t0 (rank 0's) more keys than its cache has rows: rank 0's plan fails
    and rank 1's plan of t1 does not. Both ranks return that clock's finished batch, then raise in
    their next call (long before the group's 20 s timeout), rank 0 its own error and rank 1
    PeerStepFailed; both drop the same batches and go on in step: what they trained equals
    single-process training of the batches trained before the failure and of every batch after
    it. In eval mode, where the clock's vote also settles the forward-only step (and is waited
    for at once), the same holds: the finished batch's step went well everywhere, so it counts
    and its output is returned."""
    join(rank, init_file, tests_dir, timeout_s=20)
    from train_helpers import DENSE_IN, drain, integer_weights, make_tables, window_minimum
    from torchrec import KeyedJaggedTensor

    from torchpipe.grad_sync import PeerStepFailed
    from torchpipe.rec import SGD, CachedEmbeddingBagCollection, CacheTooSmallError
    from torchpipe.train import EmbCacheTrainPipeline, RecBatch, TableWiseSharding

    try:
        tables = make_tables(num_rows=(200, 24))
        sharding = TableWiseSharding(tables, output_group=dist.new_group(list(range(WORLD))))
        mine = sharding.local_tables
        before, global_before = rank_batches(tables, 10, seed=50)
        after, global_after = rank_batches(tables, 6, seed=60)
        cache_rows = window_minimum(mine, global_before + global_after)
        assert cache_rows < tables[0].num_embeddings, cache_rows
        batches = list(before[rank])
        if rank == 0:  # every key of t0 in sample 0's f0a bag: no cache of fewer rows holds them
            good = batches[6]
            jagged = good.sparse_features
            lengths = jagged.lengths().clone()
            lengths[0] = tables[0].num_embeddings
            values = torch.cat([torch.arange(tables[0].num_embeddings), jagged.values()[jagged.lengths()[0]:]])
            batches[6] = RecBatch(good.dense_features,
                                  KeyedJaggedTensor.from_lengths_sync(jagged.keys(), values, lengths), good.labels)

        weights = integer_weights(tables)
        ebc = CachedEmbeddingBagCollection(mine, cache_rows, optimizer=SGD(lr=1.0), weights=weights)
        model = SparseAndDense(ebc, DENSE_IN)
        evaluating = mode == "eval"
        if evaluating:
            model.eval()
        opt = torch.optim.SGD(model.dense.parameters(), lr=2.0 ** -6)
        outputs: list = []
        with EmbCacheTrainPipeline(model, opt, collection=ebc, sharding=sharding, host_threads=2,
                                   device_threads=1, dense_grads="sum") as pipe:
            error = progress_until_it_fails(pipe, batches, outputs)
            trained_before = pipe.steps_done
            assert pipe.pipeline.in_flight() == [], pipe.pipeline.in_flight()
            notes = "\n".join(getattr(error, "__notes__", []))
            if rank == 0:
                assert isinstance(error, CacheTooSmallError), repr(error)
                assert "ranks [0] failed in this clock" in notes and "failed in stage 'plan'" in notes, notes
            else:
                assert isinstance(error, PeerStepFailed), repr(error)
                assert "ranks [0] failed in this clock's h2d, plan or swap stage" in str(error), str(error)
                assert "failed on another rank (its finished batch, if any, was handed on)" in notes, notes
            # Both ranks returned the failed clock's finished batch and raised in the same call,
            # before admitting a batch: the same outputs, the same steps, the same calls.
            counts = [None] * WORLD
            dist.all_gather_object(counts, (trained_before, len(outputs)))
            assert counts[0] == counts[1] == (trained_before, trained_before) and 0 < trained_before < 6, counts
            # The ranks go on in step with new batches.
            outputs += drain(pipe, iter(after[rank]))
            assert pipe.steps_done == trained_before + len(global_after)

        reference, scores, _ = reference_training(tables, weights, global_before[:trained_before] + global_after, rank,
                                                  evaluating)
        returned_before = len(outputs) - len(global_after)
        expected = [score for step, score in enumerate(scores) if step < returned_before or step >= trained_before]
        assert len(expected) == len(outputs)
        for step, (got, want) in enumerate(zip(outputs, expected)):
            assert torch.equal(got, want), f"rank {rank}: output {step} differs"
        assert_same_state(rank, ebc, model, reference)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_plan_that_fails_on_one_rank_fails_that_clock_on_every_rank_and_they_go_on_in_step(tmp_path, mode) -> None:
    run_ranks(plan_failure_worker, tmp_path, mode)


def shared_feature_worker(rank: int, init_file: str, tests_dir: str) -> None:
    """A feature read by tables on both ranks (``user``), and by two tables of rank 1 (``item``)."""
    join(rank, init_file, tests_dir)
    from rec_helpers import integer_weights
    from test_shared_features import EXPECTED_KEYS, shared_batches, shared_tables

    from torchpipe.rec import SGD, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection
    from torchpipe.train import TableWiseSharding

    try:
        tables = shared_tables()
        sharding = TableWiseSharding(tables, output_group=dist.new_group(list(range(WORLD))),
                                     owners={"t0": 0, "t1": 1, "t2": 1})
        mine = sharding.local_tables
        weights = integer_weights(tables)
        ebc = CachedEmbeddingBagCollection(mine, 24, optimizer=SGD(lr=1.0), weights=weights)
        full = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0), weights=weights)
        per_rank = [shared_batches(tables, 12, batch_size=3 + r, seed=20 + r) for r in range(WORLD)]
        global_kjts = [concat_kjts([per_rank[r][step] for r in range(WORLD)]) for step in range(12)]
        lookups_train_as_in_one_process(rank, sharding, ebc, full, per_rank[rank], global_kjts, EXPECTED_KEYS)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_feature_read_by_tables_of_several_ranks_equals_single_process(tmp_path) -> None:
    run_ranks(shared_feature_worker, tmp_path)


def sharding_refusal_worker(rank: int, init_file: str, tests_dir: str) -> None:
    """Review: a direct lookup whose batch had a key bad for another rank's table failed on that
    rank, after the key exchange, and left this rank in a collective until the group's timeout;
    a rank owning no table failed inside its lookup; a repeated feature was reported as a clash."""
    join(rank, init_file, tests_dir, timeout_s=20)
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    from torchpipe.rec import SGD, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection, RecInputError
    from torchpipe.train import TableWiseSharding

    try:
        tables = [EmbeddingBagConfig(num_embeddings=30, embedding_dim=2, name="t0", feature_names=["u"]),
                  EmbeddingBagConfig(num_embeddings=12, embedding_dim=2, name="t1", feature_names=["u", "v"])]
        output_group = dist.new_group(list(range(WORLD)))
        for owners, message in (({"t0": 0, "t1": 0}, r"ranks \[1\] own no table \(2 tables, world size 2"),
                                (None, r"table 't0' lists features \['u'\] more than once"),
                                ({"t0": 0}, r"owners must name every table once: missing \['t1'\], unknown \[\]"),
                                ({"t0": 0, "t1": 1, "t9": 0}, r"missing \[\], unknown \['t9'\]"),
                                ({"t0": 0, "t1": "1"}, r"table 't1': owner rank must be an int, got '1'"),
                                ({"t0": 0, "t1": 2}, r"table 't1': owner rank 2 out of range for world size 2"),
                                ([0, 1], r"owners must be a dict of table name to rank, got list")):
            configs = tables if owners else [EmbeddingBagConfig(num_embeddings=4, embedding_dim=2, name="t0",
                                                                feature_names=["u", "v", "u"])]
            try:
                TableWiseSharding(configs, output_group=output_group, owners=owners)
            except (ValueError, TypeError) as exc:
                assert re.search(message, str(exc)), str(exc)
            else:
                raise AssertionError(f"rank {rank}: {message} was not refused")
        sharding = TableWiseSharding(tables, output_group=output_group)
        weights = {t.name: torch.arange(t.num_embeddings * 2, dtype=torch.float32).view(-1, 2) for t in tables}
        ebc = CachedEmbeddingBagCollection(sharding.local_tables, 8, optimizer=SGD(lr=1.0), weights=weights)
        bad_u = 20 if rank == 0 else 3  # in range for t0 (rank 0's), not for t1 (rank 1's)
        batch = KeyedJaggedTensor.from_lengths_sync(["u", "v"], torch.tensor([bad_u, 1]), torch.tensor([1, 1]))
        try:
            sharding.lookup(ebc, batch)
        except RecInputError as exc:
            text = str(exc) + "".join(getattr(exc, "__notes__", []))
            expected = ("feature 'u' (table 't1') has keys out of range [0, 12): e.g. [20]" if rank == 0
                        else "ranks [0] refused their batch (see their error)")
            assert expected in text, text
        else:
            raise AssertionError(f"rank {rank}: the bad batch went through")
        # The ranks are still in step: a good lookup gives the single-process result.
        good = KeyedJaggedTensor.from_lengths_sync(["u", "v"], torch.tensor([rank + 1, 2]), torch.tensor([1, 1]))
        both = KeyedJaggedTensor.from_lengths_sync(["u", "v"], torch.tensor([1, 2, 2, 2]), torch.tensor([1, 1, 1, 1]))
        with torch.no_grad():
            got = sharding.lookup(ebc, good)
            want = FullTableEmbeddingBagCollection(tables, weights=weights)(both)
        assert got.keys() == want.keys() == ["u@t0", "u@t1", "v"], got.keys()
        assert torch.equal(got.values(), want.values()[rank:rank + 1])
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sharding_refuses_bad_batches_and_configs_on_every_rank_together(tmp_path) -> None:
    run_ranks(sharding_refusal_worker, tmp_path)


def agreement_worker(rank: int, init_file: str, tests_dir: str) -> None:
    """Review: ranks set up differently failed on one rank and left the other in a collective
    (a weighted sharding on one rank only: gloo aborted the process, or both waited for the
    group's timeout); a collection that did not match the sharding on one rank, at lookup or
    when a pipeline was built; an owner whose lookup failed after the key exchange."""
    join(rank, init_file, tests_dir, timeout_s=20)
    from train_helpers import integer_weights, make_batches, make_tables
    from torchrec import PoolingType

    from torchpipe.rec import CachedEmbeddingBagCollection, CacheTooSmallError
    from torchpipe.train import EmbCacheTrainPipeline, TableWiseSharding

    def refused_on_both(build, mine: str, theirs: str, error: type = ValueError) -> None:
        try:
            build()
        except error as exc:
            text = str(exc) + "".join(getattr(exc, "__notes__", []))
            assert (mine if rank == 1 else theirs) in text, text
        else:
            raise AssertionError(f"rank {rank}: {mine!r} was not refused")

    try:
        tables = make_tables(pooling=(PoolingType.SUM,))
        output_group = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=20))
        refused_on_both(lambda: TableWiseSharding(tables, output_group=output_group, is_weighted=rank == 1),
                        "is_weighted: False on rank 0, True on rank 1", "is_weighted: False on rank 0, True on rank 1")
        refused_on_both(lambda: TableWiseSharding(tables, output_group=output_group, is_weighted=1 if rank else False),
                        "is_weighted must be a bool, got 1", "ranks [1] refused their TableWiseSharding arguments",
                        (TypeError, ValueError))
        sharding = TableWiseSharding(tables, output_group=output_group)
        weights = integer_weights(tables)
        good = CachedEmbeddingBagCollection(sharding.local_tables, 64, weights=weights)
        odd = CachedEmbeddingBagCollection(sharding.local_tables, 64, weights=weights, is_weighted=rank == 1)
        batch = make_batches(tables, 1, seed=rank)[0]
        refused_on_both(lambda: sharding.lookup(odd, batch.sparse_features),
                        "the collection was built with is_weighted=True but the sharding with is_weighted=False",
                        "ranks [1] refused their batch (see their error)")
        model = torch.nn.Module()
        model.ebc = odd
        refused_on_both(lambda: EmbCacheTrainPipeline(model, None, sharding=sharding, host_threads=1,
                                                      device_threads=1),
                        "the collection was built with is_weighted=True", "ranks [1] refused their collection")
        # Rank 1's cache holds 2 rows: enough for its own batch, not for the global one.
        small = CachedEmbeddingBagCollection(sharding.local_tables, 64 if rank == 0 else 2, weights=weights)
        refused_on_both(lambda: sharding.lookup(small, batch.sparse_features), "is too small",
                        "ranks [1] refused their lookup (see their error)", (CacheTooSmallError, RuntimeError))
        with torch.no_grad():  # and the ranks are still in step
            assert sharding.lookup(good, batch.sparse_features).values().shape[0] == len(batch.labels)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ranks_set_up_differently_all_raise_instead_of_waiting_for_each_other(tmp_path) -> None:
    run_ranks(agreement_worker, tmp_path)


@pytest.mark.parametrize("eval_step", [False, True], ids=["train mode", "eval mode"])
@pytest.mark.parametrize("when", ["starting", "reading"])
def test_a_vote_that_fails_keeps_the_ranks_own_failure(when: str, eval_step: bool) -> None:
    """The per-clock vote itself can fail (a peer gone, the group's timeout): a rank that failed
    raises its own error with that noted, one that did not raises the vote's error. (A clock
    that ran a forward-only step reads the vote at once, the others in the check.)"""
    from types import SimpleNamespace

    from torchpipe.train import EmbCacheTrainPipeline

    def codes_later(code: int):
        if when == "starting":
            raise RuntimeError("gloo: connection closed by peer")

        def outcome():
            raise RuntimeError("gloo: connection closed by peer")
        return outcome

    def agree_and_check(pipeline, failure) -> None:
        pipeline._eval_step = SimpleNamespace(trained=False) if eval_step else None
        EmbCacheTrainPipeline._agree_on_clock(pipeline, failure)()

    pipeline = SimpleNamespace(_sharding=SimpleNamespace(codes_later=codes_later), steps_done=0)
    pipeline._settle_eval_step = lambda *args: EmbCacheTrainPipeline._settle_eval_step(pipeline, *args)
    own = ValueError("cache too small")
    with pytest.raises(ValueError, match="cache too small") as info:
        agree_and_check(pipeline, own)
    assert "telling the other ranks of it failed too (RuntimeError: gloo: connection closed by peer)" in \
        " ".join(info.value.__notes__)
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        agree_and_check(pipeline, None)
    assert pipeline.steps_done == 0  # a step whose vote failed does not count


def test_a_key_group_without_a_cpu_backend_is_refused_before_any_collective(monkeypatch) -> None:
    """Review: with init_process_group("nccl") the first vote failed with torch's "No backend type
    associated with device type cpu"; the guide said NCCL carried the keys."""
    from train_helpers import make_tables

    from torchpipe.train import TableWiseSharding

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    with pytest.raises(ValueError, match=r"input_group .*has no backend for CPU tensors \(its backends: cuda:nccl\)"
                                         r".*cpu:gloo,cuda:nccl"):
        TableWiseSharding(make_tables())


@pytest.mark.parametrize("case", ["went well", "a peer's step failed", "own step failed", "a peer's plan failed",
                                  "own step failed with a peer's error type"])
def test_the_clock_vote_carries_and_settles_a_forward_only_step(case: str) -> None:
    """Eval mode across processes: the forward-only step's outcome goes into the clock's vote
    (code 2), which is read at once, before the check is returned, so that an output built
    from a failing peer's zero embeddings is never handed on. The step counts only when no
    rank's failed. (Any error of the step is its own, even one of PeerStepFailed's type.)"""
    from types import SimpleNamespace

    from torchpipe.grad_sync import PeerStepFailed
    from torchpipe.train import EmbCacheTrainPipeline
    from torchpipe.train.pipelines import _EVAL_STEP_FAILED

    own_failed = case.startswith("own step failed")
    replies = {"went well": [0, 0], "a peer's step failed": [0, 2], "own step failed": [2, 0],
               "a peer's plan failed": [0, 1], "own step failed with a peer's error type": [2, 0]}
    sent, read = [], []

    def codes_later(code: int):
        sent.append(code)

        def outcome():
            read.append(True)
            return replies[case]
        return outcome

    item = SimpleNamespace(trained=False)
    pipeline = SimpleNamespace(_sharding=SimpleNamespace(codes_later=codes_later), steps_done=0,
                               _eval_step=_EVAL_STEP_FAILED if own_failed else item)
    pipeline._settle_eval_step = lambda *args: EmbCacheTrainPipeline._settle_eval_step(pipeline, *args)
    failure = None
    if own_failed:
        failure = PeerStepFailed("the model's own") if "type" in case else ValueError("the model's own")

    if case in ("went well", "a peer's plan failed"):
        check = EmbCacheTrainPipeline._agree_on_clock(pipeline, failure)
        assert read, "the vote of a clock with a forward-only step must be read before its output is handed on"
        assert sent == [0] and item.trained and pipeline.steps_done == 1
        if case == "went well":
            check()
        else:
            with pytest.raises(PeerStepFailed, match=r"ranks \[1\] failed in this clock's h2d, plan or swap"):
                check()
    else:
        with pytest.raises(Exception) as info:
            EmbCacheTrainPipeline._agree_on_clock(pipeline, failure)
        if own_failed:
            assert info.value is failure and sent == [2]
            assert "ranks [0] failed this batch's train step (forward only, in eval mode)" in \
                " ".join(info.value.__notes__)
        else:
            assert isinstance(info.value, PeerStepFailed) and sent == [0]
            assert "ranks [1] failed this batch's train step (see their error)" in str(info.value)
        assert not item.trained and pipeline.steps_done == 0
    assert pipeline._eval_step is None
