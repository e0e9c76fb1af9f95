"""Eviction policies: which unprotected slots to give to a batch's missing keys.

A pure function of the cache's bookkeeping tensors, so policies can be tested and swapped
without touching the cache's locking.
"""

from __future__ import annotations

import torch

__all__ = ["POLICIES", "choose_victims"]

POLICIES = ("lru", "lfu")


def choose_victims(candidates: torch.Tensor, count: int, policy: str, key_of_slot: torch.Tensor,
                   last_used: torch.Tensor, freq_of_key: torch.Tensor) -> torch.Tensor:
    """Pick ``count`` slots among ``candidates`` (slot ids): free slots first, then by policy.

    ``'lru'``: least recently used first. ``'lfu'``: lowest key frequency first, ties broken
    by least recently used (FBGEMM's LFU keeps a frequency per key over the whole table,
    so a key keeps its count when it leaves the cache; so do we).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; expected one of {POLICIES}")
    if count == 0:
        return candidates[:0]
    keys = key_of_slot[candidates]
    order = torch.argsort(last_used[candidates], stable=True)
    if policy == "lfu":
        freq = freq_of_key[keys.clamp(min=0)]
        order = order[torch.argsort(freq[order], stable=True)]
    occupied = (keys[order] >= 0).to(torch.int8)
    order = order[torch.argsort(occupied, stable=True)]
    return candidates[order[:count]]
