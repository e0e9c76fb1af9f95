"""Train-pipeline tests run torch single-threaded: tiny tensors, and a reference loop
whose float results must match the workers' bitwise (same ops, same thread count)."""

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
