"""Timing helper: warm up, calibrate a loop, then take the median of interleaved repeats.

Shared machines are noisy, so every figure the benchmarks quote is a ratio between cases
timed in the same run. ``compare`` runs its cases round-robin (repeat 1 of every case,
then repeat 2, ...) so that a burst of load from elsewhere lands on all cases alike
instead of on whichever case happened to be running, and quotes the median repeat.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

__all__ = ["Measurement", "TimingConfig", "compare"]


@dataclass(frozen=True)
class TimingConfig:
    """How to time: ``repeats`` samples of a loop of ``iters`` calls, after ``warmup`` calls.

    ``iters=None`` calibrates the loop so one repeat lasts about ``target_s`` (at least
    ``min_iters`` calls), which keeps fast cases above timer noise without making slow
    ones take forever.
    """

    repeats: int = 7
    warmup: int = 3
    iters: Optional[int] = None
    target_s: float = 0.1
    min_iters: int = 3
    max_iters: int = 10_000

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.iters is not None and self.iters < 1:
            raise ValueError(f"iters must be >= 1, got {self.iters}")


@dataclass
class Measurement:
    """Per-call seconds of each repeat (the loop time divided by its ``iters``)."""

    name: str
    iters: int
    samples: List[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were (0 = identical)."""
        med = self.median
        return (self.max - self.min) / med if med > 0 else 0.0

    def to_json(self) -> Dict[str, object]:
        return {"iters": self.iters, "median_s": self.median, "samples_s": list(self.samples)}


def _calibrate(fn: Callable[[], object], config: TimingConfig) -> int:
    if config.iters is not None:
        return config.iters
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    iters = int(config.target_s / once)
    return max(config.min_iters, min(config.max_iters, iters))


def compare(cases: Mapping[str, Callable[[], object]], config: TimingConfig) -> Dict[str, Measurement]:
    """Time every case in ``cases`` (name -> zero-argument call) and return their measurements.

    Warm-up and calibration happen first for every case; the timed repeats then interleave.
    """
    plan: Dict[str, Measurement] = {}
    for name, fn in cases.items():
        for _ in range(config.warmup):
            fn()
        plan[name] = Measurement(name, _calibrate(fn, config))
    for _ in range(config.repeats):
        for name, fn in cases.items():
            m = plan[name]
            start = time.perf_counter()
            for _ in range(m.iters):
                fn()
            m.samples.append((time.perf_counter() - start) / m.iters)
    return plan
