"""``Plan``: per-worker ordered action lists, the one object that is printed *and* run.

The runtime executes ``worker_actions`` in order and waits on ``dependencies``; the table,
the chrome trace and the simulator read the very same lists, so the printed schedule
cannot differ from the executed one.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..checks import as_int
from .action import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, Action
from .errors import InvalidPlanError

if TYPE_CHECKING:
    from .simulate import Costs, Simulation

__all__ = ["Plan"]


def _require_int(name: str, value: object) -> None:
    """TypeError naming ``name`` unless ``value`` is a Python int (bools refused)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"Plan {name} must be an int, got {value!r}")


def _is_sequence(value: Any) -> bool:
    """A list-like of items: not a str (whose characters would pass for items)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _is_idle(entry: Any) -> bool:
    """An idle slot of a hand-written or imported order: ``None`` or a blank string."""
    return entry is None or (isinstance(entry, str) and not entry.strip())


def _parsed(entry: Any, worker: int, position: int) -> Action:
    """``entry`` of a hand-written list as an Action; a text that does not parse is named by
    its worker and position (as ``load_csv`` names its row and entry)."""
    if isinstance(entry, Action):
        return entry
    try:
        return Action.parse(entry)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"worker {worker}, entry {position}: {exc}") from None


def _count_hint(worker_actions: Sequence[Sequence[Action]], index: Callable[[Action], int], count: int, what: str,
                option: str) -> str | None:
    """Where an inferred count of ``what`` came from, when its highest index is named by at most
    half as many actions as the most-named lower one (a typo's mark, not a plan's last stage or
    micro-batch); None otherwise."""
    if count < 2:
        return None
    named = collections.Counter(index(a) for acts in worker_actions for a in acts)
    if 2 * named[count - 1] > max(named[i] for i in range(count - 1)):
        return None
    last = [f"{a} on worker {w}" for w, acts in enumerate(worker_actions) for a in acts if index(a) == count - 1]
    return (f"the plan's {count} {what} were counted from the highest index in the lists ({', '.join(last[:3])}"
            f"{', ...' if len(last) > 3 else ''}): pass {option}= if that is not the count you meant")


def _inferred_placement(worker_actions: Sequence[Sequence[Action]], num_stages: int) -> tuple[int, ...]:
    """Each stage on the worker whose list names it most often; Megatron's ``s % workers``
    for a stage no list names, or to break a tie.

    A stage named on several workers (an action moved by hand, a duplicate) keeps the
    worker that holds most of its actions, so validation names the stray action, whatever
    the layout (a V shape too, where Megatron's rule would blame the right ones).
    """
    counts: dict[int, dict[int, int]] = {}
    for worker, acts in enumerate(worker_actions):
        for act in acts:
            per_worker = counts.setdefault(act.stage, {})
            per_worker[worker] = per_worker.get(worker, 0) + 1
    workers = len(worker_actions)

    def owner(stage: int) -> int:
        per_worker = counts.get(stage)
        if not per_worker:
            return stage % workers
        most = max(per_worker.values())
        tied = [w for w, n in per_worker.items() if n == most]
        return stage % workers if stage % workers in tied else min(tied)

    return tuple(owner(s) for s in range(num_stages))


@dataclass(frozen=True)
class Plan:
    """A schedule as data: which worker runs which action, in which order.

    ``stage_to_worker[s]`` is the worker that owns stage ``s`` (several virtual stages may
    share a worker, Megatron style ``s % num_workers``); ``worker_actions[w]`` is the
    execution order on worker ``w``. Build one with ``build(...)`` or
    ``Plan.from_lists(...)``; call ``validate()`` before trusting a hand-made one.
    """

    name: str
    num_stages: int
    num_microbatches: int
    stage_to_worker: tuple[int, ...]
    worker_actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"Plan name must be a str, got {self.name!r}")
        for field_name in ("stage_to_worker", "worker_actions"):
            if not _is_sequence(getattr(self, field_name)):
                raise TypeError(f"Plan {field_name} must be a sequence, got {getattr(self, field_name)!r}")
        if not all(_is_sequence(acts) for acts in self.worker_actions):
            raise TypeError(f"Plan worker_actions must be a sequence of per-worker action sequences, "
                            f"got {self.worker_actions!r}")
        # Accept lists for convenience but store tuples so the plan stays immutable/hashable.
        object.__setattr__(self, "stage_to_worker", tuple(self.stage_to_worker))
        object.__setattr__(self, "worker_actions", tuple(tuple(acts) for acts in self.worker_actions))
        for name in ("num_stages", "num_microbatches"):
            _require_int(name, getattr(self, name))
        for acts in self.worker_actions:
            for act in acts:
                if not isinstance(act, Action):
                    raise TypeError(f"Plan worker_actions must hold Action objects, got {act!r}")

    def __hash__(self) -> int:
        # Computed once: ``Pipe.step`` looks a caller's plan up by value on every call, and
        # hashing every action of a long plan each time would cost more than the lookup saves.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.name, self.num_stages, self.num_microbatches, self.stage_to_worker,
                           self.worker_actions))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        # Not the cached hash: str hashes differ from process to process, so a plan sent to
        # another one must hash there like its equals do.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    # ----------------------------------------------------------------- structure
    @property
    def num_workers(self) -> int:
        """Number of workers (threads/devices); may be fewer than stages when interleaved."""
        return len(self.worker_actions)

    def actions(self) -> Iterator[Action]:
        """All actions, worker by worker, each worker in execution order."""
        for acts in self.worker_actions:
            yield from acts

    def worker_of(self, action: Action) -> int:
        """The worker that owns ``action``'s stage (where the runtime must run it)."""
        if not 0 <= action.stage < len(self.stage_to_worker):
            raise ValueError(f"{action} names stage {action.stage}; plan {self.name!r} has stages "
                             f"0..{len(self.stage_to_worker) - 1}")
        return self.stage_to_worker[action.stage]

    def stages_of(self, worker: int) -> tuple[int, ...]:
        """Stages owned by ``worker``, ascending: the partitions that worker must hold."""
        index = as_int(worker)
        if index is None or not 0 <= index < self.num_workers:
            raise ValueError(f"worker {worker!r}: plan {self.name!r} has workers 0..{self.num_workers - 1}")
        return tuple(s for s, w in enumerate(self.stage_to_worker) if w == index)

    @cached_property
    def _action_set(self) -> frozenset[Action]:
        return frozenset(self.actions())

    def __contains__(self, action: object) -> bool:
        return action in self._action_set

    @property
    def has_backward(self) -> bool:
        """False for a forward-only plan (``Pipe.forward``: autograd does the backward)."""
        return any(a.is_backward for a in self._action_set)

    def dependencies(self, action: Action) -> tuple[Action, ...]:
        """Actions that must finish before ``action`` starts, besides its worker predecessor.

        Rules: F(s,m) <- F(s-1,m); B(s,m) and I(s,m) <- F(s,m) and the input-gradient
        step of (s+1,m), which is I(s+1,m) when that stage is split in this plan, else
        B(s+1,m); W(s,m) <- I(s,m). The loss is part of the last stage's F.
        """
        if action not in self:  # the rules would name actions of another plan (6F0 of 2 stages)
            raise ValueError(f"{action} is not an action of plan {self.name!r} ({self.num_stages} stages, "
                             f"{self.num_microbatches} micro-batches)")
        s, m = action.stage, action.microbatch
        if action.kind == FORWARD:
            return (Action(s - 1, FORWARD, m),) if s > 0 else ()
        if action.kind == WEIGHT_GRAD:
            return (Action(s, INPUT_GRAD, m),)
        deps = [Action(s, FORWARD, m)]
        if s + 1 < self.num_stages:
            split = Action(s + 1, INPUT_GRAD, m)
            deps.append(split if split in self._action_set else Action(s + 1, BACKWARD, m))
        return tuple(deps)

    # ----------------------------------------------------------------- derived plans
    def forward_only(self) -> "Plan":
        """Same plan with only the F actions, same order (autograd runs the backward)."""
        return Plan(
            name=self.name,
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            stage_to_worker=self.stage_to_worker,
            worker_actions=tuple(tuple(a for a in acts if a.kind == FORWARD) for acts in self.worker_actions),
        )

    @classmethod
    def from_lists(
        cls,
        name: str,
        lists: Sequence[Sequence[Action | str | None]],
        *,
        num_stages: int | None = None,
        num_microbatches: int | None = None,
        stage_to_worker: Sequence[int] | None = None,
    ) -> "Plan":
        """Build and validate a hand-written plan; actions may be given as text ("1B3").

        ``None`` and blank strings are idle slots, as in ``torch.distributed.pipelining``'s
        ``pipeline_order``; they are dropped (the runtime waits on dependencies, not slots).
        Sizes default to what the lists mention. A stage found on one worker's list only
        belongs to that worker (so V-shaped plans need no ``stage_to_worker``); any other
        stage gets Megatron placement, stage ``s`` on worker ``s % len(lists)``.
        """
        for size_name, size in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
            if size is not None:
                _require_int(size_name, size)
        if not _is_sequence(lists) or not all(_is_sequence(acts) for acts in lists):
            raise TypeError(f"lists must hold one list of actions per worker (e.g. [['0F0', '0B0']]), got {lists!r}")
        worker_actions = tuple(
            tuple(_parsed(a, worker, entry) for entry, a in enumerate(acts) if not _is_idle(a))
            for worker, acts in enumerate(lists)
        )
        everything = [a for acts in worker_actions for a in acts]
        stages_from_lists = num_stages is None and stage_to_worker is None
        if num_stages is None:
            num_stages = max((a.stage for a in everything), default=-1) + 1
            if stage_to_worker is not None:
                num_stages = max(num_stages, len(stage_to_worker))
        inferred_microbatches = num_microbatches is None
        if num_microbatches is None:
            num_microbatches = max((a.microbatch for a in everything), default=-1) + 1
        if stage_to_worker is None:
            if not worker_actions:
                raise InvalidPlanError(f"plan {name!r} has no workers")
            stage_to_worker = _inferred_placement(worker_actions, num_stages)
        plan = cls(name, num_stages, num_microbatches, tuple(stage_to_worker), worker_actions)
        try:
            plan.validate()
        except InvalidPlanError as exc:
            # A typo in an index ("1F2" for "1F1", "2F0" in a plan of two stages) raises the
            # inferred count and shows up as an action missing elsewhere: say where that count
            # came from, when its highest index is rare (the typo) and the plan is incomplete.
            if exc.missing is None:
                raise
            hints = [
                _count_hint(worker_actions, lambda a: a.stage, num_stages, "stages", "num_stages")
                if stages_from_lists else None,
                _count_hint(worker_actions, lambda a: a.microbatch, num_microbatches, "micro-batches",
                            "num_microbatches") if inferred_microbatches else None,
            ]
            counted = [hint for hint in hints if hint is not None]
            if not counted:
                raise
            raise InvalidPlanError(f"{exc}; {'; '.join(counted)}", exc.missing) from None
        return plan

    @classmethod
    def from_torch(cls, schedule: Any, name: str | None = None) -> "Plan":
        """The plan of a ``torch.distributed.pipelining`` schedule, to run in one process.

        ``schedule`` is a schedule object (its ``pipeline_order``) or such an order itself:
        per rank, a list of actions or ``None``. See ``interop.py`` for the translation.
        """
        from .interop import from_torch

        return from_torch(schedule, name)

    @classmethod
    def load_csv(cls, path: Any, name: str | None = None) -> "Plan":
        """Read a plan from CSV, a row of actions per worker (torch's ``compute_only`` format)."""
        from .interop import load_csv

        return load_csv(path, name)

    def save_csv(self, path: Any) -> None:
        """Write this plan as CSV, a row per worker, that ``load_csv`` and torch's ``_load_csv`` read."""
        from .interop import save_csv

        save_csv(self, path)

    # ----------------------------------------------------------------- checks & views
    def validate(self) -> None:
        """Raise ``InvalidPlanError`` naming the first bad action; see ``validate.py``."""
        from .validate import validate

        validate(self)

    def simulate(self, costs: "Costs" = None, *, comm: float = 0.0) -> "Simulation":
        """Timed list-scheduling of the plan; see ``simulate.py`` for the cost forms."""
        from .simulate import simulate

        return simulate(self, costs, comm=comm)

    def table(self, costs: "Costs" = None, *, comm: float = 0.0) -> str:
        """Time table (one row per worker, ``.`` for idle slots) from the simulation."""
        from .render import table

        return table(self, costs, comm=comm)

    def chrome_trace(self, costs: "Costs" = None, *, comm: float = 0.0, us_per_unit: float = 1.0) -> dict[str, Any]:
        """Chrome/Perfetto trace (``chrome://tracing``) of the simulated plan."""
        from .render import chrome_trace

        return chrome_trace(self, costs, comm=comm, us_per_unit=us_per_unit)

    def save_png(self, path: Any, costs: "Costs" = None, *, comm: float = 0.0) -> None:
        """Gantt chart of the simulated plan; needs matplotlib (ImportError otherwise)."""
        from .render import save_png

        save_png(self, path, costs, comm=comm)

    def __str__(self) -> str:
        rows = [f"{self.name}: {self.num_stages} stages, {self.num_microbatches} micro-batches, "
                f"{self.num_workers} workers"]
        for w, acts in enumerate(self.worker_actions):
            rows.append(f"  w{w}: " + " ".join(map(str, acts)))
        return "\n".join(rows)
