"""The expert cache's demand side: the lookups, takes and gives back of the compute thread
(the ExpertProvider calls of engine/models/base.py).

A lookup (:meth:`DemandLookups.prepare_split`, :meth:`DemandLookups.take_split`) counts a hit
or a miss per expert, makes the hits most recent (``take_split``: takes them), reserves slots
for the misses and queues their reads in compute order; a take (:meth:`DemandLookups.acquire`)
waits for its expert's read, or reserves and queues it then, and marks the slot busy until
it is given back. A decode step whose every expert is resident takes them in the one-call
kernel under the lock (:meth:`DemandLookups.take_resident_layers`). Victim choice is a
function of the routing alone: the order of the lookups and takes, never the reads' timing.

``ExpertCache`` derives from :class:`DemandLookups`, which uses of it: ``lock``, ``closed``,
``table`` (engine/cache/slots.py), ``io`` and ``demand`` (engine/cache/io.py), ``spec``
(engine/cache/speculation.py), ``store``, ``cond``, ``slot_waiters``, ``wait_slots`` and
``notify_slots``.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import EngineError, ExpertReadError
from ..kernel_choice import K
from .slots import LOADING, RESIDENT

STALL_TIMEOUT_S = 60.0  # an acquire that cannot get a slot this long is a bug: fail, never hang


class DemandLookups:
    """The demand lookups and takes of :class:`engine.expert_cache.ExpertCache`."""

    def _start_reads(self, layer: int, absent: list[int], loading: list, hold=()) -> None:
        """Queue a lookup's demand reads in compute order (lock held): a speculation not started
        taken over, then a slot reserved for each of ``absent`` while one is found (see
        SlotTable.reserve_absent for ``hold``)."""
        for e, s in loading:
            self.spec.claim_back(layer, e, s, 1)
        for e in absent:
            self.io.errors.pop((layer, e), None)  # a failure of an earlier call is stale
        if absent:
            for e, slot in zip(absent, self.table.reserve_absent(layer, absent, hold)):
                self.demand.submit(layer, e, slot, 1)  # in compute order: the first needed is read first

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
        with self.lock:
            self.spec.drain()
            hits, _, misses, absent, loading = self.table.lookup(layer, experts)
            self._start_reads(layer, absent, loading, hold=experts)
            if misses and hits:  # the hits compute next: their reads must be on the disk by then
                self.demand.hand_off()
        return hits, misses

    def take_split(self, layer: int, experts) -> tuple[list[int], np.ndarray, list[int]]:
        """:meth:`prepare_split` and :meth:`acquire_many` of its hits in one lock round-trip,
        for a decode step whose hits run in one kernel call reading the arena in place.

        ``experts``: distinct ints in the order to look them up (the engine passes ascending
        ids). When all are resident the bookkeeping runs as whole-array operations.
        Returns (hits, slots, misses): the resident experts, already taken until
        :meth:`release_slots`; ``slots`` int64 [len(hits)] their slots in ``layer``
        (:meth:`slot_offsets`); the misses, counted and their reads started as
        :meth:`prepare_split` does, to be taken with :meth:`acquire`. The state ends as after
        prepare_split + acquire_many, except that a hit can no longer be evicted between the
        two calls (a speculation's read could do that before)."""
        ea = np.asarray(experts, np.int64)
        n = len(ea)
        ss = np.empty(n, np.int64)
        pm = np.empty(n, np.bool_)
        t = self.table
        with self.lock:
            self.spec.drain()
            nspec = K.cache_take_resident(t.where[layer], t.slot_state[layer], t.slot_busy[layer],
                                          t.last_use[layer], t.routed_now[layer], t.pinned[layer],
                                          t.slot_spec[layer], ea, t.clock, RESIDENT, ss, pm)
            if nspec >= 0:  # all resident: those arrays are updated, the rest in take_all
                return t.take_all(layer, ea, ss, pm.tolist(), nspec)
            hits, slots, misses, absent, loading = t.lookup(layer, experts, take=True)
            self._start_reads(layer, absent, loading)  # the hits are busy: a miss never evicts one
            if hits and misses:
                self.demand.hand_off()
        return hits, np.asarray(slots, np.int64), misses

    def take_resident_layers(self, run, l0: int = 0, after_run=None) -> int:
        """Run the MoE layers l0.. of a decode step that takes their experts itself (K.
        decode_layers_t1 from layer l0) with the lock held, for as long as each layer's experts
        are resident: no read can publish, no slot be evicted and no demand read start while
        it runs (reads in flight finish their I/O and wait for the lock).

        ``run(where, slot_state, slot_busy, last_use, routed_now, pinned, slot_spec, resident,
        clock)`` gets the table's [L, ...] arrays, the RESIDENT state code and the use clock,
        does cache_take_resident's array half for each layer it runs and gives the slots back,
        and returns (clock after, ea int64 [L, k] each layer's experts in ascending id order, ss
        int64 [L, k] their slots, pm bool [L, k] whether pinned, nspec int64 [L] the taken slots
        still flagged speculative, upto: with a clock >= 0, the layer it stopped before, every
        layer up to it run in full: num_layers, or earlier for PILOT's predictions inside the
        run, K.decode_layers_t1's ``look``); its clock is negative, -1 - l, when layer l found an
        expert not resident (layers l0..l-1 ran, layer l's take did not). Then ``after_run(stop)``
        without the lock, then the rest of layers l0..stop-1's takes in one hold of the lock
        (SlotTable.settle_run), so the caller can take layer ``stop`` by take_split next.

        Returns ``stop``: num_layers when every layer from l0 ran, l when layer l stopped it
        (or the run stopped before it, ``upto``), -1 when nothing ran (the cache is closed)."""
        t = self.table
        with self.lock:
            if self.closed:
                return -1
            self.spec.drain()  # reads that came in during the last run: resident for this one
            clock, ea, ss, pm, nspec, upto = run(t.where, t.slot_state, t.slot_busy, t.last_use,
                                                 t.routed_now, t.pinned, t.slot_spec, RESIDENT, t.clock)
            stop = upto if clock >= 0 else -1 - clock
            # the layers a PILOT worker that waited for the lock through the run must not reserve
            # for (its token's cur_layer moves only in after_run, without the lock): up to stop
            # when stop's experts are taken on demand next, up to stop - 1 when the run stopped
            # before stop for a prediction (upto)
            self.spec.passed = stop if clock < 0 else stop - 1
        if after_run is not None:
            after_run(stop)
        with self.lock:
            self.spec.drain()
            self.table.settle_run(l0, stop, ea, ss, pm, nspec)
            self.notify_slots()
        return stop

    def release_slots(self, layer: int, slots: np.ndarray) -> None:
        """Give back the slots (int64 [n], distinct) :meth:`take_split` took."""
        if not len(slots):
            return
        with self.lock:
            busy = self.table.slot_busy
            busy[layer, slots] -= 1
            if self.slot_waiters and not busy[layer, slots].all():
                self.cond.notify_all()  # a cap reduction may be waiting for one of them

    def slot_offsets(self, layer: int, slots: np.ndarray) -> np.ndarray:
        """Byte offsets int64 [n] in ``arena`` of the slabs in ``slots`` (int [n]) of ``layer``
        (computed in int64: an arena can be larger than 2 GiB)."""
        t = self.table
        return (np.int64(layer) * t.max_cap + np.asarray(slots, np.int64)) * np.int64(t.slot_bytes)

    def acquire(self, layer: int, expert: int) -> dict:
        """Views of the expert's slab, resident and marked busy until ``release``.

        Raises:
            ExpertReadError: its read failed twice.
        """
        t0 = None
        t = self.table
        with self.lock:
            while True:
                self.spec.drain()
                s = t.where[layer, expert]
                if s >= 0 and t.slot_state[layer, s] == RESIDENT:
                    break
                err = self.io.errors.pop((layer, expert), None)
                if err is not None:
                    raise err if isinstance(err, ExpertReadError) else ExpertReadError(str(err))
                if t0 is None:
                    t0 = time.perf_counter()
                if s >= 0:
                    self.spec.claim_back(layer, expert, int(s), 0)
                else:
                    slot = t.reserve_for_take(layer, expert)
                    if slot >= 0:
                        # read by a reader thread, before any other queued read: the compute
                        # thread never reads or verifies a slab itself
                        self.demand.submit(layer, expert, slot, 0)
                        continue
                self.wait_slots()
                if time.perf_counter() - t0 > STALL_TIMEOUT_S:
                    self._stalled(layer, expert)
            if t0 is not None:
                t.stats.felt_wait_s += time.perf_counter() - t0
            return t.take(layer, expert, s)

    def _stalled(self, layer: int, expert: int) -> None:
        """Raise the error of an acquire that waited STALL_TIMEOUT_S (lock held)."""
        t = self.table
        s = t.where[layer, expert]
        if s >= 0 and t.slot_state[layer, s] == LOADING:
            meta = self.store.experts[layer][expert]
            raise ExpertReadError(
                f"{self.store.path / meta['file']}: reading expert {expert} of layer {layer} "
                f"did not finish in {STALL_TIMEOUT_S:.0f} s; the disk is stalled or failing "
                f"(check it, or copy the store to another disk)")
        raise EngineError(
            f"expert {expert} of layer {layer} found no cache slot for {STALL_TIMEOUT_S:.0f} s "
            f"(cap {t.layers[layer].cap}); raise the cap or the RAM budget")

    def acquire_many(self, layer: int, experts: list[int]) -> list[dict]:
        """:meth:`acquire` of each of ``experts`` (ints) in order, in one lock round-trip while
        they are resident (a decode step's hits, just returned by :meth:`prepare_split`); one
        that is not (evicted since, or failed) goes through :meth:`acquire`. Release them with
        :meth:`release_many`. The same state changes, in the same order, as one acquire each.

        Raises:
            ExpertReadError: a read failed twice (the experts acquired before it are released).
        """
        out: list[dict] = []
        t = self.table
        with self.lock:
            for e in experts:
                s = t.where[layer, e]
                if s < 0 or t.slot_state[layer, s] != RESIDENT:
                    break
                out.append(t.take(layer, e, s))
        try:
            for e in experts[len(out):]:
                out.append(self.acquire(layer, e))
        except BaseException:
            self.release_many(layer, experts[:len(out)])
            raise
        return out

    def release(self, layer: int, expert: int) -> None:
        with self.lock:
            if self.table.give_back(layer, expert):
                self.notify_slots()  # a cap reduction may be waiting for this slot

    def release_many(self, layer: int, experts: list[int]) -> None:
        """:meth:`release` of each of ``experts`` in one lock round-trip."""
        with self.lock:
            for e in experts:
                if self.table.give_back(layer, e):
                    self.notify_slots()

    def load_experts(self, layer: int, experts) -> None:
        """Make ``experts`` of ``layer`` resident now (pre-warm, "all resident" benchmarks): one
        prepare/acquire/release pass whose lookups are not counted as demand hits or misses.

        Raises:
            ExpertReadError: a read failed twice.
        """
        st = self.table.stats
        hits, misses, pinned_hits = st.hits, st.misses, st.pinned_hits
        for e in self.prepare(layer, experts):
            self.acquire(layer, int(e))
            self.release(layer, int(e))
        with self.lock:
            st.hits, st.misses, st.pinned_hits = hits, misses, pinned_hits
