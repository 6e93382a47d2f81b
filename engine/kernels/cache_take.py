"""The expert cache's per-layer bookkeeping for a decode step whose experts are all resident,
as one kernel (the decode step calls it between layers)."""

from __future__ import annotations

from numba import njit

from .setup import _KW


# --- expert cache bookkeeping ------------------------------------------------------------

@njit(nogil=True, cache=_KW["cache"])
def cache_take_resident(where, state, busy, last_use, routed_now, pinned, spec, ea, clock, resident, ss, pm):
    """The array half of ExpertCache.take_split for one layer when every expert is resident
    (engine/expert_cache.py, lock held): one call instead of ~10 numpy operations per MoE
    layer of a decode step.

    where int32 [E] (slot of each expert, -1 none), state int8 [S] (slot states), busy int32
    [S], last_use int64 [E], routed_now bool [E], pinned bool [E], spec bool [S] (a layer's
    rows of the cache's arrays); ea int64 [n] distinct experts in lookup order; clock the use
    clock before the call; resident the RESIDENT state code; ss int64 [n] and pm bool [n]
    outputs (each expert's slot and whether it is pinned).

    Returns -1 and changes nothing when an expert is not resident, out of range or repeated
    (take_split's Python loop then handles it as before); else the number of the
    taken slots still flagged speculative, after: routed_now = exactly ea, busy[ss] += 1,
    last_use[ea[i]] = clock + 1 + i (the use clock advanced by n)."""
    n = ea.shape[0]
    E = where.shape[0]
    for i in range(n):
        e = ea[i]
        if e < 0 or e >= E:  # no bounds checks in numba: the Python loop raises for it
            return -1
        for k in range(i):
            if ea[k] == e:  # a repeated expert: the Python loop's semantics
                return -1
        s = where[e]
        if s < 0 or state[s] != resident:
            return -1
        ss[i] = s
    routed_now[:] = False
    nspec = 0
    for i in range(n):
        e = ea[i]
        s = ss[i]
        routed_now[e] = True
        pm[i] = pinned[e]
        busy[s] += 1
        last_use[e] = clock + 1 + i
        if spec[s]:
            nspec += 1
    return nspec
