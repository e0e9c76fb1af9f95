"""Profiling a pipeline: a ``torch.profiler.profile`` that also records the worker threads.

PyTorch's profiler records only the thread that started it unless its experimental
``profile_all_threads`` option is set. Pipeline work runs on worker threads, so a plain
profiler would show the caller waiting and nothing else. Every pipeline task is wrapped in
``record_function("stage 2 F mb 5")`` while a profiler is active, so the trace shows the
schedule.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["profile"]


def profile(**kwargs: Any) -> "torch.profiler.profile":
    """``torch.profiler.profile(**kwargs)`` with worker threads recorded too."""
    config = kwargs.pop("experimental_config", None)
    if config is None:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    else:
        config.profile_all_threads = True  # type: ignore[attr-defined]
    kwargs.setdefault("activities", [torch.profiler.ProfilerActivity.CPU])
    return torch.profiler.profile(experimental_config=config, **kwargs)
