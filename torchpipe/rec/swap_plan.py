"""The swap info of one batch for one table: what to evict, what to load, where keys live."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .host_table import WriteTicket

__all__ = ["SwapPlan"]


@dataclass(eq=False)
class SwapPlan:
    """Computed on the host at plan time; consumed by the swap and forward steps.

    ``swap_out_*``: rows to gather from their slots and write back to the host table
    (their keys are not in the batch). ``swap_in_*``: rows to read from the host table and
    scatter into their slots (their keys were not cached). ``slots_of_keys[i]`` is the slot
    of ``unique_keys[i]``, the restore index; `slots_of_positions` maps it back to every key
    position of the batch. The batch's keys stay protected until the cache's ``release``.
    """

    table: str
    seq: int
    unique_keys: torch.Tensor
    slots_of_keys: torch.Tensor
    swap_out_keys: torch.Tensor
    swap_out_slots: torch.Tensor
    swap_in_keys: torch.Tensor
    swap_in_slots: torch.Tensor
    ticket: WriteTicket | None = None
    released: bool = field(default=False)

    @property
    def hits(self) -> int:
        return int(self.unique_keys.numel() - self.swap_in_keys.numel())

    @property
    def misses(self) -> int:
        return int(self.swap_in_keys.numel())

    def slots_of_positions(self, inverse: torch.Tensor) -> torch.Tensor:
        """Slot of every key position, given the positions' index into ``unique_keys``."""
        return self.slots_of_keys[inverse]
