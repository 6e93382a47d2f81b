"""The expert cache's populate-ahead thread and the budget's say over background growth.

A read into never-touched memory pays the page faults and the zeroing on the reader's path
(10.5 ms per 6.3 MB O_DIRECT slab read into fresh memory against 6.0 ms into touched memory,
the fault-in alone 3.7 ms, on a VM with 4 KB pages). So a low-priority thread faults in the
pages of the free slots a reservation takes next, ``ahead`` per layer, before a read needs
them (``Arena.populate``: MADV_POPULATE_WRITE, contents untouched): the RSS grows with use,
not to the whole arena at open. With ``reserve`` (the setting ``reserve_cache``) it does every
slot under the cap, in the background from open, so no read after the first seconds pays the
faults, which cost most where the host takes freed guest memory back
(docs/decisions/0008-reserve-cache.md).

Background growth (this thread, and the pre-read into slots not faulted in) asks the engine
first (``grow_ok``: RSS + the bytes within the RAM budget); a no to one slot stops it
(``grow_stopped``) until the cap is set again or the cache is forgotten. Demand reads never
ask: the RSS guard lowers the cap for those (engine/ram_budget.py). Why: the cap is planned
from the dense bytes and a fixed runtime reserve, while the process's real runtime can be
more; a reservation that faulted in every slot at once pushed a 7B int4 store's RSS to 4.03 GB
at a 4.0 GB budget before any token, and a 4 GB memory cgroup OOM-killed the process.

Works for an owner ``cache`` (engine.expert_cache.ExpertCache) and uses of it: ``lock``,
``closed``, ``table``, ``memory``, ``slot_bytes``, ``fill`` and ``preread``.
"""

from __future__ import annotations

import threading

from .slots import FREE


class PopulateAhead:
    """The populate thread (started with :meth:`start`, where the arena can populate) and the
    growth gate.

    Args:
        cache: the owner.
        ahead: free slots per layer to fault in ahead of reads (the cap with ``reserve``).
        grow_ok: ``(nbytes) -> bool`` or None (growth bounded by the cap only).
    """

    def __init__(self, cache, ahead: int, grow_ok=None):
        self.cache = cache
        self.ahead = ahead
        self.grow_ok = grow_ok
        self.grow_stopped = False  # grow_ok said no: populate and the pre-read pause
        self._grow_gen = 0  # bumped with each reset of grow_stopped (a "no" from before it is stale)
        # bytes a yes was given for whose pages are not in yet: two growers (this thread and the
        # pre-read) asking at once were both told yes for the last slot the budget had room for
        self.growing = 0
        self._grow_lock = threading.Lock()
        self.wake_event = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="colibri-populate", daemon=True)
        self.thread.start()
        self.wake_event.set()

    def wake(self) -> None:
        self.wake_event.set()

    def may_grow(self, nslots: int = 1) -> bool:
        """Whether a background thread may add ``nslots`` slots' pages now (``grow_ok``, asked
        with the bytes of earlier yeses still growing); a yes holds those bytes until the caller
        gives them back with :meth:`grown` (once the pages are in, or the growth is dropped). A
        no to one slot sets ``grow_stopped`` (a no to more leaves the question of fewer open).
        Lock not held (grow_ok reads the RSS)."""
        if self.grow_stopped:
            return False
        gen = self._grow_gen
        nbytes = int(self.cache.slot_bytes) * int(nslots)
        with self._grow_lock:  # one question at a time: each sees the others' yeses
            if self.grow_ok is None or self.grow_ok(nbytes + self.growing):
                self.growing += nbytes
                return True
        if nslots > 1:
            return False
        with self.cache.lock:
            if self._grow_gen == gen:  # not reset (set_cap, forget) while grow_ok read the RSS
                self.grow_stopped = True
        return False

    def grown(self, nslots: int = 1) -> None:
        """Give back what :meth:`may_grow` held for ``nslots`` slots (their pages are in the RSS
        now, or the growth did not happen)."""
        with self._grow_lock:
            self.growing = max(0, self.growing - int(self.cache.slot_bytes) * int(nslots))

    def allow_growth(self) -> None:
        """A new cap or a fresh start (lock held): background growth may ask again."""
        self.grow_stopped = False
        self._grow_gen += 1

    def wanted(self, layer: int) -> list[int]:
        """Free slots of ``layer`` a reservation takes next (the top of the free stack, as many
        as the cap leaves room for, at most ``ahead``) whose pages are not in yet (lock held),
        the next one first."""
        ahead = self.cache.table.room(layer)[-self.ahead:] if self.ahead > 0 else []
        return [v for v in reversed(ahead) if not self.cache.memory.faulted[layer, v]]

    def pending(self) -> int:
        """Bytes of free slots under the cap still to fault in (0 once done, and 0 without a
        running thread: off Linux, a kernel without MADV_POPULATE_WRITE, after an error)."""
        c = self.cache
        with c.lock:
            if self.thread is None or not self.thread.is_alive() or c.closed or self.grow_stopped:
                return 0
            return sum(len(self.wanted(layer)) for layer in range(c.table.L)) * int(c.slot_bytes)

    def _loop(self) -> None:
        """Nice 19 where the OS has per-thread priorities (Linux), so it takes a core only when
        compute and reads leave one idle. Racing a read into the same slot is harmless (the
        contents are never touched); a slot the cap no longer leaves room for when its
        populate ends is given back at once. A kernel without MADV_POPULATE_WRITE stops it."""
        import os
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        c = self.cache
        t, mem = c.table, c.memory
        while True:
            self.wake_event.wait()
            self.wake_event.clear()
            with c.lock:
                if c.closed:
                    return
                # round robin over the layers (each layer's next slot first): a decode that
                # starts before a long reservation ends finds every layer's next slots faulted
                want = [self.wanted(layer) for layer in range(t.L)]
                todo = [(layer, w[i]) for i in range(max(map(len, want), default=0))
                        for layer, w in enumerate(want) if i < len(w)]
            for layer, v in todo:
                if c.closed:
                    return
                with c.lock:  # the list may be stale (a load took the slot, a lower cap): skip those
                    if t.slot_state[layer, v] != FREE or mem.faulted[layer, v] or v not in t.room(layer):
                        continue
                if not self.may_grow():
                    break
                try:
                    ok, again = mem.populate(layer, v)  # again: EINTR / EAGAIN, at the next wake
                    with c.lock:
                        if ok:
                            mem.faulted[layer, v] = True
                            if c.fill:  # a pre-read the budget paused can use these pages now
                                c.preread.wake()
                        if t.slot_state[layer, v] == FREE and not (ok and v in t.room(layer)):
                            # the cap shrank meanwhile, or the populate failed part way (ENOMEM,
                            # EINTR) with pages in that nothing tracks: given back now
                            mem.release(layer, v)
                finally:
                    self.grown()
                if again:
                    break
                if not ok:
                    return  # EINVAL (a kernel before 5.14), ENOMEM: reads fault their pages as before

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
