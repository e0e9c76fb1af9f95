"""EmbCacheTrainPipeline: step-by-step equal to the unpipelined full-table loop, bitwise."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor, PoolingType
from train_helpers import (RecBatch, TinyDLRM, assert_same_outputs, assert_same_state, build, drain, emb_width,
                           integer_weights, make_batches, make_tables, reference_run, window_minimum, with_weights)

from torchpipe.rec import (SGD, Adam, CachedEmbeddingBagCollection, CacheTooSmallError, FullTableEmbeddingBagCollection,
                           RecInputError, RowWiseAdagrad)
from torchpipe.train import EmbCacheTrainPipeline, train_step
from torchpipe.train.dist import TableWiseSharding

pytestmark = pytest.mark.timeout(60)

OPTIMIZERS = {"sgd": SGD(lr=1.0), "adagrad": RowWiseAdagrad(lr=0.5), "adam": Adam(lr=0.5)}
STEPS = 120


@pytest.mark.parametrize("optimizer, policy, size", [
    ("sgd", "lru", "minimal"), ("adagrad", "lfu", "minimal"), ("adam", "lru", "minimal"),
    ("adam", "lfu", "half"), ("sgd", "lfu", "whole"), ("adagrad", "lru", "whole"),
])
def test_pipeline_equals_full_table_loop(optimizer: str, policy: str, size: str) -> None:
    tables = make_tables()
    batches = make_batches(tables, STEPS, seed=len(optimizer + policy + size))
    minimal = window_minimum(tables, batches)
    rows = {"minimal": minimal, "half": max(minimal, 20), "whole": 40}[size]
    model, opt = build(tables, rows, OPTIMIZERS[optimizer], policy)
    reference, ref_opt, ref_outputs = reference_run(tables, batches, OPTIMIZERS[optimizer])
    with EmbCacheTrainPipeline(model, opt, host_threads=2, device_threads=1) as pipe:
        outputs = drain(pipe, iter(batches))
        assert len(outputs) == STEPS == pipe.steps_done
        for step, ((loss, logit), (ref_loss, ref_logit)) in enumerate(zip(outputs, ref_outputs)):
            assert torch.equal(loss, ref_loss), f"loss differs at step {step}"
            assert torch.equal(logit, ref_logit), f"output differs at step {step}"
        pipe.flush()
    ebc = model.ebc
    assert ebc.in_flight() == 0 and ebc.pending_writes() == 0
    assert_same_state(model, reference)
    stats = ebc.cache_stats()["t0"]
    if size == "minimal":
        assert stats.swapped_out > 0
    assert 0.0 < pipe.hit_rate() <= 1.0


def test_one_row_below_the_window_minimum_is_refused_with_numbers() -> None:
    tables = make_tables()
    batches = make_batches(tables, 60, seed=3)
    minimal = window_minimum(tables, batches)
    model, opt = build(tables, minimal - 1, SGD(lr=1.0))
    with EmbCacheTrainPipeline(model, opt, host_threads=2, device_threads=1) as pipe:
        with pytest.raises(CacheTooSmallError, match=f"cache_rows={minimal - 1}") as info:
            drain(pipe, iter(batches))
        assert "cache_rows must hold the unique keys a table gets in any 3 consecutive batches" in "".join(
            info.value.__notes__)
        assert model.ebc.in_flight() == 0 and model.ebc.pending_writes() == 0


def test_serial_mode_is_the_same_training() -> None:
    tables = make_tables()
    batches = make_batches(tables, 40, seed=5)
    model, opt = build(tables, window_minimum(tables, batches), Adam(lr=0.5))
    reference, _, ref_outputs = reference_run(tables, batches, Adam(lr=0.5))
    with EmbCacheTrainPipeline(model, opt, host_threads=1, device_threads=1, overlap=False) as pipe:
        outputs = drain(pipe, iter(batches))
        pipe.flush()
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(outputs, ref_outputs))
    assert_same_state(model, reference)


def test_schedule_shows_train_of_b_with_swap_of_b1_and_plan_of_b2() -> None:
    tables = make_tables()
    model, opt = build(tables, 40, SGD(lr=1.0))
    with EmbCacheTrainPipeline(model, opt, host_threads=3, device_threads=1) as pipe:
        table = pipe.schedule_table(6)
    header = table.splitlines()[0].split()
    assert header[2:7] == ["h2d@copy", "input_dist@host0", "plan@host1", "swap@host2", "train@compute"]
    rows = [line.split() for line in table.splitlines()[2:]]
    steady = [r for r in rows if r[6:7] == ["1"]][0]
    assert steady[2:8] == ["5", "4", "3", "2", "1", "1"]  # train b=1 | swap 2 | plan 3 | dist 4 | h2d 5


def test_close_from_the_data_iterator_waits_for_the_call_and_keeps_the_trained_state() -> None:
    """Review: close() inside progress() (the data iterator) stopped the hooks and handed the
    in-flight batches back under the running call, which then failed with an unrelated error.
    Now the close waits for the call's end; the collection holds exactly `steps_done` steps."""
    tables = make_tables()
    batches = make_batches(tables, 12, seed=9)
    model, opt = build(tables, window_minimum(tables, batches), SGD(lr=1.0))
    pipe = EmbCacheTrainPipeline(model, opt, host_threads=2, device_threads=1)

    def data():
        for index, batch in enumerate(batches):
            if index == 6:
                pipe.close()  # deferred: this thread is inside progress()
            yield batch

    it, returned = data(), 0
    with pytest.raises(RuntimeError, match="this pipeline is closed"):  # the call after the close's
        while True:
            pipe.progress(it)
            returned += 1
    assert returned == pipe.steps_done > 0
    with pytest.raises(RuntimeError, match="closed"):
        pipe.progress(iter(batches))
    model.ebc.flush()
    reference, _, _ = reference_run(tables, batches, SGD(lr=1.0), steps=pipe.steps_done)
    assert_same_state(model, reference)


def test_a_model_copied_beside_an_open_pipeline_leaves_the_pipeline_behind() -> None:
    """deepcopy(model) of a cached model: refused while batches are in flight; once drained, the
    copy trains on its own (the pipeline's plan-injecting hook is not copied) and equals the
    original trained the same way."""
    tables = make_tables()
    batches = make_batches(tables, 10)
    model, opt = build(tables, window_minimum(tables, batches), Adam(lr=0.5))
    with EmbCacheTrainPipeline(model, opt, host_threads=2, device_threads=1) as pipe:
        it = iter(batches[:6])
        pipe.progress(it)
        with pytest.raises(RuntimeError, match=r"cannot be copied or pickled while it is in use.*flush\(\) the pipeline"):
            copy.deepcopy(model)
        drain(pipe, it)
        pipe.flush()
        twin = copy.deepcopy(model)
        assert len(model.ebc._forward_pre_hooks) == 1 and len(twin.ebc._forward_pre_hooks) == 0
        twin_opt = torch.optim.SGD(twin.parameters(), lr=opt.param_groups[0]["lr"])
        twin_outputs = [train_step(twin, twin_opt, b) for b in batches[6:]]  # beside the open pipeline
        outputs = drain(pipe, iter(batches[6:]))
        pipe.flush()
    assert_same_outputs(outputs, twin_outputs)
    assert_same_state(model, twin)


def test_a_weighted_collection_trains_through_the_pipeline_as_the_loop_does() -> None:
    """Per-sample weights ride along the host KJT the pipeline plans from (is_weighted=True)."""
    tables = make_tables(pooling=(PoolingType.SUM,))
    batches = with_weights(make_batches(tables, 30), seed=5)

    def model_of(ebc):
        model = TinyDLRM(ebc, emb_width(tables))
        return model, torch.optim.SGD(model.parameters(), lr=2.0 ** -6)

    reference, ref_opt = model_of(FullTableEmbeddingBagCollection(
        tables, optimizer=Adam(lr=0.5), weights=integer_weights(tables), is_weighted=True))
    expected = [train_step(reference, ref_opt, b) for b in batches]
    model, opt = model_of(CachedEmbeddingBagCollection(
        tables, window_minimum(tables, batches), optimizer=Adam(lr=0.5), weights=integer_weights(tables),
        is_weighted=True))
    with EmbCacheTrainPipeline(model, opt, host_threads=2, device_threads=1) as pipe:
        outputs = drain(pipe, iter(batches))
        pipe.flush()
    assert_same_outputs(outputs, expected)
    assert_same_state(model, reference)



def test_a_sharding_makes_one_output_group_for_the_job_and_refuses_to_guess_one_for_a_subgroup() -> None:
    """helper-123: the output group was made only when none was given *and* the input group was
    None (input_group=dist.group.WORLD kept one group for both threads: gloo aborted), by
    local synchronisation (names that differ between ranks that made other groups: a hang),
    and once per sharding (a gloo group left behind each time)."""
    tables = make_tables()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        first = TableWiseSharding(tables)
        assert first.output_group is not None and first.output_group is not dist.group.WORLD
        assert TableWiseSharding(tables, input_group=dist.group.WORLD).output_group is first.output_group
        assert TableWiseSharding(tables, output_group=dist.group.WORLD).output_group is first.output_group
        mine = dist.new_group([0])
        assert TableWiseSharding(tables, output_group=mine).output_group is mine
        for output_group, said in ((None, "not given"), (mine, "the same group")):
            with pytest.raises(ValueError, match=f"input_group is a subgroup and output_group is {said}: .* Pass "
                                                 r"output_group=dist.new_group\(ranks"):
                TableWiseSharding(tables, input_group=mine, output_group=output_group)
        dist.destroy_process_group(first.output_group)  # released by the user: the next sharding makes another
        again = TableWiseSharding(tables).output_group
        assert again is not first.output_group
        ones = torch.ones(2)
        dist.all_reduce(ones, group=again)
        assert ones.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()

def test_table_wise_sharding_refuses_weights_it_was_not_built_for_before_anything_changes() -> None:
    """A sharding sends per-sample weights only when built with is_weighted=True; the collection
    must match it, and weights that require grad are refused (no gradient goes back)."""
    tables = make_tables(pooling=(PoolingType.SUM,))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match="is_weighted must be a bool, got 'yes'"):
            TableWiseSharding(tables, is_weighted="yes")
        with pytest.raises(ValueError, match=r"table 't1': per-sample weights \(is_weighted=True\) pool with SUM"):
            TableWiseSharding(make_tables(), is_weighted=True)  # t1 is a MEAN table
        sharding = TableWiseSharding(tables)
        ebc = CachedEmbeddingBagCollection(sharding.local_tables, 64, is_weighted=True)
        model = TinyDLRM(ebc, emb_width(tables))
        mismatch = "the collection was built with is_weighted=True but the sharding with is_weighted=False"
        with pytest.raises(ValueError, match=mismatch):
            EmbCacheTrainPipeline(model, None, sharding=sharding)
        assert len(ebc._forward_pre_hooks) == 0  # not hooked, not claimed: a pipeline without sharding works
        EmbCacheTrainPipeline(model, None, host_threads=1, device_threads=1).close()
        plain_batches = make_batches(tables, 3)
        weighted = with_weights(plain_batches, seed=1)
        with pytest.raises(ValueError, match=mismatch):  # the direct sharded lookup
            sharding.lookup(ebc, weighted[0].sparse_features)
        plain = CachedEmbeddingBagCollection(sharding.local_tables, 64)
        carries = "the sharding was built with is_weighted=False, but the batch carries per-sample weights"
        with pytest.raises(RecInputError, match=carries):
            sharding.lookup(plain, weighted[1].sparse_features)
        with pytest.raises(RecInputError, match=carries):  # input_dist alone checks before its collectives
            sharding.input_dist(weighted[1].sparse_features)
        names = ["f0a", "f0b", "f1a", "f1b"]
        vbe = KeyedJaggedTensor(keys=names, values=torch.arange(7), lengths=torch.ones(7, dtype=torch.int64),
                                stride_per_key_per_rank=[[2], [1], [2], [2]],
                                inverse_indices=(names, torch.tensor([[0, 1], [0, 0], [1, 0], [0, 1]])))
        plain(vbe)  # one process takes it
        for call in (lambda: sharding.lookup(plain, vbe), lambda: sharding.input_dist(vbe)):
            with pytest.raises(RecInputError, match=r"a batch size per feature \(stride_per_key_per_rank, VBE\) "
                                                    "or inverse_indices trains in one process only"):
                call()
        # and at a sharded pipeline's admission, leaving the batches in flight alone
        with EmbCacheTrainPipeline(TinyDLRM(plain, emb_width(tables)), None, sharding=sharding, host_threads=1,
                                   device_threads=1) as pipe:
            it = iter([plain_batches[0], weighted[1], plain_batches[2]])
            with pytest.raises(RecInputError, match=carries):
                pipe.progress(it)  # filling: the first batch was admitted, the second is refused
            assert len(pipe.pipeline.in_flight()) == 1
            assert len(drain(pipe, it)) == 2 and pipe.steps_done == 2
        weighted_sharding = TableWiseSharding(tables, is_weighted=True)
        assert weighted_sharding.is_weighted() and not sharding.is_weighted()
        with pytest.raises(RecInputError, match="the sharding was built with is_weighted=True, but the batch has no"):
            weighted_sharding.lookup(ebc, plain_batches[0].sparse_features)
        kjt = weighted[0].sparse_features
        needs_grad = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(),
                                                         weights=kjt.weights().clone().requires_grad_())
        for call in (weighted_sharding.check_batch, weighted_sharding.input_dist):
            with pytest.raises(RecInputError, match="per-sample weights require grad, but across processes"):
                call(needs_grad)
        # One rank: the weighted exchange is the identity, and the lookup is the collection's.
        full = FullTableEmbeddingBagCollection(tables, weights=integer_weights(tables), is_weighted=True)
        both = CachedEmbeddingBagCollection(tables, 64, weights=integer_weights(tables), is_weighted=True)
        with torch.no_grad():
            got, want = weighted_sharding.lookup(both, kjt), full(kjt)
        assert got.keys() == want.keys() and torch.equal(got.values(), want.values())
    finally:
        dist.destroy_process_group()
