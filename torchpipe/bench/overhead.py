"""``overhead``: runtime cost per (stage, micro-batch), against the same model without a pipeline.

The model is tiny (4 x Linear(16, 16), batch 64), so a step is almost all runtime: task
hand-off, queues, scatter/gather, autograd glue. The baseline that isolates the runtime
is the plain model looped over the same micro-batches, with the outputs concatenated and
one backward, which is exactly the arithmetic a pipeline does. Hence

    overhead per (stage, micro-batch) fwd+bwd = (pipeline step - chunked-loop step) / (stages x chunks)

for torchpipe, torchgpipe and fairscale, all timed in the same run (interleaved repeats).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .peers import PEER_NAMES, SHIMS_APPLIED, THREADS, Peer, build_peers, close_pipeline, load_peers, release
from .registry import Options
from .report import Column, Goal, SuiteResult, Table
from .stats import paired_median_interval
from .timing import Measurement, compare

STAGES = 4
WIDTH = 16
BATCH = 64
CHUNKS = (1, 8, 32)
GOAL_US = 25.0
GOAL_VS_TORCHGPIPE = 3.5
INTRA_OP_THREADS = 1
"""Intra-op threads for the caller and every thread it starts. At this size intra-op
parallelism buys nothing, and on a shared 2-core machine an OpenMP team whose second
thread is descheduled turns the whole-batch baseline into 100x outliers (seen: 142 ms
instead of 0.5 ms per step). torchpipe's workers cap themselves to 1 here anyway."""


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(STAGES)])


def _step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model(x).sum().backward()

    return step


def _chunked_step(model: nn.Module, x: torch.Tensor, chunks: int) -> Callable[[], None]:
    def step() -> None:
        torch.cat([model(c) for c in x.chunk(chunks)]).sum().backward()

    return step


def _build(peer: Peer, chunks: int, x: torch.Tensor, expected: torch.Tensor) -> nn.Module:
    """Build the pipeline and check one step against the plain model before timing it."""
    assert peer.make is not None
    pipeline = peer.make(make_model(), chunks)
    try:
        out = pipeline(x)
        if not torch.allclose(out, expected, atol=1e-5):
            raise RuntimeError("output differs from the plain model")
        out.sum().backward()
    except BaseException:
        close_pipeline(pipeline)
        raise
    return pipeline


def overhead_tables(steps_title: str, summary_title: str) -> Tuple[Table, Table]:
    """The step-time table and the per-(stage, micro-batch) summary, shared with the cuda suite."""
    steps = Table(steps_title, [
        Column("chunks", "chunks"),
        Column("case", "case", align="<"),
        Column("step_ms", "step ms", "{:.3f}"),
        Column("spread", "spread", "{:.0%}"),
        Column("iters", "iters/repeat"),
        Column("vs_plain", "x plain", "{:.2f}"),
        Column("vs_loop", "x loop", "{:.2f}"),
        Column("overhead_us", "overhead us/(stage,mb)", "{:.1f}"),
    ])
    summary = Table(summary_title, [
        Column("chunks", "chunks"),
        Column("torchpipe", "torchpipe us", "{:.1f}"),
        Column("torchgpipe", "torchgpipe us", "{:.1f}"),
        Column("fairscale", "fairscale us", "{:.1f}"),
        Column("threads", "bare threads us", "{:.1f}"),
        Column("tp_over_floor", "torchpipe - bare threads us", "{:.1f}"),
        Column("tg_over_tp", "torchgpipe/torchpipe", "{:.2f}x"),
        Column("fs_over_tp", "fairscale/torchpipe", "{:.2f}x"),
        Column("goal_us", f"<= {GOAL_US:g} us", align="<"),
        Column("goal_ratio", f">= {GOAL_VS_TORCHGPIPE:g}x less", align="<"),
    ])
    return steps, summary


def report_chunks(result: SuiteResult, steps: Table, summary: Table, chunks: int, measured: Dict[str, Measurement],
                  unavailable: Dict[str, str], labels: Dict[str, str], key_prefix: str = "",
                  goal_prefix: str = "") -> None:
    """Rows, ratios and goals of one chunk count: overhead = (pipe - loop) / (stages x chunks)."""
    plain = measured["plain"].median
    loop = measured["loop"].median
    overhead: Dict[str, Optional[float]] = {}
    for name in labels:
        if name in unavailable:
            steps.add(chunks=chunks, case=f"{labels[name]}: unavailable: {unavailable[name]}")
            overhead[name] = None
            continue
        m = measured[name]
        row: Dict[str, Any] = dict(chunks=chunks, case=labels[name], step_ms=m.median * 1e3, spread=m.spread,
                                   iters=m.iters, vs_plain=m.median / plain, vs_loop=m.median / loop)
        if name != "plain":
            result.ratio(f"{key_prefix}chunks={chunks}/{name} step / plain step", m.median, plain)
        if name not in ("plain", "loop"):
            overhead[name] = (m.median - loop) / (STAGES * chunks)
            row["overhead_us"] = overhead[name] * 1e6
            result.ratio(f"{key_prefix}chunks={chunks}/{name} step / loop step", m.median, loop)
        steps.add(**row)

    tp = overhead.get("torchpipe")
    summary_row: Dict[str, Any] = dict(chunks=chunks)
    for name in ("torchpipe", "torchgpipe", "fairscale", THREADS):
        value = overhead.get(name)
        summary_row[name] = None if value is None else value * 1e6
    floor = overhead.get(THREADS)
    if tp is not None and floor is not None:
        summary_row["tp_over_floor"] = (tp - floor) * 1e6
        result.ratio(f"{key_prefix}chunks={chunks}/torchpipe overhead / bare threads overhead", tp, floor)
    summary_row["tg_over_tp"] = result.ratio(f"{key_prefix}chunks={chunks}/torchgpipe overhead / torchpipe overhead",
                                             overhead.get("torchgpipe"), tp)
    summary_row["fs_over_tp"] = result.ratio(f"{key_prefix}chunks={chunks}/fairscale overhead / torchpipe overhead",
                                             overhead.get("fairscale"), tp)
    per_stage_mb = STAGES * chunks
    loop_samples = measured["loop"].samples
    us_interval = ratio_interval = None
    if tp is not None:
        us_interval = paired_median_interval(lambda pipe, loop: (pipe - loop) / per_stage_mb * 1e6,
                                             measured["torchpipe"].samples, loop_samples)
        if overhead.get("torchgpipe") is not None:
            ratio_interval = paired_median_interval(lambda tg, pipe, loop: (tg - loop) / (pipe - loop),
                                                    measured["torchgpipe"].samples, measured["torchpipe"].samples,
                                                    loop_samples)
    goal_us = Goal(f"{goal_prefix}chunks={chunks}: torchpipe overhead per (stage, mb), us",
                   None if tp is None else tp * 1e6, "<=", GOAL_US, us_interval)
    goal_ratio = Goal(f"{goal_prefix}chunks={chunks}: torchgpipe overhead / torchpipe overhead",
                      summary_row["tg_over_tp"], ">=", GOAL_VS_TORCHGPIPE, ratio_interval)
    summary_row["goal_us"], summary_row["goal_ratio"] = goal_us.status, goal_ratio.status
    result.goals += [goal_us, goal_ratio]
    summary.add(**summary_row)


def thread_handoff_us(rounds: int) -> float:
    """Microseconds per lock ping-pong round trip between two threads: the cost of waking a thread here."""
    ping, pong = threading.Lock(), threading.Lock()
    ping.acquire()
    pong.acquire()

    def partner() -> None:
        for _ in range(rounds):
            ping.acquire()
            pong.release()

    thread = threading.Thread(target=partner, name="bench-handoff")
    thread.start()
    start = time.perf_counter()
    for _ in range(rounds):
        ping.release()
        pong.acquire()
    elapsed = time.perf_counter() - start
    thread.join()
    return elapsed / rounds * 1e6


def run(options: Options) -> SuiteResult:
    """Time every case with one intra-op thread per thread (see ``INTRA_OP_THREADS``)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(INTRA_OP_THREADS)
    try:
        return _run(options)
    finally:
        torch.set_num_threads(previous)


def _run(options: Options) -> SuiteResult:
    config = options.timing(target_s=0.2, quick_target_s=0.01)
    result = SuiteResult(
        "overhead",
        f"runtime overhead per (stage, micro-batch), {STAGES} x Linear({WIDTH},{WIDTH}), batch {BATCH}, "
        "checkpoint='never', forward+backward, CPU",
        config={"repeats": config.repeats, "warmup": config.warmup, "target_s_per_repeat": config.target_s,
                "chunks": list(CHUNKS), "intra_op_threads": torch.get_num_threads(), "quick": options.quick},
    )
    peers = load_peers(PEER_NAMES + (THREADS,))
    x = torch.randn(BATCH, WIDTH)
    with torch.no_grad():
        expected = make_model()(x)

    steps, summary = overhead_tables("Step time (median of repeats; 'spread' = (max-min)/median over repeats)",
                                     "Runtime overhead per (stage, micro-batch) fwd+bwd, us = (pipe step - "
                                     "chunked-loop step) / (stages x chunks)")
    steps.notes.append(
        "plain = model(x) on the whole batch; loop = torch.cat([model(c) for c in x.chunk(chunks)]).sum().backward(), "
        "the same arithmetic as a pipeline without its runtime"
    )
    result.tables += [steps, summary]
    for peer in peers:
        if not peer.available:
            result.notes.append(f"{peer.label} unavailable: {peer.reason}")

    for chunks in CHUNKS:
        options.say(f"overhead: chunks={chunks}")
        cases: Dict[str, Callable[[], None]] = {
            "plain": _step(make_model(), x),
            "loop": _chunked_step(make_model(), x, chunks),
        }
        built, unavailable = build_peers(peers, lambda peer: _build(peer, chunks, x, expected), f"chunks={chunks}",
                                         result.notes)
        pipelines: List[nn.Module] = list(built.values())
        cases.update({name: _step(pipeline, x) for name, pipeline in built.items()})
        del built
        try:
            measured = compare(cases, config)
        finally:
            release(pipelines, cases)
        for name, m in measured.items():
            result.measurements[f"chunks={chunks}/{name}"] = m.to_json()

        labels = {"plain": "plain model, whole batch", "loop": "plain model, chunked loop"}
        labels.update({p.name: p.label for p in peers})
        report_chunks(result, steps, summary, chunks, measured, unavailable, labels)

    if SHIMS_APPLIED:
        result.notes += [f"shim applied: {s}" for s in SHIMS_APPLIED]
    else:
        result.notes.append("no shims needed: torchgpipe and fairscale import and run unmodified with torch "
                            f"{torch.__version__}")
    versions = ", ".join(f"{p.name} {p.version}" for p in peers if p.available and p.version)
    result.notes.append(f"versions: {versions}")
    result.notes.append(f"torch.set_num_threads({INTRA_OP_THREADS}) for the whole suite (caller and every thread "
                        "it starts), so that all cases run with the same intra-op threading")
    result.notes.append("each pipeline's output was checked against the plain model before timing")
    result.notes.append(
        "bare threads = torchpipe.bench.thread_chain: a thread per stage and a queue between neighbours, nothing "
        "else (no plan, timings, error recovery or devices); its overhead is what threads alone cost on this "
        "machine, and 'torchpipe - bare threads' what the runtime adds on top. At chunks=1 the plan is one chain "
        "and torchpipe runs it on the caller's thread, with no hand-off, so it may come in below that floor"
    )
    handoff = thread_handoff_us(2000 if options.quick else 20000)
    result.config["thread_handoff_round_trip_us"] = round(handoff, 1)
    result.notes.append(
        f"this machine's thread hand-off: a lock ping-pong between two threads takes {handoff:.1f} us per round trip "
        "(measured now). A pipeline pays at least one hand-off per (stage, micro-batch) it runs on a thread of "
        "its own, and one GIL hand-off per torch op while several stages run; where a round trip costs hundreds of us, that bounds the overhead from below"
    )
    if options.quick:
        result.notes.append("quick run: few short repeats, figures are indicative only")
    return result
