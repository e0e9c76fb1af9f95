"""tests/test_reliability.py's concurrent failing/good calls, repeated, with the differences shown."""
import copy, sys, threading
import torch
from torch import nn
from torchpipe import Pipe

MARK = 12345.0

class FailIfMarked(nn.Module):
    def forward(self, x):
        if x[0, 0].item() == MARK:
            raise RuntimeError("marked input")
        return x * 1.0

worst, wrong, strict_misses, rounds = 0.0, [], 0, int(sys.argv[1]) if len(sys.argv) > 1 else 40
for r in range(rounds):
    model = nn.Sequential(FailIfMarked(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    pipe = Pipe(model, [2, 1, 1], devices=["cpu"] * 3, chunks=2, checkpoint="never")

    def bad():
        for i in range(30):
            x = torch.randn(4, 4); x[0, 0] = MARK
            try:
                pipe(x)
            except RuntimeError:
                pass

    def good():
        global worst, strict_misses
        for i in range(30):
            x = torch.randn(4, 4)
            out = pipe(x)
            want = reference(x)
            diff = (out - want).abs().max().item()
            worst = max(worst, diff)
            if not torch.allclose(out, want):
                strict_misses += 1
            if diff > 1e-4:
                wrong.append((r, i, diff, out.tolist(), want.tolist()))

    threads = [threading.Thread(target=f) for f in (bad, good)]
    [t.start() for t in threads]; [t.join() for t in threads]
    pipe.close()
# the same arithmetic without threads: micro-batches of 2 against the batch of 4
lin = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
m = 0.0
for _ in range(20000):
    x = torch.randn(4, 4)
    m = max(m, (torch.cat([lin(x[:2]), lin(x[2:])]) - lin(x)).abs().max().item())
print(f"leakprobe: {rounds} rounds x 30 good calls: worst diff {worst:.3g}, strict allclose misses {strict_misses}, "
      f"O(1) wrong {len(wrong)}; plain chunked-vs-whole worst diff {m:.3g}")
for w in wrong[:3]:
    print("WRONG", w)
