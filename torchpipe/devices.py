"""One backend interface for cpu, cuda and npu devices.

Everything above this module (copies, workers, the runtime) speaks to devices only through
:class:`Backend`, so that the same pipeline code runs on CPU, where streams and events are
no-ops, and on accelerators, where every worker computes on its own stream. ``torch_npu`` is
optional: asking for an ``npu`` device without it raises :class:`BackendUnavailableError`
with the install hint, instead of an obscure import error deep in a worker thread.
"""
from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any, ContextManager, Dict, Iterator, Optional, Union

import torch

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CPUBackend",
    "AcceleratorBackend",
    "CPUStream",
    "get_backend",
    "register_backend",
    "use_backend",
    "as_device",
    "usable_device",
]

DeviceLike = Union[torch.device, str, int]


class BackendUnavailableError(RuntimeError):
    """Raised when a device type is requested whose runtime library is not installed."""


class CPUStream:
    """The stream of a CPU device: work runs in program order, so it needs no synchronisation."""

    __slots__ = ()
    device = torch.device("cpu")

    def __repr__(self) -> str:
        return "CPUStream()"


CPU_STREAM = CPUStream()


class Backend:
    """Streams, events and copies of one device type.

    Subclasses implement the accelerator calls; the defaults describe a device with a single
    in-order stream (the CPU), where every synchronisation is a no-op.
    """

    type: str = "cpu"

    def is_available(self) -> bool:
        """Whether this device type can be used in this process (its library loads, a device is present)."""
        return True

    def device_count(self) -> int:
        """How many devices of this type there are, to check an index before anything is placed."""
        return 1

    def check(self, device: torch.device) -> None:
        """Raise a clear error if ``device`` cannot be used (missing library, bad index)."""

    def canonical(self, device: torch.device) -> torch.device:
        """One spelling per physical device, so that ``'cpu'``/``'cpu:0'`` compare equal.

        Partitions on one device share its random generator (and need its lock); two
        spellings of one device must not look like two devices.
        """
        return device

    def current_stream(self, device: torch.device) -> Any:
        """The stream the calling thread queues work on for ``device``: the one a step must wait for."""
        return CPU_STREAM

    def new_stream(self, device: torch.device) -> Any:
        """A stream of its own for a worker or a copy, so that compute and copies can overlap."""
        return CPU_STREAM

    def use_stream(self, stream: Any) -> ContextManager[None]:
        """Make ``stream`` current on this thread while the block runs (a worker's task, a copy)."""
        return contextlib.nullcontext()

    def use_device(self, device: torch.device) -> ContextManager[None]:
        """Make ``device`` current on this thread, so that kernels and allocations land on it."""
        return contextlib.nullcontext()

    def wait_stream(self, waiting: Any, waited: Any) -> None:
        """Make ``waiting`` wait for the work queued on ``waited`` so far."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator that ``tensor`` is in use on ``stream`` (never for CPU tensors)."""

    def new_event(self) -> Any:
        """An event to mark a point in a stream that another stream (or the host) waits for."""
        return None

    def record_event(self, event: Any, stream: Any) -> None:
        """Mark in ``event`` the work queued on ``stream`` so far."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for the work marked in ``event``, without blocking the host."""

    def synchronize(self, device: torch.device) -> None:
        """Block the host until ``device`` has finished its queued work (timings, teardown)."""

    def default_generator(self, device: torch.device) -> torch.Generator:
        """The generator that random ops on ``device`` draw from (for RNG replay)."""
        return torch.default_generator

    def memory_allocated(self, device: torch.device) -> Optional[int]:
        """Bytes of live tensors on ``device`` by its caching allocator, or None without one (the CPU).

        ``balance_by_size`` measures each layer with it; without it, it counts the tensors
        autograd saves instead.
        """
        return None


class CPUBackend(Backend):
    """The CPU: one in-order stream, nothing to synchronise."""

    type = "cpu"

    def canonical(self, device: torch.device) -> torch.device:
        return torch.device("cpu")  # 'cpu:0', 'cpu:1': one memory, one generator


class MetaBackend(Backend):
    """The ``meta`` device (shapes only): no streams, like the CPU; used for dry runs and tests."""

    type = "meta"


class AcceleratorBackend(Backend):
    """A CUDA-like device driven through a ``torch.<type>`` module (``torch.cuda``, ``torch.npu``).

    ``import_name`` is imported on first use: ``torch_npu`` registers ``torch.npu`` that way.
    """

    def __init__(self, type: str, import_name: Optional[str] = None, install_hint: str = "") -> None:
        self.type = type
        self._import_name = import_name
        self._install_hint = install_hint
        self._module: Any = None
        self._lock = threading.Lock()

    @property
    def module(self) -> Any:
        if self._module is None:
            with self._lock:
                if self._module is None:
                    if self._import_name is not None:
                        try:
                            importlib.import_module(self._import_name)
                        except Exception as exc:  # ImportError, or OSError from missing CANN libraries
                            raise BackendUnavailableError(
                                f"device type {self.type!r} needs the package {self._import_name!r}, "
                                f"which failed to import ({type(exc).__name__}: {exc}). {self._install_hint}"
                            ) from exc
                    module = getattr(torch, self.type, None)
                    if module is None:
                        raise BackendUnavailableError(
                            f"torch has no {self.type!r} backend module; {self._install_hint}"
                        )
                    self._module = module
        return self._module

    def is_available(self) -> bool:
        try:
            return bool(self.module.is_available())
        except BackendUnavailableError:
            return False

    def device_count(self) -> int:
        return int(self.module.device_count()) if self.is_available() else 0

    def canonical(self, device: torch.device) -> torch.device:
        if device.index is not None:
            return device
        return torch.device(self.type, int(self.module.current_device()))

    def check(self, device: torch.device) -> None:
        module = self.module
        if not module.is_available():
            raise BackendUnavailableError(
                f"device {str(device)!r} was requested but no {self.type} device is available "
                f"on this machine. {self._install_hint}"
            )
        index = device.index if device.index is not None else 0
        count = module.device_count()
        if index >= count:
            raise BackendUnavailableError(
                f"device {str(device)!r} was requested but only {count} {self.type} device(s) exist"
            )

    def current_stream(self, device: torch.device) -> Any:
        return self.module.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return self.module.Stream(device)

    def use_stream(self, stream: Any) -> ContextManager[None]:
        return self.module.stream(stream)

    def use_device(self, device: torch.device) -> ContextManager[None]:
        return self.module.device(device)

    def wait_stream(self, waiting: Any, waited: Any) -> None:
        if waiting is not waited:
            waiting.wait_stream(waited)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type == self.type:
            tensor.record_stream(stream)

    def new_event(self) -> Any:
        return self.module.Event()

    def record_event(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, device: torch.device) -> None:
        self.module.synchronize(device)

    def default_generator(self, device: torch.device) -> torch.Generator:
        index = device.index if device.index is not None else self.module.current_device()
        return self.module.default_generators[index]

    def memory_allocated(self, device: torch.device) -> Optional[int]:
        return int(self.module.memory_allocated(device))


_NPU_HINT = (
    "Install Ascend's CANN toolkit and the torch_npu build that matches this torch "
    "(pip install torchpipe's 'npu' extra from the checkout), or use 'cpu'/'cuda' devices."
)

_backends: Dict[str, Backend] = {
    "cpu": CPUBackend(),
    "meta": MetaBackend(),
    "cuda": AcceleratorBackend("cuda", install_hint="Install a CUDA build of torch."),
    "npu": AcceleratorBackend("npu", import_name="torch_npu", install_hint=_NPU_HINT),
}


def as_device(device: DeviceLike) -> torch.device:
    """Normalise ``device`` and reject unknown device strings with a clear ValueError."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool):
        raise TypeError(f"invalid device {device!r}: expected a str such as 'cpu' or 'cuda:0', a torch.device, or a CUDA index")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"invalid device {device!r}: a CUDA index must be >= 0")
        return torch.device("cuda", device)
    if not isinstance(device, str):
        raise TypeError(f"invalid device {device!r}: expected a str such as 'cpu' or 'cuda:0', a torch.device, or a CUDA index")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        device_type = device.split(":", 1)[0] if isinstance(device, str) else None
        backend = _backends.get(device_type) if device_type else None
        if isinstance(backend, AcceleratorBackend):
            backend.module  # raises BackendUnavailableError with the install hint
            try:
                return torch.device(device)
            except (RuntimeError, TypeError):
                pass
        if backend is not None:
            raise ValueError(f"invalid device {device!r}: torchpipe has a backend for {device_type!r}, but torch "
                             "does not know the device type: import the library that registers it with torch "
                             "(torch.utils.rename_privateuse1_backend) first") from exc
        raise ValueError(f"invalid device {device!r}: expected e.g. 'cpu', 'cuda:0' or 'npu:0'") from exc


def get_backend(device: DeviceLike) -> Backend:
    """The backend that serves ``device``'s type."""
    device_type = as_device(device).type
    try:
        return _backends[device_type]
    except KeyError:
        raise BackendUnavailableError(
            f"no backend for device type {device_type!r}; known types: {sorted(_backends)}"
        ) from None


def usable_device(device: DeviceLike) -> torch.device:
    """``device`` as a ``torch.device``, refused now if it cannot be used.

    How every constructor resolves a device it is given: an unknown string is a ValueError, an ``'npu'`` device
    without ``torch_npu`` or a ``'cuda'`` device without CUDA is a `BackendUnavailableError`
    with the install hint (rather than torch's own error from deep inside a constructor).
    """
    resolved = as_device(device)
    get_backend(resolved).check(resolved)
    return resolved


def register_backend(device_type: str, backend: Backend) -> Optional[Backend]:
    """Install ``backend`` for ``device_type``; returns the one it replaces.

    How a device type torch knows (a vendor's, registered with torch by its library) gets
    served, and how tests put in fakes. See the guide's "Devices" section for what a backend
    must override.
    """
    previous = _backends.get(device_type)
    _backends[device_type] = backend
    return previous


@contextlib.contextmanager
def use_backend(device_type: str, backend: Backend) -> Iterator[Backend]:
    """Temporarily serve ``device_type`` with ``backend`` (a fake backend in tests)."""
    previous = register_backend(device_type, backend)
    try:
        yield backend
    finally:
        if previous is None:
            del _backends[device_type]
        else:
            register_backend(device_type, previous)
