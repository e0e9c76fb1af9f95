"""Bad input gets a clear error before any state changes."""

from __future__ import annotations

import pytest
import torch
from rec_helpers import integer_weights, make_kjt, make_tables
from torchrec import KeyedJaggedTensor

from torchpipe.rec import CachedEmbeddingBagCollection, CacheTooSmallError, RecInputError, StaleBatchError


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


def bags(keys_a: list[int]) -> dict[str, list[list[int]]]:
    return {"f0a": [keys_a, [1]], "f0b": [[2], []], "f1a": [[1], [2]], "f1b": [[3], [3]]}


@pytest.mark.parametrize("case, error, words", [
    ("out_of_range", RecInputError, "out of range"),
    ("negative", RecInputError, "out of range"),
    ("unknown_feature", RecInputError, "unknown feature"),
    ("missing_feature", RecInputError, "missing"),
    ("float_keys", RecInputError, "int32 or int64"),
    ("too_many_keys", CacheTooSmallError, "cache_rows=4"),
])
def test_bad_input_is_refused_before_any_state_change(case: str, error: type, words: str) -> None:
    model, snapshot = model_and_state()
    tables = make_tables(num_rows=(10, 10))
    if case == "out_of_range":
        kjt = make_kjt(tables, bags([1, 10]))
    elif case == "negative":
        kjt = make_kjt(tables, bags([-1]))
    elif case == "unknown_feature":
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0a", "f0b", "f1a", "f1b", "zzz"], torch.arange(5),
                                                  torch.ones(10, dtype=torch.int64))
    elif case == "missing_feature":
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0a", "f0b", "f1a"], torch.arange(3),
                                                  torch.ones(6, dtype=torch.int64))
    elif case == "float_keys":
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0a", "f0b", "f1a", "f1b"], torch.ones(8),
                                                  torch.ones(8, dtype=torch.int64))
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
