"""Microbenchmark of the decode step's expert kernel on an arena with 4 KB pages vs one advised
for transparent huge pages (MADV_HUGEPAGE) whole or slab by slab as the cache does (and that one
collapsed whole once filled, MADV_COLLAPSE, as the cache does once every slot is in), arms interleaved, best of 5 x 200 calls per arm and
round, in us per call.

    python tools/micro_arena.py [--hidden 2048] [--inter 1024] [--experts 64] [--rounds 3]

A synthetic arena of ``experts`` int4 SwiGLU slabs (interleaved layout, OLMoE-1B-7B's shapes by
default: 3.5 MB each, 226 MB in all, more than any CPU cache) is read by K.experts_q4_t1 for 8
experts a call, 16 fixed random sets cycled, so every call streams its 28 MB from memory. The
values are the same in both arms (the same bytes); only the page size differs.
"""
import argparse
import mmap
import time

import numba
import numpy as np

from engine import kernels as K
from engine.cache.arena import MADV_COLLAPSE, _advise_huge_interiors, _populate_call


def arena(nbytes: int, how: str, slab: int) -> np.ndarray:
    """4k: plain pages; huge: the whole map advised; slots: each slab's interior advised, as the
    engine's ExpertCache does (engine.cache.arena._advise_huge_interiors)."""
    size = -(-nbytes // (2 << 20)) * (2 << 20)
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8, count=nbytes)
    if how == "huge":
        m.madvise(mmap.MADV_HUGEPAGE)
    elif how in ("slots", "collapsed"):
        _advise_huge_interiors(m, a.ctypes.data, slab, nbytes // slab)
    return a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    D, I, n, gs = a.hidden, a.inter, 8, 32
    sizes = [I * D // 2, 2 * I * D // gs, I * D // 2, 2 * I * D // gs, D * I // 2, 2 * D * I // gs]
    slab = sum(sizes)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 255, slab * a.experts, dtype=np.uint8)
    for e in range(a.experts):  # scales: small finite halves
        o = e * slab
        for k, sz in enumerate(sizes):
            if k % 2:
                src[o:o + sz].view(np.uint16)[:] = np.float16(0.01).view(np.uint16)
            o += sz
    arms = {how: arena(len(src), how, slab) for how in ("4k", "huge", "slots", "collapsed")}
    for k, ar in arms.items():
        ar[:] = src
        if k == "collapsed":
            import time as _t
            t0 = _t.perf_counter()
            r = _populate_call()(ar.ctypes.data - ar.ctypes.data % 4096, len(src) + ar.ctypes.data % 4096, MADV_COLLAPSE)
            print(f"MADV_COLLAPSE -> {r} in {(_t.perf_counter() - t0) * 1e3:.0f} ms")
    fields = np.cumsum([0] + sizes[:-1]).astype(np.int64)
    x = rng.standard_normal((1, D)).astype(np.float32)
    h = np.empty((n, I), np.float32)
    out = {k: np.empty((n, D), np.float32) for k in arms}
    sets = [(np.sort(rng.choice(a.experts, n, replace=False)).astype(np.int64) * slab)[:, None] + fields[None, :]
            for _ in range(16)]
    numba.set_num_threads(a.threads)
    for k, ar in arms.items():
        K.experts_q4_t1(x, ar, sets[0], I, gs, h, out[k], True)
    assert all(np.array_equal(out["4k"], v) for v in out.values())
    best = {k: [] for k in arms}
    for _ in range(a.rounds):
        for k, ar in arms.items():
            b = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for i in range(200):
                    K.experts_q4_t1(x, ar, sets[i % 16], I, gs, h, out[k], True)
                b = min(b, (time.perf_counter() - t) / 200)
            best[k].append(b * 1e6)
    gb = n * slab / 1e9
    for k, v in best.items():
        print(f"{k:5s} us/call by round: {' '.join(f'{u:.0f}' for u in v)}   best {min(v):.0f} us = {gb / min(v) * 1e6:.1f} GB/s")
    for k in ("huge", "slots", "collapsed"):
        print(f"{k} / 4k time, best: {min(best[k]) / min(best['4k']):.3f}, "
              f"median of rounds: {np.median(best[k]) / np.median(best['4k']):.3f}")


if __name__ == "__main__":
    main()
