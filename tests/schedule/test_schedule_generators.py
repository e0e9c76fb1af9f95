"""Generators: every schedule validates over a grid; bubbles and memory match theory."""
from __future__ import annotations

from collections import Counter
from fractions import Fraction
from math import isclose
from types import SimpleNamespace

import pytest

from torchpipe.schedule import SCHEDULES, Action, Plan, build

PS = range(1, 7)
MS = range(1, 13)


def _grid() -> list[tuple[str, int, dict]]:
    """(name, num_stages, options) for every schedule, p in 1..6, v in 1..3 where it applies."""
    cases: list[tuple[str, int, dict]] = []
    for p in PS:
        cases += [("gpipe", p, {}), ("gpipe", p, {"backward": False}), ("1f1b", p, {}), ("zb-h1", p, {})]
        cases += [("zb-v", 2 * p, {})]
        cases += [("interleaved-1f1b", p * v, {"virtual_stages": v}) for v in (1, 2, 3)]
    return cases


def test_schedules_names() -> None:
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")


@pytest.mark.parametrize("name,stages,options", _grid(), ids=lambda x: str(x))
def test_grid_validates_and_simulates(name: str, stages: int, options: dict) -> None:
    v = options.get("virtual_stages", 2 if name == "zb-v" else 1)
    p = stages // v
    for m in MS:
        plan = build(name, stages, m, **options)
        plan.validate()
        assert plan.num_workers == p and plan.num_stages == stages and plan.num_microbatches == m
        kinds = Counter(a.kind for a in plan.actions())
        assert kinds["F"] == stages * m
        if options.get("backward") is False:
            assert set(kinds) == {"F"}
        elif name.startswith("zb"):
            assert kinds["I"] == kinds["W"] == stages * m and kinds["B"] == 0
        else:
            assert kinds["B"] == stages * m and kinds["I"] == kinds["W"] == 0
        for act in plan.actions():
            assert plan.worker_of(act) == plan.stage_to_worker[act.stage]
        sim = plan.simulate()
        assert len(sim.timeline) == sum(kinds.values())
        assert 0.0 <= sim.bubble_ratio < 1.0
        # Every worker does the same amount of work under unit costs and one stage per
        # worker (or the same number of stages per worker).
        assert len(set(sim.busy)) == 1


def _bubble(name: str, stages: int, m: int, **options: int) -> float:
    return build(name, stages, m, **options).simulate().bubble_ratio


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_closed_form_gpipe_1f1b(name: str) -> None:
    for p in PS:
        for m in MS:
            sim = build(name, p, m).simulate()
            expected = Fraction(p - 1, m + p - 1)
            assert isclose(sim.bubble_ratio, float(expected), abs_tol=1e-12), (p, m, sim.bubble_ratio)
            assert sim.makespan == 3 * (m + p - 1)


def test_bubble_closed_form_interleaved() -> None:
    for p in PS:
        for v in (1, 2, 3):
            for m in range(p, 13, p):
                got = _bubble("interleaved-1f1b", p * v, m, virtual_stages=v)
                assert isclose(got, (p - 1) / (v * m + p - 1), abs_tol=1e-12), (p, v, m, got)


def test_interleaved_beats_1f1b_and_checks_its_options() -> None:
    assert _bubble("interleaved-1f1b", 8, 8, virtual_stages=2) < _bubble("1f1b", 4, 8)
    build("interleaved-1f1b", 8, 3, virtual_stages=2)  # m < p: one short group
    with pytest.raises(ValueError, match="virtual_stages"):
        build("interleaved-1f1b", 7, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages"):
        build("interleaved-1f1b", 4, 4, virtual_stages=0)


def test_interleaved_takes_any_microbatch_count() -> None:
    # m that p does not divide: ragged groups (sizes differ by one, each >= p), never a
    # deadlock, and per layer never a larger bubble than 1F1B's.
    for p in range(1, 7):
        for v in (2, 3, 4):
            for m in range(1, 41):
                plan = build("interleaved-1f1b", p * v, m, virtual_stages=v)
                sim = plan.simulate()
                assert sim.bubble_ratio <= _bubble("1f1b", p, m) + 1e-12, (p, v, m)
                first_group = m // max(1, m // p) + (1 if m % max(1, m // p) else 0)
                assert sim.peak_activations == tuple(
                    min((v - 1) * first_group + 2 * (p - 1 - r) + 1, m * v) for r in range(p)
                ), (p, v, m)


def test_interleaved_order_equals_torch_distributed_pipelining() -> None:
    # Where torch 2.13's ScheduleInterleaved1F1B accepts m (its round count divides m,
    # ragged m = 6 or 10 on 4 workers included), every worker runs torch's order.
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    ranks_ops = getattr(schedules.ScheduleInterleaved1F1B, "_calculate_single_rank_operations", None)
    if ranks_ops is None:
        pytest.skip("this torch computes interleaved orders elsewhere")
    compared = 0
    for p in range(1, 6):
        for v in (2, 3):
            for m in range(1, 21):
                rounds = max(1, m // p)
                if m % rounds:
                    continue  # torch refuses these m
                fake = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=p,
                                       _n_microbatches=m)
                plan = build("interleaved-1f1b", p * v, m, virtual_stages=v)
                for rank in range(p):
                    theirs = [str(op) for op in ranks_ops(fake, rank) if op is not None]
                    assert [str(a) for a in plan.worker_actions[rank]] == theirs, (p, v, m, rank)
                    compared += 1
    assert compared > 300


def test_interleaved_uses_megatron_placement() -> None:
    plan = build("interleaved-1f1b", 6, 3, virtual_stages=2)
    assert plan.stage_to_worker == (0, 1, 2, 0, 1, 2)
    assert plan.stages_of(1) == (1, 4)
    with pytest.raises(ValueError, match=r"worker 3: plan 'interleaved-1f1b' has workers 0..2"):
        plan.stages_of(3)  # gave () before: a worker of no stages
    # The dependency rules would name actions of a larger plan (6F0 for 7F0): refused.
    with pytest.raises(ValueError, match=r"7F0 is not an action of plan 'interleaved-1f1b' \(6 stages, 3 "):
        plan.dependencies(Action(7, "F", 0))


def test_zb_h1_bubble_closed_form_and_third_of_1f1b() -> None:
    # Qi et al. 2023: ZB-H1 bubble is (p-1)(F+I-W) against (p-1)(F+I+W) for 1F1B.
    for p in PS:
        for m in range(p, 13):
            got = _bubble("zb-h1", p, m)
            assert isclose(got, (p - 1) / (3 * m + p - 1), abs_tol=1e-12), (p, m, got)
    for m in (12, 16, 24, 32):
        zb, ref = _bubble("zb-h1", 4, m), _bubble("1f1b", 4, m)
        assert 0.0 < zb <= 0.4 * ref + 1e-9, (m, zb, ref)


def test_zb_h1_never_worse_than_1f1b() -> None:
    for p in range(2, 7):
        for m in MS:
            assert _bubble("zb-h1", p, m) < _bubble("1f1b", p, m)


def test_zb_h1_peak_memory_equals_1f1b() -> None:
    # Same peak as 1F1B (p micro-batches, on the first worker); later workers defer W
    # up to that same budget, which is what buys the smaller bubble.
    for p in PS:
        for m in MS:
            zb = build("zb-h1", p, m).simulate().peak_activations
            ref = build("1f1b", p, m).simulate().peak_activations
            assert max(zb) == max(ref) == min(p, m), (p, m, zb, ref)
            assert zb[0] == ref[0]


def test_zb_v_small_bubble_bounded_memory() -> None:
    for p in range(2, 7):
        for m in (2 * p, 12):
            sim = build("zb-v", 2 * p, m).simulate()
            assert sim.bubble_ratio < _bubble("zb-h1", p, m)
            assert max(sim.peak_activations) <= 2 * p
    plan = build("zb-v", 6, 3)
    assert plan.stage_to_worker == (0, 1, 2, 2, 1, 0)
    with pytest.raises(ValueError, match="even"):
        build("zb-v", 5, 4)


def test_peak_activations_1f1b_and_gpipe() -> None:
    for p in PS:
        for m in MS:
            ofob = build("1f1b", p, m).simulate().peak_activations
            assert ofob == tuple(min(p - s, m) for s in range(p)), (p, m, ofob)
            assert build("gpipe", p, m).simulate().peak_activations == (m,) * p


def test_1f1b_warmup_order() -> None:
    plan = build("1f1b", 3, 4)
    assert [str(a) for a in plan.worker_actions[0]] == "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3".split()
    assert [str(a) for a in plan.worker_actions[2]] == "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3".split()
    # m < p: warm-up is capped by m.
    assert [str(a) for a in build("1f1b", 4, 2).worker_actions[0]] == "0F0 0F1 0B0 0B1".split()


def test_gpipe_order_and_forward_only() -> None:
    plan = build("gpipe", 2, 3)
    assert [str(a) for a in plan.worker_actions[1]] == "1F0 1F1 1F2 1B2 1B1 1B0".split()
    fwd = build("gpipe", 2, 3, backward=False)
    assert fwd == plan.forward_only()
    assert [str(a) for a in fwd.worker_actions[1]] == "1F0 1F1 1F2".split()
    fwd.validate()


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v"])
def test_forward_only_keeps_order(name: str) -> None:
    plan = build(name, 6, 6, **({"virtual_stages": 2} if name == "interleaved-1f1b" else {}))
    fwd = plan.forward_only()
    fwd.validate()
    for full, only in zip(plan.worker_actions, fwd.worker_actions):
        assert only == tuple(a for a in full if a.kind == "F")
    assert not fwd.has_backward and plan.has_backward


def test_build_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*gpipe.*1f1b"):
        build("pipedream", 2, 2)
    with pytest.raises(TypeError, match=r"schedule is named by a str.*got \['gpipe'\]"):
        build(["gpipe"], 2, 2)  # type: ignore[arg-type]
    for flag in (None, "no", 0):
        with pytest.raises(TypeError, match=f"backward must be a bool, got {flag!r}"):
            build("gpipe", 2, 2, backward=flag)
    with pytest.raises(ValueError, match="num_stages.*0"):
        build("gpipe", 0, 2)
    with pytest.raises(ValueError, match="num_microbatches.*-1"):
        build("1f1b", 2, -1)
    with pytest.raises(TypeError, match="num_stages.*2.0"):
        build("gpipe", 2.0, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_microbatches.*True"):
        build("gpipe", 2, True)
    with pytest.raises(TypeError, match="virtual_stages.*1.5"):
        build("interleaved-1f1b", 4, 2, virtual_stages=1.5)
    with pytest.raises(TypeError, match="chunks"):
        build("1f1b", 2, 2, chunks=3)


def test_plans_are_hashable_values() -> None:
    assert build("1f1b", 3, 4) == build("1f1b", 3, 4)
    assert hash(build("1f1b", 3, 4)) == hash(build("1f1b", 3, 4))
    assert isinstance(build("1f1b", 3, 4), Plan)
    assert Action(0, "F", 0) in build("1f1b", 3, 4)


def test_a_worker_the_plan_gives_nothing_is_not_counted_as_idle():
    """Review: simulate() counted an empty worker as idle for the whole step, while the
    runtime's measured bubble counts the workers that ran jobs: 0.5 planned beside 0.0 measured."""
    plan = Plan.from_lists("one-worker", [["0F0", "1F0", "1B0", "0B0", "0F1", "1F1", "1B1", "0B1"], []],
                           stage_to_worker=[0, 0])
    assert plan.simulate().bubble_ratio == 0.0
    assert build("1f1b", 2, 2).simulate().bubble_ratio == pytest.approx(1 / 3)  # every worker used: unchanged


def test_build_takes_numpy_sizes_as_pipe_takes_a_numpy_chunks() -> None:
    """Review (s28): build() refused a NumPy integer that Pipe(chunks=...) takes."""
    np = pytest.importorskip("numpy")
    plan = build("interleaved-1f1b", np.int64(4), np.int32(4), virtual_stages=np.int64(2))
    assert plan == build("interleaved-1f1b", 4, 4, virtual_stages=2)
    assert type(plan.num_stages) is int and type(plan.num_microbatches) is int
    with pytest.raises(TypeError, match=r"num_stages must be an int, got np.float64\(4.0\)"):
        build("1f1b", np.float64(4.0), 4)
    with pytest.raises(TypeError, match="num_microbatches must be an int, got True"):
        build("1f1b", 4, True)
