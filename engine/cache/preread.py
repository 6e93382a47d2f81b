"""The expert cache's pre-read (the setting ``idle_fill``): experts not yet in RAM read into
free slots while no demand read is in flight, never evicting.

One sequential pass in file order (each MoE layer's slabs are one file, experts in id order),
each run of slabs that lie back to back read with one positional read (``ExpertStore.
read_run``): the disk's sequential rate, not one slab per call. A store that fits in the cap
ends up wholly resident seconds after open, so a first answer waits on no read the pass would
have brought; one that does not gets its free slots filled with the experts most routed to so
far (the routing history). A filled slot joins its layer's eviction order at the cold end, so
an expert the routing never asks for is the first victim, and the pass never evicts, so it
cannot lower the hit rate. A demand read always goes first: a run starts only once no demand
read is in flight and no :meth:`PreRead.hold` holds it (the engine holds it while it
generates), and a demand read arriving during a run shares the disk with at most ``pass_run``
slabs.

When the pass is done and every slot holds an expert, :meth:`PreRead.collapse_full` puts the
whole arena on huge pages. Works for an owner ``cache`` (engine.expert_cache.ExpertCache) and
uses of it: ``lock``, ``closed``, ``fill``, ``table``, ``memory``, ``store``, ``stats``,
``slot_bytes``, ``io``, ``demand`` and ``populate``.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ..units import format_bytes
from .arena import HUGE_PAGE, MADV_COLLAPSE
from .slots import LOADING, RESIDENT

log = logging.getLogger(__name__)

# The pass's longest run (one positional read of slabs back to back): long enough for the
# disk's sequential rate, short enough that a demand read arriving during it shares the disk
# with a few milliseconds of it at most
PASS_READ_BYTES = 16 << 20

# The collapse's step: the kernel copies ~0.8 GB/s while collapsing (4.4 s for a 3.6 GB arena),
# so an answer that starts during a collapse waits on at most ~80 ms of it before it pauses
COLLAPSE_CHUNK = 64 << 20


class PreRead:
    """The pre-read thread (started once by :meth:`start`) and the holds on it.

    ``pass_run``: slabs per run; ``inflight``: reads reserved and not published; ``bad``: bool
    [L, E], experts whose pre-read failed (not tried again until :meth:`forget`);
    ``collapsed``: the whole arena was asked onto huge pages (once); ``collapse_at``: bytes of
    the arena asked so far (a collapse paused by an answer resumes there).
    """

    def __init__(self, cache):
        self.cache = cache
        self.wake_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.pass_run = max(1, PASS_READ_BYTES // int(cache.slot_bytes))
        self.holds = 0  # hold() calls not yet released: the pass waits
        self.answers = 0  # answers running (begin_answer): no arena collapse meanwhile
        self.collapsed = False
        self.collapse_at = 0
        self.collapsing = False  # a thread is in collapse_full's loop
        self.collapse_idle = threading.Event()  # set while no thread is
        self.collapse_idle.set()
        self.inflight = 0
        self.bad = np.zeros((cache.L, cache.E), bool)

    def wake(self) -> None:
        self.wake_event.set()

    def start(self) -> bool:
        """Start the thread (with ``cache.fill``; once, after the engine's warm-up and
        pre-warm) and wake it. Returns whether a pre-read thread runs."""
        c = self.cache
        with c.lock:
            if not c.fill or c.closed:
                return False
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="colibri-fill", daemon=True)
                self.thread.start()
        self.wake_event.set()
        return True

    def hold(self) -> None:
        """Pause the pass before its next run until :meth:`release` (calls nest). A first answer
        started at open beside the pass waited 2-9 s on its demand reads (each behind a pass
        read, on a 2-core machine) against 1.3 s with no pass: it reads between answers."""
        with self.cache.lock:
            self.holds += 1

    def release(self) -> None:
        """Undo one :meth:`hold`; the last one wakes the pass."""
        with self.cache.lock:
            self.holds = max(0, self.holds - 1)
            if self.holds == 0:
                self.wake_event.set()

    def begin_answer(self) -> None:
        """An answer starts (calls nest): no collapse onto huge pages until it ends."""
        with self.cache.lock:
            self.answers += 1

    def end_answer(self) -> None:
        """Undo one :meth:`begin_answer`; the last one wakes the pass (which collapses a full arena)."""
        with self.cache.lock:
            self.answers = max(0, self.answers - 1)
            if self.answers == 0:
                self.wake_event.set()

    def forget(self) -> None:
        """Failed experts may be tried again (lock held)."""
        self.bad[:] = False

    def room(self, layer: int) -> tuple[int, np.ndarray]:
        """(free slots a reservation may take under the cap, the absent experts whose pre-read
        has not failed, int64 ids) of ``layer`` (lock held)."""
        t = self.cache.table
        ly = t.layers[layer]
        room = max(0, min(min(ly.cap, ly.target) - ly.live, len(ly.free)))
        return room, np.flatnonzero((t.where[layer] < 0) & ~self.bad[layer])

    def pick(self, skip=()) -> tuple[int, list[int]]:
        """The next run (lock held): (layer, experts ascending, at most ``pass_run`` and the
        layer's room), or (-1, []). Layers in file order, but those in ``skip``; in a layer
        whose free slots hold all its absent experts, those in id order; else the ``room``
        hottest by ``heat`` (ties: the lowest id), read in id order."""
        heat = self.cache.table.heat
        for layer in range(self.cache.table.L):
            if layer in skip:
                continue
            room, absent = self.room(layer)
            if room == 0 or absent.size == 0:
                continue
            if absent.size > room:  # stable: ties keep the lowest ids
                absent = np.sort(absent[np.argsort(-heat[layer, absent], kind="stable")[:room]])
            return layer, [int(e) for e in absent[:min(room, self.pass_run)]]
        return -1, []

    def pending(self, layer: int | None = None) -> int:
        """Experts the pass could still read now (free slots under the cap, summed over the
        layers, each at most the absent experts of its layer that have not failed; once
        ``grow_stopped``, only free slots whose pages are in) plus its reads in flight; 0
        without a running thread. With ``layer``, that MoE layer's alone, plus its slots
        still being read (the pass's or a demand read's)."""
        c = self.cache
        t = c.table
        with c.lock:
            if self.thread is None or not self.thread.is_alive() or c.closed:
                return 0
            n = 0
            for ly in range(t.L) if layer is None else (layer,):
                room, absent = self.room(ly)
                if c.populate.grow_stopped:  # only slots whose pages are in: the budget refuses more
                    room = min(room, int(c.memory.faulted[ly, t.layers[ly].free].sum()))
                n += min(room, absent.size)
            if layer is not None:
                return n + int((t.slot_state[layer] == LOADING).sum())
            return n + self.inflight

    def _loop(self) -> None:
        """The pass: while a layer has a free slot under the cap, wait until no demand read is
        in flight, reserve free slots for the next run of :meth:`pick` and read it (bytes read
        ahead of demand: ``spec_bytes``; ``fill_loads``). Slots whose pages are in go first; a
        slot that is not adds pages only while ``grow_ok`` says yes. Woken by start, forget,
        a raised cap and a freed slot."""
        import os
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        c = self.cache
        t, faulted = c.table, c.memory.faulted
        while True:
            self.wake_event.wait()
            self.wake_event.clear()
            blocked: set[int] = set()  # layers whose free slots would all add pages the budget refuses
            t0, n0, b0 = time.perf_counter(), c.stats.fill_loads, c.stats.spec_bytes
            while True:
                if c.closed:
                    return
                if not c.demand.wait_idle(0.05):
                    continue
                with c.lock:
                    if c.closed:
                        return
                    if self.holds:  # woken again by the last release
                        break
                    if c.demand.inflight > 0:
                        continue
                    layer, run = self.pick(blocked)
                    if layer < 0:
                        break
                    free = t.layers[layer].free  # a reservation takes the top of the free stack:
                    free.sort(key=lambda v: bool(faulted[layer, v]))  # slots whose pages are in go first
                    ready = int(faulted[layer, free].sum())
                grow = allowed = len(run) - ready  # slots whose pages the run would add
                if grow > 0 and not c.populate.may_grow(grow):
                    if grow > 1 and c.populate.may_grow(1):
                        allowed = 1
                    elif ready:
                        allowed = 0
                    else:
                        blocked.add(layer)
                        continue
                    run = run[:ready + allowed]
                try:  # the yes for ``allowed`` slots is held until their pages are in
                    with c.lock:
                        if c.closed:
                            return
                        # the lock was let go for grow_ok: the pick may be stale (a demand read
                        # took an expert or a slot, a lower cap), and a speculation may have
                        # taken a slot whose pages were in
                        free = t.layers[layer].free
                        free.sort(key=lambda v: bool(faulted[layer, v]))
                        top = free[len(free) - len(run):]
                        if (c.demand.inflight > 0 or self.holds or self.room(layer)[0] < len(run)
                                or len(run) - int(faulted[layer, top].sum()) > allowed
                                or any(t.where[layer, e] >= 0 for e in run)):
                            continue
                        slots = [t.reserve(layer, e) for e in run]
                        self.inflight += len(run)
                    self._read(layer, run, slots)
                finally:
                    if allowed > 0:
                        c.populate.grown(allowed)
            n = c.stats.fill_loads - n0
            if n:
                dt = time.perf_counter() - t0
                nb = c.stats.spec_bytes - b0
                log.info("read %d experts (%s) ahead of use in %.2f s (%.2f GB/s)", n, format_bytes(nb), dt,
                         nb / 1e9 / max(dt, 1e-9))
            self.collapse_full()

    def _read(self, layer: int, experts: list[int], slots: list[int]) -> None:
        """Read a run into its reserved slots (one positional read; a store without
        ``read_run`` or a run of one: one read each) and publish each read."""
        c = self.cache
        if getattr(c.store, "read_run", None) is None or len(experts) == 1:
            for e, s in zip(experts, slots):
                res = c.io.read(layer, e, s)
                with c.lock:
                    self._publish(layer, e, s, res)
            return
        res = c.io.read_run(layer, experts, slots)
        with c.lock:
            for e, s, r in zip(experts, slots, res):
                self._publish(layer, e, s, r)

    def _publish(self, layer: int, expert: int, slot: int, res: tuple) -> None:
        self.inflight -= 1
        if res[1] is not None:  # not tried again (until forget)
            self.bad[layer, expert] = True
        self.cache.io.publish(layer, expert, slot, True, True, *res)

    def collapse_full(self) -> None:
        """Once every slot of the arena holds an expert, put the whole arena on huge pages
        (MADV_COLLAPSE, Linux >= 6.1), the blocks two slots share included (the arena's advice
        leaves those on 4 KB pages so that filling a slot never faults its neighbour's pages
        in, which no longer matters once every slot is in): K.experts_q4_t1 1028 us per call
        with the interiors advised, 820-867 us collapsed (OLMoE-1B-7B slabs, 2 threads). Once
        per arena, in steps of ``COLLAPSE_CHUNK`` bytes ending on huge-page boundaries (the
        kernel copies each block it collapses, the GIL released); a kernel without it refuses;
        no value changes and no mapping is added.

        Not while an answer runs or the pass is held (the copying slowed a first answer's
        decode from 36 to 11 tok/s): it does not start then, and one running pauses before its
        next step when an answer begins; the pass calls it when it ends, and the last release
        or end_answer wakes the pass, which resumes where it paused. A caller that filled the
        arena with demand reads (load_experts) may call it itself. Returns when the arena is
        collapsed or the collapse paused, also when another thread's call was running."""
        c = self.cache
        with c.lock:
            if c.closed or c.memory.madvise is None or self.collapsed:
                return
            other = self.collapsing
            if not other:
                if self.holds or self.answers or not (c.table.slot_state == RESIDENT).all():
                    return
                self.collapsing = True
                self.collapse_idle.clear()
            base, total = c.memory.base, c.memory.array.nbytes
        if other:  # another thread's call: return when it stops
            self.collapse_idle.wait()
            return
        try:
            while True:
                with c.lock:
                    at = self.collapse_at
                    if at >= total:
                        self.collapsed = True
                    if self.collapsed or c.closed or self.holds or self.answers:
                        return
                    # the step ends on a huge-page boundary (the kernel collapses only whole aligned
                    # blocks inside a range: a block cut by a step's edge would be skipped)
                    end = (base + at + COLLAPSE_CHUNK) // HUGE_PAGE * HUGE_PAGE - base
                    end = total if end <= at or end >= total else end
                    self.collapse_at = end
                c.memory.madvise(base + at, end - at, MADV_COLLAPSE)  # a refusal leaves the pages as they are
        finally:
            with c.lock:
                self.collapsing = False
                self.collapse_idle.set()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
