"""Tests of DeferredBatchNorm: running statistics per mini-batch, normalisation per micro-batch."""
from __future__ import annotations

import copy
import inspect
import pickle
from typing import List, Optional, Tuple

import pytest
import torch
from torch import nn

from torchpipe.batchnorm import DeferredBatchNorm, DeferredBatchNorm1d, DeferredBatchNorm3d, set_microbatches
from torchpipe.checkpoint import _set_flag

# (batch-norm class, shape of one sample): 1d without and with length, 2d, 3d.
SHAPES: List[Tuple[type, Tuple[int, ...]]] = [
    (nn.BatchNorm1d, (3,)),
    (nn.BatchNorm1d, (3, 5)),
    (nn.BatchNorm2d, (3, 4, 4)),
    (nn.BatchNorm3d, (3, 2, 3, 3)),
]


def tolerance(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}


def make_batch_norms(kind: type, chunks: int, momentum: Optional[float] = 0.1,
                     dtype: torch.dtype = torch.float32) -> Tuple[nn.Module, nn.Module, nn.Module]:
    """A plain BN for the whole batch, a naive BN per micro-batch, and a deferred BN."""
    torch.manual_seed(0)
    plain = kind(3, momentum=momentum).to(dtype)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-1, 1)
    naive = copy.deepcopy(plain)
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(plain), chunks)
    return plain, naive, deferred


def random_batch(batch: int, sample_shape: Tuple[int, ...], dtype: torch.dtype,
                 step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return (torch.randn(batch, *sample_shape, generator=generator, dtype=dtype) * (2 + step)
            + step - 1)


def train_pipelined(deferred: nn.Module, x: torch.Tensor, chunks: int,
                    recompute: bool = False) -> List[torch.Tensor]:
    """Feed micro-batches in order as a pipeline would, optionally recomputing each one."""
    microbatches = x.chunk(chunks)
    set_microbatches(deferred, len(microbatches))
    outputs = []
    for microbatch in microbatches:
        outputs.append(deferred(microbatch))
        if recompute:
            with _set_flag("recomputing"):
                deferred(microbatch)
    return outputs


def assert_same_running_stats(a: nn.Module, b: nn.Module, dtype: torch.dtype) -> None:
    torch.testing.assert_close(a.running_mean, b.running_mean, **tolerance(dtype))
    torch.testing.assert_close(a.running_var, b.running_var, **tolerance(dtype))
    assert int(a.num_batches_tracked) == int(b.num_batches_tracked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("kind,sample_shape", SHAPES)
def test_running_stats_equal_whole_batch_and_differ_from_naive(
        kind: type, sample_shape: Tuple[int, ...], recompute: bool, dtype: torch.dtype) -> None:
    chunks = 4
    plain, naive, deferred = make_batch_norms(kind, chunks, dtype=dtype)
    for step in range(3):
        x = random_batch(16, sample_shape, dtype, step)
        plain(x)
        for microbatch in x.chunk(chunks):
            naive(microbatch)
        train_pipelined(deferred, x, chunks, recompute=recompute)

    assert_same_running_stats(deferred, plain, dtype)
    assert int(deferred.num_batches_tracked) == 3
    assert int(naive.num_batches_tracked) == 12
    assert not torch.allclose(naive.running_mean, plain.running_mean, rtol=1e-3, atol=1e-4)
    assert not torch.allclose(naive.running_var, plain.running_var, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("kind,sample_shape", SHAPES)
def test_momentum_none_is_a_cumulative_average(kind: type, sample_shape: Tuple[int, ...]) -> None:
    plain, _, deferred = make_batch_norms(kind, 2, momentum=None, dtype=torch.float64)
    for step in range(4):
        x = random_batch(8, sample_shape, torch.float64, step)
        plain(x)
        train_pipelined(deferred, x, 2)
    assert deferred.momentum is None
    assert_same_running_stats(deferred, plain, torch.float64)


def test_non_divisible_batch_commits_once_with_fewer_microbatches() -> None:
    plain, _, deferred = make_batch_norms(nn.BatchNorm2d, chunks=4, dtype=torch.float64)
    # 10 samples in 4 chunks: 3, 3, 3, 1.
    x = random_batch(10, (3, 4, 4), torch.float64, 0)
    assert [len(c) for c in x.chunk(4)] == [3, 3, 3, 1]
    plain(x)
    train_pipelined(deferred, x, 4)
    assert_same_running_stats(deferred, plain, torch.float64)
    # 6 samples in "4" chunks: torch.chunk gives only 3. The step still commits.
    x = random_batch(6, (3, 4, 4), torch.float64, 1)
    assert len(x.chunk(4)) == 3
    plain(x)
    train_pipelined(deferred, x, 4)
    assert_same_running_stats(deferred, plain, torch.float64)
    assert int(deferred.num_batches_tracked) == 2


@pytest.mark.parametrize("kind,sample_shape", SHAPES)
def test_outputs_and_gradients_equal_plain_batch_norm_per_microbatch(
        kind: type, sample_shape: Tuple[int, ...]) -> None:
    chunks = 2
    plain, _, deferred = make_batch_norms(kind, chunks)
    x = random_batch(8, sample_shape, torch.float32, 0)
    set_microbatches(deferred, chunks)
    for microbatch in x.chunk(chunks):
        reference = copy.deepcopy(plain)  # same parameters, normalises with its batch stats
        input_ref = microbatch.clone().requires_grad_()
        input_def = microbatch.clone().requires_grad_()
        out_ref = reference(input_ref)
        out_def = deferred(input_def)
        torch.testing.assert_close(out_def, out_ref, rtol=0, atol=0)

        upstream = torch.randn_like(out_ref)
        out_ref.backward(upstream)
        out_def.backward(upstream)
        torch.testing.assert_close(input_def.grad, input_ref.grad)
        torch.testing.assert_close(deferred.weight.grad, reference.weight.grad)
        torch.testing.assert_close(deferred.bias.grad, reference.bias.grad)
        deferred.zero_grad()


def test_eval_mode_uses_running_stats() -> None:
    plain, _, deferred = make_batch_norms(nn.BatchNorm2d, 4)
    for step in range(3):
        x = random_batch(12, (3, 4, 4), torch.float32, step)
        plain(x)
        train_pipelined(deferred, x, 4)
    plain.eval()
    deferred.eval()
    before = copy.deepcopy(deferred.state_dict())
    x = random_batch(5, (3, 4, 4), torch.float32, 9)
    torch.testing.assert_close(deferred(x), plain(x))
    for key, value in deferred.state_dict().items():
        assert torch.equal(value, before[key]), "eval mode does not update statistics"


def test_state_dict_round_trip_with_plain_batch_norm() -> None:
    plain, _, deferred = make_batch_norms(nn.BatchNorm2d, 2)
    for step in range(2):
        train_pipelined(deferred, random_batch(8, (3, 4, 4), torch.float32, step), 2)
    state = deferred.state_dict()
    assert list(state) == list(nn.BatchNorm2d(3).state_dict())

    fresh_plain = nn.BatchNorm2d(3)
    fresh_plain.load_state_dict(state)
    back = DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm2d(3), chunks=2)
    back.load_state_dict(fresh_plain.state_dict())
    for key, value in state.items():
        assert torch.equal(fresh_plain.state_dict()[key], value)
        assert torch.equal(back.state_dict()[key], value)


_HAS_BIAS_OPTION = "bias" in inspect.signature(nn.BatchNorm2d.__init__).parameters


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.norm = nn.BatchNorm2d(3)
        # bias=False exists from torch 2.13; older versions get a plain affine one instead.
        without_bias = nn.BatchNorm2d(3, bias=False) if _HAS_BIAS_OPTION else nn.BatchNorm2d(3)
        self.inner = nn.Sequential(nn.BatchNorm2d(3, affine=False), without_bias)
        self.untracked = nn.BatchNorm2d(3, track_running_stats=False)


def test_conversion_replaces_nested_batch_norms_and_keeps_objects() -> None:
    model = nn.Sequential(Block(), nn.BatchNorm1d(3))
    model.eval()
    model[0].norm.train()
    norm = model[0].norm
    weight, running_mean = norm.weight, norm.running_mean
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=3)
    assert converted is model
    block = converted[0]
    for layer in (block.norm, block.inner[0], block.inner[1], converted[1]):
        assert isinstance(layer, DeferredBatchNorm)
        assert layer.chunks == 3
    assert not isinstance(block.untracked, DeferredBatchNorm)
    assert block.norm.weight is weight and block.norm.running_mean is running_mean
    assert block.norm.training and not converted[1].training and not block.inner[0].training
    assert block.inner[0].weight is None and (block.inner[1].bias is None) == _HAS_BIAS_OPTION
    assert block.inner[1].weight is not None

    # An optimizer built before the conversion still trains the converted model.
    converted.train()
    before = weight.detach().clone()
    out = block.norm(torch.randn(6, 3, 2, 2)) * torch.randn(6, 3, 2, 2)
    out.sum().backward()
    optimizer.step()
    assert not torch.equal(block.norm.weight, before)

    # A batch norm passed directly is replaced; its input rank check is the source's.
    single = DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm2d(3))
    assert isinstance(single, DeferredBatchNorm)
    with pytest.raises(ValueError, match="4D"):
        single(torch.randn(4, 3, 5))


def test_set_microbatches_drops_statistics_of_an_interrupted_step() -> None:
    plain, _, deferred = make_batch_norms(nn.BatchNorm2d, 4, dtype=torch.float64)
    interrupted = random_batch(8, (3, 2, 2), torch.float64, 5)
    set_microbatches(deferred, 4)
    deferred(interrupted[:2])  # the step fails after one micro-batch
    x = random_batch(8, (3, 2, 2), torch.float64, 0)
    plain(x)
    train_pipelined(deferred, x, 4)
    assert_same_running_stats(deferred, plain, torch.float64)


def test_invalid_microbatch_counts() -> None:
    model = DeferredBatchNorm.convert_deferred_batch_norm(nn.Sequential(nn.BatchNorm1d(2)))
    for bad, error in ((0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match=repr(bad)):
            set_microbatches(model, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0"):
        DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm1d(2), chunks=0)


def test_an_uninitialized_lazy_batch_norm_is_refused_before_anything_is_converted() -> None:
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 3, 1), nn.Sequential(nn.LazyBatchNorm2d()))
    with pytest.raises(ValueError, match=r"uninitialized LazyBatchNorm2d '2\.0'.*run one forward first"):
        DeferredBatchNorm.convert_deferred_batch_norm(model, 2)
    assert [type(m).__name__ for m in model.modules()] == [
        "Sequential", "BatchNorm2d", "Conv2d", "Sequential", "LazyBatchNorm2d"]


def test_bad_arguments_are_refused_before_any_state_changes():
    """momentum='x' failed in forward after num_batches_tracked had been counted."""
    with pytest.raises(TypeError, match="convert_deferred_batch_norm takes an nn.Module, got None"):
        DeferredBatchNorm.convert_deferred_batch_norm(None)
    with pytest.raises(TypeError, match="momentum must be a float or None.*'x'"):
        DeferredBatchNorm(4, momentum="x")
    assert DeferredBatchNorm(4, momentum=None).momentum is None


def test_counts_are_ints_of_any_integer_type_and_wrong_types_are_type_errors():
    """Review: np.int64(2) and a 0-dim tensor were refused with a ValueError (torchgpipe and
    Pipe(chunks=...) take them), and a str or float was a ValueError, not a TypeError."""
    import numpy

    for count in (numpy.int64(2), torch.tensor(2)):
        norm = DeferredBatchNorm(3, chunks=count)
        assert type(norm.chunks) is int and norm.chunks == 2
        norm.set_microbatches(count)
        assert type(norm.microbatches) is int
        converted = DeferredBatchNorm.convert_deferred_batch_norm(nn.Sequential(nn.BatchNorm1d(3)), count)
        assert converted[0].chunks == 2
    for wrong in ("2", 2.0, True, None):
        with pytest.raises(TypeError, match=f"the number of micro-batches must be a positive int, got {wrong!r}"):
            DeferredBatchNorm(3, chunks=wrong)
    with pytest.raises(ValueError, match="the number of micro-batches must be a positive int, got 0"):
        DeferredBatchNorm(3).set_microbatches(0)


@pytest.mark.parametrize("kind, shape", [(nn.BatchNorm1d, (8, 3)), (nn.BatchNorm2d, (8, 3, 2, 2)),
                                         (nn.BatchNorm3d, (8, 3, 2, 2, 2))])
def test_a_converted_batch_norm_is_still_an_instance_of_its_kind(kind, shape):
    """helper-120: a converted layer was no longer an ``nn.BatchNorm2d``, so the usual "no weight
    decay on norm layers" split by isinstance found no norm and decayed its weights. It stays
    one, pickles and copies, and still defers (its forward is ours)."""
    model = nn.Sequential(nn.Identity(), kind(3))
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=2)
    norm = converted[1]
    assert isinstance(norm, kind) and isinstance(norm, DeferredBatchNorm)
    assert [m for m in converted.modules() if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))] == [norm]
    for other in {nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d} - {kind}:
        assert not isinstance(norm, other)
    assert pickle.loads(pickle.dumps(norm)).state_dict().keys() == norm.state_dict().keys()
    assert type(copy.deepcopy(norm)) is type(norm)
    before = norm.running_mean.clone()
    norm(torch.randn(*shape))
    assert torch.equal(norm.running_mean, before)  # one of two micro-batches: nothing committed yet
    norm(torch.randn(*shape))
    assert not torch.equal(norm.running_mean, before)
    with pytest.raises(ValueError, match="expected"):
        norm(torch.randn(*shape[:1]))  # the kind's input check
    # helper-123: called on a per-kind class, the conversion gave every kind that class.
    for converter in (DeferredBatchNorm1d, DeferredBatchNorm3d):
        again = converter.convert_deferred_batch_norm(nn.Sequential(kind(3)))[0]
        assert isinstance(again, kind) and type(again) is type(norm)


def test_the_converted_layer_keeps_the_batch_norms_hooks_and_their_handles():
    """Review (helper-144): conversion built a new layer and moved only parameters and buffers,
    so a forward hook (activation logging) on a batch norm stopped being called."""
    calls: List[str] = []
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    forward = model[1].register_forward_hook(lambda module, args, output: calls.append("forward"))
    model[1].register_forward_pre_hook(lambda module, args: calls.append("pre"))
    model[1].register_full_backward_hook(lambda module, grad_input, grad_output: calls.append("backward"))
    model[1].register_state_dict_post_hook(lambda module, state, prefix, local: calls.append("state_dict"))
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=2)
    assert isinstance(converted[1], DeferredBatchNorm)
    converted(torch.randn(4, 4)).sum().backward()
    converted.state_dict()
    assert calls == ["pre", "forward", "backward", "state_dict"]
    forward.remove()  # the user's handle still reaches the hook
    calls.clear()
    converted(torch.randn(4, 4))
    assert calls == ["pre"]


def test_a_load_state_dict_pre_hook_of_the_batch_norm_is_called_with_the_converted_layer():
    """Review (helper-146): the public load_state_dict pre-hook holds its module weakly; carried
    over as it was, it called the hook with the replaced batch norm, and once that was gone
    load_state_dict raised "You are trying to call the hook of a dead Module!"."""
    import gc

    seen: List[str] = []
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].register_load_state_dict_pre_hook(lambda module, *args: seen.append(type(module).__name__))
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=2)
    gc.collect()  # the replaced batch norm is gone
    converted.load_state_dict(converted.state_dict())
    assert seen == ["DeferredBatchNorm1d"]


class _HalvedBatchNorm(nn.BatchNorm1d):
    def forward(self, input):
        return super().forward(input) * 0.5


def _weight_normed_batch_norm():
    with pytest.warns(FutureWarning):  # torch.nn.utils.weight_norm is deprecated, and still used
        return torch.nn.utils.weight_norm(nn.BatchNorm1d(4), dim=None)


@pytest.mark.parametrize("norm, words", [
    (lambda: _HalvedBatchNorm(4), "_HalvedBatchNorm has a forward of its own"),
    (lambda: nn.SyncBatchNorm(4), "SyncBatchNorm has a forward of its own.*span the processes"),
    (_weight_normed_batch_norm, "its weight is computed from other parameters"),
])
def test_a_batch_norm_whose_forward_or_weight_conversion_would_drop_is_refused(norm, words):
    """Review (helper-144): a subclass's own forward was replaced by the deferred one (other
    outputs than the plain model's), and a weight_norm'd batch norm failed in torch's setattr
    naming no layer."""
    model = nn.Sequential(nn.Linear(4, 4), norm())
    kind = type(model[1])
    with pytest.raises(ValueError, match=f"cannot convert the {kind.__name__} '1': {words}"):
        DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=2)
    assert type(model[1]) is kind  # refused before anything was replaced
