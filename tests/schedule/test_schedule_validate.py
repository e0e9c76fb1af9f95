"""Plan.validate / Plan.from_lists: every broken rule is rejected, naming the action."""
from __future__ import annotations

import pytest

from torchpipe.schedule import Action, InvalidPlanError, Plan, ScheduleDeadlockError, build

GPIPE_2x2 = [["0F0", "0F1", "0B1", "0B0"], ["1F0", "1F1", "1B1", "1B0"]]


def _with(lists: list[list[str]], worker: int, new: list[str]) -> list[list[str]]:
    out = [list(acts) for acts in lists]
    out[worker] = new
    return out


def test_from_lists_accepts_text_and_actions() -> None:
    plan = Plan.from_lists("hand", [["0F0", Action(0, "F", 1), "0B1", "0B0"], GPIPE_2x2[1]])
    assert plan.worker_actions == build("gpipe", 2, 2).worker_actions
    assert (plan.num_stages, plan.num_microbatches, plan.stage_to_worker) == (2, 2, (0, 1))


def test_from_lists_default_placement_is_megatron() -> None:
    plan = build("interleaved-1f1b", 4, 2, virtual_stages=2)
    again = Plan.from_lists("again", [[str(a) for a in acts] for acts in plan.worker_actions])
    assert again.stage_to_worker == (0, 1, 0, 1)
    assert again.worker_actions == plan.worker_actions


def test_duplicate_action() -> None:
    with pytest.raises(InvalidPlanError, match="duplicate action 0F1"):
        Plan.from_lists("dup", _with(GPIPE_2x2, 0, ["0F0", "0F1", "0F1", "0B1", "0B0"]))


def test_missing_forward() -> None:
    with pytest.raises(InvalidPlanError, match="missing action 1F1"):
        Plan.from_lists("miss", _with(GPIPE_2x2, 1, ["1F0", "1B1", "1B0"]), num_microbatches=2)


def test_missing_backward() -> None:
    with pytest.raises(InvalidPlanError, match="missing action 1B0"):
        Plan.from_lists("miss", _with(GPIPE_2x2, 1, ["1F0", "1F1", "1B1"]))


def test_missing_weight_grad_and_w_without_i() -> None:
    split = [["0F0", "0I0", "0W0"], ["1F0", "1I0", "1W0"]]
    Plan.from_lists("ok", split)
    with pytest.raises(InvalidPlanError, match="missing action 1W0"):
        Plan.from_lists("no-w", _with(split, 1, ["1F0", "1I0"]))
    with pytest.raises(InvalidPlanError, match="1W0.*W without I"):
        Plan.from_lists("no-i", _with(split, 1, ["1F0", "1B0", "1W0"]))
    with pytest.raises(InvalidPlanError, match="0I0.*0B0"):
        Plan.from_lists("both", _with(split, 0, ["0F0", "0I0", "0W0", "0B0"]))


def test_out_of_range() -> None:
    with pytest.raises(InvalidPlanError, match="action 2F0 on worker 1: stage 2 is out of range"):
        Plan.from_lists("range", _with(GPIPE_2x2, 1, ["1F0", "1F1", "1B1", "1B0", "2F0"]), num_stages=2)
    with pytest.raises(InvalidPlanError, match="action 1F5 on worker 1: micro-batch 5 is out of range"):
        Plan.from_lists("range", _with(GPIPE_2x2, 1, ["1F0", "1F1", "1F5", "1B1", "1B0"]), num_microbatches=2)


def test_wrong_worker() -> None:
    lists = [["0F0", "0F1", "0B1", "0B0", "1F0"], ["1F1", "1B1", "1B0"]]
    with pytest.raises(InvalidPlanError, match="action 1F0 is on worker 0, but stage 1 belongs to worker 1"):
        Plan.from_lists("wrong", lists)


def test_backward_before_forward_on_same_worker() -> None:
    lists = _with(GPIPE_2x2, 1, ["1F0", "1B1", "1F1", "1B0"])
    with pytest.raises(InvalidPlanError, match="action 1B1 on worker 1 runs before its dependency 1F1"):
        Plan.from_lists("order", lists)


def test_weight_grad_before_input_grad_on_same_worker() -> None:
    with pytest.raises(InvalidPlanError, match="action 0W0 on worker 0 runs before its dependency 0I0"):
        Plan.from_lists("order", [["0F0", "0W0", "0I0"], ["1F0", "1I0", "1W0"]])


def test_cross_worker_deadlock() -> None:
    # w0 waits at 0B0 for 1B0; w1 waits at 1F1 for 0F1, which w0 runs after 0B0.
    lists = [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]
    with pytest.raises(ScheduleDeadlockError) as info:
        Plan.from_lists("cycle", lists)
    msg = str(info.value)
    assert "worker 0 is stuck at 0B0 waiting for 1B0" in msg
    assert "worker 1 is stuck at 1F1 waiting for 0F1" in msg
    assert isinstance(info.value, InvalidPlanError) and isinstance(info.value, ValueError)


def test_deadlock_also_raised_by_simulate() -> None:
    plan = Plan("cycle", 2, 2, (0, 1), tuple(tuple(map(Action.parse, acts)) for acts in
                                             [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]))
    with pytest.raises(ScheduleDeadlockError, match="0B0"):
        plan.simulate()


def test_mixed_forward_only_and_backward_rejected() -> None:
    # Backward for stage 1 only: stage 0 then misses its backward.
    with pytest.raises(InvalidPlanError, match="missing action 0B0"):
        Plan.from_lists("half", [["0F0"], ["1F0", "1B0"]])


def test_from_lists_names_a_size_of_the_wrong_type() -> None:
    with pytest.raises(TypeError, match="num_stages must be an int, got 1.0"):
        Plan.from_lists("x", [["0F0", "0B0"]], num_stages=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_microbatches must be an int, got '1'"):
        Plan.from_lists("x", [["0F0", "0B0"]], num_microbatches="1")  # type: ignore[arg-type]


def test_bad_stage_to_worker() -> None:
    with pytest.raises(InvalidPlanError, match="stage_to_worker has 1 entries for 2 stages"):
        Plan.from_lists("map", GPIPE_2x2, num_stages=2, stage_to_worker=[0])
    with pytest.raises(InvalidPlanError, match="stage 1 is mapped to worker 5"):
        Plan.from_lists("map", GPIPE_2x2, stage_to_worker=[0, 5])
    with pytest.raises(InvalidPlanError, match="stage 0 is mapped to False of type bool"):
        Plan.from_lists("map", GPIPE_2x2, stage_to_worker=[False, True])
    np = pytest.importorskip("numpy")
    # In range but not an int: the message names the type, not a range it is inside.
    with pytest.raises(InvalidPlanError, match="stage 0 is mapped to .* of type int64; stage_to_worker must hold Python ints"):
        Plan.from_lists("map", GPIPE_2x2, stage_to_worker=[np.int64(0), 1])


def test_dependencies_rules() -> None:
    plan = build("1f1b", 3, 2)
    assert plan.dependencies(Action(0, "F", 1)) == ()
    assert plan.dependencies(Action(2, "F", 1)) == (Action(1, "F", 1),)
    assert plan.dependencies(Action(2, "B", 1)) == (Action(2, "F", 1),)  # loss is in the last F
    assert plan.dependencies(Action(1, "B", 0)) == (Action(1, "F", 0), Action(2, "B", 0))
    split = build("zb-h1", 3, 2)
    assert split.dependencies(Action(1, "I", 0)) == (Action(1, "F", 0), Action(2, "I", 0))
    assert split.dependencies(Action(1, "W", 0)) == (Action(1, "I", 0),)
    # A full backward after a split stage waits for that stage's I only.
    mixed = Plan.from_lists("mixed", [["0F0", "0B0"], ["1F0", "1I0", "1W0"]])
    assert mixed.dependencies(Action(0, "B", 0)) == (Action(0, "F", 0), Action(1, "I", 0))
    assert mixed.simulate().span(Action(0, "B", 0)) == (3.0, 5.0)


def test_worker_of_and_actions() -> None:
    plan = build("interleaved-1f1b", 6, 4, virtual_stages=3)
    assert [plan.worker_of(Action(s, "F", 0)) for s in range(6)] == [0, 1, 0, 1, 0, 1]
    assert list(plan.actions()) == [a for acts in plan.worker_actions for a in acts]


@pytest.mark.parametrize("make, error, words", [
    (lambda: Plan("x", 1, 1, 5, ()), TypeError, "stage_to_worker must be a sequence, got 5"),
    (lambda: Plan(3, 1, 1, (0,), ((),)), TypeError, "name must be a str, got 3"),
    (lambda: Plan("x", 1, 1, (0,), ("0F0",)), TypeError, "worker_actions must be a sequence of per-worker"),
    (lambda: Plan.from_lists("x", "0F0"), TypeError, "lists must hold one list of actions per worker"),
    (lambda: Plan.from_lists("x", ["0F0", "0B0"]), TypeError, "lists must hold one list of actions per worker"),
    (lambda: build("1f1b", 2, 2).worker_of(Action(5, "F", 0)), ValueError, "5F0 names stage 5.*stages 0..1"),
])
def test_plan_arguments_of_the_wrong_shape_are_named(make, error, words) -> None:
    """A str passed for a list was read character by character ('cannot parse action 0')."""
    with pytest.raises(error, match=words):
        make()


def test_a_micro_batch_typo_says_where_the_inferred_count_came_from() -> None:
    # 1F2 is a typo for 1F1: it made the plan count 3 micro-batches, and the error named only
    # the missing 0F2, on the other worker.
    with pytest.raises(InvalidPlanError, match=r"missing action 0F2 .*the plan's 3 micro-batches were counted from "
                                               r"the highest index in the lists \(1F2 on worker 1\): pass "
                                               r"num_microbatches="):
        Plan.from_lists("typo", [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F2", "1B1"]])
    with pytest.raises(InvalidPlanError, match=r"missing action 0F2 \(every stage runs F for every micro-batch\)$"):
        Plan.from_lists("typo", [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F2", "1B1"]], num_microbatches=3)


def test_a_stage_typo_says_where_the_inferred_stage_count_came_from() -> None:
    # A stray 2F0 in a plan of two stages was reported as "missing action 2B0" with a hint
    # about the micro-batch count, which had nothing to do with it.
    lists = [["0F0", "0F1", "0B0", "0B1", "2F0"], ["1F0", "1B0", "1F1", "1B1"]]
    with pytest.raises(InvalidPlanError, match=r"missing action 2B0 .*; the plan's 3 stages were counted from the "
                                               r"highest index in the lists \(2F0 on worker 0\): pass num_stages= if "
                                               r"that is not the count you meant$") as caught:
        Plan.from_lists("typo", lists)
    assert caught.value.missing == Action(2, "B", 0)


@pytest.mark.parametrize("lists, hint", [
    ([["0F0", "0F1"], ["1F0", "2F1"]], r"missing action 1F1 .*; the plan's 3 stages were counted from the highest "
                                       r"index in the lists \(2F1 on worker 1\): pass num_stages=[^;]*$"),
    ([["0F0", "0F2"], ["1F0", "1F1"]], r"missing action 0F1 .*; the plan's 3 micro-batches were counted from the "
                                       r"highest index in the lists \(0F2 on worker 0\): pass num_microbatches=[^;]*$"),
], ids=["stage typo", "micro-batch typo"])
def test_a_typo_that_replaces_an_action_gets_the_hint_for_the_count_it_inflated(lists, hint) -> None:
    with pytest.raises(InvalidPlanError, match=hint):
        Plan.from_lists("typo", lists)


def test_no_stage_hint_when_stage_to_worker_gives_the_count() -> None:
    lists = [[str(a) for a in acts] for acts in build("1f1b", 3, 2).worker_actions]
    lists[2] = []
    with pytest.raises(InvalidPlanError, match=r"^missing action 2F0 \(every stage runs F for every micro-batch\)$"):
        Plan.from_lists("x", lists, stage_to_worker=(0, 1, 2))


@pytest.mark.parametrize("bad, error", [("1b1", ValueError), (7, TypeError)])
def test_an_entry_that_is_not_an_action_is_named_by_its_worker_and_position(bad, error) -> None:
    with pytest.raises(error, match=rf"^worker 1, entry 3: .*{bad!r}"):
        Plan.from_lists("mine", [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", bad]])


def _moved(lists, action: str, to: int):
    """``lists`` with ``action`` taken from its worker and appended to worker ``to``'s list."""
    moved = [[a for a in acts if a != action] for acts in lists]
    moved[to].append(action)
    return moved


def test_a_stray_action_of_a_v_shaped_plan_is_the_one_named() -> None:
    # Review (s30): a stage named on two workers fell back to Megatron's s % workers, which in a
    # V shape (stage 3 on worker 0 of 2) blamed a correctly placed action, 3F0.
    lists = [[str(a) for a in acts] for acts in build("zb-v", 4, 3).worker_actions]
    with pytest.raises(InvalidPlanError, match=r"action 3W2 is on worker 1, but stage 3 belongs to worker 0 "
                                               r"\(which holds 8 of its 9 actions\)"):
        Plan.from_lists("stray", _moved(lists, "3W2", 1))


def test_an_action_repeated_on_another_worker_is_called_a_duplicate() -> None:
    lists = [[str(a) for a in acts] for acts in build("zb-v", 4, 3).worker_actions]
    lists[1].append("3F0")
    with pytest.raises(InvalidPlanError, match="duplicate action 3F0: on worker 1 and on worker 0, which owns stage 3"):
        Plan.from_lists("twice", lists)
