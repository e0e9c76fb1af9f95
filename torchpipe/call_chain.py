"""Whom a thread works for: the pipelines whose step waits on it, and the RNG locks held for it.

A stage runs on a worker thread and may call another ``Pipe`` (one nested in a layer), or
hand work to a host thread that does. The thread's identity cannot tell that such a call
comes from inside a step, so the chain of callers travels with the work instead (each job
of a step adopts its caller's chain; so does each ``HostPool`` task). That lets a pipeline

* refuse a call from anything its own step waits on (its stage, a host task of its stage,
  a pipeline its stage called), which would otherwise deadlock on its step lock, and
* pass a generator lock down: a checkpointed forward holds its device generator's lock, and
  a pipeline it calls must not wait for that lock. Its stages take a lock of their own,
  one level down, which still keeps them from drawing at the same time as each other.
"""
from __future__ import annotations

import collections
import functools
import itertools
import threading
import time
from types import MappingProxyType
from typing import Callable, FrozenSet, List, Mapping, Optional, Tuple

import torch

__all__ = ["Cancel", "Chain", "RNGWaitAborted", "current", "adopt", "new_owner", "enter_rng_section",
           "leave_rng_section", "holds_rng_section", "LockWaits"]

# How often a wait for a generator's lock looks whether its step was aborted. The wait itself
# ends as soon as the lock is free; this only bounds how late an abort is seen.
_CANCEL_POLL_S = 0.05


class Cancel:
    """Set once the step it belongs to aborts: a wait of that step's work for a generator's
    lock (held by another pipeline's stage, which may never let go) then gives up."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False


class RNGWaitAborted(RuntimeError):
    """A stage's wait for a random generator's lock ended because its step was aborted."""


class HeldSection:
    """A generator lock held by an RNG section, as seen by the work that section starts.

    ``sub_lock`` is what that work takes instead of the generator's lock; ``held`` turns
    False when the section ends, after which work that kept the chain (a host task that
    outlived the step) takes the generator's own lock again.
    """

    __slots__ = ("sub_lock", "held")

    def __init__(self) -> None:
        self.sub_lock = threading.Lock()
        self.held = True


LockWaits = List[Tuple[int, float, float]]
"""Waits for a random generator's lock: (thread ident, start, end) ``perf_counter`` readings."""


class Chain:
    """The steps a piece of work serves, and the RNG sections it runs inside."""

    __slots__ = ("owners", "rng_locks", "cancels", "waits")

    def __init__(self, owners: FrozenSet[int] = frozenset(),
                 rng_locks: Mapping[int, HeldSection] = MappingProxyType({}), cancels: Tuple[Cancel, ...] = (),
                 waits: Optional[LockWaits] = None) -> None:
        self.owners = owners
        self.rng_locks = rng_locks
        self.cancels = cancels  # one per step served: any set aborts this work's lock waits
        self.waits = waits  # the innermost step's record of waits for a generator's lock, if kept

    def serving(self, owner: int, cancel: Optional[Cancel] = None, waits: Optional[LockWaits] = None) -> "Chain":
        """This chain, one level down: work done for step ``owner`` (aborted when ``cancel``
        is set) on behalf of this chain's caller, its waits for a generator's lock noted in
        ``waits`` (else where this chain notes them)."""
        return Chain(self.owners | {owner}, self.rng_locks, self.cancels if cancel is None else self.cancels + (cancel,),
                     self.waits if waits is None else waits)


ROOT = Chain()


class _Current(threading.local):
    chain: Chain = ROOT


_current = _Current()
_owner_tokens = itertools.count(1)


# Both run around every job and call: built-in partials, so that neither runs a Python frame
# (on this project's VMs a frame run right after a thread slept costs microseconds).
current: Callable[[], Chain] = functools.partial(getattr, _current, "chain")
current.__doc__ = "The chain of the work this thread is doing now."

adopt: Callable[[Chain], None] = functools.partial(setattr, _current, "chain")
adopt.__doc__ = "Make ``chain`` this thread's: a worker does so before each job or host task."


def new_owner() -> int:
    """A token naming one step in chains (never reused, unlike ``id``)."""
    return next(_owner_tokens)


def holds_rng_section(generator: torch.Generator) -> bool:
    """Whether this thread's work runs inside an RNG section of ``generator`` still held."""
    section = _current.chain.rng_locks.get(id(generator))
    return section is not None and section.held


_LOCK_TYPE = type(threading.Lock())
_TAKE_WAITING = _LOCK_TYPE.acquire  # called on the lock: a plain blocking acquire, which Ctrl-C interrupts
_TAKE_POLLING = functools.partial(_LOCK_TYPE.acquire, timeout=_CANCEL_POLL_S)
_TAKE_FREE = functools.partial(_LOCK_TYPE.acquire, blocking=False)  # only if no one holds it: no wait

class HeldLock:
    """A lock this thread takes, and the one call that gives it back: safe against Ctrl-C.

    Python raises a pending ``KeyboardInterrupt`` (on the main thread) only between bytecodes:
    when a call returns, on entry to a Python function, on a loop's back edge; never inside a
    C function. ``lock.acquire()`` followed by a store of its result has such a point in
    between, where an interrupt would leave the lock taken with nothing to say so: held for
    good, and every later checkpointed step on that generator hangs. So here the lock is taken
    *and recorded* in one C call (``filter`` around ``acquire``, feeding ``list.extend``), and
    given back by one C call that releases only what was recorded, once (a ``deque`` draining
    an iterator over the record, made before anything was taken): a cleanup after an interrupt
    at any point gives back exactly what was taken, and calling it again does nothing.
    """

    __slots__ = ("taken", "give_back")

    def __init__(self) -> None:
        self.taken: List[threading.Lock] = []
        self.give_back = functools.partial(collections.deque, map(_LOCK_TYPE.release, iter(self.taken)), 0)

    def take(self, lock: threading.Lock, cancels: Tuple[Cancel, ...], waits: Optional[LockWaits] = None) -> None:
        """``lock.acquire()``, given up with `RNGWaitAborted` once a step of ``cancels`` aborts: a
        worker's wait must end with its step (another pipeline's stage stuck inside its section
        would otherwise hold this worker, and this pipeline, for as long as it is stuck)."""
        taken = self.taken
        taken.extend(filter(_TAKE_FREE, (lock,)))
        if taken:  # the common case: nobody held it
            return
        start = time.perf_counter()
        try:
            if not cancels:  # the caller's own thread: a plain wait, which Ctrl-C interrupts
                taken.extend(filter(_TAKE_WAITING, (lock,)))
                return
            while not taken:
                taken.extend(filter(_TAKE_POLLING, (lock,)))
                if not taken and any(cancel.cancelled for cancel in cancels):
                    raise RNGWaitAborted("this stage's step was aborted while it waited for a random generator's "
                                         "lock, which another stage (of another pipeline, or a thread of yours) holds")
        finally:
            if waits is not None:  # (thread, start, end): the step's record counts it as idle
                waits.append((threading.get_ident(), start, time.perf_counter()))


RNGSection = Tuple[HeldLock, Chain, HeldSection]


def enter_rng_section(generator: torch.Generator, lock: threading.Lock) -> RNGSection:
    """Take ``generator``'s lock for this chain: ``lock`` at the top, the caller's sub-lock below.

    The sub-lock applies only while the section that made it still holds the generator;
    otherwise (work that outlived it) this takes ``lock`` itself. While the new section is
    held, work this thread starts (a nested pipeline's stages) gets a sub-lock of its own.
    Give the result to :func:`leave_rng_section`. All or nothing: an exception (Ctrl-C
    included) leaves nothing taken and the chain as it was.
    """
    chain = _current.chain
    outer = chain.rng_locks.get(id(generator))
    held = HeldLock()
    try:
        if outer is not None:
            held.take(outer.sub_lock, chain.cancels, chain.waits)
            if not outer.held:  # the section ended (work that outlived it): the generator's own lock
                held.give_back()
                held = HeldLock()
        if not held.taken:
            held.take(lock, chain.cancels, chain.waits)
        section = HeldSection()
        _current.chain = Chain(chain.owners, MappingProxyType({**chain.rng_locks, id(generator): section}), chain.cancels,
                               chain.waits)
        return held, chain, section
    except BaseException:  # noqa: B902 - Ctrl-C too: give back what was taken, then raise
        _current.chain = chain
        held.give_back()
        raise


def leave_rng_section(entered: Optional[RNGSection]) -> None:
    """Release what :func:`enter_rng_section` took and restore the chain.

    Waits for work under this section's sub-lock to leave it first, so that nothing it
    started draws after the generator's lock went to someone else. The lock is given back
    even if this is interrupted (Ctrl-C) half way, and only once: calling this again sets
    the chain back and waits for the sub-lock again, but releases nothing.

    A Ctrl-C that interrupts that wait (work under the sub-lock that does not return: a
    nested pipeline's stage, left behind) gives the generator's lock back while that work
    may still draw under the sub-lock: the step is interrupted anyway, and the lock held
    for good would hang every later step on the generator.
    """
    if entered is not None:
        held, chain, section = entered
        try:
            _current.chain = chain
            with section.sub_lock:
                section.held = False
        finally:
            held.give_back()
