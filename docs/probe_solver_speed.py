"""What the balance solver's second pass costs: the most even optimal split against any optimum.

Until the twenty-fourth session the solver took, of the optimal splits, the one whose last
blocks start as late as possible; it now takes the most even (least sum of squared block
sums, then of squared layer counts), a second dynamic program over the same exact integers.
This times ``blockpartition`` of this tree against the solver of an earlier commit (read with
``git show``), on random float costs, median of 3.

    .venv/bin/python docs/probe_solver_speed.py [old commit, default 5399d70]
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time
import types

from torchpipe.balance import solver as new_solver


def old_solver(commit: str) -> types.ModuleType:
    source = subprocess.run(["git", "show", f"{commit}:torchpipe/balance/solver.py"], check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("old_solver")
    exec(compile(source, f"{commit}:solver.py", "exec"), module.__dict__)  # noqa: S102 - our own file
    return module


def main() -> None:
    old = old_solver(sys.argv[1] if len(sys.argv) > 1 else "5399d70")
    rng = random.Random(0)
    print("layers partitions  old s  new s  new/old")
    for n, p in ((600, 16), (2000, 64), (5000, 64)):
        costs = [rng.random() for _ in range(n)]
        medians = []
        for module in (old, new_solver):
            times = []
            for _ in range(3):
                began = time.perf_counter()
                module.blockpartition(costs, p)
                times.append(time.perf_counter() - began)
            medians.append(statistics.median(times))
        print(f"{n:6d} {p:10d} {medians[0]:6.3f} {medians[1]:6.3f} {medians[1] / medians[0]:8.2f}")


if __name__ == "__main__":
    main()
