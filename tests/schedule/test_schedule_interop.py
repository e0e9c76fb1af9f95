"""Plans written elsewhere: idle slots, inferred placement, CSV files, torch's schedules."""
from __future__ import annotations

import pickle
import re
import subprocess
import sys

import pytest
from torch_schedules import CLASSES, torch_order, torch_schedule

from torchpipe.schedule import SCHEDULES, Action, InvalidPlanError, Plan, build

NAMED = [(name, {"virtual_stages": 2} if name == "interleaved-1f1b" else {}) for name in SCHEDULES]


def _stages_for(name: str, workers: int) -> int:
    return 2 * workers if name in ("interleaved-1f1b", "zb-v") else workers


def test_idle_slots_are_dropped() -> None:
    plan = Plan.from_lists("idle", [["0F0", None, "0F1", "", "0B1", " ", "0B0"], [None, "1F0", "1F1", "1B1", "1B0"]])
    assert plan.worker_actions == build("gpipe", 2, 2).worker_actions


def test_a_stage_on_one_workers_list_belongs_to_that_worker() -> None:
    # zb-v's V: worker 0 holds stages 0 and 3. Megatron placement would put stage 3 on worker 1.
    plan = build("zb-v", 4, 3)
    again = Plan.from_lists("v", [[str(a) for a in acts] for acts in plan.worker_actions])
    assert again.stage_to_worker == plan.stage_to_worker == (0, 1, 1, 0)
    assert again.worker_actions == plan.worker_actions


@pytest.mark.parametrize("name,options", NAMED)
@pytest.mark.parametrize("workers,microbatches", [(1, 1), (2, 3), (4, 8), (3, 7)])
def test_csv_round_trip(tmp_path, name, options, workers, microbatches) -> None:
    plan = build(name, _stages_for(name, workers), microbatches, **options)
    path = tmp_path / f"{name}.csv"
    plan.save_csv(path)
    again = Plan.load_csv(path)
    assert again.name == name
    assert again.worker_actions == plan.worker_actions
    assert again.stage_to_worker == plan.stage_to_worker
    assert (again.num_stages, again.num_microbatches) == (plan.num_stages, plan.num_microbatches)
    assert Plan.load_csv(str(path), name="mine").name == "mine"


def test_csv_in_torchs_format_with_idle_cells_sends_and_overlapped_pairs(tmp_path) -> None:
    # A V of 4 stages on 2 workers, as torch writes it with communication (compute_comms).
    path = tmp_path / "v.csv"
    path.write_text("0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,,3RECV_F0,3F0,3RECV_F1,(3F1;3B0)OVERLAP_F_B,3B1,"
                    "1RECV_B0,0B0,0B1,0REDUCE_GRAD,0RESHARD\n"
                    ",1RECV_F0,1F0,1F1,2F0,2SEND_F0,2F1,2RECV_B0,2B0,2B1,1B0,1SEND_B0,1B1\n")
    plan = Plan.load_csv(path)
    assert plan.name == "v"
    assert [[str(a) for a in acts] for acts in plan.worker_actions] == [
        ["0F0", "0F1", "3F0", "3F1", "3B0", "3B1", "0B0", "0B1"],
        ["1F0", "1F1", "2F0", "2F1", "2B0", "2B1", "1B0", "1B1"]]
    assert plan.stage_to_worker == (0, 1, 1, 0)


def test_a_misplaced_action_in_a_csv_is_named(tmp_path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0F1,0B1,0B0,1F0\n1F1,1B1,1B0\n")
    with pytest.raises(InvalidPlanError, match="action 1F0 is on worker 0, but stage 1 belongs to worker 1"):
        Plan.load_csv(path)


@pytest.mark.parametrize("cell", ["0X1", "F0", "01F0", "(0F0;1Q0)OVERLAP_F_B"])
def test_an_unreadable_cell_is_named_with_its_row_and_entry(tmp_path, cell) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(f"0F0,{cell},0B0\n")
    with pytest.raises(ValueError, match=r"bad\.csv: row 0, entry 1: cannot read '.*' as a pipeline action"):
        Plan.load_csv(path)


def test_from_torch_takes_an_order_as_a_dict_or_a_list() -> None:
    order = {1: [None, "1F0", "1B0"], 0: ["0F0", None, None, "0B0"]}
    plan = Plan.from_torch(order)
    assert plan.name == "torch"
    assert plan.worker_actions == build("gpipe", 2, 1).worker_actions
    assert Plan.from_torch([order[0], order[1]], name="mine").worker_actions == plan.worker_actions
    assert Plan.from_torch([[Action(0, "F", 0), Action(0, "B", 0)]]).num_stages == 1


@pytest.mark.parametrize("order,error,message", [
    (42, TypeError, "from_torch takes a torch.distributed.pipelining schedule .* got int"),
    ("0F0,0B0", TypeError, "got str"),
    ({0: ["0F0"], 2: ["2F0"]}, ValueError, re.escape("ranks must be 0..1, got [0, 2]")),
    ({0: "0F0 0B0"}, TypeError, "rank 0's actions must be a list, got str"),
    ({0: ["0F0", "0B0"], "r1": []}, TypeError, re.escape("ranks must be ints 0..1, got the key 'r1' (str)")),
    ({0: ["0F0", "0B0"], True: []}, TypeError, re.escape("got the key True (bool)")),
    ({0: ["0F0", "0Z0"]}, ValueError, "rank 0, entry 1: cannot read '0Z0'"),
])
def test_from_torch_names_what_it_cannot_read(order, error, message) -> None:
    with pytest.raises(error, match=message):
        Plan.from_torch(order)


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (3, 6), (4, 8)])
def test_torchs_schedules_become_plans_in_the_same_order(name, ranks, microbatches) -> None:
    schedule = torch_schedule(name, ranks, microbatches)
    plan = Plan.from_torch(schedule)
    assert plan.name == name
    assert (plan.num_stages, plan.num_microbatches, plan.num_workers) == (2 * ranks, microbatches, ranks)
    for rank, entries in torch_order(schedule).items():
        expected = []
        for entry in entries:
            if entry is None:
                continue
            pair = re.fullmatch(r"\((.*)\)OVERLAP_F_B", entry)
            expected += pair.group(1).split(";") if pair else [entry]
        assert [str(a) for a in plan.worker_actions[rank]] == expected, rank
        assert set(plan.stages_of(rank)) == {int(re.match(r"\d+", e).group()) for e in expected}


def test_torch_reads_the_csv_we_write(tmp_path) -> None:
    plan = build("zb-v", 6, 6)
    path = tmp_path / "zbv.csv"
    plan.save_csv(path)
    schedule = torch_schedule("ScheduleZBVZeroBubble", 3, 6)
    loader = getattr(schedule, "_load_csv", None)
    if loader is None:
        pytest.skip("this torch has no _load_csv")
    loader(str(path), format="compute_only")
    assert {rank: [str(a) for a in actions] for rank, actions in schedule.pipeline_order.items()} == {
        w: [str(a) for a in acts] for w, acts in enumerate(plan.worker_actions)}


def test_a_plan_from_another_process_hashes_like_its_equals_here() -> None:
    # A plan caches its hash; str hashes differ between processes, so the cache must not
    # travel with the pickle (a dict lookup, Pipe's program cache among them, would miss).
    script = ("import pickle, sys; from torchpipe.schedule import build; p = build('zb-v', 4, 3); hash(p); "
              "sys.stdout.buffer.write(pickle.dumps(p))")
    sent = subprocess.run([sys.executable, "-c", script], capture_output=True, check=True,
                          env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout
    received, local = pickle.loads(sent), build("zb-v", 4, 3)
    assert received == local and hash(received) == hash(local)
    assert {local: "program"}[received] == "program"


def test_empty_lines_at_the_end_of_a_csv_are_not_workers(tmp_path) -> None:
    plan = build("1f1b", 2, 3)
    path = tmp_path / "trailing.csv"
    plan.save_csv(path)
    path.write_text(path.read_text() + "\n\n")
    again = Plan.load_csv(path)
    assert again.worker_actions == plan.worker_actions
    assert again.stage_to_worker == plan.stage_to_worker


@pytest.mark.parametrize("idle", [0, 1])
def test_a_worker_with_nothing_to_do_survives_a_csv_round_trip(tmp_path, idle) -> None:
    busy = ["0F0", "1F0", "1B0", "0B0"]
    plan = Plan.from_lists("idle", [busy, []] if idle == 1 else [[], busy])
    path = tmp_path / "idle.csv"
    plan.save_csv(path)
    again = Plan.load_csv(path, name="idle")
    assert again == plan
    assert len(again.worker_actions) == 2


@pytest.mark.parametrize("path", [1, True, 3.0, None])
def test_a_csv_path_must_be_a_path_not_a_file_descriptor(tmp_path, path) -> None:
    """open() would take an int or a bool as a file descriptor: write into (and close) the
    caller's file or stdout. Refused before anything is opened."""
    plan = build("1f1b", 2, 2)
    with pytest.raises(TypeError, match=rf"save_csv takes a file path \(str or os.PathLike\), got {type(path).__name__}: "
                                        rf"{re.escape(repr(path))}"):
        plan.save_csv(path)
    with pytest.raises(TypeError, match=rf"load_csv takes a file path .*got {type(path).__name__}"):
        Plan.load_csv(path)
    with open(tmp_path / "mine.txt", "w") as mine:  # a real descriptor of the caller's stays open
        with pytest.raises(TypeError):
            plan.save_csv(mine.fileno())
        mine.write("still open\n")
    assert (tmp_path / "mine.txt").read_text() == "still open\n"


# Review (s28): torch 2.13's Schedule1F1B keeps a pipeline_order that shifts rank 1's micro-batch
# indices by one (1F1..1F4 for 4 micro-batches). The refusal said to pass num_microbatches=,
# which from_torch does not take, and did not say whose order was wrong.
def test_a_schedule_whose_own_order_does_not_hold_is_refused_naming_torchs_order_and_the_way_out() -> None:
    from torch_schedules import torch_single_schedule

    schedule = torch_single_schedule("Schedule1F1B", 2, 4)
    numbered = [int(re.search(r"\d+$", str(a)).group()) for a in schedule.pipeline_order[1]
                if a is not None and re.fullmatch(r"\d+[FB]\d+", str(a))]
    if max(numbered) < 4:  # a torch whose order holds together: it is taken as it is
        assert Plan.from_torch(schedule).num_microbatches == 4
        return
    with pytest.raises(InvalidPlanError, match=r"Schedule1F1B\.pipeline_order cannot run as written: action 1F4 "
                                               r"on worker 1: micro-batch 4 is out of range \(plan has 4 micro-"
                                               r"batches\)\. .*schedule=Schedule1F1B") as caught:
        Plan.from_torch(schedule)
    assert "num_microbatches=" not in str(caught.value)
    gpipe = Plan.from_torch(torch_single_schedule("ScheduleGPipe", 2, 4))  # an order that holds: as before
    assert gpipe.num_microbatches == 4


def test_a_csv_with_a_byte_order_mark_or_a_bytes_path_loads(tmp_path) -> None:
    # Review (s30): a spreadsheet's "CSV UTF-8" export (BOM first) was refused as '\ufeff0F0', and
    # a bytes path failed on the plan's name taken from it.
    path = tmp_path / "excel.csv"
    path.write_bytes("\ufeff0F0,0F1,0B1,0B0\n1F0,1F1,1B1,1B0\n".encode("utf-8"))
    plan = Plan.load_csv(path)
    assert plan.name == "excel" and str(plan.worker_actions[0][0]) == "0F0"
    again = Plan.load_csv(bytes(path))
    assert again.name == "excel" and again.worker_actions == plan.worker_actions


def test_a_csv_that_is_not_utf8_is_named(tmp_path) -> None:
    path = tmp_path / "latin.csv"
    path.write_bytes("0F0,0F1\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a UTF-8 text file")):
        Plan.load_csv(path)
