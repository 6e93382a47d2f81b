"""RAM measurements and the measured-RSS guard (the sizing rule itself is engine/sizing.py).

The automatic budget is RSS after the dense weights are loaded + 0.88 x available memory
(psutil, cut to the cgroup's limit and headroom inside a container: sysinfo.memory); an unmeasurable or implausible probe (0, or < 2% of physical RAM) falls back to
half of physical RAM (8 GB if that is unknown) with one warning (colibri #1500 / #1601).
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)

GB = 1_000_000_000
# Room the cache's background growth (reservation, populate-ahead, idle fill: ExpertCache
# grow_ok) leaves free under the budget for the next forward's activations and scratch (a
# 512-token prefill of OLMoE-1B-7B's shape allocates ~50 MB for a moment), so a reservation
# does not end right at a limit the next forward then crosses (docs/decisions/0003-runtime-reserve.md).
GROWTH_HEADROOM_BYTES = 64_000_000
RESERVE_BYTES = 200_000_000  # Python + numpy + numba runtime, activations, logits: RSS - dense - KV - cache
# measured 172-183 MB after a 24-token answer once the compiler's memory is given back
# (release_compiler_memory; docs/decisions/0003-runtime-reserve.md)
AVAILABLE_SHARE = 0.88
FALLBACK_BYTES = 8 * GB


_PROC = None


def current_rss() -> int:
    """Resident set size of this process in bytes (psutil)."""
    global _PROC
    if _PROC is None:
        import psutil
        _PROC = psutil.Process()
    return int(_PROC.memory_info().rss)


MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim a range's pages now (file pages dropped, re-read on use)
COMPILER_LIBRARIES = ("libllvmlite",)  # numba's LLVM: needed to compile or load kernels, not to run them


def release_compiler_memory() -> int:
    """Give back the memory that compiling or loading the compute kernels left behind, once
    they are loaded: the pages of LLVM's shared library (llvmlite's, ~70 MB resident after
    numba loads its cached kernels, file-backed and clean: MADV_PAGEOUT drops them, and a later
    compile reads them again from disk) and the C heap's free tail (glibc ``malloc_trim``).
    Those bytes are otherwise counted as the process's own (RSS) for as long as it runs, and
    the RSS guard takes them from the expert cache. Values never change; a kernel compiled
    later only pays a few ms of page faults. Linux only (a no-op elsewhere, or on kernels
    without MADV_PAGEOUT, which refuse it with EINVAL).

    Returns the RSS released in bytes (before - after, 0 if nothing was or it grew).
    Source: madvise(2) MADV_PAGEOUT; mallopt(3)/malloc_trim(3)."""
    import sys
    if not sys.platform.startswith("linux"):
        return 0
    from .cache.arena import _populate_call  # libc's madvise through ctypes (the GIL released)
    madvise = _populate_call()
    if madvise is None:
        return 0
    before = current_rss()
    try:
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return 0
    for line in maps:
        parts = line.split(None, 5)
        if len(parts) < 6 or not any(n in parts[5].rsplit("/", 1)[-1] for n in COMPILER_LIBRARIES):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        madvise(lo, hi - lo, MADV_PAGEOUT)  # a refusal (old kernel) leaves the pages: nothing to undo
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (ImportError, OSError, AttributeError):  # not glibc (musl): its allocator returns memory itself
        pass
    return max(0, before - current_rss())


def probe_available() -> tuple[int, bool]:
    """(bytes the OS can still give us, whether the probe was trusted). Inside a cgroup
    (container, systemd slice) the limit's headroom counts, not the host's free memory."""
    try:
        from .sysinfo import memory
        total, avail = memory()
    except Exception as e:  # noqa: BLE001
        log.warning("cannot measure available memory (%s); assuming %.1f GB", e, FALLBACK_BYTES / GB)
        return FALLBACK_BYTES, False
    if total <= 0:
        log.warning("physical memory unknown; assuming %.1f GB available", FALLBACK_BYTES / GB)
        return FALLBACK_BYTES, False
    if avail <= 0 or avail < 0.02 * total:
        log.warning("available-memory probe returned %d bytes of %d; assuming half of physical RAM",
                    avail, total)
        return total // 2, False
    return avail, True


def per_layer(slots: int, layers: int) -> str:
    """"10" or "9-10": the slots each layer holds when ``slots`` are spread over ``layers``."""
    lo, extra = divmod(slots, max(1, layers))
    return f"{lo}-{lo + 1}" if extra else f"{lo}"


class RssGuard:
    """Compare measured RSS with the budget after every token and whenever the cache has
    loaded experts since the last look (the engine calls ``poll`` at every layer, so a
    prefill that fills the cache is caught within one layer, not 16 tokens later); above
    the budget, lower the cache's slots (all layers together) to what fits when every slot
    is full, (budget - (RSS - cache bytes)) // slot bytes, at least one per layer and at
    least one below the old count, evicting the excess (ExpertCache.set_slots: the layers
    keep cap or cap - 1 slots). Counted in single slots, an overrun of a few MB costs a few
    slots, not one in every layer (a 7B int4 model at 4 GB lost 16 x 3.5 MB for a 7 MB
    overrun, and its cap fell 61 -> 59). The lowered count holds (colibri #1034: no regrowth).

    Lowering the cap unpins first: at most ``pins_for_cap(new_cap)`` (default new_cap - 1)
    experts per layer stay pinned, so a lowered cap always leaves a slot for misses (a cap
    equal to the pin count deadlocked every miss for 60 s).

    Args:
        cache: the ExpertCache. budget: bytes. every: tokens between ``step`` looks.
        read_rss: () -> bytes, injectable for tests. pins_for_cap: cap -> pins per layer.

    Attributes: fired (times the cap was lowered), peak (highest RSS seen, bytes),
    trail (list of (token_index or None, rss bytes, old cap, new cap) per action).
    """

    def __init__(self, cache, budget: int, every: int = 1,
                 read_rss: Callable[[], int] = current_rss,
                 pins_for_cap: Callable[[int], int] | None = None):
        self.cache, self.budget, self.every, self.read_rss = cache, budget, every, read_rss
        self.pins_for_cap = pins_for_cap
        self.fired = 0
        self.peak = 0
        self.trail: list[tuple[int | None, int, int, int]] = []
        self.last_message = ""
        self._loads_seen = -1
        self.floor_warned = False  # the "cannot be held" message was given
        self.last_rss: int | None = None  # the RSS of the last check that left the cache as it was

    def step(self, token_index: int) -> str | None:
        """Call at a safe point after each token. Returns a log line when it fired.
        ``last_rss`` is then the RSS it measured (bytes), or None when it did not measure or
        lowered the cap."""
        self.last_rss = None
        if token_index % self.every:
            return None
        return self._check(token_index)

    def make_room(self, nbytes: int) -> str | None:
        """Call at a safe point before the process grows by ``nbytes`` it can foresee (the KV
        cache's next positions, whose pages are mapped as they are written): when RSS + nbytes
        is over the budget, the slots are lowered as for an overrun, with those bytes counted
        as already there. Returns a log line when it fired."""
        if nbytes <= 0:
            return None
        return self._check(None, int(nbytes))

    def hold_room(self, nbytes: int) -> int:
        """Call at a safe point before the process holds ``nbytes`` more while the cache may
        still fill (a forward's activations, which live until it returns while its layers read
        experts into free slots): the slots are lowered so that the RSS outside the cache +
        ``nbytes`` + every slot full stays within the budget (at least one per layer). Unlike
        :meth:`make_room` it counts the slots not yet filled: a prefill fills them while its
        buffers are held. Returns the slots given back (0: none), for the caller to return
        once the bytes are freed."""
        c = self.cache
        if nbytes <= 0:
            return 0
        outside = self.read_rss() - c.resident_bytes()
        fit = max(c.L, (self.budget - outside - int(nbytes)) // c.slot_bytes)
        old = c.slots
        if fit >= old:
            return 0
        new_cap = -(-fit // c.L)
        n = c.set_slots(fit, self.pins_for_cap(new_cap) if self.pins_for_cap else None)
        self.trail.append((None, outside + c.resident_bytes(), None, c.cap, old, c.slots))
        log.info("%.1f MB of activations for a forward beside the cache: expert slots %d -> %d while it runs, "
                 "%d cached expert%s evicted", nbytes / 1e6, old, c.slots, n, "" if n == 1 else "s")
        return old - c.slots

    def poll(self) -> str | None:
        """Call at a safe point (no expert acquired, e.g. a layer start): looks only if the
        cache loaded something since the last look. Returns a log line when it fired."""
        if self.cache.stats.loads == self._loads_seen:
            return None
        return self._check(None)

    def _check(self, token_index: int | None, extra: int = 0) -> str | None:
        c = self.cache
        self._loads_seen = c.stats.loads
        rss = self.read_rss()
        self.peak = max(self.peak, rss)
        self.last_rss = rss
        if rss + extra <= self.budget:
            return None
        self.last_rss = None  # the cap may drop below: a later reader measures again
        # The slots that fit if every slot fills up (a prefill fills the layers one after the
        # other): what the budget leaves beside the RSS that is not cache (and the growth to
        # come, ``extra``), in single slots.
        outside = rss + extra - c.resident_bytes()
        fit = (self.budget - outside) // c.slot_bytes
        old, old_cap = c.slots, c.cap
        new = int(max(c.L, min(old - 1, fit)))
        if new == old:  # one slot per layer already: the budget cannot be held; said once
            if not self.floor_warned:
                self.floor_warned = True
                self.last_message = (
                    f"RSS {(rss + extra) / 1e6:,.0f} MB{' with the KV cache of the context' if extra else ''} is over the "
                    f"{self.budget / 1e6:,.0f} MB RAM budget with one expert slot "
                    f"per layer: this budget cannot be held; raise it to at least {(outside + c.L * c.slot_bytes) / 1e6:,.0f} MB "
                    f"for one slot per layer, more for speed")
                log.warning(self.last_message)
                return self.last_message
            return None
        new_cap = -(-new // c.L)
        n = c.set_slots(new, self.pins_for_cap(new_cap) if self.pins_for_cap else None)
        self.fired += 1
        self.trail.append((token_index, rss, old_cap, c.cap, old, c.slots))
        grows = f" with {extra / 1e6:,.1f} MB more KV cache for the context" if extra else ""
        self.last_message = (f"RSS {rss / 1e6:,.0f} MB{grows} over the {self.budget / 1e6:,.0f} MB RAM budget: expert slots "
                             f"{old} -> {c.slots} ({per_layer(old, c.L)} -> {per_layer(c.slots, c.L)} per layer), "
                             f"{n} cached expert{'' if n == 1 else 's'} evicted")
        # a context growing into the room the cache had is the plan (sizing.KV_OPEN_TOKENS), not a fault
        (log.info if extra else log.warning)(self.last_message)
        return self.last_message
