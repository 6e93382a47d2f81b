"""Linear layers out[T, O] = x[T, N] @ W^T of every weight kind (f32, f16, q8, q4 row-major
and interleaved by IL rows, mxfp4), several matrices in one launch, and the quantized
embedding tables' row reads."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .setup import _KW
from .tiles import (_dot_f16, _dot_f32, _make_int_tile, _make_tail, _q4_out, _q4_prepare, _q4_rows,
                    _q4_shift, _Q4_SIMD, _q8_out, _q8_prepare, _q8_rows, RB, _sc, TB, _TR4)


# --- linear layers: out[T, O] = x[T, N] @ W^T ------------------------------------------------

@njit(parallel=True, **_KW)
def linear_f32(x, w, out):
    for o in prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _dot_f32(x[t], w[o])


@njit(parallel=True, **_KW)
def linear_f16(x, w, lut, out):
    for o in prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _dot_f16(x[t], w[o], lut)


@njit(parallel=True, **_KW)
def linear_q8(x, w, s, out):
    P = _q8_prepare(x)
    T, O = x.shape[0], w.shape[0]
    if P[0]:
        nb = (O + RB - 1) // RB
        scr = np.empty((nb, RB, T), np.float32)  # one allocation per call, not one per block
        for ob in prange(nb):
            o0 = ob * RB
            res = scr[ob]
            _q8_rows(P, w, s, o0, res)
            for r in range(min(RB, O - o0)):
                for t in range(T):
                    out[t, o0 + r] = res[r, t]
    else:
        for o in prange(O):
            for t in range(T):
                out[t, o] = _q8_out(P, w, s, o, t)


@njit(parallel=True, **_KW)
def linear_q4(x, w, s, gs, out):
    P = _q4_prepare(x, gs)
    T, O = x.shape[0], w.shape[0]
    if P[0]:
        nb = (O + RB - 1) // RB
        scr = np.empty((nb, RB, T), np.float32)  # one allocation per call, not one per block
        for ob in prange(nb):
            o0 = ob * RB
            res = scr[ob]
            _q4_rows(P, w, s, o0, res)
            for r in range(min(RB, O - o0)):
                for t in range(T):
                    out[t, o0 + r] = res[r, t]
    else:
        sh, hg = _q4_shift(gs), gs // 2
        for o in prange(O):
            for t in range(T):
                out[t, o] = _q4_out(P, w, s, sh, hg, o, t)


@njit(inline="always", **_KW)
def _starts(w, per):
    """Prefix sums [M + 1] of the units (row blocks of ``per`` rows) of each matrix in w."""
    st = np.empty(len(w) + 1, np.int64)
    st[0] = 0
    for m in range(len(w)):
        st[m + 1] = st[m] + (w[m].shape[0] + per - 1) // per
    return st


@njit(inline="always", **_KW)
def _which(b, st):
    """The matrix m whose units st[m] <= b < st[m + 1] hold unit b (few matrices: a scan)."""
    m = 0
    while b >= st[m + 1]:
        m += 1
    return m


def _make_block_into(rows):
    """Row block b (of _starts(w, RB)) of the matrices w into out[m] by ``rows`` (_q4_rows or
    _q8_rows: the same arguments P, w, s, o0, res), through the block's scratch scr[b]."""
    @njit(inline="always", **_KW)
    def block_into(P, w, s, st, b, scr, out):
        m = _which(b, st)
        o0 = (b - st[m]) * RB
        res = scr[b]
        rows(P, w[m], s[m], o0, res)
        om = out[m]
        for r in range(min(RB, w[m].shape[0] - o0)):
            for t in range(om.shape[0]):
                om[t, o0 + r] = res[r, t]
    return block_into


_q4_block_into = _make_block_into(_q4_rows)
_q8_block_into = _make_block_into(_q8_rows)


@njit(parallel=True, **_KW)
def linears_q4(x, w, s, gs, out):
    """Several int4 matrices on the same rows in one call: out[m] = linear_q4(x, w[m], s[m], gs)
    for every m (a decode step's q / k / v projections).

    x float32 [T, N]; w: tuple of uint8 [O_m, N // 2]; s: tuple of group scales [O_m, G] (all
    uint16 half bits or all float32); out: tuple of float32 [T, O_m]. x is quantized once, and
    one parallel launch covers the row blocks of every matrix: at T = 1 on an AMD EPYC Zen 4
    (2 threads, weights from DRAM) three [2048, 2048] matrices took 3 x 140 us as three
    linear_q4 calls and ~230 us as one [6144, 2048] call (kernel launch and ramp-up per call).
    Each row runs linear_q4's code, so the values are bit-identical to separate calls."""
    P = _q4_prepare(x, gs)
    T = x.shape[0]
    if P[0]:
        st = _starts(w, RB)
        scr = np.empty((st[-1], RB, T), np.float32)
        for b in prange(st[-1]):
            _q4_block_into(P, w, s, st, b, scr, out)
    else:
        sh, hg = _q4_shift(gs), gs // 2
        st = _starts(w, 1)
        for b in prange(st[-1]):
            m = _which(b, st)
            om = out[m]
            for t in range(T):
                om[t, b - st[m]] = _q4_out(P, w[m], s[m], sh, hg, b - st[m], t)


@njit(parallel=True, **_KW)
def linears_q8(x, w, s, out):
    """q8 twin of linears_q4: out[m] = linear_q8(x, w[m], s[m]) for every m, x quantized once,
    one launch; w: tuple of int8 [O_m, N], s: tuple of float32 [O_m], out: tuple of float32
    [T, O_m]. Bit-identical to separate linear_q8 calls."""
    P = _q8_prepare(x)
    T = x.shape[0]
    if P[0]:
        st = _starts(w, RB)
        scr = np.empty((st[-1], RB, T), np.float32)
        for b in prange(st[-1]):
            _q8_block_into(P, w, s, st, b, scr, out)
    else:
        st = _starts(w, 1)
        for b in prange(st[-1]):
            m = _which(b, st)
            om = out[m]
            for t in range(T):
                om[t, b - st[m]] = _q8_out(P, w[m], s[m], b - st[m], t)


# --- int4 rows interleaved by groups of IL (decode: IL rows per pass over one stream) --------
# A T = 1 tile over IL rows shares each pair's activation loads and scale widening among the
# rows and runs IL independent accumulator chains, where 1 x 1 walks one row at a time (IL x 1
# over row-major rows is IL streams 1 KB apart: slower, see RB). With the IL rows' pairs side by
# side (llama.cpp's repacked Q4_0 is the same idea) it is one stream. Measured (AMD EPYC Zen 4,
# linear_q4 at T = 1, [1024, 2048], best of 7, interleaved arms): one thread 19.8 -> 25.4 GB/s,
# two threads 34.9 -> 42.7; a [65536, 2048] matrix from DRAM 19.6 -> 24.1 (one thread), 39.3 ->
# 45.1 (two); 2 x 1 and 8 x 1 groups were within a few percent of 4 x 1. Every row's sums are
# made of the same operations in the same order: bit-identical to the row-major kernels.
from ..quant import IL, deinterleave_q4, interleave_q4  # noqa: E402,F401  (the layout lives with the store's)
assert RB == IL, "the interleaved kernels take one row block as one group of IL rows"


def q4_interleavable(w: np.ndarray, s: np.ndarray, gs: int) -> bool:
    """Whether linear_q4i can run these int4 weights (w uint8 [O, N / 2], s [O, G] uint16 half
    bits): the SIMD path (group size 32 on a CPU with it), O a multiple of IL, G even."""
    return (bool(_Q4_SIMD) and gs == 32 and w.ndim == 2 and s is not None and s.dtype == np.uint16
            and w.shape[0] % IL == 0 and s.shape[1] % 2 == 0 and w.shape[1] == 16 * s.shape[1])


def q4_interleaved_ok(gs: int) -> bool:
    """Whether the interleaved int4 kernels (linear_q4i, expert_q4i, experts_q4_t1 / _sorted
    with il) run here: the SIMD int4 path and group size 32. Without it, interleaved store
    slabs are run on row-major copies (engine.quant.deinterleave_q4)."""
    return bool(_Q4_SIMD) and gs == 32


_q4i_tile_4x1 = _make_int_tile("q4", IL, 1, il=IL)
_q4i_tile_rx4 = _make_int_tile("q4", _TR4, 4, il=IL)
# the last T % TB tokens of a row block: _TR4 rows per pass (all IL rows with AVX-512: one
# stream, two 512-bit registers of rows per token, as the decode tile); 1-row tails read the
# group's 128 bytes of a pair four times over
_q4i_tail = _make_tail(_make_int_tile("q4", _TR4, 3, il=IL), _make_int_tile("q4", _TR4, 2, il=IL),
                       _q4i_tile_4x1 if _TR4 == IL else _make_int_tile("q4", _TR4, 1, il=IL))


@njit(inline="always", **_KW)
def _q4i_rows(P, w, s, o0, res):
    """_q4_rows for interleaved weights w [O / IL, G / 2, IL * 32] (G even, O % IL == 0, RB ==
    IL): rows o0..o0+RB-1 (o0 a multiple of RB), every token, into res[:RB, :T]."""
    xq, xs, xc = P[1], P[2], P[3]
    T = xq.shape[0]
    npairs = s.shape[1] // 2
    if T == 1:
        _q4i_tile_4x1(xq, xs, xc, w, s, o0, 0, npairs, res)
        return
    t = 0
    while t + TB <= T:
        for r2 in range(0, RB, _TR4):
            _q4i_tile_rx4(xq, xs, xc, w, s, o0 + r2, t, npairs, res[r2:])
        t += TB
    for r2 in range(0, RB, _TR4):
        _q4i_tail(xq, xs, xc, w, s, o0 + r2, t, T - t, npairs, res[r2:])


@njit(parallel=True, **_KW)
def linear_q4i(x, w, s, gs, out):
    """linear_q4 on interleaved weights (:func:`interleave_q4`; :func:`q4_interleavable` held
    for the row-major matrix): x float32 [T, N], w uint8 [O / IL, N / 64, IL * 32], s uint16
    [O, N / 32] half bits, out float32 [T, O]. Bit-identical to linear_q4 on the row-major w."""
    P = _q4_prepare(x, gs)
    T, O = x.shape[0], s.shape[0]
    nb = O // RB
    scr = np.empty((nb, RB, T), np.float32)
    for ob in prange(nb):
        o0 = ob * RB
        res = scr[ob]
        _q4i_rows(P, w, s, o0, res)
        for r in range(RB):
            for t in range(T):
                out[t, o0 + r] = res[r, t]


@njit(parallel=True, **_KW)
def linears_q4i(x, w, s, gs, out):
    """linears_q4 on interleaved weights: out[m] = linear_q4i(x, w[m], s[m], gs) for every m,
    x quantized once, one parallel launch. Bit-identical to linears_q4 on the row-major w."""
    P = _q4_prepare(x, gs)
    T = x.shape[0]
    st = _starts(s, RB)  # the scales have the O rows (w has O / IL groups)
    scr = np.empty((st[-1], RB, T), np.float32)
    for b in prange(st[-1]):
        m = _which(b, st)
        o0 = (b - st[m]) * RB
        res = scr[b]
        _q4i_rows(P, w[m], s[m], o0, res)
        om = out[m]
        for r in range(RB):
            for t in range(T):
                om[t, o0 + r] = res[r, t]


_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)  # e2m1 code -> value
# e8m0 scale byte X -> 2^(X - 127); 255 (NaN in OCP MX) -> inf, as transformers' ldexp gives
_E8M0 = np.append(np.ldexp(1.0, np.arange(255) - 127), np.inf).astype(np.float32)


@njit(parallel=True, **_KW)
def linear_mxfp4(x, w, s, out):
    """out[T, O] = x[T, N] @ W^T for an MXFP4 matrix (engine/quant.py): w uint8 [O, N // 2]
    (low nibble = even column), s uint8 [O, N // 32] e8m0 scale bytes. Each weight row is
    decoded exactly to float32 once (code value x 2^(X - 127)) and dotted with every row of x
    in float32 (the activations are not quantized), so results do not depend on T."""
    T, N = x.shape
    O = w.shape[0]
    for o in prange(O):
        row = np.empty(N, np.float32)
        for g in range(N // 32):
            sc = _E8M0[s[o, g]]
            for b in range(16):
                byte = w[o, g * 16 + b]
                row[g * 32 + 2 * b] = _FP4[byte & 15] * sc
                row[g * 32 + 2 * b + 1] = _FP4[byte >> 4] * sc
        for t in range(T):
            out[t, o] = _dot_f32(x[t], row)


# --- embeddings -------------------------------------------------------------------------

@njit(**_KW)
def embed_q8(ids, w, s, out):
    """out[T, D] = dequantized rows ``ids`` of the int8 table w [V, D] with scales s [V]."""
    for t in range(ids.shape[0]):
        r = ids[t]
        for i in range(w.shape[1]):
            out[t, i] = np.float32(w[r, i]) * s[r]


@njit(**_KW)
def embed_q4(ids, w, s, gs, out):
    """out[T, D] = dequantized rows ``ids`` of the int4 table w uint8 [V, D // 2] with group
    scales s [V, D // gs] (layout of the module docstring)."""
    for t in range(ids.shape[0]):
        r = ids[t]
        for k in range(w.shape[1]):
            b = np.int32(w[r, k])
            sc = _sc(s[r], (2 * k) // gs)
            out[t, 2 * k] = np.float32((b & 15) - 8) * sc
            out[t, 2 * k + 1] = np.float32((b >> 4) - 8) * sc
