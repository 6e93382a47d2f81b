"""The expert cache: ``cap`` slots per MoE layer carved from one preallocated arena, filled
from the expert store on demand, by PILOT's speculation and by the pre-read.

:class:`ExpertCache` is the engine's ExpertProvider and composes the parts in engine/cache/:

- ``lookups.py``: the demand side, the ExpertProvider calls of the compute thread (lookups,
  takes, gives back), which ExpertCache derives from;
- ``slots.py``: the bookkeeping (which expert is in which slot, busy counts, pins, caps,
  counters), pure: no threads, no I/O; victims chosen by ``policy.py`` ("lru", "lfru", "ema");
- ``arena.py``: the slots' memory (one private mapping, huge pages, page release);
- ``io.py``: a slab read into its reserved slot and published; the demand-read queue and its
  reader threads (``io_threads``), and the hand-off to an idle reader;
- ``speculation.py``: PILOT's reads (a worker's own, or queued for the speculation reader
  right before a one-call decode run);
- ``preread.py``: the pre-read pass into free slots (setting ``idle_fill``), the arena's
  collapse onto huge pages;
- ``populate.py``: pages faulted in ahead of reads, and the budget's say over that growth.

The slots a RAM budget pays for need not be a multiple of the layers: ``slots`` may leave
some layers one slot fewer than ``cap`` (:meth:`ExpertCache.set_slots`, engine.sizing's plan
and the RSS guard), so a budget overrun costs the slots it needs, not one in every layer.

Concurrency: one lock over every part's state, and conditions on it for each kind of wait
(``cond``: a slot's state changed; the demand reads' own). Reads happen outside the lock; a
second request for an expert that is loading waits for that load (never reads it twice); a
failed read frees its slot again. The compute thread never reads or checksums a slab itself.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from .cache.arena import (HUGE_PAGE, MADV_COLLAPSE, MADV_POPULATE_WRITE, Arena,  # noqa: F401 - re-exported
                          _mapping_room, _populate_call)
from .cache.io import DemandReads, SlabIO
from .cache.lookups import DemandLookups
from .cache.populate import PopulateAhead
from .cache.preread import PreRead
from .cache.slots import FREE, LOADING, RESIDENT, CacheStats, SlotTable  # noqa: F401 - re-exported
from .cache.speculation import Speculations, SpecDrop, SpecRefused  # noqa: F401 - re-exported
from .observers import ObserverList


def _poll_until_zero(pending, timeout: float | None, poll_s: float) -> bool:
    """Call ``pending()`` every ``poll_s`` seconds until it returns 0 (True) or ``timeout``
    seconds pass (False; None = no limit)."""
    end = None if timeout is None else time.monotonic() + timeout
    while pending() > 0:
        if end is not None and time.monotonic() >= end:
            return False
        time.sleep(poll_s)
    return True


class ExpertCache(DemandLookups):
    """The ExpertProvider of the streaming engine.

    Args:
        store: an ExpertStore (read / read_run / views / slot_bytes).
        num_layers, num_experts: dimensions.
        cap: slots per layer (1..num_experts); the arena's width.
        slots: the slots of all layers together (num_layers..num_layers x cap), or None for
            cap in every layer; fewer leave some layers cap - 1 (see :meth:`set_slots`).
        policy: a name in engine.cache.registry.POLICY_CLASSES ("lru", "lfru", "ema").
        heat: int64 [L, E] routing counts, shared with the engine (read only here).
        checksum: "off" | "first" | "always".
        io_threads: concurrent demand reads (the disk's queue depth).
        reserve: fault in every slot the cap allows in the background from open, not only the
            next two of each layer: the setting ``reserve_cache`` (engine/cache/populate.py).
        fill: the pre-read after :meth:`start_fill`: the setting ``idle_fill``
            (engine/cache/preread.py).
        grow_ok: ``(nbytes) -> bool``, whether the process may grow by ``nbytes`` now, asked
            before background growth (engine/cache/populate.py), or None.

    The parts: ``table`` (SlotTable), ``memory`` (Arena), ``io`` (SlabIO), ``demand``
    (DemandReads), ``spec`` (Speculations), ``preread`` (PreRead), ``populate``
    (PopulateAhead). The table's arrays are also attributes of the cache (``where``,
    ``slot_state``, ``slot_busy``, ``slot_expert``, ``slot_spec``, ``last_use``, ``pinned``,
    ``routed_now``, ``prob_ema``, ``heat``, ``layers``); ``arena`` is the arena's uint8 array.
    """

    RESIDENT_STATE = RESIDENT  # the slot_state code of a resident slot (K.cache_take_resident's ``resident``)

    def __init__(self, store, num_layers: int, num_experts: int, cap: int, policy: str = "lru",
                 heat: np.ndarray | None = None, checksum: str = "first", io_threads: int = 4,
                 reserve: bool = False, fill: bool = False, grow_ok=None, slots: int | None = None):
        if not 1 <= cap <= num_experts:
            raise ValueError(f"cap {cap} must be between 1 and num_experts ({num_experts})")
        if slots is not None and not num_layers <= slots <= num_layers * cap:
            raise ValueError(f"slots {slots} must be between num_layers ({num_layers}) and "
                             f"num_layers x cap ({num_layers * cap})")
        self.store = store
        self.L, self.E = num_layers, num_experts
        self.slot_bytes = store.slot_bytes
        self.max_cap = cap
        self.policy = policy
        self.checksum = checksum
        self.fill = bool(fill)
        self.closed = False
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)  # a slot's state changed: a load ended, a slot given back
        self.slot_waiters = 0  # threads in wait_slots (lock held to change): no waiter, no notify
        self.observers = ObserverList()  # on_load, on_evict, on_pins (engine/observers.py)
        # module globals looked up here, so that a test can replace them
        # every slot will be filled (a cap of every expert, or the pre-read fills the cap): the whole
        # arena on huge pages from the first read, not its slots' interiors only
        self.memory = Arena(num_layers, cap, self.slot_bytes, mapping_room=_mapping_room, madvise=_populate_call(),
                            whole=fill or (cap == num_experts and slots in (None, num_layers * cap)))
        self.arena = self.memory.array
        self.huge_bytes = self.memory.huge_bytes
        self.populate = PopulateAhead(self, cap if reserve else 2, grow_ok)
        self.preread = PreRead(self)
        t = self.table = SlotTable(num_layers, num_experts, cap, policy, heat, self.slot_bytes, self.observers,
                                   on_free_taken=self.populate.wake_event.set,
                                   on_slot_freed=self.preread.wake_event.set)
        if slots is not None:  # an empty cache: the layers' caps are set, nothing to evict
            for ly, c in zip(t.layers, t.spread(slots)):
                ly.cap = ly.target = c
        self.heat, self.prob_ema, self.layers = t.heat, t.prob_ema, t.layers
        self.where, self.slot_expert, self.slot_state = t.where, t.slot_expert, t.slot_state
        self.slot_busy, self.slot_spec, self.last_use = t.slot_busy, t.slot_spec, t.last_use
        self.pinned, self.routed_now = t.pinned, t.routed_now
        self.io = SlabIO(self)
        self.spec = Speculations(self)
        self.demand = DemandReads(self, io_threads)
        self.io_threads = self.demand.n_threads
        if self.memory.madvise is not None:
            self.populate.start()

    # --- the parts' state, as the cache's callers read it ----------------------------------------------

    stats = property(lambda self: self.table.stats, doc="CacheStats: the cumulative counters.")
    clock = property(lambda self: self.table.clock, doc="Takes so far (the use clock of ``last_use``).")
    demand_inflight = property(lambda self: self.demand.inflight, lambda self, n: setattr(self.demand, "inflight", n),
                               doc="Demand reads issued and not finished (PILOT and the pre-read yield to them).")
    read_s_ema = property(lambda self: self.io.read_s_ema, doc="Seconds per slab read (EMA; 0 before the first).")
    grow_ok = property(lambda self: self.populate.grow_ok, doc="The budget's ``(nbytes) -> bool``, or None.")
    grow_stopped = property(lambda self: self.populate.grow_stopped,
                            doc="grow_ok said no: background growth pauses until set_cap or forget.")
    populate_ahead = property(lambda self: self.populate.ahead, doc="Free slots per layer faulted in ahead.")

    # --- slot-state waits (lock held) ----------------------------------------------------------------

    def wait_slots(self) -> None:
        """Wait (lock held) up to 50 ms for a slot-state change: a load ended or a slot given
        back. Counted, so giving back an expert notifies only when a thread waits: 8 per MoE
        layer of every decode step, almost never with a waiter."""
        self.slot_waiters += 1
        try:
            self.cond.wait(0.05)
        finally:
            self.slot_waiters -= 1

    def notify_slots(self) -> None:
        """Wake the threads in :meth:`wait_slots`, if any (lock held)."""
        if self.slot_waiters:
            self.cond.notify_all()

    # --- the routing's feed -------------------------------------------------------------------------

    def touch(self, layer: int, slot: int) -> None:
        """Mark a resident slot most recently used (lock held)."""
        self.table.touch(layer, slot)

    def observe_probs(self, layer: int, probs: np.ndarray) -> None:
        """One EMA step of the "ema" policy: probs float [E], the call's mean router softmax.
        Call it before ``prepare`` of the same MoE call (the engine does, from its route hook)."""
        with self.lock:
            self.table.observe_probs(layer, np.asarray(probs)[None])

    def observe_probs_layers(self, l0: int, probs: np.ndarray) -> None:
        """:meth:`observe_probs` of layers l0..l0+n-1 at once: probs float [n, E], row i the
        call of layer l0 + i (the same EMA values as n calls)."""
        with self.lock:
            self.table.observe_probs(l0, probs)

    # --- speculative loads (PILOT; engine/cache/speculation.py) ----------------------------------------

    def try_speculate(self, layer: int, expert: int, guard=None) -> int:
        """Reserve a slot for a speculative load: the slot (>= 0) or a SpecRefused
        (Speculations.try_speculate); then :meth:`load_speculative`."""
        return self.spec.try_speculate(layer, expert, guard)

    def load_speculative(self, layer: int, expert: int, slot: int) -> None:
        """Read a slot :meth:`try_speculate` reserved, on the calling thread (a PILOT worker)."""
        self.io.load(layer, expert, slot, True)

    def speculate_now(self, layer: int, expert: int, guard=None) -> int:
        """Reserve a slot as :meth:`try_speculate` and queue its read for the speculation reader,
        which starts it without the cache's lock (Speculations.speculate_now). Returns the slot
        or a SpecRefused."""
        return self.spec.speculate_now(layer, expert, guard)

    def hand_off_speculations(self) -> bool:
        """Wait (briefly) until the speculation reader started the first queued read
        (Speculations.hand_off). Returns whether it waited for a start."""
        return self.spec.hand_off()

    def cancel_speculations(self, below: int | None = None) -> int:
        """Give back queued speculations not started, all or those of layers before ``below``
        (Speculations.cancel). Returns how many."""
        return self.spec.cancel(below)

    def wait_demand_idle(self, timeout: float) -> bool:
        """Block until no demand read is in flight (True) or ``timeout`` seconds pass (False).
        PILOT workers call it before a speculative read: on a disk whose bandwidth does not
        grow with queue depth, a speculation read beside a demand read only slows the demand."""
        return self.demand.wait_idle(timeout)

    def count_dropped(self, reason: SpecDrop, n: int = 1) -> None:
        """Count ``n`` speculative loads dropped for ``reason`` (stats.spec_dropped_*)."""
        with self.lock:
            name = "spec_dropped_" + SpecDrop(reason).value
            setattr(self.stats, name, getattr(self.stats, name) + n)

    # --- observers ------------------------------------------------------------------------------------

    def subscribe(self, observer) -> None:
        """Publish loads, evictions and pin changes to ``observer`` (hooks ``on_load``,
        ``on_evict``, ``on_pins`` of ``engine.observers.Observer``; called with the cache lock
        held: record, never call back into the cache)."""
        self.observers.subscribe(observer)

    def unsubscribe(self, observer) -> None:
        """Stop publishing to ``observer`` (no-op if it is not subscribed)."""
        self.observers.unsubscribe(observer)

    # --- pinning, cap, residency ------------------------------------------------------------------------

    def set_pinned(self, pinned: np.ndarray) -> None:
        """Replace the pin set (bool [L, E]); at most cap - 1 per layer stay pinned, the hottest
        (SlotTable.set_pinned)."""
        with self.lock:
            self.table.set_pinned(pinned)

    def forget(self) -> None:
        """Evict every unpinned expert and zero the counters and the access clock, as if the
        cache had just been made (the engine's kernel warm-up at open uses it, so that the
        warm-up leaves no trace in residency, hit rates or benchmarks' cold starts)."""
        with self.lock:
            for layer, v in self.table.forget():
                self.memory.release(layer, v)
            self.preread.forget()
        with self.lock:
            self.populate.allow_growth()  # a fresh start: background growth may ask again
        self.populate.wake()
        self.preread.wake()

    def set_cap(self, cap: int, max_pins: int | None = None) -> int:
        """Change the slots per layer (1..arena size), the same in every layer. Lowering first
        unpins the coldest pins beyond ``max_pins`` (default and upper bound: cap - 1, so one
        slot per layer always stays free for misses), then evicts policy victims and waits for
        busy or loading slots to come free, and only then publishes the new cap, so
        ``live_slots(layer) <= cap`` holds at every instant; the cap holds until changed again
        (no slot regrows past it). Returns the number of evictions."""
        cap = max(1, min(int(cap), self.max_cap))
        return self._apply_caps([cap] * self.L, max_pins)

    def set_slots(self, slots: int, max_pins: int | None = None) -> int:
        """Change the slots of all layers together (clamped to num_layers .. num_layers x the
        arena's width): ``slots // L`` in every layer and one more in ``slots % L`` of them
        (SlotTable.spread). Lowering and pins as :meth:`set_cap` (``max_pins`` bounded by each
        layer's cap - 1). Returns the number of evictions."""
        return self._apply_caps(self.table.spread(slots), max_pins)

    def _apply_caps(self, caps: list[int], max_pins: int | None) -> int:
        n = 0
        t, mem = self.table, self.memory
        with self.lock:
            for ly, c in zip(t.layers, caps):  # every layer first: none grows past its new cap while another settles
                ly.target = c
            for layer in range(self.L):
                ly, cap = t.layers[layer], caps[layer]
                t.trim_pins(layer, cap - 1 if max_pins is None else max(0, min(int(max_pins), cap - 1)))
                while ly.live > cap and not self.closed:
                    v = t.free_one(layer, pins_too=True)  # pinned slots go last
                    if v >= 0:
                        mem.release(layer, v)
                        n += 1
                    else:
                        self.wait_slots()
                ly.cap = cap
                room = set(t.room(layer))  # (a raised cap: the populate thread wakes below)
                for v in ly.free:  # slots populated ahead that the new cap leaves no room for
                    if mem.faulted[layer, v] and v not in room:
                        mem.release(layer, v)
        with self.lock:
            self.populate.allow_growth()  # a new cap: background growth may ask again
        self.populate.wake()
        self.preread.wake()
        return n

    @property
    def cap(self) -> int:
        """The largest layer's slots (every layer has this, or one fewer: :meth:`set_slots`)."""
        return max(ly.cap for ly in self.layers)

    @property
    def slots(self) -> int:
        """The slots of all layers together (``cap`` x L when every layer has ``cap``)."""
        return sum(ly.cap for ly in self.layers)

    def layer_caps(self) -> list[int]:
        """Each layer's slots."""
        return [ly.cap for ly in self.layers]

    def live_slots(self, layer: int) -> int:
        return self.layers[layer].live

    def resident_bytes(self) -> int:
        """Arena bytes in memory: live slots, and free slots whose pages are in (populated ahead,
        within the cap's room). The RSS guard counts these as the cache's, not as other memory."""
        return int(np.count_nonzero((self.slot_state != FREE) | self.memory.faulted)) * self.slot_bytes

    def residency(self) -> np.ndarray:
        """int8 [L, E] of ABSENT / RESIDENT / PINNED / LOADING (events.py constants)."""
        with self.lock:
            return self.table.residency()

    def wait_estimate(self, layer: int, experts) -> float:
        """Seconds until every expert of ``experts`` of ``layer`` is resident, estimated from the
        mean slab read time (SlabIO.wait_estimate); 0 before any read finished."""
        return self.io.wait_estimate(layer, experts)

    def is_present(self, layer: int, expert: int) -> bool:
        return self.where[layer, expert] >= 0

    # --- background growth: the pre-read and populate-ahead -------------------------------------------

    def start_fill(self) -> bool:
        """Start the pre-read once (``fill``; PreRead.start). Returns whether it runs."""
        return self.preread.start()

    def hold_fill(self) -> None:
        """Pause the pre-read until :meth:`release_fill` (calls nest; PreRead.hold)."""
        self.preread.hold()

    def release_fill(self) -> None:
        self.preread.release()

    def begin_answer(self) -> None:
        """An answer starts (calls nest): no collapse onto huge pages until :meth:`end_answer`."""
        self.preread.begin_answer()

    def end_answer(self) -> None:
        self.preread.end_answer()

    def fill_pending(self, layer: int | None = None) -> int:
        """Experts the pre-read could still read now plus its reads in flight (PreRead.pending)."""
        return self.preread.pending(layer)

    def wait_filled(self, timeout: float | None = None, poll_s: float = 0.05) -> bool:
        """Block until :meth:`fill_pending` is 0 (True) or ``timeout`` seconds pass (False)."""
        return _poll_until_zero(self.fill_pending, timeout, poll_s)

    def collapse_full(self) -> None:
        """Put a full arena on huge pages once (PreRead.collapse_full); returns when done."""
        self.preread.collapse_full()

    def populate_pending(self) -> int:
        """Bytes of free slots under the cap still to fault in (PopulateAhead.pending)."""
        return self.populate.pending()

    def wait_populated(self, timeout: float | None = None, poll_s: float = 0.05) -> bool:
        """Block until :meth:`populate_pending` is 0 (True) or ``timeout`` seconds pass (False):
        with ``reserve``, the whole cache's memory faulted in."""
        return _poll_until_zero(self.populate_pending, timeout, poll_s)

    def close(self) -> None:
        """Stop the threads (the reader threads finish the queued reads first; a read that
        finishes after close frees its slot). Idempotent."""
        with self.lock:
            self.closed = True
            self.cond.notify_all()
            self.demand.wake_all()
        self.spec.wake_all()
        self.populate.wake()
        self.preread.wake()
        self.demand.join()
        self.spec.join()
        self.spec.cancel()
        with self.lock:
            self.spec.drain()  # closed: their slots are given back
        self.populate.join()
        self.preread.join()
