"""The full embedding table and its optimizer state, in host memory, shared by host workers.

Why a ticket order: the swap-out of batch i writes a row back here and the swap-in of a
later batch may read that same row, possibly on another thread and before the write has
run. Relying on timing (or on a shared thread pool) lets the reader see a stale row. So
every swap plan takes a `WriteTicket` *at plan time*, in batch order: it marks the keys it
will write back as pending under its sequence number. A `lookup` made with ticket ``s``
waits until no key it reads has a pending write with a sequence number below ``s``. The
order is thus fixed by planning, which is serial, and not by when threads happen to run.
Every wait can be woken by `abort`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checks import check_nonnegative_int, check_positive_int
from .errors import CacheAbortedError
from .portable import in_use_error, restore_locks, state_without_locks

__all__ = ["HostEmbeddingTable", "WriteTicket", "accelerator_present"]


def accelerator_present() -> bool:
    """True when a CUDA/NPU-like accelerator is usable, i.e. when pinned memory pays off."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        try:
            return bool(accelerator.is_available())
        except Exception:  # pragma: no cover - backend probing failed
            return False
    return torch.cuda.is_available()  # pragma: no cover - older torch


@dataclass(eq=False)
class WriteTicket:
    """A place in the host-table order: writes of ``keys`` pending under ``seq``.

    A reader holding ticket ``s`` sees every write of a ticket below ``s``.
    """

    seq: int
    keys: torch.Tensor
    done: bool = field(default=False)


class HostEmbeddingTable:
    """Host rows ``[num_rows, dim + state_width]``: ``[embedding | optimizer state]``.

    Pinned when an accelerator is present (``pin_memory=None``), so host-device copies can
    be asynchronous. `lookup`, `update` and the ticket calls are safe from several threads.
    """

    _LOCKS = {"_cond": threading.Condition}

    def __getstate__(self) -> dict[str, Any]:  # copy and pickle: see `portable`
        if self._pending_tickets:
            raise in_use_error("HostEmbeddingTable", f"{self._pending_tickets} write tickets pending",
                               "Land or cancel them first")
        state = state_without_locks(self, self._LOCKS)
        state["_abort_exc"] = None  # a copy starts usable: an abort belongs to the step that failed here
        state["_pinned"] = self.rows.is_pinned()  # a copied tensor is not pinned: pinned again below
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        pinned = state.pop("_pinned", False)
        restore_locks(self, state, self._LOCKS)
        if pinned and not self.rows.is_pinned() and accelerator_present():
            self.rows = self.rows.pin_memory()

    def __init__(self, num_rows: int, dim: int, state_width: int, dtype: torch.dtype = torch.float32,
                 pin_memory: bool | None = None, weight: torch.Tensor | None = None,
                 state: torch.Tensor | None = None) -> None:
        check_positive_int("num_rows", num_rows)
        check_positive_int("dim", dim)
        check_nonnegative_int("state_width", state_width)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.num_rows = num_rows
        self.dim = dim
        self.state_width = state_width
        if weight is not None:
            self._check_shape("weight", weight, dim)
        if state is not None:
            self._check_shape("state", state, state_width)
        if pin_memory is None:
            pin_memory = accelerator_present()
        self.dtype = dtype
        self.rows = torch.zeros(num_rows, dim + state_width, dtype=dtype, pin_memory=pin_memory)
        # Values only: a weight that requires grad (a TorchRec EBC's parameter) must not pull
        # the host rows into autograd, where every later write would grow its graph.
        if weight is not None:
            self.rows[:, :dim] = weight.detach()
        if state is not None:
            self.rows[:, dim:] = state.detach()
        self._cond = threading.Condition()
        # For each key, the sequence number of its pending write, or -1.
        self._pending_seq = torch.full((num_rows,), -1, dtype=torch.int64)
        self._pending_tickets = 0
        self._next_seq = 0
        self._abort_exc: BaseException | None = None

    def _check_shape(self, what: str, tensor: torch.Tensor, width: int) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor of shape {(self.num_rows, width)}, "
                            f"got {type(tensor).__name__}")
        if tuple(tensor.shape) != (self.num_rows, width):
            raise ValueError(f"{what} has shape {tuple(tensor.shape)}, expected {(self.num_rows, width)}")

    @property
    def weight(self) -> torch.Tensor:
        """The embedding columns (a view)."""
        return self.rows[:, :self.dim]

    @property
    def state(self) -> torch.Tensor:
        """The optimizer-state columns (a view)."""
        return self.rows[:, self.dim:]

    # -- ordering ---------------------------------------------------------------------
    def reserve_write(self, keys: torch.Tensor) -> WriteTicket:
        """Take the next place in the order and mark ``keys`` as written back there.

        Call in batch order (the cache's planning does, under its lock). ``keys`` may be empty:
        the ticket still orders the batch's lookups after every earlier write.
        """
        keys = self._check_keys(keys)  # before anything changes: a wrapped key could never land
        with self._cond:
            if keys.numel() and bool((self._pending_seq[keys] >= 0).any()):
                raise RuntimeError("host-table write reserved twice for a key before the first landed")
            seq = self._next_seq
            self._next_seq += 1
            if keys.numel():
                self._pending_seq[keys] = seq
                self._pending_tickets += 1
            return WriteTicket(seq, keys, done=keys.numel() == 0)

    def _wait_for_writes(self, keys: torch.Tensor, before_seq: int) -> None:
        """Block (holding ``_cond``) until no key has a pending write below ``before_seq``."""
        while True:
            if self._abort_exc is not None:
                raise CacheAbortedError("host-table lookup aborted") from self._abort_exc
            if self._pending_tickets == 0:
                return
            pending = self._pending_seq[keys]
            if not bool(((pending >= 0) & (pending < before_seq)).any()):
                return
            self._cond.wait()

    def _clear_ticket(self, ticket: WriteTicket) -> None:
        if ticket.done:
            return
        ticket.done = True
        mine = self._pending_seq[ticket.keys] == ticket.seq
        self._pending_seq[ticket.keys[mine]] = -1
        self._pending_tickets -= 1
        self._cond.notify_all()

    def pending_writes(self) -> int:
        """Tickets whose write-back has not landed (0 when the pipeline is drained)."""
        with self._cond:
            return self._pending_tickets

    # -- data -------------------------------------------------------------------------
    def _check_keys(self, keys: torch.Tensor) -> torch.Tensor:
        if not isinstance(keys, torch.Tensor) or keys.dim() != 1 or keys.is_floating_point() or keys.is_complex() \
                or keys.dtype == torch.bool:
            raise TypeError(f"host-table keys must be a 1-D integer tensor, got {_describe(keys)}")
        keys = keys.to(torch.int64)
        if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= self.num_rows):
            bad = keys[(keys < 0) | (keys >= self.num_rows)]
            raise IndexError(f"host-table keys out of range [0, {self.num_rows}): e.g. {bad[:5].tolist()}")
        return keys

    def lookup(self, keys: torch.Tensor, ticket: WriteTicket | None = None) -> torch.Tensor:
        """Copy of the rows of ``keys``; with ``ticket``, after every earlier pending write of them."""
        keys = self._check_keys(keys)
        _check_ticket(ticket)
        with self._cond:
            if ticket is not None:
                self._wait_for_writes(keys, ticket.seq)
            return self.rows.index_select(0, keys)

    def update(self, keys: torch.Tensor, rows: torch.Tensor, ticket: WriteTicket | None = None) -> None:
        """Write ``rows`` for ``keys``; with ``ticket``, land that ticket's pending writes and wake readers."""
        keys = self._check_keys(keys)
        _check_ticket(ticket)
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"host-table rows must be a tensor, got {_describe(rows)}")
        rows = rows.detach().to(device="cpu", dtype=self.dtype)
        if rows.shape != (keys.numel(), self.rows.shape[1]):
            raise ValueError(f"rows have shape {tuple(rows.shape)}, expected {(keys.numel(), self.rows.shape[1])}")
        with self._cond:  # never blocks, so it runs even when aborted: no row is lost
            self.rows.index_copy_(0, keys, rows)
            if ticket is not None:
                self._clear_ticket(ticket)

    def cancel(self, ticket: WriteTicket) -> None:
        """Drop a ticket's pending writes without writing (its step was rolled back)."""
        if not isinstance(ticket, WriteTicket):
            raise TypeError(f"cancel takes a WriteTicket from this table, got {_describe(ticket)}")
        with self._cond:
            self._clear_ticket(ticket)

    # -- abort ------------------------------------------------------------------------
    def abort(self, exc: BaseException) -> None:
        """Wake every waiting lookup with `CacheAbortedError` (cause: ``exc``) until `clear_abort`."""
        with self._cond:
            self._abort_exc = exc
            self._cond.notify_all()

    def clear_abort(self) -> None:
        """Make the table usable again after an abort."""
        with self._cond:
            self._abort_exc = None


def _check_ticket(ticket: object) -> None:
    """Before anything is written: a bad ticket found after the write would leave it half done."""
    if ticket is not None and not isinstance(ticket, WriteTicket):
        raise TypeError(f"ticket must be a WriteTicket from this table or None, got {_describe(ticket)}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__}: {value!r:.60}"
