"""A confidence interval for a median, without assuming how the repeats are distributed.

A goal judged on a median alone flips between PASS and MISS when the figure sits near the
target and the machine is noisy. With the repeats, order statistics give an interval that
holds the true median with a known probability, whatever the noise's distribution: the
k-th smallest and k-th largest of n repeats bracket it with probability
``1 - 2 P(Binomial(n, 1/2) < k)``. Where it is wide, the verdict says so instead of guessing.

The values must be independent repeats of one quantity. Benchmarks build them per repeat
from cases timed round-robin (``timing.compare``), so that a burst of load lands on both
sides of a ratio alike: a paired estimate, which a ratio of two medians is not.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

__all__ = ["MedianInterval", "median_interval", "paired_median_interval"]

CONFIDENCE = 0.95


@dataclass(frozen=True)
class MedianInterval:
    """The median of some repeats and an interval that holds the true median with ``coverage``."""

    median: float
    low: float
    high: float
    coverage: float


def _binomial_below(n: int, k: int) -> float:
    """P(Binomial(n, 1/2) < k)."""
    return sum(math.comb(n, i) for i in range(k)) / 2 ** n


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Optional[MedianInterval]:
    """The narrowest order-statistic interval for the median of ``values`` with at least
    ``confidence`` coverage; with too few values for that, ``[min, max]`` and its (lower)
    coverage. None when a value is not finite (nothing to judge by)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    ordered = sorted(float(v) for v in values)
    if not ordered or not all(math.isfinite(v) for v in ordered):
        return None
    n = len(ordered)
    k = 1  # 1-based: the k-th smallest and the k-th largest
    while k + 1 <= n // 2 and 1 - 2 * _binomial_below(n, k + 1) >= confidence:
        k += 1
    coverage = 1 - 2 * _binomial_below(n, k)
    return MedianInterval(statistics.median(ordered), ordered[k - 1], ordered[n - k], coverage)


def paired_median_interval(combine: Callable[..., float], *series: Sequence[float],
                           confidence: float = CONFIDENCE) -> Optional[MedianInterval]:
    """:func:`median_interval` of ``combine(a[i], b[i], ...)`` over the repeats ``i`` of cases
    timed round-robin (repeat ``i`` of each ran back to back). None where the series differ in
    length or a repeat's figure is undefined (a division by zero, a value not finite)."""
    if not series or len({len(s) for s in series}) != 1:
        return None
    try:
        values = [combine(*repeat) for repeat in zip(*series)]
    except ZeroDivisionError:
        return None
    return median_interval(values, confidence)
