"""Which routed experts sit in the VRAM expert cache: N slots, each holding one expert's
gate+up+down blocks, keyed by (layer, expert), with an eviction policy and hit/miss counters.

This module is the bookkeeping only (pure Python, no bytes): `moe_offload.py` asks
`acquire(layer, experts)` for a layer's selected experts and copies the bytes of the ones
that missed into the slots it is told. Policies:

- `lru`: evict the slot whose expert was used longest ago.
- `lfu`: evict the expert with the lowest use frequency, where frequency decays by half every
  `half_life` lookups (aging, so experts that were popular long ago do not squat on slots);
  ties go to the least recently used.

The experts asked for in one `acquire` are never evicted by that same call, so a caller that
asks for at most `n_slots` experts at once always gets all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("lru", "lfu")
LFU_HALF_LIFE = 256  # lookups after which an expert's past uses count half


@dataclass
class CacheCounts:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses

    def as_dict(self) -> dict:
        n = self.lookups
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "hit_rate": self.hits / n if n else None}


@dataclass
class CacheStats:
    """Counters per layer and in total since the last reset."""
    layers: dict[int, CacheCounts] = field(default_factory=dict)
    copied_bytes: int = 0  # expert bytes moved into slots (host -> device)

    def layer(self, i: int) -> CacheCounts:
        return self.layers.setdefault(i, CacheCounts())

    @property
    def total(self) -> CacheCounts:
        t = CacheCounts()
        for c in self.layers.values():
            t.hits, t.misses, t.evictions = t.hits + c.hits, t.misses + c.misses, t.evictions + c.evictions
        return t

    def as_dict(self) -> dict:
        return {**self.total.as_dict(), "copied_bytes": self.copied_bytes,
                "per_layer": {str(i): c.as_dict() for i, c in sorted(self.layers.items())}}


class ExpertCache:
    """Slots 0..n_slots-1 and the (layer, expert) each holds."""

    def __init__(self, n_slots: int, policy: str = "lru", half_life: int = LFU_HALF_LIFE) -> None:
        if n_slots < 1:
            raise ValueError(f"the expert cache needs at least 1 slot, got {n_slots}")
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if half_life < 1:
            raise ValueError(f"LFU half-life must be >= 1 lookup, got {half_life}")
        self.n_slots, self.policy, self.half_life = n_slots, policy, half_life
        self.stats = CacheStats()
        self.clear()

    def clear(self) -> None:
        """Forget every cached expert (the slots' bytes become garbage)."""
        self.slot_of: dict[tuple[int, int], int] = {}
        self.key_of: list[tuple[int, int] | None] = [None] * self.n_slots
        self._free = list(range(self.n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._last: dict[tuple[int, int], int] = {}  # key -> clock of its last use
        self._freq: dict[tuple[int, int], float] = {}  # key -> decayed use count
        self._freq_at: dict[tuple[int, int], int] = {}  # clock when _freq was last brought up to date
        self._clock = 0

    def reset_stats(self) -> None:
        self.stats = CacheStats()

    def contains(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.slot_of

    def acquire(self, layer: int, experts) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for `experts` of `layer`: ({expert: slot}, [(expert, slot) to fill]). The
        misses' slots are taken from free slots first, then from evicted experts."""
        experts = [int(e) for e in experts]
        if len(set(experts)) > self.n_slots:
            raise ValueError(f"{len(set(experts))} experts asked for at once, but the cache has {self.n_slots} slots")
        wanted = {(layer, e) for e in experts}
        counts = self.stats.layer(layer)
        slots, fills = {}, []
        for e in dict.fromkeys(experts):
            key = (layer, e)
            self._clock += 1
            self._touch(key)
            if key in self.slot_of:
                counts.hits += 1
            else:
                counts.misses += 1
                slot = self._free.pop() if self._free else self._evict(wanted)
                self.slot_of[key], self.key_of[slot] = slot, key
                fills.append((e, slot))
            slots[e] = self.slot_of[key]
        return slots, fills

    def admit(self, layer: int, expert: int, protect=()) -> int | None:
        """Prefetch: a slot for (layer, expert) if it is not cached (None if it is), evicting
        by the policy but never an expert in `protect`. Counted as neither hit nor miss."""
        key = (layer, int(expert))
        if key in self.slot_of:
            return None
        keep = {(layer, int(e)) for e in protect} | {key}
        if not self._free and all(k in keep for k in self.slot_of):
            return None
        slot = self._free.pop() if self._free else self._evict(keep)
        self.slot_of[key], self.key_of[slot] = slot, key
        self._last.setdefault(key, self._clock)
        return slot

    def _touch(self, key: tuple[int, int]) -> None:
        self._last[key] = self._clock
        self._freq[key] = self._decayed(key) + 1.0
        self._freq_at[key] = self._clock

    def _decayed(self, key: tuple[int, int]) -> float:
        if key not in self._freq:
            return 0.0
        return self._freq[key] * 0.5 ** ((self._clock - self._freq_at[key]) / self.half_life)

    def _evict(self, protect: set) -> int:
        candidates = [k for k in self.slot_of if k not in protect]
        if not candidates:  # acquire() checked the count; this is a caller bug
            raise RuntimeError("no expert slot can be evicted")
        if self.policy == "lru":
            victim = min(candidates, key=lambda k: self._last.get(k, -1))
        else:
            victim = min(candidates, key=lambda k: (self._decayed(k), self._last.get(k, -1)))
        slot = self.slot_of.pop(victim)
        self.key_of[slot] = None
        self.stats.layer(victim[0]).evictions += 1
        return slot
