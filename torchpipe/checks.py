"""Argument checks shared by every public constructor: one rule, one wording.

Bad input gets a TypeError (wrong type) or a ValueError (right type, bad value) that names
the argument, the value and what was expected, raised at the public entry before anything is
built or any thread starts.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Optional

__all__ = ["check_bool", "check_nonnegative_int", "check_positive_int", "check_real"]


def check_positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    """TypeError unless ``value`` is an int (not a bool), ValueError unless it is >= 1.

    One rule for every count a user gives (threads, workers): checked where it is given,
    before any thread starts, so a bad value never surfaces as a worker dying later.
    """
    if value is None and allow_none:
        return
    expected = "a positive int or None" if allow_none else "a positive int"
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_nonnegative_int(name: str, value: Any) -> None:
    """TypeError unless ``value`` is an int (not a bool), ValueError unless it is >= 0."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """TypeError unless ``value`` is a bool (a truthy string such as 'no' is not one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_real(name: str, value: Any, low: float, high: Optional[float] = None) -> None:
    """TypeError unless ``value`` is a real number; ValueError unless it is finite, in ``[low, high)``.

    ``high=None``: no upper bound. NaN and infinities are refused: they would turn every row
    they update into NaN.
    """
    expected = f"a finite float >= {low:g}" if high is None else f"a float in [{low:g}, {high:g})"
    if not isinstance(value, Real):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    if not (math.isfinite(value) and low <= value and (high is None or value < high)):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
