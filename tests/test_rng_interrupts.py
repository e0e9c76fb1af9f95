"""Ctrl-C inside a generator section on the caller's thread leaves no lock taken and no state changed.

A checkpointed partition's recompute runs in backward on the thread that called
``backward()`` (the caller's, for CPU stages), under the generator's lock and at the
generator state its forward saw. Python raises a pending ``KeyboardInterrupt`` between
bytecodes; a signal that arrives while a C call runs (``lock.acquire()``, the generator's
``get_state()``, where the time goes) is raised as that call returns. These tests raise one
there, at each C call of the section code (``torchpipe/call_chain.py``,
``torchpipe/checkpoint.py``, ``contextlib``) in turn, through a profile function, and check what it left:
the generator's lock must be free (else the next checkpointed step waits for it for good),
this thread's chain and the checkpoint flags as they were, and the generator's state where
it belongs.

Not covered, and not closable in Python: a signal that arrives in the few bytecodes between
a cleanup's call (in a ``finally``) and the first line of the function it calls is raised on
that function's entry, and skips it. Raising at every function entry too fails these tests
there (``leave_rng_section`` called from a ``finally``).

Shown to fail without the fix: with the old ``_acquire`` (``lock.acquire()``, and nothing to
record it before the call returned), an interrupt at the end of that acquire left the lock
held in every test below; with the new acquire but the old recompute context, an interrupt
while it read or set the generator's state left the lock held (three tests); with
``contextlib.ExitStack`` holding a stage's recompute contexts, an interrupt in its bookkeeping
left the lock held (the two-generator and the end-to-end backward tests).
"""
import contextlib
import sys
import threading
from typing import Any, Callable

import pytest
import torch
from torch import nn

import torchpipe.call_chain as call_chain
import torchpipe.checkpoint as checkpoint_module
from torchpipe import Pipe
from torchpipe.checkpoint import RNGGuard, StageRNG, _lock_for, draw_step_seed, settled_state

pytestmark = pytest.mark.timeout(120)

# contextlib too: the generator-based contexts a recompute enters (frozen running statistics,
# skip replay) run through it, and so did the ExitStack that once held the recompute contexts.
SECTION_FILES = frozenset({call_chain.__file__, checkpoint_module.__file__, contextlib.__file__})


class InterruptAt:
    """A profile function that raises KeyboardInterrupt at the end of the ``n``-th C call made
    from the section code on this thread (where a real Ctrl-C that arrived during it lands)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0
        self.fired = False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "c_return" or frame.f_code.co_filename not in SECTION_FILES:
            return
        if self.seen == self.n:
            self.fired = True
            sys.setprofile(None)
            raise KeyboardInterrupt
        self.seen += 1


def interrupted_once_each(scenario: Callable[..., None], check: Callable[[], None],
                          prepare: Callable[[], tuple] = tuple, limit: int = 400) -> int:
    """Run ``scenario(*prepare())`` with an interrupt at its first C call, then its second, ...
    until it runs through uninterrupted; ``check()`` after each. ``prepare`` runs before the
    interrupts are armed. Returns how many points were interrupted."""
    for n in range(limit):
        arguments = prepare()
        injector = InterruptAt(n)
        sys.setprofile(injector)
        try:
            scenario(*arguments)
        except KeyboardInterrupt:
            assert injector.fired, "a KeyboardInterrupt nobody injected"
        finally:
            sys.setprofile(None)
        try:
            check()
        except AssertionError as error:
            raise AssertionError(f"after an interrupt at C call {n} of the section code: {error}") from None
        if not injector.fired:
            assert n > 0, "the scenario made no C call in the section code: the test tests nothing"
            return n
    raise AssertionError(f"the scenario still had C calls to interrupt after {limit}")


def assert_free(lock: threading.Lock, what: str = "the generator's lock") -> None:
    assert not lock.locked(), f"{what} is still held"


def assert_thread_clean(chain: call_chain.Chain) -> None:
    assert call_chain.current() is chain, "this thread's chain was left changed"
    assert not checkpoint_module.is_recomputing() and not checkpoint_module.is_checkpointing()


def section_on(generator: torch.Generator, lock: threading.Lock) -> Callable[[], None]:
    """A scenario: one section on ``generator``, entered and left on this thread's chain."""
    return lambda: call_chain.leave_rng_section(call_chain.enter_rng_section(generator, lock))


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def test_reading_a_settled_state_and_drawing_a_step_seed_give_the_lock_back_when_interrupted():
    lock = _lock_for(torch.default_generator)
    root = call_chain.current()

    def check() -> None:
        assert_free(lock)
        assert_thread_clean(root)

    assert interrupted_once_each(lambda: settled_state(torch.default_generator), check) >= 10
    assert interrupted_once_each(draw_step_seed, check) >= 10


@pytest.mark.parametrize("seed", [None, 1234])
def test_a_forward_section_interrupted_anywhere_leaves_the_lock_free_and_a_seeded_generator_as_it_was(
        generator, seed):
    guard = RNGGuard(torch.device("cpu"), shared=True)
    guard.generator, guard.lock = generator, _lock_for(generator)
    root = call_chain.current()
    before = generator.get_state()

    def scenario() -> None:
        guard.begin_step()  # each run learns afresh: the section holds the lock
        with guard.forward_section(True, seed):
            torch.rand(4, generator=generator)

    def check() -> None:
        assert_free(guard.lock)
        assert_thread_clean(root)
        if seed is not None:  # a seeded section gives the generator its own state back
            assert torch.equal(generator.get_state(), before), "the seeded section left the generator moved"

    assert interrupted_once_each(scenario, check) >= 10


def test_a_recompute_interrupted_anywhere_gives_the_generator_back_its_state_and_its_lock(generator):
    guard = RNGGuard(torch.device("cpu"), shared=True)
    guard.generator, guard.lock = generator, _lock_for(generator)
    root = call_chain.current()
    replay = guard.new_replay(True)
    with guard.forward_section(True):
        with replay.forward_context():
            forward_draw = torch.rand(4, generator=generator)
    torch.rand(4, generator=generator)  # the generator moved on since: the recompute must rewind it
    outside = generator.get_state()
    redrawn = []

    def scenario() -> None:
        with replay.recompute_context():
            redrawn.append(torch.rand(4, generator=generator))

    def check() -> None:
        assert_free(guard.lock)
        assert_thread_clean(root)
        assert torch.equal(generator.get_state(), outside), "the recompute left the generator at the replayed state"

    assert interrupted_once_each(scenario, check) >= 10
    assert torch.equal(redrawn[-1], forward_draw)  # the uninterrupted run replayed the forward's draw


def test_a_nested_section_interrupted_anywhere_gives_back_the_sub_lock_and_the_outer_chain(generator):
    lock = _lock_for(generator)
    root = call_chain.current()
    outer = call_chain.enter_rng_section(generator, lock)
    try:
        inside = call_chain.current()
        sub_lock = inside.rng_locks[id(generator)].sub_lock

        def check() -> None:
            assert_free(sub_lock, "the outer section's sub-lock")
            assert lock.locked(), "the outer section lost the generator's lock"
            assert call_chain.current() is inside, "the nested section left this thread's chain changed"

        assert interrupted_once_each(section_on(generator, lock), check) >= 2
    finally:
        call_chain.leave_rng_section(outer)
    assert_free(lock)
    assert call_chain.current() is root


def test_work_that_outlived_its_section_takes_the_generator_lock_itself_and_gives_it_back_when_interrupted(
        generator):
    lock = _lock_for(generator)
    root = call_chain.current()
    outer = call_chain.enter_rng_section(generator, lock)
    outlived = call_chain.current()  # the chain a host task keeps after its section ended
    call_chain.leave_rng_section(outer)
    sub_lock = outlived.rng_locks[id(generator)].sub_lock
    call_chain.adopt(outlived)
    try:
        def check() -> None:
            assert_free(lock)
            assert_free(sub_lock, "the ended section's sub-lock")
            assert call_chain.current() is outlived

        assert interrupted_once_each(section_on(generator, lock), check) >= 3
    finally:
        call_chain.adopt(root)


def test_a_stage_with_two_generators_interrupted_anywhere_gives_both_locks_back():
    host, device = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    stage = StageRNG(torch.device("cpu"), shared=True, host_shared=True)
    stage.guards = [RNGGuard(torch.device("cpu"), shared=True), RNGGuard(torch.device("cpu"), shared=True)]
    for guard, generator in zip(stage.guards, (host, device)):
        guard.generator, guard.lock = generator, _lock_for(generator)
    root = call_chain.current()
    replay = stage.new_replay(True)
    with stage.forward_section(True):
        with replay.forward_context():
            torch.rand(2, generator=host), torch.rand(2, generator=device)
    states = host.get_state(), device.get_state()

    def scenario() -> None:
        with replay.recompute_context():
            torch.rand(2, generator=host), torch.rand(2, generator=device)

    def check() -> None:
        for guard in stage.guards:
            assert_free(guard.lock)
        assert_thread_clean(root)
        assert torch.equal(host.get_state(), states[0]) and torch.equal(device.get_state(), states[1])

    assert interrupted_once_each(scenario, check) >= 20


class Noise(nn.Module):
    """y = x * u, u uniform: a recompute that redrew other u would give other gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rand_like(x)


def noisy_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Noise(), nn.Linear(8, 8), Noise())


def seeded_step_gradients(pipe: Pipe, x: torch.Tensor) -> list:
    torch.manual_seed(5)
    pipe.zero_grad()
    pipe(x).sum().backward()
    return [p.grad.clone() for p in pipe.parameters()]


def test_ctrl_c_in_a_checkpointed_backward_never_leaves_the_next_step_waiting_or_drawing_otherwise():
    """The user's view: Ctrl-C during ``loss.backward()`` of a checkpointed pipeline with random
    layers, whose recompute runs on this thread under the CPU generator's lock, then the next
    step. Whatever point the interrupt hit, the generator is where the forward left it (each
    recompute rewinds it and gives its state back), the next step runs (it would wait for the
    lock for good), and its gradients are a fresh pipeline's."""
    x = torch.randn(8, 8)
    lock = _lock_for(torch.default_generator)
    root = call_chain.current()
    with Pipe(noisy_model(), [2, 2], chunks=2, checkpoint="always", reproducible=True) as fresh:
        expected = seeded_step_gradients(fresh, x)
    with Pipe(noisy_model(), [2, 2], chunks=2, checkpoint="always", reproducible=True) as pipe:
        after_forward = []

        def forward() -> tuple:  # on the workers, not interrupted
            pipe.zero_grad()
            loss = pipe(x).sum()
            after_forward[:] = [torch.default_generator.get_state()]
            return (loss,)

        def check() -> None:
            assert_free(lock)
            assert_thread_clean(root)
            assert torch.equal(torch.default_generator.get_state(), after_forward[0]), "the generator was left moved"

        assert interrupted_once_each(lambda loss: loss.backward(), check, prepare=forward) >= 40
        got = seeded_step_gradients(pipe, x)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_a_section_taken_by_a_polling_wait_gives_the_lock_back_when_interrupted(generator):
    """Work of a step (a job run on the caller's thread) waits in polls, to see its step abort."""
    lock = _lock_for(generator)
    root = call_chain.current()
    serving = root.serving(call_chain.new_owner(), call_chain.Cancel())
    call_chain.adopt(serving)
    try:
        def check() -> None:
            assert_free(lock)
            assert call_chain.current() is serving

        assert interrupted_once_each(section_on(generator, lock), check) >= 3
    finally:
        call_chain.adopt(root)


class ThreadNoted(nn.Module):
    """Notes the thread each forward runs on."""

    def __init__(self, threads: set) -> None:
        super().__init__()
        self.threads = threads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.add(threading.get_ident())
        return x


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_ctrl_c_in_a_one_micro_batch_forward_on_the_callers_thread_leaves_the_generator_as_a_fresh_pipes(checkpoint):
    """A call of one micro-batch runs its stages on the caller's thread, and with
    ``checkpoint='always'`` or ``reproducible=True`` their forwards hold the generator's lock
    and seed it there: a Ctrl-C anywhere in that must leave the lock free and the next step
    drawing what a fresh pipeline's draws. The generator itself moved by the step seed's draw at
    most (every section gives back the state it seeded)."""
    x = torch.randn(8, 8)
    lock = _lock_for(torch.default_generator)
    root = call_chain.current()
    threads: set = set()

    def model() -> nn.Sequential:
        return nn.Sequential(ThreadNoted(threads), *noisy_model())

    with Pipe(model(), [3, 2], chunks=1, checkpoint=checkpoint, reproducible=True) as fresh:
        expected = seeded_step_gradients(fresh, x)
    assert threads == {threading.get_ident()}, "the call did not run on this thread: the test tests nothing here"
    with Pipe(model(), [3, 2], chunks=1, checkpoint=checkpoint, reproducible=True) as pipe:
        before: list = []

        def unmoved() -> tuple:
            before[:] = [torch.default_generator.get_state()]
            seed_drawn = torch.Generator()
            seed_drawn.set_state(before[0])
            torch.randint(0, 1 << 62, (1,), generator=seed_drawn)  # draw_step_seed's draw
            before.append(seed_drawn.get_state())
            return ()

        def check() -> None:
            assert_free(lock)
            assert_thread_clean(root)
            state = torch.default_generator.get_state()
            assert any(torch.equal(state, allowed) for allowed in before), "the generator was left moved or seeded"

        assert interrupted_once_each(lambda: pipe(x), check, prepare=unmoved) >= 20
        got = seeded_step_gradients(pipe, x)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
