"""The VRAM expert cache's bookkeeping (ntx_engine/expert_cache.py): eviction order of the LRU
and LFU policies against a direct replay of their definitions, counters, and bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.expert_cache import ExpertCache


def test_lru_evicts_the_least_recently_used():
    c = ExpertCache(3, "lru")
    c.acquire(0, [1, 2])
    c.acquire(0, [3])
    c.acquire(0, [1])  # 2 is now the oldest
    slots, fills = c.acquire(0, [4])
    assert not c.contains(0, 2) and all(c.contains(0, e) for e in (1, 3, 4))
    assert fills == [(4, slots[4])] and slots[4] == 1  # 2 sat in slot 1
    assert c.stats.layer(0).evictions == 1


def test_lfu_keeps_the_frequent_expert():
    c = ExpertCache(2, "lfu")
    for _ in range(5):
        c.acquire(0, [7])
    c.acquire(0, [8])  # used once, and more recently than 7
    c.acquire(0, [9])  # LRU would evict 7; LFU evicts 8
    assert c.contains(0, 7) and c.contains(0, 9) and not c.contains(0, 8)


def test_lfu_ages_old_popularity():
    """With a half-life of 2 lookups, 4 old uses of expert 1 weigh less than 14 recent uses of
    2; without aging (a huge half-life) 1 would still beat 2's first use."""
    c = ExpertCache(2, "lfu", half_life=2)
    for _ in range(4):
        c.acquire(0, [1])
    for _ in range(14):
        c.acquire(0, [2])
    c.acquire(0, [3])
    assert not c.contains(0, 1) and c.contains(0, 2)
    c = ExpertCache(2, "lfu", half_life=10 ** 9)
    for _ in range(4):
        c.acquire(0, [1])
    c.acquire(0, [2])
    c.acquire(0, [3])
    assert c.contains(0, 1) and not c.contains(0, 2)


def test_one_acquire_never_evicts_its_own_experts():
    c = ExpertCache(2, "lru")
    c.acquire(0, [0, 1])
    slots, fills = c.acquire(0, [1, 2])  # must evict 0, never 1
    assert set(slots) == {1, 2} and c.contains(0, 1) and not c.contains(0, 0)
    assert [e for e, _ in fills] == [2]
    assert len(set(slots.values())) == 2


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_counts_add_up_and_slots_stay_consistent(policy):
    """hits + misses == lookups, misses - evictions == occupied slots; a replayed LRU (the
    definition, written directly) agrees on every hit/miss."""
    rng = np.random.default_rng(3)
    c = ExpertCache(5, policy)
    lookups, order = 0, []  # order: LRU replay (most recent last)
    hits_ref = 0
    for _ in range(400):
        layer = int(rng.integers(0, 3))
        experts = list(dict.fromkeys(int(e) for e in rng.integers(0, 8, 2)))
        before = {k for k in c.slot_of}
        c.acquire(layer, experts)
        lookups += len(experts)
        for e in experts:
            hits_ref += (layer, e) in before
        assert len(set(c.slot_of.values())) == len(c.slot_of) <= 5
        assert all(c.key_of[s] == k for k, s in c.slot_of.items())
        if policy == "lru":
            for e in experts:
                if (layer, e) in order:
                    order.remove((layer, e))
                order.append((layer, e))
            order = order[-5:] if len(order) > 5 else order
            assert set(order) == set(c.slot_of)
    t = c.stats.total
    assert t.hits + t.misses == lookups and t.hits == hits_ref
    assert t.misses - t.evictions == len(c.slot_of)


def test_admit_prefetches_without_counting():
    c = ExpertCache(2, "lru")
    c.acquire(0, [0])
    assert c.admit(1, 3) is not None and c.admit(1, 3) is None
    assert c.stats.total.lookups == 1
    assert c.admit(1, 4, protect=[3]) is not None  # evicts layer 0's expert, keeps 3
    assert not c.contains(0, 0) and c.contains(1, 3) and c.contains(1, 4)
    assert c.admit(1, 5, protect=[3, 4]) is None and not c.contains(1, 5)  # nothing may go


@pytest.mark.parametrize("args, match", [((0,), "at least 1 slot"), ((2, "fifo"), "lru, lfu"),
                                         ((2, "lfu", 0), "half-life")])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        ExpertCache(*args)


def test_more_experts_than_slots_at_once_is_an_error():
    with pytest.raises(ValueError, match="3 experts asked for at once"):
        ExpertCache(2).acquire(0, [0, 1, 2])
