"""``rec``: embedding-cache training throughput and overlap, against TorchRec on the same data.

A DLRM-like model (bottom MLP on 13 dense features, 4 pooled embedding tables, concat
interaction, top MLP, BCE loss) on synthetic Criteo-like batches with Zipf keys. Cases,
all timed in the same run with interleaved repeats (the median is quoted), one batch per
call in steady state (the pipelines stay full between calls):

* ``torchpipe EmbCache pipelined``: `EmbCacheTrainPipeline`, host stages on 3 host threads;
* ``torchpipe EmbCache serial``: the same stages and cache, jobs of a clock run one after
  another (``overlap=False``): the no-overlap baseline;
* ``torchrec loop``: TorchRec ``DistributedModelParallel`` (gloo world of 1, CPU, table-wise,
  ``fused`` FBGEMM CPU kernel with row-wise Adagrad applied in backward), plain loop;
* ``torchrec TrainPipelineSparseDist``: the same DMP model under TorchRec's pipeline.

Sparse optimizer everywhere: row-wise Adagrad, lr 0.01; dense: SGD lr 0.01. The
torchpipe cache holds ``--cache-fraction`` of each table (at least the 3-batch protection
window). Then, with simulated device latency (sleeps that release the GIL, like
asynchronous kernels: compute per step, H2D of the batch, D2H/H2D of swapped rows at a
given bandwidth), pipelined vs serial again: the overlap an accelerator would get.

``python -m torchpipe.bench rec [--quick]`` or, with size flags,
``python -m torchpipe.bench.rec --rows 1000000 --dim 64 --batch 2048 --pooling 20``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .registry import Options
from .report import Column, SuiteResult, Table, print_suite
from .timing import compare
from ..workers import available_cores

DENSE_IN = 13


@dataclass(frozen=True)
class RecConfig:
    tables: int = 4
    rows: int = 1_000_000
    dim: int = 64
    batch: int = 2048
    pooling: int = 20
    alpha: float = 1.05
    cache_fraction: float = 0.1
    pool_batches: int = 12
    host_threads: int = 3
    sim_compute_ms: float = 20.0
    sim_bandwidth_gbs: float = 16.0
    torchrec: bool = True


QUICK = RecConfig(rows=100_000, dim=32, batch=512, pooling=10, pool_batches=8, sim_compute_ms=5.0)


# -- data ---------------------------------------------------------------------------------
def zipf_sampler(rows: int, alpha: float, seed: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    """Keys with Zipf(alpha) popularity, hot keys spread over the table (inverse-CDF sampling)."""
    cdf = torch.cumsum(1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** alpha, 0)
    cdf /= cdf[-1].clone()
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))

    def sample(n: int, g: torch.Generator) -> torch.Tensor:
        ranks = torch.searchsorted(cdf, torch.rand(n, generator=g, dtype=torch.float64)).clamp_(max=rows - 1)
        return perm[ranks]

    return sample


def make_batches(cfg: RecConfig, seed: int = 0) -> List[Any]:
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    g = torch.Generator().manual_seed(seed)
    samplers = [zipf_sampler(cfg.rows, cfg.alpha, seed=100 + t) for t in range(cfg.tables)]
    batches = []
    for _ in range(cfg.pool_batches):
        values = torch.cat([s(cfg.batch * cfg.pooling, g) for s in samplers])
        lengths = torch.full((cfg.tables * cfg.batch,), cfg.pooling, dtype=torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync([f"f{t}" for t in range(cfg.tables)], values, lengths)
        batches.append(Batch(torch.randn(cfg.batch, DENSE_IN, generator=g), kjt,
                             torch.randint(0, 2, (cfg.batch,), generator=g).float()))
    return batches


def table_configs(cfg: RecConfig, meta: bool = False) -> list:
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(num_embeddings=cfg.rows, embedding_dim=cfg.dim, name=f"t{t}", feature_names=[f"f{t}"])
            for t in range(cfg.tables)]


# -- model --------------------------------------------------------------------------------
class DLRMLike(nn.Module):
    """Bottom MLP, pooled embeddings, concat, top MLP; ``model(batch) -> (loss, (loss, logits))``."""

    def __init__(self, ebc: nn.Module, cfg: RecConfig, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.ebc = ebc
        self.bottom = nn.Sequential(nn.Linear(DENSE_IN, 256), nn.ReLU(), nn.Linear(256, cfg.dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(cfg.dim * (cfg.tables + 1), 256), nn.ReLU(), nn.Linear(256, 1))
        self.sim_compute_s = 0.0

    def forward(self, batch: Any):
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.top(torch.cat([self.bottom(batch.dense_features), pooled], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        if self.sim_compute_s:
            time.sleep(self.sim_compute_s)  # an accelerator's fwd+bwd: the host thread waits, GIL released
        return loss, (loss.detach(), logits.detach())


def dense_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for n, p in model.named_parameters() if "ebc" not in n], lr=0.01)


def window_minimum(cfg: RecConfig, batches: Sequence[Any], window: int = 3) -> int:
    best = 0
    for i in range(len(batches)):
        chunk = [batches[(i + k) % len(batches)] for k in range(window)]
        for t in range(cfg.tables):
            keys = torch.cat([b.sparse_features[f"f{t}"].values() for b in chunk])
            best = max(best, int(torch.unique(keys).numel()))
    return best


def build_torchpipe(cfg: RecConfig, cache_rows: int, overlap: bool):
    from ..rec import CachedEmbeddingBagCollection, RowWiseAdagrad
    from ..train import EmbCacheTrainPipeline

    weights = {f"t{t}": torch.empty(cfg.rows, cfg.dim).uniform_(-0.01, 0.01) for t in range(cfg.tables)}
    ebc = CachedEmbeddingBagCollection(table_configs(cfg), cache_rows, optimizer=RowWiseAdagrad(lr=0.01),
                                       weights=weights)
    model = DLRMLike(ebc, cfg)
    cores = available_cores()
    pipe = EmbCacheTrainPipeline(model, dense_optimizer(model), host_threads=cfg.host_threads,
                                 device_threads=max(1, cores - 1), overlap=overlap)
    return model, pipe


def build_torchrec(cfg: RecConfig):
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad as TorchRecRowWiseAdagrad

    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="torchpipe-bench-"), "init")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    ebc = EmbeddingBagCollection(table_configs(cfg), device=torch.device("meta"))
    model = DLRMLike(ebc, cfg)
    apply_optimizer_in_backward(TorchRecRowWiseAdagrad, model.ebc.parameters(), {"lr": 0.01})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"))
    return dmp, dense_optimizer(dmp)


# -- simulated latency ---------------------------------------------------------------------
def simulate_latency(model: DLRMLike, pipe: Any, cfg: RecConfig) -> Callable[[], None]:
    """Sleeps for compute and for copies of swapped rows / the batch; returns an undo."""
    ebc = pipe.collection
    bandwidth = cfg.sim_bandwidth_gbs * 1e9
    originals = {name: getattr(ebc, name) for name in ("gather_out", "scatter_in")}

    def gather_out(plan):
        rows = originals["gather_out"](plan)
        time.sleep(sum(r.numel() * r.element_size() for r in rows.values()) / bandwidth)  # D2H
        return rows

    def scatter_in(plan, rows):
        time.sleep(sum(r.numel() * r.element_size() for r in rows.values()) / bandwidth)  # H2D
        return originals["scatter_in"](plan, rows)

    ebc.gather_out, ebc.scatter_in = gather_out, scatter_in
    model.sim_compute_s = cfg.sim_compute_ms / 1000.0

    def undo() -> None:
        for name in originals:
            delattr(ebc, name)
        model.sim_compute_s = 0.0

    return undo


# -- the suite ------------------------------------------------------------------------------
def host_seconds_per_batch(pipe: Any) -> float:
    staged = pipe.pipeline
    host = sum(t for s, t, w in zip(staged.stages, staged.stage_seconds, staged.stage_workers) if w >= 2)
    return host / max(1, staged.clocks_run)


def run_config(cfg: RecConfig, options: Options) -> SuiteResult:
    timing = options.timing(target_s=2.0, quick_target_s=0.3, warmup=4, min_iters=3)
    result = SuiteResult(
        "rec",
        f"DLRM-like, {cfg.tables} tables x {cfg.rows:,} rows x dim {cfg.dim}, batch {cfg.batch}, pooling "
        f"{cfg.pooling}, Zipf({cfg.alpha}) keys, row-wise Adagrad (sparse) + SGD (dense), CPU",
        config={**asdict(cfg), "repeats": timing.repeats, "target_s": timing.target_s},
    )
    torch.manual_seed(0)
    options.say("rec: generating batches")
    batches = make_batches(cfg)
    minimum = window_minimum(cfg, batches)
    cache_rows = min(cfg.rows, max(int(cfg.cache_fraction * cfg.rows), int(minimum * 1.1)))
    result.config.update(cache_rows=cache_rows, window_minimum=minimum)
    options.say(f"rec: building models (cache {cache_rows} rows/table, window minimum {minimum})")
    pipe_model, pipelined = build_torchpipe(cfg, cache_rows, overlap=True)
    serial_model, serial = build_torchpipe(cfg, cache_rows, overlap=False)
    cases: Dict[str, Callable[[], object]] = {}
    iters = {name: itertools.cycle(batches) for name in ("pipe", "serial", "loop", "sparsedist")}
    cases["torchpipe EmbCache pipelined"] = lambda: pipelined.progress(iters["pipe"])
    cases["torchpipe EmbCache serial"] = lambda: serial.progress(iters["serial"])
    if cfg.torchrec:
        try:
            from torchrec.distributed.train_pipeline import TrainPipelineSparseDist as TorchRecSparseDist

            from ..train import train_step

            loop_model, loop_opt = build_torchrec(cfg)
            sd_model, sd_opt = build_torchrec(cfg)
            sparsedist = TorchRecSparseDist(sd_model, sd_opt, torch.device("cpu"))
            cases["torchrec loop"] = lambda: train_step(loop_model, loop_opt, next(iters["loop"]))
            cases["torchrec TrainPipelineSparseDist"] = lambda: sparsedist.progress(iters["sparsedist"])
        except Exception as exc:  # pragma: no cover - torchrec missing or broken
            result.notes.append(f"torchrec baselines unavailable: {type(exc).__name__}: {exc}")
    options.say(f"rec: timing {len(cases)} cases")
    measured = compare(cases, timing)
    serial_host = host_seconds_per_batch(serial)

    options.say("rec: simulated device latency")
    undo = [simulate_latency(pipe_model, pipelined, cfg), simulate_latency(serial_model, serial, cfg)]
    for pipe in (pipelined, serial):  # fresh stage counters for the simulated run
        pipe.pipeline.stage_seconds = [0.0] * pipe.pipeline.depth
        pipe.pipeline.clocks_run = 0
    sim_timing = replace(timing, target_s=timing.target_s / 2)
    sim = compare({"sim pipelined": cases["torchpipe EmbCache pipelined"],
                   "sim serial": cases["torchpipe EmbCache serial"]}, sim_timing)
    sim_host = host_seconds_per_batch(serial)
    for u in undo:
        u()

    table = Table("throughput (median of repeats; one batch per call, pipelines kept full)", [
        Column("case", "case", "{}", "<"), Column("ms", "ms/batch", "{:.1f}"),
        Column("sps", "samples/s", "{:,.0f}"), Column("vs_loop", "vs torchrec loop", "{:.2f}x"),
        Column("vs_serial", "vs serial", "{:.2f}x"), Column("spread", "spread", "{:.0%}")])
    base = measured.get("torchrec loop")
    for name, m in list(measured.items()) + list(sim.items()):
        ref_serial = sim["sim serial"] if name.startswith("sim") else measured["torchpipe EmbCache serial"]
        table.add(case=name, ms=m.median * 1e3, sps=cfg.batch / m.median,
                  vs_loop=(base.median / m.median) if base is not None and not name.startswith("sim") else None,
                  vs_serial=ref_serial.median / m.median, spread=m.spread)
    hit = pipelined.hit_rate()
    overlap = Table("overlap and cache", [Column("what", "quantity", "{}", "<"), Column("value", "value", "{}")])

    def hidden(serial_s: float, pipe_s: float, host_s: float) -> Optional[float]:
        return max(0.0, min(1.0, (serial_s - pipe_s) / host_s)) if host_s > 0 else None

    real_hidden = hidden(measured["torchpipe EmbCache serial"].median,
                         measured["torchpipe EmbCache pipelined"].median, serial_host)
    sim_hidden = hidden(sim["sim serial"].median, sim["sim pipelined"].median, sim_host)
    overlap.add(what="hit rate (unique keys, all tables)", value=f"{hit:.1%}")
    overlap.add(what="cache rows per table (share of table)", value=f"{cache_rows:,} ({cache_rows / cfg.rows:.0%})")
    overlap.add(what="host work per batch, serial run (ms)", value=f"{serial_host * 1e3:.1f}")
    overlap.add(what="share of host work hidden (CPU compute)",
                value=f"{real_hidden:.0%}" if real_hidden is not None else "-")
    overlap.add(what=f"share of host work hidden (simulated: {cfg.sim_compute_ms:g} ms compute, "
                     f"{cfg.sim_bandwidth_gbs:g} GB/s copies)", value=f"{sim_hidden:.0%}" if sim_hidden is not None else "-")
    stage_ms = {s.name: f"{t / max(1, serial.pipeline.clocks_run) * 1e3:.1f}"
                for s, t in zip(serial.pipeline.stages, serial.pipeline.stage_seconds)}
    overlap.add(what="per-stage ms/batch (serial, simulated run)", value=", ".join(f"{k} {v}" for k, v in stage_ms.items()))
    result.tables += [table, overlap]
    result.ratio("pipelined_vs_serial", measured["torchpipe EmbCache serial"].median,
                 measured["torchpipe EmbCache pipelined"].median)
    result.ratio("sim_pipelined_vs_sim_serial", sim["sim serial"].median, sim["sim pipelined"].median)
    if base is not None:
        result.ratio("pipelined_vs_torchrec_loop", base.median, measured["torchpipe EmbCache pipelined"].median)
        if "torchrec TrainPipelineSparseDist" in measured:
            result.ratio("torchrec_sparsedist_vs_loop", base.median,
                         measured["torchrec TrainPipelineSparseDist"].median)
    result.config["hit_rate"] = hit
    result.notes.append("torchrec cases: DistributedModelParallel on CPU, gloo world of 1, sharding plan table_wise/"
                        "fused (FBGEMM CPU TBE, row-wise Adagrad fused in backward); the full tables live in host "
                        "memory there too, with no cache: it is the 'everything on the host' baseline")
    result.notes.append("torchpipe cases: host tables + a device-row cache (here the 'device' is the CPU, so swaps "
                        "are memcpys); serial = same stages and cache, no two jobs at once")
    schedule = pipelined.schedule_table(4)
    result.notes.append("schedule (first 4 batches):\n" + schedule)
    for pipe in (pipelined, serial):
        pipe.close()
    return result


def run(options: Options) -> SuiteResult:
    return run_config(QUICK if options.quick else RecConfig(), options)


def main(argv: Optional[Sequence[str]] = None) -> SuiteResult:
    parser = argparse.ArgumentParser(prog="python -m torchpipe.bench.rec", description=__doc__.split("\n")[0])
    defaults = RecConfig()
    parser.add_argument("--quick", action="store_true", help="small sizes (100k rows, dim 32, batch 512)")
    parser.add_argument("--repeats", type=int, default=None)
    for name in ("tables", "rows", "dim", "batch", "pooling", "host_threads", "pool_batches"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    for name in ("alpha", "cache_fraction", "sim_compute_ms", "sim_bandwidth_gbs"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=None)
    parser.add_argument("--no-torchrec", action="store_true")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else defaults
    changes = {k: v for k, v in vars(args).items() if k in RecConfig.__dataclass_fields__ and v is not None}
    if args.no_torchrec:
        changes["torchrec"] = False
    cfg = replace(cfg, **changes)
    result = run_config(cfg, Options(repeats=args.repeats, quick=args.quick))
    print_suite(result)
    return result


if __name__ == "__main__":
    main()
