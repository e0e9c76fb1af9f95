"""Eviction policies: which unprotected slots to give to a batch's missing keys.

Pure functions of the cache's bookkeeping tensors, so policies can be tested and swapped
without touching the cache's locking.

The order of victims (both policies) is lexicographic and total, so it is deterministic:

* free slots first, then occupied ones;
* ``'lru'``: then least recently used first (``last_used``, the plan tick of the slot's
  last use);
* ``'lfu'``: then lowest key frequency first, ties by least recently used;
* remaining ties (slots last used by the same batch) by lower slot id.

`select_victims` computes that order with one partial selection (`torch.topk`) over an
int64 priority per slot that packs the whole lexicographic key; `choose_victims` is the
sort-based formulation of the same order (the fallback when the packed key would overflow
int64, and the reference the fast path is tested against).
"""

from __future__ import annotations

import torch

__all__ = ["POLICIES", "LruIndex", "check_policy", "choose_victims", "select_victims"]

POLICIES = ("lru", "lfu")

_INT64_MAX = torch.iinfo(torch.int64).max
_PACK_LIMIT = 1 << 62  # packed priorities stay below this, so INT64_MAX marks "not a candidate"


def check_policy(policy: object) -> None:
    """TypeError unless ``policy`` is a str, ValueError unless it is one of `POLICIES`."""
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, one of {POLICIES}; got {policy!r}")
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; expected one of {POLICIES}")


def choose_victims(candidates: torch.Tensor, count: int, policy: str, key_of_slot: torch.Tensor,
                   last_used: torch.Tensor, freq_of_key: torch.Tensor) -> torch.Tensor:
    """Pick ``count`` slots among ``candidates`` (ascending slot ids): free slots first, then by policy.

    ``'lru'``: least recently used first. ``'lfu'``: lowest key frequency first, ties broken
    by least recently used (FBGEMM's LFU keeps a frequency per key over the whole table,
    so a key keeps its count when it leaves the cache; so do we. A key's frequency here is
    the number of batches that held it; FBGEMM adds its occurrences). Remaining ties: lower slot
    id first (stable sorts over ascending ``candidates``). Returns the victims in that order.
    """
    check_policy(policy)
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


def select_victims(candidate_mask: torch.Tensor, count: int, policy: str, key_of_slot: torch.Tensor,
                   last_used: torch.Tensor, freq_of_key: torch.Tensor, tick: int) -> torch.Tensor:
    """`choose_victims` over the slots where ``candidate_mask`` is true, without a full sort.

    Same victims in the same order. ``tick`` bounds ``last_used`` (every value is in
    ``[-1, tick]``). Packs (occupied, [frequency,] last use, slot) into one int64 per slot
    and takes the ``count`` smallest with `torch.topk`; priorities are unique, so the result
    does not depend on the selection algorithm. Falls back to `choose_victims` when the
    packed key could overflow.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; expected one of {POLICIES}")
    slots = candidate_mask.numel()
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    occupied = key_of_slot >= 0
    # Radix of each field: slot in [0, slots), last use + 1 in [0, tick + 1], frequency in [0, top].
    uses = tick + 2
    if policy == "lru":
        prefix = occupied.to(torch.int64)                       # (occupied)
        span = 2
    else:
        freq = freq_of_key[key_of_slot.clamp(min=0)]
        top = int(freq.max()) + 1 if freq.numel() else 1
        # free slots: frequency field 0 (all free slots share the key-0 frequency in the
        # sort-based order, so the field does not order them); occupied: top + frequency.
        prefix = torch.where(occupied, freq + top, 0)           # (occupied, frequency)
        span = 2 * top
    if span * uses * slots >= _PACK_LIMIT:
        if uses * slots < _PACK_LIMIT:  # a long LFU run: frequencies and ticks both grew
            return _select_by_prefix_first(candidate_mask, count, prefix, last_used, uses, slots)
        return choose_victims(torch.nonzero(candidate_mask).flatten(), count, policy, key_of_slot,
                              last_used, freq_of_key)
    priority = (prefix * uses + (last_used + 1)) * slots + torch.arange(slots, dtype=torch.int64)
    priority.masked_fill_(~candidate_mask, _INT64_MAX)
    if count * 4 >= slots:  # most of the slots: a full sort is as cheap as a selection
        return torch.sort(priority).indices[:count]
    return torch.topk(priority, count, largest=False, sorted=True).indices


def _select_by_prefix_first(candidate_mask: torch.Tensor, count: int, prefix: torch.Tensor, last_used: torch.Tensor,
                            uses: int, slots: int) -> torch.Tensor:
    """`select_victims`'s order when (prefix, last use, slot) no longer packs into an int64.

    Linear in the cache, like the packed path: the ``count``-th smallest prefix (one
    selection) splits the candidates into sure victims (smaller prefix) and ties (that
    prefix), of which the ones used least recently, then lowest slot, are taken. Only the
    ``count`` victims are sorted into the full order.
    """
    masked = prefix.masked_fill(~candidate_mask, _INT64_MAX)
    threshold = torch.kthvalue(masked, count).values
    sure = torch.nonzero(masked < threshold).flatten()
    tied = torch.nonzero(masked == threshold).flatten()
    tied_priority = (last_used[tied] + 1) * slots + tied  # below uses * slots: no overflow
    taken = torch.topk(tied_priority, count - sure.numel(), largest=False, sorted=False).indices
    victims = torch.cat([sure, tied[taken]])
    # Stable sorts, least significant field first, give the (prefix, last use, slot) order.
    victims = victims[torch.argsort(victims)]
    victims = victims[torch.argsort(last_used[victims], stable=True)]
    return victims[torch.argsort(prefix[victims], stable=True)]


class LruIndex:
    """The occupied slots in LRU order, kept incrementally: one bucket of slots per plan tick.

    A bucket ``(tick, slots)`` holds the slots a plan used at ``tick``; an entry is live while
    ``last_used[slot] == tick`` (a later use or an eviction makes it stale; stale entries are
    dropped lazily). Buckets in tick order, each sorted by slot, give exactly the LRU order
    (least recently used first, ties by lower slot), so `select` finds the victims by
    reading the oldest buckets: work proportional to the batch, not to the cache.

    The index is only a shortcut: `select` returns None (the caller then uses the full
    selection) when the walk would get long, and when the plans leave too many distinct
    ticks in the cache the index turns itself off and tries to rebuild later.
    """

    max_walk = 16       # buckets `select` reads before giving up
    max_buckets = 256   # more live ticks than this: off until `retry_every` more plans

    def __init__(self, cache_rows: int) -> None:
        self.cache_rows = cache_rows
        self.clear()

    def clear(self) -> None:
        self._buckets: list[list] = []  # [tick, slots, sorted]
        self._entries = 0
        self._valid = True
        self._retry_at = 0

    def add(self, tick: int, slots: torch.Tensor, key_of_slot: torch.Tensor, last_used: torch.Tensor) -> None:
        """Record that ``slots`` were used at ``tick`` (after ``last_used`` was updated)."""
        if not self._valid:
            if tick >= self._retry_at:
                self._rebuild(tick, key_of_slot, last_used)
            return
        if slots.numel():
            self._buckets.append([tick, slots.clone(), False])
            self._entries += int(slots.numel())
        if len(self._buckets) > self.max_buckets or self._entries > 2 * self.cache_rows + 4096:
            self._rebuild(tick, key_of_slot, last_used)

    def _rebuild(self, tick: int, key_of_slot: torch.Tensor, last_used: torch.Tensor) -> None:
        slots = torch.nonzero(key_of_slot >= 0).flatten()
        used = last_used.index_select(0, slots)
        order = torch.argsort(used, stable=True)  # by (last use, slot)
        ticks, counts = torch.unique_consecutive(used[order], return_counts=True)
        if ticks.numel() > self.max_buckets:
            self._buckets, self._entries, self._valid = [], 0, False
            self._retry_at = tick + self.max_buckets
            return
        self._buckets = [[t, s, True] for t, s in zip(ticks.tolist(), torch.split(slots[order], counts.tolist()))]
        self._entries = int(slots.numel())
        self._valid = True

    def select(self, count: int, last_used: torch.Tensor, protect_count: torch.Tensor,
               batch_slot: torch.Tensor) -> torch.Tensor | None:
        """The ``count`` least recently used occupied slots that are unprotected and not in
        ``batch_slot`` (a mask), in LRU order; None if the index cannot tell cheaply."""
        if not self._valid:
            return None
        taken: list[torch.Tensor] = []
        left = count
        walked = 0
        while left > 0:
            if walked >= len(self._buckets) or walked >= self.max_walk:
                self._drop_empty(walked)
                return None
            bucket = self._buckets[walked]
            tick, slots, is_sorted = bucket
            live = slots[last_used.index_select(0, slots) == tick]
            if not is_sorted:
                live = torch.sort(live).values
            self._entries -= int(slots.numel() - live.numel())
            bucket[1], bucket[2] = live, True
            free = live[(protect_count.index_select(0, live) == 0) & ~batch_slot.index_select(0, live)]
            take = free[:left]
            taken.append(take)
            left -= int(take.numel())
            walked += 1
        self._drop_empty(walked)
        return torch.cat(taken) if taken else torch.empty(0, dtype=torch.int64)

    def _drop_empty(self, walked: int) -> None:
        if any(b[1].numel() == 0 for b in self._buckets[:walked]):
            self._buckets = [b for b in self._buckets[:walked] if b[1].numel()] + self._buckets[walked:]
