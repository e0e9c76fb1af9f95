"""``cuda``: torchpipe on one GPU: runtime overhead, real layers, activation memory.

Every partition of every pipeline sits on ``cuda:0``: torchpipe still gives each partition
its own worker thread and CUDA stream, torchgpipe and fairscale take the repeated device.
Every timed call ends with ``torch.cuda.synchronize()``, so its wall time covers the GPU
work it queued, not just the launches. Three parts, each against baselines timed in the
same run (interleaved repeats, median):

1. overhead on CUDA: ``overhead``'s tiny model (4 x Linear(16, 16), batch 64) on the GPU,
   where a step is almost all runtime; overhead per (stage, micro-batch) =
   (pipeline step - chunked-loop step) / (stages x chunks), as in ``overhead``.
2. real layers: 8 x (Linear(4096, 4096) + ReLU) in bfloat16, batch 1024, 4 partitions of
   2 pairs each, MSE loss; the plain model, the plain chunked loop, ``Pipe`` forward +
   autograd backward, ``Pipe.step`` (1F1B and GPipe plans) and torchgpipe, with
   ``checkpoint='never'`` and ``'except_last'``.
3. activation memory: the increase of ``torch.cuda.max_memory_allocated()`` over one
   ``Pipe.step`` (gpipe, 1f1b, zb-h1) and one plain step of the real-layers model, chunks 8,
   at batch 1024 and 8192, with what ``pipe.last_memory`` counted as saved for backward.

Without CUDA the suite returns a result with no tables and a note saying it was skipped.
"""
from __future__ import annotations

import gc
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import overhead
from .peers import SHIMS_APPLIED, Peer, build_peers, close_pipeline, load_peers, release
from .registry import Options
from .report import Column, Goal, SuiteResult, Table
from .timing import Measurement, compare

SKIP_NOTE = "CUDA is not available on this machine: suite skipped"
DEVICE = "cuda:0"

# Part 1: overhead's tiny model, on the GPU.
STAGES = overhead.STAGES
BATCH = overhead.BATCH
CHUNKS = overhead.CHUNKS

# Part 2: real layers.
PAIRS = 8
"""Linear(WIDTH, WIDTH) + ReLU pairs in the model."""
PARTITIONS = 4
WIDTH = 4096
REAL_BATCH = 1024
REAL_CHUNKS = (1, 4, 8)
CHECKPOINTS = ("never", "except_last")
STEP_SCHEDULES = ("1f1b", "gpipe")
DTYPE = torch.bfloat16
"""bfloat16: what one trains these layers in on an H100. float32 matmuls (no TF32 by default) run
on an order of magnitude fewer FLOP/s, which would hide the runtime's cost behind the GPU."""
REAL_TOLERANCE = 1e-2
"""Largest ||pipeline output - chunked-loop output|| / ||chunked-loop output|| accepted (bfloat16)."""

# Part 3: activation memory.
MEMORY_CHUNKS = 8
MEMORY_BATCHES = (REAL_BATCH, 8 * REAL_BATCH)
"""The real-layers batch, where activations are about as large as one weight gradient, and a batch
where they dominate the CUDA peak (micro-batch = the real-layers batch)."""
MEMORY_SCHEDULES = ("gpipe", "1f1b", "zb-h1")
GOAL_MEMORY = PARTITIONS / MEMORY_CHUNKS
"""1F1B keeps at most p - s micro-batches on stage s, so its worst stage holds p/m of GPipe's."""

MIB = 2 ** 20


def run(options: Options) -> SuiteResult:
    if not torch.cuda.is_available():
        result = SuiteResult("cuda", "torchpipe on one GPU (skipped: no CUDA)",
                             config={"torch": torch.__version__, "quick": options.quick})
        result.notes.append(SKIP_NOTE)
        return result
    device = torch.device(DEVICE)
    torch.cuda.set_device(device)
    tiny = options.timing(target_s=0.2, quick_target_s=0.01)
    real = options.timing(target_s=0.2, quick_target_s=0.02)
    result = SuiteResult(
        "cuda",
        f"torchpipe with every partition on {DEVICE}: runtime overhead on {STAGES} x Linear({overhead.WIDTH},"
        f"{overhead.WIDTH}), {PAIRS} x (Linear({WIDTH},{WIDTH}) + ReLU) in {_dtype_name()} on {PARTITIONS} "
        "partitions, and activation memory per schedule",
        config={"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
                "device": DEVICE, "repeats": tiny.repeats, "warmup": tiny.warmup,
                "target_s_per_repeat": {"overhead": tiny.target_s, "real": real.target_s},
                "dtype_real": _dtype_name(), "quick": options.quick},
    )
    peers = load_peers()
    for peer in peers:
        if not peer.available:
            result.notes.append(f"{peer.label} unavailable: {peer.reason}")
    try:
        _overhead(options, result, peers, device, tiny)
        _empty_cache()
        _real_layers(options, result, [p for p in peers if p.name in ("torchpipe", "torchgpipe")], device, real)
        _empty_cache()
        _memory(options, result, peers, device, real.repeats)
    finally:
        _empty_cache()

    if SHIMS_APPLIED:
        result.notes += [f"shim applied: {s}" for s in SHIMS_APPLIED]
    elif all(p.available for p in peers):
        result.notes.append("no shims needed: torchgpipe and fairscale import and run unmodified with torch "
                            f"{torch.__version__}")
    versions = ", ".join(f"{p.name} {p.version}" for p in peers if p.available and p.version)
    result.notes.append(f"versions: {versions}")
    result.notes.append("every timed call ends with torch.cuda.synchronize(), so step times include the GPU work")
    result.notes.append("each pipeline's output was checked against the plain model (the chunked loop for the real "
                        "layers) before timing")
    if options.quick:
        result.notes.append("quick run: few short repeats, figures are indicative only")
    return result


def _dtype_name() -> str:
    return str(DTYPE).replace("torch.", "")


def _empty_cache() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _synchronized(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` followed by ``torch.cuda.synchronize()``: a timed call covers the GPU work it queued."""

    def step() -> None:
        fn()
        torch.cuda.synchronize()

    return step


# ---------------------------------------------------------------------------- part 1: overhead


def _tiny_model(device: torch.device) -> nn.Sequential:
    return overhead.make_model().to(device)


def _build_tiny(peer: Peer, chunks: int, x: torch.Tensor, expected: torch.Tensor, device: torch.device) -> nn.Module:
    """``overhead._build`` on ``device``: build, check one step against the plain model."""
    assert peer.make is not None
    pipeline = peer.make(_tiny_model(device), chunks, device)
    try:
        out = pipeline(x)
        if not torch.allclose(out, expected, atol=1e-5):
            raise RuntimeError("output differs from the plain model")
        out.sum().backward()
        torch.cuda.synchronize()
    except BaseException:
        close_pipeline(pipeline)
        raise
    return pipeline


def _measure(result: SuiteResult, key: str, cases: Dict[str, Callable[[], None]], pipelines: List[nn.Module],
             config: Any) -> Dict[str, Measurement]:
    """Time ``cases`` from an idle GPU, then close the pipelines and free their memory."""
    try:
        torch.cuda.synchronize()
        measured = compare(cases, config)
    finally:
        release(pipelines, cases)
        _empty_cache()
    for name, m in measured.items():
        result.measurements[f"{key}/{name}"] = m.to_json()
    return measured


def _overhead(options: Options, result: SuiteResult, peers: List[Peer], device: torch.device, config: Any) -> None:
    steps, summary = overhead.overhead_tables(
        f"Overhead on CUDA: {STAGES} x Linear({overhead.WIDTH},{overhead.WIDTH}), batch {BATCH}, every stage on "
        f"{DEVICE}, checkpoint='never', forward+backward: step time (median of repeats)",
        "Overhead on CUDA per (stage, micro-batch) fwd+bwd, us = (pipe step - chunked-loop step) / (stages x chunks)")
    steps.notes.append("plain = model(x).sum().backward() on the whole batch; loop = torch.cat([model(c) for c in "
                       "x.chunk(chunks)]).sum().backward(), the same arithmetic as a pipeline without its runtime; "
                       "all on the caller's thread and the default stream")
    summary.notes.append("targets are the CPU overhead suite's; torchpipe runs each stage on its own worker thread "
                         "and stream, torchgpipe and fairscale run every stage on one worker (one device)")
    result.tables += [steps, summary]
    x = torch.randn(BATCH, overhead.WIDTH).to(device)
    with torch.no_grad():
        expected = _tiny_model(device)(x)
    labels = {"plain": "plain model, whole batch", "loop": "plain model, chunked loop"}
    labels.update({p.name: p.label for p in peers})

    for chunks in CHUNKS:
        options.say(f"cuda: overhead chunks={chunks}")
        cases: Dict[str, Callable[[], None]] = {
            "plain": _synchronized(overhead._step(_tiny_model(device), x)),
            "loop": _synchronized(overhead._chunked_step(_tiny_model(device), x, chunks)),
        }
        built, unavailable = build_peers(peers, lambda peer: _build_tiny(peer, chunks, x, expected, device),
                                         f"overhead chunks={chunks}", result.notes)
        pipelines: List[nn.Module] = list(built.values())
        cases.update({name: _synchronized(overhead._step(pipeline, x)) for name, pipeline in built.items()})
        del built
        measured = _measure(result, f"overhead/chunks={chunks}", cases, pipelines, config)

        overhead.report_chunks(result, steps, summary, chunks, measured, unavailable, labels,
                               key_prefix="overhead/", goal_prefix="CUDA ")


# ---------------------------------------------------------------------------- part 2: real layers


def make_real_model(device: torch.device, seed: int = 0) -> nn.Sequential:
    """``PARTITIONS`` children of ``PAIRS / PARTITIONS`` x (Linear + ReLU), built on ``device``.

    One child per partition, so ``balance=[1] * PARTITIONS`` over it is ``balance=[4] * 4``
    over the flat 16 layers. Same ``seed``, same weights.
    """
    torch.manual_seed(seed)
    per_partition = PAIRS // PARTITIONS

    def child() -> nn.Sequential:
        layers: List[nn.Module] = []
        for _ in range(per_partition):
            layers += [nn.Linear(WIDTH, WIDTH, device=device, dtype=DTYPE), nn.ReLU()]
        return nn.Sequential(*layers)

    return nn.Sequential(*[child() for _ in range(PARTITIONS)])


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def _loss_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module) -> Callable[[], None]:
    def step() -> None:
        loss_fn(model(x), y).backward()
        torch.cuda.synchronize()

    return step


def _loss_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module,
               chunks: int) -> Callable[[], None]:
    def step() -> None:
        loss_fn(torch.cat([model(c) for c in x.chunk(chunks)]), y).backward()
        torch.cuda.synchronize()

    return step


def _pipe_step(pipe: Any, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module, schedule: str) -> Callable[[], None]:
    def step() -> None:
        pipe.step(x, y, loss_fn, schedule=schedule)
        torch.cuda.synchronize()

    return step


def _build_real(peer: Peer, chunks: int, checkpoint: str, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module,
                expected: torch.Tensor, device: torch.device) -> nn.Module:
    """Build the pipeline, check its output against the chunked loop's, run one backward."""
    assert peer.make is not None
    pipeline = peer.make(make_real_model(device), chunks, device, checkpoint=checkpoint)
    try:
        out = pipeline(x)
        error = _relative_error(out, expected)
        if not error <= REAL_TOLERANCE:
            raise RuntimeError(f"output differs from the plain model's (relative error {error:.3g})")
        loss_fn(out, y).backward()
        torch.cuda.synchronize()
    except BaseException:
        close_pipeline(pipeline)
        raise
    return pipeline


def _check_step(pipe: Any, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module, schedule: str,
                expected_loss: torch.Tensor) -> None:
    """One ``Pipe.step``; its loss must be the chunked loop's."""
    loss = pipe.step(x, y, loss_fn, schedule=schedule)
    torch.cuda.synchronize()
    error = _relative_error(loss, expected_loss)
    if not error <= REAL_TOLERANCE:
        raise RuntimeError(f"Pipe.step loss differs from the plain model's (relative error {error:.3g})")


def _add_real_cases(result: SuiteResult, peers: List[Peer], chunks: int, checkpoint: str, x: torch.Tensor,
                    y: torch.Tensor, loss_fn: nn.Module, expected: torch.Tensor, expected_loss: torch.Tensor,
                    device: torch.device, labels: Dict[str, str], cases: Dict[str, Callable[[], None]],
                    pipelines: List[nn.Module], unavailable: Dict[str, str]) -> None:
    """Build and check the pipelines of one checkpoint mode; add their cases, or why they are unavailable."""
    where = f"real layers chunks={chunks} checkpoint={checkpoint}"
    built, missing = build_peers(
        peers, lambda peer: _build_real(peer, chunks, checkpoint, x, y, loss_fn, expected, device), where,
        result.notes)
    pipelines += built.values()
    for name in ("torchpipe", "torchgpipe"):
        if name not in built:
            unavailable[f"{checkpoint}/{name}"] = missing.get(name, "not loaded")
    pipe = built.get("torchpipe")
    for schedule in STEP_SCHEDULES:
        key = f"{checkpoint}/step {schedule}"
        if pipe is None:
            unavailable[key] = unavailable[f"{checkpoint}/torchpipe"]
            continue
        try:
            _check_step(pipe, x, y, loss_fn, schedule, expected_loss)
        except Exception as exc:
            unavailable[key] = f"{type(exc).__name__}: {exc}"
            result.notes.append(f"{labels[f'step {schedule}']} unavailable at {where}: {unavailable[key]}")
            continue
        cases[key] = _pipe_step(pipe, x, y, loss_fn, schedule)
    for name, pipeline in built.items():
        cases[f"{checkpoint}/{name}"] = _loss_step(pipeline, x, y, loss_fn)


def _real_layers(options: Options, result: SuiteResult, peers: List[Peer], device: torch.device, config: Any) -> None:
    table = Table(
        f"Real layers on one GPU: {PAIRS} x (Linear({WIDTH},{WIDTH}) + ReLU) in {_dtype_name()}, batch {REAL_BATCH}, "
        f"{PARTITIONS} partitions of {PAIRS // PARTITIONS} pairs on {DEVICE}, MSE loss, forward+backward: step time",
        [
            Column("chunks", "chunks"),
            Column("checkpoint", "checkpoint", align="<"),
            Column("case", "case", align="<"),
            Column("step_ms", "step ms", "{:.3f}"),
            Column("spread", "spread", "{:.0%}"),
            Column("iters", "iters/repeat"),
            Column("vs_plain", "x plain", "{:.3f}"),
            Column("vs_loop", "x loop", "{:.3f}"),
            Column("vs_pipe", "x Pipe fwd+bwd", "{:.3f}"),
        ],
    )
    table.notes.append("plain = loss(model(x), y).backward(); loop = loss(torch.cat([model(c) for c in "
                       "x.chunk(chunks)]), y).backward(); Pipe fwd+bwd = loss(pipe(x), y).backward(); Pipe.step runs "
                       "forward, loss and backward on the workers in the named plan's order. x Pipe fwd+bwd: against "
                       "torchpipe's forward+backward with the same chunks and checkpoint")
    table.notes.append("with every stage on one GPU a pipeline cannot beat the plain model by more than what "
                       "overlapping streams buys; x loop > 1 is the runtime's cost left visible at this size, while "
                       "x plain also holds the cost of launching chunks times more, smaller kernels")
    result.tables.append(table)

    torch.manual_seed(1)
    x = torch.randn(REAL_BATCH, WIDTH, device=device, dtype=DTYPE)
    y = torch.randn(REAL_BATCH, WIDTH, device=device, dtype=DTYPE)
    loss_fn = nn.MSELoss()
    reference = make_real_model(device)
    reference.requires_grad_(False)
    labels = {"plain": "plain model, whole batch", "loop": "plain model, chunked loop",
              "torchpipe": "torchpipe Pipe, forward + autograd backward",
              "torchgpipe": "torchgpipe GPipe, forward + autograd backward"}
    labels.update({f"step {s}": f"torchpipe Pipe.step(schedule={s!r})" for s in STEP_SCHEDULES})
    names = ["torchpipe", *[f"step {s}" for s in STEP_SCHEDULES], "torchgpipe"]

    for chunks in REAL_CHUNKS:
        options.say(f"cuda: real layers chunks={chunks}")
        with torch.no_grad():
            expected = torch.cat([reference(c) for c in x.chunk(chunks)])
            expected_loss = loss_fn(expected, y)
        cases: Dict[str, Callable[[], None]] = {
            "plain": _loss_step(make_real_model(device), x, y, loss_fn),
            "loop": _loss_loop(make_real_model(device), x, y, loss_fn, chunks),
        }
        pipelines: List[nn.Module] = []
        unavailable: Dict[str, str] = {}
        try:
            for checkpoint in CHECKPOINTS:
                _add_real_cases(result, peers, chunks, checkpoint, x, y, loss_fn, expected, expected_loss, device,
                                labels, cases, pipelines, unavailable)
        except BaseException:
            release(pipelines, cases)
            _empty_cache()
            raise
        measured = _measure(result, f"real/chunks={chunks}", cases, pipelines, config)

        plain = measured["plain"].median
        loop = measured["loop"].median
        for name in ("plain", "loop"):
            m = measured[name]
            table.add(chunks=chunks, checkpoint="-", case=labels[name], step_ms=m.median * 1e3, spread=m.spread,
                      iters=m.iters, vs_plain=m.median / plain, vs_loop=m.median / loop)
        result.ratio(f"real/chunks={chunks}/loop step / plain step", loop, plain)
        for checkpoint in CHECKPOINTS:
            pipe_fb = measured.get(f"{checkpoint}/torchpipe")
            for name in names:
                key = f"{checkpoint}/{name}"
                if key in unavailable:
                    table.add(chunks=chunks, checkpoint=checkpoint, case=f"{labels[name]}: unavailable: "
                              f"{unavailable[key]}")
                    continue
                m = measured[key]
                prefix = f"real/chunks={chunks}/checkpoint={checkpoint}/{name}"
                row: Dict[str, Any] = dict(chunks=chunks, checkpoint=checkpoint, case=labels[name],
                                           step_ms=m.median * 1e3, spread=m.spread, iters=m.iters)
                row["vs_plain"] = result.ratio(f"{prefix} step / plain step", m.median, plain)
                row["vs_loop"] = result.ratio(f"{prefix} step / loop step", m.median, loop)
                if name != "torchpipe" and pipe_fb is not None:
                    row["vs_pipe"] = result.ratio(f"{prefix} step / torchpipe forward+backward step",
                                                  m.median, pipe_fb.median)
                table.add(**row)
    del reference


# ---------------------------------------------------------------------------- part 3: activation memory


def _peak_increase(step: Callable[[], Any]) -> int:
    """Bytes by which ``torch.cuda.max_memory_allocated()`` rose above the allocated bytes during ``step()``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def _median(values: List[int]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _measure_memory(name: str, peer: Optional[Peer], x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module,
                    samples: int, device: torch.device) -> Tuple[List[int], Any]:
    """Peak increase of ``samples`` steps after one warm-up step (which allocates every ``.grad``).

    ``name`` is 'plain' or a schedule of ``Pipe.step``; returns the samples and, for a Pipe,
    its ``last_memory`` after the last step.
    """
    pipeline: Any = None
    model: Optional[nn.Module] = None
    step: Optional[Callable[[], None]] = None
    try:
        if peer is None:
            model = make_real_model(device)
            step = _loss_step(model, x, y, loss_fn)
        else:
            assert peer.make is not None
            pipeline = peer.make(make_real_model(device), MEMORY_CHUNKS, device, checkpoint="never")
            step = _pipe_step(pipeline, x, y, loss_fn, name)
        step()  # warm-up: .grad allocated, programs built, streams and cuBLAS workspaces created
        samples_ = [_peak_increase(step) for _ in range(samples)]
        record = getattr(pipeline, "last_memory", None) if pipeline is not None else None
        return samples_, record
    finally:
        if pipeline is not None:
            close_pipeline(pipeline)
        pipeline = model = step = None
        _empty_cache()


def _memory(options: Options, result: SuiteResult, peers: List[Peer], device: torch.device, repeats: int) -> None:
    p, m = PARTITIONS, MEMORY_CHUNKS
    table = Table(
        f"Activation memory on one GPU: the real-layers model, chunks={m}, checkpoint='never', one step; "
        "peak = max_memory_allocated() - memory_allocated() before the step (median of repeats)",
        [
            Column("batch", "batch"),
            Column("case", "case", align="<"),
            Column("peak_mib", "peak MiB", "{:.1f}"),
            Column("vs_gpipe", "x gpipe", "{:.3f}"),
            Column("vs_plain", "x plain", "{:.3f}"),
            Column("saved_mib", "last_memory MiB", "{:.1f}"),
            Column("saved_vs_gpipe", "last_memory x gpipe", "{:.3f}"),
            Column("worst_stage", "worst stage x gpipe", "{:.3f}"),
            Column("peak_mb", "peak mb/stage", align="<"),
        ],
    )
    table.notes.append(
        "last_memory = pipe.last_memory: bytes saved for backward, the sum over stages of each stage's peak (every "
        "saved tensor counts, parameters included: a Linear saves its weight for the input gradient, "
        f"{WIDTH * WIDTH * DTYPE.itemsize / MIB:.0f} MiB per Linear and micro-batch here, which is no new memory); "
        "worst stage = max over stages of its peak bytes / GPipe's on that stage; peak mb/stage = "
        "pipe.last_memory.peak_microbatches")
    table.notes.append(
        "peak also holds what does not shrink with the schedule: each stage's transient weight gradient "
        f"({WIDTH}x{WIDTH} {_dtype_name()} = {WIDTH * WIDTH * DTYPE.itemsize / MIB:.0f} MiB) before it is added to "
        f".grad, gradients in flight and the loss. At batch {MEMORY_BATCHES[0]} (the real-layers batch) the "
        f"activations are about as large as those; batch {MEMORY_BATCHES[-1]} (micro-batch {MEMORY_BATCHES[-1] // m}) "
        "lets them dominate, and the goal uses it")
    result.tables.append(table)
    result.notes.append(
        f"activation memory: all {p} stages share one GPU, so the CUDA peak is the sum over stages; the issue's goal "
        f"is per stage (1F1B's worst stage <= p/m = {p}/{m} of GPipe's), checked on pipe.last_memory, while the "
        f"CUDA-peak goal applies the same {GOAL_MEMORY:g} to the total")

    torchpipe = next((peer for peer in peers if peer.name == "torchpipe" and peer.available), None)
    loss_fn = nn.MSELoss()
    for batch in MEMORY_BATCHES:
        torch.manual_seed(2)
        x = torch.randn(batch, WIDTH, device=device, dtype=DTYPE)
        y = torch.randn(batch, WIDTH, device=device, dtype=DTYPE)
        peaks: Dict[str, float] = {}
        records: Dict[str, Any] = {}
        failed: Dict[str, str] = {}
        for name in ("plain", *MEMORY_SCHEDULES):
            options.say(f"cuda: activation memory batch={batch} {name}")
            if name != "plain" and torchpipe is None:
                failed[name] = "torchpipe unavailable"
                continue
            try:
                samples, record = _measure_memory(name, None if name == "plain" else torchpipe, x, y, loss_fn,
                                                  repeats, device)
            except Exception as exc:
                failed[name] = f"{type(exc).__name__}: {exc}"
                result.notes.append(f"activation memory: batch={batch} {name} failed: {failed[name]}")
                continue
            result.measurements[f"memory/batch={batch}/{name} peak increase bytes"] = samples
            peaks[name] = _median(samples)
            if record is not None:
                records[name] = record
                result.measurements[f"memory/batch={batch}/{name} last_memory"] = {
                    "peak_bytes": list(record.peak_bytes), "peak_microbatches": list(record.peak_microbatches)}
        del x, y

        gpipe_saved = records["gpipe"].peak_bytes if "gpipe" in records else None
        for name in ("plain", *MEMORY_SCHEDULES):
            label = "plain model, whole batch" if name == "plain" else f"Pipe.step(schedule={name!r})"
            if name in failed:
                table.add(batch=batch, case=f"{label}: unavailable: {failed[name]}")
                continue
            prefix = f"memory/batch={batch}/{name}"
            row: Dict[str, Any] = dict(batch=batch, case=label, peak_mib=peaks[name] / MIB)
            if name != "gpipe":
                row["vs_gpipe"] = result.ratio(f"{prefix} peak increase / gpipe's", peaks[name], peaks.get("gpipe"))
            if name != "plain":
                row["vs_plain"] = result.ratio(f"{prefix} peak increase / plain's", peaks[name], peaks.get("plain"))
            record = records.get(name)
            if record is not None:
                saved = sum(record.peak_bytes)
                row["saved_mib"] = saved / MIB
                row["peak_mb"] = str(record.peak_microbatches)
                if gpipe_saved is not None and name != "gpipe":
                    row["saved_vs_gpipe"] = result.ratio(f"{prefix} last_memory bytes / gpipe's", saved,
                                                         sum(gpipe_saved))
                    shares = [mine / theirs for mine, theirs in zip(record.peak_bytes, gpipe_saved) if theirs]
                    if shares:
                        row["worst_stage"] = result.ratio(f"{prefix} worst stage last_memory bytes / gpipe's",
                                                          max(shares), 1.0)
            table.add(**row)

    batch = MEMORY_BATCHES[-1]
    result.goals.append(Goal(f"batch={batch}: 1F1B peak activation memory / GPipe's (CUDA peak increase over one "
                             f"step, all {p} stages on one GPU)",
                             result.ratios.get(f"memory/batch={batch}/1f1b peak increase / gpipe's"), "<=",
                             GOAL_MEMORY))
    result.goals.append(Goal(f"batch={batch}: 1F1B worst stage bytes saved for backward / GPipe's (pipe.last_memory; "
                             f"target p/m = {p / m:.3f})",
                             result.ratios.get(f"memory/batch={batch}/1f1b worst stage last_memory bytes / gpipe's"),
                             "<=", p / m))
