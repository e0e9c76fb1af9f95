"""Profiling a pipeline: a ``torch.profiler.profile`` that also records the worker threads.

PyTorch's profiler records only the thread that started it unless its experimental
``profile_all_threads`` option is set. Pipeline work runs on worker threads, so a plain
profiler would show the caller waiting and nothing else. Every pipeline task is wrapped in
``record_function("stage 2 F mb 5")`` while a profiler is active, so the trace shows the
schedule.
"""
from __future__ import annotations

from typing import Any, List

import torch

__all__ = ["profile"]


def profile(**kwargs: Any) -> "torch.profiler.profile":
    """``torch.profiler.profile(**kwargs)`` with worker threads recorded too.

    Every keyword of ``torch.profiler.profile`` works, with its defaults (``activities``:
    every kind the machine supports, so a GPU's kernels are recorded too). torch's config
    object is read-only, so an ``experimental_config`` of your own is passed on unchanged:
    build it with ``profile_all_threads=True``, or the trace shows the calling thread only.
    """
    if kwargs.get("activities") is not None:
        kwargs["activities"] = _checked_activities(kwargs["activities"])
    if kwargs.get("experimental_config") is None:
        kwargs["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    return torch.profiler.profile(**kwargs)


def _checked_activities(activities: Any) -> List["torch.profiler.ProfilerActivity"]:
    """torch answers a string, or a list of strings, with a bare ``AssertionError`` ("No valid
    profiler activities found"): say what it takes instead, before anything is recorded."""
    if activities is None:
        return
    kinds = list(torch.profiler.ProfilerActivity.__members__)
    if isinstance(activities, (str, bytes)) or not hasattr(activities, "__iter__"):
        raise TypeError(f"activities must be a list of torch.profiler.ProfilerActivity (one of {kinds}), "
                        f"got {type(activities).__name__}: {activities!r}")
    given = list(activities)
    wrong = [a for a in given if not isinstance(a, torch.profiler.ProfilerActivity)]
    if wrong:
        raise TypeError(f"activities must be torch.profiler.ProfilerActivity members (one of {kinds}), "
                        f"got {wrong[0]!r}")
    if not given:
        raise ValueError("activities must name at least one torch.profiler.ProfilerActivity, got an empty "
                         "collection (leave it out for every kind the machine supports)")
    return given
