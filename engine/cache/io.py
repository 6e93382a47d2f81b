"""The expert cache's reads: one slab from the store into its reserved slot, and the demand
reads' queue and reader threads.

:class:`SlabIO` is the one path from the store to a resident slot, for demand, speculative and
pre-read loads alike: :meth:`SlabIO.read` without the cache's lock (``ExpertStore.read``, the
checksum verified in the reading thread), then :meth:`SlabIO.publish` with it, which makes the
slot resident (``SlotTable.publish``) or gives it back (``SlotTable.abandon``) and wakes the
waiters.

:class:`DemandReads` runs ``io_threads`` reader threads over one ordered queue: first the reads
the compute is blocked on right now (``acquire`` found no slot at lookup time), then every
other demand read in submission order, which is the layer's compute order (hits first, then
misses by ascending id). With one reader (the engine's default on a disk whose bandwidth does
not grow with queue depth) a layer's first-needed miss arrives after one slab read instead of
after all of them sharing the disk; the kernels start on it while the next one is read. The
compute thread never reads or checksums a slab itself.

Both work for an owner ``cache`` (engine.expert_cache.ExpertCache) and use of it only: ``lock``,
``cond`` (slot-state changes), ``closed``, ``table`` (engine/cache/slots.py), ``memory`` (the
arena), ``store``, ``checksum``, ``stats``, ``observers``, ``demand`` and ``io``.
"""

from __future__ import annotations

import heapq
import threading
import time

import numpy as np

from .slots import RESIDENT

HANDOFF_WAIT_S = 0.002  # the compute thread's longest wait for an idle reader to take its demand read


class SlabIO:
    """Reads into reserved slots and publishes them.

    ``read_s_ema``: seconds per slab read (EMA over finished reads; 0 before the first);
    ``started``: (layer, expert) -> perf_counter time, the reads in progress; ``errors``:
    (layer, expert) -> the exception of a failed demand read, raised by the next acquire.
    """

    def __init__(self, cache):
        self.cache = cache
        self.verified = np.zeros((cache.L, cache.E), dtype=bool)  # checksums checked ("first")
        self.started: dict[tuple[int, int], float] = {}
        self.read_s_ema = 0.0
        self.errors: dict[tuple[int, int], Exception] = {}

    def must_verify(self, layer: int, expert: int) -> bool:
        c = self.cache.checksum
        return c == "always" or (c == "first" and not self.verified[layer, expert])

    def read(self, layer: int, expert: int, slot: int) -> tuple:
        """Read the expert's slab into its reserved slot (no lock held). Returns (bytes read,
        error or None, seconds, verified), the arguments of :meth:`publish` after the slot's."""
        buf = self.cache.memory.buf(layer, slot)
        verify = self.must_verify(layer, expert)
        t0 = time.perf_counter()
        self.started[(layer, expert)] = t0
        try:
            n = self.cache.store.read(layer, expert, buf, verify=verify)
            err = None
        except Exception as e:  # noqa: BLE001 - reported to the waiter
            err = e
            n = 0
        self.started.pop((layer, expert), None)  # done (wait_estimate): its publishing may wait for the lock
        return n, err, time.perf_counter() - t0, verify

    def read_run(self, layer: int, experts: list[int], slots: list[int]) -> list[tuple]:
        """Read ``experts`` of ``layer`` into their reserved ``slots`` with one positional read
        per run of slabs back to back in the store (``ExpertStore.read_run``; no lock held).
        Returns one :meth:`read` result per expert (each the run's mean time)."""
        bufs = [self.cache.memory.buf(layer, s) for s in slots]
        verify = [self.must_verify(layer, e) for e in experts]
        t0 = time.perf_counter()
        for e in experts:
            self.started[(layer, e)] = t0
        try:
            res = self.cache.store.read_run(layer, experts, bufs, verify)
        except Exception as e:  # noqa: BLE001 - every slot is given back by publish
            res = [(0, e)] * len(experts)
        dt = (time.perf_counter() - t0) / len(experts)
        return [(n, err, dt, v) for (n, err), v in zip(res, verify)]

    def publish(self, layer: int, expert: int, slot: int, speculative: bool, fill: bool, n: int,
                err: Exception | None, dt: float, verify: bool) -> bool:
        """A read of a reserved slot ended (lock held): the slot resident, or freed on an error
        or a closed cache; the counters; the waiters woken. ``speculative``: PILOT's or the
        pre-read's (``fill``) read, else a demand read. Returns whether the slot is resident."""
        c = self.cache
        stats = c.stats
        self.started.pop((layer, expert), None)
        self.read_s_ema = dt if self.read_s_ema == 0.0 else 0.8 * self.read_s_ema + 0.2 * dt
        c.memory.faulted[layer, slot] = True  # the read (or its attempt) touched the pages
        if not speculative:
            c.demand.finished()
        stats.read_service_s += dt
        ok = err is None and not c.closed
        if not ok:
            stats.read_errors += err is not None
            c.table.abandon(layer, slot)
            if err is not None and not speculative:
                self.errors[(layer, expert)] = err
        else:
            if verify:
                self.verified[layer, expert] = True
            stats.loads += 1
            if speculative:
                stats.spec_bytes += n
                if fill:
                    stats.fill_loads += 1
                else:
                    stats.spec_completed += 1
            else:
                stats.demand_bytes += n
            c.table.publish(layer, expert, slot, c.store.views(c.memory.buf(layer, slot)), speculative, fill)
            c.observers.publish("on_load", layer, expert, n, dt, speculative)
        c.cond.notify_all()
        return ok

    def load(self, layer: int, expert: int, slot: int, speculative: bool) -> None:
        """:meth:`read`, then :meth:`publish` under the lock."""
        res = self.read(layer, expert, slot)
        with self.cache.lock:
            self.publish(layer, expert, slot, speculative, False, *res)

    def wait_estimate(self, layer: int, experts) -> float:
        """Seconds until every expert of ``experts`` (ints) of ``layer`` is resident, estimated
        from ``read_s_ema``: the longest remainder of the reads in progress (the mean minus
        their elapsed time), plus the mean for each round of ``io_threads`` queued reads;
        resident experts count nothing. 0 before any read finished (nothing to go by)."""
        c = self.cache
        now = time.perf_counter()
        inflight, queued = 0.0, 0
        with c.lock:
            ema = self.read_s_ema
            for e in experts:
                s = int(c.table.where[layer, int(e)])
                if s >= 0 and c.table.slot_state[layer, s] == RESIDENT:
                    continue
                t0 = self.started.get((layer, int(e)))
                if t0 is None:
                    queued += 1
                else:
                    inflight = max(inflight, ema - (now - t0))
        # the longest read in progress, then the queued ones, io_threads at a time
        return max(0.0, inflight) + -(-queued // c.demand.n_threads) * ema


class DemandReads:
    """The demand reads: a queue ordered by (urgency, submission) and ``n_threads`` reader
    threads. ``inflight``: demand reads submitted and not published (PILOT and the pre-read
    yield to them)."""

    def __init__(self, cache, n_threads: int):
        self.cache = cache
        self.n_threads = max(1, int(n_threads))
        # a heap of (urgency, sequence, layer, expert, slot); urgency 0 = the compute waits for
        # it now (acquire), 1 = announced by a lookup (in compute order)
        self.queue: list[tuple[int, int, int, int, int]] = []
        self.seq = 0
        self.inflight = 0
        # conditions of their own on the cache's lock, so that a wake-up reaches only the
        # threads waiting for that change (with one condition for all, every expert given back
        # woke every idle reader: ~1.6 ms per MoE layer on a busy machine)
        self.queued_cv = threading.Condition(cache.lock)  # a read was queued (reader threads)
        self.taken_cv = threading.Condition(cache.lock)  # a reader took a queued read (hand_off)
        self.idle_cv = threading.Condition(cache.lock)  # no demand read in flight (wait_idle)
        self.idle_readers = 0  # reader threads waiting for a read
        self.taken = 0  # reads the readers have taken from the queue
        self.handoff_waiters = 0
        self.threads = [threading.Thread(target=self._reader, name=f"colibri-io-{i}", daemon=True)
                        for i in range(self.n_threads)]
        for t in self.threads:
            t.start()

    def submit(self, layer: int, expert: int, slot: int, urgency: int) -> None:
        """Queue a demand read of a reserved slot (lock held)."""
        self.seq += 1
        heapq.heappush(self.queue, (urgency, self.seq, layer, expert, slot))
        self.inflight += 1
        self.queued_cv.notify()  # one reader takes it

    def finished(self) -> None:
        """A demand read was published (lock held)."""
        self.inflight -= 1
        if self.inflight == 0:
            self.idle_cv.notify_all()

    def _reader(self) -> None:
        """A reader thread: take the most urgent queued read, read (and verify) it, publish it."""
        c = self.cache
        while True:
            with c.lock:
                while not self.queue and not c.closed:
                    self.idle_readers += 1
                    try:
                        self.queued_cv.wait()
                    finally:
                        self.idle_readers -= 1
                if not self.queue:  # closed and drained
                    return
                _u, _seq, layer, expert, slot = heapq.heappop(self.queue)
                self.taken += 1
                if self.handoff_waiters:
                    self.taken_cv.notify_all()
            c.io.load(layer, expert, slot, False)

    def hand_off(self) -> None:
        """After the compute thread queued demand reads it will not wait for at once (lock
        held): when a reader thread was idle, wait until it has taken the first of them (at
        most HANDOFF_WAIT_S), so the read is on the disk while the compute thread works on the
        hits. Without it the woken reader waited for a core behind the kernel's threads, which
        keep both of a 2-core machine's cores busy (a median 1.7 ms from a miss's queueing to
        its read's start, as long as the hits' compute); waiting here gives the reader the
        compute thread's core for the ~0.1 ms it needs to start the read (it then blocks in the
        read system call, leaving the core and the GIL)."""
        if self.idle_readers == 0 or not self.queue or self.cache.closed:
            return
        target = self.taken + 1
        deadline = time.perf_counter() + HANDOFF_WAIT_S
        self.handoff_waiters += 1
        try:
            while self.taken < target and not self.cache.closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self.taken_cv.wait(left)
        finally:
            self.handoff_waiters -= 1

    def wait_idle(self, timeout: float) -> bool:
        """Block until no demand read is in flight (True) or ``timeout`` seconds pass (False)."""
        deadline = time.perf_counter() + timeout
        with self.cache.lock:
            while self.inflight > 0 and not self.cache.closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                self.idle_cv.wait(min(left, 0.01))
            return True

    def wake_all(self) -> None:
        """Wake every waiting thread (lock held; the cache is closing)."""
        self.queued_cv.notify_all()
        self.taken_cv.notify_all()
        self.idle_cv.notify_all()

    def join(self) -> None:
        """Wait for the reader threads (each finishes the queued reads first)."""
        for t in self.threads:
            t.join()
