"""Where torchpipe's cost above the bare thread chain sits: quoted in docs/benchmarks.md.

The `overhead` suite's model (4 x Linear(16, 16), batch 64, checkpoint='never', one
intra-op thread) through `Pipe` and through `torchpipe.bench.thread_chain.ThreadChain`:
the node types of each output's autograd graph, then forward and backward timed apart
(median over 9 repeats of 30 steps, the two interleaved).

    .venv/bin/python docs/probe_overhead_split.py 8
    .venv/bin/python docs/probe_overhead_split.py 32
"""
import collections
import statistics
import sys
import time

import torch

from torchpipe import Pipe
from torchpipe.bench.overhead import make_model
from torchpipe.bench.thread_chain import ThreadChain


def graph_nodes(output: torch.Tensor) -> collections.Counter:
    seen, stack, counts = set(), [output.grad_fn], collections.Counter()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        counts[type(node).__name__] += 1
        stack.extend(child for child, _ in node.next_functions)
    return counts


def main(chunks: int) -> None:
    torch.set_num_threads(1)
    x = torch.randn(64, 16)
    cases = {"torchpipe": Pipe(make_model(), balance=[1, 1, 1, 1], devices=["cpu"] * 4, chunks=chunks,
                               checkpoint="never"),
             "bare threads": ThreadChain(list(make_model()), chunks)}
    for name, module in cases.items():
        print(f"{name} graph: {dict(sorted(graph_nodes(module(x)).items()))}")
    times = {name: ([], []) for name in cases}
    for _ in range(9):
        for name, module in cases.items():
            forward, backward = [], []
            for _ in range(30):
                start = time.perf_counter()
                output = module(x)
                middle = time.perf_counter()
                output.sum().backward()
                forward.append(middle - start)
                backward.append(time.perf_counter() - middle)
            times[name][0].append(statistics.median(forward))
            times[name][1].append(statistics.median(backward))
    for name, (forward, backward) in times.items():
        print(f"chunks={chunks} {name}: forward {statistics.median(forward) * 1e3:.3f} ms, "
              f"backward {statistics.median(backward) * 1e3:.3f} ms")
    cases["torchpipe"].close()
    cases["bare threads"].close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
