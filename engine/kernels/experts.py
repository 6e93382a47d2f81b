"""Expert FFNs out[T, D] = down(silu(gate(x)) * up(x)): one expert per call, a decode step's
K routed experts in one call from the expert cache's arena, a prefill chunk's experts sorted by
expert, and the rank-ordered combine of their outputs."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .setup import _KW
from .tiles import (_dot_f16, _dot_f32, _exp32, _q4_finish, _q4_out, _q4_prep_portable,
                    _q4_prep_simd, _q4_prepare, _q4_rows, _q4_shift, _Q4_SIMD, _q4_tile_1x1,
                    _q8_finish, _q8_out, _q8_prepare, _q8_rows, _q8_tile_1x1, RB, _sadd, _sdiv,
                    _smul)
from .linears import IL, _q4i_rows


# --- expert FFN: out[T, D] = down(silu(gate(x)) * up(x)) -----------------------------------


@njit(inline="always", **_KW)
def _silu_mul(g, u):
    return _smul(_sdiv(g, _sadd(np.float32(1.0), _exp32(-g))), u)


@njit(parallel=True, **_KW)
def expert_f32(x, gw, uw, dw, h, out):
    for i in prange(gw.shape[0]):
        for t in range(x.shape[0]):
            h[t, i] = _silu_mul(_dot_f32(x[t], gw[i]), _dot_f32(x[t], uw[i]))
    for o in prange(dw.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _dot_f32(h[t], dw[o])


@njit(parallel=True, **_KW)
def expert_f16(x, gw, uw, dw, lut, h, out):
    for i in prange(gw.shape[0]):
        for t in range(x.shape[0]):
            h[t, i] = _silu_mul(_dot_f16(x[t], gw[i], lut), _dot_f16(x[t], uw[i], lut))
    for o in prange(dw.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _dot_f16(h[t], dw[o], lut)


@njit(parallel=True, **_KW)
def expert_q8(x, gw, gs, uw, us, dw, ds, h, out):
    P = _q8_prepare(x)
    T, I, D = x.shape[0], gw.shape[0], dw.shape[0]
    if P[0]:
        nb = (I + RB - 1) // RB
        scg = np.empty((nb, RB, T), np.float32)  # one allocation per call, not one per block
        scu = np.empty((nb, RB, T), np.float32)
        for ib in prange(nb):
            i0 = ib * RB
            rg = scg[ib]
            ru = scu[ib]
            _q8_rows(P, gw, gs, i0, rg)
            _q8_rows(P, uw, us, i0, ru)
            for r in range(min(RB, I - i0)):
                for t in range(T):
                    h[t, i0 + r] = _silu_mul(rg[r, t], ru[r, t])
    else:
        for i in prange(I):
            for t in range(T):
                h[t, i] = _silu_mul(_q8_out(P, gw, gs, i, t), _q8_out(P, uw, us, i, t))
    Q = _q8_prepare(h)
    if Q[0]:
        nb = (D + RB - 1) // RB
        scd = np.empty((nb, RB, T), np.float32)
        for ob in prange(nb):
            o0 = ob * RB
            res = scd[ob]
            _q8_rows(Q, dw, ds, o0, res)
            for r in range(min(RB, D - o0)):
                for t in range(T):
                    out[t, o0 + r] = res[r, t]
    else:
        for o in prange(D):
            for t in range(T):
                out[t, o] = _q8_out(Q, dw, ds, o, t)


@njit(parallel=True, **_KW)
def expert_q4(x, gw, gs, uw, us, dw, ds, gsz, h, out):
    P = _q4_prepare(x, gsz)
    T, I, D = x.shape[0], gw.shape[0], dw.shape[0]
    sh, hg = _q4_shift(gsz), gsz // 2
    if P[0]:
        nb = (I + RB - 1) // RB
        scg = np.empty((nb, RB, T), np.float32)  # one allocation per call, not one per block
        scu = np.empty((nb, RB, T), np.float32)
        for ib in prange(nb):
            i0 = ib * RB
            rg = scg[ib]
            ru = scu[ib]
            _q4_rows(P, gw, gs, i0, rg)
            _q4_rows(P, uw, us, i0, ru)
            for r in range(min(RB, I - i0)):
                for t in range(T):
                    h[t, i0 + r] = _silu_mul(rg[r, t], ru[r, t])
    else:
        for i in prange(I):
            for t in range(T):
                h[t, i] = _silu_mul(_q4_out(P, gw, gs, sh, hg, i, t), _q4_out(P, uw, us, sh, hg, i, t))
    Q = _q4_prepare(h, gsz)
    if Q[0]:
        nb = (D + RB - 1) // RB
        scd = np.empty((nb, RB, T), np.float32)
        for ob in prange(nb):
            o0 = ob * RB
            res = scd[ob]
            _q4_rows(Q, dw, ds, o0, res)
            for r in range(min(RB, D - o0)):
                for t in range(T):
                    out[t, o0 + r] = res[r, t]
    else:
        for o in prange(D):
            for t in range(T):
                out[t, o] = _q4_out(Q, dw, ds, sh, hg, o, t)


@njit(parallel=True, **_KW)
def expert_q4i(x, gw, gs, uw, us, dw, ds, gsz, h, out):
    """expert_q4 on interleaved weights (engine.quant.interleave_q4, store format 4): gw, uw
    uint8 [I / IL, D / 64, IL * 32], dw uint8 [D / IL, I / 64, IL * 32], scales uint16 half
    bits as expert_q4's; x float32 [T, D], h float32 [T, I] scratch, out float32 [T, D].
    Needs the SIMD path, group size 32 and I, D multiples of 64 (engine.quant.int4_interleavable).
    Bit-identical to expert_q4 on the row-major weights.

    Raises:
        ValueError: without the SIMD int4 kernels (the caller de-interleaves instead), or another
            group size or widths.
    """
    P = _q4_prepare(x, gsz)
    T, I, D = x.shape[0], gs.shape[0], ds.shape[0]
    if not P[0] or gsz != 32 or I % 64 or D % 64:
        raise ValueError("interleaved int4 slabs need the SIMD int4 kernels, group size 32 and widths that are multiples of 64")
    nb = I // RB
    scg = np.empty((nb, RB, T), np.float32)
    scu = np.empty((nb, RB, T), np.float32)
    for ib in prange(nb):
        i0 = ib * RB
        rg = scg[ib]
        ru = scu[ib]
        _q4i_rows(P, gw, gs, i0, rg)
        _q4i_rows(P, uw, us, i0, ru)
        for r in range(RB):
            for t in range(T):
                h[t, i0 + r] = _silu_mul(rg[r, t], ru[r, t])
    Q = _q4_prepare(h, gsz)
    nb = D // RB
    scd = np.empty((nb, RB, T), np.float32)
    for ob in prange(nb):
        o0 = ob * RB
        res = scd[ob]
        _q4i_rows(Q, dw, ds, o0, res)
        for r in range(RB):
            for t in range(T):
                out[t, o0 + r] = res[r, t]


# --- a decode step's routed experts in one call (T = 1) ----------------------------------------
#
# At T = 1 a MoE layer runs K experts on the same row. One call per layer instead of one per
# expert: the gate/up rows of all K experts are one parallel loop and their down rows another,
# so the threads stream K experts' weights back to back (not K short loops with a fork/join
# each) and Python dispatches once. Every element runs exactly the operations of expert_q4 /
# expert_q8 at T = 1 (same activation quantization, same 1 x 1 tiles, same tails), so out[k]
# is bit-identical to the one-expert kernel on expert k (tests/test_kernels.py).

@njit(inline="always", **_KW)
def _q4_rows_t(P, w, s, o0, t, res):
    """_q4_rows for the one activation row t: rows o0..o0+nr-1 into res[:nr, t] (the 1 x 1
    tiles and tail of _q4_rows' T = 1 path)."""
    simd, xq, xs, c, xe, xo = P
    nr = min(RB, w.shape[0] - o0)
    npairs = s.shape[1] // 2
    for r in range(nr):
        _q4_tile_1x1(xq, xs, c, w, s, o0 + r, t, npairs, res[r:])
    if s.shape[1] % 2:
        for r in range(nr):
            res[r, t] = _q4_finish(res[r, t], xq[t], xs[t], w[o0 + r], s[o0 + r])


@njit(inline="always", **_KW)
def _q8_rows_t(P, w, s, o0, t, res):
    """_q8_rows for the one activation row t (see _q4_rows_t)."""
    simd, xu, xs, xf = P
    nr = min(RB, w.shape[0] - o0)
    npairs = w.shape[1] // 64
    for r in range(nr):
        _q8_tile_1x1(xu, xs, xs, w, xs, o0 + r, t, npairs, res[r:])
    for r in range(nr):
        res[r, t] = _q8_finish(res[r, t], xu[t], xs[t], w[o0 + r], s[o0 + r])


UB = 16  # row blocks per work unit of the arena kernels (their weight views made once per unit)


@njit(inline="always", **_KW)
def _arena_q4(arena, off, O, N, gsz):
    """The int4 weights [O, N/2] uint8 and half-bit group scales [O, N/gsz] uint16 at byte
    offsets off[0], off[1] of an expert arena (views, no copy)."""
    w = arena[off[0]:off[0] + O * (N // 2)].reshape((O, N // 2))
    s = arena[off[1]:off[1] + 2 * O * (N // gsz)].view(np.uint16).reshape((O, N // gsz))
    return w, s


@njit(inline="always", **_KW)
def _arena_q4i(arena, off, O, N, gsz):
    """_arena_q4 for a slab stored interleaved (engine.quant.interleave_q4, store format 4): the
    weights as uint8 [O / IL, N / 64, IL * 32], the scales as _arena_q4's."""
    w = arena[off[0]:off[0] + O * (N // 2)].reshape((O // IL, N // 64, IL * 32))
    s = arena[off[1]:off[1] + 2 * O * (N // gsz)].view(np.uint16).reshape((O, N // gsz))
    return w, s


@njit(inline="always", **_KW)
def _arena_q8(arena, off, O, N):
    """The int8 weights [O, N] and float32 row scales [O] at byte offsets off[0], off[1]."""
    w = arena[off[0]:off[0] + O * N].view(np.int8).reshape((O, N))
    s = arena[off[1]:off[1] + 4 * O].view(np.float32)
    return w, s


@njit(inline="always", **_KW)
def _unit(u, nu, nb):
    """Work unit u of the arena kernels' loops over n experts x nu units of UB blocks (of nb
    blocks per expert): (expert k, first block, end block)."""
    k = u // nu
    j = u - k * nu
    return k, j * UB, min((j + 1) * UB, nb)


@njit(parallel=True, **_KW)
def experts_q4_t1(x, arena, offs, I, gsz, h, out, il=False):
    """n int4 experts on one row, reading their slabs in the expert cache's arena:
    out[k] = expert_q4(x, gate_k, up_k, down_k) for k < n.

    ``il``: the slabs hold interleaved weights (engine.quant.interleave_q4, store format 4):
    gate_proj.w / up_proj.w uint8 [I / IL, D / 64, IL * 32], down_proj.w [D / IL, I / 64, IL *
    32], run by the IL x 1 tiles (_q4i_rows); needs the SIMD path, gsz 32 and I, D multiples of
    64 (raises ValueError otherwise).
    Measured (synthetic arena of OLMoE-1B-7B's slab shapes, 16 layers x 8 experts a token, Zen
    4): 2 threads median 18.3 -> 21.0 GB/s, 1 thread 15.5 -> 18.0. Same values either way.

    x float32 [1, D]; arena uint8 [bytes]; offs int64 [>= n, 6]: byte offsets in arena of
    expert k's gate_proj.w [I, D/2] uint8, gate_proj.s [I, D/gsz] (uint16 half bits), up_proj.w,
    up_proj.s, down_proj.w [D, I/2], down_proj.s [D, I/gsz]; h float32 [n, I] scratch; out
    float32 [n, D]; n = out.shape[0]. Offsets, not arrays: a parallel region that captures
    tuples of arrays pays for each array at every launch (numba 0.68, Zen 4: ~35 us for one
    tuple of 8, ~94 us for six; this kernel passed six tuples of 8 to three regions, ~75 us of
    a ~950 us decode layer). The views are made once per unit of UB row blocks (making them
    per row block cost more than the tuples did). Bit-identical to n expert_q4 calls."""
    n = out.shape[0]
    D = x.shape[1]
    P = _q4_prepare(x, gsz)
    sh, hg = _q4_shift(gsz), gsz // 2
    if il and (not P[0] or gsz != 32 or I % 64 or D % 64):
        raise ValueError("interleaved int4 slabs need the SIMD int4 kernels, group size 32 and widths that are multiples of 64")
    if P[0]:
        nbi = (I + RB - 1) // RB
        nui = (nbi + UB - 1) // UB
        scg = np.empty((n * nbi, RB, 1), np.float32)
        scu = np.empty((n * nbi, RB, 1), np.float32)
        # the gate rows of all n experts, then their up rows: each thread streams one matrix at
        # a time (alternating gate and up blocks, two streams, read at ~24 GB/s against ~31
        # for one; Zen 4, 2 threads); the same sums, so the same values
        for u in prange(n * nui):
            k, b0, b1 = _unit(u, nui, nbi)
            if il:
                gwi, gsi = _arena_q4i(arena, offs[k, 0:2], I, D, gsz)
                for ib in range(b0, b1):
                    _q4i_rows(P, gwi, gsi, ib * RB, scg[k * nbi + ib])
            else:
                gw, gs = _arena_q4(arena, offs[k, 0:2], I, D, gsz)
                for ib in range(b0, b1):
                    _q4_rows(P, gw, gs, ib * RB, scg[k * nbi + ib])
        for u in prange(n * nui):
            k, b0, b1 = _unit(u, nui, nbi)
            if il:
                uwi, usi = _arena_q4i(arena, offs[k, 2:4], I, D, gsz)
                for ib in range(b0, b1):
                    _q4i_rows(P, uwi, usi, ib * RB, scu[k * nbi + ib])
            else:
                uw, us = _arena_q4(arena, offs[k, 2:4], I, D, gsz)
                for ib in range(b0, b1):
                    _q4_rows(P, uw, us, ib * RB, scu[k * nbi + ib])
            for ib in range(b0, b1):
                i0 = ib * RB
                rg = scg[k * nbi + ib]
                ru = scu[k * nbi + ib]
                for r in range(min(RB, I - i0)):
                    h[k, i0 + r] = _silu_mul(rg[r, 0], ru[r, 0])
    else:
        for k in prange(n):
            gw, gs = _arena_q4(arena, offs[k, 0:2], I, D, gsz)
            uw, us = _arena_q4(arena, offs[k, 2:4], I, D, gsz)
            for i in range(I):
                h[k, i] = _silu_mul(_q4_out(P, gw, gs, sh, hg, i, 0), _q4_out(P, uw, us, sh, hg, i, 0))
    Q = _q4_prepare(h, gsz)  # each row quantized on its own, as expert_q4 quantizes its h
    if Q[0]:
        nbd = (D + RB - 1) // RB
        nud = (nbd + UB - 1) // UB
        scd = np.empty((n * nbd, RB, n), np.float32)
        for u in prange(n * nud):
            k, b0, b1 = _unit(u, nud, nbd)
            if il:
                dwi, dsi = _arena_q4i(arena, offs[k, 4:6], D, I, gsz)
                Qk = (Q[0], Q[1][k:k + 1], Q[2][k:k + 1], Q[3][k:k + 1], Q[4][k:k + 1], Q[5][k:k + 1])
                for ob in range(b0, b1):
                    o0 = ob * RB
                    res = scd[k * nbd + ob]
                    _q4i_rows(Qk, dwi, dsi, o0, res)  # into res[:, 0]
                    for r in range(RB):
                        out[k, o0 + r] = res[r, 0]
            else:
                dw, ds = _arena_q4(arena, offs[k, 4:6], D, I, gsz)
                for ob in range(b0, b1):
                    o0 = ob * RB
                    res = scd[k * nbd + ob]
                    _q4_rows_t(Q, dw, ds, o0, k, res)
                    for r in range(min(RB, D - o0)):
                        out[k, o0 + r] = res[r, k]
    else:
        for k in prange(n):
            dw, ds = _arena_q4(arena, offs[k, 4:6], D, I, gsz)
            for o in range(D):
                out[k, o] = _q4_out(Q, dw, ds, sh, hg, o, k)


@njit(parallel=True, **_KW)
def experts_q8_t1(x, arena, offs, I, h, out):
    """n int8 experts on one row from the arena (see experts_q4_t1): offs int64 [>= n, 6]
    the byte offsets of gate_proj.w [I, D] int8, gate_proj.s [I] float32, up_proj.w, up_proj.s,
    down_proj.w [D, I], down_proj.s [D]; h float32 [n, I] scratch; out float32 [n, D].
    Bit-identical to n expert_q8 calls."""
    n = out.shape[0]
    D = x.shape[1]
    P = _q8_prepare(x)
    if P[0]:
        nbi = (I + RB - 1) // RB
        nui = (nbi + UB - 1) // UB
        scg = np.empty((n * nbi, RB, 1), np.float32)
        scu = np.empty((n * nbi, RB, 1), np.float32)
        for u in prange(n * nui):
            k, b0, b1 = _unit(u, nui, nbi)
            gw, gs = _arena_q8(arena, offs[k, 0:2], I, D)
            uw, us = _arena_q8(arena, offs[k, 2:4], I, D)
            for ib in range(b0, b1):
                i0 = ib * RB
                rg = scg[k * nbi + ib]
                ru = scu[k * nbi + ib]
                _q8_rows(P, gw, gs, i0, rg)
                _q8_rows(P, uw, us, i0, ru)
                for r in range(min(RB, I - i0)):
                    h[k, i0 + r] = _silu_mul(rg[r, 0], ru[r, 0])
    else:
        for k in prange(n):
            gw, gs = _arena_q8(arena, offs[k, 0:2], I, D)
            uw, us = _arena_q8(arena, offs[k, 2:4], I, D)
            for i in range(I):
                h[k, i] = _silu_mul(_q8_out(P, gw, gs, i, 0), _q8_out(P, uw, us, i, 0))
    Q = _q8_prepare(h)
    if Q[0]:
        nbd = (D + RB - 1) // RB
        nud = (nbd + UB - 1) // UB
        scd = np.empty((n * nbd, RB, n), np.float32)
        for u in prange(n * nud):
            k, b0, b1 = _unit(u, nud, nbd)
            dw, ds = _arena_q8(arena, offs[k, 4:6], D, I)
            for ob in range(b0, b1):
                o0 = ob * RB
                res = scd[k * nbd + ob]
                _q8_rows_t(Q, dw, ds, o0, k, res)
                for r in range(min(RB, D - o0)):
                    out[k, o0 + r] = res[r, k]
    else:
        for k in prange(n):
            dw, ds = _arena_q8(arena, offs[k, 4:6], D, I)
            for o in range(D):
                out[k, o] = _q8_out(Q, dw, ds, o, k)


# --- a prefill chunk's routed experts in one call (T > 1) -------------------------------------
#
# A prefill chunk of T tokens routes T * K (token, rank) entries to up to num_experts experts.
# Run one expert_q4 call per expert and each call quantizes its rows again (the same token once
# per expert that chose it), forks and joins the threads twice, and the caller gathers the rows
# into expert order and scatters the outputs back with numpy (two [T * K, D] float32 copies).
# Measured on OLMoE-1B-7B int4 (T = 128, 64 experts x 16 rows, 2 threads, Zen 4): 93 ms per
# MoE layer against 80 ms for the kernel calls alone and ~68 ms for the same multiply-adds at
# a single big matrix's rate. experts_q4_sorted does a chunk's resident experts in one call:
# each token row quantized once (in parallel), the gate / up rows of every expert in one
# parallel loop and the down rows in another, each thread taking the same share of every
# expert's rows (balanced whatever the experts' token counts). Each element runs exactly
# expert_q4's operations on exactly its activations (quantization is per row; the register
# tiles of _q4_rows over the expert's own rows, in the same token order), so the outputs are
# bit-identical to one expert_q4 call per expert (tests/test_kernels.py).

@njit(parallel=True, **_KW)
def experts_q4_sorted(x, tok, starts, arena, offs, I, gsz, nch, h, out, il=False):
    """Routed int4 experts of a prefill chunk, reading their slabs in place.

    x float32 [T, D] the normed rows; tok int64 [M] the row of x of each (token, rank) entry,
    grouped by expert: entries starts[e] .. starts[e + 1] - 1 go to expert e of this call
    (starts int64 [n + 1], ascending); arena uint8 [bytes] the expert cache's arena; offs int64
    [n, 6] byte offsets in arena of expert e's gate_proj.w [I, D/2] uint8, gate_proj.s [I, G]
    (uint16 half bits), up_proj.w, up_proj.s, down_proj.w [D, I/2], down_proj.s [D, I/gsz];
    h float32 [M, I] scratch; out float32 [M, D]: out[m] = expert_q4(x[tok[m]]) of the expert
    entry m belongs to; nch: the work shares (the calling thread's kernel threads,
    :func:`current_threads`), share c taking row blocks c * nb / nch .. of every expert.
    ``il``: interleaved slabs (shapes and conditions as experts_q4_t1's, else ValueError).
    Bit-identical to expert_q4 on each expert's rows x[tok[lo:hi]]."""
    M = tok.shape[0]
    n = starts.shape[0] - 1
    D = x.shape[1]
    simd = _Q4_SIMD and gsz == 32
    if il and (not simd or I % 64 or D % 64):
        raise ValueError("interleaved int4 slabs need the SIMD int4 kernels, group size 32 and widths that are multiples of 64")
    xq = np.empty((M, 2 * D if simd else 0), np.int8)
    xs = np.empty((M, D // gsz), np.float32)
    c = np.empty((M, D // 4 if simd else 0), np.int32)
    xe = np.empty((M, 0 if simd else D // 2), np.float32)
    xo = np.empty((M, 0 if simd else D // 2), np.float32)
    for m in prange(M):  # each entry's row quantized as _q4_prepare quantizes it
        t = tok[m]
        if simd:
            _q4_prep_simd(x[t], xq[m], xs[m], c[m])
        else:
            _q4_prep_portable(x[t], gsz, xe[m], xo[m])
    most = 0
    for e in range(n):
        most = max(most, starts[e + 1] - starts[e])
    sh, hg = _q4_shift(gsz), gsz // 2
    nbi = (I + RB - 1) // RB
    nbs = (nbi + nch - 1) // nch  # row blocks of a share, at most
    scg = np.empty((nch, nbs, RB, most), np.float32)
    scu = np.empty((nch, RB, most), np.float32)
    for ch in prange(nch):  # thread ch: the same share of every expert's gate / up row blocks
        b0, b1 = ch * nbi // nch, (ch + 1) * nbi // nch
        for e in range(n):
            lo, hi = starts[e], starts[e + 1]
            if hi == lo:
                continue
            P = (simd, xq[lo:hi], xs[lo:hi], c[lo:hi], xe[lo:hi], xo[lo:hi])
            ru = scu[ch, :, :hi - lo]
            if il:
                gwi, gsi = _arena_q4i(arena, offs[e, 0:2], I, D, gsz)
                uwi, usi = _arena_q4i(arena, offs[e, 2:4], I, D, gsz)
                for ib in range(b0, b1):
                    _q4i_rows(P, gwi, gsi, ib * RB, scg[ch, ib - b0, :, :hi - lo])
                for ib in range(b0, b1):
                    i0 = ib * RB
                    rg = scg[ch, ib - b0]
                    _q4i_rows(P, uwi, usi, i0, ru)
                    for r in range(RB):
                        for t in range(hi - lo):
                            h[lo + t, i0 + r] = _silu_mul(rg[r, t], ru[r, t])
                continue
            gw, gs = _arena_q4(arena, offs[e, 0:2], I, D, gsz)
            uw, us = _arena_q4(arena, offs[e, 2:4], I, D, gsz)
            if simd:
                # the share's gate rows, then its up rows: one weight stream at a time (as
                # experts_q4_t1; alternating gate and up blocks streamed two matrices at once)
                for ib in range(b0, b1):
                    _q4_rows(P, gw, gs, ib * RB, scg[ch, ib - b0, :, :hi - lo])
                for ib in range(b0, b1):
                    i0 = ib * RB
                    rg = scg[ch, ib - b0]
                    _q4_rows(P, uw, us, i0, ru)
                    for r in range(min(RB, I - i0)):
                        for t in range(hi - lo):
                            h[lo + t, i0 + r] = _silu_mul(rg[r, t], ru[r, t])
                continue
            for i in range(b0 * RB, min(I, b1 * RB)):  # portable path
                for t in range(hi - lo):
                    h[lo + t, i] = _silu_mul(_q4_out(P, gw, gs, sh, hg, i, t), _q4_out(P, uw, us, sh, hg, i, t))
    Q = _q4_prepare(h, gsz)  # each row on its own, as expert_q4 quantizes its h
    nbd = (D + RB - 1) // RB
    scd = np.empty((nch, RB, most), np.float32)
    for ch in prange(nch):
        b0, b1 = ch * nbd // nch, (ch + 1) * nbd // nch
        for e in range(n):
            lo, hi = starts[e], starts[e + 1]
            if hi == lo:
                continue
            Qe = (Q[0], Q[1][lo:hi], Q[2][lo:hi], Q[3][lo:hi], Q[4][lo:hi], Q[5][lo:hi])
            res = scd[ch, :, :hi - lo]
            if il:
                dwi, dsi = _arena_q4i(arena, offs[e, 4:6], D, I, gsz)
                for ob in range(b0, b1):
                    o0 = ob * RB
                    _q4i_rows(Qe, dwi, dsi, o0, res)
                    for r in range(RB):
                        for t in range(hi - lo):
                            out[lo + t, o0 + r] = res[r, t]
                continue
            dw, ds = _arena_q4(arena, offs[e, 4:6], D, I, gsz)
            for ob in range(b0, b1):
                o0 = ob * RB
                if Q[0]:
                    _q4_rows(Qe, dw, ds, o0, res)
                    for r in range(min(RB, D - o0)):
                        for t in range(hi - lo):
                            out[lo + t, o0 + r] = res[r, t]
                else:
                    for o in range(o0, min(D, o0 + RB)):
                        for t in range(hi - lo):
                            out[lo + t, o] = _q4_out(Qe, dw, ds, sh, hg, o, t)


@njit(parallel=True, nogil=True, cache=_KW["cache"])  # no fastmath: numpy's rounding, as combine_ranked
def combine_sorted(y, pos, w, out):
    """out[t] = y[pos[t, 0]] * w[t, 0] + y[pos[t, 1]] * w[t, 1] + ... in rank order, each
    product and each sum rounded to float32: :func:`combine_ranked` of the rows y[pos[t, k]]
    (bit-identical to it), reading the expert-ordered outputs in place instead of scattering
    them back first, tokens in parallel.

    y float32 [M, D] outputs in expert order, pos int64 [T, K] the row of y of (token t, rank
    k), w float32 [T, K] routing weights, out float32 [T, D]."""
    T, Kk = pos.shape
    D = y.shape[1]
    for t in prange(T):
        w0 = w[t, 0]
        p0 = pos[t, 0]
        for d in range(D):
            out[t, d] = y[p0, d] * w0
        for k in range(1, Kk):
            wk = w[t, k]
            pk = pos[t, k]
            for d in range(D):
                out[t, d] = out[t, d] + y[pk, d] * wk
