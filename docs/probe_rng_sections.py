"""Time one RNG section's taking and giving back, and a recompute context: quoted in docs/benchmarks.md.

Every checkpointed or reproducible forward on a shared generator, and every recompute of a
checkpointed forward that drew, enters and leaves such a section. The thirty-seventh session
made them safe against a Ctrl-C (``call_chain.HeldLock``); this measures what that costs.
Median of 5 x (min of 5 repeats of 2000 calls). Run it from each tree:

    cd <tree> && PYTHONPATH=. /work/main/.venv/bin/python /work/main/docs/probe_rng_sections.py
"""
import timeit, torch, statistics
from torchpipe import call_chain
from torchpipe.checkpoint import _lock_for, RNGGuard
g = torch.Generator()
lock = _lock_for(g)
def pair():
    call_chain.leave_rng_section(call_chain.enter_rng_section(g, lock))
guard = RNGGuard(torch.device("cpu"), shared=True); guard.generator, guard.lock = g, lock
rep = guard.new_replay(True)
with guard.forward_section(True):
    with rep.forward_context(): torch.rand(2, generator=g)
def rec():
    with rep.recompute_context(): pass
for name, fn in [("enter+leave", pair), ("recompute context", rec)]:
    ts = [min(timeit.repeat(fn, number=2000, repeat=5)) / 2000 * 1e6 for _ in range(5)]
    print(f"{name}: {statistics.median(ts):.2f} us")
