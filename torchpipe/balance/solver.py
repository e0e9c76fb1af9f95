"""Optimal split of a cost sequence into consecutive blocks (the "linear partition" problem).

Balancing a pipeline means cutting a sequence of per-layer costs into exactly ``partitions``
non-empty runs of consecutive layers so that the most expensive run -- the one that bounds
the pipeline's throughput -- is as cheap as possible. torchgpipe used a heuristic (Bárány et
al.) that is not always optimal; this module returns an optimum.

Exactness: every cost is converted to an exact rational (a float is exactly ``m / 2**e``) and
all costs are scaled to integers over their common denominator, so block sums are computed
without rounding. Two splits whose float sums would round to the same value are therefore
still told apart correctly, and the result is deterministic.

Algorithm, in two passes over (blocks, prefix length):

1. The optimum, the smallest possible largest block, in ``O(partitions * n * log n)``:
   ``best[j][i]`` is the smallest largest block when the first ``i`` costs form ``j`` blocks.
   With non-negative costs ``best[j - 1][s]`` is non-decreasing in ``s`` and the last block's
   sum ``prefix[i] - prefix[s]`` is non-increasing in ``s``, so the best split point is found
   by bisection at their crossing.
2. Which optimal split (ties are the rule when one layer dominates: any split that keeps the
   other blocks under it is optimal). Of the splits whose blocks all fit under the optimum,
   the one with the most even blocks: the smallest sum of squared block costs, then the
   smallest sum of squared layer counts (so zero-cost layers are spread, not piled into one
   block). A block's penalty is convex in its sum and infinite above the optimum, so it obeys
   the quadrangle inequality, the best split points are monotone, and divide and conquer finds
   them in ``O(partitions * n * log n)`` evaluations. Remaining ties go to the earliest split
   point, so the result is deterministic.

Why the second pass: picking any optimum (say, every last block as short as possible) packs
the non-dominant layers into one block when a single layer (an embedding, a stem, an LM head)
sets the bottleneck, e.g. ``[1, 10, 1, 1]`` for an embedding and 12 equal blocks on 4
devices. That block then becomes the bottleneck under the smallest timing error, and holds
10x the activations of its neighbours. ``[1, 4, 4, 4]`` is as fast and leaves slack everywhere.
"""
from __future__ import annotations

import math
import operator
from fractions import Fraction
from numbers import Integral, Rational, Real
from typing import Callable, List, Optional, Sequence, Tuple

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
    if hasattr(costs, "tolist") and not isinstance(costs, (list, tuple)):  # a 1-D tensor or NumPy array
        costs = costs.tolist()
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):  # a set or a dict has no order
        raise TypeError(f"costs must be a sequence of real numbers, one per layer (a list, a tuple, a 1-D tensor "
                        f"or array), got {type(costs).__name__} {costs!r}")
    fractions: List[Fraction] = []
    for index, cost in enumerate(costs):
        if getattr(cost, "ndim", None) == 0 and hasattr(cost, "item"):  # a 0-dim tensor or array, as torchgpipe takes
            if getattr(cost, "is_meta", False):
                raise TypeError(f"cost {index} is a meta tensor, which holds no value: {cost!r}")
            cost = cost.item()
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
    """Start index of each block of the most even optimal split (``starts[0] == 0``)."""
    prefix = [0] * (len(costs) + 1)
    for i, cost in enumerate(costs):
        prefix[i + 1] = prefix[i] + cost
    return _most_even_block_starts(prefix, partitions, _smallest_largest_block(prefix, partitions))


def _smallest_largest_block(prefix: List[int], partitions: int) -> int:
    """The optimum: the smallest possible largest block of ``partitions`` consecutive blocks."""
    n = len(prefix) - 1
    best = prefix[:]  # one block: the first i costs hold everything
    for blocks in range(2, partitions + 1):
        current = [0] * (n + 1)
        # Leave room for the blocks still to come: the first `blocks` costs at least.
        for i in range(blocks, n - (partitions - blocks) + 1):
            current[i] = _best_last_block(best, prefix, lo=blocks - 1, hi=i - 1, end=i)
        best = current
    return best[n]


def _most_even_block_starts(prefix: List[int], partitions: int, bottleneck: int) -> List[int]:
    """Block starts of the split with every block at most ``bottleneck`` that minimises the sum
    of squared block costs, then of squared layer counts (see the module docstring)."""
    n = len(prefix) - 1
    counts_weight = n * n + 1  # more than any sum of squared layer counts: costs come first

    def penalty(start: int, end: int) -> Optional[int]:
        block = prefix[end] - prefix[start]
        if block > bottleneck:
            return None  # not allowed (None, not math.inf: exact integers may exceed any float)
        return block * block * counts_weight + (end - start) ** 2

    # score[i]: the least total penalty of the first i costs in the current number of blocks
    # (None: they cannot form that many blocks under the bottleneck).
    score: List[Optional[int]] = [penalty(0, i) if i else None for i in range(n + 1)]
    choice: List[List[int]] = [[0] * (n + 1)]
    for blocks in range(2, partitions + 1):
        current: List[Optional[int]] = [None] * (n + 1)
        chosen = [0] * (n + 1)
        ends = (blocks, n - (partitions - blocks))  # leave room for the blocks still to come
        _fill_by_divide_and_conquer(score, current, chosen, penalty, ends, (blocks - 1, ends[1] - 1))
        score = current
        choice.append(chosen)

    starts = [0] * partitions
    end = n
    for blocks in range(partitions, 1, -1):
        end = choice[blocks - 1][end]
        starts[blocks - 1] = end
    return starts


def _fill_by_divide_and_conquer(before: List[Optional[int]], current: List[Optional[int]], chosen: List[int],
                                penalty: Callable[[int, int], Optional[int]], ends: Tuple[int, int],
                                starts: Tuple[int, int]) -> None:
    """``current[i] = min over s of before[s] + penalty(s, i)`` for ``i`` in ``ends`` (inclusive),
    with ``s`` in ``starts`` and ``s < i``; ``chosen[i]`` the earliest best ``s``.

    The best ``s`` is non-decreasing in ``i`` (quadrangle inequality), so the middle end's best
    start bounds the search of the ends on either side of it. An explicit stack, not recursion:
    no recursion limit on long sequences.
    """
    stack = [(ends[0], ends[1], starts[0], starts[1])]
    while stack:
        first, last, low, high = stack.pop()
        if first > last:
            continue
        middle = (first + last) // 2
        best_value: Optional[int] = None
        best_start = high  # no allowed start: neither does any later end have one
        for start in range(low, min(high, middle - 1) + 1):
            head, block = before[start], penalty(start, middle)
            if head is None or block is None:
                continue
            if best_value is None or head + block < best_value:
                best_value, best_start = head + block, start
        current[middle], chosen[middle] = best_value, best_start
        stack.append((first, middle - 1, low, best_start))
        stack.append((middle + 1, last, best_start, high))


def _best_last_block(before: List[int], prefix: List[int], lo: int, hi: int, end: int) -> int:
    """The least ``max(before[s], last block)`` over starts ``s`` in ``[lo, hi]`` of a last
    block ending at ``end``.

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
    return min(candidates)
