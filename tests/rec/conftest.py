"""Run the embedding-cache tests single-threaded inside torch.

The tensors here are tiny: on a busy 2-core box, torch's intra-op thread pool costs
milliseconds per op in barrier waits, and the suite would be 5x slower. Restored after
each test so other suites keep their setting.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
