"""RMSNorm, rotary embedding, the 16-bit KV cache's stores and attention (prefill by query
blocks, with or without a per-head sink)."""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .setup import _FM, _KW
from .tiles import _const_vec, _exp32, _F32, _I16, _I32, _I64, _sadd, _smul, _strict, _vec


# --- normalisation, rotary embedding, attention -------------------------------------------

@njit(**_KW)
def rmsnorm(x, w, eps, out):
    """out[T, N] = x * rsqrt(mean(x^2) + eps) * w  (float32, as transformers' OlmoeRMSNorm)."""
    n = x.shape[1]
    for t in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(n):
            ss += x[t, i] * x[t, i]
        r = np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(n) + np.float32(eps)))
        for i in range(n):
            out[t, i] = w[i] * (x[t, i] * r)


@njit(**_KW)
def rope(x, cos, sin):
    """In place, x[T, H, S] rotated by the "rotate-half" RoPE of transformers' Llama/OLMoE:
    pairs (j, j + S/2) with angle pos * theta^(-2j/S); cos/sin [T, S/2] for the T positions."""
    half = x.shape[2] // 2
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for j in range(half):
                a = x[t, h, j]
                b = x[t, h, j + half]
                x[t, h, j] = a * cos[t, j] - b * sin[t, j]
                x[t, h, j + half] = b * cos[t, j] + a * sin[t, j]


@intrinsic
def _kv_f32(typingctx, v):
    """The float32 value of one KV-cache element: float32 as is, uint16 as IEEE half bits
    (exact widening; LLVM turns a loop of them into vcvtph2ps)."""
    if isinstance(v, types.Integer) and v.bitwidth == 16:
        def cg(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)
        return types.float32(v), cg
    if v == types.float32:
        def cg_id(context, builder, signature, args):
            return args[0]
        return types.float32(v), cg_id
    return None


@intrinsic
def _f32_bits(typingctx, v):
    """The IEEE bits of a float32 as uint32 (a bitcast, no conversion)."""
    if v != types.float32:
        return None

    def cg(context, builder, signature, args):
        return builder.bitcast(args[0], _I32)
    return types.uint32(v), cg


F16_MAX = np.float32(65504.0)  # the largest finite IEEE half


@njit(inline="always", **_KW)
def _f16_bits(v):
    """IEEE half bits (uint16) of float32 v clipped to [-65504, 65504], rounded to nearest,
    ties to even; NaN stays NaN. Integer arithmetic only (any CPU, no F16C needed), and bit
    for bit numpy's ``np.clip(v, -65504, 65504).astype(np.float16)`` (numpy's
    npy_floatbits_to_halfbits, the IEEE 754 rounding; tests/test_kernels.py compares them on
    every exponent, the rounding ties and the subnormal halves)."""
    if v > F16_MAX:
        v = F16_MAX
    elif v < -F16_MAX:
        v = -F16_MAX
    f = _f32_bits(v)
    sgn = (f >> np.uint32(16)) & np.uint32(0x8000)
    e = f & np.uint32(0x7F800000)
    if e == np.uint32(0x7F800000):  # NaN (inf was clipped): keep a NaN, payload's top bits
        sig = (f & np.uint32(0x007FFFFF)) >> np.uint32(13)
        if sig == 0:
            sig = np.uint32(1)
        return np.uint16(sgn | np.uint32(0x7C00) | sig)
    if e <= np.uint32(0x38000000):  # |v| < 2^-14: a subnormal half, or zero
        if e < np.uint32(0x33000000):  # below half the smallest subnormal: signed zero
            return np.uint16(sgn)
        ex = e >> np.uint32(23)
        m = np.uint32(0x00800000) | (f & np.uint32(0x007FFFFF))
        sh = np.uint32(126) - ex  # 14..24: bits shifted out of the half's 10-bit significand
        half = np.uint32(1) << (sh - np.uint32(1))
        rest = m & ((np.uint32(1) << sh) - np.uint32(1))
        h = m >> sh
        if rest > half or (rest == half and (h & np.uint32(1))):
            h += np.uint32(1)
        return np.uint16(sgn | h)
    # normal: rebias the exponent, round the significand's 13 dropped bits (a carry may
    # roll into the exponent, which is the correctly rounded result)
    h = ((e - np.uint32(0x38000000)) >> np.uint32(13)) | ((f & np.uint32(0x007FFFFF)) >> np.uint32(13))
    rest = f & np.uint32(0x1FFF)
    if rest > np.uint32(0x1000) or (rest == np.uint32(0x1000) and (h & np.uint32(1))):
        h += np.uint32(1)
    return np.uint16(sgn | h)


@njit(inline="always", **_KW)
def _f16_rows(src, dst):
    """dst[b, s] = _f16_bits(src[b, s]) for float32 src [B, S], uint16 dst [B, S]."""
    for b in range(src.shape[0]):
        for s in range(src.shape[1]):
            dst[b, s] = _f16_bits(src[b, s])


@njit(parallel=True, **_KW)
def kv_put_f16(src, dst):
    """dst[a, b, s] = the IEEE half bits of src[a, b, s] clipped to the finite half range
    (:func:`_f16_bits`: numpy's rounding, bit for bit): how K and V rows enter an f16 KV cache.
    src float32 [A, B, S], dst uint16 [A, B, S], any strides (a transposed view of the cache
    slice the rows go to). One call instead of numpy's clip + astype + strided copy (~1 ms per
    decode token of OLMoE-1B-7B's 16 layers). Rows a in parallel when there are many."""
    A, B, S = src.shape
    if A * B * S >= 65536:
        for a in prange(A):
            _f16_rows(src[a], dst[a])
    else:  # a decode step's rows: no parallel launch
        for a in range(A):
            _f16_rows(src[a], dst[a])


def _f32_at(builder, ary, i):
    """float* to element i of a contiguous float32 array struct ``ary``."""
    return builder.gep(builder.bitcast(ary.data, _F32.as_pointer()), [i])


def _kv_vec8(builder, aty, ary, off):
    """8 float32 lanes of a contiguous 1-D KV-side array from element ``off``: float32 as is,
    uint16 IEEE half bits widened exactly (vcvtph2ps)."""
    if aty.dtype == types.uint16:
        p = builder.bitcast(builder.gep(builder.bitcast(ary.data, _I16.as_pointer()), [off]),
                            _vec(_I16, 8).as_pointer())
        return builder.fpext(builder.bitcast(builder.load(p, align=2), _vec(ir.HalfType(), 8)), _vec(_F32, 8))
    p = builder.bitcast(_f32_at(builder, ary, off), _vec(_F32, 8).as_pointer())
    return builder.load(p, align=4)


def _kv_scalar(builder, aty, ary, i):
    v = builder.load(builder.gep(builder.bitcast(ary.data, _I16.as_pointer() if aty.dtype == types.uint16
                                                  else _F32.as_pointer()), [i]))
    return builder.fpext(builder.bitcast(v, ir.HalfType()), _F32) if aty.dtype == types.uint16 else v


def _contig_kv_pair(x, k):
    return (isinstance(x, types.Array) and isinstance(k, types.Array) and x.ndim == 1 and k.ndim == 1
            and x.layout == "C" and k.layout == "C" and x.dtype == types.float32
            and k.dtype in (types.float32, types.uint16))


@intrinsic
def _dot8(typingctx, x, k):
    """:func:`_dot_kv` on contiguous rows as explicit 8-lane vectors: lane r is the lane sum
    a_r of _dot_kv (strict products and sums, dims i = r mod 8 in order), the tail joins lane 0,
    then the same pairwise total. Per lane the same IEEE operations, so the same bits; LLVM did
    not vectorize the scalar lanes (scalar vmulss / vaddss in the attention kernel)."""
    if not _contig_kv_pair(x, k):
        return None

    def codegen(context, builder, signature, args):
        xty, kty = signature.args
        xa = context.make_array(xty)(context, builder, value=args[0])
        ka = context.make_array(kty)(context, builder, value=args[1])
        n = builder.extract_value(xa.shape, 0)
        v8 = _vec(_F32, 8)
        acc = cgutils.alloca_once_value(builder, ir.Constant(v8, [0.0] * 8))
        with cgutils.for_range(builder, builder.lshr(n, ir.Constant(_I64, 3))) as loop:
            off = builder.shl(loop.index, ir.Constant(_I64, 3))
            xp = builder.bitcast(_f32_at(builder, xa, off), v8.as_pointer())
            prod = _strict(builder.fmul(builder.load(xp, align=4), _kv_vec8(builder, kty, ka, off)))
            builder.store(_strict(builder.fadd(builder.load(acc), prod)), acc)
        lanes = [builder.extract_element(builder.load(acc), ir.Constant(_I32, r)) for r in range(8)]
        a0 = cgutils.alloca_once_value(builder, lanes[0])
        n8 = builder.shl(builder.lshr(n, ir.Constant(_I64, 3)), ir.Constant(_I64, 3))
        with cgutils.for_range_slice(builder, n8, n, ir.Constant(_I64, 1), inc=True) as (i, _):
            xi = builder.load(_f32_at(builder, xa, i))
            builder.store(_strict(builder.fadd(builder.load(a0), _strict(builder.fmul(xi, _kv_scalar(builder, kty, ka, i))))), a0)
        a = [builder.load(a0)] + lanes[1:]
        add = lambda u, v: _strict(builder.fadd(u, v))  # noqa: E731
        return add(add(add(a[0], a[4]), add(a[1], a[5])), add(add(a[2], a[6]), add(a[3], a[7])))
    return types.float32(x, k), codegen


@intrinsic
def _axpy8(typingctx, o, p, v):
    """o[d] = o[d] + p * v[d] for every d (o float32 contiguous [S], v a contiguous KV row), each
    product and sum one IEEE rounding, 8 lanes at a time: the weighted-value step of attention."""
    if not (_contig_kv_pair(o, v) and p == types.float32):
        return None

    def codegen(context, builder, signature, args):
        oty, _, vty = signature.args
        oa = context.make_array(oty)(context, builder, value=args[0])
        va = context.make_array(vty)(context, builder, value=args[2])
        n = builder.extract_value(oa.shape, 0)
        v8 = _vec(_F32, 8)
        pv = builder.insert_element(ir.Constant(v8, ir.Undefined), args[1], ir.Constant(_I32, 0))
        pv = builder.shuffle_vector(pv, ir.Constant(v8, ir.Undefined), _const_vec(_I32, [0] * 8))
        with cgutils.for_range(builder, builder.lshr(n, ir.Constant(_I64, 3))) as loop:
            off = builder.shl(loop.index, ir.Constant(_I64, 3))
            op = builder.bitcast(_f32_at(builder, oa, off), v8.as_pointer())
            prod = _strict(builder.fmul(pv, _kv_vec8(builder, vty, va, off)))
            builder.store(_strict(builder.fadd(builder.load(op, align=4), prod)), op, align=4)
        n8 = builder.shl(builder.lshr(n, ir.Constant(_I64, 3)), ir.Constant(_I64, 3))
        with cgutils.for_range_slice(builder, n8, n, ir.Constant(_I64, 1), inc=True) as (i, _):
            op = _f32_at(builder, oa, i)
            prod = _strict(builder.fmul(args[1], _kv_scalar(builder, vty, va, i)))
            builder.store(_strict(builder.fadd(builder.load(op), prod)), op)
        return context.get_dummy_value()
    return types.void(o, p, v), codegen


@njit(inline="always", **_KW)
def _dot_kv_lanes(x, k):
    """x . k (x float32 [S], k a KV row) in a fixed order: 8 lane sums over i = lane mod 8, then
    the tail, then a fixed pairwise sum of the lanes, every product and sum strict. Left to
    fastmath, the reduction's order was chosen by LLVM and differed between the process that
    compiled the attention kernel and one that loaded it from numba's cache (AMD Zen 3: 1246 of
    2048 outputs). The scalar form, for rows that are not contiguous; :func:`_dot8` otherwise."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    n8 = (x.shape[0] // 8) * 8
    for i in range(0, n8, 8):
        a0 = _sadd(a0, _smul(x[i], _kv_f32(k[i])))
        a1 = _sadd(a1, _smul(x[i + 1], _kv_f32(k[i + 1])))
        a2 = _sadd(a2, _smul(x[i + 2], _kv_f32(k[i + 2])))
        a3 = _sadd(a3, _smul(x[i + 3], _kv_f32(k[i + 3])))
        a4 = _sadd(a4, _smul(x[i + 4], _kv_f32(k[i + 4])))
        a5 = _sadd(a5, _smul(x[i + 5], _kv_f32(k[i + 5])))
        a6 = _sadd(a6, _smul(x[i + 6], _kv_f32(k[i + 6])))
        a7 = _sadd(a7, _smul(x[i + 7], _kv_f32(k[i + 7])))
    for i in range(n8, x.shape[0]):
        a0 = _sadd(a0, _smul(x[i], _kv_f32(k[i])))
    return _sadd(_sadd(_sadd(a0, a4), _sadd(a1, a5)), _sadd(_sadd(a2, a6), _sadd(a3, a7)))


def _dot_kv(x, k):
    """x . k (x float32 [S], k a float32 or IEEE-half KV row [S]) in the fixed order of
    :func:`_dot_kv_lanes`: explicit 8-lane vectors (:func:`_dot8`) for contiguous rows."""
    raise NotImplementedError("called from numba kernels only")


@overload(_dot_kv, inline="always", jit_options={"fastmath": _FM})
def _ol_dot_kv(x, k):
    if _contig_kv_pair(x, k):
        return lambda x, k: _dot8(x, k)
    return lambda x, k: _dot_kv_lanes(x, k)


def _axpy_kv(o, p, v):
    """o[:] = o + p * v (strict products and sums) for float32 o [S] and a KV row v [S]."""
    raise NotImplementedError("called from numba kernels only")


@overload(_axpy_kv, inline="always", jit_options={"fastmath": _FM})
def _ol_axpy_kv(o, p, v):
    if _contig_kv_pair(o, v):
        return lambda o, p, v: _axpy8(o, p, v)

    def scalar(o, p, v):
        for d in range(o.shape[0]):
            o[d] = _sadd(o[d], _smul(p, _kv_f32(v[d])))
    return scalar


ATT_QB = 8  # queries of one head attended together in a prefill: each K / V row widened once for them


@njit(inline="always", **_KW)
def _attend_block(q, kc, vc, pos0, scale, sink, use_sink, t0, nq, h, kh, out):
    """Causal attention of queries t0..t0+nq-1 of query head h over KV head kh (see
    :func:`attention`), the block's queries together: each key and value row is widened to
    float32 once for all of them (a decode step, nq = 1, reads the cache as it is). Every
    output element runs the operations of one query alone in the same order (each score
    :func:`_dot_kv`, the running maximum over keys in order, the exponentials, their strict sum
    in key order, the weighted values strictly summed in key order), so the values do not
    depend on the block, on T or on the thread count. ``sink``: gpt-oss's sink logit (used
    when ``use_sink``), one more logit of the softmax whose value row is zero."""
    S = q.shape[2]
    if nq == 1:  # a decode step (or a last lone query): the cache rows read as they are
        n = pos0 + t0 + 1
        s1 = np.empty(n, dtype=np.float32)
        m1 = sink if use_sink else np.float32(-np.inf)
        for j in range(n):
            v = _smul(_dot_kv(q[t0, h], kc[kh, j]), scale)
            s1[j] = v
            if v > m1:
                m1 = v
        tot = _exp32(sink - m1) if use_sink else np.float32(0.0)
        for j in range(n):
            e = _exp32(s1[j] - m1)
            s1[j] = e
            tot = _sadd(tot, e)  # strict, in key order: no fresh-vs-cached rounding (see _exp32)
        inv1 = np.float32(1.0) / tot
        for d in range(S):
            out[t0, h, d] = 0.0
        for j in range(n):
            _axpy_kv(out[t0, h], _smul(s1[j], inv1), vc[kh, j])  # strict products and sums: see _dot_kv
        return
    nmax = pos0 + t0 + nq  # keys seen by the block's last query
    sc = np.empty((nq, nmax), np.float32)
    m = np.empty(nq, np.float32)
    for i in range(nq):
        m[i] = sink if use_sink else np.float32(-np.inf)
    row = np.empty(S, np.float32)
    for j in range(nmax):
        i0 = max(0, j - pos0 - t0)  # the first query of the block that sees key j
        for d in range(S):
            row[d] = _kv_f32(kc[kh, j, d])
        for i in range(i0, nq):
            v = _smul(_dot_kv(q[t0 + i, h], row), scale)
            sc[i, j] = v
            if v > m[i]:
                m[i] = v
    inv = np.empty(nq, np.float32)
    for i in range(nq):
        n = pos0 + t0 + i + 1
        mi = m[i]
        for j in range(n):  # no reduction in this loop: the exponentials vectorize
            sc[i, j] = _exp32(sc[i, j] - mi)
        tot = _exp32(sink - mi) if use_sink else np.float32(0.0)
        for j in range(n):
            tot = _sadd(tot, sc[i, j])  # strict, in key order: no fresh-vs-cached rounding (see _exp32)
        inv[i] = np.float32(1.0) / tot
        for d in range(S):
            out[t0 + i, h, d] = 0.0
    for j in range(nmax):
        i0 = max(0, j - pos0 - t0)
        for d in range(S):
            row[d] = _kv_f32(vc[kh, j, d])
        for i in range(i0, nq):
            _axpy_kv(out[t0 + i, h], _smul(sc[i, j], inv[i]), row)


@njit(inline="always", **_KW)
def _att_task(k, H, nblk):
    """(query block, head) of task k of a prange over nblk * H: blocks in the order 0, last, 1,
    last - 1, ..., so the contiguous share of tasks each thread gets holds about as many
    (query, key) pairs as the others' (in query order the last share did ~3x the first's)."""
    kb = k // H
    b = kb // 2 if kb % 2 == 0 else nblk - 1 - kb // 2
    return b, k - kb * H


@njit(parallel=True, **_KW)
def attention(q, kc, vc, pos0, scale, out):
    """Causal attention of T new queries at positions pos0..pos0+T-1 over the KV cache.

    q float32 [T, H, S]; kc, vc [Hkv, C, S] float32, or uint16 holding IEEE half bits (the
    16-bit KV cache: widened exactly to float32 as they are read); positions < pos0 + T
    already written; out float32 [T, H, S]. Grouped-query: query head h reads KV head
    h // (H // Hkv). Scores, softmax and the weighted sum are float32 whatever the cache
    holds. Queries run in blocks of ATT_QB per head (:func:`_attend_block`), values unchanged.
    """
    T, H, S = q.shape
    rep = H // kc.shape[0]
    nblk = (T + ATT_QB - 1) // ATT_QB
    for k in prange(nblk * H):
        b, h = _att_task(k, H, nblk)
        t0 = b * ATT_QB
        _attend_block(q, kc, vc, pos0, scale, np.float32(0.0), False, t0, min(ATT_QB, T - t0), h, h // rep, out)


@njit(parallel=True, **_KW)
def attention_sink(q, kc, vc, pos0, scale, sinks, out):
    """:func:`attention` with a learned sink logit per query head (gpt-oss): sinks float32 [H]
    joins each head's softmax as one more logit whose value row is zero, so the weights of the
    real keys sum to less than one: p_j = exp(s_j - m) / (sum_i exp(s_i - m) + exp(sink_h - m)),
    m the largest of the scores and the sink (transformers' models/gpt_oss eager_attention_forward:
    softmax over [scores, sink], sink column dropped)."""
    T, H, S = q.shape
    rep = H // kc.shape[0]
    nblk = (T + ATT_QB - 1) // ATT_QB
    for k in prange(nblk * H):
        b, h = _att_task(k, H, nblk)
        t0 = b * ATT_QB
        _attend_block(q, kc, vc, pos0, scale, np.float32(sinks[h]), True, t0, min(ATT_QB, T - t0), h, h // rep,
                      out)
