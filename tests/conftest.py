import threading

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pipeline_threads():
    return [t for t in threading.enumerate() if t.name.startswith("torchpipe")]
