"""HostEmbeddingTable: rows, thread safety, ticket ordering and abort."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from torchpipe.rec import CacheAbortedError, HostEmbeddingTable


def test_init_lookup_update_and_pinning_only_with_an_accelerator() -> None:
    weight = torch.arange(12.0).view(6, 2)
    table = HostEmbeddingTable(6, 2, 1, weight=weight)
    assert table.rows.is_pinned() == torch.cuda.is_available()
    assert torch.equal(table.weight, weight) and torch.equal(table.state, torch.zeros(6, 1))
    table.update(torch.tensor([4, 1]), torch.tensor([[9.0, 9.0, 1.0], [8.0, 8.0, 2.0]]))
    assert torch.equal(table.lookup(torch.tensor([1, 4])), torch.tensor([[8.0, 8.0, 2.0], [9.0, 9.0, 1.0]]))
    with pytest.raises(IndexError):
        table.lookup(torch.tensor([6]))
    with pytest.raises(ValueError):
        HostEmbeddingTable(6, 2, 0, weight=torch.zeros(5, 2))


def test_lookup_waits_for_earlier_ticket_only() -> None:
    table = HostEmbeddingTable(4, 1, 0)
    first = table.reserve_write(torch.tensor([2]))
    second = table.reserve_write(torch.tensor([], dtype=torch.int64))
    # A reader before the first ticket does not wait (it must see the old row).
    assert table.lookup(torch.tensor([2]), ticket=first).item() == 0.0
    got: list[float] = []
    reader = threading.Thread(target=lambda: got.append(table.lookup(torch.tensor([2]), ticket=second).item()))
    reader.start()
    time.sleep(0.1)
    assert got == [] and reader.is_alive()  # blocked on the pending write of key 2
    table.update(torch.tensor([2]), torch.tensor([[5.0]]), ticket=first)
    reader.join(5)
    assert got == [5.0] and table.pending_writes() == 0


def test_abort_wakes_a_blocked_lookup_and_clear_restores() -> None:
    table = HostEmbeddingTable(4, 1, 0)
    pending = table.reserve_write(torch.tensor([1]))
    later = table.reserve_write(torch.tensor([], dtype=torch.int64))
    errors: list[BaseException] = []

    def read() -> None:
        try:
            table.lookup(torch.tensor([1]), ticket=later)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.05)
    cause = ValueError("boom in another task")
    table.abort(cause)
    reader.join(5)
    assert not reader.is_alive()
    assert isinstance(errors[0], CacheAbortedError) and errors[0].__cause__ is cause
    table.update(torch.tensor([1]), torch.tensor([[3.0]]), ticket=pending)  # updates still land
    table.clear_abort()
    assert table.lookup(torch.tensor([1]), ticket=later).item() == 3.0


def test_concurrent_updates_and_lookups_see_whole_rows() -> None:
    table = HostEmbeddingTable(64, 8, 8)
    stop = threading.Event()
    torn: list[torch.Tensor] = []

    def writer(value: float) -> None:
        while not stop.is_set():
            table.update(torch.arange(64), torch.full((64, 16), value))

    def reader() -> None:
        while not stop.is_set():
            rows = table.lookup(torch.arange(64))
            if not bool((rows == rows[0, 0]).all()):
                torn.append(rows)

    threads = [threading.Thread(target=writer, args=(v,)) for v in (1.0, 2.0)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join()
    assert not torn
