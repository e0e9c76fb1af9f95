"""Simulation costs and the views (table, chrome trace, png) drawn from the plan."""
from __future__ import annotations

import io
import math
import random
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from torchpipe.schedule import SCHEDULES, Action, Plan, Simulation, build

GPIPE_2x2 = """\
slot 0   1   2   3   4   5   6   7   8
w0   0F0 0F1 .   .   .   0B1 ~   0B0 ~
w1   .   1F0 1F1 1B1 ~   1B0 ~   .   ."""

ONE_F_ONE_B_3x4 = """\
slot 0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17
w0   0F0 0F1 0F2 .   .   .   .   0B0 ~   0F3 0B1 ~   .   0B2 ~   .   0B3 ~
w1   .   1F0 1F1 .   .   1B0 ~   1F2 1B1 ~   1F3 1B2 ~   .   1B3 ~   .   .
w2   .   .   2F0 2B0 ~   2F1 2B1 ~   2F2 2B2 ~   2F3 2B3 ~   .   .   .   ."""


def test_golden_tables() -> None:
    assert build("gpipe", 2, 2).table() == GPIPE_2x2
    assert build("1f1b", 3, 4).table() == ONE_F_ONE_B_3x4


def test_table_scales_with_costs() -> None:
    # Same shape when all costs scale (slot = gcd), finer slots when they do not.
    assert build("gpipe", 2, 2).table({"F": 0.5, "B": 1.0}) == GPIPE_2x2
    assert build("gpipe", 2, 2).table({"F": 3, "B": 6}) == GPIPE_2x2
    assert build("gpipe", 1, 1).table({"F": 1, "B": 3}) == "slot 0   1   2   3\nw0   0F0 0B0 ~   ~"


def _cells(table: str) -> list[list[str]]:
    return [line.split()[1:] for line in table.splitlines()[1:]]


# Regression: slots were fractions of the *absolute* times, so costs in seconds (1e-4) made a
# zero slot (ZeroDivisionError), and irregular costs put an action in no cell at all.
def test_table_slots_do_not_depend_on_the_cost_unit() -> None:
    unit = build("1f1b", 2, 3).table()
    assert build("1f1b", 2, 3).table({"F": 1e-4, "B": 2e-4}) == unit
    assert build("1f1b", 2, 3).table({"F": 1e3, "B": 2e3}) == unit
    assert build("gpipe", 1, 1).table({"F": 1e-4, "B": 2e-4}) == "slot 0   1   2\nw0   0F0 0B0 ~"


def test_irregular_costs_get_one_column_per_event() -> None:
    table = build("zb-h1", 2, 2).table({"F": 2, "I": 1.57, "W": 0.2})
    assert table.splitlines() == [
        "time 0     2     4     5.57  7.14  7.34  7.57  9.14  9.34  9.54  10.71",
        "w0   0F0   0F1   .     0I0   0W0   .     .     0I1   ~     ~     0W1",
        "w1   .     1F0   1I0   1F1   ~     ~     1I1   1W0   1W1   .     .",
    ]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_action_is_drawn_once_whatever_the_costs(name: str) -> None:
    rng = random.Random(name)
    for _ in range(40):
        workers = rng.randint(1, 4)
        stages = 2 * workers if name in ("zb-v", "interleaved-1f1b") else workers
        m = workers if name == "interleaved-1f1b" else rng.randint(1, 8)
        plan = build(name, stages, m)
        scale = rng.choice([1e-6, 1e-3, 1.0, 37.0])
        costs = {kind: scale * rng.uniform(0.05, 3.0) for kind in "FIW"}
        comm = rng.choice([0.0, 0.013 * scale])
        table = plan.table(costs, comm=comm)
        for row, acts in zip(_cells(table), plan.worker_actions):
            assert [c for c in row if c not in (".", "~")] == [str(a) for a in acts], (table, costs)


@pytest.mark.parametrize("nudge", [1e-7, 3e-8, -3e-8])
def test_costs_just_off_whole_ratios_keep_every_action_in_its_slot(nudge: float) -> None:
    """Review (helper-141): the slot grid took times within 1e-6 of a slot, but cells were
    placed to 1e-9: an action just past a boundary went one column late, and one past the
    last column was not drawn at all ("0B0" missing, "0B1" two slots wide)."""
    assert build("gpipe", 1, 2).table({"F": 1, "B": 1 + nudge}).splitlines() == [
        "slot 0   1   2   3",
        "w0   0F0 0F1 0B1 0B0",
    ]
    plan = build("1f1b", 2, 8)
    table = plan.table({"F": 1, "B": 2 + nudge})
    assert table == plan.table({"F": 1, "B": 2})
    for row, acts in zip(_cells(table), plan.worker_actions):
        assert [c for c in row if c not in (".", "~")] == [str(a) for a in acts]


def test_time_headers_tell_close_start_times_apart() -> None:
    header = build("1f1b", 2, 2).table({"F": 1000, "B": 0.5}).splitlines()[0].split()
    assert header == ["time", "0", "1000", "2000", "2000.5", "2001", "3000.5", "3001"]  # was 2000 twice


def test_actions_without_duration_are_listed_under_the_grid() -> None:
    assert build("gpipe", 2, 2).table({"F": 1, "B": 0}).splitlines() == [
        "slot 0   1   2",
        "w0   0F0 0F1 .",
        "w1   .   1F0 1F1",
        "no duration (not drawn): w0: 0B1 0B0; w1: 1B1 1B0",
    ]


@pytest.mark.parametrize("name", SCHEDULES)
def test_table_is_drawn_from_worker_actions(name: str) -> None:
    stages = 8 if name in ("zb-v", "interleaved-1f1b") else 4
    plan = build(name, stages, 8)
    for row, acts in zip(_cells(plan.table()), plan.worker_actions):
        assert [c for c in row if c not in (".", "~")] == [str(a) for a in acts]
    sim = plan.simulate()
    for w, row in enumerate(_cells(plan.table())):
        assert row.count(".") == pytest.approx(sim.makespan - sim.busy[w])


def test_unit_costs_default() -> None:
    sim = build("zb-h1", 1, 1).simulate()
    assert [(str(a), s, e) for _, a, s, e in sim.timeline] == [("0F0", 0, 1), ("0I0", 1, 2), ("0W0", 2, 3)]
    assert build("gpipe", 1, 1).simulate().makespan == 3  # B = 2


def test_cost_forms_agree() -> None:
    plan = build("1f1b", 3, 4)
    per_stage = {"F": [1.0, 2.0, 3.0], "B": [2.0, 4.0, 6.0]}
    by_fn = plan.simulate(lambda a: (a.stage + 1) * (1.0 if a.kind == "F" else 2.0))
    by_seq = plan.simulate(per_stage)
    assert by_fn == by_seq
    assert by_seq.busy == (12.0, 24.0, 36.0)
    # Unbalanced stages: the bubble counts every worker's idle time.
    uneven = build("gpipe", 2, 1).simulate({"F": [1, 3], "B": [2, 6]})
    assert (uneven.makespan, uneven.busy, uneven.bubble_ratio) == (12.0, (3.0, 9.0), 0.5)
    # B defaults to I + W when only those are given, and when only one half is given the
    # other takes its default: a full and a split backward always cost the same.
    assert build("gpipe", 1, 1).simulate({"I": 2, "W": 3}).makespan == 6
    assert build("gpipe", 1, 1).simulate({"I": 3}).makespan == 1 + 3 + 1
    assert build("gpipe", 1, 1).simulate({"W": 0.5}).makespan == 1 + 1 + 0.5
    assert build("gpipe", 2, 4).simulate({"I": 3}).makespan == build("gpipe", 2, 4).simulate({"I": 3, "W": 1}).makespan
    assert build("gpipe", 1, 1).simulate({"F": Fraction(1, 2), "B": [Fraction(2)]}).makespan == 2.5
    # The other way round: a B alone splits into halves for a split-backward plan, and B with
    # one half leaves the rest to the other, so zero-bubble plans are not charged unit I and W.
    zb = build("zb-h1", 4, 8)
    assert zb.simulate({"F": 1, "B": 4}) == zb.simulate({"F": 1, "I": 2, "W": 2})
    assert zb.simulate({"F": 1, "B": [4, 4, 4, 4], "I": 3}) == zb.simulate({"F": 1, "I": 3, "W": 1})
    assert zb.simulate({"F": 1, "B": 4, "W": 1}) == zb.simulate({"F": 1, "I": 3, "W": 1})
    assert zb.table({"F": 1, "B": 4}) == zb.table({"F": 1, "I": 2, "W": 2})
    with pytest.raises(ValueError, match=r"costs\['I'\] at stage 1 is 3, more than costs\['B'\] = 2"):
        zb.simulate({"F": 1, "B": [4, 2, 4, 4], "I": 3})
    with pytest.raises(ValueError, match="2 entries for 3 stages"):
        plan.simulate({"F": [1, 2]})
    # Bad values are refused when the costs are read, naming the entry, not when an action runs.
    with pytest.raises(ValueError, match=r"costs\['F'\] must be a finite number >= 0, got -1"):
        plan.simulate({"F": -1})
    with pytest.raises(ValueError, match=r"costs\['W'\] .* got -1"):
        build("gpipe", 1, 1).simulate({"I": 5, "W": -1})  # gpipe runs no W: still refused
    with pytest.raises(ValueError, match=r"costs\['F'\]\[1\] .* got inf"):
        plan.simulate({"F": [1, math.inf, 1]})
    with pytest.raises(ValueError, match="got nan"):
        plan.simulate({"B": math.nan})
    with pytest.raises(TypeError, match=r"costs\['F'\] must be a number or a sequence of 3 numbers, got '12'"):
        plan.simulate({"F": "12"})
    with pytest.raises(TypeError, match="must be a number or a sequence of 3 numbers, got True"):
        plan.simulate({"F": True})
    with pytest.raises(ValueError, match="cost of action 0F0 must be a finite number >= 0, got -1"):
        plan.simulate(lambda a: -1)
    with pytest.raises(ValueError, match="comm must be a finite number >= 0, got inf"):
        plan.simulate(comm=math.inf)
    with pytest.raises(ValueError, match="'X'"):
        plan.simulate({"X": 1})


def test_comm_added_across_workers_only() -> None:
    plan = build("gpipe", 2, 1)
    sim = plan.simulate(comm=0.5)
    assert sim.span(Action(1, "F", 0)) == (1.5, 2.5)
    assert sim.span(Action(0, "B", 0)) == (5.0, 7.0)
    one_worker = build("interleaved-1f1b", 2, 1, virtual_stages=2)
    assert one_worker.simulate(comm=5).makespan == one_worker.simulate().makespan


def test_simulation_fields() -> None:
    sim = build("gpipe", 2, 2).simulate()
    assert isinstance(sim, Simulation)
    assert sim.makespan == 9 and sim.busy == (6.0, 6.0)
    assert sim.bubble_ratio == pytest.approx(1 / 3)
    assert [e[2] for e in sim.timeline] == sorted(e[2] for e in sim.timeline)
    for w, act, start, end in sim.timeline:
        assert end - start == (1 if act.kind == "F" else 2)
        for dep in build("gpipe", 2, 2).dependencies(act):
            assert sim.span(dep)[1] <= start


def test_peak_activations_counted_per_stage_and_microbatch() -> None:
    plan = Plan.from_lists("two-stages-one-worker", [["0F0", "1F0", "0F1", "1F1", "1B0", "0B0", "1B1", "0B1"]])
    assert plan.simulate().peak_activations == (4,)
    split = Plan.from_lists("w-releases", [["0F0", "0I0", "0F1", "0W0", "0I1", "0W1"]])
    assert split.simulate().peak_activations == (2,)  # 0F0 is still held after 0I0


def test_chrome_trace() -> None:
    plan = build("1f1b", 2, 3)
    trace = plan.chrome_trace()
    events = trace["traceEvents"]
    assert len(events) == len(list(plan.actions()))
    sim = plan.simulate()
    for ev, (w, act, start, end) in zip(events, sim.timeline):
        assert ev["ph"] == "X" and ev["pid"] == 0 and ev["tid"] == w and ev["name"] == str(act)
        assert (ev["ts"], ev["dur"]) == (start, end - start)
    scaled = plan.chrome_trace({"F": 0.001, "B": 0.002}, us_per_unit=1e6)["traceEvents"]
    assert scaled[-1]["ts"] + scaled[-1]["dur"] == pytest.approx(sim.makespan * 1000)


@pytest.mark.parametrize("scale,error", [(-1.0, ValueError), (0, ValueError), (float("nan"), ValueError),
                                         (float("inf"), ValueError), ("1", TypeError), (True, TypeError)])
def test_chrome_trace_refuses_a_bad_unit(scale: object, error: type) -> None:
    # Negative or non-finite timestamps would make a trace Perfetto rejects (json writes NaN).
    with pytest.raises(error, match="us_per_unit"):
        build("1f1b", 2, 2).chrome_trace(us_per_unit=scale)  # type: ignore[arg-type]
    if error is ValueError:  # one bound in every message: 0 is refused too
        with pytest.raises(error, match="us_per_unit must be a finite number > 0"):
            build("1f1b", 2, 2).chrome_trace(us_per_unit=scale)  # type: ignore[arg-type]


def test_a_cost_beyond_a_floats_range_is_the_value_error_of_any_bad_cost() -> None:
    """Review (helper-145): an int too large for a float raised OverflowError, not the
    documented ValueError (and its 400 digits filled the message)."""
    plan = build("1f1b", 2, 2)
    for call in (lambda: plan.simulate({"F": 10 ** 400}), lambda: plan.simulate(comm=10 ** 400),
                 lambda: plan.chrome_trace(us_per_unit=10 ** 400)):
        with pytest.raises(ValueError, match=r"must be a finite number >=? 0, got 1000000000.*\(401 characters\)$"):
            call()


def test_per_stage_costs_may_be_numpy_arrays_or_tensors() -> None:
    """Review (helper-145): two costs in an array or a tensor were refused as not "a sequence
    of 2 numbers", where balance_by_cost takes them."""
    import numpy
    import torch

    plan = build("1f1b", 2, 4)
    expected = plan.simulate({"F": [1.0, 2.0], "B": 3.0})
    for form in (numpy.array, torch.tensor):
        assert plan.simulate({"F": form([1.0, 2.0]), "B": form(3.0)}) == expected
    with pytest.raises(ValueError, match=r"costs\['F'\] has 3 entries for 2 stages"):
        plan.simulate({"F": numpy.array([1.0, 2.0, 3.0])})


def test_costs_that_overflow_when_added_are_refused() -> None:
    with pytest.raises(ValueError, match="past the largest float"):
        build("1f1b", 2, 2).simulate({"F": 1e308, "B": 1e308})


def test_save_png_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="matplotlib"):
        build("gpipe", 2, 2).save_png(str(tmp_path / "plan.png"))


# --------------------------------------------------------------------------- save_png
# matplotlib is not a dependency, so save_png is checked against a fake matplotlib that
# records every call; its savefig writes a real (non-PNG) file at the given path.


@dataclass
class _Call:
    """One recorded call: who received it, the method name and its arguments."""

    owner: str
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Recorder:
    """Object whose every method call is appended to a shared log (``owner`` tags it)."""

    def __init__(self, owner: str, log: list[_Call]) -> None:
        self._owner = owner
        self._log = log

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)

        def method(*args: Any, **kwargs: Any) -> None:
            self._log.append(_Call(self._owner, name, args, kwargs))

        return method


class _FakeFigure(_Recorder):
    """Figure whose ``savefig`` also writes a file, so the test can look for it."""

    fail_savefig: bool = False

    def __init__(self, owner: str, log: list[_Call], axes: _Recorder) -> None:
        super().__init__(owner, log)
        self._axes = axes

    def add_subplot(self, *args: Any, **kwargs: Any) -> _Recorder:
        self._log.append(_Call(self._owner, "add_subplot", args, kwargs))
        return self._axes

    def savefig(self, path: Any, *args: Any, **kwargs: Any) -> None:
        self._log.append(_Call(self._owner, "savefig", (path, *args), kwargs))
        if self.fail_savefig:
            raise OSError(f"cannot write {path}")
        if hasattr(path, "write"):  # a file object, as matplotlib's savefig takes
            path.write(b"fake png")
            return
        with open(path, "wb") as f:
            f.write(b"fake png")


class _FakeMatplotlib:
    """Fake ``matplotlib`` modules (figure, Agg canvas, and pyplot) plus their call log.

    save_png must draw on a bare ``Figure`` with the Agg canvas: every use of ``matplotlib.use``
    or ``pyplot`` (which would change the caller's backend or figure registry) is logged too,
    so a test can check there is none.
    """

    def __init__(self) -> None:
        self.log: list[_Call] = []
        self.axes = _Recorder("ax", self.log)
        self.figure = _FakeFigure("fig", self.log, self.axes)
        self.matplotlib = types.ModuleType("matplotlib")
        self.matplotlib.use = self._recording("matplotlib", "use")  # type: ignore[attr-defined]
        self.figure_module = types.ModuleType("matplotlib.figure")
        self.figure_module.Figure = self._new_figure  # type: ignore[attr-defined]
        self.backends = types.ModuleType("matplotlib.backends")
        self.backend_agg = types.ModuleType("matplotlib.backends.backend_agg")
        self.backend_agg.FigureCanvasAgg = self._recording("agg", "FigureCanvasAgg")  # type: ignore[attr-defined]
        self.pyplot = types.ModuleType("matplotlib.pyplot")
        self.pyplot.__getattr__ = lambda name: self._recording("plt", name)  # type: ignore[attr-defined]

    def modules(self) -> dict[str, types.ModuleType]:
        return {"matplotlib": self.matplotlib, "matplotlib.figure": self.figure_module,
                "matplotlib.backends": self.backends, "matplotlib.backends.backend_agg": self.backend_agg,
                "matplotlib.pyplot": self.pyplot}

    def _recording(self, owner: str, name: str) -> Callable[..., None]:
        """A function that only records its calls under ``owner.name``."""

        def function(*args: Any, **kwargs: Any) -> None:
            self.log.append(_Call(owner, name, args, kwargs))

        return function

    def _new_figure(self, *args: Any, **kwargs: Any) -> _FakeFigure:
        self.log.append(_Call("matplotlib.figure", "Figure", args, kwargs))
        return self.figure

    def calls(self, owner: str, name: str) -> list[_Call]:
        """Recorded calls of ``owner.name``, in call order."""
        return [c for c in self.log if (c.owner, c.name) == (owner, name)]

    def index(self, owner: str, name: str) -> int:
        """Position in the log of the first ``owner.name`` call."""
        return next(i for i, c in enumerate(self.log) if (c.owner, c.name) == (owner, name))


@pytest.fixture
def fake_mpl(monkeypatch: pytest.MonkeyPatch) -> _FakeMatplotlib:
    """Install the fake matplotlib in ``sys.modules`` for one test."""
    fake = _FakeMatplotlib()
    for name, module in fake.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    return fake


def _barh_args(y: float, width: float, height: float = 0.8, left: float | None = None, **kwargs: Any) -> dict[str, Any]:
    """Bind ``Axes.barh`` arguments the way matplotlib does."""
    return {"y": y, "width": width, "left": 0.0 if left is None else left, **kwargs}


def _text_args(x: float, y: float, s: str, fontdict: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Bind ``Axes.text`` arguments the way matplotlib does."""
    return {"x": x, "y": y, "s": s, **kwargs}


@dataclass(frozen=True)
class _Bar:
    """A drawn bar with the label drawn at its centre."""

    row: float
    left: float
    width: float
    color: Any
    label: str


def _drawn_bars(fake: _FakeMatplotlib) -> list[_Bar]:
    """Pair every ``barh`` with the single ``text`` at its centre; fail on strays."""
    bars = [_barh_args(*c.args, **c.kwargs) for c in fake.calls("ax", "barh")]
    texts = [_text_args(*c.args, **c.kwargs) for c in fake.calls("ax", "text")]
    assert len(texts) == len(bars)
    drawn = []
    for t in texts:
        at_centre = [
            b for b in bars if b["y"] == t["y"] and b["left"] + b["width"] / 2 == pytest.approx(t["x"])
        ]
        assert len(at_centre) == 1, f"label {t['s']!r} is not at the centre of exactly one bar"
        b = at_centre[0]
        drawn.append(_Bar(b["y"], b["left"], b["width"], b.get("color"), t["s"]))
    return drawn


def _by_label(fake: _FakeMatplotlib) -> dict[str, _Bar]:
    """Drawn bars keyed by label, which must be unique."""
    bars = _drawn_bars(fake)
    by_label = {b.label: b for b in bars}
    assert len(by_label) == len(bars), "two bars carry the same label"
    return by_label


def _check_chart(fake: _FakeMatplotlib, plan: Plan, sim: Simulation, path: Path) -> None:
    """Everything save_png must have drawn for ``plan`` simulated as ``sim``."""
    # One bare figure on the Agg canvas; the caller's backend and pyplot are left alone.
    assert fake.calls("matplotlib", "use") == [] and not [c for c in fake.log if c.owner == "plt"]
    assert len(fake.calls("matplotlib.figure", "Figure")) == 1
    assert [c.args for c in fake.calls("agg", "FigureCanvasAgg")] == [(fake.figure,)]
    width, height = fake.calls("matplotlib.figure", "Figure")[0].kwargs["figsize"]
    assert width > 0 and height > 0
    # One bar per action, on the row of the worker the plan puts it on, timed as simulated.
    bars = _by_label(fake)
    placed = {str(a): (w, a) for w, acts in enumerate(plan.worker_actions) for a in acts}
    assert set(bars) == set(placed)
    for label, (w, act) in placed.items():
        start, end = sim.span(act)
        assert bars[label].row == w
        assert (bars[label].left, bars[label].width) == (pytest.approx(start), pytest.approx(end - start))
    # One colour per kind, different kinds told apart.
    colors: dict[str, set[Any]] = {}
    for _, act in placed.values():
        colors.setdefault(act.kind, set()).add(bars[str(act)].color)
    assert all(len(c) == 1 and None not in c for c in colors.values()), colors
    assert len({next(iter(c)) for c in colors.values()}) == len(colors)
    # Rows named w0.. with w0 on top, a time axis, plan name and bubble in the title.
    (yticks,) = fake.calls("ax", "set_yticks")
    assert list(yticks.args[0]) == list(range(plan.num_workers))
    assert list(yticks.args[1]) == [f"w{w}" for w in range(plan.num_workers)]
    assert len(fake.calls("ax", "invert_yaxis")) == 1
    assert [c.args for c in fake.calls("ax", "set_xlabel")] == [("time",)]
    (title,) = fake.calls("ax", "set_title")
    assert title.args[0] == f"{plan.name}: bubble {sim.bubble_ratio:.1%}"
    # Saved once to the path.
    assert [c.args for c in fake.calls("fig", "savefig")] == [(str(path),)]
    assert path.read_bytes() == b"fake png"


SAVE_PNG_CASES = [
    ("1f1b", 4, None, 0.0),
    ("1f1b", 4, {"F": 1, "B": 2}, 0.0),
    ("1f1b", 4, {"F": [1.0, 2.0, 3.0, 4.0], "B": 3}, 0.25),
    ("zb-h1", 4, None, 0.0),
    ("zb-h1", 4, {"F": 2, "I": 1.5, "W": 0.5}, 0.5),
    # Several stages per worker: the row is the worker, not the stage.
    ("interleaved-1f1b", 8, None, 0.0),
    ("zb-v", 8, {"F": 1, "I": 1, "W": 2}, 0.0),
]


@pytest.mark.parametrize(("name", "stages", "costs", "comm"), SAVE_PNG_CASES)
def test_save_png_draws_the_simulated_plan(
    fake_mpl: _FakeMatplotlib, tmp_path: Path, name: str, stages: int, costs: Any, comm: float
) -> None:
    plan = build(name, stages, 8)
    assert plan.num_workers == 4
    path = tmp_path / "plan.png"
    plan.save_png(str(path), costs, comm=comm)
    _check_chart(fake_mpl, plan, plan.simulate(costs, comm=comm), path)


def test_save_png_zero_bubble_uses_split_backward_kinds(fake_mpl: _FakeMatplotlib, tmp_path: Path) -> None:
    build("zb-h1", 4, 8).save_png(str(tmp_path / "zb.png"))
    bars = _drawn_bars(fake_mpl)
    assert {Action.parse(b.label).kind for b in bars} == {"F", "I", "W"}
    assert len({b.color for b in bars}) == 3


def test_save_png_costs_set_bar_widths(fake_mpl: _FakeMatplotlib, tmp_path: Path) -> None:
    plan = build("1f1b", 4, 8)
    for costs in (None, {"F": 1, "B": 2}, {"F": 3, "B": 5}):
        fake_mpl.log.clear()
        plan.save_png(str(tmp_path / "plan.png"), costs)
        widths = {b.label: b.width for b in _drawn_bars(fake_mpl)}
        f, b = (1, 2) if costs is None else (costs["F"], costs["B"])
        assert widths == {str(a): (f if a.kind == "F" else b) for a in plan.actions()}
    # Costs as a function of the action: stage s is s + 1 times slower.
    fake_mpl.log.clear()
    plan.save_png(str(tmp_path / "plan.png"), lambda a: (a.stage + 1) * (1 if a.kind == "F" else 2))
    for bar in _drawn_bars(fake_mpl):
        act = Action.parse(bar.label)
        assert bar.width == (act.stage + 1) * (1 if act.kind == "F" else 2)


def test_save_png_function_and_method_agree(fake_mpl: _FakeMatplotlib, tmp_path: Path) -> None:
    from torchpipe.schedule.render import save_png

    plan = build("zb-h1", 3, 5)
    save_png(plan, str(tmp_path / "a.png"), {"F": 2}, comm=1.0)
    by_function = _drawn_bars(fake_mpl)
    fake_mpl.log.clear()
    plan.save_png(str(tmp_path / "b.png"), {"F": 2}, comm=1.0)
    assert _drawn_bars(fake_mpl) == by_function
    assert (tmp_path / "a.png").exists() and (tmp_path / "b.png").exists()


def test_save_png_writes_a_png_under_the_name_given_and_refuses_a_non_path_first(
        fake_mpl: _FakeMatplotlib, tmp_path: Path) -> None:
    """Review (helper-145): an int path failed with an AttributeError after the whole chart was
    drawn, and matplotlib picked the format from the suffix (``x.jpg`` gave a JPEG, a name
    without a suffix got ``.png`` added)."""
    with pytest.raises(TypeError, match="save_png takes a file path"):
        build("1f1b", 2, 2).save_png(3)  # type: ignore[arg-type]
    assert fake_mpl.calls("matplotlib.figure", "Figure") == []
    build("1f1b", 2, 2).save_png(str(tmp_path / "schedule.jpg"))
    saves = [call for call in fake_mpl.log if call.name == "savefig"]
    assert len(saves) == 1 and saves[0].kwargs == {"format": "png"}
    buffer = io.BytesIO()  # a file object is written as such (helper-146)
    build("1f1b", 2, 2).save_png(buffer)
    saves = [call for call in fake_mpl.log if call.name == "savefig"]
    assert saves[-1].args[0] is buffer and saves[-1].kwargs == {"format": "png"}


def test_save_png_rejects_bad_costs_before_drawing(fake_mpl: _FakeMatplotlib, tmp_path: Path) -> None:
    path = tmp_path / "plan.png"
    with pytest.raises(ValueError, match=">= 0"):
        build("1f1b", 2, 2).save_png(str(path), {"F": -1})
    with pytest.raises(ValueError, match="comm"):
        build("1f1b", 2, 2).save_png(str(path), comm=-1.0)
    assert fake_mpl.calls("matplotlib.figure", "Figure") == [] and not path.exists()


# Regression: the width once followed the raw makespan (0.4 inch per cost unit), so costs in
# microseconds asked for a figure a million pixels wide that Pillow refuses to open.
def test_save_png_figure_size_does_not_depend_on_cost_unit(fake_mpl: _FakeMatplotlib, tmp_path: Path) -> None:
    plan = build("zb-h1", 4, 8)
    sizes = []
    for scale in (1e-3, 1.0, 1e3):
        fake_mpl.log.clear()
        plan.save_png(str(tmp_path / "plan.png"), {k: scale for k in "FIW"})
        sizes.append(fake_mpl.calls("matplotlib.figure", "Figure")[0].kwargs["figsize"])
    assert sizes[0] == sizes[1] == sizes[2]
    width, _ = sizes[0]
    assert 6.0 <= width <= 60.0


# Regression: a failed savefig (missing directory, full disk) once left the figure open in
# pyplot. A bare figure is in no registry: nothing is left behind, and the error comes through.
def test_save_png_leaves_nothing_open_when_savefig_fails(fake_mpl: _FakeMatplotlib, tmp_path: Path) -> None:
    fake_mpl.figure.fail_savefig = True
    with pytest.raises(OSError):
        build("1f1b", 2, 2).save_png(str(tmp_path / "plan.png"))
    assert not [c for c in fake_mpl.log if c.owner == "plt"]


# Regression: save_png called matplotlib.use("Agg"), switching a notebook's backend for good.
def test_save_png_keeps_the_callers_matplotlib_backend(tmp_path: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    before = matplotlib.get_backend()
    build("1f1b", 2, 2).save_png(str(tmp_path / "plan.png"))
    assert matplotlib.get_backend() == before
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_costs_too_far_apart_for_slots_and_times_that_overflow() -> None:
    """table() raised OverflowError from its slot search; chrome_trace wrote inf timestamps."""
    plan = build("1f1b", 2, 2)
    text = plan.table({"F": 5e-324, "B": 1.0})
    assert text.splitlines()[0].startswith("time")
    with pytest.raises(ValueError, match="overflow.*us_per_unit=1e\\+300"):
        plan.chrome_trace({"F": 1e300, "B": 1e300}, us_per_unit=1e300)
