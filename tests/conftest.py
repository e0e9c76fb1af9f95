import pathlib
import sys

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


@pytest.fixture(autouse=True)
def _cpu_pipelines_unless_devices_are_named(request, monkeypatch):
    """The suite's pipelines are CPU pipelines unless a test names its devices.

    With CUDA present, ``devices=None`` means every GPU (torchgpipe's rule, checked by
    tests marked ``default_devices`` in tests/test_cuda.py), and a GPU machine usually has
    fewer GPUs than these tests have partitions.
    """
    if not torch.cuda.is_available() or request.node.get_closest_marker("default_devices"):
        return
    import torchpipe.pipe

    resolve = torchpipe.pipe._resolve_devices
    monkeypatch.setattr(torchpipe.pipe, "_resolve_devices",
                        lambda devices, partitions: resolve(["cpu"] * partitions if devices is None else devices,
                                                            partitions))
