"""The pipelines the benchmarks compare: torchpipe and its anchors, built the same way.

Each peer is a factory ``make(module, chunks, device="cpu", *, checkpoint="never")`` that
returns a pipeline with one partition per child of ``module``, every partition on
``device``: ``"cpu"`` by default (the CPU suites), ``"cuda:0"`` in the ``cuda`` suite, where
torchpipe gives each partition its own worker thread and stream and torchgpipe and
fairscale accept the repeated device. The anchors are optional (``pip install .[bench]``):
when one cannot be imported or run, its rows say ``unavailable: <reason>`` instead of
failing the run. If an import fails only because torch removed an old private API, a small
shim for that API is installed *in this process only* and the import retried; every shim
applied is reported in the output so that no number silently depends on one.
"""
from __future__ import annotations

import gc
import importlib
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

__all__ = ["Peer", "PEER_NAMES", "THREADS", "load_peers", "close_pipeline", "release", "join_stopped_peer_workers",
           "SHIMS_APPLIED"]

PEER_NAMES = ("torchpipe", "torchgpipe", "fairscale")
THREADS = "threads"
"""The bare thread chain (thread_chain.py): not a peer to beat but the floor, where a suite shows it."""

Device = Union[str, torch.device]
MakePipeline = Callable[..., nn.Module]
"""``make(module, chunks, device="cpu", *, checkpoint="never") -> nn.Module``."""

SHIMS_APPLIED: List[str] = []
"""Human-readable descriptions of the shims installed in this process."""


@dataclass
class Peer:
    """A pipeline implementation, or the reason it cannot be used (``make is None``)."""

    name: str
    label: str
    make: Optional[MakePipeline]
    reason: str = ""
    version: str = ""

    @property
    def available(self) -> bool:
        return self.make is not None


def _shim_torch_six() -> str:
    """``torch._six`` was removed in torch 2.0; old libraries imported string_classes etc. from it."""
    import collections.abc
    import math

    six = types.ModuleType("torch._six")
    six.string_classes = (str, bytes)  # type: ignore[attr-defined]
    six.int_classes = int  # type: ignore[attr-defined]
    six.inf = math.inf  # type: ignore[attr-defined]
    six.nan = math.nan  # type: ignore[attr-defined]
    six.container_abcs = collections.abc  # type: ignore[attr-defined]
    sys.modules["torch._six"] = six
    return "torch._six (removed in torch 2.0) provided as a stub module"


# Missing module name -> installer returning a description. Applied only after an import fails.
_SHIMS: Dict[str, Callable[[], str]] = {"torch._six": _shim_torch_six}


def _import(name: str) -> types.ModuleType:
    """Import ``name``, installing known shims for removed torch modules on demand."""
    tried = set()
    while True:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if missing in _SHIMS and missing not in tried:
                tried.add(missing)
                SHIMS_APPLIED.append(f"{name}: {_SHIMS[missing]()}")
                for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                    del sys.modules[loaded]
                continue
            raise


def _torchpipe() -> Peer:
    from .. import Pipe, __version__

    def make(module: nn.Sequential, chunks: int, device: Device = "cpu", *, checkpoint: str = "never") -> nn.Module:
        n = len(module)
        return Pipe(module, balance=[1] * n, devices=[device] * n, chunks=chunks, checkpoint=checkpoint)

    return Peer("torchpipe", "torchpipe Pipe", make, version=__version__)


def _torchgpipe() -> Peer:
    try:
        torchgpipe = _import("torchgpipe")
    except Exception as exc:  # any import-time failure makes the row unavailable
        return Peer("torchgpipe", "torchgpipe GPipe", None, f"import torchgpipe failed: {type(exc).__name__}: {exc}")

    def make(module: nn.Sequential, chunks: int, device: Device = "cpu", *, checkpoint: str = "never") -> nn.Module:
        n = len(module)
        return torchgpipe.GPipe(module, balance=[1] * n, devices=[device] * n, chunks=chunks, checkpoint=checkpoint)

    return Peer("torchgpipe", "torchgpipe GPipe", make, version=getattr(torchgpipe, "__version__", ""))


def _fairscale() -> Peer:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fairscale = _import("fairscale")
            fs_nn = _import("fairscale.nn")
    except Exception as exc:
        return Peer("fairscale", "fairscale Pipe", None, f"import fairscale.nn failed: {type(exc).__name__}: {exc}")

    def make(module: nn.Sequential, chunks: int, device: Device = "cpu", *, checkpoint: str = "never") -> nn.Module:
        n = len(module)
        with warnings.catch_warnings():  # its constructor warns that it is deprecated
            warnings.simplefilter("ignore")
            return fs_nn.Pipe(module, balance=[1] * n, devices=[device] * n, chunks=chunks, checkpoint=checkpoint)

    return Peer("fairscale", "fairscale Pipe", make, version=getattr(fairscale, "__version__", ""))


def _threads() -> Peer:
    from .thread_chain import ThreadChain

    def make(module: nn.Sequential, chunks: int, device: Device = "cpu", *, checkpoint: str = "never") -> nn.Module:
        if checkpoint != "never":
            raise ValueError(f"the bare thread chain does not checkpoint (got checkpoint={checkpoint!r})")
        return ThreadChain(list(module), chunks, device)

    return Peer(THREADS, "bare threads (floor)", make)


_LOADERS = {"torchpipe": _torchpipe, "torchgpipe": _torchgpipe, "fairscale": _fairscale, "threads": _threads}


def load_peers(names=PEER_NAMES) -> List[Peer]:
    return [_LOADERS[name]() for name in names]


def build_peers(peers: List[Peer], build: Callable[[Peer], Any], where: str,
                notes: List[str]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """Build one pipeline per available peer with ``build(peer)``.

    Returns ``(pipelines, unavailable)`` by peer name; a peer that fails to import or to
    build is recorded with its reason (and a note naming ``where``) instead of failing the run.
    """
    pipelines: Dict[str, Any] = {}
    unavailable: Dict[str, str] = {}
    for peer in peers:
        if not peer.available:
            unavailable[peer.name] = peer.reason
            continue
        try:
            pipelines[peer.name] = build(peer)
        except Exception as exc:
            unavailable[peer.name] = f"{type(exc).__name__}: {exc}"
            notes.append(f"{peer.label} unavailable at {where}: {unavailable[peer.name]}")
    return pipelines, unavailable


def close_pipeline(pipeline: object) -> None:
    """Stop a pipeline's threads if it has any to stop (torchpipe's ``close``)."""
    close = getattr(pipeline, "close", None)
    if callable(close):
        close()


def release(*holders: Any) -> None:
    """Close every pipeline held in ``holders`` (dicts or lists), drop them, and collect.

    fairscale's ``Pipeline.__del__`` joins its worker threads; if a fairscale pipeline is
    still referenced at interpreter exit, that join runs after the daemon workers are
    frozen and the process hangs. So no suite may keep one alive past its own end.
    """
    for holder in holders:
        for value in list(holder.values()) if isinstance(holder, dict) else list(holder):
            if isinstance(value, nn.Module):
                close_pipeline(value)
        holder.clear()
    gc.collect()
    join_stopped_peer_workers()


PEER_WORKER_SUFFIX = "(worker)"
"""How Python names a thread whose target is called ``worker``: torchgpipe's and fairscale's loops."""


def join_stopped_peer_workers(timeout: float = 5.0) -> None:
    """Wait until the peers' stopped worker threads have really ended.

    torchgpipe and fairscale stop their daemon workers with a message on a queue and never
    join them, so a worker may still be ending when the suite returns. On a 16-core H100
    host, the ``gpipe`` suite aborted at interpreter exit ("terminate called without an
    active exception", rc 134), with one such thread still alive: the known crash of a daemon
    thread during CPython's finalization (pytorch/pytorch#38228). Threads of a peer pipeline
    that is still alive are not stopped; the wait for them ends after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.daemon and thread.name.endswith(PEER_WORKER_SUFFIX) and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
