"""Argument checks shared by every public constructor: one rule, one wording.

Bad input gets a TypeError (wrong type) or a ValueError (right type, bad value) that names
the argument, the value and what was expected, raised at the public entry before anything is
built or any thread starts.
"""

from __future__ import annotations

import math
import operator
import os
import tempfile
from numbers import Real
from typing import Any, Optional

import torch

__all__ = ["as_int", "check_bool", "check_file_path", "check_nonnegative_int", "check_positive_int", "check_real",
           "why_unwritable"]


def as_int(value: Any) -> Optional[int]:
    """``value`` as an int when it is one (a NumPy integer or a one-element integer tensor
    too, as ``operator.index`` takes them), else None. A bool is not a count."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_count(name: str, value: Any, minimum: int, expected: str) -> int:
    number = as_int(value)
    if number is None:
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    if number < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return number


def check_positive_int(name: str, value: Any, *, allow_none: bool = False) -> Optional[int]:
    """TypeError unless ``value`` is an int (not a bool), ValueError unless it is >= 1.

    One rule for every count a user gives (threads, workers): checked where it is given,
    before any thread starts, so a bad value never surfaces as a worker dying later.
    Returns it as a plain int (None stays None), for code that needs exactly an int.
    """
    if value is None and allow_none:
        return None
    return _check_count(name, value, 1, "a positive int or None" if allow_none else "a positive int")


def check_nonnegative_int(name: str, value: Any) -> int:
    """TypeError unless ``value`` is an int (not a bool), ValueError unless it is >= 0."""
    return _check_count(name, value, 0, "an int >= 0")


def check_bool(name: str, value: Any) -> None:
    """TypeError unless ``value`` is a bool (a truthy string such as 'no' is not one)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_real(name: str, value: Any, low: float, high: Optional[float] = None) -> None:
    """TypeError unless ``value`` is a real number; ValueError unless it is finite, in ``[low, high)``.

    A one-element tensor counts as its number (torch's optimizers take a tensor ``lr``).
    ``high=None``: no upper bound. NaN and infinities are refused: they would turn every row
    they update into NaN.
    """
    expected = f"a finite float >= {low:g}" if high is None else f"a float in [{low:g}, {high:g})"
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool:
        number = float(value)
    elif isinstance(value, Real) and not isinstance(value, bool):
        number = float(value)
    else:
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    if not (math.isfinite(number) and low <= number and (high is None or number < high)):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_file_path(path: Any, what: str) -> None:
    """A file name, not an int: ``open()`` would take an int (or a bool) as a file descriptor,
    and closing it would close the caller's file, or stdout."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{what} takes a file path (str or os.PathLike), got {type(path).__name__}: {path!r}")


def why_unwritable(path: str, *, folder: bool) -> Optional[str]:
    """Why ``path`` (a file to write, or with ``folder=True`` a folder to make and write in)
    cannot be written, or None: for a command line to refuse an output path at once, not
    after minutes of work. Missing folders are fine (the writer makes them); the nearest one
    that exists must take a new file, so a read-only file system or ``/proc`` is caught too."""
    target = os.path.abspath(path)
    if folder and os.path.exists(target) and not os.path.isdir(target):
        return "is a file; give a folder"
    if not folder and os.path.isdir(target):
        return "is a folder; give a file name, such as out/results.json"
    if not folder and os.path.exists(target):
        if not os.path.isfile(target):  # a FIFO would block an open
            return None if os.access(target, os.W_OK) else "cannot be written"
        # The writer opens it in place: that is the test (append mode changes nothing), also on a
        # read-only file system, and a folder that takes no new file does not matter.
        try:
            with open(target, "ab"):
                pass
        except OSError as error:
            return f"is a file that cannot be written ({error.strerror or error})"
        return None
    nearest = target if folder else os.path.dirname(target)
    while not os.path.exists(nearest):
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        return f"{nearest} is a file, so no folder can be made there"
    try:
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as error:
        return f"cannot write in {nearest} ({error.strerror or error})"
    return None
