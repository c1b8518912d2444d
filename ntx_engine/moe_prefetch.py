"""Prefetch of the next layer's experts (an experiment; docs/moe.md reports what it measured).

After layer L's routed experts are issued, layer L+1's router is applied to layer L's
normalized FFN input h: the hidden state changes little from one layer to the next, so its
top-k is a guess at layer L+1's choice. Guessed experts that are not cached are copied into
slots on the copy stream while layer L+1's attention runs; when layer L+1 routes, a guess that
was right is a hit. Only single-token passes (decode) prefetch. The copies count in the
cache's copied bytes: a wrong guess costs link bandwidth.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Prefetcher:
    def __init__(self, offload: Any, routers: list, n_used: int, norm: bool) -> None:
        self.off, self.routers, self.n_used, self.norm = offload, routers, n_used, norm
        self.reset()

    def reset(self) -> None:
        self.pending: set[tuple[int, int]] = set()  # prefetched, not looked up yet
        self.issued = self.useful = 0
        self.copied_bytes = 0

    def after_layer(self, i: int, h: Any) -> None:
        """Guess layer i+1's experts from layer i's normalized input and copy in the misses."""
        j, off = i + 1, self.off
        if j >= len(self.routers) or off.sides[j] != "gpu":
            return
        b = off.b
        ids, _ = off.moe.route(b.matmul(self.routers[j], h), self.n_used, self.norm)
        guess = np.unique(np.asarray(b.to_numpy(ids)))
        pool = off.pool_of[j]
        for e in guess:
            slot = pool.cache.admit(j, int(e), protect=guess)
            if slot is None:
                continue
            parts, staged = off.store.parts(j, int(e))
            pool.slots.fill(slot, parts)
            if staged:
                pool.slots.wait_copies()
            n = sum(p.nbytes for p in parts)
            pool.cache.stats.copied_bytes += n
            self.copied_bytes += n
            self.pending.add((j, int(e)))
            self.issued += 1

    def looked_up(self, i: int, experts, fills) -> None:
        """Layer i looked `experts` up; `fills` are the misses among them."""
        missed = {e for e, _ in fills}
        for e in experts:
            key = (i, int(e))
            if key in self.pending:
                self.pending.discard(key)
                self.useful += int(e) not in missed

    def stats(self) -> dict:
        return {"issued": self.issued, "useful": self.useful,
                "accuracy": self.useful / self.issued if self.issued else None,
                "copied_bytes": self.copied_bytes}
