"""A dependency-free progress bar for the demos (one line, redrawn in place)."""
from __future__ import annotations

import sys
import time
from typing import Iterator


def progress(total: int, label: str, width: int = 28) -> Iterator[int]:
    """Yield ``0 .. total-1`` while drawing ``label [#####.....] i/total``; ``set_postfix`` via send is not needed."""
    start = time.perf_counter()
    for i in range(total):
        yield i
        done = i + 1
        filled = width * done // total
        elapsed = time.perf_counter() - start
        bar = "#" * filled + "." * (width - filled)
        sys.stdout.write(f"\r{label} [{bar}] {done}/{total} {elapsed:5.1f}s {progress.postfix}")
        sys.stdout.flush()
    sys.stdout.write("\n")


progress.postfix = ""  # type: ignore[attr-defined]
