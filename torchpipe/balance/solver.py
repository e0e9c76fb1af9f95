"""Optimal split of a cost sequence into consecutive blocks (the "linear partition" problem).

Balancing a pipeline means cutting a sequence of per-layer costs into exactly ``partitions``
non-empty runs of consecutive layers so that the most expensive run -- the one that bounds
the pipeline's throughput -- is as cheap as possible. torchgpipe used a heuristic (Bárány et
al.) that is not always optimal; this module returns an optimum.

Exactness: every cost is converted to an exact rational (a float is exactly ``m / 2**e``) and
all costs are scaled to integers over their common denominator, so block sums are computed
without rounding. Two splits whose float sums would round to the same value are therefore
still told apart correctly, and the result is deterministic.

Algorithm: dynamic programming over (blocks, prefix length) in ``O(partitions * n * log n)``.
``best[j][i]`` is the smallest possible largest block when the first ``i`` costs form ``j``
blocks. With non-negative costs ``best[j - 1][s]`` is non-decreasing in ``s`` and the last
block's sum ``prefix[i] - prefix[s]`` is non-increasing in ``s``, so the best split point is
found by bisection at their crossing.

Tie-break (deterministic): of the optimal splits, the last block starts as late as possible;
the layers before it are, recursively, an optimal split of their own chosen the same way. So
every prefix of the plan is itself optimally balanced, and zero-cost layers at the end go to
the last block.
"""
from __future__ import annotations

import math
import operator
from fractions import Fraction
from numbers import Integral, Rational, Real
from typing import Iterable, List, Sequence

__all__ = ["blockpartition", "balance_by_cost"]


def blockpartition(costs: Sequence[float], partitions: int) -> List[List[int]]:
    """Split ``costs`` into ``partitions`` consecutive non-empty blocks minimising the largest sum.

    Returns the indices of the costs in each block, e.g. ``[[0, 1], [2], [3, 4]]``. Why indices
    and not costs: a caller maps them back to layers without searching for equal values.

    Raises ``ValueError`` when ``partitions < 1``, when there are fewer costs than partitions,
    or when a cost is negative, NaN or infinite; ``TypeError`` when ``partitions`` is not an
    integer or a cost is not a real number.
    """
    scaled = _exact_integers(costs)
    partitions = check_partitions(partitions, len(scaled))
    starts = _optimal_block_starts(scaled, partitions)
    ends = starts[1:] + [len(scaled)]
    return [list(range(start, end)) for start, end in zip(starts, ends)]


def _solve(sequence: Sequence[float], partitions: int = 1) -> List[List[float]]:
    """torchgpipe's ``blockpartition.solve(sequence, partitions)``: the blocks as lists of the costs.

    Code written against torchgpipe (``from torchgpipe.balance import blockpartition``) calls
    this; it gets the optimal split of :func:`blockpartition` (the smallest largest block),
    where torchgpipe's heuristic minimised the blocks' variance and may cut elsewhere.
    """
    return [[sequence[i] for i in block] for block in blockpartition(sequence, partitions)]


blockpartition.solve = _solve  # type: ignore[attr-defined]


def balance_by_cost(costs: Sequence[float], partitions: int) -> List[int]:
    """Number of consecutive layers per partition for an optimal split of ``costs``.

    This is the ``balance`` argument a pipe takes; it is :func:`blockpartition` with each
    block replaced by its length.
    """
    return [len(block) for block in blockpartition(costs, partitions)]


def as_count(name: str, value: int) -> int:
    """``value`` as an int of at least 1 (NumPy and 0-dim tensor integers too), else TypeError/ValueError."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be at least 1 (got {number} < 1)")
    return number


def check_partitions(partitions: int, length: int) -> int:
    """``partitions`` as an int (NumPy and 0-dim tensor integers too) that can split ``length`` layers."""
    partitions = as_count("partitions", partitions)
    if partitions > length:
        raise ValueError(
            f"more partitions than layers: cannot split {length} layers into {partitions} "
            f"non-empty partitions ({partitions} > {length})"
        )
    return partitions


def _exact_integers(costs: Sequence[float]) -> List[int]:
    """Scale the costs to integers over their common denominator, exactly."""
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Iterable):
        raise TypeError(f"costs must be a sequence of real numbers, one per layer, got {costs!r}")
    fractions: List[Fraction] = []
    for index, cost in enumerate(costs):
        if isinstance(cost, bool) or not isinstance(cost, Real):
            raise TypeError(f"cost {index} is not a real number: {cost!r}")
        if not isinstance(cost, Integral) and not math.isfinite(float(cost)):  # ints are exact, any size
            raise ValueError(f"cost {index} must be finite, got {cost!r}")
        # Fraction takes Python floats and exact rationals; a NumPy float32 goes through float.
        exact = Fraction(cost) if isinstance(cost, (Rational, float)) else Fraction(float(cost))
        if exact < 0:
            raise ValueError(f"cost {index} must be non-negative, got {cost!r}")
        fractions.append(exact)
    denominator = math.lcm(*(f.denominator for f in fractions)) if fractions else 1
    return [f.numerator * (denominator // f.denominator) for f in fractions]


def _optimal_block_starts(costs: List[int], partitions: int) -> List[int]:
    """Start index of each block of an optimal split (``starts[0] == 0``)."""
    n = len(costs)
    prefix = [0] * (n + 1)
    for i, cost in enumerate(costs):
        prefix[i + 1] = prefix[i] + cost

    # best[i]: optimum for the first i costs in the current number of blocks j.
    # choice[j][i]: start of the j-th (last) block in that optimum.
    best = prefix[:]  # j == 1: one block holds everything.
    choice: List[List[int]] = [[0] * (n + 1)]
    for blocks in range(2, partitions + 1):
        current = [0] * (n + 1)
        chosen = [0] * (n + 1)
        # Leave room for the blocks still to come: the first `blocks` costs at least.
        for i in range(blocks, n - (partitions - blocks) + 1):
            start, value = _best_last_block(best, prefix, lo=blocks - 1, hi=i - 1, end=i)
            current[i] = value
            chosen[i] = start
        best = current
        choice.append(chosen)

    starts = [0] * partitions
    end = n
    for blocks in range(partitions, 1, -1):
        end = choice[blocks - 1][end]
        starts[blocks - 1] = end
    return starts


def _best_last_block(before: List[int], prefix: List[int], lo: int, hi: int,
                     end: int) -> tuple[int, int]:
    """Best start ``s`` in ``[lo, hi]`` of a last block ending at ``end``; the latest on ties.

    ``before[s]`` (the optimum of everything before ``s``) is non-decreasing in ``s``;
    ``prefix[end] - prefix[s]`` (the last block) is non-increasing, so ``max`` of the two is
    minimised at their crossing.
    """
    # Smallest s with before[s] >= last block; if none, s = hi + 1.
    left, right = lo, hi + 1
    while left < right:
        middle = (left + right) // 2
        if before[middle] >= prefix[end] - prefix[middle]:
            right = middle
        else:
            left = middle + 1
    crossing = left

    candidates = []
    if crossing <= hi:
        candidates.append(before[crossing])
    if crossing - 1 >= lo:
        candidates.append(prefix[end] - prefix[crossing - 1])
    value = min(candidates)

    if crossing <= hi and before[crossing] <= value:
        # From the crossing on, the cost is before[s], non-decreasing: take the last s equal.
        left, right = crossing, hi + 1
        while left < right:
            middle = (left + right) // 2
            if before[middle] <= value:
                left = middle + 1
            else:
                right = middle
        return left - 1, value
    # Below the crossing the cost is the last block, non-increasing: crossing - 1 is latest.
    return crossing - 1, value
