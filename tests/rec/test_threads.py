"""Direct lookups on one collection from several threads (a serving process, two trainers).

They run one at a time (as ``Pipe`` serves two threads), and a backward on one thread never
races another thread's lookup for its rows. Review (helper-130): two threads doing ``no_grad``
lookups got "batches planned and not swapped in yet" in most calls, though no pipeline
existed, and with grad also "swap plan ... released twice".
"""

from __future__ import annotations

import threading

import torch
from rec_helpers import integer_weights, loss_coefficients, make_kjt, make_tables

from torchpipe.rec import SGD, CachedEmbeddingBagCollection, FullTableEmbeddingBagCollection

CALLS = 150


def _batches(tables, keys_from: int, keys_to: int, seed: int):
    """Batches of 4 bags per feature, keys drawn from ``[keys_from, keys_to)``."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(CALLS):
        bags = {feature: [torch.randint(keys_from, keys_to, (int(n),), generator=g).tolist()
                          for n in torch.randint(0, 4, (4,), generator=g)]
                for table in tables for feature in table.feature_names}
        batches.append(make_kjt(tables, bags))
    return batches


def _run_in_threads(work, *args_per_thread) -> list:
    errors: list = []

    def run(*args):
        try:
            work(*args)
        except BaseException as exc:  # noqa: B902 - reported below, with the thread's traceback
            errors.append(exc)

    threads = [threading.Thread(target=run, args=args) for args in args_per_thread]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a lookup thread hung"
    return errors


def test_no_grad_lookups_from_two_threads_are_all_served_and_right() -> None:
    # At most 24 keys of a table per batch, in a cache of 30 rows: most lookups swap.
    tables = make_tables(num_rows=(200, 120))
    weights = integer_weights(tables)
    model = CachedEmbeddingBagCollection(tables, 30, weights=weights)
    reference = FullTableEmbeddingBagCollection(tables, weights=weights)
    work = {seed: _batches(tables, 0, 120, seed) for seed in (1, 2)}
    with torch.no_grad():
        expected = {seed: [reference(kjt).values() for kjt in batches] for seed, batches in work.items()}
    wrong: list = []

    def serve(seed: int) -> None:
        with torch.no_grad():
            for i, kjt in enumerate(work[seed]):
                if not torch.equal(model(kjt).values(), expected[seed][i]):
                    wrong.append((seed, i))

    errors = _run_in_threads(serve, (1,), (2,))
    assert not errors, errors[:3]
    assert not wrong
    assert model.in_flight() == 0 and model.pending_writes() == 0


def test_training_lookups_from_two_threads_apply_every_update_once() -> None:
    # Disjoint keys per thread: the updates commute, so the tables must equal the full-table
    # reference that ran one thread's batches after the other's (integer values: exact).
    # Room for both threads' live lookups (24 keys each at most), not for the 120 keys used.
    tables = make_tables(num_rows=(200, 120))
    weights = integer_weights(tables)
    model = CachedEmbeddingBagCollection(tables, 56, optimizer=SGD(lr=1.0), weights=weights)
    reference = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0), weights=weights)
    work = {0: _batches(tables, 0, 60, 3), 1: _batches(tables, 60, 120, 4)}
    width = sum(len(t.feature_names) * t.embedding_dim for t in tables)
    coefficients = {seed: loss_coefficients(width, 4, CALLS, seed=seed + 10) for seed in work}

    def train(seed: int, collection) -> None:
        for kjt, coefficient in zip(work[seed], coefficients[seed]):
            (collection(kjt).values() * coefficient).sum().backward()

    errors = _run_in_threads(train, (0, model), (1, model))
    assert not errors, errors[:3]
    for seed in work:
        train(seed, reference)
    model.flush()
    for layout in model.layouts:
        assert torch.equal(model.full_weight(layout.name), reference.full_weight(layout.name)), layout.name
    assert model.in_flight() == 0 and model.pending_writes() == 0


def test_a_lookup_that_needs_the_rows_of_a_backward_in_progress_waits_for_its_update(monkeypatch) -> None:
    # Thread A's backward is held inside its row update; the main thread's lookup needs A's
    # slots (the cache holds one batch, not both), so it must release A's lookup, and may
    # only once A's update is done: released in the middle, A's update would land on slots
    # that hold the main thread's rows by then, and A would release its plan a second time.
    import torchpipe.rec.fused_lookup as fused_lookup

    tables = make_tables(num_rows=(40,))
    weights = integer_weights(tables)
    model = CachedEmbeddingBagCollection(tables, 8, optimizer=SGD(lr=1.0), weights=weights)
    reference = FullTableEmbeddingBagCollection(tables, optimizer=SGD(lr=1.0), weights=weights)
    first = make_kjt(tables, {"f0a": [[0, 1], [2]], "f0b": [[3, 4], [5]]})
    second = make_kjt(tables, {"f0a": [[10, 11], [12]], "f0b": [[13, 14], [15]]})
    updating, go = threading.Event(), threading.Event()
    update = fused_lookup.apply_row_update

    def held_update(*args, **kwargs):
        if threading.current_thread().name == "backward-a":
            updating.set()
            go.wait(timeout=10)
        return update(*args, **kwargs)

    monkeypatch.setattr(fused_lookup, "apply_row_update", held_update)
    out = model(first).values()
    errors: list = []

    def run(work) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: B902 - checked below
            errors.append(exc)

    a = threading.Thread(target=run, args=(lambda: out.sum().backward(),), name="backward-a")
    a.start()
    assert updating.wait(timeout=10)
    b = threading.Thread(target=run, args=(lambda: model(second).values().sum().backward(),))
    b.start()
    b.join(timeout=0.5)  # long enough for it to release and evict A's rows, if it may
    go.set()
    a.join(timeout=30)
    b.join(timeout=30)
    assert not a.is_alive() and not b.is_alive()
    assert not errors, errors
    for kjt in (first, second):
        reference(kjt).values().sum().backward()
    model.flush()
    assert torch.equal(model.full_weight("t0"), reference.full_weight("t0"))
    assert model.in_flight() == 0


def test_a_lookup_never_reads_rows_that_a_backward_on_another_thread_is_updating(monkeypatch) -> None:
    # Review (helper-132): a lookup on thread B, past its own start when thread A's backward
    # began, read the rows while A's update was between its two tables: t0 updated, t1 not.
    import torchpipe.rec.fused_lookup as fused_lookup

    tables = make_tables(num_rows=(40, 24))
    model = CachedEmbeddingBagCollection(tables, 16, optimizer=SGD(lr=1.0), weights=integer_weights(tables))
    kjt = make_kjt(tables, {feature: [[0, 1]] for table in tables for feature in table.feature_names})
    with torch.no_grad():
        before = model(kjt).values().clone()
    out = model(kjt).values()
    in_lookup, resume, updating, go = (threading.Event() for _ in range(4))
    update, swaps = fused_lookup.apply_row_update, model.finish_swaps

    def held_update(*args, **kwargs):
        result = update(*args, **kwargs)
        if threading.current_thread().name == "backward-a" and not updating.is_set():
            updating.set()  # one table updated, the other not yet
            go.wait(timeout=10)
        return result

    def held_swaps(*args, **kwargs):  # B, inside its lookup, before it plans and reads
        if threading.current_thread().name == "lookup-b" and not in_lookup.is_set():
            in_lookup.set()
            resume.wait(timeout=10)
        return swaps(*args, **kwargs)

    monkeypatch.setattr(fused_lookup, "apply_row_update", held_update)
    monkeypatch.setattr(model, "finish_swaps", held_swaps)
    seen: list = []

    def look() -> None:
        with torch.no_grad():
            seen.append(model(kjt).values().clone())

    b = threading.Thread(target=look, name="lookup-b")
    b.start()
    assert in_lookup.wait(timeout=10)
    a = threading.Thread(target=lambda: out.sum().backward(), name="backward-a")
    a.start()
    updating.wait(timeout=1.0)  # A gets here only if it may update while B looks up
    resume.set()
    b.join(timeout=30)
    go.set()
    a.join(timeout=30)
    assert not a.is_alive() and not b.is_alive()
    with torch.no_grad():
        after = model(kjt).values()
    assert len(seen) == 1
    assert torch.equal(seen[0], before) or torch.equal(seen[0], after), "a lookup read rows half updated"
