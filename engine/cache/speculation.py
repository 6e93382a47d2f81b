"""The expert cache's speculative reads: PILOT's predicted experts loaded before their layer
asks for them.

Two ways in. A PILOT worker thread reserves a slot (:meth:`Speculations.try_speculate`) and
reads it itself (``ExpertCache.load_speculative``). Right before a one-call decode run, which
holds the cache's lock for the whole run, PILOT instead queues the read
(:meth:`Speculations.speculate_now`) for the speculation reader thread, which starts it without
the cache's lock: it starts reads in claim order, one at a time, each once no demand read is
in flight, and parks the ones it finishes while a run holds the lock (``done``), published by
the next holder that looks at slots (:meth:`Speculations.drain`). A demand lookup of an expert
whose speculative read has not started takes it over as a demand read
(:meth:`Speculations.claim_back`).

A speculation never evicts a staged (unused) speculation and may be refused by PILOT's
eviction guard; see :class:`SpecRefused`. Works for an owner ``cache``
(engine.expert_cache.ExpertCache) and uses of it: ``lock``, ``cond``, ``closed``, ``table``,
``stats``, ``io`` and ``demand``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from enum import Enum, IntEnum

from . import io as cache_io

SPEC_PUBLISH_WAIT_S = 0.0003  # the speculation reader's wait for the lock before parking a finished read


class SpecRefused(IntEnum):
    """Why ``ExpertCache.try_speculate`` reserved no slot (negative, so ``slot >= 0`` still
    means a slot was reserved)."""

    ALREADY = -1  # the expert is resident or being loaded already
    GUARD = -2    # the eviction guard refused to evict the only candidate victim
    FULL = -3     # no slot can be freed (all pinned, busy or staged)
    PASSED = -4   # this decode step's one-call run has reached the layer already


class SpecDrop(Enum):
    """Why a speculative load (PILOT) was dropped; ``ExpertCache.count_dropped`` counts it in
    ``stats.spec_dropped_<value>``."""

    STALE = "stale"  # its token or layer had passed before a worker got to it
    GUARD = "guard"  # the eviction guard protected the victim
    FULL = "full"    # no slot (or the prefetch queue was full)


class Speculations:
    """Speculative slot reservations and the speculation reader thread.

    ``passed``: the last layer this decode step's one-call runs reached (set by
    ``ExpertCache.take_resident_layers``); no speculation is reserved for it or before it.
    """

    def __init__(self, cache):
        self.cache = cache
        self.passed = -1
        # the queued reads wait under a lock of their own, so the reader can start them while
        # a run holds the cache's lock
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.started_cv = threading.Condition(self.lock)  # a speculative read started
        self.ready: deque = deque()  # (layer, expert, slot), claim order
        self.done: deque = deque()  # (layer, expert, slot, read result) read, not yet published
        self.thread: threading.Thread | None = None
        self.waiting = None  # (layer, expert, slot) the reader took, its read not started
        self.reading = False  # the reader is reading (hand_off)
        self.started = 0  # reads the reader has started

    def try_speculate(self, layer: int, expert: int, guard=None) -> int:
        """Reserve a slot for a speculative load (the cache's lock taken here). Returns the slot
        (>= 0), or a SpecRefused: ALREADY (resident/loading), PASSED (a one-call run of this
        decode step has reached the layer), GUARD (``guard(layer, victim expert, expert)``
        refused), FULL (no slot)."""
        c = self.cache
        t = c.table
        with c.lock:
            if c.closed or t.where[layer, expert] >= 0:
                return SpecRefused.ALREADY
            if layer <= self.passed:  # a worker that waited for the lock through a run
                return SpecRefused.PASSED
            ly = t.layers[layer]
            if not (ly.live < min(ly.cap, ly.target) and ly.free):
                v = t.victim(layer, allow_staged=False)
                if v < 0:
                    return SpecRefused.FULL
                if guard is not None and not guard(layer, int(t.slot_expert[layer, v]), expert):
                    return SpecRefused.GUARD
            slot = t.reserve(layer, expert)
            if slot < 0:
                return SpecRefused.FULL
            c.stats.spec_issued += 1
            return slot

    def speculate_now(self, layer: int, expert: int, guard=None) -> int:
        """Reserve a slot as :meth:`try_speculate` and queue its read for the speculation
        reader. Returns the slot (>= 0) or a SpecRefused."""
        slot = self.try_speculate(layer, expert, guard)
        if slot < 0:
            return slot
        with self.cv:
            if self.cache.closed:  # close() ran between the two locks: give the slot back
                ready = False
            else:
                ready = True
                self.ready.append((layer, expert, slot))
                self.cv.notify()
                if self.thread is None:
                    self.thread = threading.Thread(target=self._read_loop, name="colibri-spec-io", daemon=True)
                    self.thread.start()
        if not ready:
            with self.cache.lock:
                self.cache.table.abandon(layer, slot)
                self.cache.stats.spec_issued -= 1
            return SpecRefused.ALREADY
        return slot

    def hand_off(self) -> bool:
        """After :meth:`speculate_now` queued reads right before a one-call decode run, wait
        until the reader has started the first of them (at most io.HANDOFF_WAIT_S), when it is
        free: not reading nor holding a speculation back for a demand read, and no demand read
        in flight (it would wait for that first: nothing to hand over). The run keeps both of
        a 2-core machine's cores busy, so a reader woken just before it waited for a core (as
        ``DemandReads.hand_off`` for demand reads). Returns whether it waited for a start. A
        reader that took a speculation and has not started it yet (no demand read holds it back)
        is waited for too: it may lose its core between the two, just when the run starts."""
        with self.cv:
            if ((not self.ready and self.waiting is None) or self.reading
                    or self.cache.demand.inflight > 0 or self.cache.closed):
                return False
            target = self.started + 1
            deadline = time.perf_counter() + cache_io.HANDOFF_WAIT_S
            while self.started < target and not self.cache.closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self.started_cv.wait(left)
            return True

    def claim_back(self, layer: int, expert: int, slot: int, urgency: int) -> None:
        """A demand lookup found ``expert`` loading in ``slot`` (cache lock held): if it is a
        speculation whose read has not started, queued or taken by the reader while it waits
        for the demand reads in flight, read it as a demand read now (``urgency`` as
        ``DemandReads.submit``) instead of after the speculations queued before it."""
        with self.lock:
            try:
                self.ready.remove((layer, expert, slot))
            except ValueError:
                if self.waiting != (layer, expert, slot):
                    return  # not queued: a worker's speculation, or its read in flight
                # the reader took it and waits for the demand reads in flight, the less urgent
                # ones queued after them included: read it now as a demand read
                self.waiting = None
        self.cache.stats.spec_issued -= 1
        self.cache.demand.submit(layer, expert, slot, urgency)

    def cancel(self, below: int | None = None) -> int:
        """Give back the slots of queued speculations whose reads have not started (PILOT at a
        new token: they are stale), or only those of layers before ``below`` (a run starts from
        that layer); counted as stale drops. Without ``below`` the layers a run reached are
        open to speculation again. Returns how many."""
        c = self.cache
        with c.lock:
            if below is None:
                self.passed = -1
            with self.lock:
                items = [it for it in self.ready if below is None or it[0] < below]
                if items:
                    keep = [it for it in self.ready if not (below is None or it[0] < below)]
                    self.ready.clear()
                    self.ready.extend(keep)
            for layer, _e, slot in items:
                c.table.abandon(layer, slot)
            c.stats.spec_issued -= len(items)
            c.stats.spec_dropped_stale += len(items)
            if items:
                c.notify_slots()
        return len(items)

    def _read_loop(self) -> None:
        """The speculation reader thread: take the oldest queued speculation, wait while a
        demand read is in flight (a read beside it only slows it on a disk that gains nothing
        from queue depth), read it, and publish it if the cache's lock comes free within
        SPEC_PUBLISH_WAIT_S; a one-call run holds the lock for milliseconds, so a read done
        during one is parked (``done``) and the next read starts at once: every lock holder
        that looks at slots publishes the parked ones first (:meth:`drain`), and the reader
        itself once it has nothing left to read."""
        c = self.cache
        while True:
            with self.cv:
                while not self.ready and not self.done and not c.closed:
                    self.cv.wait()
                if c.closed:
                    return  # close() gives the queued slots back and publishes the parked reads
                item = self.ready.popleft() if self.ready else None
                self.waiting = item  # waiting for the demand reads: still a demand lookup's to take
            if item is None:  # nothing left to read: publish the parked reads (waiting for the lock)
                with c.lock:
                    self.drain()
                continue
            layer, expert, slot = item
            while c.demand.inflight > 0 and not c.closed:  # an int read: no lock (a run may hold it)
                time.sleep(0.0005)
            with self.lock:  # from here the read is started: no demand lookup can take it over
                taken = self.waiting != item  # a demand lookup took it over while it waited
                self.waiting = None
                if not taken:
                    self.started += 1
                    self.reading = True
                    self.started_cv.notify_all()
            if taken:
                continue
            try:
                res = c.io.read(layer, expert, slot)
            finally:
                self.reading = False  # (a bool: hand_off reads it under self.lock)
            if c.lock.acquire(timeout=SPEC_PUBLISH_WAIT_S):
                try:
                    self.drain()
                    c.io.publish(layer, expert, slot, True, False, *res)
                finally:
                    c.lock.release()
            else:
                with self.cv:
                    self.done.append((layer, expert, slot, res))

    def drain(self) -> None:
        """Publish the reads the reader parked while a run held the cache's lock (lock held)."""
        if not self.done:  # a plain read of a deque's length: no lock needed to skip
            return
        with self.lock:
            done = list(self.done)
            self.done.clear()
        for layer, expert, slot, res in done:
            self.cache.io.publish(layer, expert, slot, True, False, *res)

    def wake_all(self) -> None:
        """Wake the reader and any hand-off waiter (the cache is closing)."""
        with self.cv:
            self.cv.notify_all()
            self.started_cv.notify_all()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
