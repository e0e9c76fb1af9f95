"""On a real CUDA device: worker streams, copies, events and fences keep every result equal
to the un-pipelined model. Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest tests/test_cuda.py``.

The race tests use layers big enough that a kernel takes milliseconds, so that a missing
wait between the caller's stream and a worker stream reads stale memory and shows up as
a wrong loss, not as a lucky pass.
"""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from test_pipe import RecordDropout  # (kind, batch size, output) per call

from torchpipe import Pipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda", 0)
LAYOUTS = {
    "four streams on one GPU": ["cuda:0"] * 4,
    "cpu and gpu alternating": ["cpu", "cuda:0", "cuda:0", "cpu"],
}
SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("zb-h1", {}), ("interleaved-1f1b", {"virtual_stages": 2}), ("zb-v", {})]


@pytest.fixture(autouse=True)
def _exact_matmuls():
    """TF32 would make the reference and the micro-batches round differently."""
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
    torch.cuda.synchronize()


def make_model(width=32, depth=8):
    return nn.Sequential(*[nn.Linear(width, width) if i % 2 == 0 else nn.Tanh() for i in range(depth)])


def grads(module):
    return {name: p.grad.detach().to("cpu") for name, p in module.named_parameters()}


def close(a, b, **tolerance):
    torch.testing.assert_close(a.to("cpu"), b.to("cpu"), **tolerance)


# ------------------------------------------------------------------ default devices
@pytest.mark.default_devices
def test_default_devices_are_every_gpu_as_in_torchgpipe():
    count = torch.cuda.device_count()
    with Pipe(make_model(depth=2 * count), [2] * count, chunks=2) as pipe:
        assert pipe.devices == [torch.device("cuda", i) for i in range(count)]
        assert pipe(torch.randn(4, 32, device=CUDA)).device == torch.device("cuda", count - 1)
    with pytest.raises(IndexError, match=f"devices: {count}, partitions: {count + 1}"):
        Pipe(make_model(depth=2 * count + 2), [2] * (count + 1))


# ------------------------------------------------------------------ forward() path
def test_bitwise_for_one_chunk_without_checkpointing():
    model = make_model()
    reference = copy.deepcopy(model).to(CUDA)
    x = torch.randn(16, 32, device=CUDA)
    with Pipe(model, [2, 2, 2, 2], devices=LAYOUTS["four streams on one GPU"], chunks=1, checkpoint="never") as pipe:
        out = pipe(x)
        out.pow(2).sum().backward()
        got = grads(pipe)
    expected = reference(x)
    expected.pow(2).sum().backward()
    assert torch.equal(out, expected)
    want = grads(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("chunks", [1, 4, 7])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_outputs_and_every_gradient_match(layout, chunks, checkpoint):
    devices = LAYOUTS[layout]
    model = make_model()
    reference = copy.deepcopy(model).to(CUDA)
    x = torch.randn(10, 32, device=devices[0], requires_grad=True)
    x_ref = x.detach().to(CUDA).requires_grad_()
    with Pipe(model, [2, 2, 2, 2], devices=devices, chunks=chunks, checkpoint=checkpoint) as pipe:
        out = pipe(x)
        assert out.device == torch.device(devices[-1])
        out.pow(2).sum().backward()
        got = grads(pipe)
    expected = reference(x_ref)
    expected.pow(2).sum().backward()
    close(out, expected, rtol=1e-5, atol=1e-5)
    close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    for name, want in grads(reference).items():
        close(got[name], want, rtol=1e-5, atol=1e-5, msg=name)


def test_dropout_on_the_cuda_generator_is_replayed_on_recompute():
    """Four partitions share cuda:0's generator; each recompute must see its forward's mask."""
    logs = [[] for _ in range(4)]
    layers = []
    for log in logs:
        layers += [RecordDropout(0.5, log), nn.Linear(256, 256)]
    with Pipe(nn.Sequential(*layers), [2, 2, 2, 2], devices=["cuda:0"] * 4, chunks=8, checkpoint="always") as pipe:
        x = torch.randn(64, 256, device=CUDA)
        for _ in range(3):
            for log in logs:
                log.clear()
            pipe(x).sum().backward()
            for log in logs:
                forward = [t for kind, _, t in log if kind == "forward"]
                recompute = [t for kind, _, t in log if kind == "recompute"]
                assert len(forward) == len(recompute) == 8
                for again in recompute:
                    assert any(torch.equal(again, first) for first in forward)


def test_autocast_reaches_the_workers():
    model = make_model()
    reference = copy.deepcopy(model).to(CUDA)
    x = torch.randn(8, 32, device=CUDA)
    with Pipe(model, [2, 2, 2, 2], devices=["cuda:0"] * 4, chunks=1, checkpoint="never") as pipe:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = pipe(x)
            expected = reference(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)


# ------------------------------------------------------------------ Pipe.step
@pytest.mark.parametrize("schedule,options", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_step_loss_and_every_gradient_match(schedule, options, checkpoint):
    partitions = 8 if schedule in ("interleaved-1f1b", "zb-v") else 4
    model = make_model(depth=2 * partitions)
    reference = copy.deepcopy(model).to(CUDA)
    x, y = torch.randn(12, 32, device=CUDA), torch.randn(12, 32, device=CUDA)
    loss_fn = nn.MSELoss()
    expected = loss_fn(reference(x), y)
    expected.backward()
    with Pipe(model, [2] * partitions, devices=["cuda:0"] * partitions, chunks=4, checkpoint=checkpoint) as pipe:
        loss = pipe.step(x, y, loss_fn, schedule=schedule, **options)
        got = grads(pipe)
    close(loss, expected, rtol=1e-5, atol=1e-6)
    for name, want in grads(reference).items():
        close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("schedule,options", SCHEDULES)
def test_step_frees_outputs_copied_across_devices(schedule, options):
    """Megatron's output deallocation: a stage whose output another device copied frees it."""
    partitions = 8 if schedule in ("interleaved-1f1b", "zb-v") else 4
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(partitions) for m in (nn.Tanh(), nn.Linear(32, 32))])
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    loss_fn = nn.MSELoss()
    expected = loss_fn(reference(x), y)
    expected.backward()
    devices = ["cpu", "cuda:0"] * (partitions // 2)
    if schedule == "zb-v":  # its V puts stages w and 7 - w on worker w: one device for both
        devices = devices[:4] + devices[:4][::-1]
    with Pipe(model, [2] * partitions, devices=devices, chunks=4, checkpoint="never") as pipe:
        loss = pipe.step(x, y.to(devices[-1]), loss_fn, schedule=schedule, **options)
        memory = pipe.last_memory
        got = grads(pipe)
    copied = 4 * 4 * 32 * 4  # four micro-batches of 4 x 32 floats, each copied to the next device
    assert memory.freed_output_bytes == [copied if here != there else 0
                                         for here, there in zip(devices, devices[1:])] + [0]
    close(loss, expected, rtol=1e-5, atol=1e-6)
    for name, want in grads(reference).items():
        close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)


DELAY_CYCLES = 50_000_000
"""About 30 ms of GPU clock: queued on a stream, it makes every later kernel there late, so a
missing wait between two streams reads stale memory instead of winning a race by luck."""


class Delay(nn.Module):
    """Identity that first stalls its stream (the worker's) for ``DELAY_CYCLES``."""

    def forward(self, x):
        torch.cuda._sleep(DELAY_CYCLES)
        return x


def big_model(width=2048, depth=8, delay_last=False):
    torch.manual_seed(0)
    layers = [nn.Linear(width, width) if i % 2 == 0 else nn.Tanh() for i in range(depth)]
    if delay_last:
        layers.insert(depth - 1, Delay())
    return nn.Sequential(*layers)


@pytest.mark.parametrize("path,input_on", [("step 1f1b", "cuda"), ("step 1f1b", "cpu"), ("step zb-h1", "cuda"),
                                           ("forward+backward", "cuda"), ("forward+backward", "cpu")])
def test_training_loop_with_the_optimizer_on_the_callers_stream(path, input_on):
    """optimizer.step() and loss.item() run on the caller's stream, the stages on their own:
    the pipeline must order its streams after the caller's and the caller's after its own.
    A CPU input carries no ready event from the caller's stream, so only the step's own
    fence orders the first stage after the optimizer step (a CUDA input's ready event, recorded
    when the step starts, orders it too)."""
    # The last stage stalls its stream before the loss (a caller reading the loss too early
    # sees stale memory), and the caller stalls its own before each optimizer step (a stage
    # reading the parameters too early sees the old ones).
    model = big_model(delay_last=True)
    reference = copy.deepcopy(model).to(CUDA)
    x, y = torch.randn(512, 2048, device=CUDA), torch.randn(512, 2048, device=CUDA)
    loss_fn = nn.MSELoss()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_losses = []
    for _ in range(4):
        ref_opt.zero_grad()
        loss = loss_fn(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    # Copied to the CPU once, here: x.cpu() in the loop would wait for the caller's stream
    # itself (the optimizer step included) and hide a missing fence.
    x_cpu = x.cpu()
    with Pipe(model, [2, 2, 2, 3], devices=["cuda:0"] * 4, chunks=4, checkpoint="never") as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        losses = []
        for _ in range(4):
            opt.zero_grad()
            given = x if input_on == "cuda" else x_cpu
            if path.startswith("step"):
                loss = pipe.step(given, y, loss_fn, schedule=path.split()[1])
            else:
                loss = loss_fn(pipe(given), y)
                loss.backward()
            losses.append(loss.item())  # read on the caller's stream, right away
            torch.cuda._sleep(DELAY_CYCLES)
            opt.step()
        final = {name: p.detach().to("cpu") for name, p in pipe.named_parameters()}
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    for name, p in reference.named_parameters():
        close(final[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_1f1b_holds_less_gpu_memory_than_gpipe():
    """Measured by the CUDA allocator, not by our own counter: 1F1B frees activations early."""
    peaks = {}
    # Activations (16384 x 1024 floats per layer output) dwarf the 4 MiB weights and grads.
    # On top of what each schedule keeps, the four stages' concurrent backward passes hold
    # about 20 micro-batch-sized transients (gradients in flight, weight gradients, the
    # loss's): measured on an H100 with chunks=16, GPipe peaked at 344 MiB and 1F1B at
    # 144 MiB, 0.42 of it. 32 micro-batches make what the schedules keep dominate.
    x, y = torch.randn(16384, 1024, device=CUDA), torch.randn(16384, 1024, device=CUDA)
    with Pipe(big_model(width=1024), [2, 2, 2, 2], devices=["cuda:0"] * 4, chunks=32, checkpoint="never") as pipe:
        pipe.step(x, y, nn.MSELoss(), schedule="gpipe")  # gradients exist from here on
        for schedule in ("gpipe", "1f1b", "gpipe", "1f1b"):  # twice: the second run has warm caches
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            pipe.step(x, y, nn.MSELoss(), schedule=schedule)
            torch.cuda.synchronize()
            peaks[schedule] = torch.cuda.max_memory_allocated() - base
            assert pipe.last_memory is not None
    # All four stages share the GPU: GPipe holds 32 micro-batches per stage (128 in all), 1F1B
    # 4+3+2+1 = 10; the transients come on top of both.
    assert peaks["1f1b"] < 0.35 * peaks["gpipe"], peaks


# ------------------------------------------------------------------ batch dims, evaluate, loss_kwargs
# The float64 sequence models of tests/test_pipe_batch_dim.py, spread over four partitions.
from test_pipe_batch_dim import C, D, T, causal_mask, masked_model, pooled_model, seq_input, seq_model  # noqa: E402

def seq_close(a, b, msg=None):
    close(a, b, rtol=1e-9, atol=1e-12, msg=msg)


def same_grads_on_cpu(model, reference):
    got, want = grads(model), grads(reference)
    assert got.keys() == want.keys()
    for name in want:
        seq_close(got[name], want[name], msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_sequence_first_split_along_dim_1_on_cuda(layout, checkpoint):
    """batch_dim=1 through cuDNN's LSTM on worker streams: pipe(x) + backward, then
    Pipe.step with the target on the caller's GPU, both equal to the plain model."""
    devices = LAYOUTS[layout]
    model = seq_model()
    reference = copy.deepcopy(model).to(CUDA)
    x = seq_input(n=10).to(devices[0]).requires_grad_()
    x_ref = x.detach().to(CUDA).requires_grad_()
    y = torch.randn(T, 10, D, dtype=torch.float64, device=CUDA)
    with Pipe(model, [2, 1, 2, 1], devices=devices, chunks=4, checkpoint=checkpoint, batch_dim=1) as pipe:
        out = pipe(x)
        assert out.shape == (T, 10, D) and out.device == torch.device(devices[-1])
        out.pow(2).sum().backward()
        expected = reference(x_ref)
        expected.pow(2).sum().backward()
        seq_close(out, expected)
        seq_close(x.grad, x_ref.grad)
        same_grads_on_cpu(pipe, reference)

        pipe.zero_grad()
        reference.zero_grad()
        loss, gathered = pipe.step(x.detach(), y, nn.MSELoss(), return_outputs=True)
        expected_output = reference(x_ref.detach())
        expected_loss = nn.MSELoss()(expected_output, y)
        expected_loss.backward()
        seq_close(loss, expected_loss)
        seq_close(gathered, expected_output)
        same_grads_on_cpu(pipe, reference)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("target_on", ["cpu", "cuda"])
def test_cross_entropy_with_class_weights_on_the_last_device(layout, schedule, target_on):
    """Pooled (N, C) logits after batch_dim=1; F.cross_entropy gets class weights that live on
    the last stage's device and an ignore_index through loss_kwargs; the class-index target
    comes from either device. step and evaluate both equal the plain loss."""
    devices = LAYOUTS[layout]
    model = pooled_model()
    reference = copy.deepcopy(model).to(CUDA)
    x = seq_input(n=12)
    y = torch.randint(0, C, (12,))
    y[::5] = -1  # ignored: micro-batches count their kept, weighted targets
    weight = torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)
    kwargs = {"weight": weight.to(devices[-1]), "ignore_index": -1}
    logits = reference(x.to(CUDA))
    expected = F.cross_entropy(logits, y.to(CUDA), weight=weight.to(CUDA), ignore_index=-1)
    expected.backward()
    with Pipe(model, [1, 1, 1, 1], devices=devices, chunks=4, checkpoint="except_last", batch_dim=1,
              output_batch_dim=0) as pipe:
        losses = []
        loss, out = pipe.step(x.to(devices[0]), y.to(target_on), F.cross_entropy, schedule=schedule,
                              loss_kwargs=kwargs, return_outputs=True, losses=losses)
        assert out.shape == (12, C) and out.device == torch.device(devices[-1])
        assert len(losses) == 4
        seq_close(loss, expected)
        seq_close(out, logits.detach())
        same_grads_on_cpu(pipe, reference)
        evaluated, evaluated_out = pipe.evaluate(x.to(devices[0]), y.to(target_on), F.cross_entropy,
                                                 loss_kwargs=kwargs, return_outputs=True)
        seq_close(evaluated, expected)
        seq_close(evaluated_out, logits.detach())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_replicated_mask_reaches_every_micro_batch_on_its_device(layout):
    """batch_dim=(1, None): the (T, T) mask is passed whole to every micro-batch and copied
    to each stage's device with it; its gradient sums over micro-batches."""
    devices = LAYOUTS[layout]
    model = masked_model(keep_mask=False)
    reference = copy.deepcopy(model).to(CUDA)
    x = seq_input(n=10).to(devices[0])
    mask = causal_mask().to(devices[0]).requires_grad_()
    mask_ref = mask.detach().to(CUDA).requires_grad_()
    y = torch.randn(T, 10, D, dtype=torch.float64)
    expected = nn.MSELoss()(reference((x.to(CUDA), mask_ref)), y.to(CUDA))
    expected.backward()
    with Pipe(model, [2, 1, 2, 1], devices=devices, chunks=4, checkpoint="except_last", batch_dim=(1, None),
              output_batch_dim=1) as pipe:
        loss = pipe.step((x, mask), y.to(devices[-1]), nn.MSELoss(), schedule="1f1b")
        seq_close(loss, expected)
        seq_close(mask.grad, mask_ref.grad)
        same_grads_on_cpu(pipe, reference)


# ------------------------------------------------------------------ tensors nested between partitions
from test_step import SequenceHead  # noqa: E402 - reads an LSTM's (out, (h_n, c_n))


@pytest.mark.parametrize("devices", [["cuda:0", "cpu"], ["cuda:0", "cuda:0"]], ids=["copied", "one device"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_an_lstms_nested_state_reaches_the_next_partition_on_its_device(devices, checkpoint):
    """The LSTM's ``(h_n, c_n)`` sits inside the output tuple, on the GPU: it is copied to the
    next device with the output after its producer's stream (or, on one device, fenced on the
    consumer's stream), in pipe(x) and in Pipe.step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.LSTM(5, 8, batch_first=True), SequenceHead()).double()
    reference = copy.deepcopy(model).to(CUDA)
    x = torch.randn(6, 7, 3, dtype=torch.double)
    y = torch.randn(6, 1, dtype=torch.double, device=devices[-1])
    with Pipe(model, [2, 1], devices=devices, chunks=3, checkpoint=checkpoint) as pipe:
        out = pipe(x.to(devices[0]))
        expected = reference(x.to(CUDA))
        seq_close(out, expected)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        same_grads_on_cpu(pipe, reference)

        pipe.zero_grad()
        reference.zero_grad()
        loss = pipe.step(x.to(devices[0]), y, nn.MSELoss())
        expected_loss = nn.MSELoss()(reference(x.to(CUDA)), y.to(CUDA))
        expected_loss.backward()
        seq_close(loss, expected_loss)
        same_grads_on_cpu(pipe, reference)
