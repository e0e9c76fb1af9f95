"""Pipe(..., batch_dim=, output_batch_dim=, target_batch_dim=): micro-batches along any dim.

Every case runs the same nn.Sequential plainly (a deepcopy) and compares outputs, the loss
and every gradient, parameters and inputs, in float64.
"""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from torchpipe import Pipe

T, N, D, H, C = 5, 10, 3, 4, 3  # time steps, samples (10: 4 chunks give 3, 3, 3, 1), widths, classes
RTOL, ATOL = 1e-9, 1e-12
SCHEDULES = [
    ("gpipe", {}, [2, 2, 2]),
    ("1f1b", {}, [3, 3]),
    ("1f1b", {}, [2, 1, 2, 1]),
    ("zb-h1", {}, [2, 2, 2]),
    ("interleaved-1f1b", {"virtual_stages": 2}, [2, 1, 2, 1]),
    ("zb-v", {}, [2, 1, 2, 1]),
]
CHECKPOINTS = ["never", "except_last", "always"]


# ---------------------------------------------------------------- layers
class CumTime(nn.Module):
    """Mixes along time (dim 0): a running sum, scaled per step by a learned weight."""

    def __init__(self, steps=T):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, steps).reshape(steps, 1, 1))

    def forward(self, x):
        return x.cumsum(0) * self.scale[: x.size(0)] / torch.arange(1, x.size(0) + 1, dtype=x.dtype, device=x.device).reshape(-1, 1, 1)


class LSTMOut(nn.Module):
    """A sequence-first LSTM (batch_first=False) that returns only its output tensor."""

    def __init__(self, width_in, width_out):
        super().__init__()
        self.lstm = nn.LSTM(width_in, width_out)

    def forward(self, x):
        return self.lstm(x)[0]


class MeanTime(nn.Module):
    def forward(self, x):
        return x.mean(0)  # (T, N, H) -> (N, H)


class Transpose01(nn.Module):
    def forward(self, x):
        return x.transpose(0, 1)


class MaskedMix(nn.Module):
    """(src, mask) -> (mask @ linear(src) along time, mask): the (T, T) mask is shared by every sample."""

    def __init__(self, width_in, width_out):
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)

    def forward(self, inputs):
        src, mask = inputs
        assert mask.shape == (T, T), mask.shape
        return torch.einsum("ts,snh->tnh", mask, self.linear(src)), mask


class OnFirst(nn.Module):
    """Applies a module to item 0 of a tuple; the other items pass through."""

    def __init__(self, module):
        super().__init__()
        self.inner = module

    def forward(self, inputs):
        return (self.inner(inputs[0]),) + tuple(inputs[1:])


class First(nn.Module):
    def forward(self, inputs):
        return inputs[0] if isinstance(inputs, tuple) else inputs


class TableIn(nn.Module):
    """(x, table) -> (tanh(x @ table), table): a learned table that comes with the input."""

    def forward(self, inputs):
        x, table = inputs
        assert table.shape == (D, H), table.shape
        return torch.tanh(x @ table), table


class TableOut(nn.Module):
    def forward(self, inputs):
        h, table = inputs
        return h @ table.t()


class Record(nn.Module):
    """Identity that records what it is given (checkpoint='never': one call per micro-batch)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, inputs):
        self.seen.append(inputs)
        return inputs


# ---------------------------------------------------------------- models and helpers
def seq_model():
    """(T, N, D) -> (T, N, D), batch at dim 1: every layer but the Linears mixes along time."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), CumTime(), LSTMOut(H, H), nn.Tanh(), nn.Linear(H, D)).double()


def masked_model(keep_mask):
    """(src (T, N, D), mask (T, T)) -> (T, N, D), or (that, mask) with keep_mask."""
    torch.manual_seed(0)
    layers = [MaskedMix(D, H), OnFirst(nn.Tanh()), MaskedMix(H, H), OnFirst(LSTMOut(H, H))]
    layers += [OnFirst(nn.Linear(H, D))] if keep_mask else [First(), nn.Linear(H, D)]
    return nn.Sequential(*layers).double()


def table_model():
    torch.manual_seed(0)
    return nn.Sequential(TableIn(), OnFirst(CumTime()), OnFirst(LSTMOut(H, H)), TableOut()).double()


def pooled_model():
    """(T, N, D) -> (N, C) logits."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), LSTMOut(H, H), MeanTime(), nn.Linear(H, C)).double()


def tagger_model(transpose):
    """(T, N, D) -> per-step logits, (T, N, C), or (N, T, C) with transpose."""
    torch.manual_seed(0)
    layers = [nn.Linear(D, H), LSTMOut(H, H), nn.Linear(H, C)] + ([Transpose01()] if transpose else [])
    return nn.Sequential(*layers).double()


def seq_input(requires_grad=False, n=N):
    return torch.randn(T, n, D, dtype=torch.float64, requires_grad=requires_grad)


def causal_mask():
    return torch.tril(torch.ones(T, T, dtype=torch.float64)) / torch.arange(1, T + 1, dtype=torch.float64)[:, None]


def same(got, want, exact, msg=None):
    if exact:
        assert torch.equal(got, want), msg
    else:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=msg)


def same_grads(model, reference, exact=False):
    for (name, param), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        assert param.grad is not None and ref.grad is not None, name
        same(param.grad, ref.grad, exact, msg=name)


def no_grads(model):
    return all(p.grad is None for p in model.parameters())


def leaf_like(x):
    return x.detach().clone().requires_grad_(x.requires_grad)


def mse(output, target):
    return F.mse_loss(output, target)


def pipe_kwargs(chunks, checkpoint, exact):
    kwargs = {"chunks": chunks, "checkpoint": checkpoint}
    if exact:  # the caller's intra-op threads: the same arithmetic as the plain model
        kwargs["intra_op_threads"] = torch.get_num_threads()
    return kwargs


# ---------------------------------------------------------------- 1. sequence-first model
@pytest.mark.parametrize("balance", [[3, 3], [2, 2, 2], [2, 1, 2, 1]])
@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_sequence_first_forward_and_backward_match_the_plain_model(balance, chunks, checkpoint):
    model = seq_model()
    reference = copy.deepcopy(model)
    x = seq_input(requires_grad=True)
    x_ref = leaf_like(x)
    weight = torch.randn(T, N, D, dtype=torch.float64)
    exact = chunks == 1 and checkpoint == "never"
    expected = reference(x_ref)
    (expected * weight).sum().backward()
    with Pipe(model, balance, batch_dim=1, **pipe_kwargs(chunks, checkpoint, exact)) as pipe:
        out = pipe(x)
        assert out.shape == (T, N, D)
        same(out, expected, exact)
        (out * weight).sum().backward()
    same(x.grad, x_ref.grad, exact)
    same_grads(model, reference, exact)


@pytest.mark.parametrize("schedule,options,balance", SCHEDULES)
@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_sequence_first_step_matches_the_plain_model(schedule, options, balance, chunks, checkpoint):
    model = seq_model()
    reference = copy.deepcopy(model)
    x, y = seq_input(requires_grad=True), torch.randn(T, N, D, dtype=torch.float64)
    x_ref = leaf_like(x)
    exact = chunks == 1 and checkpoint == "never"
    expected = mse(reference(x_ref), y)
    expected.backward()
    with Pipe(model, balance, batch_dim=1, **pipe_kwargs(chunks, checkpoint, exact)) as pipe:
        loss = pipe.step(x, y, mse, schedule=schedule, **options)
    same(loss, expected.detach(), exact)
    same(x.grad, x_ref.grad, exact)
    same_grads(model, reference, exact)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("schedule,options,balance", [SCHEDULES[1], SCHEDULES[5]])
def test_step_reduction_losses_and_outputs_follow_the_batch_dim(reduction, schedule, options, balance):
    # 10 samples in 4 micro-batches of 3, 3, 3, 1 along dim 1 (and 5 along dim 0 in every one):
    # under 'mean' each micro-batch weighs its share of samples along dim 1, not dim 0.
    model = seq_model()
    reference = copy.deepcopy(model)
    x, y = seq_input(), torch.randn(T, N, D, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction=reduction)
    expected_out = reference(x)
    expected = loss_fn(expected_out, y)
    expected.backward()
    losses = []
    with Pipe(model, balance, chunks=4, checkpoint="except_last", batch_dim=1) as pipe:
        loss, out = pipe.step(x, y, loss_fn, schedule=schedule, return_outputs=True, losses=losses, **options)
    same(loss, expected.detach(), False)
    same(out, expected_out.detach(), False)
    same_grads(model, reference)
    assert len(losses) == 4
    parts = torch.arange(N).chunk(4)
    for got, part in zip(losses, parts):
        with torch.no_grad():
            same(got, loss_fn(reference(x[:, part]), y[:, part]), False)


@pytest.mark.parametrize("n,chunks,schedule,balance", [(2, 4, "1f1b", [2, 2, 2]), (7, 3, "zb-v", [2, 1, 2, 1])])
def test_fewer_samples_along_the_batch_dim_than_chunks_or_a_ragged_split(n, chunks, schedule, balance):
    # 2 samples in 4 chunks give 2 micro-batches (T = 5 along dim 0 must not count); 7 in 3 give 3, 3, 1.
    model = seq_model()
    reference = copy.deepcopy(model)
    x, y = seq_input(requires_grad=True, n=n), torch.randn(T, n, D, dtype=torch.float64)
    x_ref = leaf_like(x)
    expected = mse(reference(x_ref), y)
    expected.backward()
    losses = []
    with Pipe(model, balance, chunks=chunks, checkpoint="except_last", batch_dim=1) as pipe:
        loss = pipe.step(x, y, mse, schedule=schedule, losses=losses)
    assert len(losses) == len(torch.empty(n).chunk(chunks))
    same(loss, expected.detach(), False)
    same(x.grad, x_ref.grad, False)
    same_grads(model, reference)


def test_negative_batch_dim_counts_from_the_end():
    model = seq_model()
    reference = copy.deepcopy(model)
    x, y = seq_input(requires_grad=True), torch.randn(T, N, D, dtype=torch.float64)
    x_ref = leaf_like(x)
    weight = torch.randn(T, N, D, dtype=torch.float64)
    expected = reference(x_ref)
    (expected * weight).sum().backward()
    with Pipe(model, [2, 2, 2], chunks=4, checkpoint="except_last", batch_dim=-2, output_batch_dim=-2,
              target_batch_dim=-2) as pipe:
        assert pipe.batch_dim == -2
        out = pipe(x)
        same(out, expected, False)
        (out * weight).sum().backward()
        same(x.grad, x_ref.grad, False)
        same_grads(model, reference)

        for p in list(model.parameters()) + list(reference.parameters()):
            p.grad = None
        expected_loss = mse(reference(x), y)
        expected_loss.backward()
        loss = pipe.step(x.detach(), y, mse, schedule="1f1b")
    same(loss, expected_loss.detach(), False)
    same_grads(model, reference)


def test_negative_entries_of_a_tuple_spec():
    model = masked_model(keep_mask=False)
    reference = copy.deepcopy(model)
    src, mask = seq_input(requires_grad=True), causal_mask()
    src_ref = leaf_like(src)
    expected = reference((src_ref, mask))
    expected.pow(2).sum().backward()
    with Pipe(model, [3, 3], chunks=3, checkpoint="always", batch_dim=(-2, None),
              output_batch_dim=1) as pipe:
        out = pipe((src, mask))
        same(out, expected, False)
        out.pow(2).sum().backward()
    same(src.grad, src_ref.grad, False)
    same_grads(model, reference)


# ---------------------------------------------------------------- micro-batch shapes
def _shapes(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in value)


@pytest.mark.parametrize("dims,make_input,expected", [
    ({"batch_dim": 1}, lambda: torch.randn(T, N, D), [(T, 3, D)] * 3 + [(T, 1, D)]),
    ({"batch_dim": -2, "output_batch_dim": 1}, lambda: torch.randn(T, N, D), [(T, 3, D)] * 3 + [(T, 1, D)]),
    ({"batch_dim": 2}, lambda: torch.randn(2, 3, N), [(2, 3, 3)] * 3 + [(2, 3, 1)]),
    ({"batch_dim": -1, "output_batch_dim": -1, "target_batch_dim": 0}, lambda: torch.randn(2, 3, N),
     [(2, 3, 3)] * 3 + [(2, 3, 1)]),
    ({"batch_dim": 1}, lambda: (torch.randn(T, N, D), "tag", torch.randn(2, N)),
     [((T, 3, D), "tag", (2, 3))] * 3 + [((T, 1, D), "tag", (2, 1))]),
    ({"batch_dim": (1, None, None), "output_batch_dim": (1, None, None)},
     lambda: (torch.randn(T, N, D), torch.randn(T, T), "tag"),
     [((T, 3, D), (T, T), "tag")] * 3 + [((T, 1, D), (T, T), "tag")]),
    ({"batch_dim": (1, 0), "output_batch_dim": (1, 0), "target_batch_dim": 0},
     lambda: (torch.randn(T, N, D), torch.arange(N)),
     [((T, 3, D), (3,))] * 3 + [((T, 1, D), (1,))]),
])
def test_microbatches_are_chunks_along_each_items_batch_dim(dims, make_input, expected):
    x = make_input()
    record = Record()
    with Pipe(nn.Sequential(record, nn.Identity()), [1, 1], chunks=4, checkpoint="never", **dims) as pipe:
        out = pipe(x)
    assert [_shapes(v) for v in record.seen] == expected
    # The identity model gives its input back: gathered along the same dims, or taken whole.
    for got, want in zip(out if isinstance(x, tuple) else (out,), x if isinstance(x, tuple) else (x,)):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert got == want


def test_replicated_items_are_the_callers_tensor_in_every_microbatch():
    record = Record()
    src, mask = torch.randn(T, N, D), torch.randn(T, T)
    with Pipe(nn.Sequential(record, First()), [1, 1], chunks=4, checkpoint="never", batch_dim=(1, None),
              output_batch_dim=1) as pipe:
        pipe((src, mask))
    assert len(record.seen) == 4
    for _, seen_mask in record.seen:
        assert torch.equal(seen_mask, mask) and seen_mask.data_ptr() == mask.data_ptr()


@pytest.mark.parametrize("batch_dim", [1, (1, None)])
def test_one_chunk_passes_the_input_as_it_is(batch_dim):
    record = Record()
    src, mask = torch.randn(T, N, D), torch.randn(T, T)
    x = src if batch_dim == 1 else (src, mask)
    with Pipe(nn.Sequential(record, First()), [1, 1], chunks=1, checkpoint="never", batch_dim=batch_dim,
              output_batch_dim=1) as pipe:
        out = pipe(x)
    assert len(record.seen) == 1
    seen = record.seen[0] if isinstance(record.seen[0], tuple) else (record.seen[0],)
    for got, want in zip(seen, x if isinstance(x, tuple) else (x,)):
        assert got is want
    assert torch.equal(out, src)


# ---------------------------------------------------------------- 2. replicated mask
@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_replicated_mask_goes_whole_to_every_microbatch(chunks, checkpoint):
    model = masked_model(keep_mask=False)
    reference = copy.deepcopy(model)
    src, mask = seq_input(requires_grad=True), causal_mask()
    src_ref = leaf_like(src)
    weight = torch.randn(T, N, D, dtype=torch.float64)
    exact = chunks == 1 and checkpoint == "never"
    expected = reference((src_ref, mask))
    (expected * weight).sum().backward()
    with Pipe(model, [1, 2, 3], batch_dim=(1, None), output_batch_dim=1,
              **pipe_kwargs(chunks, checkpoint, exact)) as pipe:
        out = pipe((src, mask))
        assert out.shape == (T, N, D)
        same(out, expected, exact)
        (out * weight).sum().backward()
    same(src.grad, src_ref.grad, exact)
    same_grads(model, reference, exact)


@pytest.mark.parametrize("schedule,options,balance", [
    ("1f1b", {}, [3, 3]),
    ("zb-h1", {}, [1, 2, 3]),
    ("interleaved-1f1b", {"virtual_stages": 2}, [1, 2, 2, 1]),
    ("zb-v", {}, [1, 2, 2, 1]),
])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_replicated_mask_under_step(schedule, options, balance, checkpoint):
    model = masked_model(keep_mask=False)
    reference = copy.deepcopy(model)
    src, mask, y = seq_input(requires_grad=True), causal_mask(), torch.randn(T, N, D, dtype=torch.float64)
    src_ref = leaf_like(src)
    expected_out = reference((src_ref, mask))
    expected = mse(expected_out, y)
    expected.backward()
    with Pipe(model, balance, chunks=4, checkpoint=checkpoint, batch_dim=(1, None), output_batch_dim=1) as pipe:
        loss, out = pipe.step((src, mask), y, mse, schedule=schedule, return_outputs=True, **options)
    same(loss, expected.detach(), False)
    same(out, expected_out.detach(), False)
    same(src.grad, src_ref.grad, False)
    same_grads(model, reference)


def _first_mse(output, target):
    return F.mse_loss(output[0], target)


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_replicated_output_item_is_taken_from_the_first_microbatch(chunks):
    # The model returns (h, mask): h is concatenated along dim 1, the mask is the same in
    # every micro-batch and comes back once (output_batch_dim entry None).
    model = masked_model(keep_mask=True)
    reference = copy.deepcopy(model)
    src, mask, y = seq_input(), causal_mask(), torch.randn(T, N, D, dtype=torch.float64)
    expected_h, expected_mask = reference((src, mask))
    expected = _first_mse((expected_h, expected_mask), y)
    expected.backward()
    with Pipe(model, [2, 3], chunks=chunks, checkpoint="except_last", batch_dim=(1, None),
              output_batch_dim=(1, None)) as pipe:
        with torch.no_grad():
            h, out_mask = pipe((src, mask))
        same(h, expected_h.detach(), False)
        assert torch.equal(out_mask, mask)
        loss, (h, out_mask) = pipe.step((src, mask), y, _first_mse, return_outputs=True)
    same(loss, expected.detach(), False)
    same(h, expected_h.detach(), False)
    assert torch.equal(out_mask, mask)
    same_grads(model, reference)


# ---------------------------------------------------------------- 3. outputs and targets on other dims
@pytest.mark.parametrize("schedule,options,chunks", [
    ("gpipe", {}, 1), ("gpipe", {}, 4), ("1f1b", {}, 4), ("zb-h1", {}, 4),
    ("interleaved-1f1b", {"virtual_stages": 2}, 4), ("zb-v", {}, 4),
])
@pytest.mark.parametrize("ignored", [False, True])
def test_pooled_output_on_dim_0_with_cross_entropy(schedule, options, chunks, ignored):
    model = pooled_model()
    reference = copy.deepcopy(model)
    x, y = seq_input(requires_grad=True), torch.randint(0, C, (N,))
    if ignored:  # CrossEntropyLoss averages over the targets it counts: micro-batches weigh those
        y[1] = y[2] = y[7] = -100
    x_ref = leaf_like(x)
    expected_out = reference(x_ref)
    expected = nn.CrossEntropyLoss()(expected_out, y)
    expected.backward()
    with Pipe(model, [1, 1, 1, 1], chunks=chunks, checkpoint="except_last", batch_dim=1, output_batch_dim=0) as pipe:
        assert pipe.output_batch_dim == 0
        with torch.no_grad():
            same(pipe(x), expected_out.detach(), False)
        loss, out = pipe.step(x, y, nn.CrossEntropyLoss(), schedule=schedule, return_outputs=True, **options)
    assert out.shape == (N, C)
    same(loss, expected.detach(), False)
    same(out, expected_out.detach(), False)
    same(x.grad, x_ref.grad, False)
    same_grads(model, reference)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_pooled_output_forward_and_backward(checkpoint):
    model = pooled_model()
    reference = copy.deepcopy(model)
    x = seq_input(requires_grad=True)
    x_ref = leaf_like(x)
    weight = torch.randn(N, C, dtype=torch.float64)
    expected = reference(x_ref)
    (expected * weight).sum().backward()
    with Pipe(model, [2, 2], chunks=3, checkpoint=checkpoint, batch_dim=1, output_batch_dim=0) as pipe:
        out = pipe(x)
        same(out, expected, False)
        (out * weight).sum().backward()
    same(x.grad, x_ref.grad, False)
    same_grads(model, reference)


def _flat_cross_entropy_nt(output, target):
    # output (N, T, C), target (T, N) class indices
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.t().reshape(-1))


def _flat_cross_entropy_tn(output, target):
    # output (T, N, C), target (T, N) class indices
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


@pytest.mark.parametrize("transpose,dims", [
    (True, {"output_batch_dim": 0, "target_batch_dim": 1}),  # three different dims: input 1, output 0, target 1
    (False, {"target_batch_dim": 1}),
    (False, {}),  # the target follows the output, which follows the input: dim 1
])
@pytest.mark.parametrize("schedule,options", [("1f1b", {}), ("zb-v", {})])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_per_step_targets_split_along_their_own_batch_dim(transpose, dims, schedule, options, checkpoint):
    model = tagger_model(transpose)
    reference = copy.deepcopy(model)
    loss_fn = _flat_cross_entropy_nt if transpose else _flat_cross_entropy_tn
    x, y = seq_input(requires_grad=True), torch.randint(0, C, (T, N))
    x_ref = leaf_like(x)
    expected_out = reference(x_ref)
    expected = loss_fn(expected_out, y)
    expected.backward()
    balance = [1, 1, 1, 1] if transpose else [1, 1, 1]
    if schedule == "zb-v" and not transpose:
        model.append(nn.Identity())
        reference.append(nn.Identity())
        balance = [1, 1, 1, 1]
    with Pipe(model, balance, chunks=4, checkpoint=checkpoint, batch_dim=1, **dims) as pipe:
        loss, out = pipe.step(x, y, loss_fn, schedule=schedule, return_outputs=True, **options)
    same(loss, expected.detach(), False)
    same(out, expected_out.detach(), False)
    same(x.grad, x_ref.grad, False)
    same_grads(model, reference)


def _weighted_mse(output, target):
    y, per_step = target
    assert per_step.shape == (T,), per_step.shape
    return ((output - y).pow(2) * per_step[:, None, None]).mean()


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_target_tuple_with_a_replicated_item(chunks):
    model = seq_model()
    reference = copy.deepcopy(model)
    x, y = seq_input(), torch.randn(T, N, D, dtype=torch.float64)
    per_step = torch.rand(T, dtype=torch.float64)
    expected = _weighted_mse(reference(x), (y, per_step))
    expected.backward()
    with Pipe(model, [3, 3], chunks=chunks, checkpoint="except_last", batch_dim=1,
              target_batch_dim=(1, None)) as pipe:
        loss = pipe.step(x, (y, per_step), _weighted_mse)
    same(loss, expected.detach(), False)
    same_grads(model, reference)


# ---------------------------------------------------------------- 4. a replicated tensor that requires grad
def _table(derived):
    """The table and the leaf its gradient lands on: itself, or a tensor upstream of it."""
    base = torch.randn(D, H, dtype=torch.float64, requires_grad=True)
    return (base * 1.5, base) if derived else (base, base)


@pytest.mark.parametrize("derived", [False, True])
@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_replicated_table_gets_the_plain_models_gradient_in_forward_backward(derived, chunks, checkpoint):
    model = table_model()
    reference = copy.deepcopy(model)
    x = seq_input(requires_grad=True)
    x_ref = leaf_like(x)
    table, leaf = _table(derived)
    leaf_ref = leaf.detach().clone().requires_grad_()
    table_ref = leaf_ref * 1.5 if derived else leaf_ref
    weight = torch.randn(T, N, D, dtype=torch.float64)
    exact = chunks == 1 and checkpoint == "never"
    expected = reference((x_ref, table_ref))
    (expected * weight).sum().backward()
    with Pipe(model, [1, 1, 2], batch_dim=(1, None), output_batch_dim=1,
              **pipe_kwargs(chunks, checkpoint, exact)) as pipe:
        out = pipe((x, table))
        same(out, expected, exact)
        (out * weight).sum().backward()
    same(leaf.grad, leaf_ref.grad, exact)
    same(x.grad, x_ref.grad, exact)
    same_grads(model, reference, exact)


@pytest.mark.parametrize("schedule,options,balance,derived", [
    ("gpipe", {}, [1, 1, 2], False),
    ("1f1b", {}, [1, 1, 1, 1], False),
    ("1f1b", {}, [1, 1, 1, 1], True),  # the table is computed upstream: its gradient goes on up
    ("zb-h1", {}, [2, 2], False),
    ("interleaved-1f1b", {"virtual_stages": 2}, [1, 1, 1, 1], False),
    ("zb-v", {}, [1, 1, 1, 1], False),
    ("zb-v", {}, [1, 1, 1, 1], True),
])
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_replicated_table_gets_the_plain_models_gradient_under_step(schedule, options, balance, derived, checkpoint):
    model = table_model()
    reference = copy.deepcopy(model)
    x, y = seq_input(requires_grad=True), torch.randn(T, N, D, dtype=torch.float64)
    x_ref = leaf_like(x)
    table, leaf = _table(derived)
    leaf_ref = leaf.detach().clone().requires_grad_()
    table_ref = leaf_ref * 1.5 if derived else leaf_ref
    expected = mse(reference((x_ref, table_ref)), y)
    expected.backward()
    with Pipe(model, balance, chunks=4, checkpoint=checkpoint, batch_dim=(1, None), output_batch_dim=1) as pipe:
        loss = pipe.step((x, table), y, mse, schedule=schedule, **options)
    same(loss, expected.detach(), False)
    same(leaf.grad, leaf_ref.grad, False)
    same(x.grad, x_ref.grad, False)
    same_grads(model, reference)


# ---------------------------------------------------------------- 5. errors
def test_the_constructor_accepts_every_form_of_spec():
    for kwargs in ({"batch_dim": 1}, {"batch_dim": -2, "output_batch_dim": 1},
                   {"batch_dim": -2, "output_batch_dim": -2, "target_batch_dim": 1},
                   {"batch_dim": (1, None), "output_batch_dim": 1}, {"batch_dim": (None, 1, None), "output_batch_dim": 0},
                   {"batch_dim": 1, "output_batch_dim": 0}, {"batch_dim": 1, "output_batch_dim": (1, None)},
                   {"batch_dim": (0, 1), "output_batch_dim": 0},
                   {"batch_dim": (0, 1), "output_batch_dim": (0, 1), "target_batch_dim": 1},
                   {"batch_dim": 1, "target_batch_dim": (1, None)}):
        with Pipe(nn.Sequential(nn.Identity(), nn.Identity()), [1, 1], chunks=2, **kwargs):
            pass


@pytest.mark.parametrize("kwargs,error,match", [
    ({"batch_dim": True}, TypeError, None),
    ({"batch_dim": False}, TypeError, None),
    ({"batch_dim": (1, True)}, TypeError, None),
    ({"batch_dim": 1.0}, TypeError, None),
    ({"batch_dim": "1"}, TypeError, None),
    ({"batch_dim": 1, "output_batch_dim": True}, TypeError, None),
    ({"batch_dim": 1, "output_batch_dim": (0, 1.5)}, TypeError, None),
    ({"batch_dim": 1, "target_batch_dim": True}, TypeError, None),
    ({"batch_dim": 1, "target_batch_dim": "0"}, TypeError, None),
    ({"batch_dim": (0, 1)}, ValueError, "output_batch_dim"),
    ({"batch_dim": (0, None, 1)}, ValueError, "output_batch_dim"),
    ({"batch_dim": (1, None)}, ValueError, "output_batch_dim"),  # the mask may come out, or not
    ({"batch_dim": (1, 1)}, ValueError, "output_batch_dim"),
    ({"batch_dim": -2}, ValueError, "counts from the end"),  # -2 of a (T, N) target is its dim 0
    ({"batch_dim": 1, "output_batch_dim": -1}, ValueError, "target_batch_dim"),
    ({"batch_dim": 1, "output_batch_dim": (0, 1)}, ValueError, "target_batch_dim"),
])
def test_the_constructor_refuses_bad_specs(kwargs, error, match):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(error, match=match) as raised:
        Pipe(model, [1, 1], chunks=2, **kwargs)
    assert "unexpected keyword" not in str(raised.value)
    with Pipe(model, [1, 1], chunks=2, batch_dim=1) as pipe:  # the model is still usable
        assert pipe(torch.randn(3, 4, 2)).shape == (3, 4, 2)


def _tuple_model():
    """Takes a tensor or a tuple (item 0 is the (T, N, D) input), returns (T, N, D)."""
    torch.manual_seed(0)
    return nn.Sequential(First(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).double()


def _x(n=N):
    return torch.randn(T, n, D, dtype=torch.float64)


INPUT_ERRORS = [
    # (pipe kwargs, bad input, good input, error, words the message must hold)
    ({"batch_dim": 1}, lambda: (_x(), _x(7)), lambda: (_x(), _x()), ValueError, ["10", "7"]),
    ({"batch_dim": (1, 0), "output_batch_dim": 1}, lambda: (_x(), torch.zeros(7)), lambda: (_x(), torch.zeros(N)),
     ValueError, ["10", "7"]),
    ({"batch_dim": (1, None), "output_batch_dim": 1}, lambda: (_x(), causal_mask(), causal_mask()), lambda: (_x(), causal_mask()),
     ValueError, []),
    ({"batch_dim": (1, None, None), "output_batch_dim": 1}, lambda: (_x(), causal_mask()), lambda: (_x(), causal_mask(), "tag"),
     ValueError, []),
    ({"batch_dim": (1, 0), "output_batch_dim": 1}, lambda: (_x(), "tag"), lambda: (_x(), torch.zeros(N)),
     TypeError, []),
    ({"batch_dim": 7}, lambda: _x(), lambda: torch.randn(1, 1, 1, 1, 1, 1, 1, N, D, dtype=torch.float64),
     ValueError, ["7"]),
    ({"batch_dim": -4, "output_batch_dim": 0}, lambda: _x(), lambda: torch.randn(N, T, T, D, dtype=torch.float64),
     ValueError, ["-4"]),
    ({"batch_dim": (1, 2), "output_batch_dim": 1}, lambda: (_x(), causal_mask()),
     lambda: (_x(), torch.zeros(T, T, N)), ValueError, ["2"]),
]


@pytest.mark.parametrize("kwargs,bad,good,error,words", INPUT_ERRORS)
@pytest.mark.parametrize("call", ["forward", "step"])
def test_bad_inputs_are_refused_before_anything_runs(kwargs, bad, good, error, words, call):
    model = _tuple_model()
    with Pipe(model, [2, 2], chunks=4, checkpoint="except_last", **kwargs) as pipe:
        with pytest.raises(error) as raised:
            if call == "forward":
                pipe(bad())
            else:
                pipe.step(bad(), torch.zeros(T, N, D, dtype=torch.float64), mse)
        for word in words:
            assert word in str(raised.value), (word, str(raised.value))
        assert pipe.last_step is None and no_grads(model)
        # The Pipe still works, and as the plain model does.
        good_input = good()
        reference = copy.deepcopy(model)
        expected = reference(good_input)
        out = pipe(good_input)
        same(out, expected, False)


TARGET_ERRORS = [
    # (pipe kwargs, bad target, error, words)
    ({"batch_dim": 1}, lambda: torch.zeros(T, 7, D), ValueError, ["10", "7"]),
    ({"batch_dim": 1}, lambda: torch.zeros(N), ValueError, ["out of range", "(10,)"]),
    ({"batch_dim": 1, "target_batch_dim": 0}, lambda: torch.zeros(T, N, D), ValueError, ["10"]),
    ({"batch_dim": 1, "target_batch_dim": 3}, lambda: torch.zeros(T, N, D), ValueError, ["3"]),
    ({"batch_dim": 1, "target_batch_dim": (1, 0)}, lambda: (torch.zeros(T, N, D), torch.zeros(7)), ValueError,
     ["10", "7"]),
    ({"batch_dim": 1, "target_batch_dim": (1, None)}, lambda: (torch.zeros(T, N, D),), ValueError,
     ["2 entries", "1 items"]),
]


@pytest.mark.parametrize("kwargs,bad,error,words", TARGET_ERRORS)
def test_bad_targets_are_refused_before_anything_runs(kwargs, bad, error, words):
    model = _tuple_model()

    def loss_fn(output, target):
        return mse(output, target[0] if isinstance(target, tuple) else target)

    with Pipe(model, [2, 2], chunks=4, checkpoint="except_last", **kwargs) as pipe:
        x = _x()
        with pytest.raises(error) as raised:
            pipe.step(x, bad(), loss_fn)
        for word in words:
            assert word in str(raised.value), (word, str(raised.value))
        assert pipe.last_step is None and no_grads(model)
        pipe.target_batch_dim = 1
        reference = copy.deepcopy(model)
        y = torch.randn(T, N, D, dtype=torch.float64)
        expected = mse(reference(x), y)
        expected.backward()
        loss = pipe.step(x, y, loss_fn)
    same(loss, expected.detach(), False)
    same_grads(model, reference)


# ---------------------------------------------------------------- 6. the settings may change between calls
def test_setting_batch_dim_between_calls_changes_the_split():
    model = seq_model()
    reference = copy.deepcopy(model)
    x, y = seq_input(), torch.randn(T, N, D, dtype=torch.float64)
    with torch.no_grad():
        expected = reference(x)
    with Pipe(model, [2, 2, 2], chunks=4, checkpoint="except_last") as pipe:
        assert pipe.batch_dim == 0
        with torch.no_grad():
            along_time = pipe(x)  # split along dim 0 (time): the running sum and the LSTM restart
        assert along_time.shape == expected.shape and not torch.allclose(along_time, expected)
        pipe.batch_dim = 1  # output_batch_dim and target_batch_dim were left to follow it
        assert pipe.batch_dim == 1
        with torch.no_grad():
            same(pipe(x), expected, False)
        expected_loss = mse(reference(x), y)
        expected_loss.backward()
        loss = pipe.step(x, y, mse)
        same(loss, expected_loss.detach(), False)
        same_grads(model, reference)


def test_setting_every_dim_between_calls():
    model = tagger_model(transpose=True)  # (T, N, D) -> (N, T, C)
    reference = copy.deepcopy(model)
    x, y = seq_input(), torch.randint(0, C, (T, N))
    expected_out = reference(x)
    expected = _flat_cross_entropy_nt(expected_out, y)
    expected.backward()
    with Pipe(model, [2, 2], chunks=4, checkpoint="never") as pipe:
        pipe.batch_dim = 1
        pipe.output_batch_dim = 0
        pipe.target_batch_dim = 1
        assert (pipe.batch_dim, pipe.output_batch_dim, pipe.target_batch_dim) == (1, 0, 1)
        with torch.no_grad():
            same(pipe(x), expected_out.detach(), False)
        loss, out = pipe.step(x, y, _flat_cross_entropy_nt, return_outputs=True)
        same(loss, expected.detach(), False)
        same(out, expected_out.detach(), False)
        same_grads(model, reference)


def test_setting_a_badly_typed_value_is_refused_and_keeps_the_old_one():
    model = seq_model()
    reference = copy.deepcopy(model)
    x = seq_input()
    with Pipe(model, [3, 3], chunks=4, checkpoint="never", batch_dim=1) as pipe:
        for name, value in [("batch_dim", True), ("batch_dim", 1.0), ("batch_dim", "1"), ("batch_dim", (1, False)),
                            ("output_batch_dim", False), ("output_batch_dim", [1.0]),
                            ("target_batch_dim", True), ("target_batch_dim", 0.5)]:
            with pytest.raises(TypeError):
                setattr(pipe, name, value)
        with pytest.raises(ValueError, match="output_batch_dim"):
            pipe.batch_dim = (0, 1)  # well typed, but the output, left to follow it, cannot
        assert pipe.batch_dim == 1
        with torch.no_grad():
            same(pipe(x), reference(x), False)
        # Nothing of the refused values stayed behind: the other settings can still be set.
        pipe.output_batch_dim = 1
        pipe.target_batch_dim = 1
        assert (pipe.batch_dim, pipe.output_batch_dim, pipe.target_batch_dim) == (1, 1, 1)
        with torch.no_grad():
            same(pipe(x), reference(x), False)


def test_an_output_batch_dim_out_of_range_is_refused_and_can_be_fixed():
    model = seq_model()
    reference = copy.deepcopy(model)
    x, y = seq_input(), torch.randn(T, N, D, dtype=torch.float64)
    expected_out = reference(x)
    expected = mse(expected_out, y)
    expected.backward()
    with Pipe(model, [3, 3], chunks=4, checkpoint="except_last", batch_dim=1, output_batch_dim=5,
              target_batch_dim=1) as pipe:
        with pytest.raises(ValueError, match="output_batch_dim 5 is out of range"):
            pipe(x)
        with pytest.raises(ValueError, match="output_batch_dim 5 is out of range"):
            pipe.step(x, y, mse, return_outputs=True)
        assert no_grads(model)  # the failed step left no gradients
        pipe.output_batch_dim = 1
        loss, out = pipe.step(x, y, mse, return_outputs=True)
    same(loss, expected.detach(), False)
    same(out, expected_out.detach(), False)
    same_grads(model, reference)


def test_a_copy_of_the_pipe_keeps_its_batch_dims():
    model = seq_model()
    reference = copy.deepcopy(model)
    x = seq_input()
    with Pipe(model, [3, 3], chunks=4, checkpoint="never", batch_dim=1, output_batch_dim=1,
              target_batch_dim=1) as pipe:
        twin = copy.deepcopy(pipe)
    with twin:
        assert (twin.batch_dim, twin.output_batch_dim, twin.target_batch_dim) == (1, 1, 1)
        with torch.no_grad():
            same(twin(x), reference(x), False)


def test_a_tuple_spec_set_between_calls():
    model = masked_model(keep_mask=False)
    reference = copy.deepcopy(model)
    src, mask = seq_input(), causal_mask()
    with torch.no_grad():
        expected = reference((src, mask))
    with Pipe(model, [3, 3], chunks=4, checkpoint="never", batch_dim=1) as pipe:
        with pytest.raises(ValueError):
            pipe((src, mask))  # the (T, T) mask has 5 along dim 1, src 10
        assert pipe.last_step is None
        with pytest.raises(ValueError, match="output_batch_dim"):
            pipe.batch_dim = (1, None)  # the output follows batch_dim=1, and cannot follow a tuple
        pipe.output_batch_dim = 1
        pipe.batch_dim = (1, None)
        assert tuple(pipe.batch_dim) == (1, None)
        with torch.no_grad():
            same(pipe((src, mask)), expected, False)


def test_a_pipe_pickled_before_batch_dims_existed_loads_splitting_along_dim_0():
    model = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)).double()
    reference = copy.deepcopy(model)
    with Pipe(model, [2, 1], chunks=3, checkpoint="never") as pipe:
        state = pipe.__getstate__()
    del state["_given_batch_dims"], state["_batch_dims"]  # what an older torchpipe pickled
    old = Pipe.__new__(Pipe)
    old.__setstate__(state)
    with old:
        assert (old.batch_dim, old.output_batch_dim, old.target_batch_dim) == (0, 0, 0)
        x = torch.randn(N, D, dtype=torch.float64)
        with torch.no_grad():
            same(old(x), reference(x), False)


# ---------------------------------------------------------------- regressions from the review
class MeanTime(nn.Module):
    def forward(self, x):
        return x.mean(0)  # (T, N, F) -> (N, F): pooled over a sequence-first input


@pytest.mark.parametrize("n", [10, 8])  # uneven and even splits
def test_a_pooled_output_that_follows_batch_dim_1_is_refused_before_the_step_leaves_anything(n):
    model = nn.Sequential(nn.Linear(D, 3), MeanTime()).double()
    x, y = torch.randn(T, n, D, dtype=torch.float64), torch.randn(n, 3, dtype=torch.float64)
    with Pipe(model, [1, 1], chunks=4, batch_dim=1, target_batch_dim=0) as pipe:
        each = ["kept"]
        with pytest.raises(ValueError, match=r"3 along dim 1, where its micro-batch has \d samples; "
                                             "output_batch_dim follows batch_dim"):
            pipe.step(x, y, mse, losses=each, return_outputs=True)
        assert each == ["kept"] and no_grads(model)
        with pytest.raises(ValueError, match="output_batch_dim follows batch_dim"), torch.no_grad():
            pipe(x)  # an even split would otherwise concatenate (2, 3) pieces into (2, 12)
        pipe.output_batch_dim = 0
        reference = copy.deepcopy(model)
        expected = mse(reference(x), y)
        expected.backward()
        loss, out = pipe.step(x, y, mse, return_outputs=True)
    same(loss, expected.detach(), False)
    same(out, reference(x).detach(), False)
    same_grads(model, reference)


class Shrink(nn.Module):
    def forward(self, x):
        return x[:, :, : x.size(1)]  # the feature count depends on the micro-batch: cannot be joined


def test_outputs_that_differ_outside_their_batch_dim_are_refused_inside_the_step():
    model = nn.Sequential(nn.Linear(D, 4), Shrink()).double()
    x = torch.randn(T, N, D, dtype=torch.float64)
    with Pipe(model, [1, 1], chunks=4, batch_dim=1, output_batch_dim=1) as pipe:
        each = ["kept"]
        with pytest.raises(ValueError, match=r"shape \(5, 1, 1\) in one micro-batch and \(5, 3, 3\) in another: "
                                             "they differ outside dim 1"):
            pipe.step(x, torch.zeros(T, N, 1), lambda out, y: out.sum(), losses=each, return_outputs=True)
        assert each == ["kept"] and no_grads(model)
        with pytest.raises(ValueError, match="they differ outside dim 1"), torch.no_grad():
            pipe(x)


@pytest.mark.parametrize("output_batch_dim, weight", [(0, "mean"), (1, "sum")])
def test_kl_batchmean_divides_by_dim_0_whatever_the_batch_dim(output_batch_dim, weight):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, 4), nn.LogSoftmax(-1)).double()
    reference = copy.deepcopy(model)
    if output_batch_dim == 0:
        x = torch.randn(N, T, D, dtype=torch.float64)
    else:
        x = torch.randn(T, N, D, dtype=torch.float64)
    y = torch.softmax(torch.randn(*x.shape[:2], 4, dtype=torch.float64), -1)
    loss_fn = nn.KLDivLoss(reduction="batchmean")
    expected = loss_fn(reference(x), y)
    expected.backward()
    with Pipe(model, [2, 2], chunks=4, batch_dim=output_batch_dim) as pipe:
        loss = pipe.step(x, y, loss_fn)
        same(loss, expected.detach(), False)
        same_grads(model, reference)
        pipe.eval()
        same(pipe.evaluate(x, y, loss_fn), expected.detach(), False)
        pipe.output_batch_dim, pipe.target_batch_dim = (output_batch_dim, None), output_batch_dim
        with pytest.raises(ValueError, match="'batchmean' divides by the output's dim 0"):
            pipe.evaluate(x, y, loss_fn)


def test_evaluate_leaves_losses_alone_when_its_outputs_cannot_be_gathered():
    model = nn.Sequential(nn.Linear(D, 3), MeanTime()).double()
    x, y = torch.randn(T, N, D, dtype=torch.float64), torch.randn(N, 3, dtype=torch.float64)
    with Pipe(model, [1, 1], chunks=4, batch_dim=1, target_batch_dim=0) as pipe:
        each = ["kept"]
        with pytest.raises(ValueError, match="output_batch_dim follows batch_dim"):
            pipe.evaluate(x, y, mse, losses=each, return_outputs=True)
        assert each == ["kept"]


class AuxWhen(nn.Module):
    """(x, aux): aux a tensor in micro-batches of more than one sample and None otherwise, or the reverse."""

    def __init__(self, tensor_when_big: bool):
        super().__init__()
        self.tensor_when_big = tensor_when_big

    def forward(self, x):
        big = x.size(0) > 1
        return x, (x.sum(1, keepdim=True) if big == self.tensor_when_big else None)


def _first_item_mse(output, target):
    return F.mse_loss(output[0], target)


def test_an_output_item_that_is_a_tensor_first_and_none_later_fails_the_step_before_it_keeps_anything():
    model = nn.Sequential(nn.Linear(4, 4), AuxWhen(tensor_when_big=True)).double()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)  # last micro-batch: 1
    with Pipe(model, [1, 1], chunks=4) as pipe:
        each = ["kept"]
        with pytest.raises(ValueError, match=r"output 1 of the pipeline is a tensor of shape \(2, 1\) in one "
                                             "micro-batch and NoneType in another"):
            pipe.step(x, y, _first_item_mse, losses=each, return_outputs=True)
        assert each == ["kept"] and no_grads(model) and pipe.last_memory is None


def test_an_output_item_that_is_none_first_is_taken_from_the_first_micro_batch_by_step_as_by_forward():
    model = nn.Sequential(nn.Linear(4, 4), AuxWhen(tensor_when_big=False)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    expected = _first_item_mse(reference(x), y)
    expected.backward()
    with Pipe(model, [1, 1], chunks=4) as pipe:
        with torch.no_grad():
            assert pipe(x)[1] is None
        loss, (out, aux) = pipe.step(x, y, _first_item_mse, return_outputs=True)
    assert aux is None
    same(loss, expected.detach(), False)
    same(out, reference(x)[0].detach(), False)
    same_grads(model, reference)


class Squeeze(nn.Module):
    def forward(self, x):
        return x.squeeze()  # a micro-batch of one sample loses its batch dim


@pytest.mark.parametrize("dims", [{}, {"batch_dim": 1}])
def test_a_micro_batch_output_that_lost_its_batch_dim_is_a_clear_value_error(dims):
    model = nn.Sequential(nn.Linear(4, 1), Squeeze()).double()
    x = torch.randn(7, 4, dtype=torch.float64) if not dims else torch.randn(3, 7, 4, dtype=torch.float64)
    with Pipe(model, [1, 1], chunks=4, **dims) as pipe, torch.no_grad():
        with pytest.raises(ValueError, match=r"is a tensor of shape \((3, )?2,?\) in one micro-batch and a tensor of "
                                             r"shape \((3,)?\) in another"):
            pipe(x)


class MeanOverRows(nn.Module):
    """Pools each sample of a jagged nested tensor (variable rows) to one row."""

    def forward(self, x):
        return torch.stack([sample.mean(0) for sample in x.unbind()]) if x.is_nested else x


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_a_jagged_nested_input_splits_at_dim_0_and_trains_like_the_plain_model(checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.Tanh(), MeanOverRows(), nn.Linear(H, C)).double()
    reference = copy.deepcopy(model)
    x = torch.nested.nested_tensor([torch.randn(n, D, dtype=torch.float64) for n in (2, 3, 1, 4, 2)],
                                   layout=torch.jagged)
    with Pipe(model, [2, 2], chunks=3, checkpoint=checkpoint) as pipe:
        out = pipe(x)
        out.pow(2).sum().backward()
    expected = reference(x)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)  # BLAS blocks rows by count
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_a_sparse_input_with_chunks_above_1_is_refused_before_any_layer_runs():
    calls = []
    model = nn.Sequential(nn.Identity(), nn.Identity())
    model[0].register_forward_pre_hook(lambda *args: calls.append(1))
    with Pipe(model, [1, 1], chunks=2) as pipe:
        with pytest.raises(ValueError, match="but it is a torch.sparse_coo tensor"):
            pipe(torch.randn(4, 3).to_sparse())
        with pytest.raises(ValueError, match="but it is a torch.sparse_coo tensor"):
            pipe.step(torch.randn(4, 3).to_sparse(), torch.randn(4, 3), nn.MSELoss())
    assert not calls
