"""Pipe.step with a plan of one's own: hand-written, from CSV, or from torch's schedules."""
import copy

import pytest
import torch
from torch import nn
from torch_schedules import CLASSES, torch_schedule

from torchpipe import Pipe
from torchpipe.schedule import Action, InvalidPlanError, Plan, ScheduleDeadlockError, build


def make_model(stages):
    return nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(stages)])


def _executed_order(pipe):
    """Each worker's jobs of the last step, as actions, in the order they started."""
    record = pipe.last_step
    per_worker = {}
    for label, worker, start in sorted(zip(record.labels, record.workers, record.starts), key=lambda item: item[2]):
        _, stage, kind, _, microbatch = label.split()
        per_worker.setdefault(worker, []).append(Action(int(stage), kind, int(microbatch)))
    return [per_worker.get(w, []) for w in range(len(per_worker))]


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_torchs_multi_rank_schedules_run_in_one_process_and_match_the_plain_model(name, checkpoint):
    ranks, m = 3, 6
    plan = Plan.from_torch(torch_schedule(name, ranks, m))
    model = make_model(2 * ranks)
    reference = copy.deepcopy(model)
    x, y = torch.randn(11, 6), torch.randn(11, 6)  # 11 samples in 6 micro-batches: 2, 2, 2, 2, 2, 1
    expected = nn.MSELoss()(reference(x), y)
    expected.backward()
    with Pipe(model, [1] * (2 * ranks), chunks=m, checkpoint=checkpoint) as pipe:
        loss = pipe.step(x, y, nn.MSELoss(), schedule=plan)
        executed = _executed_order(pipe)
        report = pipe.last_report()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for (param_name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=param_name)
    assert executed == [list(acts) for acts in plan.worker_actions]  # the plan runs as written
    assert report.schedule == name


def test_a_hand_written_plan_equal_to_a_named_one_gives_the_same_bits(tmp_path):
    named = build("1f1b", 4, 4)
    path = tmp_path / "mine.csv"
    named.save_csv(path)
    plan = Plan.load_csv(path)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    grads = []
    for schedule in ("1f1b", plan):
        model = make_model(4)
        torch.manual_seed(1)
        for param in model.parameters():
            nn.init.normal_(param)
        with Pipe(model, [1, 1, 1, 1], chunks=4, checkpoint="never") as pipe:
            loss = pipe.step(x, y, nn.MSELoss(), schedule=schedule)
        grads.append([loss] + [p.grad for p in model.parameters()])
    for mine, theirs in zip(*grads):
        assert torch.equal(mine, theirs)


def test_a_plan_of_a_new_order_runs_in_that_order():
    # Backward in forward order on every stage (not the reverse GPipe uses): still a valid
    # plan, and the runtime must run it as written, not fall back to a named schedule's order.
    lists = [[f"{s}F{m}" for m in range(3)] + [f"{s}B{m}" for m in range(3)] for s in range(3)]
    plan = Plan.from_lists("forward-order backward", lists)
    model = make_model(3)
    reference = copy.deepcopy(model)
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    nn.MSELoss(reduction="sum")(reference(x), y).backward()
    with Pipe(model, [1, 1, 1], chunks=3, checkpoint="except_last") as pipe:
        pipe.step(x, y, nn.MSELoss(reduction="sum"), schedule=plan)
        assert _executed_order(pipe) == [list(acts) for acts in plan.worker_actions]
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6)


def _unchecked(name, lists, stages, microbatches):
    """A Plan built directly, as a caller may: nothing has validated it."""
    actions = tuple(tuple(Action.parse(a) for a in acts) for acts in lists)
    return Plan(name, stages, microbatches, tuple(range(stages)), actions)


@pytest.mark.parametrize("plan,options,batch,chunks,error,message", [
    # A plan that does not fit this Pipe is an InvalidPlanError (a ValueError), as the guide says.
    (build("1f1b", 3, 4), {}, 8, 4, InvalidPlanError, "plan '1f1b' has 3 stages, but this Pipe has 2 partitions"),
    (build("1f1b", 2, 4), {}, 3, 4, InvalidPlanError,
     r"plan '1f1b' is for 4 micro-batches, but this batch splits into 3 \(chunks=4.*pass a batch that gives 4"),
    # Review (s30): the advice was a batch that gives 3, which chunks=2 never splits into.
    (build("1f1b", 2, 3), {}, 300, 2, InvalidPlanError,
     r"is for 3 micro-batches, but this batch splits into 2 \(chunks=2, Tensor.chunk rules\); set pipe.chunks = 3"),
    (build("gpipe", 2, 4, backward=False), {}, 8, 4, InvalidPlanError, "plan 'gpipe' has no backward actions"),
    (build("1f1b", 2, 4), {"virtual_stages": 2}, 8, 4, TypeError, r"options \['virtual_stages'\] configure a named"),
    (_unchecked("holes", [["0F0", "0B0"], ["1F0"]], 2, 1), {}, 2, 1, InvalidPlanError, "missing action 1B0"),
    (_unchecked("early", [["0F0", "0B0"], ["1B0", "1F0"]], 2, 1), {}, 2, 1, InvalidPlanError,
     "action 1B0 on worker 1 runs before its dependency 1F0"),
    (_unchecked("stuck", [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]], 2, 2), {}, 4, 2,
     ScheduleDeadlockError, "deadlock"),
])
def test_a_plan_that_cannot_run_here_is_refused_before_anything_runs(plan, options, batch, chunks, error, message):
    model = make_model(2)
    x, y = torch.randn(batch, 6), torch.randn(batch, 6)
    with Pipe(model, [1, 1], chunks=chunks, checkpoint="never") as pipe:
        with pytest.raises(error, match=message):
            pipe.step(x, y, nn.MSELoss(), schedule=plan, **options)
        assert pipe.last_step is None  # nothing ran
        assert all(p.grad is None for p in model.parameters())
        pipe.step(x, y, nn.MSELoss())  # and the Pipe still works
    assert all(p.grad is not None for p in model.parameters())


def test_a_schedule_that_is_neither_a_name_nor_a_plan_is_refused():
    with Pipe(make_model(2), [1, 1], chunks=2) as pipe:
        with pytest.raises(TypeError, match=r"schedule is named by a str \(one of .*\) or by a torch.distributed.pipelining schedule class, or a torchpipe.schedule.Plan; got 3"):
            pipe.step(torch.randn(4, 6), torch.randn(4, 6), nn.MSELoss(), schedule=3)


@pytest.mark.parametrize("first_batch,second_batch", [(2, 8), (8, 6)])
def test_a_plan_reused_on_a_batch_of_another_micro_batch_count_is_refused_every_time(first_batch, second_batch):
    # chunks=4: 2 samples give 2 micro-batches, 8 give 4, 6 give 3. The first call caches the
    # plan's program; the second must still compare the plan with its own batch.
    plan = build("1f1b", 2, 2 if first_batch == 2 else 4)
    model = make_model(2)
    with Pipe(model, [1, 1], chunks=4, checkpoint="never") as pipe:
        pipe.step(torch.randn(first_batch, 6), torch.randn(first_batch, 6), nn.MSELoss(), schedule=plan)
        model.zero_grad(set_to_none=True)
        with pytest.raises(ValueError, match=f"plan '1f1b' is for {plan.num_microbatches} micro-batches, but this "
                                             "batch splits into"):
            pipe.step(torch.randn(second_batch, 6), torch.randn(second_batch, 6), nn.MSELoss(), schedule=plan)
        assert all(p.grad is None for p in model.parameters())


def _random_plan(rng, workers, microbatches, v_shape):
    """A random valid plan: a random order of every action that respects the dependencies,
    each stage's backward a ``B`` or an ``I`` + ``W``, split per worker in that order."""
    stages = 2 * workers if v_shape else workers
    placement = [s if s < workers else 2 * workers - 1 - s for s in range(stages)] if v_shape else list(range(stages))
    split = {(s, mb): rng.random() < 0.5 for s in range(stages) for mb in range(microbatches)}
    done = set()

    def ready(action):
        s, kind, mb = action.stage, action.kind, action.microbatch
        needs = {"F": [(s - 1, "F")] if s else [],
                 "B": [(s, "F")] + ([(s + 1, "B" if not split[s + 1, mb] else "I")] if s + 1 < stages else []),
                 "W": [(s, "I")]}
        needs["I"] = needs["B"]
        return all(Action(t, k, mb) in done for t, k in needs[kind])

    todo = [Action(s, k, mb) for s in range(stages) for mb in range(microbatches)
            for k in (("F", "I", "W") if split[s, mb] else ("F", "B"))]
    lists = [[] for _ in range(workers)]
    while todo:
        action = rng.choice([a for a in todo if ready(a)])
        todo.remove(action)
        done.add(action)
        lists[placement[action.stage]].append(action)
    return Plan.from_lists("random", lists, stage_to_worker=placement)


# The core of a differential fuzzer that ran about 5,000 cases with no defect, kept small:
# any order the dependencies allow, with B and I + W mixed, must give the plain model's loss
# and gradients and run exactly as written.
@pytest.mark.parametrize("seed", range(12))
def test_random_valid_plans_run_as_written_and_match_the_plain_model(seed):
    import random

    rng = random.Random(seed)
    workers, microbatches, v_shape = rng.choice([2, 3]), rng.choice([1, 2, 3, 4]), rng.random() < 0.3
    plan = _random_plan(rng, workers, microbatches, v_shape)
    checkpoint = rng.choice(["never", "except_last", "always"])
    torch.manual_seed(seed)
    model = make_model(plan.num_stages)
    reference = copy.deepcopy(model)
    batch = rng.randint(microbatches, 3 * microbatches) if microbatches > 1 else rng.randint(1, 4)
    while len(torch.empty(batch).chunk(microbatches)) != microbatches:
        batch += 1
    x, y = torch.randn(batch, 6, requires_grad=True), torch.randn(batch, 6)
    x_ref = x.detach().clone().requires_grad_()
    expected = nn.MSELoss()(reference(x_ref), y)
    expected.backward()
    with Pipe(model, [1] * plan.num_stages, chunks=microbatches, checkpoint=checkpoint) as pipe:
        loss = pipe.step(x, y, nn.MSELoss(), schedule=plan)
        assert _executed_order(pipe) == [list(acts) for acts in plan.worker_actions], plan.table()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)
