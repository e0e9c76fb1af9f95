"""Time ``pipe(x).sum().backward()`` at chunks = 1 whose forwards hold a generator's lock: quoted in docs/benchmarks.md.

``checkpoint='always'`` and ``reproducible=True`` put each forward in an RNG section; since
the thirty-seventh session such a call runs on the caller's thread like any other call of one
micro-batch (before, it kept to the workers, a thread hand-off per stage). ``except_last`` (no
section at chunks = 1) is the control. The ``overhead`` suite's model, one intra-op thread;
median of 15 repeats of 100 calls. Run it from each tree with the tree first on ``sys.path``:

    cd <tree> && PYTHONPATH=. /work/main/.venv/bin/python /work/main/docs/probe_rng_chunks1.py
"""
import time, statistics, torch, sys
from torchpipe import Pipe
from torchpipe.bench.overhead import make_model
torch.set_num_threads(1)
x=torch.randn(64,16)
for ck, rep in [("always", False), ("never", True), ("except_last", False)]:
    with Pipe(make_model(), [1,1,1,1], devices=['cpu']*4, chunks=1, checkpoint=ck, reproducible=rep) as pipe:
        for _ in range(100): pipe(x).sum().backward()
        ts=[]
        for r in range(15):
            t0=time.perf_counter()
            for _ in range(100): pipe(x).sum().backward()
            ts.append((time.perf_counter()-t0)/100*1e6)
        print(f"checkpoint={ck} reproducible={rep}: {statistics.median(ts):.1f} us per pipe(x)+backward")
