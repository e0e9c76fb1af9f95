"""Simulation costs and the views (table, chrome trace, png) drawn from the plan."""
from __future__ import annotations

import sys

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
    # B defaults to I + W when only those are given.
    assert build("gpipe", 1, 1).simulate({"I": 2, "W": 3}).makespan == 6
    with pytest.raises(ValueError, match="2 entries for 3 stages"):
        plan.simulate({"F": [1, 2]})
    with pytest.raises(ValueError, match="0F0.*>= 0"):
        plan.simulate({"F": -1})
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


def test_save_png_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="matplotlib"):
        build("gpipe", 2, 2).save_png(str(tmp_path / "plan.png"))
