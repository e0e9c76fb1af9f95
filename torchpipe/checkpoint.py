"""Checkpointing of partitions: forward without storing activations, recompute in backward.

Layers that must behave differently while a partition is being checkpointed or recomputed
(deferred batch norm must not count a micro-batch twice) ask ``is_checkpointing()`` and
``is_recomputing()``. Both flags are thread-local, because every partition runs on its own
worker thread and recomputation runs on the autograd engine's thread.
"""
from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["is_checkpointing", "is_recomputing"]


class _Flags(threading.local):
    checkpointing: bool = False
    recomputing: bool = False


_flags = _Flags()


def is_checkpointing() -> bool:
    """True while a checkpointed partition runs its first (activation-free) forward."""
    return _flags.checkpointing


def is_recomputing() -> bool:
    """True while a checkpointed partition recomputes its forward during backward."""
    return _flags.recomputing


@contextmanager
def _set_flag(name: str) -> Iterator[None]:
    previous = getattr(_flags, name)
    setattr(_flags, name, True)
    try:
        yield
    finally:
        setattr(_flags, name, previous)


# --------------------------------------------------------------------------------------------
# Checkpointing with RNG replay
# --------------------------------------------------------------------------------------------
import functools  # noqa: E402
import inspect  # noqa: E402
import weakref  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Set, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.utils.checkpoint as _torch_checkpoint  # noqa: E402

from .call_chain import RNGSection, enter_rng_section, leave_rng_section  # noqa: E402
from .devices import get_backend  # noqa: E402
from .microbatch import Batch, map_nested, nested_tensors, rebuild  # noqa: E402
from .saved_versions import CheckpointVersions, backward_call_key  # noqa: E402
from .notes import add_note  # noqa: E402
from .thread_state import CHECKPOINT_HOOK_MARK, current_saved_tensors_hooks  # noqa: E402

__all__ += ["checkpoint", "ForwardTensors", "RNGGuard", "RNGReplayError", "StageRNG", "generator_state", "tensor_slots"]


def _import_collective_defaults_before_any_group() -> None:
    """Import ``torch.distributed.nn.functional`` now, while no process group exists yet.

    Its collectives take ``group=group.WORLD`` as a default, evaluated at import. The first
    ``torch.utils.checkpoint`` call imports ``torch._dynamo``, which imports that module: after
    ``init_process_group`` the defaults then hold the default group, ``destroy_process_group()``
    no longer frees it, and its gloo threads live on into the interpreter's teardown. There, a
    thread that drops a finished collective's tensors needs the GIL and aborts the process
    ("terminate called without an active exception", SIGABRT after all work is done; see
    pytorch/pytorch#109478 and #179291). Imported here, the defaults stay ``None``.
    """
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return  # no collectives, or too late: importing now would capture the live group
    try:
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:  # pragma: no cover - a build without torch.distributed.nn
        pass


_import_collective_defaults_before_any_group()

# One lock per generator, keyed by id: some torch versions (2.11) cannot weak-reference a
# Generator. The entry keeps its generator alive so that an id is never reused; the
# generators locked here are the devices' default generators, which live as long as torch.
_generator_locks: Dict[int, Tuple[torch.Generator, threading.Lock]] = {}
_generator_locks_guard = threading.Lock()

# Every get_state/set_state of ours runs under this one short lock, and nothing is acquired
# while it is held. Two such calls at once can deadlock: torch holds the generator's mutex
# with the GIL while it creates the state tensor, which can start the garbage collector,
# whose Python code may hand the GIL to the thread waiting for that mutex.
_state_lock = threading.Lock()


# Generators (by id) on which a replay went wrong: every forward of a checkpointing step on
# them holds the lock from then on, RNG-free or not (see RNGReplayError).
_always_locked: Set[int] = set()


# Per generator (by id): how many of torchpipe's sections that may move it for good (unseeded
# ones, and step-seed draws) have ended. A reproducible call that sees this count change
# cannot tell another pipeline's draws from stray ones of its own (see pipe._shared_generators).
_unrestored_sections: Dict[int, int] = {}


def unrestored_sections(generator: torch.Generator) -> int:
    """How many sections that may have drawn from ``generator`` for good have ended so far."""
    return _unrestored_sections.get(id(generator), 0)


def settled_state(generator: torch.Generator) -> Tuple[torch.Tensor, int]:
    """``generator``'s state and `unrestored_sections` count, read under its lock: with no
    section of torchpipe's half way through its draws (a seeded one not yet given its state
    back, an unseeded one not yet counted)."""
    section = enter_rng_section(generator, _lock_for(generator))
    try:
        return _get_state(generator), unrestored_sections(generator)
    finally:
        leave_rng_section(section)


def _count_unrestored(generator: torch.Generator) -> None:
    """Called holding ``generator``'s lock, or where no other thread shares it."""
    _unrestored_sections[id(generator)] = _unrestored_sections.get(id(generator), 0) + 1


def lock_for_good(generator: torch.Generator) -> None:
    """Every later forward of a checkpointing or reproducible step on ``generator`` holds its
    lock (and is seeded, in a reproducible step), RNG-free or not: where a partition seen not
    to draw was caught drawing after all."""
    _always_locked.add(id(generator))


class RNGReplayError(RuntimeError):
    """A recompute drew other random numbers than its forward: its gradients would be wrong.

    Another thread drew from the same generator while the forward ran: a partition seen
    RNG-free earlier in the step that then drew (dropout on some micro-batches only), or a
    thread outside the pipeline. The step is stopped instead of returning wrong gradients,
    and every later forward on that generator holds its lock, so running the step again
    replays exactly.
    """


def _lock_for(generator: torch.Generator) -> threading.Lock:
    with _generator_locks_guard:
        entry = _generator_locks.get(id(generator))
        if entry is None:
            entry = _generator_locks[id(generator)] = (generator, threading.Lock())
        return entry[1]


def _get_state(generator: torch.Generator) -> torch.Tensor:
    with _state_lock:
        return generator.get_state()


def generator_state(generator: torch.Generator) -> torch.Tensor:
    """``generator.get_state()``, taken safely next to the replays running on other threads."""
    return _get_state(generator)


def _set_state(generator: torch.Generator, state: torch.Tensor) -> None:
    with _state_lock:
        generator.set_state(state)


_MASK64 = (1 << 64) - 1


def task_seed(step_seed: int, *parts: int) -> int:
    """A seed of its own for one forward of a step (``parts``: stage, micro-batch, generator).

    SplitMix64's finaliser over the parts: neighbouring tasks get unrelated seeds, and the
    same step seed gives the same seeds in every run. Kept below 2**63 (torch's seed range);
    the CPU generator keeps 32 bits of a seed, so two forwards of a step share one with odds
    of about n**2 / 2**33 for n forwards.
    """
    value = step_seed & _MASK64
    for part in parts:
        value = (value + 0x9E3779B97F4A7C15 + (part & _MASK64)) & _MASK64
        value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
        value ^= value >> 31
    return value >> 1


def draw_step_seed() -> int:
    """One draw of the CPU generator, on the caller's thread: the seed of a reproducible step.

    Drawn under the generator's lock: unlocked, it could land inside another pipeline's
    locked forward on that generator, and shift what that forward draws (its recompute would
    then draw other numbers)."""
    generator = torch.default_generator
    section = enter_rng_section(generator, _lock_for(generator))
    try:
        _count_unrestored(generator)
        return int(torch.randint(0, 1 << 62, (1,), generator=generator).item())
    finally:
        leave_rng_section(section)


def _seed(generator: torch.Generator, seed: int) -> None:
    with _state_lock:
        generator.manual_seed(seed)


class RNGGuard:
    """Makes a checkpointed partition's recompute draw the same random numbers as its forward.

    Replay restores the generator state saved before the forward. That only works if nothing
    else draws from the same generator *during* that forward, and partitions that share a
    device share its generator while running on different threads. So when the generator is
    shared, each forward of a checkpointing step (checkpointed or not: an unprotected draw
    would interleave) runs under the generator's lock. A partition observed to leave the
    generator untouched in a forward is marked RNG-free and skips the lock, so dropout-free
    partitions still pipeline. A checkpointed forward always saves the generator state, so a
    partition whose draws depend on the data (dropout on small micro-batches only) is still
    replayed; when the generator did not move, the state is dropped and the recompute takes
    no lock. Every step learns afresh (:meth:`begin_step`): a partition may start drawing
    between steps (a dropout probability raised from 0 by a schedule).

    A partition marked RNG-free whose *first* data-dependent draw runs while a partition on
    the same generator draws too interleaves with it unlocked. That is caught, not prevented:
    each recompute that draws checks that it ends in the generator state its forward ended
    in, and raises :class:`RNGReplayError` if not (the generator then stays locked).
    """

    def __init__(self, device: torch.device, shared: bool, name: str = "") -> None:
        self.device = device
        self.name = name or f"a partition on {device}"
        self.generator = get_backend(device).default_generator(device)
        self.lock: Optional[threading.Lock] = _lock_for(self.generator) if shared else None
        # Per training flag of the partition: None unknown, True uses RNG, False RNG-free.
        self._uses_rng: Dict[bool, Optional[bool]] = {True: None, False: None}

    def begin_step(self) -> None:
        """Forget what earlier steps learned: the first forward of this step checks again."""
        self._uses_rng[True] = self._uses_rng[False] = None

    @property
    def always_locked(self) -> bool:
        """True once a replay on this generator went wrong: no RNG-free shortcut any more."""
        return id(self.generator) in _always_locked

    def forward_section(self, training: bool, seed: Optional[int] = None) -> "_ForwardSection":
        """Context for one forward of a checkpointing or reproducible step (holds the lock if
        shared). With a ``seed``, the forward draws from the generator seeded with it and
        gives the generator its own state back: every forward on a generator of its own, and
        on a shared one every forward that holds the lock (not one seen RNG-free)."""
        return _ForwardSection(self, training, seed)

    def new_replay(self, training: bool) -> "_Replay":
        return _Replay(self, training)


class _ForwardSection:
    """One generator's section around a forward; ``training=None``: a section always held
    that teaches nothing about the partition (a loss that may draw)."""

    __slots__ = ("guard", "training", "seed", "before", "section", "outside")

    def __init__(self, guard: RNGGuard, training: Optional[bool], seed: Optional[int] = None) -> None:
        self.guard = guard
        self.training = training
        self.seed = seed
        self.before: Optional[torch.Tensor] = None
        self.section: Optional[RNGSection] = None
        # The generator's state outside a seeded forward, given back when it ends.
        self.outside: Optional[torch.Tensor] = None

    def __enter__(self) -> None:
        guard = self.guard
        learning = self.training is not None and guard.lock is not None
        if learning and guard._uses_rng[self.training] is False and not guard.always_locked:
            return  # seen RNG-free in this step: neither lock nor seed
        if guard.lock is not None:  # no lock: no other partition draws from it, nothing to learn
            self.section = enter_rng_section(guard.generator, guard.lock)
        try:
            if self.seed is not None:
                self.outside = _get_state(guard.generator)
                _seed(guard.generator, self.seed)
            if learning and guard._uses_rng[self.training] is None:
                self.before = _get_state(guard.generator)
        except BaseException:  # noqa: B902 - __exit__ will not run: give everything back here
            self._leave()
            raise

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        guard = self.guard
        try:
            if self.before is not None and exc_type is None:
                guard._uses_rng[self.training] = not torch.equal(self.before, _get_state(guard.generator))
        finally:
            self._leave()

    def _leave(self) -> None:
        try:
            if self.outside is not None:
                _set_state(self.guard.generator, self.outside)
                self.outside = None
            elif self.section is not None:  # unseeded, under the lock: its draws stay
                _count_unrestored(self.guard.generator)
        finally:
            leave_rng_section(self.section)
            self.section = None


class _Replay:
    """The generator state of one checkpointed forward, and the contexts that use it."""

    __slots__ = ("guard", "training", "state", "end_state")

    def __init__(self, guard: RNGGuard, training: bool) -> None:
        self.guard = guard
        self.training = training
        self.state: Optional[torch.Tensor] = None
        # Where the forward left the generator: a recompute that draws must end there too.
        self.end_state: Optional[torch.Tensor] = None

    def forward_context(self) -> "_CheckpointContext":
        return _CheckpointContext(self)

    def recompute_context(self) -> "_RecomputeContext":
        return _RecomputeContext(self)


class _CheckpointContext:
    __slots__ = ("replay", "previous")

    def __init__(self, replay: _Replay) -> None:
        self.replay = replay

    def __enter__(self) -> None:
        replay = self.replay
        # Saved even when the partition looked RNG-free so far: its draws may depend on the
        # data (dropout on some micro-batches only), and a replay that restores nothing would
        # redraw differently. RNG-free only spares the lock.
        replay.state = _get_state(replay.guard.generator)
        self.previous = _flags.checkpointing
        _flags.checkpointing = True

    def __exit__(self, *exc: Any) -> None:
        _flags.checkpointing = self.previous
        replay = self.replay
        guard = replay.guard
        if guard._uses_rng[replay.training] is False and replay.state is not None:
            # Seen RNG-free, run unlocked: if the generator did not move, nothing was drawn and
            # the recompute needs neither the state nor the lock. (If it moved, this forward or
            # another partition drew; the state is kept and the recompute replays it.)
            if torch.equal(replay.state, _get_state(guard.generator)):
                replay.state = None
        if replay.state is not None:
            # Taken inside the forward's section: under the lock, when the forward holds it.
            replay.end_state = _get_state(guard.generator)


class _RecomputeContext:
    __slots__ = ("replay", "previous", "saved", "section")

    def __init__(self, replay: _Replay) -> None:
        self.replay = replay

    def __enter__(self) -> None:
        replay = self.replay
        self.saved = None
        self.section: Optional[RNGSection] = None
        if replay.state is not None:
            lock = replay.guard.lock
            if lock is not None:
                self.section = enter_rng_section(replay.guard.generator, lock)
            try:
                generator = replay.guard.generator
                self.saved = _get_state(generator)
                _set_state(generator, replay.state)
            except BaseException:  # noqa: B902 - Ctrl-C too: __exit__ will not run, give it all back here
                self._give_back()
                raise
        self.previous = _flags.recomputing
        _flags.recomputing = True

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        _flags.recomputing = self.previous
        replay = self.replay
        mismatch = False
        try:
            if self.saved is not None and exc_type is None:
                mismatch = _replay_differs(replay, _get_state(replay.guard.generator))
                if mismatch:  # under the lock, before anyone else draws
                    lock_for_good(replay.guard.generator)
        finally:
            self._give_back()
        if mismatch:
            raise RNGReplayError(
                f"{replay.guard.name}: its recompute drew other random numbers than its forward on the "
                f"{replay.guard.device.type} generator, because another thread drew from that generator "
                "while the forward ran (a partition that drew only on some micro-batches, or a thread "
                "outside the pipeline), so this step's gradients would be wrong. Every later forward on "
                "that generator now holds its lock: run the step again. To avoid this, draw on every "
                "micro-batch, or keep such partitions on devices of their own"
            )

    def _give_back(self) -> None:
        """Give the generator the state it had before the recompute, then its lock."""
        try:
            if self.saved is not None:
                _set_state(self.replay.guard.generator, self.saved)
        finally:
            leave_rng_section(self.section)
            self.section = None


def _replay_differs(replay: _Replay, after_recompute: torch.Tensor) -> bool:
    """True if the recompute drew, and did not end where its forward ended.

    A recompute that drew nothing cannot have redrawn other numbers. One that drew the same
    numbers from the same start ends in the same state; one whose forward had other draws
    interleaved (from another thread) does not.
    """
    if replay.end_state is None or replay.state is None:
        return False
    if torch.equal(after_recompute, replay.state):
        return False
    return not torch.equal(after_recompute, replay.end_state)


class StageRNG:
    """The generators one partition's random ops may draw from, each behind its :class:`RNGGuard`.

    The device's generator, and for a partition on an accelerator the CPU's too: a layer on a
    GPU may still draw on the host (``torch.randperm(n)``), and its recompute must redraw the
    same numbers (torchgpipe replays both). The CPU guard comes first, so every partition
    takes the locks in one order.
    """

    def __init__(self, device: torch.device, shared: bool, host_shared: bool, name: str = "") -> None:
        guard = RNGGuard(device, shared=shared, name=name)
        self.guards = [guard]
        if guard.generator is not torch.default_generator:
            self.guards.insert(0, RNGGuard(torch.device("cpu"), shared=host_shared, name=name))

    def begin_step(self) -> None:
        for guard in self.guards:
            guard.begin_step()

    def forward_section(self, training: bool, seed: Optional[int] = None) -> Any:
        """Context for one forward of a checkpointing or reproducible step (each generator's
        section; with a ``seed``, each generator seeded with one of its own derived from it)."""
        return self._sections(training, seed)

    def _sections(self, training: Optional[bool], seed: Optional[int]) -> Any:
        if len(self.guards) == 1:
            return _ForwardSection(self.guards[0], training, seed)
        return _Contexts([functools.partial(_ForwardSection, guard, training, None if seed is None else task_seed(seed, index))
                          for index, guard in enumerate(self.guards)])

    def new_replay(self, training: bool) -> "_StageReplay":
        return _StageReplay([guard.new_replay(training) for guard in self.guards])

    def hold(self, seed: Optional[int] = None) -> Any:
        """Hold every shared generator's lock (a loss that draws, while other stages replay);
        with a ``seed``, draw from seeded states, as a reproducible step's forward does."""
        return self._sections(None, seed)


class _StageReplay:
    """The saved generator states of one checkpointed forward, and its extra recompute contexts."""

    __slots__ = ("parts", "recompute_extras")

    def __init__(self, parts: List[_Replay]) -> None:
        self.parts = parts
        # Factories of further contexts the recompute runs under (skip replay, for one).
        self.recompute_extras: List[Callable[[], Any]] = []

    def forward_context(self) -> Any:
        if len(self.parts) == 1:
            return self.parts[0].forward_context()
        return _Contexts([part.forward_context for part in self.parts])

    def recompute_context(self) -> Any:
        return _Contexts([part.recompute_context for part in self.parts] + self.recompute_extras)


class _Contexts:
    """Enters the contexts the factories make, in order; leaves them in reverse, every one of
    them even when leaving a later one raised.

    Not an ``ExitStack``: a recompute's generator sections are among these contexts, and a
    Ctrl-C landing inside ``ExitStack``'s own bookkeeping (between a context's enter and its
    registration, or in its exit loop) would skip one's exit and leave the generator's lock
    held for good. Here a context counts as entered as soon as its ``__enter__`` returns (the
    append that records it is one C call after a Python return, with no point in between
    where Python raises a pending interrupt), and each exit is followed by the call that
    leaves the one before it, whether it returned or raised: no loop, no ``len()``.
    """

    __slots__ = ("factories", "entered")

    def __init__(self, factories: List[Callable[[], Any]]) -> None:
        self.factories = factories

    def __enter__(self) -> None:
        entered: List[Any] = []
        self.entered = entered
        try:
            for factory in self.factories:
                context = factory()
                context.__enter__()
                entered.append(context)
        except BaseException:  # noqa: B902 - Ctrl-C too: the caller will not call __exit__, undo what was entered
            self._leave(-1, sys.exc_info())
            raise

    def __exit__(self, *exc: Any) -> None:
        self._leave(-1, exc)

    def _leave(self, index: int, exc: Tuple[Any, ...]) -> None:
        """Leave the entered contexts from ``entered[index]`` back to the first (``index`` counts
        from the end); an exception raised in one is what the ones before it see, and goes up
        once they are all left. (No ``len()``: a C call before the first exit would be a point
        where a pending interrupt skips them all.)"""
        try:
            context = self.entered[index]
        except IndexError:  # all left
            return
        try:
            context.__exit__(*exc)
        except BaseException:  # noqa: B902 - re-raised once the earlier contexts are left too
            self._leave(index - 1, sys.exc_info())
            raise
        self._leave(index - 1, exc)


TensorSlot = Tuple[Dict[str, Any], str]
_MISSING = object()


def tensor_slots(module: torch.nn.Module) -> List[TensorSlot]:
    """Where ``module`` and its submodules keep their parameters and buffers: (dict, name) pairs."""
    return [(slots, name) for m in module.modules() for slots in (m._parameters, m._buffers) for name in slots]


class ForwardTensors:
    """The parameters and buffers one checkpointed forward ran with, put back for its recompute.

    ``torch.func.functional_call(pipe, tensors, x)`` swaps ``tensors`` into the modules for
    the call and puts the modules' own back when it returns, before backward recomputes. A
    recompute with the modules' own tensors would compute other values and send the
    gradients to other tensors, silently. So when a slot holds another tensor at recompute
    time, the recompute runs with the one the forward used (the plain model's graph keeps
    exactly those), and the slot gets its tensor back afterwards.
    """

    __slots__ = ("slots", "values", "swapped", "owner", "what")

    def __init__(self, slots: List[TensorSlot], owner: Optional[torch.nn.Module] = None, what: str = "the module") -> None:
        self.slots = slots
        self.values = [holder.get(name, _MISSING) for holder, name in slots]
        self.swapped: List[Tuple[Dict[str, Any], str, Any]] = []
        self.owner = owner  # the module the slots were read from, ``what`` in a refusal: named there
        self.what = what

    def restored(self) -> "ForwardTensors":
        """The context a recompute runs under (a factory for ``recompute_extras``)."""
        return self

    def __enter__(self) -> None:
        swapped = self.swapped = []
        try:
            for (holder, name), value in zip(self.slots, self.values):
                current = holder.get(name, _MISSING)
                if current is not value and value is not _MISSING:
                    if current is _MISSING:
                        raise self._slot_gone(holder, name)
                    swapped.append((holder, name, current))
                    holder[name] = value
        except BaseException:  # noqa: B902 - the caller will not call __exit__: put them back
            self.__exit__()
            raise

    def _slot_gone(self, holder: Dict[str, Any], name: str) -> RuntimeError:
        """The refusal for a parameter or buffer removed between the forward and its recompute.

        ``weight_norm``, a parametrization or pruning registered in between turn ``weight``
        into a computed attribute: putting the old parameter back would fight the hook that
        now sets it, and the layer no longer runs as it did in the forward.
        """
        kind, qualified = "parameter or buffer", name
        for path, module in self.owner.named_modules() if self.owner is not None else ():
            if holder is module._parameters or holder is module._buffers:
                kind = "parameter" if holder is module._parameters else "buffer"
                qualified = f"{path}.{name}" if path else name
                break
        return RuntimeError(
            f"{self.what} changed between a checkpointed forward and its recompute in backward: {kind} "
            f"{qualified!r} was there in the forward and is gone now (weight_norm, a parametrization or pruning "
            "registered in between?). The recompute must run the layers the forward ran: change layers after "
            "backward, between steps, or use checkpoint='never'")

    def __exit__(self, *exc: Any) -> None:
        for holder, name, current in reversed(self.swapped):
            holder[name] = current
        self.swapped = []


# Recompute the whole partition, as torchgpipe does. Non-reentrant checkpoint stops a
# recompute once the last tensor saved for backward is rebuilt, so layers after it would never
# run with ``is_recomputing()`` True, and a layer that pairs each checkpointed forward with its
# recompute (state handed over through the flags, a counter, a hook) would fall out of step.
# Per call, not ``set_checkpoint_early_stop``: that one is a process-wide global, which other
# workers (and the user's own checkpoints) would see.
_WHOLE_RECOMPUTE: Dict[str, Any] = (
    {"early_stop": False} if "early_stop" in inspect.signature(_torch_checkpoint.checkpoint).parameters else {}
)


class _KeepOne(torch.autograd.Function):
    """Passes tensors through and saves an empty one: something for backward to unpack.

    torch's non-reentrant checkpoint recomputes when backward unpacks a tensor saved inside
    the checkpointed region. A partition that saves nothing (``x * 2``, an identity) would
    never be recomputed, and a layer that pairs each checkpointed forward with its recompute
    (``is_checkpointing()`` / ``is_recomputing()``, as torchgpipe guarantees) would fall out
    of step. Every output that requires grad goes through the one node, so a backward that
    reaches any of them unpacks it. The outputs are copies, not views: the caller may change
    them in place.
    """

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(tensors[0].new_empty(0))
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        ctx.saved_tensors  # noqa: B018 - unpacking is the point: it starts the recompute
        return grads


def _with_kept_tensor(output: Any) -> Any:
    """``output`` with every tensor that requires grad, nested ones too (an LSTM's state),
    passed through one :class:`_KeepOne`; a tensor found twice gets one copy, in both places."""
    if isinstance(output, torch.Tensor):
        return _KeepOne.apply(output)[0]
    carrying: Dict[int, torch.Tensor] = {}
    for tensor in nested_tensors(output):
        if tensor.requires_grad:
            carrying.setdefault(id(tensor), tensor)
    kept = dict(zip(carrying, _KeepOne.apply(*carrying.values())))
    return map_nested(output, lambda tensor: kept.get(id(tensor), tensor))


def _requires_grad(output: Any) -> bool:
    """Whether backward can reach ``output``: a tensor of it, nested ones too, requires grad."""
    if isinstance(output, torch.Tensor):
        return output.requires_grad
    return isinstance(output, tuple) and any(t.requires_grad for t in nested_tensors(output))


class _CountingHooks:
    """The checkpoint's own hooks, with each save counted and numbered on the way through.

    Methods, wrapped once in ``torch.compiler.disable`` (as torch wraps its checkpoint's hooks):
    autograd calls a pack hook from inside whatever runs, and after a graph break inside a
    compiled layer torch.compile would try to compile the hook itself, on fake tensors.
    """

    def __init__(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any], versions: CheckpointVersions) -> None:
        self._pack = pack
        self._unpack = unpack
        self.versions = versions
        self.saved = 0
        self._holders: List["weakref.ReferenceType[Any]"] = []  # torch's, for _release_recomputed
        self._release_queued: Set[int] = set()

    @torch.compiler.disable
    def pack(self, tensor: torch.Tensor) -> Any:
        index = self.saved
        self.saved += 1
        self.versions.forward_saved(index, tensor)
        holder = self._pack(tensor)
        if isinstance(getattr(holder, "handles", None), dict):
            self._holders.append(weakref.ref(holder))
        return holder, index

    @torch.compiler.disable
    def unpack(self, packed: Any) -> Any:
        holder, index = packed
        tensor = self._unpack(holder)  # the first one recomputes the partition
        key = backward_call_key()
        self.versions.check(index, key)
        self._release_after_this_backward(key)
        return tensor

    def _release_after_this_backward(self, gid: Any) -> None:
        """Let go of this backward call's recomputed tensors when it ends, also those it never read.

        torch's checkpoint keeps what a recompute saved per backward call, until the call
        reads it, or else until the graph goes. A backward that reads only part of it and
        keeps the graph (a zero-bubble ``I`` reads the input-gradient path; ``W`` then runs
        backward calls of its own, which recompute again) left the rest alive until ``W``
        ended: activations of every micro-batch between its ``I`` and its ``W``, which
        checkpointing was to spare. The call's last step drops them (an engine callback).
        """
        if not self._holders:
            return
        if not isinstance(gid, int) or gid == -1 or gid in self._release_queued:
            return  # outside backward, or torch's own grouping of calls: it keeps what it keeps
        self._release_queued.add(gid)
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._release_recomputed, gid))

    def _release_recomputed(self, gid: int) -> None:
        self._release_queued.discard(gid)
        self.versions.recompute_released(gid)
        for ref in self._holders:
            holder = ref()
            if holder is not None:
                holder.handles.pop(gid, None)  # the handle keys the recomputed tensor (weakly)

    @torch.compiler.disable
    def recording_pack(self, tensor: torch.Tensor) -> Any:
        """The recompute's pack: note each saved tensor's version for the reads to check."""
        self.versions.recompute_saved(tensor)
        return self._pack(tensor)


# A Pipe called inside these hooks' scope must see the checkpoint around it.
setattr(_CountingHooks.pack, CHECKPOINT_HOOK_MARK, True)
setattr(_CountingHooks.recording_pack, CHECKPOINT_HOOK_MARK, True)


# torch.func's grad transforms disable saved-tensor hooks, and fail when one is active.
_FUNC_TRANSFORM_REFUSAL = "don't yet support saved tensor hooks"


def explain_hooks_refusal(error: BaseException, why_hooks: str, instead: str) -> None:
    """Add a note to torch.func's refusal of saved-tensor hooks: the user installed none.

    ``torch.func.grad``/``vjp``/``jacrev``/``hessian`` inside a layer fail under any active
    saved-tensor hook; the message blames hooks the user never saw. The note says whose
    hooks they are (``why_hooks``) and what works (``instead``)."""
    if isinstance(error, RuntimeError) and _FUNC_TRANSFORM_REFUSAL in str(error):
        add_note(error, f"[torchpipe] {why_hooks}, and torch.func's grad, vjp, jacrev and hessian refuse to run "
                        f"under any saved-tensor hook. {instead}")


def _counting_saves(function: Callable[[Any], Any], value: Any, versions: CheckpointVersions) -> Tuple[Any, int]:
    """``function(value)`` and how many tensors it saved for backward through the checkpoint.

    The checkpoint's own hooks do the saving; these count on the way through, number each
    save, and check it when backward reads it (``versions``). Where torch does not expose the
    active hooks, the count is -1 (unknown).
    """
    hooks = current_saved_tensors_hooks()
    if hooks is None:
        return function(value), -1
    counting = _CountingHooks(*hooks, versions)
    with torch.autograd.graph.saved_tensors_hooks(counting.pack, counting.unpack):
        output = function(value)
    versions.forward_finished()
    return output, counting.saved


def _recompute_recording_versions(function: Callable[[Any], Any], value: Any, versions: CheckpointVersions) -> Any:
    """``function(value)`` under the recompute's hooks, noting what each saved tensor's version was.

    The recompute runs the whole partition (``early_stop=False``), so a tensor saved early may
    be changed in place later in it; backward's read of it checks (``_counting_saves``).
    """
    hooks = current_saved_tensors_hooks()
    if hooks is None:
        return function(value)
    versions.recompute_started()
    recording = _CountingHooks(*hooks, versions)
    with torch.autograd.graph.saved_tensors_hooks(recording.recording_pack, hooks[1]):
        output = function(value)
    versions.recompute_finished()
    return output


def checkpoint(function: Callable[[Any], Any], batch: Batch, replay: "_StageReplay",
               where: str = "recomputed by a checkpoint") -> Batch:
    """Run ``function`` on ``batch`` without keeping its activations; recompute them in backward.

    Built on PyTorch's non-reentrant checkpoint (saved-tensor hooks), which recomputes on
    demand during backward and supports tuple outputs and in-place layers. RNG replay and the
    ``is_checkpointing``/``is_recomputing`` flags come from ``replay``'s contexts. Whenever
    backward passes through the output, the partition is recomputed once, also when it saved
    nothing (see :class:`_KeepOne`). A tensor saved for backward and then changed in place
    fails the backward, as without the checkpoint; ``where`` names the job in that error.
    """
    atomic, template = batch.atomic, batch.values
    versions = CheckpointVersions(where)
    failures: List[BaseException] = []
    keeps_one: List[bool] = []  # set by the forward; the recompute must save what it saved

    def run(*values: Any) -> Any:
        value = values[0] if atomic else rebuild(template, values)
        # An exception must not leave torch's checkpoint half-entered: some versions (2.11)
        # resume their context only on success, which would leave the checkpoint's
        # saved-tensor hooks installed on this worker thread for every later step.
        if _flags.recomputing:  # a failed recompute surfaces through backward as it is
            output = _recompute_recording_versions(function, value, versions)
            return _with_kept_tensor(output) if keeps_one else output
        try:
            output, saved = _counting_saves(function, value, versions)
        except BaseException as exc:  # noqa: B902 - re-raised below, unchanged
            explain_hooks_refusal(
                exc, "a checkpointed micro-batch runs its stage under the checkpoint's saved-tensor hooks (as "
                     "torch.utils.checkpoint does)",
                "Use checkpoint='never' for this model, or torch.autograd.grad(..., create_graph=True) in the layer")
            failures.append(exc)
            return None
        if saved == 0 and _requires_grad(output):
            keeps_one.append(True)
            return _with_kept_tensor(output)
        return output

    output = _torch_checkpoint.checkpoint(
        run,
        *batch.values,
        use_reentrant=False,
        preserve_rng_state=False,
        context_fn=lambda: (replay.forward_context(), replay.recompute_context()),
        **_WHOLE_RECOMPUTE,
    )
    if failures:
        raise failures.pop()  # no local name: the traceback must not keep the exception alive
    return Batch(output)
