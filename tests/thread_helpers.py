"""Thread helpers shared by the tests: waiting for threads to exit, torch's intra-op threads."""
import threading
import time

import pytest
import torch


def pretend_cores(monkeypatch, count):
    """Make torchpipe see ``count`` cores (its affinity mask and ``os.cpu_count``) for one test."""
    import torchpipe.workers as workers_module

    monkeypatch.setattr(workers_module.os, "sched_getaffinity", lambda pid: set(range(count)), raising=False)
    monkeypatch.setattr(workers_module.os, "cpu_count", lambda: count)
    monkeypatch.setattr(workers_module, "_caller_threads", lambda: count)  # and a caller that leaves them all


def torchpipe_threads():
    """The live threads torchpipe started (workers and host pools are named 'torchpipe...')."""
    return {t for t in threading.enumerate() if t.name.startswith("torchpipe")}


def wait_until_gone(threads, timeout=5.0):
    """Poll until every thread in ``threads`` has exited; return the ones still alive."""
    deadline = time.monotonic() + timeout
    alive = [t for t in threads if t.is_alive()]
    while alive and time.monotonic() < deadline:
        time.sleep(0.01)
        alive = [t for t in alive if t.is_alive()]
    return alive


@pytest.fixture(autouse=True)
def single_torch_thread():
    """Run a test with one intra-op thread in torch, restored afterwards.

    A conftest that imports this makes it automatic for its folder: for tiny tensors on a
    busy 2-core box the intra-op pool costs milliseconds per op in barrier waits, and
    reference loops must use the same thread count as the workers to match bitwise.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
