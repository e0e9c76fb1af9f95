import pathlib
import sys
import threading

import pytest
import torch

# tests/rec/rec_helpers.py builds the embedding tables and Zipf keys that tests/train uses too.
REC_TESTS = str(pathlib.Path(__file__).resolve().parent / "rec")
if REC_TESTS not in sys.path:
    sys.path.insert(0, REC_TESTS)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pipeline_threads():
    return [t for t in threading.enumerate() if t.name.startswith("torchpipe")]
