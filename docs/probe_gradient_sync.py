"""What GradientSync's overlap buys: quoted in docs/benchmarks.md.

Two gloo ranks on this machine, each a Pipe of 4 partitions (Linear(W, W) + Tanh), 1f1b,
8 micro-batches of a 64-sample batch. Per step, in the same run: the step alone
(`no_sync()`), the step with GradientSync (each partition's all-reduce started after its
last backward action), and the step under `no_sync()` followed by `sync.all_reduce()` (the
same all-reduces, after the step). Median over 7 repeats of 20 steps, rank 0's timing.

    W=256 .venv/bin/python docs/probe_gradient_sync.py
"""
import os, time, statistics, tempfile, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn
W = int(os.environ.get("W", "256"))
def run(rank, world, f, out):
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{f}', rank=rank, world_size=world)
    from torchpipe import Pipe, GradientSync
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(4)])
    pipe = Pipe(model, balance=[1, 1, 1, 1], devices=['cpu'] * 4, chunks=8, checkpoint='never')
    sync = GradientSync(pipe, broadcast_buffers=False)
    x, y = torch.randn(64, W), torch.randn(64, W)
    def overlapped():
        pipe.step(x, y, nn.MSELoss())
    def after():
        with sync.no_sync():
            pipe.step(x, y, nn.MSELoss())
        sync.all_reduce()
    def local():
        with sync.no_sync():
            pipe.step(x, y, nn.MSELoss())
    res = {k: [] for k in ("local", "overlapped", "after")}
    for rep in range(7):
        for name, fn in (("local", local), ("overlapped", overlapped), ("after", after)):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(20):
                pipe.zero_grad(); fn()
            res[name].append((time.perf_counter() - t) / 20)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
        with open(out, "w") as fh:
            fh.write(repr(med))
    dist.destroy_process_group()
if __name__ == '__main__':
    f = tempfile.mktemp(); out = tempfile.mktemp()
    mp.spawn(run, args=(2, f, out), nprocs=2)
    med = eval(open(out).read())
    print(f"W={W}: step ms (median of 7 x 20): local {med['local']:.2f}, GradientSync {med['overlapped']:.2f}, "
          f"no_sync + all_reduce() after {med['after']:.2f}; sync cost overlapped {med['overlapped']-med['local']:.2f} "
          f"vs after {med['after']-med['local']:.2f}")
