"""Per-layer expert cache: ``cap`` slots per layer carved from one preallocated arena.

The slots a RAM budget pays for need not be a multiple of the layers: ``slots`` (the sum of
the layers' caps) may leave some layers one slot fewer than ``cap`` (:meth:`ExpertCache.set_slots`,
engine.sizing's plan and the RSS guard), so the cache holds every slot the budget has room
for, and a budget overrun costs the slots it needs, not a whole slot in every layer.

Slot states: FREE, LOADING(expert), RESIDENT(expert); plus a busy count while a kernel reads
the slot. Lookup is O(1) (a [L, E] slot index). Victim choice is the eviction policy's
(engine/cache/policy.py: "lru", "lfru", "ema"), called with the lock held.

"ema" (router-probability EMA) takes one EMA step per MoE call with the call's mean router
probability (``observe_probs``). It keeps the experts the router keeps leaning towards,
including ones it ranked just below top-k, which LRU cannot see. Chosen by replaying the
default model's held-out routing traces (``colibri bench replay``): at cap = half the experts
it hits 4 points more than LRU.

Concurrency: one lock and one condition variable. Reads happen outside the lock, on the
cache's reader threads; a second request for an expert that is loading waits for that load
(never reads it twice). A failed read frees its slot again (the slot is never leaked).

Reader threads (``io_threads`` of them) take demand reads from one ordered queue: first the
reads the compute is blocked on right now (``acquire`` found no slot at ``prepare`` time),
then every other demand read in submission order, which is the layer's compute order (hits
first, then misses by ascending id). With one reader (the engine's default on a disk whose
bandwidth does not grow with queue depth) a layer's first-needed miss arrives after one slab
read instead of after all of them sharing the disk; the kernels start on it while the next
one is read. The compute thread never reads or checksums a slab itself: verification runs
in the reader (``ExpertStore.read(verify=True)``).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from enum import Enum, IntEnum

import numpy as np

from .cache.arena import (HUGE_PAGE, MADV_POPULATE_WRITE, Arena, _advise_huge_interiors,  # noqa: F401 - re-exported
                          _anonymous_map, _mapping_room, _populate_call, MADV_COLLAPSE)
from .cache.policy import LayerOrder, make_policy
from .errors import EngineError, ExpertReadError
from .events import ABSENT, LOADING, PINNED, RESIDENT
from .kernel_choice import K
from .observers import ObserverList
from .units import format_bytes

log = logging.getLogger(__name__)


class SpecRefused(IntEnum):
    """Why ``ExpertCache.try_speculate`` reserved no slot (negative, so ``slot >= 0`` still
    means a slot was reserved)."""

    ALREADY = -1  # the expert is resident or being loaded already
    GUARD = -2    # the eviction guard refused to evict the only candidate victim
    FULL = -3     # no slot can be freed (all pinned, busy or staged)
    PASSED = -4   # this decode step's one-call run has reached the layer already


SPEC_PUBLISH_WAIT_S = 0.0003  # the speculation reader's wait for the lock before parking a finished read


class SpecDrop(Enum):
    """Why a speculative load (PILOT) was dropped; ``ExpertCache.count_dropped`` counts it in
    ``stats.spec_dropped_<value>``."""

    STALE = "stale"  # its token or layer had passed before a worker got to it
    GUARD = "guard"  # the eviction guard protected the victim
    FULL = "full"    # no slot (or the prefetch queue was full)

FREE = 0
# The pre-read's longest run (one positional read of slabs back to back): long enough for the
# disk's sequential rate, short enough that a demand read arriving during it shares the disk
# with a few milliseconds of it at most
PASS_READ_BYTES = 16 << 20
PROB_EMA_ALPHA = 0.2  # weight of the newest call in the "ema" policy's router-probability EMA
HANDOFF_WAIT_S = 0.002  # the compute thread's longest wait for an idle reader to take its demand read (_hand_off)
STALL_TIMEOUT_S = 60.0  # an acquire that cannot get a slot this long is a bug: fail, never hang
_LOADING = 1
_RESIDENT = 2


class _Layer(LayerOrder):
    """A layer's slot allocation; its eviction order is the policy's (LayerOrder)."""

    __slots__ = ("free", "live", "cap", "target")

    def __init__(self, n_slots: int, cap: int):
        super().__init__()
        self.free = list(range(n_slots - 1, -1, -1))  # stack of FREE slot ids
        self.live = 0  # LOADING + RESIDENT slots
        self.cap = cap
        self.target = cap  # a cap being lowered: no growth past it while it settles


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


def _poll_until_zero(pending, timeout: float | None, poll_s: float) -> bool:
    """Call ``pending()`` every ``poll_s`` seconds until it returns 0 (True) or ``timeout``
    seconds pass (False; None = no limit)."""
    end = None if timeout is None else time.monotonic() + timeout
    while pending() > 0:
        if end is not None and time.monotonic() >= end:
            return False
        time.sleep(poll_s)
    return True


class ExpertCache:
    """The ExpertProvider of the streaming engine.

    Args:
        store: an ExpertStore (read / views / slot_bytes).
        num_layers, num_experts: dimensions.
        cap: slots per layer (1..num_experts); the arena's width.
        slots: the slots of all layers together (num_layers..num_layers x cap), or None for
            cap in every layer; fewer leave some layers cap - 1 (see :meth:`set_slots`).
        policy: a name in engine.cache.policy.POLICY_CLASSES ("lru", "lfru", "ema").
        heat: int64 [L, E] routing counts, shared with the engine (read only here).
        checksum: "off" | "first" | "always".
        io_threads: concurrent reads for one layer's misses (the disk's queue depth).
        reserve: fault in every slot the cap allows at once (populate thread, low priority),
            not only the next ``populate_ahead`` of each layer: the setting ``reserve_cache``.
        fill: after :meth:`start_fill`, a background thread reads experts not yet in RAM into
            free slots under the cap while no demand read is in flight, never evicting: the
            setting ``idle_fill`` (see :meth:`_fill_loop`).
        grow_ok: ``(nbytes) -> bool``, whether the process may grow by ``nbytes`` now (the
            engine: RSS + nbytes within the RAM budget), asked before the populate thread
            faults in a slot and before the idle fill reads into a slot not faulted in yet; a
            no stops that background growth (``grow_stopped``) until the cap is set again
            (set_cap) or the cache is forgotten. Demand reads never ask: the RSS guard lowers the cap for those
            (engine/ram_budget.py). Without it (None) background growth is bounded by the cap
            only. Why: the cap is planned from the dense bytes and a fixed runtime reserve,
            while the process's real runtime can be more; a reservation that faulted in every
            slot at once pushed a 7B int4 store's RSS to 4.03 GB at a 4.0 GB budget before any
            token, and inside a 4 GB memory cgroup the process was OOM-killed.

    The arena (engine/cache/arena.py) is one private anonymous mapping of L x cap x slot_bytes;
    slots emptied by a cap reduction give their pages back to the OS (MADV_DONTNEED).
    """

    RESIDENT_STATE = _RESIDENT  # the slot_state code of a resident slot (K.cache_take_resident's ``resident``)

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
        self.heat = heat if heat is not None else np.zeros((num_layers, num_experts), np.int64)
        self.checksum = checksum
        self._verified = np.zeros((num_layers, num_experts), dtype=bool)
        # module globals looked up here, so that a test can replace them
        # every slot will be filled (a cap of every expert, or the pre-read fills the cap): the whole
        # arena on huge pages from the first read, not its slots' interiors only
        self._arena = Arena(num_layers, cap, self.slot_bytes, mapping_room=_mapping_room, madvise=_populate_call(),
                            whole=fill or (cap == num_experts and slots in (None, num_layers * cap)))
        self.arena = self._arena.array
        self.huge_bytes = self._arena.huge_bytes
        self.slot_expert = np.full((num_layers, cap), -1, np.int32)
        self.slot_state = np.zeros((num_layers, cap), np.int8)
        self.slot_busy = np.zeros((num_layers, cap), np.int32)
        self.slot_spec = np.zeros((num_layers, cap), bool)  # loaded speculatively, not yet used
        self.where = np.full((num_layers, num_experts), -1, np.int32)
        self.last_use = np.zeros((num_layers, num_experts), np.int64)  # access clock per expert
        self.prob_ema = np.zeros((num_layers, num_experts), np.float64)  # "ema" policy's score
        self._policy = make_policy(policy, self.heat, self.prob_ema, cap)
        self.clock = 0
        self.pinned = np.zeros((num_layers, num_experts), bool)
        self.layers = [_Layer(cap, cap) for _ in range(num_layers)]
        if slots is not None:  # an empty cache: the layers' caps are set, nothing to evict
            for ly, c in zip(self.layers, self._spread(slots)):
                ly.cap = ly.target = c
        self._views: dict[tuple[int, int], dict] = {}
        self._errors: dict[tuple[int, int], Exception] = {}
        self.lock = threading.Lock()
        # Three conditions on the one lock, so a wake-up reaches only threads that wait for
        # that change: ``cond`` slot state (a load finished, a slot given back: acquire, cap
        # shrink), ``_readq_cv`` the demand-read queue (reader threads), ``_idle_cv`` no demand
        # read in flight (PILOT workers). With one condition for all, every expert given back
        # (8 per MoE layer of a decode step) woke every idle reader thread for nothing; each woke,
        # took the GIL and the lock and slept again, and the compute thread waited for the GIL:
        # ~1.6 ms per MoE layer's release when the machine was busy (cProfile of 64 decode steps).
        self.cond = threading.Condition(self.lock)
        self._cond_waiters = 0  # threads in cond.wait (lock held to change): no waiter, no notify
        self._readq_cv = threading.Condition(self.lock)
        self._taken_cv = threading.Condition(self.lock)  # a reader took a queued demand read (_hand_off)
        self._idle_readers = 0  # reader threads waiting in _readq_cv for a read
        self._readq_taken = 0  # demand reads the readers have taken from the queue
        self._handoff_waiters = 0
        self._idle_cv = threading.Condition(self.lock)
        self.stats = CacheStats()
        self.observers = ObserverList()  # on_load, on_evict, on_pins (engine/observers.py)
        self._counted_hit: set = set()
        self.routed_now = np.zeros((num_layers, num_experts), bool)
        self.demand_inflight = 0  # demand reads issued and not finished (PILOT yields to them)
        self._closed = False
        # demand reads: a heap of (urgency, sequence, layer, expert, slot); urgency 0 = the
        # compute waits for it now (acquire), 1 = announced by prepare (in compute order)
        self._readq: list[tuple[int, int, int, int, int]] = []
        self._readq_seq = 0
        # Speculations claimed before a one-call decode run (speculate_now): their slots are
        # reserved (LOADING) under the cache lock, their reads wait in _spec_ready under a lock of
        # their own, so the speculation reader can start them while a run holds the cache lock
        self._spec_lock = threading.Lock()
        self._spec_cv = threading.Condition(self._spec_lock)
        self._spec_ready: deque = deque()  # (layer, expert, slot), claim order
        self._spec_done: deque = deque()  # (layer, expert, slot, read result) read, not yet published
        self._spec_reader: threading.Thread | None = None
        self._spec_waiting = None  # (layer, expert, slot) the speculation reader took, its read not started
        self._spec_started_cv = threading.Condition(self._spec_lock)  # a speculative read started
        self._spec_reading = False  # the speculation reader is reading (hand_off_speculations)
        self._spec_started = 0  # speculative reads the speculation reader has started
        self._passed = -1  # the last layer this decode step's one-call runs reached (take_resident_layers)
        self.io_threads = max(1, int(io_threads))
        self._readers = [threading.Thread(target=self._reader, name=f"colibri-io-{i}", daemon=True)
                         for i in range(self.io_threads)]
        for t in self._readers:
            t.start()
        # Populate ahead: the next free slots of each layer get their pages faulted in by a
        # low-priority thread before a read needs them. A read into never-touched memory pays
        # the page faults and zeroing on the reader's path: measured here (a VM, 4 KB pages)
        # 10.5 ms per 6.3 MB O_DIRECT slab read into fresh memory against 6.0 ms into touched
        # memory; the fault-in alone 3.7 ms. Only ``populate_ahead`` slots per layer, so the
        # RSS grows with use, not to the whole arena at open.
        # ``reserve``: every slot under the cap, in the background from open (setting
        # reserve_cache), so no read after the first seconds pays the faults, which cost most
        # where the host takes freed guest memory back (docs/decisions/0008-reserve-cache.md).
        self.populate_ahead = cap if reserve else 2
        self._read_t0: dict[tuple[int, int], float] = {}  # reads in progress: when each began
        self.read_s_ema = 0.0  # seconds per slab read (EMA over finished reads; 0 before the first)
        self.grow_ok = grow_ok
        self.grow_stopped = False  # grow_ok said no: populate / fill pause (see the Args)
        self._grow_gen = 0  # bumped with each reset of grow_stopped (a "no" from before it is stale)
        self._faulted = self._arena.faulted  # slot pages known present
        self._populate_wake = threading.Event()
        self.fill = bool(fill)
        self._fill_wake = threading.Event()
        self._filler = None
        self.pass_run = max(1, PASS_READ_BYTES // int(self.slot_bytes))  # slabs per pre-read run
        self._fill_holds = 0  # hold_fill() calls not yet released: the pass waits
        self._answers = 0  # answers running (begin_answer): no arena collapse meanwhile
        self._collapsed = False  # the whole arena asked onto huge pages once full (collapse_full)
        self._collapse_done = threading.Event()
        self._fill_inflight = 0  # fill reads reserved and not finished
        self._fill_bad = np.zeros((num_layers, num_experts), bool)  # fill reads that failed: not retried
        self._populater = None
        if self._arena.madvise is not None:
            self._populater = threading.Thread(target=self._populate_loop, name="colibri-populate", daemon=True)
            self._populater.start()
            self._populate_wake.set()

    # --- slot helpers (lock held) ----------------------------------------------------------------

    def _slot_offset(self, layer: int, slot: int) -> int:
        """Byte offset of (layer, slot) in the arena (a Python int, see Arena.offset)."""
        return self._arena.offset(layer, slot)

    def _buf(self, layer: int, slot: int) -> np.ndarray:
        return self._arena.buf(layer, slot)

    def _track(self, layer: int, slot: int) -> None:
        """Make a resident, unpinned slot evictable (most recent position)."""
        self._policy.track(self.layers[layer], layer, slot, int(self.slot_expert[layer, slot]))

    def _track_cold(self, layer: int, slot: int) -> None:
        """Make a resident, unpinned slot evictable at the cold end (the first victim of its
        order): an idle-fill load nothing has routed to yet."""
        self._policy.track_cold(self.layers[layer], layer, slot, int(self.slot_expert[layer, slot]))

    def _untrack(self, layer: int, slot: int) -> None:
        self._policy.untrack(self.layers[layer], layer, slot)

    def touch(self, layer: int, slot: int) -> None:
        """Mark a resident slot most recently used (lock held)."""
        e = self.slot_expert[layer, slot]
        if self.pinned[layer, e]:
            return
        self._policy.touch(self.layers[layer], layer, slot, int(e))

    def _wait_slot_state(self) -> None:
        """Wait (lock held) up to 50 ms for a slot-state change: a load finished or a slot
        given back (``cond``). Counted, so giving back an expert notifies only when a thread
        waits: 8 per MoE layer of every decode step, almost never with a waiter."""
        self._cond_waiters += 1
        try:
            self.cond.wait(0.05)
        finally:
            self._cond_waiters -= 1

    def _pick_victim(self, layer: int, allow_staged: bool = True) -> int:
        """Least valuable evictable slot of ``layer`` under the policy, or -1. Skips busy slots;
        a speculation not yet used is only taken when nothing else is evictable (the LFRU
        heat-0 trap of the colibri notes: staged slots were evicted before use)."""
        return self._policy.victim(self.layers[layer], layer, self.slot_busy[layer], self.slot_expert[layer],
                                   self.stats, allow_staged)

    def _evict(self, layer: int, slot: int) -> None:
        e = self.slot_expert[layer, slot]
        self._untrack(layer, slot)
        if self.slot_spec[layer, slot]:
            self.stats.spec_wasted_bytes += self.slot_bytes
            self.slot_spec[layer, slot] = False
        self.where[layer, e] = -1
        self.slot_expert[layer, slot] = -1
        self.slot_state[layer, slot] = FREE
        self._views.pop((layer, int(e)), None)
        self.stats.evictions += 1
        self.observers.publish("on_evict", layer, int(e))

    def _release_pages(self, layer: int, slot: int) -> None:
        self._arena.release(layer, slot)

    def _populate_wanted(self, layer: int) -> list[int]:
        """Free slots of ``layer`` a load will take next (the top of the free stack, as many
        as the cap leaves room for, at most ``populate_ahead``) whose pages are not in yet
        (lock held), the next one first."""
        ahead = self._populate_room(layer)[-self.populate_ahead:] if self.populate_ahead > 0 else []
        return [v for v in reversed(ahead) if not self._faulted[layer, v]]

    def _populate_loop(self) -> None:
        """Populate-ahead thread (see __init__): nice 19 where the OS has per-thread
        priorities (Linux), so it takes a core only when compute and reads leave one idle.
        The pages' contents are never touched (MADV_POPULATE_WRITE), so racing a read into
        the same slot is harmless; a slot the cap no longer leaves room for when its populate
        ends is given back at once. A kernel without MADV_POPULATE_WRITE stops the thread."""
        import os
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            self._populate_wake.wait()
            self._populate_wake.clear()
            with self.lock:
                if self._closed:
                    return
                # round robin over the layers (each layer's next slot first): a decode that
                # starts before a long reservation ends finds every layer's next slots faulted
                want = [self._populate_wanted(layer) for layer in range(self.L)]
                todo = [(layer, w[i]) for i in range(max(map(len, want), default=0))
                        for layer, w in enumerate(want) if i < len(w)]
            for layer, v in todo:
                if self._closed:
                    return
                with self.lock:  # the list may be stale (a load took the slot, a lower cap): skip those
                    if (self.slot_state[layer, v] != FREE or self._faulted[layer, v]
                            or v not in self._populate_room(layer)):
                        continue
                if not self._may_grow():
                    break
                ok, again = self._arena.populate(layer, v)  # again: EINTR / EAGAIN, at the next wake
                with self.lock:
                    if ok:
                        self._faulted[layer, v] = True
                        if self.fill:  # a fill the budget paused can use these pages now
                            self._fill_wake.set()
                    if self.slot_state[layer, v] == FREE and not (ok and v in self._populate_room(layer)):
                        # the cap shrank meanwhile, or the populate failed part way (ENOMEM,
                        # EINTR) with pages in that nothing tracks: given back now
                        self._release_pages(layer, v)
                if again:
                    break
                if not ok:
                    return  # EINVAL (a kernel before 5.14), ENOMEM: reads fault their pages as before

    # --- idle fill (the setting idle_fill) ---------------------------------------------------------

    def start_fill(self) -> bool:
        """Start the idle fill thread (``fill``; once, after the engine's warm-up and pre-warm).
        Returns whether a fill thread runs."""
        with self.lock:
            if not self.fill or self._closed:
                return False
            if self._filler is None:
                self._filler = threading.Thread(target=self._fill_loop, name="colibri-fill", daemon=True)
                self._filler.start()
        self._fill_wake.set()
        return True

    def hold_fill(self) -> None:
        """Pause the pre-read before its next run until :meth:`release_fill` (calls nest): the
        engine holds it while it generates. Measured on a 0.9 GB int4 store, a first answer
        started at open beside the pass waited 2-9 s on its demand reads (each behind a pass
        read, the two threads' first touches of fresh memory on a 2-core machine) against 1.3 s
        with no pass; the pass reads while the user types and between answers instead."""
        with self.lock:
            self._fill_holds += 1

    def begin_answer(self) -> None:
        """An answer starts (calls nest): the arena is not collapsed onto huge pages until it
        ends (:meth:`end_answer`), also while the answer lets the pass run to follow it."""
        with self.lock:
            self._answers += 1

    def end_answer(self) -> None:
        """Undo one :meth:`begin_answer`; the last one wakes the pass (which collapses a full arena)."""
        with self.lock:
            self._answers = max(0, self._answers - 1)
            if self._answers == 0:
                self._fill_wake.set()

    def release_fill(self) -> None:
        """Undo one :meth:`hold_fill`; the last one wakes the pre-read."""
        with self.lock:
            self._fill_holds = max(0, self._fill_holds - 1)
            if self._fill_holds == 0:
                self._fill_wake.set()

    def _fill_pick(self, skip=()) -> tuple[int, list[int]]:
        """The next run the pre-read takes (lock held): (layer, experts ascending, at most
        ``pass_run`` and the layer's room), or (-1, []). Layers in file order (each MoE layer's
        slabs are one file, experts in id order), but those in ``skip``; in a layer whose free
        slots under the cap hold all its absent experts, those in id order (the whole store, in
        one sequential sweep, when it fits); else the ``room`` hottest by ``heat`` (the routing
        history; ties: the lowest id), read in id order. Experts a fill read failed are left
        out."""
        for layer in range(self.L):
            if layer in skip:
                continue
            room, absent = self._fill_room(layer)
            if room == 0 or absent.size == 0:
                continue
            if absent.size > room:  # stable: ties keep the lowest ids
                absent = np.sort(absent[np.argsort(-self.heat[layer, absent], kind="stable")[:room]])
            return layer, [int(e) for e in absent[:min(room, self.pass_run)]]
        return -1, []

    def _fill_room(self, layer: int) -> tuple[int, np.ndarray]:
        """(free slots a load may take under the cap, the absent experts not failed by a fill
        read, int64 ids) of ``layer`` (lock held): what the idle fill may still read there."""
        ly = self.layers[layer]
        room = max(0, min(min(ly.cap, ly.target) - ly.live, len(ly.free)))
        return room, np.flatnonzero((self.where[layer] < 0) & ~self._fill_bad[layer])

    def fill_pending(self, layer: int | None = None) -> int:
        """Experts the idle fill could still read now (free slots under the cap, summed over the
        layers, each at most the absent experts of its layer that have not failed a fill read;
        once ``grow_stopped``, only free slots whose pages are in) plus its read in flight; 0
        without a running fill thread. With ``layer``, that MoE layer's alone, plus its slots
        still being read (the pass's or a demand read's)."""
        with self.lock:
            if self._filler is None or not self._filler.is_alive() or self._closed:
                return 0
            n = 0
            for ly in range(self.L) if layer is None else (layer,):
                room, absent = self._fill_room(ly)
                if self.grow_stopped:  # only slots whose pages are in: the budget refuses more
                    room = min(room, int(self._faulted[ly, self.layers[ly].free].sum()))
                n += min(room, absent.size)
            if layer is not None:
                return n + int((self.slot_state[layer] == _LOADING).sum())
            return n + self._fill_inflight

    def wait_filled(self, timeout: float | None = None, poll_s: float = 0.05) -> bool:
        """Block until :meth:`fill_pending` is 0 (True) or ``timeout`` seconds pass (False)."""
        return _poll_until_zero(self.fill_pending, timeout, poll_s)

    def _fill_loop(self) -> None:
        """The pre-read (idle fill) thread: while a layer has a free slot under the cap, wait
        until no demand read is in flight, reserve free slots for the next run of
        :meth:`_fill_pick` and read it with one positional read per run of slabs that lie back
        to back in the store (``ExpertStore.read_run``): a sequential pass in file order at the
        disk's sequential rate, not one slab per call (bytes read ahead of demand:
        ``spec_bytes``; ``fill_loads``). A demand read always goes first: the next run starts
        only once no demand read is in flight and no :meth:`hold_fill` holds it (the engine
        holds it while it generates), and a demand read that arrives during a run shares the
        disk with at most ``pass_run`` slabs. A filled slot joins its layer's eviction order at
        the cold end, so an expert the routing never asks for is the first victim, and the pass
        never evicts, so it cannot lower the hit rate. An expert whose fill read failed is not
        tried again (until forget()). A store that fits in the cap ends up wholly resident
        seconds after open, so a first answer waits on no read the pass would have brought;
        one that does not gets its free slots filled with the experts most routed to so far
        (the routing history). Slots whose pages are in go first; a slot that is not adds pages
        only while ``grow_ok`` says yes. Woken by start_fill, forget and a raised cap."""
        import os
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            self._fill_wake.wait()
            self._fill_wake.clear()
            blocked: set[int] = set()  # layers whose free slots would all add pages the budget refuses
            t0, n0, b0 = time.perf_counter(), self.stats.fill_loads, self.stats.spec_bytes
            while True:
                if self._closed:
                    return
                if not self.wait_demand_idle(0.05):
                    continue
                with self.lock:
                    if self._closed:
                        return
                    if self._fill_holds:  # woken again by the last release_fill
                        break
                    if self.demand_inflight > 0:
                        continue
                    layer, run = self._fill_pick(blocked)
                    if layer < 0:
                        break
                    free = self.layers[layer].free  # _reserve takes the top of the free stack:
                    free.sort(key=lambda v: bool(self._faulted[layer, v]))  # slots whose pages are in go first
                    ready = int(self._faulted[layer, free].sum())
                grow = allowed = len(run) - ready  # slots whose pages the run would add
                if grow > 0 and not self._may_grow(grow):
                    if grow > 1 and self._may_grow(1):
                        allowed = 1
                    elif ready:
                        allowed = 0
                    else:
                        blocked.add(layer)
                        continue
                    run = run[:ready + allowed]
                with self.lock:
                    if self._closed:
                        return
                    # the lock was let go for grow_ok: the pick may be stale (a demand read took
                    # an expert or a slot, a lower cap), and a speculation may have taken a slot
                    # whose pages were in
                    free = self.layers[layer].free
                    free.sort(key=lambda v: bool(self._faulted[layer, v]))
                    top = free[len(free) - len(run):]
                    if (self.demand_inflight > 0 or self._fill_holds or self._fill_room(layer)[0] < len(run)
                            or len(run) - int(self._faulted[layer, top].sum()) > allowed
                            or any(self.where[layer, e] >= 0 for e in run)):
                        continue
                    slots = [self._reserve(layer, e) for e in run]
                    self._fill_inflight += len(run)
                self._load_run(layer, run, slots)
            n = self.stats.fill_loads - n0
            if n:
                dt = time.perf_counter() - t0
                nb = self.stats.spec_bytes - b0
                log.info("read %d experts (%s) ahead of use in %.2f s (%.2f GB/s)", n, format_bytes(nb), dt,
                         nb / 1e9 / max(dt, 1e-9))
            self.collapse_full()

    def collapse_full(self) -> None:
        """Once every slot of the arena holds an expert (the pre-read done: a store that fits
        the cap is then wholly resident), put the whole arena on huge pages (MADV_COLLAPSE,
        Linux >= 6.1), the blocks two slots share included: _advise_huge_interiors leaves those
        on 4 KB pages so that filling a slot never faults its neighbour's pages in, which no
        longer matters once every slot is in. Once per arena; the kernel copies each block it
        collapses (4.4 s for OLMoE-1B-7B's 3.6 GB arena here, the GIL released); a kernel
        without it refuses; no value changes and no mapping is added. Measured
        (tools/micro_arena.py, OLMoE-1B-7B slabs, 2 threads, this VM): K.experts_q4_t1 1028
        us per call with the interiors advised, 820-867 us collapsed.

        The pre-read calls it when its pass ends and no answer runs (hold_fill, begin_answer:
        the copying slowed a first answer's decode from 36 to 11 tok/s); a caller that filled the arena with
        demand reads (load_experts) may call it itself. Returns when the kernel is done, also when
        another thread's call got there first."""
        with self.lock:
            first = not self._collapsed
            # not while the engine generates (it holds the pre-read): the kernel's copying slowed
            # a first answer's decode 3x; the last release_fill wakes the pass, which calls again
            if (self._closed or self._arena.madvise is None or (first and (self._fill_holds or self._answers))
                    or (first and not (self.slot_state == _RESIDENT).all())):
                return
            self._collapsed = True
            base = self.arena.ctypes.data
        if not first:  # another thread's call: return when it is done
            self._collapse_done.wait()
            return
        try:
            self._arena.madvise(base, self.arena.nbytes, MADV_COLLAPSE)  # a refusal leaves the pages as they are
        finally:
            self._collapse_done.set()

    def _load_run(self, layer: int, experts: list[int], slots: list[int]) -> None:
        """Read ``experts`` of ``layer`` into their reserved ``slots`` as one pre-read run
        (``ExpertStore.read_run``; a store without it, one read each), then publish them as
        fill loads in one hold of the lock."""
        read_run = getattr(self.store, "read_run", None)
        if read_run is None or len(experts) == 1:
            for e, s in zip(experts, slots):
                self._load(layer, e, s, True, fill=True)
            return
        bufs = [self._buf(layer, s) for s in slots]
        verify = [self.checksum == "always" or (self.checksum == "first" and not self._verified[layer, e])
                  for e in experts]
        t0 = time.perf_counter()
        for e in experts:
            self._read_t0[(layer, e)] = t0
        try:
            res = read_run(layer, experts, bufs, verify)
        except Exception as e:  # noqa: BLE001 - every slot is given back below
            res = [(0, e)] * len(experts)
        dt = (time.perf_counter() - t0) / len(experts)
        with self.lock:
            for e, s, (n, err), v in zip(experts, slots, res, verify):
                self._publish(layer, e, s, True, True, n, err, dt, v)

    def _may_grow(self, nslots: int = 1) -> bool:
        """Whether a background thread may add ``nslots`` slots' pages now (``grow_ok``); a no
        to one slot sets ``grow_stopped`` (populate and fill then pause until set_cap or
        forget; a no to more leaves the question of fewer open). Lock not held (grow_ok reads
        the RSS)."""
        if self.grow_stopped:
            return False
        gen = self._grow_gen
        if self.grow_ok is None or self.grow_ok(int(self.slot_bytes) * int(nslots)):
            return True
        if nslots > 1:
            return False
        with self.lock:
            if self._grow_gen == gen:  # not reset (set_cap, forget) while grow_ok read the RSS
                self.grow_stopped = True
        return False

    def populate_pending(self) -> int:
        """Bytes of free slots under the cap that the populate thread has still to fault in
        (0 once done, and 0 where there is no populate thread: off Linux, a kernel without
        MADV_POPULATE_WRITE, or after it stopped on an error)."""
        with self.lock:
            if self._populater is None or not self._populater.is_alive() or self._closed or self.grow_stopped:
                return 0
            return sum(len(self._populate_wanted(layer)) for layer in range(self.L)) * int(self.slot_bytes)

    def wait_populated(self, timeout: float | None = None, poll_s: float = 0.05) -> bool:
        """Block until :meth:`populate_pending` is 0 (True) or ``timeout`` seconds pass (False).
        With ``reserve`` that is the whole cache's memory faulted in; the benchmarks wait for it
        as a user's first question would after some seconds of typing."""
        return _poll_until_zero(self.populate_pending, timeout, poll_s)

    def _populate_room(self, layer: int) -> list[int]:
        """The free slots a load may still take under the cap (lock held)."""
        ly = self.layers[layer]
        room = max(0, min(ly.cap, ly.target) - ly.live)
        return ly.free[max(0, len(ly.free) - room):] if room else []

    def _stuck(self, layer: int) -> bool:
        """True if no slot of ``layer`` can come free by waiting (lock held): nothing is
        loading and every idle resident slot is pinned."""
        st = self.slot_state[layer]
        if (st == _LOADING).any():
            return False
        return bool(np.all(self.pinned[layer, self.slot_expert[layer][st == _RESIDENT]]))

    def _reserve(self, layer: int, expert: int, victim_ok=None, last_resort: bool = False) -> int:
        """Reserve a slot for ``expert`` (lock held): a free slot under the cap, else a victim;
        with ``last_resort`` (a demand acquire) an idle pinned slot is unpinned when waiting
        could never free anything else. Returns the slot (now LOADING) or -1 if nothing can
        be taken right now."""
        ly = self.layers[layer]
        slot = -1
        if ly.live < min(ly.cap, ly.target) and ly.free:
            slot = ly.free.pop()
            ly.live += 1
            self._populate_wake.set()  # the next free slot may want its pages now
        else:
            v = self._pick_victim(layer)
            if v < 0 and last_resort and self._stuck(layer):
                v = self._unpin_coldest(layer)  # never wait for a slot that cannot come free
            if v < 0 or (victim_ok is not None and not victim_ok(layer, v)):
                return -1
            self._evict(layer, v)
            slot = v
        self.slot_expert[layer, slot] = expert
        self.slot_state[layer, slot] = _LOADING
        self.where[layer, expert] = slot
        return slot

    def _unreserve(self, layer: int, slot: int) -> None:
        e = self.slot_expert[layer, slot]
        self.where[layer, e] = -1
        self.slot_expert[layer, slot] = -1
        self.slot_state[layer, slot] = FREE
        self.slot_spec[layer, slot] = False
        ly = self.layers[layer]
        ly.live -= 1
        ly.free.append(slot)
        self._fill_wake.set()  # a slot came free (a failed or cancelled read): the fill may take it

    # --- loading --------------------------------------------------------------------------------

    def _load(self, layer: int, expert: int, slot: int, speculative: bool, fill: bool = False) -> None:
        """Read into the reserved slot (I/O thread or caller), then publish or free it.
        ``fill``: an idle-fill read (speculative, not PILOT's: not staged, cold end)."""
        res = self._read_slot(layer, expert, slot)
        with self.lock:
            self._publish(layer, expert, slot, speculative, fill, *res)

    def _read_slot(self, layer: int, expert: int, slot: int) -> tuple:
        """The I/O half of :meth:`_load` (no lock): (bytes read, error or None, seconds, verified)."""
        buf = self._buf(layer, slot)
        verify = self.checksum == "always" or (self.checksum == "first" and not self._verified[layer, expert])
        t0 = time.perf_counter()
        self._read_t0[(layer, expert)] = t0
        try:
            n = self.store.read(layer, expert, buf, verify=verify)
            err = None
        except Exception as e:  # noqa: BLE001 - reported to the waiter
            err = e
            n = 0
        self._read_t0.pop((layer, expert), None)  # done (wait_estimate): its publishing may wait for the lock
        return n, err, time.perf_counter() - t0, verify

    def _publish(self, layer: int, expert: int, slot: int, speculative: bool, fill: bool, n: int,
                 err: Exception | None, dt: float, verify: bool) -> None:
        """The publishing half of :meth:`_load` (lock held): the slot resident (or freed on an
        error or a closed cache), the counters, the waiters woken."""
        buf = self._buf(layer, slot)
        self._read_t0.pop((layer, expert), None)
        self.read_s_ema = dt if self.read_s_ema == 0.0 else 0.8 * self.read_s_ema + 0.2 * dt
        self._faulted[layer, slot] = True  # the read (or its attempt) touched the pages
        if not speculative:
            self.demand_inflight -= 1
            if self.demand_inflight == 0:
                self._idle_cv.notify_all()
        self.stats.read_service_s += dt
        if fill:
            self._fill_inflight -= 1
        if err is not None or self._closed:
            self.stats.read_errors += err is not None
            if fill and err is not None:
                self._fill_bad[layer, expert] = True
            self._unreserve(layer, slot)
            if err is not None and not speculative:
                self._errors[(layer, expert)] = err
        else:
            if verify:
                self._verified[layer, expert] = True
            self.stats.loads += 1
            if speculative:
                self.stats.spec_bytes += n
                if fill:
                    self.stats.fill_loads += 1
                else:
                    self.stats.spec_completed += 1
                    self.slot_spec[layer, slot] = True
            else:
                self.stats.demand_bytes += n
            self.slot_state[layer, slot] = _RESIDENT
            self._views[(layer, expert)] = self.store.views(buf)
            # A demand load becomes evictable at its first acquire (touch), not at
            # completion: completion order varies with I/O timing, acquire order does not,
            # so victim choice is a pure function of the routing (replayable exactly).
            if speculative and not self.pinned[layer, expert]:
                if fill:
                    self._track_cold(layer, slot)
                else:
                    self._track(layer, slot)
                    self.layers[layer].staged[slot] = None
            self.observers.publish("on_load", layer, expert, n, dt, speculative)
        self.cond.notify_all()

    def _submit(self, layer: int, expert: int, slot: int, urgency: int) -> None:
        """Queue a demand read of a reserved slot for the reader threads (lock held)."""
        self._readq_seq += 1
        heapq.heappush(self._readq, (urgency, self._readq_seq, layer, expert, slot))
        self.demand_inflight += 1
        self._readq_cv.notify()  # one reader takes it

    def _reader(self) -> None:
        """A reader thread: take the most urgent queued demand read, read (and verify) it."""
        while True:
            with self.lock:
                while not self._readq and not self._closed:
                    self._idle_readers += 1
                    try:
                        self._readq_cv.wait()
                    finally:
                        self._idle_readers -= 1
                if not self._readq:  # closed and drained
                    return
                _u, _seq, layer, expert, slot = heapq.heappop(self._readq)
                self._readq_taken += 1
                if self._handoff_waiters:
                    self._taken_cv.notify_all()
            self._load(layer, expert, slot, False)

    def _hand_off(self) -> None:
        """After the compute thread queued demand reads it will not wait for at once (lock
        held; :meth:`take_split`, :meth:`prepare_split`): when a reader thread was idle, wait
        until it has taken the first of them from the queue (at most HANDOFF_WAIT_S), so the
        read is on the disk while the compute thread works on the hits. Without it the woken
        reader waited for a core behind the kernel's threads, which keep both of a 2-core
        machine's cores busy: measured here (7B int4 store, replayed routing, 4 GB budget) a
        median 1.7 ms from a miss's queueing to its read's start, as long as the hits' compute,
        so none of the read was hidden behind it; waiting here gives the reader the compute
        thread's core for the ~0.1 ms it needs to start the read (it blocks in the read
        system call, leaving the core and the GIL)."""
        if self._idle_readers == 0 or not self._readq or self._closed:
            return
        target = self._readq_taken + 1
        deadline = time.perf_counter() + HANDOFF_WAIT_S
        self._handoff_waiters += 1
        try:
            while self._readq_taken < target and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._taken_cv.wait(left)
        finally:
            self._handoff_waiters -= 1

    def load_experts(self, layer: int, experts) -> None:
        """Make ``experts`` of ``layer`` resident now (pre-warm, "all resident" benchmarks): one
        prepare/acquire/release pass whose lookups are not counted as demand hits or misses.

        Raises:
            ExpertReadError: a read failed twice.
        """
        hits, misses, pinned_hits = self.stats.hits, self.stats.misses, self.stats.pinned_hits
        for e in self.prepare(layer, experts):
            self.acquire(layer, int(e))
            self.release(layer, int(e))
        with self.lock:
            self.stats.hits, self.stats.misses, self.stats.pinned_hits = hits, misses, pinned_hits

    def observe_probs(self, layer: int, probs: np.ndarray) -> None:
        """One EMA step of the "ema" policy: probs float [E], the call's mean router softmax.
        Call it before ``prepare`` of the same MoE call (the engine does, from its route hook)."""
        with self.lock:
            self.prob_ema[layer] *= 1.0 - PROB_EMA_ALPHA
            self.prob_ema[layer] += PROB_EMA_ALPHA * np.asarray(probs, np.float64)

    def observe_probs_layers(self, l0: int, probs: np.ndarray) -> None:
        """:meth:`observe_probs` of layers l0..l0+n-1 at once: probs float [n, E], row i the
        call of layer l0 + i (the same EMA values as n calls)."""
        with self.lock:
            ema = self.prob_ema[l0:l0 + probs.shape[0]]
            ema *= 1.0 - PROB_EMA_ALPHA
            ema += PROB_EMA_ALPHA * np.asarray(probs, np.float64)

    def prepare(self, layer: int, experts) -> list[int]:
        """Count one demand lookup per expert and start concurrent reads of the misses
        (as many as free or evictable slots allow; the rest load in ``acquire``).

        Returns the order to compute them in: this call's hits (ascending id), then its misses
        (ascending id), so the kernels work on resident experts while the misses are read
        (the order is a function of the routing and the cache state only: replayable)."""
        hits, misses = self.prepare_split(layer, experts)
        return hits + misses

    def prepare_split(self, layer: int, experts) -> tuple[list[int], list[int]]:
        """:meth:`prepare`, returning (hits, misses) apart: the decode step computes all its
        hits in one kernel call (engine/models/base.py) while the misses are read."""
        hits_first: list[int] = []
        misses_after: list[int] = []
        with self.lock:
            self._drain_spec_done()
            self.routed_now[layer, :] = False
            missing = []
            for e in experts:  # hits first, made most recent, so this call's misses evict others
                e = int(e)
                self.routed_now[layer, e] = True
                s = self.where[layer, e]
                if s >= 0 and self.slot_state[layer, s] == _RESIDENT:
                    self.stats.hits += 1
                    if self.pinned[layer, e]:
                        self.stats.pinned_hits += 1
                    self.touch(layer, s)
                    self._counted_hit.add((layer, e))
                    hits_first.append(e)
                else:
                    self.stats.misses += 1
                    misses_after.append(e)
                    if s < 0:  # else loading (a speculation in flight): acquire waits for it
                        missing.append(e)
                        self._errors.pop((layer, e), None)  # a failure of an earlier call is stale
                    else:
                        self._claim_back(layer, e, int(s), 1)
            # While reserving, this call's hits are held busy so a miss never evicts an expert
            # the same call is about to use; misses that find no other victim load in acquire,
            # after the call's earlier experts have been used and become evictable.
            if missing:  # (nothing to reserve: no hold needed; the decode step of a warm cache)
                held = [self.where[layer, e] for e in experts if (layer, int(e)) in self._counted_hit]
                for s in held:
                    self.slot_busy[layer, s] += 1
                for e in missing:
                    slot = self._reserve(layer, e)
                    if slot < 0:
                        break
                    self._submit(layer, e, slot, 1)  # in compute order: the first needed is read first
                for s in held:
                    self.slot_busy[layer, s] -= 1
            if misses_after and hits_first:  # the hits compute next: their reads must be on the disk by then
                self._hand_off()
        return hits_first, misses_after

    def take_split(self, layer: int, experts) -> tuple[list[int], np.ndarray, list[int]]:
        """:meth:`prepare_split` and :meth:`acquire_many` of its hits in one lock round-trip,
        for a decode step whose hits run in one kernel call reading the arena in place.

        ``experts``: distinct ints in the order to look them up (the engine passes ascending
        ids). When all are resident the bookkeeping runs as whole-array operations.
        Returns (hits, slots, misses): the resident experts, already taken (busy, use clock,
        most recent, a staged speculation counted as used) until :meth:`release_slots`;
        ``slots`` int64 [len(hits)] their slots in ``layer`` (:meth:`slot_offsets`); the
        misses, counted and their reads started as :meth:`prepare_split` does, to be taken with
        :meth:`acquire`. The counters, use clock, busy counts and eviction order end as after
        prepare_split + acquire_many (tests/test_cache.py), except that a hit can no longer be
        evicted between the two calls (a speculation's read could do that before)."""
        hits: list[int] = []
        slots: list[int] = []
        misses: list[int] = []
        ea = np.asarray(experts, np.int64)
        n = len(ea)
        ss = np.empty(n, np.int64)
        pm = np.empty(n, np.bool_)
        with self.lock:
            self._drain_spec_done()
            nspec = K.cache_take_resident(self.where[layer], self.slot_state[layer], self.slot_busy[layer],
                                          self.last_use[layer], self.routed_now[layer], self.pinned[layer],
                                          self.slot_spec[layer], ea, self.clock, _RESIDENT, ss, pm)
            if nspec >= 0:  # all resident: those arrays are updated, the rest in _take_all
                return self._take_all(layer, ea, ss, pm.tolist(), nspec)
            self.routed_now[layer, :] = False
            missing = []
            for e in experts:
                e = int(e)
                self.routed_now[layer, e] = True
                s = int(self.where[layer, e])
                if s >= 0 and self.slot_state[layer, s] == _RESIDENT:
                    self.stats.hits += 1
                    if self.pinned[layer, e]:
                        self.stats.pinned_hits += 1
                    self._take(layer, e, s)
                    hits.append(e)
                    slots.append(s)
                else:
                    self.stats.misses += 1
                    misses.append(e)
                    if s < 0:  # else loading (a speculation in flight): acquire waits for it
                        missing.append(e)
                        self._errors.pop((layer, e), None)
                    else:
                        self._claim_back(layer, e, s, 1)
            for e in missing:  # the hits are busy: a miss never evicts one of them
                slot = self._reserve(layer, e)
                if slot < 0:
                    break
                self._submit(layer, e, slot, 1)
            if hits and misses:  # the hits compute next: the misses' reads must be on the disk by then
                self._hand_off()
        return hits, np.asarray(slots, np.int64), misses

    def _take_all(self, layer: int, ea: np.ndarray, ss: np.ndarray, pm: list, nspec: int) -> tuple[list[int], np.ndarray, list[int]]:
        """take_split when every expert ea (int64 [n], distinct) is resident in slots ss (int64
        [n]; lock held), after K.cache_take_resident set routed_now, slot_busy and last_use (pm:
        whether each expert is pinned; nspec: how many of the slots hold an unused speculation):
        the counters, use clock, speculation flags and eviction order, so that the state ends as
        after take_split's loop."""
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
        if self._counted_hit:  # as _take: a hit prepare counted is taken now
            self._counted_hit.difference_update((layer, e) for e in hits)
        self._policy.touch_many(ly, layer, sl, pm, hits)
        return hits, ss, []

    def take_resident_layers(self, run, l0: int = 0, after_run=None) -> int:
        """Run the MoE layers l0.. of a decode step that takes their experts itself (K.
        decode_layers_t1 from layer l0) with the lock held, for as long as each layer's experts
        are resident: no read can publish, no slot be evicted and no demand read start while
        it runs (reads in flight finish their I/O and wait for the lock).

        ``run(where, slot_state, slot_busy, last_use, routed_now, pinned, slot_spec, resident,
        clock)`` gets the cache's [L, ...] arrays, the RESIDENT state code and the use clock,
        does cache_take_resident's array half for each layer it runs and gives the slots back,
        and returns (clock after, ea int64 [L, k] each layer's experts in ascending id order, ss
        int64 [L, k] their slots, pm bool [L, k] whether pinned, nspec int64 [L] the taken slots
        still flagged speculative, upto: with a clock >= 0, the layer it stopped before, every
        layer up to it run in full: num_layers, or earlier for PILOT's predictions inside the
        run, K.decode_layers_t1's ``look``); its clock is negative, -1 - l, when layer l found an
        expert not resident (layers l0..l-1 ran, layer l's take did not). A slot another thread evicted
        between the two holds of the lock (a cap lowered from the app) is counted as the hit it
        was and left out of the eviction order. Then ``after_run(stop)``
        without the lock, then the counters, speculation flags and eviction order of layers
        l0..stop-1 in one hold of the lock, as :meth:`take_split` + :meth:`release_slots`
        leave them, so the caller can take layer ``stop`` by take_split next, in the order
        the per-layer path would.

        Returns ``stop``: num_layers when every layer from l0 ran, l when layer l stopped it
        (or the run stopped before it, ``upto``), -1 when nothing ran (the cache is closed)."""
        with self.lock:
            if self._closed:
                return -1
            self._drain_spec_done()  # reads that came in during the last run: resident for this one
            clock, ea, ss, pm, nspec, upto = run(self.where, self.slot_state, self.slot_busy, self.last_use,
                                                 self.routed_now, self.pinned, self.slot_spec, _RESIDENT, self.clock)
            stop = upto if clock >= 0 else -1 - clock
            # the layers a PILOT worker that waited for the lock through the run must not reserve
            # for (its token's cur_layer moves only in after_run, without the lock): up to stop
            # when stop's experts are taken on demand next, up to stop - 1 when the run stopped
            # before stop for a prediction (upto)
            self._passed = stop if clock < 0 else stop - 1
        if after_run is not None:
            after_run(stop)
        with self.lock:
            self._drain_spec_done()
            for layer in range(l0, stop):
                e, s, p = ea[layer], ss[layer], pm[layer]
                ok = (self.where[layer, e] == s) & (self.slot_state[layer, s] == _RESIDENT)
                if not ok.all():  # evicted meanwhile: a hit all the same, no longer in the order
                    gone = int((~ok).sum())
                    self.stats.hits += gone
                    self.stats.pinned_hits += int(p[~ok].sum())
                    self.clock += gone
                    e, s, p = e[ok], s[ok], p[ok]
                self._take_all(layer, e, s, p.tolist(), int(nspec[layer]))
            if self._cond_waiters:
                self.cond.notify_all()
        return stop

    def release_slots(self, layer: int, slots: np.ndarray) -> None:
        """Give back the slots (int64 [n], distinct) :meth:`take_split` took."""
        if not len(slots):
            return
        with self.lock:
            self.slot_busy[layer, slots] -= 1
            if self._cond_waiters and not self.slot_busy[layer, slots].all():
                self.cond.notify_all()  # a cap reduction may be waiting for one of them

    def slot_offsets(self, layer: int, slots: np.ndarray) -> np.ndarray:
        """Byte offsets int64 [n] in ``arena`` of the slabs in ``slots`` (int [n]) of ``layer``
        (computed in int64: an arena can be larger than 2 GiB)."""
        return (np.int64(layer) * self.max_cap + np.asarray(slots, np.int64)) * np.int64(self.slot_bytes)

    def acquire(self, layer: int, expert: int) -> dict:
        """Views of the expert's slab, resident and marked busy until ``release``.

        Raises:
            ExpertReadError: its read failed twice.
        """
        t0 = None
        with self.lock:
            while True:
                self._drain_spec_done()
                s = self.where[layer, expert]
                if s >= 0 and self.slot_state[layer, s] == _RESIDENT:
                    break
                err = self._errors.pop((layer, expert), None)
                if err is not None:
                    raise err if isinstance(err, ExpertReadError) else ExpertReadError(str(err))
                if t0 is None:
                    t0 = time.perf_counter()
                if s >= 0:
                    self._claim_back(layer, expert, int(s), 0)
                if s < 0:
                    slot = self._reserve(layer, expert, last_resort=True)
                    if slot >= 0:
                        if (layer, expert) in self._counted_hit:
                            # counted as a hit, then evicted by a later miss of the same call
                            # (cap smaller than the call's distinct experts): it is a miss
                            self.stats.hits -= 1
                            self.stats.misses += 1
                        # read by a reader thread, before any other queued read: the compute
                        # thread never reads or verifies a slab itself
                        self._submit(layer, expert, slot, 0)
                        continue
                self._wait_slot_state()
                if time.perf_counter() - t0 > STALL_TIMEOUT_S:
                    s = self.where[layer, expert]
                    if s >= 0 and self.slot_state[layer, s] == _LOADING:
                        meta = self.store.experts[layer][expert]
                        raise ExpertReadError(
                            f"{self.store.path / meta['file']}: reading expert {expert} of layer {layer} "
                            f"did not finish in {STALL_TIMEOUT_S:.0f} s; the disk is stalled or failing "
                            f"(check it, or copy the store to another disk)")
                    raise EngineError(
                        f"expert {expert} of layer {layer} found no cache slot for {STALL_TIMEOUT_S:.0f} s "
                        f"(cap {self.layers[layer].cap}); raise the cap or the RAM budget")
            if t0 is not None:
                self.stats.felt_wait_s += time.perf_counter() - t0
            return self._take(layer, expert, s)

    def _take(self, layer: int, expert: int, s: int) -> dict:
        """The bookkeeping of acquiring resident slot ``s`` of ``expert`` (lock held): busy,
        use clock, a staged speculation counted as used, most recent; returns its views."""
        self._counted_hit.discard((layer, expert))
        self.slot_busy[layer, s] += 1
        self.clock += 1
        self.last_use[layer, expert] = self.clock
        if self.slot_spec[layer, s]:
            self.slot_spec[layer, s] = False
            self.stats.spec_used += 1
            self.layers[layer].staged.pop(s, None)
        self.touch(layer, s)
        return self._views[(layer, expert)]

    def acquire_many(self, layer: int, experts: list[int]) -> list[dict]:
        """:meth:`acquire` of each of ``experts`` (ints) in order, in one lock round-trip while
        they are resident (a decode step's hits, just returned by :meth:`prepare_split`); one
        that is not (evicted since, or failed) goes through :meth:`acquire`. Release them with
        :meth:`release_many`. The same state changes, in the same order, as one acquire each.

        Raises:
            ExpertReadError: a read failed twice (the experts acquired before it are released).
        """
        out: list[dict] = []
        with self.lock:
            for e in experts:
                s = self.where[layer, e]
                if s < 0 or self.slot_state[layer, s] != _RESIDENT:
                    break
                out.append(self._take(layer, e, s))
        try:
            for e in experts[len(out):]:
                out.append(self.acquire(layer, e))
        except BaseException:
            self.release_many(layer, experts[:len(out)])
            raise
        return out

    def release(self, layer: int, expert: int) -> None:
        with self.lock:
            self._give_back(layer, expert)

    def release_many(self, layer: int, experts: list[int]) -> None:
        """:meth:`release` of each of ``experts`` in one lock round-trip."""
        with self.lock:
            for e in experts:
                self._give_back(layer, e)

    def _give_back(self, layer: int, expert: int) -> None:
        s = self.where[layer, expert]
        if s >= 0:
            self.slot_busy[layer, s] -= 1
            if self.slot_busy[layer, s] == 0 and self._cond_waiters:
                self.cond.notify_all()  # a cap reduction may be waiting for this slot

    # --- speculative loads (PILOT) ------------------------------------------------------------------

    def try_speculate(self, layer: int, expert: int, guard=None) -> int:
        """Reserve a slot for a speculative load (lock taken here). Returns the slot (>= 0),
        or a SpecRefused: ALREADY (resident/loading), PASSED (a one-call run of this decode
        step has reached the layer: :meth:`take_resident_layers`), GUARD (guard refused), FULL
        (no slot)."""
        with self.lock:
            if self._closed or self.where[layer, expert] >= 0:
                return SpecRefused.ALREADY
            if layer <= self._passed:  # a worker that waited for the lock through a run
                return SpecRefused.PASSED
            ly = self.layers[layer]
            if not (ly.live < min(ly.cap, ly.target) and ly.free):
                v = self._pick_victim(layer, allow_staged=False)
                if v < 0:
                    return SpecRefused.FULL
                if guard is not None and not guard(layer, int(self.slot_expert[layer, v]), expert):
                    return SpecRefused.GUARD
            slot = self._reserve(layer, expert)
            if slot < 0:
                return SpecRefused.FULL
            self.stats.spec_issued += 1
            return slot

    def speculate_now(self, layer: int, expert: int, guard=None) -> int:
        """Reserve a slot for a speculative load as :meth:`try_speculate` does and queue its
        read for the speculation reader thread, which starts it without the cache's lock: PILOT
        calls it right before a one-call decode run (MoEModel._decode_step_all), which holds the
        lock for the whole run, so a worker could neither reserve nor start a read until it
        ended. The reader starts reads in claim order, one at a time, each once no demand read
        is in flight, and parks the ones it finishes while the run holds the lock (published
        by the next holder that looks at slots), so several complete during one run. A demand lookup of the expert before its read started takes the read over
        as a demand read (:meth:`take_split`, :meth:`acquire`). Returns the slot (>= 0) or a
        SpecRefused, as try_speculate."""
        slot = self.try_speculate(layer, expert, guard)
        if slot < 0:
            return slot
        with self._spec_cv:
            if self._closed:  # close() ran between the two locks: give the slot back
                ready = False
            else:
                ready = True
                self._spec_ready.append((layer, expert, slot))
                self._spec_cv.notify()
                if self._spec_reader is None:
                    self._spec_reader = threading.Thread(target=self._spec_read_loop, name="colibri-spec-io",
                                                         daemon=True)
                    self._spec_reader.start()
        if not ready:
            with self.lock:
                self._unreserve(layer, slot)
                self.stats.spec_issued -= 1
            return SpecRefused.ALREADY
        return slot

    def hand_off_speculations(self) -> bool:
        """After :meth:`speculate_now` queued reads right before a one-call decode run (PILOT's
        Pilot.on_run_start), wait until the speculation reader has started the first of them
        (at most HANDOFF_WAIT_S), when it is free: not reading nor holding a speculation back
        for a demand read, and no demand read in flight (it would wait for that first: nothing
        to hand over). The run keeps both of a 2-core machine's cores busy, so a reader woken
        just before it waited for a core (:meth:`_hand_off`, the same for demand reads).
        Returns whether it waited for a start."""
        with self._spec_cv:
            if (not self._spec_ready or self._spec_reading or self._spec_waiting is not None
                    or self.demand_inflight > 0 or self._closed):
                return False
            target = self._spec_started + 1
            deadline = time.perf_counter() + HANDOFF_WAIT_S
            while self._spec_started < target and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._spec_started_cv.wait(left)
            return True

    def _claim_back(self, layer: int, expert: int, slot: int, urgency: int) -> None:
        """A demand lookup found ``expert`` loading in ``slot`` (lock held): if it is a
        speculation whose read has not started (:meth:`speculate_now`), queued or taken by the
        speculation reader while it waits for the demand reads in flight, read it as a demand
        read now (``urgency`` as _submit) instead of after the speculations queued before it
        (or after every demand read, the less urgent ones included)."""
        with self._spec_lock:
            try:
                self._spec_ready.remove((layer, expert, slot))
            except ValueError:
                if self._spec_waiting != (layer, expert, slot):
                    return  # not queued: a worker's speculation, or its read in flight
                # the speculation reader took it and waits for the demand reads in flight, the
                # less urgent ones queued after them included: read it now as a demand read
                self._spec_waiting = None
        self.stats.spec_issued -= 1
        self._submit(layer, expert, slot, urgency)

    def cancel_speculations(self, below: int | None = None) -> int:
        """Give back the slots of speculations :meth:`speculate_now` queued whose reads have
        not started (PILOT at a new token: they are stale), or only those of layers before
        ``below`` (at the start of a run from that layer: the layers before it ran); counted
        as stale drops. Without ``below`` (a new token) the layers a run reached are open to
        speculation again. Returns how many."""
        with self.lock:
            if below is None:
                self._passed = -1
            with self._spec_lock:
                items = [it for it in self._spec_ready if below is None or it[0] < below]
                if items:
                    keep = [it for it in self._spec_ready if not (below is None or it[0] < below)]
                    self._spec_ready.clear()
                    self._spec_ready.extend(keep)
            for layer, _e, slot in items:
                self._unreserve(layer, slot)
            self.stats.spec_issued -= len(items)
            self.stats.spec_dropped_stale += len(items)
            if items and self._cond_waiters:
                self.cond.notify_all()
        return len(items)

    def _spec_read_loop(self) -> None:
        """The speculation reader thread (:meth:`speculate_now`): take the oldest queued
        speculation, wait while a demand read is in flight (a read beside it only slows it on
        a disk that gains nothing from queue depth), read it, and publish it if the cache's
        lock comes free within SPEC_PUBLISH_WAIT_S; a one-call run holds the lock for
        milliseconds, so a read done during one is parked (``_spec_done``) and the next read
        starts at once: every lock holder that looks at slots publishes the parked ones first
        (:meth:`_drain_spec_done`), and the reader itself once it has nothing left to read."""
        while True:
            with self._spec_cv:
                while not self._spec_ready and not self._spec_done and not self._closed:
                    self._spec_cv.wait()
                if self._closed:
                    return  # close() gives the queued slots back and publishes the parked reads
                item = self._spec_ready.popleft() if self._spec_ready else None
                self._spec_waiting = item  # waiting for the demand reads: still a demand lookup's to take
            if item is None:  # nothing left to read: publish the parked reads (waiting for the lock)
                with self.lock:
                    self._drain_spec_done()
                continue
            layer, expert, slot = item
            while self.demand_inflight > 0 and not self._closed:  # an int read: no lock (a run may hold it)
                time.sleep(0.0005)
            with self._spec_lock:  # from here the read is started: no demand lookup can take it over
                taken = self._spec_waiting != item  # a demand lookup took it over while it waited
                self._spec_waiting = None
                if not taken:
                    self._spec_started += 1
                    self._spec_reading = True
                    self._spec_started_cv.notify_all()
            if taken:
                continue
            try:
                res = self._read_slot(layer, expert, slot)
            finally:
                self._spec_reading = False  # (a bool: hand_off_speculations reads it under _spec_lock)
            if self.lock.acquire(timeout=SPEC_PUBLISH_WAIT_S):
                try:
                    self._drain_spec_done()
                    self._publish(layer, expert, slot, True, False, *res)
                finally:
                    self.lock.release()
            else:
                with self._spec_cv:
                    self._spec_done.append((layer, expert, slot, res))

    def _drain_spec_done(self) -> None:
        """Publish the speculative reads the speculation reader parked while a run held the
        lock (lock held; :meth:`_spec_read_loop`)."""
        if not self._spec_done:  # a plain read of a deque's length: no lock needed to skip
            return
        with self._spec_lock:
            done = list(self._spec_done)
            self._spec_done.clear()
        for layer, expert, slot, res in done:
            self._publish(layer, expert, slot, True, False, *res)

    def wait_demand_idle(self, timeout: float) -> bool:
        """Block until no demand read is in flight (True) or ``timeout`` seconds pass (False).
        PILOT workers call it before a speculative read: on a disk whose bandwidth does not
        grow with queue depth, a speculation read beside a demand read only slows the demand."""
        deadline = time.perf_counter() + timeout
        with self.lock:
            while self.demand_inflight > 0 and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                self._idle_cv.wait(min(left, 0.01))
            return True

    def load_speculative(self, layer: int, expert: int, slot: int) -> None:
        self._load(layer, expert, slot, True)

    def count_dropped(self, reason: SpecDrop, n: int = 1) -> None:
        """Count ``n`` speculative loads dropped for ``reason`` (stats.spec_dropped_*)."""
        with self.lock:
            name = "spec_dropped_" + SpecDrop(reason).value
            setattr(self.stats, name, getattr(self.stats, name) + n)

    # --- observers ------------------------------------------------------------------------------

    def subscribe(self, observer) -> None:
        """Publish loads, evictions and pin changes to ``observer`` (hooks ``on_load``,
        ``on_evict``, ``on_pins`` of ``engine.observers.Observer``; called with the cache lock
        held: record, never call back into the cache)."""
        self.observers.subscribe(observer)

    def unsubscribe(self, observer) -> None:
        """Stop publishing to ``observer`` (no-op if it is not subscribed)."""
        self.observers.unsubscribe(observer)

    # --- pinning, cap, residency --------------------------------------------------------------------

    def set_pinned(self, pinned: np.ndarray) -> None:
        """Replace the pin set (bool [L, E]). Pinned residents leave the eviction order.
        At most cap - 1 experts per layer stay pinned (the hottest by ``heat``): one slot
        is always left for everything else, or a miss could never find a slot."""
        with self.lock:
            pinned = np.array(pinned, dtype=bool)
            for layer in range(self.L):
                ids = np.nonzero(pinned[layer])[0]
                n = self.layers[layer].cap - 1
                if len(ids) > n:
                    pinned[layer] = False
                    pinned[layer, ids[np.argsort(-self.heat[layer, ids], kind="stable")][:max(0, n)]] = True
            self.observers.publish("on_pins", pinned)
            for layer in range(self.L):
                for e in np.nonzero(self.pinned[layer] != pinned[layer])[0]:
                    s = self.where[layer, e]
                    was = self.pinned[layer, e]
                    if s >= 0 and self.slot_state[layer, s] == _RESIDENT:
                        if was:
                            self.pinned[layer, e] = False
                            self._track(layer, s)
                        else:
                            self._untrack(layer, s)
                            self.pinned[layer, e] = True
                    else:
                        self.pinned[layer, e] = pinned[layer, e]

    def _unpin_coldest(self, layer: int) -> int:
        """Unpin the coldest (lowest heat; ties: higher id) resident, idle pinned slot of
        ``layer`` and make it evictable (lock held). Returns the slot, or -1 if none."""
        cands = [s for s in range(self.max_cap) if self.slot_state[layer, s] == _RESIDENT
                 and self.slot_busy[layer, s] == 0 and self.pinned[layer, self.slot_expert[layer, s]]]
        if not cands:
            return -1
        v = min(cands, key=lambda s: (self.heat[layer, self.slot_expert[layer, s]], -self.slot_expert[layer, s]))
        self.pinned[layer, self.slot_expert[layer, v]] = False
        self._track(layer, v)
        return v

    def _trim_pins(self, layer: int, max_pins: int) -> None:
        """Unpin the coldest pins of ``layer`` beyond ``max_pins`` (lock held; a pinned expert
        not resident just loses its mark). Keeps at least one slot that is not pinned."""
        ids = np.nonzero(self.pinned[layer])[0]
        if len(ids) <= max_pins:
            return
        keep = ids[np.argsort(-self.heat[layer, ids], kind="stable")][:max(0, max_pins)]
        for e in ids:
            if e in keep:
                continue
            s = self.where[layer, e]
            self.pinned[layer, e] = False
            if s >= 0 and self.slot_state[layer, s] == _RESIDENT:
                self._track(layer, s)

    def _evict_one_for_shrink(self, layer: int) -> bool:
        """Free one evictable slot of ``layer`` (lock held); pinned slots go last. False if
        every live slot is busy or loading right now."""
        ly = self.layers[layer]
        v = self._pick_victim(layer)
        if v < 0:
            v = self._unpin_coldest(layer)
            if v < 0:
                return False
        self._evict(layer, v)
        ly.live -= 1
        ly.free.append(v)
        self._release_pages(layer, v)
        return True

    def forget(self) -> None:
        """Evict every unpinned expert and zero the counters and the access clock, as if the
        cache had just been made (the engine's kernel warm-up at open uses it, so that the
        warm-up leaves no trace in residency, hit rates or benchmarks' cold starts)."""
        with self.lock:
            for layer in range(self.L):
                ly = self.layers[layer]
                while ly.live > 0:
                    v = self._pick_victim(layer)
                    if v < 0:
                        break
                    self._evict(layer, v)
                    ly.live -= 1
                    ly.free.append(v)
                    self._release_pages(layer, v)
            self.stats = CacheStats()
            self.last_use[:] = 0
            self.clock = 0
            self.routed_now[:] = False
            self._counted_hit.clear()
            self._fill_bad[:] = False
        with self.lock:
            self.grow_stopped = False  # a fresh start: background growth may ask again
            self._grow_gen += 1
        self._populate_wake.set()
        self._fill_wake.set()

    def set_cap(self, cap: int, max_pins: int | None = None) -> int:
        """Change the slots per layer (1..arena size), the same in every layer. Lowering first
        unpins the coldest pins beyond ``max_pins`` (default and upper bound: cap - 1, so one
        slot per layer always stays free for misses), then evicts policy victims and waits for
        busy or loading slots to come free, and only then publishes the new cap, so
        ``live_slots(layer) <= cap`` holds at every instant; the cap holds until changed again
        (no slot regrows past it: colibri #1034). Returns the number of evictions."""
        cap = max(1, min(int(cap), self.max_cap))
        return self._apply_caps([cap] * self.L, max_pins)

    def set_slots(self, slots: int, max_pins: int | None = None) -> int:
        """Change the slots of all layers together (clamped to num_layers .. num_layers x the
        arena's width): ``slots // L`` in every layer and one more in ``slots % L`` of them, the
        layers whose routing so far reached the most distinct experts (``heat`` > 0; ties: the
        lower layer), which lose the most to a missing slot. Lowering and pins as
        :meth:`set_cap` (``max_pins`` bounded by each layer's cap - 1). Returns the number of
        evictions."""
        return self._apply_caps(self._spread(slots), max_pins)

    def _spread(self, slots: int) -> list[int]:
        """Per-layer caps summing to ``slots`` (clamped), differing by at most one (see
        :meth:`set_slots`)."""
        slots = max(self.L, min(int(slots), self.L * self.max_cap))
        base, extra = divmod(slots, self.L)
        caps = [base] * self.L
        if extra:
            breadth = np.count_nonzero(self.heat > 0, axis=1)
            for layer in np.argsort(-breadth, kind="stable")[:extra]:
                caps[int(layer)] += 1
        return caps

    def _apply_caps(self, caps: list[int], max_pins: int | None) -> int:
        n = 0
        with self.lock:
            for ly, c in zip(self.layers, caps):  # every layer first: none grows past its new cap while another settles
                ly.target = c
            for layer in range(self.L):
                ly, cap = self.layers[layer], caps[layer]
                self._trim_pins(layer, cap - 1 if max_pins is None else max(0, min(int(max_pins), cap - 1)))
                while ly.live > cap and not self._closed:
                    if self._evict_one_for_shrink(layer):
                        n += 1
                    else:
                        self._wait_slot_state()
                ly.cap = cap
                room = set(self._populate_room(layer))  # (a raised cap: the populater wakes below)
                for v in ly.free:  # slots populated ahead that the new cap leaves no room for
                    if self._faulted[layer, v] and v not in room:
                        self._release_pages(layer, v)
        with self.lock:
            self.grow_stopped = False  # a new cap: background growth may ask again
            self._grow_gen += 1
        self._populate_wake.set()
        self._fill_wake.set()
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
        return int(np.count_nonzero((self.slot_state != FREE) | self._faulted)) * self.slot_bytes

    def residency(self) -> np.ndarray:
        """int8 [L, E] of ABSENT / RESIDENT / PINNED / LOADING (events.py constants)."""
        with self.lock:
            out = np.full((self.L, self.E), ABSENT, np.int8)
            ls, ss = np.nonzero(self.slot_state != FREE)  # the live slots, as whole arrays: a
            es = self.slot_expert[ls, ss]  # Python loop over L x cap slots took ~0.8 ms for
            st = self.slot_state[ls, ss]  # 16 x 64 (the metrics take one every 0.1 s)
            out[ls, es] = np.where(st == _LOADING, LOADING, np.where(self.pinned[ls, es], PINNED, RESIDENT))
            return out

    def wait_estimate(self, layer: int, experts) -> float:
        """Seconds until every expert of ``experts`` (ints) of ``layer`` is resident, estimated
        from the mean slab read time (``read_s_ema``): the longest remainder of the reads in
        progress (the mean minus their elapsed time), plus the mean for each round of
        ``io_threads`` queued reads; resident experts count nothing. 0 before any read
        finished (nothing to go by)."""
        now = time.perf_counter()
        inflight, queued = 0.0, 0
        with self.lock:
            ema = self.read_s_ema
            for e in experts:
                s = int(self.where[layer, int(e)])
                if s >= 0 and self.slot_state[layer, s] == _RESIDENT:
                    continue
                t0 = self._read_t0.get((layer, int(e)))
                if t0 is None:
                    queued += 1
                else:
                    inflight = max(inflight, ema - (now - t0))
        # the longest read in progress, then the queued ones, io_threads at a time
        return max(0.0, inflight) + -(-queued // self.io_threads) * ema

    def is_present(self, layer: int, expert: int) -> bool:
        return self.where[layer, expert] >= 0

    def close(self) -> None:
        """Stop the reader threads (each finishes the queued reads first; a read that finishes
        after close frees its slot). Idempotent."""
        with self.lock:
            self._closed = True
            self.cond.notify_all()
            self._readq_cv.notify_all()
            self._taken_cv.notify_all()
            self._idle_cv.notify_all()
        with self._spec_cv:
            self._spec_cv.notify_all()
            self._spec_started_cv.notify_all()
        self._populate_wake.set()
        self._fill_wake.set()
        for t in self._readers:
            t.join()
        if self._spec_reader is not None:
            self._spec_reader.join()
        self.cancel_speculations()
        with self.lock:
            self._drain_spec_done()  # closed: their slots are given back
        if self._populater is not None:
            self._populater.join()
        if self._filler is not None:
            self._filler.join()
