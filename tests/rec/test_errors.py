"""Bad input gets a clear error before any state changes."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from rec_helpers import integer_weights, make_kjt, make_tables
from torchrec import KeyedJaggedTensor

from torchpipe.devices import BackendUnavailableError
from torchpipe.rec import (SGD, Adam, CachedEmbeddingBagCollection, CacheTooSmallError, EmbeddingCache,
                           FullTableEmbeddingBagCollection, HostEmbeddingTable, RecInputError, RowOptimizer,
                           RowWiseAdagrad, StaleBatchError)


def model_and_state() -> tuple[CachedEmbeddingBagCollection, callable]:
    tables = make_tables(num_rows=(10, 10))
    model = CachedEmbeddingBagCollection(tables, 4, weights=integer_weights(tables))
    model(make_kjt(tables, {f: [[1, 2], [3]] for t in tables for f in t.feature_names})).values().sum().backward()

    def snapshot() -> list[torch.Tensor]:
        parts = []
        for name in model.hosts:
            cache = model.caches[name]
            parts += [model.hosts[name].rows.clone(), model.slots[name].clone(), cache.slot_of_key.clone(),
                      cache.key_of_slot.clone(), cache._protect_count.clone(), cache._freq_of_key.clone(),
                      torch.tensor([cache.stats.plans, cache.stats.hits])]
        return parts

    return model, snapshot


NAMES = ["f0a", "f0b", "f1a", "f1b"]


def bags(keys_a: list[int]) -> dict[str, list[list[int]]]:
    return {"f0a": [keys_a, [1]], "f0b": [[2], []], "f1a": [[1], [2]], "f1b": [[3], [3]]}


@pytest.mark.parametrize("case, error, words", [
    ("out_of_range", RecInputError, "out of range"),
    ("negative", RecInputError, "out of range"),
    # A feature no table reads is ignored (TorchRec's rule); one in place of a read one is named.
    ("unknown_feature", RecInputError, r"features \['f1b'\] are missing from the batch \(it has \['zzz'\], which no "
                                       r"table reads\)"),
    ("missing_feature", RecInputError, "missing"),
    ("float_keys", RecInputError, "int32 or int64"),
    ("too_many_keys", CacheTooSmallError, "cache_rows=4"),
    # Review: a KJT's structure was not checked; these failed in the lookup, after the swap.
    ("negative_length", RecInputError, r"lengths must be >= 0, got \[-1\]"),
    ("values_2d", RecInputError, r"1-D tensor of keys, got shape \(8, 1\)"),
    ("variable_batch", RecInputError, r"different numbers of bags \(\{'f0a': 2, 'f0b': 1, 'f1a': 2, 'f1b': 2\}, a "
                                      r"batch size per feature: stride_per_key_per_rank\) needs inverse_indices"),
    ("vbe_strides_short", RecInputError, r"stride_per_key_per_rank must hold one list per feature \(4\), each with "
                                         r"one bag count per rank, got \[\[2\], \[1\], \[2\]\]"),
    ("vbe_inverse_missing_feature", RecInputError, r"inverse_indices has no row for features \['f1b'\]"),
    ("vbe_inverse_out_of_range", RecInputError, r"inverse_indices of feature 'f0b' must index its 1 bags, got \[1\]"),
    ("vbe_inverse_1d", RecInputError, r"inverse_indices must be \(keys, a 2-D int32/int64 tensor"),
    ("vbe_lengths", RecInputError, r"lengths have shape \(8,\), expected \(7,\): one per bag, and the features "
                                   r"have \{'f0a': 2, 'f0b': 1, 'f1a': 2, 'f1b': 2\} bags"),
    ("inverse_float", RecInputError, r"int32/int64 tensor .*, got 4 keys and torch.float32 of shape \(4, 2\)"),
    ("lengths_beyond_values", RecInputError, "lengths add up to 9 keys, but its values hold 5"),
    ("lengths_short_of_values", RecInputError, "lengths add up to 8 keys, but its values hold 10"),
    ("bags_not_per_feature", RecInputError, r"lengths have shape \(7,\), expected \(4,\)"),
    ("feature_twice", RecInputError, r"features \['f0a'\] appear more than once"),
])
def test_bad_input_is_refused_before_any_state_change(case: str, error: type, words: str) -> None:
    model, snapshot = model_and_state()
    tables = make_tables(num_rows=(10, 10))
    if case == "out_of_range":
        kjt = make_kjt(tables, bags([1, 10]))
    elif case == "negative":
        kjt = make_kjt(tables, bags([-1]))
    elif case == "unknown_feature":
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0a", "f0b", "f1a", "zzz"], torch.arange(4),
                                                  torch.ones(8, dtype=torch.int64))
    elif case == "missing_feature":
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0a", "f0b", "f1a"], torch.arange(3),
                                                  torch.ones(6, dtype=torch.int64))
    elif case == "float_keys":
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0a", "f0b", "f1a", "f1b"], torch.ones(8),
                                                  torch.ones(8, dtype=torch.int64))
    elif case == "negative_length":
        kjt = KeyedJaggedTensor(keys=NAMES, values=torch.arange(8), lengths=torch.tensor([3, -1, 1, 1, 1, 1, 1, 1]))
    elif case == "values_2d":
        kjt = KeyedJaggedTensor(keys=NAMES, values=torch.arange(8).view(8, 1), lengths=torch.ones(8, dtype=torch.int64))
    elif case == "variable_batch":
        kjt = KeyedJaggedTensor(keys=NAMES, values=torch.arange(7), lengths=torch.ones(7, dtype=torch.int64),
                                stride_per_key_per_rank=[[2], [1], [2], [2]])
    elif case == "vbe_strides_short":  # torchrec drops the fourth feature's bags from to_dict()
        kjt = KeyedJaggedTensor(keys=NAMES, values=torch.arange(7), lengths=torch.ones(7, dtype=torch.int64),
                                stride_per_key_per_rank=[[2], [1], [2]],
                                inverse_indices=(NAMES, torch.zeros(4, 2, dtype=torch.int64)))
    elif case == "inverse_float":  # one batch size, with inverse_indices: TorchRec applies them
        kjt = KeyedJaggedTensor(keys=NAMES, values=torch.arange(8), lengths=torch.ones(8, dtype=torch.int64),
                                inverse_indices=(NAMES, torch.zeros(4, 2)))
    elif case.startswith("vbe_"):
        inverse = {"vbe_inverse_missing_feature": (NAMES[:3], torch.tensor([[0, 1], [0, 0], [1, 0]])),
                   "vbe_inverse_out_of_range": (NAMES, torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])),
                   "vbe_inverse_1d": (NAMES, torch.tensor([0, 0, 1, 0])),
                   "vbe_lengths": (NAMES, torch.tensor([[0, 1], [0, 0], [1, 0], [0, 1]]))}[case]
        count = 8 if case == "vbe_lengths" else 7
        kjt = KeyedJaggedTensor(keys=NAMES, values=torch.arange(count), lengths=torch.ones(count, dtype=torch.int64),
                                stride_per_key_per_rank=[[2], [1], [2], [2]], inverse_indices=inverse)
    elif case == "lengths_beyond_values":
        kjt = KeyedJaggedTensor(keys=NAMES, values=torch.arange(5), lengths=torch.tensor([2, 1, 1, 1, 1, 1, 1, 1]))
    elif case == "lengths_short_of_values":
        kjt = KeyedJaggedTensor(keys=NAMES, values=torch.arange(10) % 9, lengths=torch.ones(8, dtype=torch.int64))
    elif case == "bags_not_per_feature":
        kjt = KeyedJaggedTensor(keys=NAMES, values=torch.arange(7), lengths=torch.ones(7, dtype=torch.int64))
    elif case == "feature_twice":
        kjt = KeyedJaggedTensor(keys=NAMES + ["f0a"], values=torch.arange(10) % 9,
                                lengths=torch.ones(10, dtype=torch.int64))
    else:  # table t1 fits, t0 needs 5 slots of 4: nothing may change in either table
        kjt = make_kjt(tables, bags([4, 5, 6, 7]))
    before = snapshot()
    with pytest.raises(error, match=words):
        model(kjt)
    after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert model.in_flight() == 0


def test_backward_after_release_is_refused() -> None:
    tables = make_tables(num_rows=(10, 10))
    model = CachedEmbeddingBagCollection(tables, 4)
    kjt = make_kjt(tables, bags([1]))
    plan = model.plan(model.prepare(kjt))
    model.swap(plan)
    out = model(kjt, plan)
    model.release(plan)
    with pytest.raises(StaleBatchError):
        out.values().sum().backward()


def test_a_second_backward_through_one_lookup_says_so() -> None:
    """Review: backward(retain_graph=True) then backward() was blamed on a later lookup, a
    pipeline or a flush. A fused update cannot accumulate: the second one is refused."""
    tables = make_tables(num_rows=(10, 10))
    model = CachedEmbeddingBagCollection(tables, 4, weights=integer_weights(tables))
    loss = model(make_kjt(tables, bags([1, 2]))).values().sum()
    loss.backward(retain_graph=True)
    rows = {name: host.rows.clone() for name, host in model.hosts.items()}
    slots = {name: slot.clone() for name, slot in model.slots.items()}
    with pytest.raises(RuntimeError, match="a second backward through the lookup of batch 0: its backward already"):
        loss.backward()
    assert all(torch.equal(rows[n], model.hosts[n].rows) and torch.equal(slots[n], model.slots[n]) for n in rows)


def test_a_stale_backward_tried_again_is_still_stale() -> None:
    """Review: a backward refused as stale applies nothing, so trying it again must not say that
    its rows were already updated."""
    tables = make_tables(num_rows=(10, 10))
    model = CachedEmbeddingBagCollection(tables, 4)
    kjt = make_kjt(tables, bags([1]))
    plan = model.plan(model.prepare(kjt))
    model.swap(plan)
    loss = model(kjt, plan).values().sum()
    model.release(plan)
    for _ in range(2):
        with pytest.raises(StaleBatchError, match="after its slots were released"):
            loss.backward(retain_graph=True)


def test_sync_forward_without_backward_does_not_leak_protection() -> None:
    tables = make_tables(num_rows=(10, 10))
    model = CachedEmbeddingBagCollection(tables, 4)
    kjt = make_kjt(tables, bags([1]))
    for _ in range(3):
        model(kjt)  # grads on, backward never called
    model.flush()
    assert model.in_flight() == 0


def test_a_batch_too_big_for_the_cache_leaves_a_pending_lookup_usable() -> None:
    """The fallback for two lookups released the first one before knowing whether the second
    could fit at all: the refused lookup still made the first one's backward stale."""
    tables = make_tables()
    cached = CachedEmbeddingBagCollection(tables, 6, weights=integer_weights(tables))
    small = make_kjt(tables, {"f0a": [[1, 2]], "f0b": [[3]], "f1a": [[1]], "f1b": [[2]]})
    huge = make_kjt(tables, {"f0a": [[10, 11, 12, 13]], "f0b": [[14, 15, 16]], "f1a": [[1]], "f1b": [[2]]})
    pending = cached(small)
    protected = cached.in_flight()
    with pytest.raises(CacheTooSmallError):
        cached(huge)  # 7 keys of t0 in 6 rows, whatever is released
    assert cached.in_flight() == protected
    pending.values().sum().backward()  # StaleBatchError before the fix
    assert cached.in_flight() == 0


def test_a_ctrl_c_inside_a_release_leaves_it_to_be_finished() -> None:
    """A Ctrl-C between marking a table's plan released and lowering its protection counts kept
    its keys protected for good (the retry skipped it). Simulated at each line of
    ``EmbeddingCache.release`` up to the flag; after it no call runs, so CPython cannot raise
    a KeyboardInterrupt there."""
    import dis
    import inspect
    import sys

    from torchpipe.rec.cache import EmbeddingCache

    source, first = inspect.getsourcelines(EmbeddingCache.release)
    flag = first + next(i for i, line in enumerate(source) if "plan.released = True" in line)
    body = first + next(i for i, line in enumerate(source) if "with self._lock" in line)
    tables = make_tables()
    kjt = make_kjt(tables, {"f0a": [[1, 2]], "f0b": [[3]], "f1a": [[1]], "f1b": [[2]]})
    executed: set = set()

    def record(frame, event, arg):
        if event == "line":
            executed.add(frame.f_lineno)
        return record

    probe = CachedEmbeddingBagCollection(tables, 6, weights=integer_weights(tables))
    probe_plan = probe.plan(probe.prepare(kjt))
    probe.swap(probe_plan)
    sys.settrace(lambda frame, event, arg: record if frame.f_code is EmbeddingCache.release.__code__ else None)
    try:
        probe.release(probe_plan)
    finally:
        sys.settrace(None)
    for line in sorted(executed & set(range(body, flag + 1))):
        cached = CachedEmbeddingBagCollection(tables, 6, weights=integer_weights(tables))
        plan = cached.plan(cached.prepare(kjt))
        cached.swap(plan)

        def interrupt(frame, event, arg, line=line):
            if event == "line" and frame.f_code is EmbeddingCache.release.__code__ and frame.f_lineno == line \
                    and frame.f_locals["self"].name == "t1":
                raise KeyboardInterrupt
            return interrupt

        sys.settrace(lambda frame, event, arg: interrupt if frame.f_code is EmbeddingCache.release.__code__ else None)
        try:
            with pytest.raises(KeyboardInterrupt):
                cached.release(plan)
        finally:
            sys.settrace(None)
        cached.release(plan)  # the retry finishes what was cut short
        for cache in cached.caches.values():
            assert cache.protected_slots() == 0 and cache._protected == 0, line
        cached.flush()
    # After the flag, the first call must be the one that lowers the counts (CPython checks for
    # a pending KeyboardInterrupt only at calls and backward jumps); before the fix, torch calls
    # ran in between.
    instructions = list(dis.get_instructions(EmbeddingCache.release))
    start = next(i for i, ins in enumerate(instructions) if ins.opname == "STORE_ATTR" and ins.argval == "released")
    after = instructions[start + 1:]
    first_call = next(i for i, ins in enumerate(after) if ins.opname.startswith("CALL"))
    loads = [ins.argval for ins in after[:first_call] if ins.opname in ("LOAD_METHOD", "LOAD_ATTR", "LOAD_GLOBAL")]
    assert loads and loads[-1] == "index_add_", loads  # nothing called between: no torch.full_like(...) argument
    assert not any(ins.opname.startswith("JUMP_BACKWARD") for ins in after[:first_call])


# -- constructor arguments: the right exception type, naming the argument, before anything is built --

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")


@pytest.mark.parametrize("collection", ["cached", "full"])
@pytest.mark.parametrize("device, error, words", [
    ("npu:0", BackendUnavailableError, "torch_npu"),
    pytest.param("cuda:0", BackendUnavailableError, "'cuda:0' was requested but no cuda device", marks=NO_CUDA),
    ("gpu", ValueError, "invalid device 'gpu'"),
    ("meta", ValueError, "device 'meta': a meta device holds no rows for the tables"),
])
def test_collection_device_is_resolved_like_pipes(collection: str, device: str, error: type, words: str) -> None:
    tables = make_tables()
    with pytest.raises(error, match=words):
        if collection == "cached":
            CachedEmbeddingBagCollection(tables, 4, device=device)
        else:
            FullTableEmbeddingBagCollection(tables, device=device)


@pytest.mark.parametrize("cache_rows, error, words", [
    ({"t1": 4}, ValueError, r"cache_rows has no entry for tables \['t0'\]; give one for each of"),
    ({"t0": 4, "t1x": 4}, ValueError,
     r"cache_rows has no entry for tables \['t1'\] \(it names unknown tables \['t1x'\]\)"),
    ("10", TypeError, "cache_rows must be a positive int or a dict"),
    (None, TypeError, "cache_rows must be a positive int or a dict"),
    (10.5, TypeError, "cache_rows must be a positive int or a dict"),
    ([4, 4], TypeError, "cache_rows must be a positive int or a dict"),
    (0, ValueError, "cache_rows must be a positive int, got 0"),
    ({"t0": 0, "t1": 4}, ValueError, r"cache_rows\['t0'\] must be a positive int, got 0"),
    ({"t0": "4", "t1": 4}, TypeError, r"cache_rows\['t0'\] must be a positive int, got '4'"),
])
def test_collection_refuses_bad_cache_rows(cache_rows, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        CachedEmbeddingBagCollection(make_tables(), cache_rows)


@pytest.mark.parametrize("collection", ["cached", "full"])
@pytest.mark.parametrize("optimizer", ["sgd", torch.optim.SGD, SGD, torch.optim.SGD([torch.zeros(1)], lr=0.1)],
                         ids=["str", "torch_class", "row_optimizer_class", "torch_instance"])
def test_collection_refuses_an_optimizer_that_is_not_a_row_optimizer(collection: str, optimizer) -> None:
    words = r"optimizer must be a torchpipe.rec RowOptimizer instance \(SGD, RowWiseAdagrad, Adam\)"
    with pytest.raises(TypeError, match=words):
        if collection == "cached":
            CachedEmbeddingBagCollection(make_tables(), 4, optimizer=optimizer)
        else:
            FullTableEmbeddingBagCollection(make_tables(), optimizer=optimizer)


@pytest.mark.parametrize("collection", ["cached", "full"])
@pytest.mark.parametrize("weights, error, words", [
    ([torch.ones(40, 4)], TypeError, "weights must be a dict"),
    ({"t0": [[1.0] * 4] * 40}, TypeError, r"weights\['t0'\] must be a torch.Tensor of shape \(40, 4\)"),
    ("numpy", TypeError, r"weights\['t0'\] must be a torch.Tensor of shape \(40, 4\).*got ndarray"),
    ({"t0": torch.ones(40, 3)}, ValueError, r"weights\['t0'\] has shape \(40, 3\), expected \(40, 4\)"),
    ({"t1": torch.ones(40, 4)}, ValueError, r"weights\['t1'\] has shape \(40, 4\), expected \(24, 4\)"),
])
def test_collection_refuses_bad_weights(collection: str, weights, error: type, words: str) -> None:
    if isinstance(weights, str):  # numpy is only imported (and needed) here
        numpy = pytest.importorskip("numpy")
        weights = {"t0": numpy.ones((40, 4), numpy.float32)}
    with pytest.raises(error, match=words):
        if collection == "cached":
            CachedEmbeddingBagCollection(make_tables(), 4, weights=weights)
        else:
            FullTableEmbeddingBagCollection(make_tables(), weights=weights)


def test_dicts_may_hold_other_tables() -> None:
    """One dict for the tables of every rank: each rank's collection takes its own tables' entries,
    also when only another rank's tables have pretrained rows (its own start from init_fn)."""
    tables = make_tables()
    weights = integer_weights(tables)
    mine = CachedEmbeddingBagCollection(tables[:1], {"t0": 3, "t1": 5}, weights=weights)
    assert torch.equal(mine.hosts["t0"].weight, weights["t0"]) and list(mine.hosts) == ["t0"]
    assert mine.caches["t0"].cache_rows == 3
    assert torch.equal(FullTableEmbeddingBagCollection(tables[1:], weights=weights).full_weight("t1"), weights["t1"])
    other_rank = CachedEmbeddingBagCollection(tables[1:], 5, weights={"t0": weights["t0"]})
    assert list(other_rank.hosts) == ["t1"]


@pytest.mark.parametrize("build, error, words", [
    (lambda: SGD(lr="x"), TypeError, "lr must be a finite float >= 0, got 'x'"),
    (lambda: SGD(lr=None), TypeError, "lr must be a finite float >= 0, got None"),
    (lambda: SGD(lr=float("nan")), ValueError, "lr must be a finite float >= 0, got nan"),
    (lambda: SGD(lr=-0.1), ValueError, "lr must be a finite float >= 0, got -0.1"),
    (lambda: SGD(lr=float("inf")), ValueError, "lr must be a finite float >= 0, got inf"),
    (lambda: RowWiseAdagrad(lr=-1), ValueError, "lr must be a finite float >= 0"),
    (lambda: RowWiseAdagrad(eps=-1), ValueError, "eps must be a finite float >= 0, got -1"),
    (lambda: RowWiseAdagrad(eps="1e-8"), TypeError, "eps must be a finite float >= 0"),
    (lambda: Adam(lr=float("nan")), ValueError, "lr must be a finite float >= 0"),
    (lambda: Adam(beta1=1.0), ValueError, r"beta1 must be a float in \[0, 1\), got 1.0"),
    (lambda: Adam(beta1=-0.1), ValueError, r"beta1 must be a float in \[0, 1\), got -0.1"),
    (lambda: Adam(beta2=2), ValueError, r"beta2 must be a float in \[0, 1\), got 2"),
    (lambda: Adam(beta2="0.9"), TypeError, r"beta2 must be a float in \[0, 1\)"),
    (lambda: Adam(eps=-1e-8), ValueError, "eps must be a finite float >= 0"),
    # Review: below 1 in double precision, 1.0 in the rows' float32: NaN or inf rows after one step.
    (lambda: Adam(beta2=0.99999999), ValueError, r"beta2=0.99999999 rounds to 1.0 in float32, the rows' dtype"),
    (lambda: Adam(beta1=1 - 1e-9), ValueError, r"beta1=0.999999999 rounds to 1.0 in float32"),
    (lambda: Adam(eps=1e-50), ValueError, r"eps=1e-50 rounds to 0 in float32"),
    (lambda: RowWiseAdagrad(eps=1e-46), ValueError, r"eps=1e-46 rounds to 0 in float32"),
    (lambda: SGD(lr=1e-46), ValueError, r"lr=1e-46 rounds to 0 in float32.* \(at least 1.4013e-45\)"),
    (lambda: SGD(lr=1e39), ValueError, r"lr=1e\+39 is beyond float32's range, the rows' dtype"),
    (lambda: RowWiseAdagrad(eps=1e39), ValueError, r"eps=1e\+39 is beyond float32's range"),
    (lambda: Adam(lr=1e39), ValueError, r"lr=1e\+39 is beyond float32's range"),
])
def test_row_optimizers_refuse_bad_hyperparameters(build, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        build()


@pytest.mark.parametrize("kind", ["cached", "full"])
def test_an_optimizer_is_replaced_only_by_one_with_the_same_state(kind: str) -> None:
    """Review: ``ebc.optimizer = RowWiseAdagrad(...)`` on Adam rows was taken, and Adagrad
    trained on Adam's first moment as its accumulator; a new lr or new betas are fine."""
    tables = make_tables(num_rows=(10, 10))
    weights = integer_weights(tables)
    build = (lambda opt: CachedEmbeddingBagCollection(tables, 8, optimizer=opt, weights=weights)) \
        if kind == "cached" else (lambda opt: FullTableEmbeddingBagCollection(tables, optimizer=opt, weights=weights))
    model = build(Adam(lr=0.1))
    for other in (RowWiseAdagrad(lr=0.1), SGD(lr=0.1)):
        with pytest.raises(TypeError, match=rf"rows hold Adam's state \(10 columns in table 't0'\); "
                                            rf"{type(other).__name__} keeps another state"):
            model.optimizer = other
        assert model.optimizer == Adam(lr=0.1)
    for bad, words in ((None, "cannot be set to None"), (torch.optim.SGD, "RowOptimizer instance"),
                       (RowOptimizer(), "RowOptimizer instance")):
        with pytest.raises(TypeError, match=words):
            model.optimizer = bad
    model.optimizer = dataclasses.replace(model.optimizer, lr=0.5, beta1=0.5)
    assert model.optimizer == Adam(lr=0.5, beta1=0.5)
    kjt = make_kjt(tables, bags([1, 2]))
    reference = build(Adam(lr=0.5, beta1=0.5))
    for ebc in (model, reference):
        ebc(kjt).values().sum().backward()
        if kind == "cached":
            ebc.flush()
    for layout in model.layouts:
        assert torch.equal(model.full_weight(layout.name), reference.full_weight(layout.name))
    with pytest.raises(TypeError, match="RowOptimizer instance"):
        build(RowOptimizer())
    with pytest.raises(AttributeError, match="optimizer cannot be deleted"):
        del model.optimizer
    # Copies keep the replaced optimizer, and a collection pickled when ``optimizer`` was a plain
    # attribute (review) still loads and trains.
    assert copy.deepcopy(model).optimizer == pickle.loads(pickle.dumps(model)).optimizer == model.optimizer
    legacy = pickle.loads(pickle.dumps(model))
    legacy.__dict__["optimizer"] = legacy.__dict__.pop("_optimizer")
    revived = pickle.loads(pickle.dumps(legacy))
    assert revived.optimizer == model.optimizer
    revived(kjt).values().sum().backward()


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.9999999), (0.9999999, 0.999)])
def test_adams_first_step_is_lr_against_the_gradients_sign(betas) -> None:
    """Review: (1 - beta) was taken from the double beta and beta**t from the float32 one, so
    near 1 they did not cancel: a first step of 1.09 lr (beta2 = 0.9999999) where torch's
    Adam steps exactly lr."""
    optimizer = Adam(lr=1.0, beta1=betas[0], beta2=betas[1], eps=0.0)
    rows = torch.cat([torch.zeros(1, 3), optimizer.init_state(1, 3)], dim=1)
    stepped = optimizer.apply(rows, torch.tensor([[0.5, -3.0, 1e-3]]), 3)
    assert stepped[0, :3].tolist() == [-1.0, 1.0, -1.0]


def test_row_optimizers_accept_torch_optims_boundaries() -> None:
    assert SGD(lr=0).lr == 0 and SGD(lr=1).lr == 1
    assert RowWiseAdagrad(eps=0.0).eps == 0.0
    assert Adam(beta1=0.0, beta2=0.0, eps=0.0).beta1 == 0.0


@pytest.mark.parametrize("args, kwargs, error, words", [
    (("5", 4, 0), {}, TypeError, "num_rows must be a positive int, got '5'"),
    ((None, 4, 0), {}, TypeError, "num_rows must be a positive int, got None"),
    ((5.5, 4, 0), {}, TypeError, "num_rows must be a positive int, got 5.5"),
    ((0, 4, 0), {}, ValueError, "num_rows must be a positive int, got 0"),
    ((5, "4", 0), {}, TypeError, "dim must be a positive int, got '4'"),
    ((5, 0, 0), {}, ValueError, "dim must be a positive int, got 0"),
    ((5, 4, -1), {}, ValueError, "state_width must be an int >= 0, got -1"),
    ((5, 4, 1.0), {}, TypeError, "state_width must be an int >= 0, got 1.0"),
    ((5, 4, 0), {"weight": [[1.0] * 4] * 5}, TypeError, r"weight must be a torch.Tensor of shape \(5, 4\), got list"),
    ((5, 4, 1), {"state": [[0.0]] * 5}, TypeError, r"state must be a torch.Tensor of shape \(5, 1\), got list"),
    ((5, 4, 0), {"dtype": "float32"}, TypeError, "dtype must be a torch.dtype"),
])
def test_host_table_refuses_bad_arguments(args, kwargs, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        HostEmbeddingTable(*args, **kwargs)


@pytest.mark.parametrize("args, error, words", [
    ((0, 5), ValueError, "num_rows must be a positive int, got 0"),
    ((-1, 5), ValueError, "num_rows must be a positive int, got -1"),
    (("10", 5), TypeError, "num_rows must be a positive int, got '10'"),
    ((10, "5"), TypeError, "cache_rows must be a positive int, got '5'"),
    ((10, 2.5), TypeError, "cache_rows must be a positive int, got 2.5"),
    ((10, 0), ValueError, "cache_rows must be a positive int, got 0"),
    ((10, 5, None), TypeError, "policy must be a str"),
    ((10, 5, "fifo"), ValueError, "unknown eviction policy 'fifo'"),
])
def test_embedding_cache_refuses_bad_arguments(args, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        EmbeddingCache(*args)


def test_a_plan_interrupted_before_its_first_table_leaves_nothing_behind() -> None:
    """The batch counted as planned-not-swapped for good, and every later direct lookup was refused."""
    tables = make_tables(num_rows=(10, 10))
    model = CachedEmbeddingBagCollection(tables, 4, weights=integer_weights(tables))
    plan_swap = model.caches["t0"].plan_swap

    def interrupted(keys):
        raise KeyboardInterrupt

    model.caches["t0"].plan_swap = interrupted
    kjt = make_kjt(tables, {f: [[1, 2], [3]] for t in tables for f in t.feature_names})
    with pytest.raises(KeyboardInterrupt):
        model(kjt)
    model.caches["t0"].plan_swap = plan_swap
    model(kjt).values().sum().backward()  # was refused: "1 batches planned and not swapped in yet"
    model.flush()
    assert model.in_flight() == 0


def test_numpy_counts_and_tensor_learning_rates_are_numbers() -> None:
    """The argument checks refused what worked before: NumPy ints and a tensor lr (torch.optim takes one)."""
    numpy = pytest.importorskip("numpy")
    tables = make_tables(num_rows=(10, 10))
    weights = integer_weights(tables)
    model = CachedEmbeddingBagCollection(tables, numpy.int64(4), optimizer=SGD(lr=torch.tensor(0.5)), weights=weights)
    reference = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=0.5), weights=weights)
    kjt = make_kjt(tables, {f: [[1, 2], [3]] for t in tables for f in t.feature_names})
    model(kjt).values().sum().backward()
    reference(kjt).values().sum().backward()
    assert torch.equal(model.full_weight("t0"), reference.full_weight("t0"))
    assert model.caches["t1"].cache_rows == 4


@pytest.mark.parametrize("collection", ["cached", "full"])
def test_collection_tables_must_be_configs_with_whole_sizes(collection: str) -> None:
    from torchrec import EmbeddingBagConfig

    def config(**sizes):
        return EmbeddingBagConfig(name="t", feature_names=["f"], **{"num_embeddings": 8, "embedding_dim": 4, **sizes})

    cases = [
        (None, TypeError, "tables must be a list of torchrec EmbeddingBagConfig, got NoneType: None"),
        ({"t": config()}, TypeError, "tables must be a list of torchrec EmbeddingBagConfig, got dict"),
        ([config(), "t1"], TypeError, "tables\\[1\\] must be a torchrec EmbeddingBagConfig, got str: 't1'"),
        # TorchRec's own collection refuses these; int() would have made 2 rows of 4 silently.
        ([config(num_embeddings=2.5)], TypeError, "table 't': num_embeddings must be a positive int, got 2.5"),
        ([config(embedding_dim=4.9)], TypeError, "table 't': embedding_dim must be a positive int, got 4.9"),
    ]
    for tables, error, words in cases:
        with pytest.raises(error, match=words):
            if collection == "cached":
                CachedEmbeddingBagCollection(tables, 4)
            else:
                FullTableEmbeddingBagCollection(tables)


def test_host_table_checks_a_ticket_before_writing() -> None:
    table = HostEmbeddingTable(4, 2, 0, weight=torch.ones(4, 2))
    for call, words in ((lambda: table.update(torch.tensor([1]), torch.zeros(1, 2), ticket="x"),
                         "ticket must be a WriteTicket from this table or None, got str: 'x'"),
                        (lambda: table.update(torch.tensor([1]), [[0.0, 0.0]]), "rows must be a tensor, got list"),
                        (lambda: table.lookup(torch.tensor([1]), ticket=3), "got int: 3"),
                        (lambda: table.cancel(None), "cancel takes a WriteTicket from this table, got NoneType")):
        with pytest.raises(TypeError, match=words):
            call()
    assert torch.equal(table.rows, torch.ones(4, 2))  # the refused update wrote nothing


def test_low_level_keys_out_of_range_are_refused_before_anything_changes() -> None:
    """Review: reserve_write([-1]) wrapped to the last row and left a write there that could never
    land (a later ordered lookup of that row blocked for good); is_cached([-1]) answered for the
    last row."""
    table = HostEmbeddingTable(10, 4, 0)
    for keys, error, words in ((torch.tensor([-1]), IndexError, r"out of range \[0, 10\): e.g. \[-1\]"),
                               (torch.tensor([10]), IndexError, r"e.g. \[10\]"),
                               (torch.tensor([[1]]), TypeError, "1-D integer tensor"),
                               (torch.tensor([1.0]), TypeError, "1-D integer tensor")):
        with pytest.raises(error, match=words):
            table.reserve_write(keys)
    assert table.pending_writes() == 0
    first = table.reserve_write(torch.tensor([9]))
    with pytest.raises(RuntimeError, match="reserved twice"):
        table.reserve_write(torch.tensor([9]))
    second = table.reserve_write(torch.tensor([], dtype=torch.int64))
    assert second.seq == first.seq + 1  # the refused reservation took no place in the order
    table.update(torch.tensor([9]), torch.ones(1, 4), first)
    assert torch.equal(table.lookup(torch.tensor([9]), second), torch.ones(1, 4))
    cache = EmbeddingCache(10, 4)
    cache.plan_swap(torch.tensor([9]))
    with pytest.raises(ValueError, match=r"keys out of range \[0, 10\): e.g. \[-1\]"):
        cache.is_cached(torch.tensor([-1]))
    with pytest.raises(TypeError, match="int32 or int64 tensor, got list"):
        cache.is_cached([9])
    assert cache.is_cached(torch.tensor([9, 8])).tolist() == [True, False]


def test_table_accessors_name_the_tables_and_cache_rows_are_plain_ints() -> None:
    tables = make_tables(num_rows=(10, 10))
    model = CachedEmbeddingBagCollection(tables, {"t0": torch.tensor(4), "t1": 4})
    assert all(type(cache.cache_rows) is int for cache in model.caches.values())
    for call in (lambda: model.full_weight("nope"), lambda: model.optimizer_state("nope"),
                 lambda: model.load_optimizer_state("nope", torch.zeros(10, 0))):
        with pytest.raises(KeyError, match=r"no table named 'nope'; the tables are \['t0', 't1'\]"):
            call()
    with pytest.raises(TypeError, match=r"must be a torch.Tensor of shape \(10, 0\) .*got list"):
        model.load_optimizer_state("t0", [[0.0]] * 10)
