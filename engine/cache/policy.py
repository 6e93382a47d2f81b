"""Eviction policies of the expert cache: pure per-layer bookkeeping, no threads, no I/O.

A policy keeps, per layer, the order of the evictable resident slots (:class:`LayerOrder`) and
picks the victim. The cache calls it with its lock held; a policy never blocks, reads or
allocates slots. Adding a policy: one class deriving from :class:`EvictionPolicy` in a file
of its own beside this one, registered in engine/cache/registry.py (the setting's choices are
read from there).

- "lru": the victim is the least recently used slot (O(1): an ordered dict per layer).
- "lfru": colibri's ``heat << 8 | recency`` score (recency <= 255), so one routing count
  outweighs any recency: the least recent slot of the lowest heat (buckets of equal heat, LRU
  inside a bucket; O(log distinct heats)).
- "ema": the slot whose expert has the lowest exponential moving average of the router's
  softmax probability (ties: least recent; a vectorised O(cap) scan).

Every policy skips busy slots and takes a speculation not yet used (``staged``) only when
nothing else is evictable.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np


class LayerOrder:
    """One layer's eviction bookkeeping (slot ids, all evictable: resident and unpinned)."""

    __slots__ = ("lru", "buckets", "heap", "staged")

    def __init__(self):
        self.lru: OrderedDict[int, None] = OrderedDict()  # evictable resident slots, oldest first
        self.buckets: dict[int, OrderedDict] = {}  # LFRU: heat -> OrderedDict(slot)
        self.heap: list[int] = []  # LFRU: heats that may have a bucket (lazy deletion)
        self.staged: OrderedDict[int, None] = OrderedDict()  # speculative loads not yet used


class EvictionPolicy:
    """Base: recency order in ``LayerOrder.lru``; subclasses override :meth:`pick` (and the
    tracking methods when their order lives elsewhere).

    Args:
        heat: int64 [L, E] routing counts (read only).
        prob_ema: float64 [L, E] router-probability EMA (read only).
        max_cap: slots per layer of the arena.

    ``busy`` and ``experts`` below are one layer's rows: int32 [cap] readers of each slot and
    int32 [cap] the expert in each slot. ``stats`` has a ``victim_scans`` counter.
    """

    name = ""

    def __init__(self, heat: np.ndarray, prob_ema: np.ndarray, max_cap: int):
        self.heat = heat
        self.prob_ema = prob_ema
        self.max_cap = max_cap

    def track(self, ly: LayerOrder, layer: int, slot: int, expert: int) -> None:
        """Make a resident, unpinned slot evictable (most recent position)."""
        ly.lru[slot] = None

    def track_cold(self, ly: LayerOrder, layer: int, slot: int, expert: int) -> None:
        """Make a slot evictable at the cold end (the first victim): a load nothing has routed to yet."""
        self.track(ly, layer, slot, expert)
        ly.lru.move_to_end(slot, last=False)

    def untrack(self, ly: LayerOrder, layer: int, slot: int) -> None:
        """The slot is no longer evictable (evicted, pinned or taken)."""
        ly.lru.pop(slot, None)
        ly.staged.pop(slot, None)

    def tracks(self, ly: LayerOrder, layer: int, slot: int) -> bool:
        """Whether ``slot`` is in the layer's order (evictable or staged)."""
        return slot in ly.lru

    def touch(self, ly: LayerOrder, layer: int, slot: int, expert: int) -> None:
        """Mark an unpinned resident slot most recently used (untrack + track in two dict operations)."""
        if slot in ly.lru:
            ly.lru.move_to_end(slot)
        else:
            ly.lru[slot] = None
        if ly.staged:
            ly.staged.pop(slot, None)

    def touch_many(self, ly: LayerOrder, layer: int, slots: list, pinned: list, experts: list) -> None:
        """:meth:`touch` of each slot whose ``pinned`` flag is false, in order (a decode step
        touches ~16 slots per MoE layer, so the recency order is inlined here)."""
        lru, staged = ly.lru, ly.staged
        for s, p in zip(slots, pinned):
            if p:
                continue
            if s in lru:
                lru.move_to_end(s)
            else:
                lru[s] = None
            if staged:
                staged.pop(s, None)

    def pick(self, ly: LayerOrder, layer: int, busy: np.ndarray, experts: np.ndarray, stats) -> int:
        """The policy's victim among the idle, unstaged evictable slots, or -1."""
        raise NotImplementedError

    def victim(self, ly: LayerOrder, layer: int, busy: np.ndarray, experts: np.ndarray, stats,
               allow_staged: bool = True) -> int:
        """:meth:`pick`, else (``allow_staged``) the oldest idle staged speculation, else -1."""
        s = self.pick(ly, layer, busy, experts, stats)
        if s >= 0:
            return s
        if allow_staged:
            for s in ly.staged:
                if busy[s] == 0:
                    return s
        return -1


class LRU(EvictionPolicy):
    name = "lru"

    def pick(self, ly, layer, busy, experts, stats):
        for s in ly.lru:
            stats.victim_scans += 1
            if busy[s] == 0 and s not in ly.staged:
                return s
        return -1


class EMA(EvictionPolicy):
    name = "ema"

    def pick(self, ly, layer, busy, experts, stats):
        cand = [s for s in ly.lru if busy[s] == 0 and s not in ly.staged]
        stats.victim_scans += len(ly.lru)
        if cand:
            # ly.lru is oldest first and argmin takes the first minimum: ties -> least recent
            score = self.prob_ema[layer, experts[cand]]
            return cand[int(np.argmin(score))]
        return -1


class LFRU(EvictionPolicy):
    name = "lfru"

    def __init__(self, heat, prob_ema, max_cap):
        super().__init__(heat, prob_ema, max_cap)
        self.slot_heat = np.zeros((heat.shape[0], max_cap), np.int64)  # the bucket each slot sits in

    def track(self, ly, layer, slot, expert):
        h = int(self.heat[layer, expert])
        self.slot_heat[layer, slot] = h
        b = ly.buckets.get(h)
        if b is None:
            b = ly.buckets[h] = OrderedDict()
            heapq.heappush(ly.heap, h)
        b[slot] = None

    def track_cold(self, ly, layer, slot, expert):
        self.track(ly, layer, slot, expert)
        ly.buckets[int(self.slot_heat[layer, slot])].move_to_end(slot, last=False)

    def tracks(self, ly, layer, slot):
        return slot in ly.buckets.get(int(self.slot_heat[layer, slot]), ())

    def untrack(self, ly, layer, slot):
        b = ly.buckets.get(int(self.slot_heat[layer, slot]))
        if b is not None:
            b.pop(slot, None)
        ly.staged.pop(slot, None)

    def touch(self, ly, layer, slot, expert):
        # re-bucketed by the expert's current heat
        self.untrack(ly, layer, slot)
        self.track(ly, layer, slot, expert)

    def touch_many(self, ly, layer, slots, pinned, experts):
        for s, p, e in zip(slots, pinned, experts):
            if not p:
                self.touch(ly, layer, s, e)

    def pick(self, ly, layer, busy, experts, stats):
        while ly.heap:
            h = ly.heap[0]
            b = ly.buckets.get(h)
            if not b:
                heapq.heappop(ly.heap)
                ly.buckets.pop(h, None)
                continue
            for s in b:
                stats.victim_scans += 1
                if busy[s] == 0 and s not in ly.staged:
                    return s
            # every slot of the coldest bucket is busy/staged: scan the next buckets
            for h2 in sorted(ly.buckets):
                for s in ly.buckets[h2]:
                    if busy[s] == 0 and s not in ly.staged:
                        return s
            break
        return -1
