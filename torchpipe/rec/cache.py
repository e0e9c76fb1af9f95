"""The key-to-slot map of a device row cache, with eviction and in-flight protection.

Why protection: in a pipeline, batch i+1 is planned while batch i still reads its rows in
forward and writes them in backward. A key of an in-flight batch is protected from plan
time until `release`; the planner never evicts it. So consecutive batches' swaps touch
disjoint slots and the cache stays exact whatever the overlap.

This object owns only bookkeeping (which key is in which slot); the slot rows themselves
live in the owner's device tensor. All methods are thread-safe; `plan_swap` calls must be
made in batch order (the host-table ticket order follows it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .errors import CacheTooSmallError
from .eviction import POLICIES, choose_victims
from .swap_plan import SwapPlan

__all__ = ["EmbeddingCache", "CacheStats"]


@dataclass
class CacheStats:
    """Counters over unique keys of all planned batches, for hit rate and swap volume."""

    hits: int = 0
    misses: int = 0
    swapped_in: int = 0
    swapped_out: int = 0
    plans: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class EmbeddingCache:
    """``cache_rows`` device slots over a table of ``num_rows`` keys, policy ``'lru'`` or ``'lfu'``."""

    def __init__(self, num_rows: int, cache_rows: int, policy: str = "lru", name: str = "table") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; expected one of {POLICIES}")
        if not 0 < cache_rows:
            raise ValueError(f"cache_rows must be positive, got {cache_rows}")
        if cache_rows > num_rows:
            cache_rows = num_rows  # more slots than keys would never be used
        self.name = name
        self.num_rows = num_rows
        self.cache_rows = cache_rows
        self.policy = policy
        self._lock = threading.Lock()
        self.slot_of_key = torch.full((num_rows,), -1, dtype=torch.int64)
        self.key_of_slot = torch.full((cache_rows,), -1, dtype=torch.int64)
        self._last_used = torch.full((cache_rows,), -1, dtype=torch.int64)
        self._freq_of_key = torch.zeros(num_rows, dtype=torch.int64)
        self._protect_count = torch.zeros(cache_rows, dtype=torch.int32)
        self._tick = 0
        self._seq = 0
        self.stats = CacheStats()

    # -- planning ---------------------------------------------------------------------
    def _check_keys(self, unique_keys: torch.Tensor) -> torch.Tensor:
        if unique_keys.dim() != 1 or unique_keys.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"unique_keys must be a 1-D integer tensor, got {unique_keys.dtype} "
                             f"of shape {tuple(unique_keys.shape)}")
        keys = unique_keys.to(torch.int64)
        if keys.numel():
            if int(keys.min()) < 0 or int(keys.max()) >= self.num_rows:
                raise ValueError(f"table {self.name!r}: keys out of range [0, {self.num_rows})")
            if torch.unique(keys).numel() != keys.numel():
                raise ValueError(f"table {self.name!r}: plan_swap needs unique keys")
        return keys

    def _capacity_error(self, keys: torch.Tensor) -> CacheTooSmallError | None:
        """The error planning ``keys`` now would raise, or None. Holds ``_lock``."""
        slots = self.slot_of_key[keys]
        hit = slots >= 0
        candidates = self._protect_count == 0
        candidates[slots[hit]] = False
        missing = int((~hit).sum())
        available = int(candidates.sum())
        if missing <= available:
            return None
        return CacheTooSmallError(self.name, self.cache_rows, int(keys.numel()),
                                  int((self._protect_count > 0).sum()), missing, available)

    def check_fits(self, unique_keys: torch.Tensor) -> None:
        """Raise `CacheTooSmallError` if `plan_swap` would; changes nothing.

        Lets a caller with several tables check them all before planning any.
        """
        keys = self._check_keys(unique_keys)
        with self._lock:
            error = self._capacity_error(keys)
        if error is not None:
            raise error

    def plan_swap(self, unique_keys: torch.Tensor) -> SwapPlan:
        """Assign a slot to every key, evicting unprotected rows; protect the keys until `release`.

        Raises `CacheTooSmallError` (with the numbers) before any state changes when the
        unprotected slots cannot take the missing keys.
        """
        keys = self._check_keys(unique_keys)
        with self._lock:
            error = self._capacity_error(keys)
            if error is not None:
                raise error
            slots = self.slot_of_key[keys]
            hit = slots >= 0
            candidates_mask = self._protect_count == 0
            candidates_mask[slots[hit]] = False
            in_keys = keys[~hit]
            in_slots = choose_victims(torch.nonzero(candidates_mask).flatten(), int(in_keys.numel()),
                                      self.policy, self.key_of_slot, self._last_used, self._freq_of_key)
            evicting = self.key_of_slot[in_slots] >= 0
            out_slots = in_slots[evicting]
            out_keys = self.key_of_slot[out_slots]
            # Commit: nothing below can fail.
            self.slot_of_key[out_keys] = -1
            self.slot_of_key[in_keys] = in_slots
            self.key_of_slot[in_slots] = in_keys
            slots = slots.clone()
            slots[~hit] = in_slots
            self._tick += 1
            self._last_used[slots] = self._tick
            self._freq_of_key[keys] += 1
            self._protect_count[slots] += 1
            plan = SwapPlan(self.name, self._seq, keys, slots, out_keys, out_slots, in_keys, in_slots)
            self._seq += 1
            self.stats.plans += 1
            self.stats.hits += plan.hits
            self.stats.misses += plan.misses
            self.stats.swapped_in += int(in_keys.numel())
            self.stats.swapped_out += int(out_keys.numel())
            return plan

    def release(self, plan: SwapPlan) -> None:
        """End the protection of ``plan``'s keys: its forward and backward are done."""
        with self._lock:
            if plan.released:
                raise RuntimeError(f"swap plan {plan.seq} of table {self.name!r} released twice")
            plan.released = True
            self._protect_count[plan.slots_of_keys] -= 1

    # -- inspection -------------------------------------------------------------------
    def protected_slots(self) -> int:
        """Slots still protected by unreleased plans (0 when the pipeline is drained)."""
        with self._lock:
            return int((self._protect_count > 0).sum())

    def cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, slots)`` of every cached row."""
        with self._lock:
            slots = torch.nonzero(self.key_of_slot >= 0).flatten()
            return self.key_of_slot[slots].clone(), slots

    def is_cached(self, keys: torch.Tensor) -> torch.Tensor:
        """Boolean mask: which ``keys`` hold a slot now."""
        with self._lock:
            return self.slot_of_key[keys.to(torch.int64)] >= 0

    def clear(self) -> None:
        """Forget every cached row (after a flush or a load); refuses while plans are in flight."""
        with self._lock:
            if bool((self._protect_count > 0).any()):
                raise RuntimeError(f"cannot clear cache of table {self.name!r}: batches still in flight")
            self.slot_of_key.fill_(-1)
            self.key_of_slot.fill_(-1)
            self._last_used.fill_(-1)
