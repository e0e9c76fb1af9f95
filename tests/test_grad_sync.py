"""GradientSync: Pipe.step's gradients averaged over processes (gloo, 2 local ranks), equal to
the plain model's gradients averaged over the ranks, for every schedule; each partition's
all-reduce starts while earlier partitions are still in backward; refusals and failures."""

from __future__ import annotations

import copy
import datetime
import gc
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from spawn_helpers import spawn_ranks
from torch import nn

from torchpipe import GradientSync, Pipe
from torchpipe import grad_sync
from torchpipe.grad_sync import RanksOutOfStep

pytestmark = pytest.mark.timeout(120)

WORLD = 2
SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("zb-h1", {}), ("interleaved-1f1b", {"virtual_stages": 2}), ("zb-v", {})]


def make_model(seed: int, norm: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 8), nn.Linear(8, 1)]
    if norm:
        layers.insert(1, nn.BatchNorm1d(8))
    return nn.Sequential(*layers).double()


def plain_copy(pipe: Pipe) -> nn.Sequential:
    return copy.deepcopy(nn.Sequential(*list(pipe)))


def averaged_reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list:
    """The plain model's gradients on this rank's batch, averaged over the ranks (DDP's rule)."""
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= WORLD
    return grads


def same_on_every_rank(tensors: list) -> bool:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    everyone = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def start(rank: int, init_file: str, timeout_s: float = 60) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout_s))


def rank_batch(rank: int, size: int = 12) -> tuple:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(size, 6, generator=gen, dtype=torch.double), torch.randn(size, 1, generator=gen,
                                                                                 dtype=torch.double)


def equality_worker(rank: int, init_file: str) -> None:
    start(rank, init_file)
    try:
        # Each rank starts from its own random parameters: GradientSync takes the first rank's.
        pipe = Pipe(make_model(seed=rank), balance=[2, 2, 1, 1], devices=["cpu"] * 4, chunks=4,
                    checkpoint="except_last")
        GradientSync(pipe)
        assert same_on_every_rank([p.detach() for p in pipe.parameters()])
        plain = plain_copy(pipe)
        x, y = rank_batch(rank, size=15)  # each rank its own batch, 15 samples: 4 + 4 + 4 + 3
        for schedule, options in SCHEDULES:
            for checkpoint in ("never", "except_last", "always"):
                pipe.checkpoint = checkpoint
                pipe.zero_grad(set_to_none=True)
                loss = pipe.step(x, y, nn.MSELoss(), schedule, **options)
                expected = averaged_reference_grads(plain, x, y)
                torch.testing.assert_close(loss, nn.functional.mse_loss(plain(x), y).detach(), rtol=0, atol=1e-14)
                for (name, got), want in zip(pipe.named_parameters(), expected):
                    torch.testing.assert_close(got.grad, want, rtol=0, atol=1e-14,
                                               msg=f"{schedule} {checkpoint} {name}")
                assert same_on_every_rank([p.grad for p in pipe.parameters()]), (schedule, checkpoint)
        # A copy of the Pipe (an EMA model, say) does not synchronise.
        assert copy.deepcopy(pipe)._gradient_sync is None
    finally:
        dist.destroy_process_group()


def test_step_gradients_equal_the_plain_models_averaged_over_ranks(tmp_path) -> None:
    spawn_ranks(equality_worker, str(tmp_path / "init"), nprocs=WORLD)


def accumulation_worker(rank: int, init_file: str) -> None:
    start(rank, init_file)
    ddp = None
    try:
        pipe = Pipe(make_model(seed=0), balance=[3, 3], devices=["cpu"] * 2, chunks=3, checkpoint="never")
        sync = GradientSync(pipe)
        plain = plain_copy(pipe)
        x, y = rank_batch(rank)
        x2, y2 = rank_batch(rank + 10)

        # no_sync: the first step keeps its gradients local; the next one averages the sum.
        with sync.no_sync():
            pipe.step(x, y, nn.MSELoss())
        local = [p.grad.clone() for p in pipe.parameters()]
        plain.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        for got, want in zip(local, plain.parameters()):
            torch.testing.assert_close(got, want.grad, rtol=0, atol=1e-14)
        pipe.step(x2, y2, nn.MSELoss())
        nn.functional.mse_loss(plain(x2), y2).backward()
        for got, want in zip(pipe.parameters(), plain.parameters()):
            summed = want.grad.clone()
            dist.all_reduce(summed)
            torch.testing.assert_close(got.grad, summed / WORLD, rtol=0, atol=1e-14)

        # pipe(x) + backward(): gradients stay local (a warning says so) until all_reduce().
        pipe.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nn.functional.mse_loss(pipe(x), y).backward()
            nn.functional.mse_loss(pipe(x), y).backward()
        assert [str(w.message).count("sync.all_reduce()") for w in caught] == [1], [str(w.message) for w in caught]
        assert caught[0].filename == __file__
        sync.all_reduce()
        expected = averaged_reference_grads(plain, x, y)
        for got, want in zip(pipe.parameters(), expected):
            torch.testing.assert_close(got.grad, 2 * want, rtol=0, atol=1e-14)

        # DDP around the Pipe averages pipe(x) + backward() itself.
        ddp = nn.parallel.DistributedDataParallel(Pipe(make_model(seed=rank), balance=[3, 3],
                                                       devices=["cpu"] * 2, chunks=3))
        reference = plain_copy(ddp.module)  # DDP copied the first rank's parameters
        ddp.module.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        for got, want in zip(ddp.module.parameters(), averaged_reference_grads(reference, x, y)):
            torch.testing.assert_close(got.grad, want, rtol=0, atol=1e-14)
    finally:
        # Free the DDP before the group: freed after it, its Reducer destroys the gloo group with
        # the GIL held, while a gloo thread may need the GIL to free a finished all-reduce, a
        # deadlock in torch itself (this test hung 1 run in 29; docs/probe_ddp_teardown.py).
        del ddp
        gc.collect()
        dist.destroy_process_group()


def test_no_sync_accumulates_locally_and_all_reduce_serves_the_forward_path(tmp_path) -> None:
    spawn_ranks(accumulation_worker, str(tmp_path / "init"), nprocs=WORLD)


def buffers_worker(rank: int, init_file: str) -> None:
    start(rank, init_file)
    try:
        for broadcast in (True, False):
            pipe = Pipe(make_model(seed=0, norm=True), balance=[3, 4], devices=["cpu"] * 2, chunks=2)
            GradientSync(pipe, broadcast_buffers=broadcast)
            norm = pipe[1]
            with torch.no_grad():
                norm.running_mean.fill_(float(rank))  # the ranks' statistics drifted apart
            x, y = rank_batch(0)  # the same batch on every rank
            pipe.step(x, y, nn.MSELoss())
            assert same_on_every_rank([norm.running_mean]) is broadcast, broadcast
            # The forward path too (review, helper-140): all_reduce() takes the first rank's
            # buffers, as DDP's next forward would; they drifted apart before.
            with torch.no_grad():
                norm.running_mean.fill_(float(rank))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "gradients are this rank's own" until all_reduce
                nn.functional.mse_loss(pipe(x), y).backward()
            sync = pipe._gradient_sync
            sync.all_reduce()
            assert same_on_every_rank([norm.running_mean]) is broadcast, broadcast
    finally:
        dist.destroy_process_group()


def test_buffers_come_from_the_first_rank_before_each_step(tmp_path) -> None:
    spawn_ranks(buffers_worker, str(tmp_path / "init"), nprocs=WORLD)


def overlap_worker(rank: int, init_file: str, result_file: str) -> None:
    start(rank, init_file)
    try:
        pipe = Pipe(make_model(seed=0), balance=[2, 2, 1, 1], devices=["cpu"] * 4, chunks=8, checkpoint="never")
        GradientSync(pipe, broadcast_buffers=False)
        launches = []
        all_reduce = dist.all_reduce

        def timed_all_reduce(tensor, *args, **kwargs):
            launches.append((time.perf_counter(), tensor.numel()))
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = timed_all_reduce
        x, y = rank_batch(rank, size=32)
        pipe.step(x, y, nn.MSELoss(), "1f1b")
        record = pipe.last_step
        first_end = max(end for key, end in zip(record.keys, record.ends) if key.stage == 0)
        # Per partition: its gradients and one has-a-gradient flag per parameter; then the status
        # (whether a rank failed, the highest call count and minus the lowest).
        sizes = [sum(p.numel() + 1 for p in partition.parameters()) for partition in pipe.partitions]
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr(([n for _, n in launches], sizes[::-1] + [3], launches[0][0] < first_end)))
    finally:
        dist.destroy_process_group()


def test_the_last_partitions_all_reduce_starts_while_the_first_is_still_in_backward(tmp_path) -> None:
    """One all-reduce per partition, last partition first (then one for the status), the first started before
    partition 0 has finished its backward: the reduction overlaps the pipeline's drain."""
    result_file = str(tmp_path / "result")
    spawn_ranks(overlap_worker, str(tmp_path / "init"), result_file, nprocs=WORLD)
    for rank in range(WORLD):
        sizes, expected_sizes, overlapped = eval(open(f"{result_file}.{rank}").read())
        assert sizes == expected_sizes
        assert overlapped, f"rank {rank}: the first all-reduce started after partition 0's last backward"


def mismatch_worker(rank: int, init_file: str, result_file: str) -> None:
    start(rank, init_file)
    try:
        balance = [3, 3] if rank == 0 else [2, 4]
        pipe = Pipe(make_model(seed=0), balance=balance, devices=["cpu"] * 2)
        before = [p.detach().clone() for p in pipe.parameters()]
        try:
            GradientSync(pipe)
            message = "no error"
        except ValueError as exc:
            message = str(exc)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr((message, unchanged, pipe._gradient_sync is None)))
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_pipes_are_refused_before_anything_changes(tmp_path) -> None:
    result_file = str(tmp_path / "result")
    spawn_ranks(mismatch_worker, str(tmp_path / "init"), result_file, nprocs=WORLD)
    for rank in range(WORLD):
        message, unchanged, detached = eval(open(f"{result_file}.{rank}").read())
        assert "every rank must build the same Pipe" in message, message
        assert "[[((8, 6), 'torch.float64', True), ((8,), 'torch.float64', True), ((8, 8)" in message, message
        assert unchanged and detached


def failing_worker(rank: int, init_file: str, result_file: str) -> None:
    start(rank, init_file, timeout_s=5)
    outcome = "no error"
    try:
        pipe = Pipe(make_model(seed=0), balance=[3, 3], devices=["cpu"] * 2, chunks=2)
        GradientSync(pipe, broadcast_buffers=False)
        x, y = rank_batch(rank)

        def loss_fn(output, target):
            if rank == 1:
                raise ValueError("injected on rank 1")
            return nn.functional.mse_loss(output, target)

        pipe.step(x, y, nn.MSELoss())  # a good step first
        before = [p.grad.clone() for p in pipe.parameters()]
        began = time.monotonic()
        try:
            pipe.step(x, y, loss_fn)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240]}"
        waited = time.monotonic() - began
        grads = [p.grad for p in pipe.parameters()]
        if rank == 0:
            # Nothing was averaged: what the step added is this rank's own gradient.
            plain = plain_copy(pipe)
            plain.zero_grad()
            nn.functional.mse_loss(plain(x), y).backward()
            local = all(torch.allclose(g, b + p.grad, rtol=0, atol=1e-14)
                        for g, b, p in zip(grads, before, plain.parameters()))
        else:  # failed before any backward: unchanged
            local = all(torch.equal(g, b) for g, b in zip(grads, before))
        # helper-121: the ranks stay in step after a peer's failure (the message said to rebuild
        # the process group): the next step averages as usual.
        plain = plain_copy(pipe)
        pipe.zero_grad(set_to_none=True)
        pipe.step(x, y, nn.MSELoss())
        expected = averaged_reference_grads(plain, x, y)
        averaged = all(torch.allclose(p.grad, w, rtol=0, atol=1e-14) for p, w in zip(pipe.parameters(), expected))
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr((outcome, waited, local, averaged)))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_failure_on_one_rank_fails_the_others_at_once(tmp_path) -> None:
    """The failing rank raises its own error; it still issues its collectives, so a rank whose
    step succeeded learns of the failure at once (well inside the group's 5 s timeout) and
    raises too, with its gradients left local, not half averaged."""
    result_file = str(tmp_path / "result")
    spawn_ranks(failing_worker, str(tmp_path / "init"), result_file, nprocs=WORLD)
    failed, failed_wait, failed_local, failed_then_averaged = eval(open(f"{result_file}.1").read())
    other, other_wait, other_local, other_then_averaged = eval(open(f"{result_file}.0").read())
    assert failed == "ValueError: injected on rank 1" and failed_wait < 5 and failed_local
    assert other.startswith("PeerStepFailed: another rank's step failed") and other_wait < 4, (other, other_wait)
    assert "The ranks stay in step: the next step averages as usual" in other, other
    assert other_local
    assert failed_then_averaged and other_then_averaged


def test_refusals_in_one_process(tmp_path) -> None:
    pipe = Pipe(make_model(seed=0), balance=[3, 3], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="synchronises a torchpipe.Pipe, got Sequential"):
        GradientSync(make_model(seed=0))
    with pytest.raises(RuntimeError, match="init_process_group"):
        GradientSync(pipe)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match="broadcast_buffers must be a bool, got 1"):
            GradientSync(pipe, broadcast_buffers=1)
        with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup or None .*got "
                                            "str: 'gloo'"):
            GradientSync(pipe, "gloo")
        sparse = Pipe(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)), balance=[1, 1],
                      devices=["cpu"] * 2)
        with pytest.raises(ValueError, match=r"averages dense gradients; \['0'\] make sparse ones"):
            GradientSync(sparse)
        on_gpu = Pipe(make_model(seed=0), balance=[3, 3], devices=["cpu"] * 2)
        on_gpu._devices = [torch.device("cpu"), torch.device("cuda", 0)]  # as a Pipe on a GPU would say
        with pytest.raises(ValueError, match=r"CPU partitions only \(gloo\), got devices \['cuda:0'\]"):
            GradientSync(on_gpu)
        sync = GradientSync(pipe)
        with pytest.raises(RuntimeError, match="already has a GradientSync"):
            GradientSync(pipe)
        assert pipe._gradient_sync is sync
        # One rank: the average is the gradient itself.
        x, y = rank_batch(0)
        pipe.step(x, y, nn.MSELoss())
        plain = plain_copy(pipe)
        plain.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        for got, want in zip(pipe.parameters(), plain.parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-14)
        # Review (helper-140): over the default group, a rebuilt one kept the old world size as
        # the divisor (2 ranks shrunk to 1 halved every gradient).
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init2'}", rank=0, world_size=1)
        pipe.zero_grad(set_to_none=True)
        for call in (lambda: pipe.step(x, y, nn.MSELoss()), sync.all_reduce):
            with pytest.raises(RuntimeError, match=r"default process group changed since this GradientSync was "
                                                   r"built over it \(then of 1 ranks, now of 1 ranks\): call "
                                                   r"sync.detach\(\)"):
                call()
            assert all(p.grad is None for p in pipe.parameters())
        sync.detach()
        GradientSync(pipe)
        pipe.step(x, y, nn.MSELoss())
        for got, want in zip(pipe.parameters(), plain.parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-14)
    finally:
        dist.destroy_process_group()


def refusing_worker(rank: int, init_file: str, result_file: str) -> None:
    start(rank, init_file, timeout_s=20)
    outcomes = []
    try:
        for case in ("attached", "broadcast_buffers"):
            pipe = Pipe(make_model(seed=0), balance=[3, 3], devices=["cpu"] * 2)
            if case == "attached" and rank == 1:
                pipe._gradient_sync = object()  # as if this rank had attached one already
            broadcast = case != "broadcast_buffers" or rank == 0
            began = time.monotonic()
            try:
                GradientSync(pipe, broadcast_buffers=broadcast)
                outcomes.append((case, "no error"))
            except (RuntimeError, ValueError) as exc:
                outcomes.append((case, f"{type(exc).__name__}: {str(exc)[:110]}", time.monotonic() - began < 10))
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr(outcomes))
    finally:
        dist.destroy_process_group()


def test_a_refusal_on_one_rank_reaches_the_others_instead_of_their_timeout(tmp_path) -> None:
    """Review (helper-140): a rank whose Pipe already had a sync raised before the layout
    exchange, and the others waited in it until the group's timeout; ranks that disagreed on
    broadcast_buffers built their syncs, then the first step waited out the timeout."""
    result_file = str(tmp_path / "result")
    spawn_ranks(refusing_worker, str(tmp_path / "init"), result_file, nprocs=WORLD)
    zero, one = (eval(open(f"{result_file}.{rank}").read()) for rank in range(WORLD))
    assert zero[0][0] == "attached" and zero[0][2], zero
    assert zero[0][1].startswith("RuntimeError: rank 1 of the group refused its GradientSync (this Pipe already has "
                                 "a GradientSync"), zero
    assert one[0][0] == "attached" and one[0][2], one
    assert one[0][1].startswith("RuntimeError: this Pipe already has a GradientSync; build one per Pipe"), one
    for rank, outcome in enumerate((zero[1], one[1])):
        assert outcome[0] == "broadcast_buffers" and outcome[2], outcome
        assert outcome[1].startswith(f"ValueError: rank {1 - rank} of the group has broadcast_buffers="), outcome


class WithSpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(6, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def none_grads_worker(rank: int, init_file: str, result_file: str) -> None:
    start(rank, init_file)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(WithSpare(), nn.Tanh(), nn.Linear(8, 1)).double()
        unused = model[0].spare  # a parameter nothing uses, on every rank
        model[2].bias.requires_grad_(False)
        pipe = Pipe(model, balance=[2, 1], devices=["cpu"] * 2, chunks=2)
        GradientSync(pipe)
        x, y = rank_batch(rank)
        pipe.step(x, y, nn.MSELoss())
        nones = [unused.weight.grad is None, model[2].bias.grad is None]
        # Review: a rank whose losses have no graph (a fully masked batch) raised alone, after
        # its all-reduces had gone out; the other rank went on with half its gradient.
        before = [p.grad.clone() for p in model.parameters() if p.grad is not None]

        def masked_on_rank_1(output, target):
            loss = nn.functional.mse_loss(output, target)
            return torch.zeros((), dtype=loss.dtype) if rank == 1 else loss

        try:
            pipe.step(x, y, masked_on_rank_1)
            outcome = "no error"
        except RuntimeError as exc:
            outcome = f"{type(exc).__name__}: {str(exc)[:60]}"
        after = [p.grad for p in model.parameters() if p.grad is not None]
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr((nones, outcome, all(torch.equal(a, b) for a, b in zip(after, before)))))
    finally:
        dist.destroy_process_group()


def test_unused_and_frozen_parameters_keep_none_and_a_graphless_rank_fails_every_rank(tmp_path) -> None:
    result_file = str(tmp_path / "result")
    spawn_ranks(none_grads_worker, str(tmp_path / "init"), result_file, nprocs=WORLD)
    nones, outcome, unchanged = eval(open(f"{result_file}.1").read())
    assert nones == [True, True]
    assert outcome.startswith("RuntimeError: loss_fn returned no loss with a graph"), outcome
    assert unchanged
    nones, outcome, unchanged = eval(open(f"{result_file}.0").read())
    assert nones == [True, True]
    assert outcome.startswith("PeerStepFailed: another rank's step failed"), outcome
    assert not unchanged  # its own micro-batches' gradients were added (not averaged); see the guide


def layout_worker(rank: int, init_file: str, result_file: str) -> None:
    start(rank, init_file)
    try:
        outcomes = []
        pipe = Pipe(make_model(seed=0).to(torch.float32 if rank else torch.float64), balance=[3, 3],
                    devices=["cpu"] * 2)
        before = [p.detach().clone() for p in pipe.parameters()]
        try:
            GradientSync(pipe)
        except ValueError as exc:
            outcomes.append(str(exc))
        outcomes.append(all(torch.equal(a, b) for a, b in zip(before, pipe.parameters())))
        only_first = dist.new_group([0])  # collective: every rank creates it
        same = Pipe(make_model(seed=0), balance=[3, 3], devices=["cpu"] * 2)
        try:
            GradientSync(same, only_first)
            outcomes.append("accepted")
        except ValueError as exc:
            outcomes.append(str(exc))
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr(outcomes))
    finally:
        dist.destroy_process_group()


def test_ranks_whose_dtypes_differ_and_a_rank_outside_the_group_are_refused(tmp_path) -> None:
    """Review: a float32 rank and a float64 rank were accepted and the broadcast wrote garbage;
    a rank outside process_group was accepted and failed in its first step."""
    result_file = str(tmp_path / "result")
    spawn_ranks(layout_worker, str(tmp_path / "init"), result_file, nprocs=WORLD)
    for rank in range(WORLD):
        dtypes, unchanged, membership = eval(open(f"{result_file}.{rank}").read())
        assert "torch.float32" in dtypes and "torch.float64" in dtypes and "same Pipe" in dtypes, dtypes
        assert unchanged
        assert membership == ("accepted" if rank == 0 else
                              "this rank is not a member of process_group: build the GradientSync on the "
                              "group's ranks only"), membership


def _refused_step(pipe: Pipe, x: torch.Tensor, y: torch.Tensor, refusal: str) -> str:
    """One step refused before it runs: an empty batch, or a caller under FakeTensorMode."""
    if refusal == "empty batch":
        try:
            pipe.step(x[:0], y[:0], nn.MSELoss())
        except ValueError as exc:
            return str(exc)[:30]
    else:
        from torch._subclasses.fake_tensor import FakeTensorMode

        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                pipe.step(x, y, nn.MSELoss())
        except RuntimeError as exc:
            return str(exc)[:30]
    return "not refused"


def out_of_step_worker(rank: int, init_file: str, result_file: str, refusal: str = "empty batch") -> None:
    start(rank, init_file, timeout_s=10)
    try:
        outcomes = []
        pipe = Pipe(make_model(seed=0), balance=[3, 3], devices=["cpu"] * 2, chunks=2)
        GradientSync(pipe)
        x, y = rank_batch(rank)
        pipe.step(x, y, nn.MSELoss())
        if rank == 1:  # a loop that skips a batch its step refused, and goes on
            outcomes.append(_refused_step(pipe, x, y, refusal))
        pipe.zero_grad(set_to_none=True)
        try:
            pipe.step(x, y, nn.MSELoss())
            outcomes.append("no error")
        except RanksOutOfStep as exc:
            outcomes.append(str(exc))
        # Nothing averaged, and the failed step's new gradients are removed (section 7 of the guide).
        outcomes.append(all(p.grad is None for p in pipe.parameters()))
        # A step inside no_sync() on one rank only: its next step meets the other rank's first.
        again = Pipe(make_model(seed=0), balance=[3, 3], devices=["cpu"] * 2, chunks=2)
        sync = GradientSync(again)
        if rank == 1:
            with sync.no_sync():
                again.step(x, y, nn.MSELoss())
        try:
            again.step(x, y, nn.MSELoss())
            outcomes.append("no error")
        except RanksOutOfStep as exc:
            outcomes.append(str(exc)[:60])
        # helper-121: the ranks' counts never agreed again, so every later step raised too. Every
        # rank now counts on from the highest count: the next steps of both Pipes average.
        for stepped in (pipe, again):
            plain = plain_copy(stepped)
            stepped.zero_grad(set_to_none=True)
            stepped.step(x, y, nn.MSELoss())
            expected = averaged_reference_grads(plain, x, y)
            outcomes.append(all(torch.allclose(p.grad, w, rtol=0, atol=1e-14)
                                for p, w in zip(stepped.parameters(), expected)))
        # A sync taken off its Pipe leaves its steps local, and a new one may be attached.
        sync.detach()
        again.zero_grad(set_to_none=True)
        again.step(x, y, nn.MSELoss())
        local = [p.grad.clone() for p in again.parameters()]
        outcomes.append(not same_on_every_rank(local))
        GradientSync(again)
        again.zero_grad(set_to_none=True)
        again.step(x, y, nn.MSELoss())
        outcomes.append(same_on_every_rank([p.grad for p in again.parameters()]))
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr(outcomes))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("refusal", ["empty batch", "FakeTensorMode"])
def test_ranks_whose_calls_differ_are_told_instead_of_averaging_other_steps(tmp_path, refusal) -> None:
    """Review: a rank that skipped a refused step (or stepped inside no_sync() alone) paired its
    next step's all-reduces with the other rank's previous step, and both averaged gradients
    of different steps without a word. A step refused for the caller's state (a tracer, a
    fake-tensor mode) is a refused step like any other: it was not counted."""
    result_file = str(tmp_path / "result")
    spawn_ranks(out_of_step_worker, str(tmp_path / "init"), result_file, refusal, nprocs=WORLD)
    first = eval(open(f"{result_file}.0").read())
    second = eval(open(f"{result_file}.1").read())
    assert second[0].startswith("the input batch is empty" if refusal == "empty batch" else "Pipe.step cannot run under Fa")
    assert first[0] == ("the ranks are out of step: this rank's call 2 of step()/all_reduce() met calls 2..3 of "
                        "the others (a step refused, or run inside no_sync(), on some ranks only), so the "
                        "collectives paired up wrongly and no gradient was averaged: this rank's gradients are its "
                        "own. Every rank goes on counting from call 3, so the next step averages again; every rank "
                        "must make the same calls"), first[0]
    assert second[1].startswith("the ranks are out of step: this rank's call 3 of step()/all_reduce() met calls 2..3")
    assert first[1] is True and second[2] is True
    assert first[2].startswith("the ranks are out of step: this rank's call 1 of step()"), first[2]
    assert second[3].startswith("the ranks are out of step: this rank's call 2 of step()"), second[3]
    assert first[3:] == second[4:] == [True, True, True, True], (first, second)


class TwoExperts(nn.Module):
    """float32 experts in front of float64 layers (one partition, two dtypes); expert ``b`` is
    used on rank 0 only, as an expert that one rank's batch never routes to."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.mix = nn.Linear(6, 6).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.a(x.float()) + (self.b(x.float()) if dist.get_rank() == 0 else 0)
        return self.mix(hidden.double())


class IntegerIndex(nn.Module):
    """A partition whose only parameter is an integer one (it can have no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.index = nn.Parameter(torch.tensor([0, 1, 2]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def dtypes_worker(rank: int, init_file: str, result_file: str) -> None:
    start(rank, init_file)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(TwoExperts(), IntegerIndex(), nn.Linear(6, 1).double())
        pipe = Pipe(model, balance=[1, 1, 1], devices=["cpu"] * 3, chunks=2)
        GradientSync(pipe)
        plain = plain_copy(pipe)
        x, y = rank_batch(rank)
        pipe.step(x, y, nn.MSELoss())
        nn.functional.mse_loss(plain(x), y).backward()
        matches = []
        for (name, got), want in zip(pipe.named_parameters(), plain.parameters()):
            if want.grad is None and name.endswith("index"):
                matches.append((name, got.grad is None and torch.equal(got, torch.tensor([0, 1, 2]))))
                continue
            local = want.grad if want.grad is not None else torch.zeros_like(want)
            summed = local.clone()
            dist.all_reduce(summed)  # in the parameter's dtype, as GradientSync's buffer of that dtype
            matches.append((name, got.grad.dtype == want.dtype and torch.allclose(got.grad, summed / WORLD)))
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr(matches))
    finally:
        dist.destroy_process_group()


def test_a_partition_of_two_dtypes_and_one_of_integer_parameters_are_averaged_per_dtype(tmp_path) -> None:
    """Review: one flat buffer per partition promoted float32 gradients to float64; a rank that gave
    a float32 parameter no gradient then failed in the write-back, after the collectives, while
    the other rank went on. A partition of integer parameters failed every step."""
    result_file = str(tmp_path / "result")
    spawn_ranks(dtypes_worker, str(tmp_path / "init"), result_file, nprocs=WORLD)
    for rank in range(WORLD):
        matches = eval(open(f"{result_file}.{rank}").read())
        assert len(matches) == 9 and all(ok for _, ok in matches), (rank, matches)


def interrupted_broadcast_worker(rank: int, init_file: str, result_file: str) -> None:
    start(rank, init_file, timeout_s=5)
    try:
        pipe = Pipe(make_model(seed=0, norm=True), balance=[3, 4], devices=["cpu"] * 2, chunks=1)
        GradientSync(pipe)  # batch norm: float64 statistics and an int64 count, two broadcasts
        x, y = rank_batch(rank)
        pipe.step(x, y, nn.MSELoss())
        real_wait = grad_sync._wait
        armed = [rank == 1]

        def interrupted(work):  # where a real Ctrl-C lands: in the polled wait of the first broadcast
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt
            return real_wait(work)

        grad_sync._wait = interrupted
        began = time.monotonic()
        try:
            pipe.step(x, y, nn.MSELoss())
            outcome = "no error"
        except BaseException as exc:  # noqa: B902 - reported to the parent
            outcome = type(exc).__name__
        waited = time.monotonic() - began
        pipe.zero_grad(set_to_none=True)
        pipe.step(x, y, nn.MSELoss())  # the ranks are still paired: the next step averages
        plain = plain_copy(pipe)
        expected = averaged_reference_grads(plain, x, y)
        next_ok = all(torch.allclose(p.grad, want, rtol=0, atol=1e-14) for p, want in zip(pipe.parameters(), expected))
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr((outcome, waited, next_ok)))
    finally:
        dist.destroy_process_group()


def test_a_ctrl_c_in_the_buffer_broadcast_leaves_the_collectives_paired(tmp_path) -> None:
    """Review: the broadcasts (one per buffer dtype) were each waited for before the next was
    issued, so a Ctrl-C in the first wait left the second unissued; the peer paired it with the
    step's all-reduce and waited for the group's timeout, and the next step failed too."""
    result_file = str(tmp_path / "result")
    spawn_ranks(interrupted_broadcast_worker, str(tmp_path / "init"), result_file, nprocs=WORLD)
    interrupted, interrupted_wait, interrupted_next = eval(open(f"{result_file}.1").read())
    other, other_wait, other_next = eval(open(f"{result_file}.0").read())
    assert interrupted == "KeyboardInterrupt" and interrupted_wait < 4, (interrupted, interrupted_wait)
    assert other == "PeerStepFailed" and other_wait < 4, (other, other_wait)
    assert interrupted_next and other_next, (interrupted_next, other_next)


class SlowToReadReduction(nn.MSELoss):
    """An MSE loss whose ``reduction`` takes a while to read on one thread of rank 0: that step's
    checks, before the step lock, take longer there than on rank 1."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def __getattribute__(self, name: str):
        if name == "reduction" and threading.current_thread().name == "slow":
            time.sleep(object.__getattribute__(self, "delay_s"))
        return super().__getattribute__(name)


def threads_worker(rank: int, init_file: str, result_file: str) -> None:
    start(rank, init_file, timeout_s=20)
    try:
        pipe = Pipe(make_model(seed=0), balance=[3, 3], devices=["cpu"] * 2, chunks=2)
        GradientSync(pipe)
        x, y = rank_batch(rank)
        errors = []

        def one_step() -> None:
            try:
                pipe.step(x, y, SlowToReadReduction(0.5 if rank == 0 else 0.0))
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                errors.append(f"{type(exc).__name__}: {str(exc)[:80]}")

        slow = threading.Thread(target=one_step, name="slow")
        slow.start()
        time.sleep(0.1)  # the slow thread enters step() first on both ranks, and locks last on rank 0
        fast = threading.Thread(target=one_step, name="fast")
        fast.start()
        slow.join(30)
        fast.join(30)
        averaged = same_on_every_rank([p.grad for p in pipe.parameters()])
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr((errors, averaged)))
    finally:
        dist.destroy_process_group()


def test_steps_from_two_threads_are_numbered_in_the_order_they_run(tmp_path) -> None:
    """Review: each call was numbered when it entered step(), before the step lock. Two threads
    stepping one Pipe on every rank ran in lock order, which may differ from entry order, so
    identical ranks raised RanksOutOfStep. A call is numbered under the lock now."""
    result_file = str(tmp_path / "result")
    spawn_ranks(threads_worker, str(tmp_path / "init"), result_file, nprocs=WORLD)
    for rank in range(WORLD):
        errors, averaged = eval(open(f"{result_file}.{rank}").read())
        assert errors == [] and averaged, (rank, errors)


def half_average_worker(rank: int, init_file: str, result_file: str) -> None:
    start(rank, init_file)
    try:
        def build() -> nn.Sequential:
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).half()

        x = torch.full((2, 4), 1.0 + rank, dtype=torch.float16)

        def loss_fn(out: torch.Tensor, target: object) -> torch.Tensor:
            return out.float().sum() * 25000.0  # a large loss scale: each rank's gradient nears fp16's max

        model = build()
        with Pipe(model, [1, 1], devices=["cpu"] * 2, chunks=1) as pipe:
            GradientSync(pipe)
            pipe.step(x, None, loss_fn)
        plain = build()
        ddp = nn.parallel.DistributedDataParallel(plain)
        loss_fn(ddp(x), None).backward()
        del ddp
        got, want = [p.grad for p in model.parameters()], [p.grad for p in plain.parameters()]
        finite = int(torch.isfinite(want[2]).sum())  # the sum of the two ranks' shares would overflow here
        with open(f"{result_file}.{rank}", "w") as out:
            out.write(repr(([torch.equal(g, w) for g, w in zip(got, want)], finite)))
    finally:
        dist.destroy_process_group()


def test_a_half_precision_average_is_divided_before_the_sum_as_ddp_does(tmp_path) -> None:
    """Review (s33): the gradients were summed over the ranks and then divided, so an fp16
    average that fits overflowed to inf in the sum where DDP's (divided first) did not."""
    result_file = str(tmp_path / "result")
    spawn_ranks(half_average_worker, str(tmp_path / "init"), result_file, nprocs=WORLD)
    for rank in range(WORLD):
        equal, finite = eval(open(f"{result_file}.{rank}").read())
        assert equal == [True] * 4 and finite == 3, (rank, equal, finite)
