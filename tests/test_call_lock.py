"""CallLock: a call's own thread sees that it holds the lock and can leave an action for its end."""
from __future__ import annotations

import threading

import pytest

from torchpipe.call_lock import CallLock


def test_the_thread_inside_a_call_sees_it_holds_the_lock_and_others_do_not():
    lock = CallLock()
    seen = {}

    def inside():
        seen["here"] = lock.held_here()
        other = threading.Thread(target=lambda: seen.setdefault("other", lock.held_here()))
        other.start()
        other.join()
        return "result"

    assert not lock.held_here()
    assert lock.call(inside) == "result"
    assert seen == {"here": True, "other": False}
    assert not lock.held_here()


@pytest.mark.parametrize("fails", [False, True])
def test_an_action_left_inside_a_call_runs_once_the_lock_is_free(fails):
    lock = CallLock()
    ran = []

    def inside():
        lock.after_call(lambda: ran.append(lock.acquire(timeout=0)))  # the lock is free by then
        assert ran == []
        if fails:
            raise ValueError("the call failed")

    if fails:
        with pytest.raises(ValueError, match="the call failed"):
            lock.call(inside)
    else:
        lock.call(inside)
    assert ran == [True]
    lock.release()
    lock.call(lambda: None)  # nothing is left over for the next call
    assert ran == [True]


def test_an_action_can_only_be_left_from_inside_a_call():
    with pytest.raises(RuntimeError, match="after_call"):
        CallLock().after_call(lambda: None)
