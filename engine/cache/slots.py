"""The expert cache's slot bookkeeping: which expert each slot of each layer holds, which
slots are in use, pinned or evictable, and the counters. Pure: no threads, no locks, no I/O,
no memory; the cache calls it with its lock held, and the policy simulator
(``engine.trace.replay_policy``) drives it alone.

A layer has ``cap`` slots (at most ``max_cap``, the arena's width). A slot is FREE, LOADING
(reserved for a read) or RESIDENT, and busy while a kernel reads it. Its life:

- :meth:`SlotTable.reserve` takes a free slot under the cap, else the eviction policy's victim
  (engine/cache/policy.py), and marks it LOADING for an expert;
- the read runs elsewhere; then :meth:`SlotTable.publish` makes the slot RESIDENT, or
  :meth:`SlotTable.abandon` gives it back FREE (a failed or cancelled read);
- :meth:`SlotTable.take` marks a resident slot busy and most recently used,
  :meth:`SlotTable.give_back` ends that.

A demand load becomes evictable at its first take, not when its read ends: reads end in an
order that varies with I/O timing, takes do not, so the victims are a function of the routing
alone (a trace replays exactly). A speculative load (PILOT) is evictable at once but "staged"
(taken last) until used; a pre-read load joins the order at the cold end. Pinned experts are
never evictable; at most cap - 1 per layer, so a miss always finds a slot.
"""

from __future__ import annotations

import numpy as np

from ..events import ABSENT, LOADING as SHOWN_LOADING, PINNED, RESIDENT as SHOWN_RESIDENT
from .policy import LayerOrder
from .registry import make_policy

FREE, LOADING, RESIDENT = 0, 1, 2  # slot_state codes (RESIDENT is K.cache_take_resident's ``resident``)
PROB_EMA_ALPHA = 0.2  # weight of the newest call in the "ema" policy's router-probability EMA


class CacheStats:
    """Cumulative counters (bytes, seconds, counts); read with ``snapshot()``."""

    __slots__ = ("hits", "misses", "pinned_hits", "loads", "demand_bytes", "spec_bytes",
                 "felt_wait_s", "read_service_s", "spec_issued", "spec_completed", "spec_used",
                 "spec_dropped_stale", "spec_dropped_guard", "spec_dropped_full", "spec_wasted_bytes",
                 "evictions", "read_errors", "victim_scans", "fill_loads")

    def __init__(self):
        for k in self.__slots__:
            setattr(self, k, 0)

    def snapshot(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class SlotLayer(LayerOrder):
    """A layer's slot allocation; its eviction order is the policy's (LayerOrder)."""

    __slots__ = ("free", "live", "cap", "target")

    def __init__(self, n_slots: int, cap: int):
        super().__init__()
        self.free = list(range(n_slots - 1, -1, -1))  # stack of FREE slot ids
        self.live = 0  # LOADING + RESIDENT slots
        self.cap = cap
        self.target = cap  # a cap being lowered: no growth past it while it settles


class SlotTable:
    """Every layer's slots and the eviction policy over them.

    Args:
        num_layers, num_experts: L and E.
        cap: slots per layer (1..num_experts): the arena's width, ``max_cap``.
        policy: a name in engine.cache.registry.POLICY_CLASSES.
        heat: int64 [L, E] routing counts (read only here), or None for zeros.
        slot_bytes: bytes of one slot (counted in ``stats.spec_wasted_bytes``).
        observers: an ObserverList to publish ``on_evict`` and ``on_pins`` to, or None.
        on_free_taken, on_slot_freed: ``() -> None`` or None, called when a reservation takes
            a free slot and when :meth:`abandon` frees one (the cache wakes its populate and
            pre-read threads with them).

    Arrays (shared with the kernels and the cache's callers, changed in place only):
    ``where`` int32 [L, E] the slot of each expert or -1; ``slot_expert`` int32 [L, cap];
    ``slot_state`` int8 [L, cap]; ``slot_busy`` int32 [L, cap] readers of each slot;
    ``slot_spec`` bool [L, cap] loaded speculatively, not yet used; ``last_use`` int64 [L, E]
    the use clock of each expert's last take; ``pinned`` bool [L, E]; ``routed_now`` bool
    [L, E] each layer's last lookup; ``prob_ema`` float64 [L, E] the "ema" policy's score.
    ``clock``: takes so far. ``views``: (layer, expert) -> whatever :meth:`publish` was given.
    """

    def __init__(self, num_layers: int, num_experts: int, cap: int, policy: str = "lru",
                 heat: np.ndarray | None = None, slot_bytes: int = 0, observers=None,
                 on_free_taken=None, on_slot_freed=None):
        self.L, self.E, self.max_cap = num_layers, num_experts, cap
        self.slot_bytes = int(slot_bytes)
        self.heat = heat if heat is not None else np.zeros((num_layers, num_experts), np.int64)
        self.slot_expert = np.full((num_layers, cap), -1, np.int32)
        self.slot_state = np.zeros((num_layers, cap), np.int8)
        self.slot_busy = np.zeros((num_layers, cap), np.int32)
        self.slot_spec = np.zeros((num_layers, cap), bool)
        self.where = np.full((num_layers, num_experts), -1, np.int32)
        self.last_use = np.zeros((num_layers, num_experts), np.int64)
        self.prob_ema = np.zeros((num_layers, num_experts), np.float64)
        self.pinned = np.zeros((num_layers, num_experts), bool)
        self.routed_now = np.zeros((num_layers, num_experts), bool)
        self.policy = make_policy(policy, self.heat, self.prob_ema, cap)
        self.clock = 0
        self.layers = [SlotLayer(cap, cap) for _ in range(num_layers)]
        self.views: dict[tuple[int, int], object] = {}
        self.counted_hit: set = set()  # (layer, expert) counted as a hit by a lookup, not taken yet
        self.stats = CacheStats()
        self.observers = observers
        self.on_free_taken = on_free_taken
        self.on_slot_freed = on_slot_freed

    def _publish_event(self, hook: str, *args) -> None:
        if self.observers is not None:
            self.observers.publish(hook, *args)

    # --- the eviction order --------------------------------------------------------------------

    def track(self, layer: int, slot: int) -> None:
        """Make a resident, unpinned slot evictable (most recent position)."""
        self.policy.track(self.layers[layer], layer, slot, int(self.slot_expert[layer, slot]))

    def track_cold(self, layer: int, slot: int) -> None:
        """Make a resident, unpinned slot evictable at the cold end (the first victim of its
        order): a pre-read load nothing has routed to yet."""
        self.policy.track_cold(self.layers[layer], layer, slot, int(self.slot_expert[layer, slot]))

    def untrack(self, layer: int, slot: int) -> None:
        self.policy.untrack(self.layers[layer], layer, slot)

    def touch(self, layer: int, slot: int) -> None:
        """Mark a resident slot most recently used (a pinned one is in no order)."""
        e = self.slot_expert[layer, slot]
        if self.pinned[layer, e]:
            return
        self.policy.touch(self.layers[layer], layer, slot, int(e))

    def victim(self, layer: int, allow_staged: bool = True) -> int:
        """Least valuable evictable slot of ``layer`` under the policy, or -1. Skips busy slots;
        a speculation not yet used is only taken when nothing else is evictable (else LFRU
        evicted speculations at heat 0 before their use)."""
        return self.policy.victim(self.layers[layer], layer, self.slot_busy[layer], self.slot_expert[layer],
                                  self.stats, allow_staged)

    def evict(self, layer: int, slot: int) -> None:
        """Empty a resident slot (it stays live: the caller reuses or frees it)."""
        e = self.slot_expert[layer, slot]
        self.untrack(layer, slot)
        if self.slot_spec[layer, slot]:
            self.stats.spec_wasted_bytes += self.slot_bytes
            self.slot_spec[layer, slot] = False
        self.where[layer, e] = -1
        self.slot_expert[layer, slot] = -1
        self.slot_state[layer, slot] = FREE
        self.views.pop((layer, int(e)), None)
        self.stats.evictions += 1
        self._publish_event("on_evict", layer, int(e))

    # --- reserve / publish / abandon -------------------------------------------------------------

    def stuck(self, layer: int) -> bool:
        """True if no slot of ``layer`` can come free by waiting: nothing is loading and every
        idle resident slot is pinned."""
        st = self.slot_state[layer]
        if (st == LOADING).any():
            return False
        return bool(np.all(self.pinned[layer, self.slot_expert[layer][st == RESIDENT]]))

    def unclaimed(self, layer: int) -> int:
        """The idle demand load of ``layer`` that no take has claimed yet (resident, in no
        eviction order, unpinned) holding the highest expert id, or -1; only while nothing of
        the layer is loading, so the choice does not depend on when reads end. A lookup
        reserves slots for its later misses; when an earlier expert of the same call (or of
        another caller's) then finds no slot, those loads are the only slots left and waiting
        for their takes never ends: the last-needed one is read again at its own take."""
        st = self.slot_state[layer]
        if (st == LOADING).any():
            return -1
        ly, best = self.layers[layer], -1
        for s in np.flatnonzero((st == RESIDENT) & (self.slot_busy[layer] == 0)).tolist():
            e = self.slot_expert[layer, s]
            if self.pinned[layer, e] or self.policy.tracks(ly, layer, s):
                continue
            if best < 0 or e > self.slot_expert[layer, best]:
                best = s
        return best

    def reserve(self, layer: int, expert: int, victim_ok=None, last_resort: bool = False) -> int:
        """Reserve a slot for ``expert``: a free slot under the cap, else a victim (``victim_ok
        (layer, slot) -> bool`` may refuse it); with ``last_resort`` (a demand acquire), when
        waiting could never free anything else, an unclaimed demand load (:meth:`unclaimed`)
        or else an idle pinned slot unpinned. Returns the slot, now LOADING, or -1 if nothing
        can be taken right now."""
        ly = self.layers[layer]
        slot = -1
        if ly.live < min(ly.cap, ly.target) and ly.free:
            slot = ly.free.pop()
            ly.live += 1
            if self.on_free_taken is not None:
                self.on_free_taken()  # the next free slot may want its pages now
        else:
            v = self.victim(layer)
            if v < 0 and last_resort:
                v = self.unclaimed(layer)  # never wait for a slot that cannot come free
                if v < 0 and self.stuck(layer):
                    v = self.unpin_coldest(layer)
            if v < 0 or (victim_ok is not None and not victim_ok(layer, v)):
                return -1
            self.evict(layer, v)
            slot = v
        self.slot_expert[layer, slot] = expert
        self.slot_state[layer, slot] = LOADING
        self.where[layer, expert] = slot
        return slot

    def abandon(self, layer: int, slot: int) -> None:
        """Give a reserved (LOADING) slot back FREE: its read failed or was cancelled."""
        e = self.slot_expert[layer, slot]
        self.where[layer, e] = -1
        self.slot_expert[layer, slot] = -1
        self.slot_state[layer, slot] = FREE
        self.slot_spec[layer, slot] = False
        ly = self.layers[layer]
        ly.live -= 1
        ly.free.append(slot)
        if self.on_slot_freed is not None:
            self.on_slot_freed()

    def publish(self, layer: int, expert: int, slot: int, views, speculative: bool = False,
                fill: bool = False) -> None:
        """A reserved slot's read is in: RESIDENT with ``views``. A speculation (PILOT) is
        staged in the eviction order, a pre-read load (``fill``) put at its cold end; a demand
        load joins the order at its first :meth:`take`."""
        self.slot_state[layer, slot] = RESIDENT
        self.views[(layer, expert)] = views
        if speculative and not fill:
            self.slot_spec[layer, slot] = True
        if speculative and not self.pinned[layer, expert]:
            if fill:
                self.track_cold(layer, slot)
            else:
                self.track(layer, slot)
                self.layers[layer].staged[slot] = None

    # --- demand lookups ----------------------------------------------------------------------------

    def lookup(self, layer: int, experts, take: bool = False):
        """Count one demand lookup per expert of ``experts`` (ints, in order): a resident one is
        a hit, made most recent (``take``: taken as :meth:`take`), else a miss. Returns (hits,
        slots of the hits when ``take``, misses, absent: the misses in no slot, loading: (expert,
        slot) of the misses whose read is in flight)."""
        hits, slots, misses, absent, loading = [], [], [], [], []
        self.routed_now[layer, :] = False
        for e in experts:  # hits first, made most recent, so this call's misses evict others
            e = int(e)
            self.routed_now[layer, e] = True
            s = int(self.where[layer, e])
            if s >= 0 and self.slot_state[layer, s] == RESIDENT:
                self.stats.hits += 1
                if self.pinned[layer, e]:
                    self.stats.pinned_hits += 1
                if take:
                    self.take(layer, e, s)
                    slots.append(s)
                else:
                    self.touch(layer, s)
                    self.counted_hit.add((layer, e))
                hits.append(e)
            else:
                self.stats.misses += 1
                misses.append(e)
                if s < 0:
                    absent.append(e)
                else:
                    loading.append((e, s))
        return hits, slots, misses, absent, loading

    def reserve_absent(self, layer: int, absent: list[int], hold=()) -> list[int]:
        """Reserve slots for ``absent`` (a lookup's misses in no slot) in order, until one finds
        none; returns the slots reserved (for the first ones of ``absent``). Meanwhile the hits
        of ``hold`` (the lookup's experts) that were counted and not taken yet are held busy, so
        a miss never evicts an expert the same call is about to use; the misses left load at
        their take, after the call's earlier experts were used and became evictable."""
        held = [s for s in (self.where[layer, e] for e in hold if (layer, int(e)) in self.counted_hit) if s >= 0]
        for s in held:
            self.slot_busy[layer, s] += 1
        out = []
        for e in absent:
            slot = self.reserve(layer, e)
            if slot < 0:
                break
            out.append(slot)
        for s in held:
            self.slot_busy[layer, s] -= 1
        return out

    def reserve_for_take(self, layer: int, expert: int) -> int:
        """:meth:`reserve` for a demand take that found its expert in no slot (last resort);
        a lookup's hit evicted since (a cap smaller than the call's experts) is recounted as
        the miss it turned out to be. Returns the slot or -1."""
        slot = self.reserve(layer, expert, last_resort=True)
        if slot >= 0 and (layer, expert) in self.counted_hit:
            self.stats.hits -= 1
            self.stats.misses += 1
        return slot

    def take(self, layer: int, expert: int, s: int):
        """Take resident slot ``s`` of ``expert``: busy, use clock, a staged speculation counted
        as used, most recent. Returns its views."""
        self.counted_hit.discard((layer, expert))
        self.slot_busy[layer, s] += 1
        self.clock += 1
        self.last_use[layer, expert] = self.clock
        if self.slot_spec[layer, s]:
            self.slot_spec[layer, s] = False
            self.stats.spec_used += 1
            self.layers[layer].staged.pop(s, None)
        self.touch(layer, s)
        return self.views[(layer, expert)]

    def take_all(self, layer: int, ea: np.ndarray, ss: np.ndarray, pm: list, nspec: int) -> tuple[list[int], np.ndarray, list[int]]:
        """The rest of taking every expert ea (int64 [n], distinct) resident in slots ss (int64
        [n]) after K.cache_take_resident set routed_now, slot_busy and last_use (pm: whether
        each is pinned; nspec: how many of the slots hold an unused speculation): the counters,
        use clock, speculation flags and eviction order, so that the state ends as after
        :meth:`lookup` with ``take``. Returns (hits, ss, [])."""
        n = len(ea)
        self.stats.hits += n
        self.stats.pinned_hits += sum(pm)
        self.clock += n
        ly = self.layers[layer]
        sl = ss.tolist()
        if nspec:
            for s in sl:
                if self.slot_spec[layer, s]:
                    self.slot_spec[layer, s] = False
                    self.stats.spec_used += 1
                    ly.staged.pop(s, None)
        hits = ea.tolist()
        if self.counted_hit:  # as take: a hit a lookup counted is taken now
            self.counted_hit.difference_update((layer, e) for e in hits)
        self.policy.touch_many(ly, layer, sl, pm, hits)
        return hits, ss, []

    def settle_run(self, l0: int, stop: int, ea, ss, pm, nspec) -> None:
        """The rest of the takes of a one-call decode run over layers l0..stop-1 (its arrays
        as ``ExpertCache.take_resident_layers`` describes them), as :meth:`take_all` per layer.
        A slot evicted since the run (a cap lowered from the app between the two holds of the
        lock) is counted as the hit it was and left out of the eviction order."""
        for layer in range(l0, stop):
            e, s, p = ea[layer], ss[layer], pm[layer]
            ok = (self.where[layer, e] == s) & (self.slot_state[layer, s] == RESIDENT)
            if not ok.all():
                gone = int((~ok).sum())
                self.stats.hits += gone
                self.stats.pinned_hits += int(p[~ok].sum())
                self.clock += gone
                e, s, p = e[ok], s[ok], p[ok]
            self.take_all(layer, e, s, p.tolist(), int(nspec[layer]))

    def give_back(self, layer: int, expert: int) -> bool:
        """End one :meth:`take` of ``expert``; True when its slot is idle now."""
        s = self.where[layer, expert]
        if s >= 0:
            self.slot_busy[layer, s] -= 1
            return self.slot_busy[layer, s] == 0
        return False

    def observe_probs(self, l0: int, probs: np.ndarray) -> None:
        """One EMA step of the "ema" policy's score for layers l0..l0+n-1: probs float [n, E],
        row i the mean router softmax of layer l0 + i's call."""
        ema = self.prob_ema[l0:l0 + probs.shape[0]]
        ema *= 1.0 - PROB_EMA_ALPHA
        ema += PROB_EMA_ALPHA * np.asarray(probs, np.float64)

    # --- pins and caps -----------------------------------------------------------------------------

    def set_pinned(self, pinned: np.ndarray) -> None:
        """Replace the pin set (bool [L, E]). Pinned residents leave the eviction order. At most
        cap - 1 experts per layer stay pinned (the hottest by ``heat``): one slot is always
        left for everything else, or a miss could never find a slot."""
        pinned = np.array(pinned, dtype=bool)
        for layer in range(self.L):
            ids = np.nonzero(pinned[layer])[0]
            n = self.layers[layer].cap - 1
            if len(ids) > n:
                pinned[layer] = False
                pinned[layer, ids[np.argsort(-self.heat[layer, ids], kind="stable")][:max(0, n)]] = True
        self._publish_event("on_pins", pinned)
        for layer in range(self.L):
            for e in np.nonzero(self.pinned[layer] != pinned[layer])[0]:
                s = self.where[layer, e]
                was = self.pinned[layer, e]
                if s >= 0 and self.slot_state[layer, s] == RESIDENT:
                    if was:
                        self.pinned[layer, e] = False
                        self.track(layer, s)
                    else:
                        self.untrack(layer, s)
                        self.pinned[layer, e] = True
                else:
                    self.pinned[layer, e] = pinned[layer, e]

    def unpin_coldest(self, layer: int) -> int:
        """Unpin the coldest (lowest heat; ties: higher id) resident, idle pinned slot of
        ``layer`` and make it evictable. Returns the slot, or -1 if none."""
        cands = [s for s in range(self.max_cap) if self.slot_state[layer, s] == RESIDENT
                 and self.slot_busy[layer, s] == 0 and self.pinned[layer, self.slot_expert[layer, s]]]
        if not cands:
            return -1
        v = min(cands, key=lambda s: (self.heat[layer, self.slot_expert[layer, s]], -self.slot_expert[layer, s]))
        self.pinned[layer, self.slot_expert[layer, v]] = False
        self.track(layer, v)
        return v

    def trim_pins(self, layer: int, max_pins: int) -> None:
        """Unpin the coldest pins of ``layer`` beyond ``max_pins`` (a pinned expert not resident
        just loses its mark)."""
        ids = np.nonzero(self.pinned[layer])[0]
        if len(ids) <= max_pins:
            return
        keep = ids[np.argsort(-self.heat[layer, ids], kind="stable")][:max(0, max_pins)]
        for e in ids:
            if e in keep:
                continue
            s = self.where[layer, e]
            self.pinned[layer, e] = False
            if s >= 0 and self.slot_state[layer, s] == RESIDENT:
                self.track(layer, s)

    def free_one(self, layer: int, pins_too: bool = False) -> int:
        """Evict the policy's victim of ``layer`` and free its slot (live - 1); with
        ``pins_too``, the coldest idle pin when nothing else is evictable, then an unclaimed
        demand load (:meth:`unclaimed`: a caller that never takes it would hold it forever).
        Returns the slot (its pages are the caller's to give back) or -1: every live slot is
        busy or loading."""
        ly = self.layers[layer]
        v = self.victim(layer)
        if v < 0 and pins_too:
            v = self.unpin_coldest(layer)
            if v < 0:
                v = self.unclaimed(layer)
        if v < 0:
            return -1
        self.evict(layer, v)
        ly.live -= 1
        ly.free.append(v)
        return v

    def spread(self, slots: int) -> list[int]:
        """Per-layer caps summing to ``slots`` (clamped to L .. L x max_cap), differing by at
        most one: the extra slots go to the layers whose routing so far reached the most
        distinct experts (``heat`` > 0; ties: the lower layer), which lose the most to a
        missing slot."""
        slots = max(self.L, min(int(slots), self.L * self.max_cap))
        base, extra = divmod(slots, self.L)
        caps = [base] * self.L
        if extra:
            breadth = np.count_nonzero(self.heat > 0, axis=1)
            for layer in np.argsort(-breadth, kind="stable")[:extra]:
                caps[int(layer)] += 1
        return caps

    def room(self, layer: int) -> list[int]:
        """The free slots a reservation may still take under the cap, the next one last."""
        ly = self.layers[layer]
        room = max(0, min(ly.cap, ly.target) - ly.live)
        return ly.free[max(0, len(ly.free) - room):] if room else []

    def forget(self) -> list[tuple[int, int]]:
        """Evict every unpinned expert and zero the counters and the use clock. Returns the
        (layer, slot) freed (their pages are the caller's to give back)."""
        freed = []
        for layer in range(self.L):
            while self.layers[layer].live > 0:
                v = self.free_one(layer)
                if v < 0:
                    break
                freed.append((layer, v))
        self.stats = CacheStats()
        self.last_use[:] = 0
        self.clock = 0
        self.routed_now[:] = False
        self.counted_hit.clear()
        return freed

    def residency(self) -> np.ndarray:
        """int8 [L, E] of ABSENT / RESIDENT / PINNED / LOADING (events.py constants)."""
        out = np.full((self.L, self.E), ABSENT, np.int8)
        ls, ss = np.nonzero(self.slot_state != FREE)  # the live slots, as whole arrays (a loop
        es = self.slot_expert[ls, ss]  # over L x cap slots took ~0.8 ms for 16 x 64)
        st = self.slot_state[ls, ss]
        out[ls, es] = np.where(st == LOADING, SHOWN_LOADING,
                               np.where(self.pinned[ls, es], PINNED, SHOWN_RESIDENT))
        return out
