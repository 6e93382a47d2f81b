"""The expert cache's arena: every slot of every layer in one private anonymous mapping.

Page aligned (so O_DIRECT-ready); slot interiors advised as transparent huge pages where the
platform allows; a slot's pages faulted in ahead of a read (MADV_POPULATE_WRITE) and given back
to the OS when the slot leaves the cap (MADV_DONTNEED). No threads and no locks here: the cache
decides which slot to populate or release, under its lock.

Private, not Python's default shared mapping: a shared anonymous mapping is shmem, where
MADV_DONTNEED only unmaps (the RSS falls, the memory stays allocated) and every first touch of
a page costs a shmem allocation (measured: 17% of a streaming run's CPU).
"""

from __future__ import annotations

import errno
import mmap

import numpy as np

MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault in writable pages of a range, data untouched
MADV_COLLAPSE = 25  # Linux >= 6.1: put a range's pages on huge pages now, data untouched
HUGE_PAGE = 2 << 20  # bytes: the transparent huge page of x86-64 and arm64 (4 KB granule)


def _populate_call():
    """libc ``madvise`` through ctypes (which releases the GIL for the call: Python's
    ``mmap.madvise`` holds it, and a 6 MB populate takes milliseconds), or None off Linux
    or without ctypes (a Python built without libffi)."""
    import sys
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        f = ctypes.CDLL(None, use_errno=True).madvise  # the process's own libc (no ldconfig run)
    except (ImportError, OSError, AttributeError):
        return None
    f.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    f.restype = ctypes.c_int
    return f


def _errno() -> int:
    import ctypes
    return ctypes.get_errno()


def _mapping_room() -> int | None:
    """Memory mappings this process may still create: vm.max_map_count (65530 by default) minus
    the mappings it has (the lines of /proc/self/maps); None where /proc does not tell."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return limit - used


def _advise_huge_interiors(mm: mmap.mmap, base: int, slot_bytes: int, nslots: int, mapping_room=None) -> int:
    """Advise the transparent huge pages (MADV_HUGEPAGE, Linux) of each slot's interior: the
    whole HUGE_PAGE-aligned blocks inside slot i = [i * slot_bytes, (i + 1) * slot_bytes) of the
    map ``mm``, whose first byte is at address ``base``. Only interiors, never a block two slots
    share: a page of a slot the cache has not filled is never faulted in by its neighbour's
    read (the RSS stays the pages the cache knows, tests/test_cache.py), and giving a slot back
    (MADV_DONTNEED) frees its huge pages whole.

    Each advised interior becomes a memory mapping of its own, with one unadvised mapping
    between two of them: up to 2 per slot, against the process's limit (vm.max_map_count; at
    the limit an mmap, a thread stack or a numpy allocation fails). So nothing is advised
    unless those mappings take at most half of the room left (``mapping_room()``, default
    :func:`_mapping_room`); a madvise that still fails stops the advice there. Returns the bytes
    advised: 0 where the platform has no MADV_HUGEPAGE or /proc does not tell the room, slots
    are smaller than one huge page, the room is short, or the kernel refuses (THP compiled out).

    Why: the decode kernels stream every routed expert's slab from the arena once per token;
    with 4 KB pages a 3.5 MB slab is ~900 TLB misses, each a two-level page walk in a VM.
    Measured (tools/micro_arena.py, OLMoE-1B-7B slabs, 8 of 64 experts per call, 2 threads,
    this VM): K.experts_q4_t1 870-1196 us per call on 4 KB pages, 807-886 us on huge pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or slot_bytes < HUGE_PAGE or nslots < 1:
        return 0
    spans = []
    for i in range(nslots):
        lo = -(-(base + i * slot_bytes) // HUGE_PAGE) * HUGE_PAGE - base  # offsets in mm
        hi = (base + (i + 1) * slot_bytes) // HUGE_PAGE * HUGE_PAGE - base
        if hi > lo:
            spans.append((lo, hi))
    room = (mapping_room or _mapping_room)()
    if room is None or 2 * len(spans) > room // 2:
        return 0
    done = 0
    for lo, hi in spans:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, lo, hi - lo)
        except OSError:
            return done
        done += hi - lo
    return done


def _advise_huge_whole(mm: mmap.mmap, slot_bytes: int) -> int:
    """Advise the whole map ``mm`` as transparent huge pages (one mapping, no split), for an
    arena every slot of which will be filled (a cap of every expert, or the pre-read filling
    the cap), so the blocks two slots share are faulted in on huge pages too, at the fill,
    instead of waiting for a collapse (MADV_COLLAPSE) the first answer would run without. A
    slot's read may then fault in the head of its neighbour (at most one huge page per slot
    boundary, inside the arena the plan counted whole); giving a slot back splits the huge
    pages it shares and frees its own. Returns the bytes advised (0 where the platform or the
    kernel refuses, or slots are under one huge page).

    Measured (tools/micro_arena.py, OLMoE-1B-7B slabs, 2 threads, this VM): K.experts_q4_t1
    1011 us per call with the interiors advised, 917 us with the whole map advised, 931 us
    collapsed."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or slot_bytes < HUGE_PAGE or len(mm) == 0:
        return 0
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return 0
    return len(mm)


def _anonymous_map(n: int) -> mmap.mmap:
    """n bytes of zeroed, page-aligned private anonymous memory (MAP_PRIVATE | MAP_ANONYMOUS
    where the platform has them; Windows' mmap(-1) is private pagefile-backed memory already)."""
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
        return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, n)


class Arena:
    """``num_layers`` x ``width`` slots of ``slot_bytes`` each, slot (layer, s) at byte
    ``(layer * width + s) * slot_bytes``.

    Args:
        whole: every slot will be filled (the cap holds every expert): the whole map is advised
            as huge pages (:func:`_advise_huge_whole`), else each slot's interior.
        mapping_room: ``() -> int | None``, the mappings the process may still create
            (default :func:`_mapping_room`); the huge-page advice stays within half of it.
        madvise: libc ``madvise`` (:func:`_populate_call`) or None: without it no slot can be
            populated ahead (:meth:`populate` is not to be called).

    ``array``: uint8 [L x width x slot_bytes] over the mapping (the kernels read slabs from it);
    ``faulted``: bool [L, width], the slots whose pages are known present (kept by the cache).
    """

    def __init__(self, num_layers: int, width: int, slot_bytes: int, mapping_room=None, madvise=None,
                 whole: bool = False):
        self.width = int(width)
        self.slot_bytes = int(slot_bytes)
        self.mm = _anonymous_map(num_layers * width * slot_bytes)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.base = self.array.ctypes.data  # the address of byte 0
        self.huge_bytes = (_advise_huge_whole(self.mm, slot_bytes) if whole else
                           _advise_huge_interiors(self.mm, self.base, slot_bytes, num_layers * width, mapping_room))
        self.faulted = np.zeros((num_layers, width), bool)
        self.madvise = madvise

    def offset(self, layer: int, slot: int) -> int:
        """Byte offset of (layer, slot), as a Python int: slot ids often come from int32 index
        arrays, and an int32 product wraps past 2 GiB (numpy 2 keeps the int32 type), which
        pointed slots of a > 2 GiB arena into other slots."""
        return (int(layer) * self.width + int(slot)) * self.slot_bytes

    def buf(self, layer: int, slot: int) -> np.ndarray:
        """The slot's bytes: uint8 [slot_bytes], a view."""
        off = self.offset(layer, slot)
        return self.array[off:off + self.slot_bytes]

    def release(self, layer: int, slot: int) -> None:
        """Give the slot's pages back to the OS (their contents become zeros)."""
        self.faulted[layer, slot] = False
        try:
            self.mm.madvise(mmap.MADV_DONTNEED, self.offset(layer, slot), self.slot_bytes)
        except (AttributeError, OSError, ValueError):
            pass

    def populate(self, layer: int, slot: int) -> tuple[bool, bool]:
        """Fault in the slot's pages, contents untouched (MADV_POPULATE_WRITE; the GIL released).
        Returns (ok, again): again when it failed for a passing reason (EINTR, EAGAIN). Does not
        mark the slot faulted: the caller does, under its lock."""
        ok = self.madvise(self.base + self.offset(layer, slot), self.slot_bytes,
                          MADV_POPULATE_WRITE) == 0
        return ok, (not ok and _errno() in (errno.EINTR, errno.EAGAIN))
