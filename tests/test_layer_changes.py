"""Changes made inside a layer between calls run as in the plain model, and what cannot run is refused.

A Pipe reads facts about each partition (its batch norms, where its parameters live, whether
it starts in place) to set up checkpointing; a layer changed after the Pipe was built must be
read again, or a recompute updates a new batch norm's statistics twice, silently.
"""
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize

from torchpipe import Pipe

CALLS = ["forward", "step"]


def _block() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 3))


def _train(model, call: str, x, y) -> None:
    if call == "step":
        model.step(x, y, nn.MSELoss(), schedule="1f1b")
    else:
        nn.MSELoss()(model(x), y).backward()


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("how", ["appended", "replaced"])
def test_a_batch_norm_put_inside_a_layer_later_counts_each_step_once_under_checkpointing(call, how):
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    plain = _block()
    # The caller's intra-op thread count: a bitwise comparison with the plain model.
    with Pipe(copy.deepcopy(plain), balance=[2, 2, 1], chunks=1, checkpoint="always",
              intra_op_threads=torch.get_num_threads()) as pipe:
        pipe(x)  # run once as built: the Pipe has read its partitions
        if how == "appended":
            changed = nn.BatchNorm1d(8)
            pipe[2].append(changed), plain[2].append(copy.deepcopy(changed))
        else:
            changed = nn.Sequential(copy.deepcopy(plain[2][0]), nn.BatchNorm1d(8))
            pipe[2][0], plain[2][0] = changed, copy.deepcopy(changed)
        for _ in range(3):
            _train(pipe, call, x, y)
            _train(plain, call="forward", x=x, y=y)
        norm, plain_norm = [m for m in pipe[2].modules() if isinstance(m, nn.BatchNorm1d)], \
            [m for m in plain[2].modules() if isinstance(m, nn.BatchNorm1d)]
        assert len(norm) == len(plain_norm) == 1
        assert int(norm[0].num_batches_tracked) == int(plain_norm[0].num_batches_tracked) == 3
        assert torch.equal(norm[0].running_mean, plain_norm[0].running_mean)
        assert torch.equal(norm[0].running_var, plain_norm[0].running_var)
        for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), name
        pipe.eval(), plain.eval()
        assert torch.equal(pipe(x), plain(x))


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def _parametrized(linear: nn.Linear) -> dict:
    """A parametrization: new modules inside the layer. The tensors functional_call swaps in."""
    parametrize.register_parametrization(linear, "weight", _Doubled())
    w = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return {"2.0.parametrizations.weight.original": w}


def _weight_normed(linear: nn.Linear) -> dict:
    """weight_norm: new parameters on the layer itself (no module added)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        torch.nn.utils.weight_norm(linear)
    return {"2.0.weight_g": linear.weight_g.detach().clone().mul(1.5).requires_grad_(),
            "2.0.weight_v": linear.weight_v.detach().clone().requires_grad_()}


@pytest.mark.parametrize("change", [_parametrized, _weight_normed])
def test_functional_call_reaches_parameters_a_layer_gets_after_building(change):
    # functional_call puts the module's own tensors back before backward recomputes: the
    # recompute must run with the tensors the forward ran with, those a layer got after the
    # Pipe was built too, or the gradient goes to the module's own tensors.
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    plain = _block().double()
    with Pipe(copy.deepcopy(plain), balance=[2, 2, 1], chunks=2, checkpoint="always") as pipe:
        pipe(x)
        grads = []
        for model in (pipe, plain):
            given = change(model[2][0])
            nn.MSELoss()(functional_call(model, given, (x,)), y).backward()
            grads.append([t.grad for t in given.values()])
            assert all(model.get_parameter(name).grad is None for name in given)  # the module's own
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("call", CALLS)
def test_an_in_place_first_layer_put_in_later_trains_as_the_plain_model(call):
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    torch.manual_seed(0)  # partition 0 ends with a layer that does not save its output
    plain = nn.Sequential(nn.Tanh(), nn.Linear(6, 8), nn.Sequential(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 3))
    with Pipe(copy.deepcopy(plain), balance=[2, 2, 1], chunks=1, checkpoint="always",
              intra_op_threads=torch.get_num_threads()) as pipe:
        pipe(x)
        for model in (pipe, plain):
            model[2].insert(0, nn.ReLU(inplace=True))  # partition 1 now starts in place
        _train(pipe, call, x, y)
        _train(plain, "forward", x, y)
        for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("checkpoint,chunks", [("always", 1), ("except_last", 4), ("never", 4)])
def test_inplace_turned_on_later_in_a_first_layer_trains_as_the_plain_model(call, checkpoint, chunks):
    # No module is added: only the flag changes, which a comparison of the modules misses.
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    with Pipe(copy.deepcopy(plain), balance=[1, 2, 2], chunks=chunks, checkpoint=checkpoint,
              intra_op_threads=torch.get_num_threads()) as pipe:
        pipe(x)
        pipe[1].inplace = plain[1].inplace = True  # partition 1 now starts in place
        _train(pipe, call, x, y)
        _train(plain, "forward", x, y)
        for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_batch_norm_added_later_under_deferred_batch_norm_counts_the_mini_batch_once(call, checkpoint):
    # Converted as the build converts: left plain, it updated once per micro-batch (12 against 3).
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    plain = _block().double()
    with Pipe(copy.deepcopy(plain), balance=[2, 2, 1], chunks=4, checkpoint=checkpoint,
              deferred_batch_norm=True) as pipe:
        pipe(x)
        added = nn.BatchNorm1d(8, dtype=torch.float64)
        pipe[2].append(added)
        plain[2].append(copy.deepcopy(added))
        for _ in range(3):
            _train(pipe, call, x, y)
            _train(plain, "forward", x, y)
        converted = pipe[2][-1]
        assert type(converted).__name__.startswith("DeferredBatchNorm")
        # The same tensors as the layer the user appended, which sees the statistics too.
        assert converted.running_mean is added.running_mean and converted.weight is added.weight
        assert int(added.num_batches_tracked) == int(plain[2][-1].num_batches_tracked) == 3
        torch.testing.assert_close(added.running_mean, plain[2][-1].running_mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(added.running_var, plain[2][-1].running_var, rtol=1e-12, atol=1e-12)


def test_track_running_stats_turned_on_later_without_running_statistics_runs_as_the_plain_model():
    x = torch.randn(16, 6)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.BatchNorm1d(8, track_running_stats=False)),
                          nn.BatchNorm1d(8, track_running_stats=False), nn.Linear(8, 3))
    plain = copy.deepcopy(model)
    with Pipe(model, balance=[2, 2], chunks=1, deferred_batch_norm=True,
              intra_op_threads=torch.get_num_threads()) as pipe:
        pipe(x)
        # Without running statistics the flag tracks nothing (torch normalises by the batch):
        # nothing to convert or refuse, and the call runs as the plain model does.
        for model_ in (pipe, plain):
            model_[1][0].track_running_stats = model_[2].track_running_stats = True
        assert torch.equal(pipe(x), plain(x))
        assert type(pipe[1][0]) is type(pipe[2]) is nn.BatchNorm1d


@pytest.mark.parametrize("nested", [True, False], ids=["nested", "a layer"])
@pytest.mark.parametrize("frozen_at_build", [True, False])
def test_track_running_stats_toggled_under_deferred_batch_norm_follows_the_plain_model(frozen_at_build, nested):
    # Frozen at build (the flag off, the statistics kept) and turned on later, the layer was
    # left plain and counted once per micro-batch (8 against 2); converted and then frozen,
    # it went on counting (3 against 1). Left plain while frozen (its own forward and hooks
    # kept, as torchgpipe leaves it), it is converted once the flag is on; a layer that is
    # the batch norm itself cannot be, and is refused.
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8)
    plain = nn.Sequential(nn.Linear(6, 8), nn.Sequential(norm) if nested else norm, nn.Tanh(), nn.Linear(8, 3)).double()
    the_norm = (lambda model: model[1][0]) if nested else (lambda model: model[1])
    the_norm(plain).track_running_stats = not frozen_at_build
    with Pipe(copy.deepcopy(plain), balance=[2, 2], chunks=4, deferred_batch_norm=True) as pipe:
        for flag in (not frozen_at_build, frozen_at_build):  # as built, then toggled
            the_norm(pipe).track_running_stats = the_norm(plain).track_running_stats = flag
            if flag and frozen_at_build and not nested:
                with pytest.raises(ValueError, match="layer '1' is a BatchNorm1d that tracks running statistics "
                                                     "now but did not when the Pipe was built"):
                    pipe(x)
                assert int(the_norm(pipe).num_batches_tracked) == 0
                return
            for _ in range(2):
                _train(pipe, "forward", x, y)
                _train(plain, "forward", x, y)
            got, want = the_norm(pipe), the_norm(plain)
            assert type(got).__name__.startswith("DeferredBatchNorm" if flag or not frozen_at_build else "BatchNorm1d")
            assert int(got.num_batches_tracked) == int(want.num_batches_tracked)
            torch.testing.assert_close(got.running_mean, want.running_mean, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got.running_var, want.running_var, rtol=1e-12, atol=1e-12)
        assert int(the_norm(plain).num_batches_tracked) == 2  # tracked in one of the two phases
        pipe.eval(), plain.eval()
        torch.testing.assert_close(pipe(x), plain(x), rtol=1e-12, atol=1e-12)


def test_a_frozen_batch_norm_keeps_its_own_forward_and_hooks_under_deferred_batch_norm():
    # Converted since frozen ones were (one session), a subclass's forward and a hook were lost.
    class AlwaysRunning(nn.BatchNorm1d):
        def forward(self, x):
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False)

    x = torch.randn(8, 6)
    torch.manual_seed(0)
    frozen = AlwaysRunning(8)
    frozen.track_running_stats = False
    hooked = nn.BatchNorm1d(8)
    hooked.track_running_stats = False
    hooked.register_forward_hook(lambda module, args, output: output * 2)
    plain = nn.Sequential(nn.Linear(6, 8), frozen, nn.Sequential(hooked), nn.Linear(8, 3))
    with Pipe(copy.deepcopy(plain), balance=[2, 2], chunks=1, deferred_batch_norm=True,
              intra_op_threads=torch.get_num_threads()) as pipe:
        assert type(pipe[1]) is AlwaysRunning and type(pipe[2][0]) is nn.BatchNorm1d
        assert torch.equal(pipe(x), plain(x))


class _Aliased(nn.Module):
    """One batch norm in two slots (``self.norm = self.alias = norm``), run through the alias."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.alias = norm

    def forward(self, x):
        return self.alias(x)


@pytest.mark.parametrize("when", ["at build", "added later"])
def test_a_batch_norm_held_in_two_slots_of_a_layer_is_converted_in_both(when):
    # named_children() skips a repeat: the second slot stayed a plain batch norm, counting
    # once per micro-batch on the converted one's buffers (5 against 2).
    x = torch.randn(16, 6, dtype=torch.float64)
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(8, dtype=torch.float64)
    plain = nn.Sequential(nn.Linear(6, 8), nn.Sequential(), nn.Linear(8, 3)).double()
    if when == "at build":
        plain[1].append(_Aliased(norm))
    with Pipe(copy.deepcopy(plain), balance=[1, 2], chunks=4, deferred_batch_norm=True) as pipe:
        if when == "added later":
            pipe(x)
            pipe[1].append(_Aliased(copy.deepcopy(norm)))
            plain[1].append(_Aliased(copy.deepcopy(norm)))
        for _ in range(2):
            pipe(x), plain(x)
        layer, want = pipe[1][0], plain[1][0].norm
        assert type(layer.norm).__name__.startswith("DeferredBatchNorm") and layer.alias is layer.norm
        assert int(layer.norm.num_batches_tracked) == int(want.num_batches_tracked) == 2
        torch.testing.assert_close(layer.norm.running_mean, want.running_mean, rtol=1e-12, atol=1e-12)


def test_an_uninitialized_lazy_batch_norm_added_later_is_refused_naming_its_layer():
    x = torch.randn(16, 6)
    with Pipe(nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.BatchNorm1d(8)), nn.Sequential(nn.Linear(8, 8)),
                            nn.Linear(8, 3)), balance=[2, 2], chunks=4, deferred_batch_norm=True) as pipe:
        pipe(x)
        pipe[1].append(nn.BatchNorm1d(8))  # fine on its own: not converted while another layer is refused
        pipe[2].append(nn.LazyBatchNorm1d())
        with pytest.raises(ValueError, match=r"layer '2' holds a LazyBatchNorm1d \(2\.1\) added since the Pipe was "
                                             r"built, .*cannot: it is uninitialized; .*pipe\[2\]\.eval\(\); "
                                             r"pipe\[2\]\(sample\)"):
            pipe(x)
        assert type(pipe[1][1]) is nn.BatchNorm1d
        pipe[2][1](torch.randn(4, 8))  # initialized outside the Pipe: converted at the next call
        pipe(x)
        assert type(pipe[1][1]) is type(pipe[2][1]) and type(pipe[1][1]).__name__.startswith("DeferredBatchNorm")


class _Positive(nn.Module):
    def forward(self, weight):
        return weight.abs() + 0.5


@pytest.mark.parametrize("when", ["at build", "added later"])
def test_a_parametrized_batch_norm_is_refused_before_anything_is_converted(when):
    # Its weight is computed, not a Parameter: the conversion failed halfway with torch's
    # "cannot assign 'torch.FloatTensor' as parameter 'weight'", a batch norm before it
    # already converted in the model of a refused Pipe.
    first, second = nn.BatchNorm1d(8), nn.BatchNorm1d(8)
    parametrize.register_parametrization(second, "weight", _Positive())
    layers = [nn.Linear(6, 8), first, nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 3)]
    if when == "at build":
        layers[2].append(second)
        model = nn.Sequential(*layers)
        with pytest.raises(ValueError, match=r"cannot convert the ParametrizedBatchNorm1d '2\.1': its parameters are parametrized"):
            Pipe(model, balance=[2, 2], chunks=2, deferred_batch_norm=True)
        assert model[1] is first and model[2][1] is second
        return
    with Pipe(nn.Sequential(*layers), balance=[2, 2], chunks=2, deferred_batch_norm=True) as pipe:
        pipe(torch.randn(8, 6))
        pipe[2].append(second)
        pipe[0].register_forward_pre_hook(lambda module, args: None)  # nothing else changes
        with pytest.raises(ValueError, match=r"layer '2' holds a ParametrizedBatchNorm1d \(2\.1\) added since the Pipe was "
                                             r"built, .*cannot: its parameters are parametrized"):
            pipe(torch.randn(8, 6))
        assert pipe[2][1] is second


def test_a_failed_call_puts_back_the_statistics_of_a_batch_norm_added_later():
    x = torch.randn(16, 6)
    with Pipe(_block(), balance=[2, 2, 1], chunks=4, deferred_batch_norm=True) as pipe:
        pipe(x)
        pipe[2].append(nn.BatchNorm1d(8))

        def fail(module, args, output):
            raise ValueError("the last layer fails")

        pipe[4].register_forward_hook(fail)
        with pytest.raises(ValueError, match="the last layer fails"):
            pipe(x)
        assert int(pipe[2][-1].num_batches_tracked) == 0
        assert torch.equal(pipe[2][-1].running_mean, torch.zeros(8))


@pytest.mark.parametrize("shared", ["parameter", "batch norm"])
def test_a_tensor_two_layers_share_since_building_is_refused_as_at_build(shared):
    # Two workers would update a shared running statistic at once: the build refuses it, and
    # so does the next call, before anything runs.
    x = torch.randn(8, 6)
    model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.Tanh()), nn.Linear(8, 8), nn.Sequential(nn.Tanh()),
                          nn.Linear(8, 3))
    with Pipe(model, balance=[2, 2, 1], chunks=4, deferred_batch_norm=True) as pipe:
        pipe(x)
        if shared == "parameter":
            pipe[1].append(pipe[2])  # partition 1's Linear, in partition 0 too
        else:
            norm = nn.BatchNorm1d(8)
            pipe[1].append(norm), pipe[3].append(norm)
        kind = "parameter" if shared == "parameter" else "(parameter|buffer)"
        with pytest.raises(ValueError, match=rf"changed inside since the Pipe was built: .*duplicate {kind}s.*'1' and '[23]'"):
            nn.MSELoss()(pipe(x), torch.zeros(8, 3)).backward()
        assert all(p.grad is None for p in pipe.parameters())  # nothing ran
        assert all(type(m) is nn.BatchNorm1d for m in pipe.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
        pipe[1].pop(-1)
        if shared == "batch norm":
            pipe[3].pop(-1)
        pipe(x)  # the layers as built again: it runs


def test_weight_norm_between_a_forward_and_its_recompute_is_a_clear_error():
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    with Pipe(_block(), balance=[2, 2, 1], chunks=1, checkpoint="always") as pipe:
        loss = nn.MSELoss()(pipe(x), y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
            torch.nn.utils.weight_norm(pipe[2][0])
        with pytest.raises(RuntimeError, match=r"partition 1 changed between a checkpointed forward and its "
                                               r"recompute in backward: parameter '2\.0\.weight' was there"):
            loss.backward()
        pipe.zero_grad()
        nn.MSELoss()(pipe(x), y).backward()  # the layer as it is now: trains
        assert pipe[2][0].weight_g.grad is not None


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # x does not require grad
@pytest.mark.parametrize("method", ["step", "evaluate"])
@pytest.mark.parametrize("kind", ["forward_pre_hook", "forward_hook", "full_backward_hook", "full_backward_pre_hook"])
def test_hooks_on_the_pipe_itself_are_refused_by_step_and_evaluate_before_anything_runs(method, kind):
    # They wrap pipe(x); step() and evaluate() run the layers micro-batch by micro-batch and
    # would skip them silently (a pre-hook that normalises the input among them).
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    with Pipe(_block(), balance=[2, 2, 1], chunks=2) as pipe:
        fired = []
        hook = {"forward_pre_hook": lambda m, a: fired.append(kind),
                "forward_hook": lambda m, a, out: fired.append(kind),
                "full_backward_hook": lambda m, gi, go: fired.append(kind),
                "full_backward_pre_hook": lambda m, go: fired.append(kind)}[kind]
        handle = getattr(pipe, f"register_{kind}")(hook)
        words = kind.replace("full_", "").replace("_pre_hook", " pre-hook").replace("_hook", " hook")
        with pytest.raises(RuntimeError, match=rf"Pipe.{method} cannot run this Pipe's own module hooks \(.*{words}"):
            getattr(pipe, method)(x, y, nn.MSELoss())
        assert fired == [] and all(p.grad is None for p in pipe.parameters())
        nn.MSELoss()(pipe(x), y).backward()  # pipe(x) runs them
        assert fired
        handle.remove()
        pipe.zero_grad()
        getattr(pipe, method)(x, y, nn.MSELoss())
