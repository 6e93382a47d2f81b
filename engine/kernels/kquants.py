"""Integer dot products on GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K) as a GGUF-born store keeps
them, against activations quantized to 8 bits per block of 256 (llama.cpp's Q8_K).

Activations: each row x [N] (N a multiple of 256) is quantized once per call per block of 256
columns, d = max|x_b| / 127, q = rint(x * (127 / max|x_b|)) int8, with the sums of q per 16
columns (int16). A weight block's dot product with a token's block is then computed in integers
as ggml computes it:

- Q4_K / Q5_K (value = d * sc_j * c - dmin * m_j, c the 4 / 5-bit code, sc_j, m_j the 6-bit
  scale and min of sub-block j of 32): d * dx * sum_j sc_j * sum(c * q) - dmin * dx * sum_j m_j *
  sum(q over j).
- Q6_K (value = d * sc_j * (c - 32), sc_j int8 per 16): d * dx * (sum_j sc_j * sum(c * q) - 32 *
  sum_j sc_j * sum(q over j)).

The code-times-activation products run as ``vpmaddubsw`` (unsigned codes times signed
activations, pair sums in int16: at most 63 * 127 * 2 < 2^15) then ``vpmaddwd`` with the
sub-block scales (int32), 512 bits wide with AVX-512BW, two 256-bit halves with AVX2. Each block
adds its 16 int32 lanes, converted to float, times d * dx (one FMA per lane) into the row's
float lanes; the min term has lanes of its own; a row ends with the lanes summed in a fixed
tree order. Every (row, token) element runs the same operations whatever the tile (T, tokens
per tile, thread count), so results do not depend on them. Without AVX2 (``KQ_SIMD`` False) the
callers use the float32 kernels of engine.kernels_gguf instead.

What the result is: quantize_q8k(x) @ dequant(W)^T with the float32 rounding of the block sums
(tests/test_gguf_kquants.py compares with that expression in float64 and with the float32
dequantizing kernels).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .setup import INT_FLAVOR, _KW
from .tiles import (PREFETCH_BYTES, _I8, _I16, _I32, _I64, _F32, _const_vec, _quant_group, _row_ptr,
                    _sadd, _sdiv, _smul, _strict, _tree_sum, _vec, _exp32)

KQ_BLOCK = 256  # values per K-quant block (and per activation block)
KQ_TYPES = {12: 144, 13: 176, 14: 210}  # ggml type id -> bytes per block: Q4_K, Q5_K, Q6_K
KQ_WIDTH = 512 if INT_FLAVOR in ("vnni", "bw") else 256 if INT_FLAVOR == "avx2" else 0
KQ_SIMD = KQ_WIDTH > 0
_TT = 4  # tokens per tile (weights decoded once per block for all of them)
_ROWS = 16  # weight rows per parallel work item


# --- activations: Q8_K ------------------------------------------------------------------------

@njit(inline="always", **_KW)
def _q8k_row(x, xq, xd, xb):
    """Quantize x [N] per block of 256: xq int8 [N], xd float32 [N / 256], xb int16 [N / 16]
    (the sums of xq per 16 columns)."""
    for b in range(xd.shape[0]):
        lo = b * KQ_BLOCK
        d, inv = _quant_group(x, lo, KQ_BLOCK)
        xd[b] = d
        for s in range(16):
            acc = 0
            for j in range(lo + 16 * s, lo + 16 * s + 16):
                q = np.int32(np.rint(x[j] * inv))
                xq[j] = q
                acc += q
            xb[b * 16 + s] = acc


@njit(inline="always", **_KW)
def _q8k_prepare(x):
    """(xq int8 [T, N], xd float32 [T, N / 256], xb int16 [T, N / 16]) of x float32 [T, N]."""
    T, N = x.shape
    xq = np.empty((T, N), np.int8)
    xd = np.empty((T, N // KQ_BLOCK), np.float32)
    xb = np.empty((T, N // 16), np.int16)
    if T >= 8:
        for t in prange(T):
            _q8k_row(x[t], xq[t], xd[t], xb[t])
    else:
        for t in range(T):
            _q8k_row(x[t], xq[t], xd[t], xb[t])
    return xq, xd, xb


def q8k_reference(x: np.ndarray) -> np.ndarray:
    """float64 [T, N]: the activations the integer kernels meet, dequantized (tests)."""
    x = np.asarray(x, np.float32)
    T, N = x.shape
    xb = x.reshape(T, N // KQ_BLOCK, KQ_BLOCK)
    m = np.abs(xb).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(m > 0, np.float32(127.0) / m, np.float32(0.0)).astype(np.float32)
        d = (m / np.float32(127.0)).astype(np.float32)
    q = np.rint(xb * inv).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(T, N)


# --- the tiles ---------------------------------------------------------------------------------

def _splat(builder, v, n):
    ty = _vec(v.type, n)
    one = builder.insert_element(ir.Constant(ty, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(ty, ir.Undefined), _const_vec(_I32, [0] * n))


def _madd_fns(builder):
    """(prod(u, s, sc), madd16(a, b)): prod: <64 x i8> unsigned codes u times signed activations
    s, the int16 pair sums times the int16 scales sc <32 x i16> summed pairwise into <16 x i32>
    (vpmaddubsw, vpmaddwd); madd16: <16 x i16> x <16 x i16> -> <8 x i32> pairwise sums."""
    mod = builder.module
    v16i16, v8i32, v32i8 = _vec(_I16, 16), _vec(_I32, 8), _vec(_I8, 32)
    mub2 = cgutils.get_or_insert_function(mod, ir.FunctionType(v16i16, [v32i8, v32i8]), "llvm.x86.avx2.pmadd.ub.sw")
    mwd2 = cgutils.get_or_insert_function(mod, ir.FunctionType(v8i32, [v16i16, v16i16]), "llvm.x86.avx2.pmadd.wd")
    if KQ_WIDTH == 512:
        v64i8, v32i16, v16i32 = _vec(_I8, 64), _vec(_I16, 32), _vec(_I32, 16)
        mub = cgutils.get_or_insert_function(mod, ir.FunctionType(v32i16, [v64i8, v64i8]),
                                             "llvm.x86.avx512.pmaddubs.w.512")
        mwd = cgutils.get_or_insert_function(mod, ir.FunctionType(v16i32, [v32i16, v32i16]),
                                             "llvm.x86.avx512.pmaddw.d.512")

        def prod(u, s, sc):
            return builder.call(mwd, [builder.call(mub, [u, s]), sc])
    else:
        lo32, hi32 = _const_vec(_I32, range(32)), _const_vec(_I32, range(32, 64))
        lo16, hi16 = _const_vec(_I32, range(16)), _const_vec(_I32, range(16, 32))

        def prod(u, s, sc):
            halves = [builder.call(mwd2, [builder.call(mub2, [builder.shuffle_vector(u, u, m),
                                                               builder.shuffle_vector(s, s, m)]),
                                          builder.shuffle_vector(sc, sc, h)])
                      for m, h in ((lo32, lo16), (hi32, hi16))]
            return builder.shuffle_vector(halves[0], halves[1], _const_vec(_I32, range(16)))
    return prod, lambda a, b: builder.call(mwd2, [a, b])


def _half_at(builder, base, off):
    p = builder.bitcast(builder.gep(base, [ir.Constant(_I64, off)]), _I16.as_pointer())
    return builder.fpext(builder.bitcast(builder.load(p, align=1), ir.HalfType()), _F32)


def _load(builder, base, off, ty, align=1):
    return builder.load(builder.bitcast(builder.gep(base, [off]), ty.as_pointer()), align=align)


def _make_kq_tile(t: int, TT: int):
    """An intrinsic ``tile(xq, xd, xb, w, o, t0, nb, out)``: out[t0 + k, o] = row o of w (uint8
    [O, >= nb blocks of ggml type t]) dotted with the Q8_K activations of tokens t0 .. t0 + TT - 1
    (xq int8 [T, N], xd float32 [T, N / 256], xb int16 [T, N / 16], from _q8k_prepare); out
    float32 [T, O]."""
    bsz = KQ_TYPES[t]

    def tile(typingctx, xq, xd, xb, w, o, t0, nb, out):
        sig = types.void(xq, xd, xb, w, types.intp, types.intp, types.intp, out)

        def codegen(context, builder, signature, args):
            tys = signature.args
            xq_, xd_, xb_, w_, o_, t0_, nb_, out_ = args
            mod = builder.module
            c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
            v8i8, v16i8, v32i8, v64i8 = (_vec(_I8, n) for n in (8, 16, 32, 64))
            v8i16, v16i16 = _vec(_I16, 8), _vec(_I16, 16)
            v8i32, v16i32, v16f, v8f = _vec(_I32, 8), _vec(_I32, 16), _vec(_F32, 16), _vec(_F32, 8)
            prod, madd16 = _madd_fns(builder)
            fma16 = cgutils.get_or_insert_function(mod, ir.FunctionType(v16f, [v16f] * 3), "llvm.fma.v16f32")
            fma8 = cgutils.get_or_insert_function(mod, ir.FunctionType(v8f, [v8f] * 3), "llvm.fma.v8f32")
            cat = _const_vec(_I32, range(64))
            splat8 = lambda v: _const_vec(_I8, [v] * 32)  # noqa: E731
            wrow = _row_ptr(context, builder, tys[3], w_, o_)
            xrow = [_row_ptr(context, builder, tys[0], xq_, builder.add(t0_, c64(k))) for k in range(TT)]
            xdrow = [_row_ptr(context, builder, tys[1], xd_, builder.add(t0_, c64(k))) for k in range(TT)]
            xbrow = [_row_ptr(context, builder, tys[2], xb_, builder.add(t0_, c64(k))) for k in range(TT)]
            acc = [cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16)) for _ in range(TT)]
            accm = [cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * 8)) for _ in range(TT)]
            prefetch = PREFETCH_BYTES and TT < 4
            if prefetch:
                pf = cgutils.get_or_insert_function(
                    mod, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
            with cgutils.for_range(builder, nb_) as loop:
                b = loop.index
                base = builder.gep(wrow, [builder.mul(b, c64(bsz))])
                if prefetch:
                    for k in range(0, bsz, 64):
                        builder.call(pf, [builder.gep(base, [c64(PREFETCH_BYTES + k)]), ir.Constant(_I32, 0),
                                          ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
                wv, sv = [], []  # per 64 values: codes <64 x i8>, scales <32 x i16>
                if t in (12, 13):  # Q4_K / Q5_K: d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
                    d = _half_at(builder, base, 0)
                    dmin = _half_at(builder, base, 2)
                    u = [_load(builder, base, c64(4 + 4 * k), _I32) for k in range(3)]
                    k1, k2, k3 = (ir.Constant(_I32, m) for m in (0x3F3F3F3F, 0x0F0F0F0F, 0x03030303))
                    sh = lambda v, n: builder.lshr(v, ir.Constant(_I32, n))  # noqa: E731
                    sc_hi = builder.or_(builder.and_(u[2], k2),
                                        builder.shl(builder.and_(sh(u[0], 6), k3), ir.Constant(_I32, 4)))
                    mn_hi = builder.or_(builder.and_(sh(u[2], 4), k2),
                                        builder.shl(builder.and_(sh(u[1], 6), k3), ir.Constant(_I32, 4)))
                    v2 = _vec(_I32, 2)
                    pack = lambda a, c: builder.zext(builder.bitcast(  # noqa: E731
                        builder.insert_element(builder.insert_element(ir.Constant(v2, ir.Undefined), a,
                                                                      ir.Constant(_I32, 0)), c, ir.Constant(_I32, 1)),
                        v8i8), v8i16)
                    sc8 = pack(builder.and_(u[0], k1), sc_hi)
                    mn8 = pack(builder.and_(u[1], k1), mn_hi)
                    mins = builder.shuffle_vector(mn8, mn8, _const_vec(_I32, [j // 2 for j in range(16)]))
                    qs0 = 48 if t == 13 else 16
                    if t == 13:
                        qh = _load(builder, base, c64(16), v32i8)
                    for c in range(4):
                        raw = _load(builder, base, c64(qs0 + 32 * c), v32i8)
                        lo = builder.and_(raw, splat8(15))
                        hi = builder.lshr(raw, splat8(4))
                        if t == 13:
                            one = splat8(1)
                            lo = builder.or_(lo, builder.shl(builder.and_(builder.lshr(qh, splat8(2 * c)), one), splat8(4)))
                            hi = builder.or_(hi, builder.shl(builder.and_(builder.lshr(qh, splat8(2 * c + 1)), one), splat8(4)))
                        wv.append(builder.shuffle_vector(lo, hi, cat))
                        sv.append(builder.shuffle_vector(sc8, sc8, _const_vec(_I32, [2 * c] * 16 + [2 * c + 1] * 16)))
                else:  # Q6_K: ql[128], qh[64], scales[16] int8, d
                    d = _half_at(builder, base, 208)
                    sc16 = builder.sext(_load(builder, base, c64(192), v16i8), v16i16)
                    three = splat8(3)
                    for h in range(2):
                        ql0 = _load(builder, base, c64(64 * h), v32i8)
                        ql1 = _load(builder, base, c64(64 * h + 32), v32i8)
                        qh = _load(builder, base, c64(128 + 32 * h), v32i8)
                        hb = [builder.shl(builder.and_(builder.lshr(qh, splat8(2 * s)), three), splat8(4))
                              for s in range(4)]
                        q1 = builder.or_(builder.and_(ql0, splat8(15)), hb[0])
                        q2 = builder.or_(builder.and_(ql1, splat8(15)), hb[1])
                        q3 = builder.or_(builder.lshr(ql0, splat8(4)), hb[2])
                        q4 = builder.or_(builder.lshr(ql1, splat8(4)), hb[3])
                        for part, (qa, qb) in enumerate(((q1, q2), (q3, q4))):
                            wv.append(builder.shuffle_vector(qa, qb, cat))
                            s0 = 8 * h + 4 * part
                            sv.append(builder.shuffle_vector(sc16, sc16, _const_vec(
                                _I32, [s0 + j // 8 for j in range(32)])))
                for k in range(TT):
                    xbase = builder.gep(xrow[k], [builder.mul(b, c64(KQ_BLOCK))])
                    isum = None
                    for c in range(4):
                        p = prod(wv[c], _load(builder, xbase, c64(64 * c), v64i8), sv[c])
                        isum = p if isum is None else builder.add(isum, p)
                    bs = _load(builder, xbrow[k], builder.mul(b, c64(32)), v16i16, 2)
                    xd = _load(builder, xdrow[k], builder.mul(b, c64(4)), _F32, 4)
                    if t == 14:  # the codes' "- 32": 32 * sum_j sc_j * bsum_j off the lanes 0-7
                        corr = builder.shl(madd16(sc16, bs), ir.Constant(v8i32, [5] * 8))
                        isum = builder.sub(isum, builder.shuffle_vector(
                            corr, ir.Constant(v8i32, [0] * 8), _const_vec(_I32, range(16))))
                    else:
                        m = builder.sitofp(madd16(mins, bs), v8f)
                        builder.store(builder.call(fma8, [m, _splat(builder, _strict(builder.fmul(dmin, xd)), 8),
                                                          builder.load(accm[k])]), accm[k])
                    s = _splat(builder, _strict(builder.fmul(d, xd)), 16)
                    builder.store(builder.call(fma16, [builder.sitofp(isum, v16f), s, builder.load(acc[k])]), acc[k])
            for k in range(TT):
                r = _tree_sum(builder, builder.load(acc[k]))
                if t != 14:
                    r = _strict(builder.fsub(r, _tree_sum(builder, builder.load(accm[k]))))
                orow = builder.bitcast(_row_ptr(context, builder, tys[7], out_, builder.add(t0_, c64(k))),
                                       _F32.as_pointer())
                builder.store(r, builder.gep(orow, [o_]))
            return context.get_dummy_value()
        return sig, codegen
    tile.__name__ = f"_kq{t}_tile_{TT}"
    return intrinsic(tile)


def _make_row(t: int):
    """``row(xq, xd, xb, w, o, out)``: every token of row o of type t (tiles of _TT, then one
    tile of the remaining 1-3 tokens)."""
    t4, t3, t2, t1 = (_make_kq_tile(t, n) for n in (4, 3, 2, 1))

    @njit(inline="always", **_KW)
    def row(xq, xd, xb, w, o, out):
        T = xq.shape[0]
        nb = xd.shape[1]
        k = 0
        while k + _TT <= T:
            t4(xq, xd, xb, w, o, k, nb, out)
            k += _TT
        n = T - k
        if n == 3:
            t3(xq, xd, xb, w, o, k, nb, out)
        elif n == 2:
            t2(xq, xd, xb, w, o, k, nb, out)
        elif n == 1:
            t1(xq, xd, xb, w, o, k, nb, out)
    return row


if KQ_SIMD:
    _row_q4k, _row_q5k, _row_q6k = _make_row(12), _make_row(13), _make_row(14)
else:  # never called (the callers check KQ_SIMD); plain numba so that the kernels still compile
    @njit(inline="always", **_KW)
    def _row_q4k(xq, xd, xb, w, o, out):
        raise ValueError("the K-quant integer kernels need AVX2")
    _row_q5k = _row_q6k = _row_q4k


@njit(inline="always", **_KW)
def _kq_row(t, xq, xd, xb, w, o, out):
    if t == 12:
        _row_q4k(xq, xd, xb, w, o, out)
    elif t == 13:
        _row_q5k(xq, xd, xb, w, o, out)
    else:
        _row_q6k(xq, xd, xb, w, o, out)


# --- kernels -----------------------------------------------------------------------------------

@njit(parallel=True, **_KW)
def linear_kq(x, w, t, out):
    """out[T, O] = q8k(x)[T, N] @ W^T for W's rows of K-quant type ``t`` (12 Q4_K, 13 Q5_K, 14
    Q6_K) in w uint8 [O, >= N / 256 * block bytes]; x float32 [T, N], N a multiple of 256."""
    xq, xd, xb = _q8k_prepare(x)
    O = out.shape[1]
    for c in prange((O + _ROWS - 1) // _ROWS):
        for o in range(c * _ROWS, min(O, (c + 1) * _ROWS)):
            _kq_row(t, xq, xd, xb, w, o, out)


@njit(inline="always", **_KW)
def _silu_mul(g, u):
    return _smul(_sdiv(g, _sadd(np.float32(1.0), _exp32(-g))), u)


@njit(parallel=True, **_KW)
def expert_kq(x, tg, tu, td, gw, uw, dw, hg, hu, out):
    """out[T, D] = down(silu(gate(x)) * up(x)) on K-quant rows: gw, uw uint8 [I, *] of types
    tg, tu, dw uint8 [D, *] of type td (12 / 13 / 14); x float32 [T, D]; hg, hu float32 [T, I]
    scratch (hg ends holding the down projection's input). D and I multiples of 256."""
    I = gw.shape[0]
    D = dw.shape[0]
    xq, xd, xb = _q8k_prepare(x)
    T = x.shape[0]
    for c in prange((I + _ROWS - 1) // _ROWS):
        i1 = min(I, (c + 1) * _ROWS)
        for i in range(c * _ROWS, i1):  # the chunk's gate rows, then its up rows: one stream at a time
            _kq_row(tg, xq, xd, xb, gw, i, hg)
        for i in range(c * _ROWS, i1):
            _kq_row(tu, xq, xd, xb, uw, i, hu)
        for i in range(c * _ROWS, i1):
            for k in range(T):
                hg[k, i] = _silu_mul(hg[k, i], hu[k, i])
    hq, hd, hb = _q8k_prepare(hg)
    for c in prange((D + _ROWS - 1) // _ROWS):
        for o in range(c * _ROWS, min(D, (c + 1) * _ROWS)):
            _kq_row(td, hq, hd, hb, dw, o, out)


@njit(parallel=True, **_KW)
def experts_kq_t1(x, arena, offs, wgu, wdn, h, hu, out):
    """n K-quant experts on one row, reading their GGUF-born slabs in the expert cache's arena:
    out[k] = expert_kq(x, expert k) for k < n, bit for bit (the same tiles on the same rows; h
    quantized row by row as expert_kq quantizes its one row).

    x float32 [1, D]; arena uint8 [bytes]; offs int64 [>= n, 4]: byte offsets in arena of expert
    k's slab header (its ggml types: gate, up, down, each 12 / 13 / 14), gate_proj.q [I, wgu]
    uint8, up_proj.q [I, wgu], down_proj.q [D, wdn]; h, hu float32 [n, I] scratch; out float32
    [n, D]; n = out.shape[0]. One parallel loop over every expert's gate / up rows, one over
    their down rows: the threads stream the n experts back to back (one call per expert forks
    and joins twice per expert)."""
    n, D = out.shape
    I = h.shape[1]
    xq, xd, xb = _q8k_prepare(x)
    nci = (I + _ROWS - 1) // _ROWS
    for u in prange(n * nci):
        k = u // nci
        c = u - k * nci
        base = offs[k, 0]
        tg, tu = arena[base], arena[base + 1]
        gw = arena[offs[k, 1]:offs[k, 1] + I * wgu].reshape((I, wgu))
        uw = arena[offs[k, 2]:offs[k, 2] + I * wgu].reshape((I, wgu))
        hk, uk = h[k:k + 1], hu[k:k + 1]
        i1 = min(I, (c + 1) * _ROWS)
        for i in range(c * _ROWS, i1):
            _kq_row(tg, xq, xd, xb, gw, i, hk)
        for i in range(c * _ROWS, i1):
            _kq_row(tu, xq, xd, xb, uw, i, uk)
        for i in range(c * _ROWS, i1):
            h[k, i] = _silu_mul(h[k, i], hu[k, i])
    hq, hd, hb = _q8k_prepare(h)
    ncd = (D + _ROWS - 1) // _ROWS
    for u in prange(n * ncd):
        k = u // ncd
        c = u - k * ncd
        td = arena[offs[k, 0] + 2]
        dw = arena[offs[k, 3]:offs[k, 3] + D * wdn].reshape((D, wdn))
        qk, dk, bk, ok = hq[k:k + 1], hd[k:k + 1], hb[k:k + 1], out[k:k + 1]
        for o in range(c * _ROWS, min(D, (c + 1) * _ROWS)):
            _kq_row(td, qk, dk, bk, dw, o, ok)


@njit(parallel=True, **_KW)
def experts_kq_sorted(x, tok, starts, arena, offs, wgu, wdn, nch, h, hu, out):
    """Routed K-quant experts of a prefill chunk, reading their GGUF-born slabs in the arena:
    out[m] = expert_kq(x[tok[m]]) of the expert entry m belongs to, bit for bit (each entry's
    row quantized on its own, the expert's entries through the same tiles in the same order).

    x float32 [T, D]; tok int64 [M] the row of x of each (token, rank) entry, grouped by expert:
    entries starts[e] .. starts[e + 1] - 1 go to expert e (starts int64 [n + 1]); offs int64 [n,
    4] as experts_kq_t1's; h, hu float32 [M, I] scratch; out float32 [M, D]; nch: work shares
    (the calling thread's kernel threads), share c taking rows c * I / nch .. of every expert
    (balanced whatever the experts' token counts), one fork and join for all the experts."""
    M = tok.shape[0]
    n = starts.shape[0] - 1
    D = x.shape[1]
    I = h.shape[1]
    xq = np.empty((M, D), np.int8)
    xd = np.empty((M, D // KQ_BLOCK), np.float32)
    xb = np.empty((M, D // 16), np.int16)
    for m in prange(M):
        _q8k_row(x[tok[m]], xq[m], xd[m], xb[m])
    for ch in prange(nch):
        i0, i1 = ch * I // nch, (ch + 1) * I // nch
        for e in range(n):
            lo, hi = starts[e], starts[e + 1]
            if hi == lo:
                continue
            tg, tu = arena[offs[e, 0]], arena[offs[e, 0] + 1]
            gw = arena[offs[e, 1]:offs[e, 1] + I * wgu].reshape((I, wgu))
            uw = arena[offs[e, 2]:offs[e, 2] + I * wgu].reshape((I, wgu))
            q, d, b = xq[lo:hi], xd[lo:hi], xb[lo:hi]
            for i in range(i0, i1):
                _kq_row(tg, q, d, b, gw, i, h[lo:hi])
            for i in range(i0, i1):
                _kq_row(tu, q, d, b, uw, i, hu[lo:hi])
            for i in range(i0, i1):
                for t in range(lo, hi):
                    h[t, i] = _silu_mul(h[t, i], hu[t, i])
    hq, hd, hb = _q8k_prepare(h)
    for ch in prange(nch):
        o0, o1 = ch * D // nch, (ch + 1) * D // nch
        for e in range(n):
            lo, hi = starts[e], starts[e + 1]
            if hi == lo:
                continue
            td = arena[offs[e, 0] + 2]
            dw = arena[offs[e, 3]:offs[e, 3] + D * wdn].reshape((D, wdn))
            q, d, b, oe = hq[lo:hi], hd[lo:hi], hb[lo:hi], out[lo:hi]
            for o in range(o0, o1):
                _kq_row(td, q, d, b, dw, o, oe)
