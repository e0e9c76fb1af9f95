"""select_victims (the cache's fast path) against choose_victims (the sort-based definition).

The packed path, the path for counters too large to pack (a long LFU run: frequencies and
plan ticks both grow with the run), and the plain fallback must give the same victims in
the same order.
"""

from __future__ import annotations

import pytest
import torch

from torchpipe.rec import eviction
from torchpipe.rec.eviction import choose_victims, select_victims


def random_state(generator: torch.Generator, slots: int, tick: int, top_freq: int):
    keys = torch.randperm(slots * 3, generator=generator)[:slots]
    free = torch.rand(slots, generator=generator) < 0.2
    key_of_slot = torch.where(free, -1, keys)
    # Few distinct values, so that ties (same last use, same frequency) are common.
    last_used = torch.randint(0, 4, (slots,), generator=generator) * (tick // 4) + torch.randint(0, 2, (slots,), generator=generator)
    last_used = torch.where(free, -1, last_used.clamp(max=tick))
    freq_of_key = torch.randint(0, 3, (slots * 3,), generator=generator) * (top_freq // 3)
    candidate_mask = torch.rand(slots, generator=generator) < 0.7
    return candidate_mask, key_of_slot, last_used, freq_of_key


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("tick,top_freq,path", [
    (50, 9, "packed"),
    (1 << 20, 1 << 40, "prefix first"),  # frequency x tick x slots overflows int64, tick x slots does not
    (1 << 61, 1 << 40, "sorted"),        # even tick x slots overflows
])
def test_fast_selection_equals_the_sort_based_order(policy: str, tick: int, top_freq: int, path: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    taken = []
    for name in ("_select_by_prefix_first", "choose_victims"):
        original = getattr(eviction, name)

        def spy(*args, _original=original, _name=name):
            taken.append(_name)
            return _original(*args)

        monkeypatch.setattr(eviction, name, spy)
    generator = torch.Generator().manual_seed(tick % 1000 + len(policy))
    for trial in range(40):
        slots = int(torch.randint(2, 300, (1,), generator=generator))
        candidate_mask, key_of_slot, last_used, freq_of_key = random_state(generator, slots, tick, top_freq)
        candidates = torch.nonzero(candidate_mask).flatten()
        # The cache never asks for more victims than there are candidates.
        for count in {0, min(1, candidates.numel()), candidates.numel() // 3, candidates.numel()}:
            expected = choose_victims(candidates, count, policy, key_of_slot, last_used, freq_of_key)
            got = select_victims(candidate_mask, count, policy, key_of_slot, last_used, freq_of_key, tick)
            assert torch.equal(got, expected), (trial, slots, count)
    # Each case ran the path it is named after (LRU packs no frequency: only huge ticks overflow).
    used = set(taken)
    expected_paths = {"packed": set(), "prefix first": {"_select_by_prefix_first"} if policy == "lfu" else set(),
                      "sorted": {"choose_victims"}}[path]
    assert used == expected_paths
