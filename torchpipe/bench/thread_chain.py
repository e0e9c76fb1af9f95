"""The floor of any threaded pipeline in CPython: a thread per stage, a queue between them.

:class:`ThreadChain` is what a pipeline runtime would be with nothing of its own: no plan,
no dependency tracking, no timings, no error recovery, no device or stream handling, no
checkpointing. Each stage thread takes a micro-batch from its queue, runs its layer and puts
the result on the next queue; the caller splits the batch, feeds the first queue and
concatenates what comes out of the last one. Backward is autograd's, on the caller's thread,
as in ``Pipe.forward``.

It is a benchmark baseline, not a product: it shows how much of a pipeline's per-task cost
is the machine's (waking a thread, passing the GIL) and how much the runtime adds on top.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, List, Sequence

import torch
from torch import nn

__all__ = ["ThreadChain"]

_STOP = object()


class _Failed:
    """A stage's exception, travelling down the chain to the caller."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ThreadChain(nn.Module):
    """``layers[i]`` on thread ``i``; ``forward`` splits the batch into ``chunks`` micro-batches."""

    def __init__(self, layers: Sequence[nn.Module], chunks: int, device: Any = "cpu") -> None:
        super().__init__()
        if chunks < 1:
            raise ValueError(f"chunks must be a positive int, got {chunks!r}")
        self.layers = nn.ModuleList(layers).to(device)
        self.chunks = chunks
        self._queues: List["queue.SimpleQueue[Any]"] = [queue.SimpleQueue() for _ in range(len(self.layers) + 1)]
        self._lock = threading.Lock()  # one forward at a time: micro-batches must not interleave
        self._threads = [
            threading.Thread(target=self._stage, args=(i,), name=f"thread-chain-{i}", daemon=True)
            for i in range(len(self.layers))
        ]
        for thread in self._threads:
            thread.start()

    def _stage(self, index: int) -> None:
        layer, get, put = self.layers[index], self._queues[index].get, self._queues[index + 1].put
        while True:
            item = get()
            if item is _STOP:
                put(_STOP)
                return
            if isinstance(item, _Failed):
                put(item)
                continue
            grad_enabled, value = item
            try:
                with torch.set_grad_enabled(grad_enabled):
                    put((grad_enabled, layer(value)))
            except BaseException as exc:  # noqa: B902 - reaches the caller, never kills the thread
                put(_Failed(exc))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._lock:
            parts = x.chunk(self.chunks)
            grad_enabled = torch.is_grad_enabled()
            first, last = self._queues[0].put, self._queues[-1].get
            for part in parts:
                first((grad_enabled, part))
            outputs, error = [], None
            for _ in parts:
                item = last()
                if isinstance(item, _Failed):
                    error = error or item.error
                else:
                    outputs.append(item[1])
            if error is not None:
                raise error
            return torch.cat(outputs)

    def close(self) -> None:
        """Stop and join the stage threads (idempotent)."""
        if self._threads and self._threads[0].is_alive():
            self._queues[0].put(_STOP)
        for thread in self._threads:
            thread.join()
