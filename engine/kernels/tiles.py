"""The integer kernels' building blocks: one-row dot products, the LLVM vector helpers and
strict float operations behind the numba intrinsics (AVX-512 VNNI ``vpdpbusd``, AVX-512BW / AVX2
``vpmaddubsw``), the activations' quantization per block, the register tiles (R weight rows x
TT tokens per pass) and the float32 exponential every kernel uses.

int8 and int4: the activation rows are quantized once per call to int8 per block
(32 columns for q8, the weight group for q4; llama.cpp's Q8_0 activations) and the block dot
products are integer: AVX-512 VNNI ``vpdpbusd`` through numba intrinsics (LLVM vector IR) on
CPUs that have it (``INT_FLAVOR`` "vnni"), AVX-512BW ``vpmaddubsw`` for q4 ("bw"), AVX2
``vpmaddubsw`` on 256-bit halves for q4 and q8 ("avx2": AMD before Zen 4, Intel desktop chips
since Alder Lake), plain vectorizable numba loops on the dequantized activations elsewhere
("portable", several times slower than "avx2"). Every path
computes the same real-valued expression, quantize_activations(x) @ dequant(W)^T, which is
what kernels_ref computes. The SIMD paths run register tiles (see "register tiles" below): one
pass over R weight rows serves TT tokens, with R x TT independent accumulators, and the
nibbles' "- 8" (q4) and the unsigned activations' "+ 128" (q8) are folded into vpdpbusd's
start values, so a group costs one vpdpbusd, one int -> float conversion, one multiply and one
FMA per (row, token). At T = 1 the weights come from DRAM, and there one row-major row per
pass (the 1 x 1 tile) streams faster than R rows at once (docs/decisions/0002-int4-interleaved-layout.md).
So token rows that do not fill a token tile run 1 x 1 per weight row (_q4_block_pairs).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .setup import INT_FLAVOR, _KW


# --- dot products (one row) ----------------------------------------------------------------

@njit(inline="always", **_KW)
def _dot_f32(x, w):
    acc = np.float32(0.0)
    for i in range(x.shape[0]):
        acc += x[i] * w[i]
    return acc


@njit(inline="always", **_KW)
def _dot_f16(x, w, lut):
    acc = np.float32(0.0)
    for i in range(x.shape[0]):
        acc += x[i] * lut[w[i]]
    return acc


@njit(inline="always", **_KW)
def _dot_q8(x, w, s):
    acc = np.float32(0.0)
    for i in range(x.shape[0]):
        acc += x[i] * np.float32(w[i])
    return acc * s


# --- LLVM vector helpers for the integer kernels' intrinsics -----------------------------

_I8, _I16, _I32, _I64, _F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                                ir.FloatType())


def _vec(t, n):
    return ir.VectorType(t, n)


def _const_vec(t, values):
    return ir.Constant(_vec(t, len(values)), list(values))


# --- strict float operations --------------------------------------------------------------
#
# The kernels compile with reassoc / contract / arcp so that LLVM may vectorize float
# reductions. Under those flags the same expression can round differently in two compiled
# copies: contraction into an FMA and reassociation depend on the code around it, and on this
# CPU the process that compiled a kernel and a later process that loaded the same kernel from
# numba's cache disagreed in the last bit of an int4 row with an odd group count (_q4_finish):
# a token stream then changed between the first run after install and every later run, and
# experts_q4_t1 (the decode hits) and expert_q4 (the misses) disagreed, so the cache size
# changed the output (CI, Sapphire Rapids). Code whose bits must not depend on where it is
# compiled (SiLU, exp, the per-element scale and tail of the integer tiles) uses these: one
# IEEE instruction each, flagged only ``nsz``. numba's fastmath pass adds its flags only to
# float instructions that have none, so these keep exactly IEEE rounding (nsz changes no
# nonzero result), vectorized or not, inlined or not, fresh or cached.

_STRICT_FLAG = "nsz"


def _strict(instr):
    """Mark a float instruction strict (see above) and return it."""
    instr.flags.append(_STRICT_FLAG)
    return instr


def _strict_binop(op: str):
    def impl(typingctx, a, b):
        if isinstance(a, types.Float) and a == b:
            def codegen(context, builder, signature, args):
                return _strict(getattr(builder, op)(args[0], args[1]))
            return a(a, b), codegen
        return None
    impl.__name__ = "_s" + op[1:]
    impl.__doc__ = f"a {op[1:]} b for two floats of one type, rounded once (IEEE, no fastmath)."
    return intrinsic(impl)


_sadd, _smul, _sdiv = (_strict_binop(op) for op in ("fadd", "fmul", "fdiv"))


@intrinsic
def _sc(typingctx, a, i):
    """Element i of a 1-D int4 group-scale array as float32: uint16 IEEE half bits (store
    format 3) widened (vcvtph2ps), float32 (older stores) as is."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype in (types.uint16, types.float32)):
        return None
    sig = types.float32(a, types.intp)

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, value=args[0])
        v = builder.load(cgutils.get_item_pointer(context, builder, aty, ary, [args[1]]))
        if aty.dtype == types.uint16:
            return builder.fpext(builder.bitcast(v, ir.HalfType()), _F32)
        return v
    return sig, codegen


def _tree_sum(builder, v):
    """Sum of the lanes of a float vector in a fixed pairwise order (deterministic)."""
    width = v.type.count
    while width > 1:
        half = width // 2
        v = _strict(builder.fadd(builder.shuffle_vector(v, v, _const_vec(_I32, range(half))),
                                 builder.shuffle_vector(v, v, _const_vec(_I32, range(half, width)))))
        width = half
    return builder.extract_element(v, ir.Constant(_I32, 0))


# --- q8: activations quantized per block of 32 (llama.cpp's Q8_0), integer dot products -------
#
# Each activation row x [N] is quantized per block of 32 columns (the last block may be
# shorter) to int8: d = max|x_b| / 127, q = rint(x * (127 / max|x_b|)); the x the weights meet
# is q * d (kernels_ref.quantize_activations). With VNNI the block dot products run as
# vpdpbusd(q + 128, w) - 128 * vpdpbusd(1, w): unsigned activation bytes times signed weights.

@njit(inline="always", **_KW)
def _quant_group(x, lo, gs):
    """(d, 127 / max|x|) of x[lo:lo + gs] (0, 0 for an all-zero group). A NaN in the group
    makes d NaN (and an inf makes it inf), so a non-finite activation reaches the output as the
    float kernels let it, instead of vanishing in the int8 cast (the engine's NaN check relies
    on it)."""
    m = np.float32(0.0)
    bad = False
    for j in range(lo, lo + gs):
        a = abs(x[j])
        if a != a:
            bad = True
        m = max(m, a)
    if bad:
        return np.float32(np.nan), np.float32(0.0)
    if m == 0:
        return np.float32(0.0), np.float32(0.0)
    return m / np.float32(127.0), np.float32(127.0) / m


QB = 32  # activation block of the q8 kernels (columns)


_Q8_SIMD = INT_FLAVOR in ("vnni", "avx2")


@njit(inline="always", **_KW)
def _q8_prep(x, simd, xu, xs, xf):
    """Quantize x [N] per block of QB: xs [NB] scales; xu [N] = q + 128 (simd) or xf [N] =
    q * d (portable)."""
    N = x.shape[0]
    for b in range(xs.shape[0]):
        lo = b * QB
        n = min(QB, N - lo)
        d, inv = _quant_group(x, lo, n)
        xs[b] = d
        if simd:
            for j in range(lo, lo + n):
                xu[j] = np.int32(np.rint(x[j] * inv)) + 128
        else:
            for j in range(lo, lo + n):
                xf[j] = np.float32(np.rint(x[j] * inv)) * d


@njit(inline="always", **_KW)
def _q8_prepare(x):
    """Quantize the rows of x [T, N] once per call: (simd, xu, xs, xf), unused arrays empty."""
    T, N = x.shape
    simd = _Q8_SIMD
    xu = np.empty((T, N if simd else 0), np.uint8)
    xf = np.empty((T, 0 if simd else N), np.float32)
    xs = np.empty((T, (N + QB - 1) // QB), np.float32)
    if T >= 8:
        for t in prange(T):
            _q8_prep(x[t], simd, xu[t], xs[t], xf[t])
    else:
        for t in range(T):
            _q8_prep(x[t], simd, xu[t], xs[t], xf[t])
    return simd, xu, xs, xf


@njit(inline="always", **_KW)
def _q8_out(P, w, s, o, t):
    """Element (t, o) of quantize_activations(x) @ (w * s)^T for x prepared as P (portable
    path; the SIMD path runs through the register tiles below)."""
    simd, xu, xs, xf = P
    return _dot_q8(xf[t], w[o], s[o])


# --- q4: activations quantized like llama.cpp's Q8_0, integer dot products --------------------
#
# Per call, each activation row x [N] is quantized per weight group (gs columns) to int8:
# d = max|x_g| / 127, q = rint(x * (127 / max|x_g|)), the x the weights meet is q * d (exactly
# what kernels_ref.quantize_activations does). A group's dot product is then
# d * s_w * sum_j q_j * (nibble_j - 8) = d * s_w * (sum_j q_j * nibble_j - 8 * sum_j q_j):
# unsigned nibbles times signed bytes, the operand shape of AVX-512 VNNI's vpdpbusd, with the
# "- 8" folded into each int32 lane's start value, -8 times the sum of the q that lane meets
# (_q4_prep_simd, once per activation row).

@njit(inline="always", **_KW)
def _q4_prep_simd(x, xq, xs, c):
    """Quantize x [N] (gs = 32) into the layout of the q4 tiles (_make_q4_tile). xq int8
    [>= 2N]: per pair of groups (A, B), 128 bytes [E, E, O, O] with E the even columns of A (16)
    then of B (16) and O their odd columns: E meets the low nibbles of a row's 32 packed
    bytes, O the high nibbles, each written twice so that a 512-bit register of two rows'
    nibbles meets one plain 64-byte load; a last unpaired group holds [16 even | 16 odd] at
    byte 128 * (G // 2). xs [G] scales. c int32 [>= 16 * (G // 2)]: per pair, 8 lane starts
    written twice: lane j is -8 times the sum of the q in bytes 4j..4j+3 of E and of O (what
    lane j of a row meets), so a lane sums q * (nibble - 8) exactly in int32."""
    G = xs.shape[0]
    npairs = G // 2
    for g in range(G):
        d, inv = _quant_group(x, g * 32, 32)
        xs[g] = d
        if g < 2 * npairs:
            base, odd = (g // 2) * 128 + (g % 2) * 16, 64
        else:
            base, odd = npairs * 128, 16
        for j in range(16):
            qe = np.int32(np.rint(x[g * 32 + 2 * j] * inv))
            qo = np.int32(np.rint(x[g * 32 + 2 * j + 1] * inv))
            xq[base + j] = qe
            xq[base + odd + j] = qo
            if g < 2 * npairs:
                xq[base + 32 + j] = qe
                xq[base + odd + 32 + j] = qo
    for i in range(npairs):
        for j in range(8):
            acc = np.int32(0)
            for b in range(4):
                acc += np.int32(xq[128 * i + 4 * j + b]) + np.int32(xq[128 * i + 64 + 4 * j + b])
            c[16 * i + j] = -8 * acc
            c[16 * i + 8 + j] = -8 * acc


@njit(inline="always", **_KW)
def _q4_prep_portable(x, gs, xe, xo):
    """Quantize x [N] per group of gs like _q4_prep_simd, but keep the dequantized values
    q * d as float32, split into even (xe) and odd (xo) columns [N / 2]."""
    hg = gs // 2
    for g in range(x.shape[0] // gs):
        d, inv = _quant_group(x, g * gs, gs)
        for j in range(hg):
            xe[g * hg + j] = np.float32(np.rint(x[g * gs + 2 * j] * inv)) * d
            xo[g * hg + j] = np.float32(np.rint(x[g * gs + 2 * j + 1] * inv)) * d


@njit(inline="always", **_KW)
def _q4_dot_portable(xe, xo, w, s, sh, hg):
    """One q4 row: xe, xo float32 [N/2], w uint8 [N/2], s [G]. sh = log2(gs / 2) when gs / 2 is
    a power of two (one unit-stride loop LLVM vectorizes), else -1 (a loop per group)."""
    acc = np.float32(0.0)
    if sh >= 0:
        for k in range(w.shape[0]):
            b = np.int32(w[k])
            acc += _sc(s, k >> sh) * (xe[k] * np.float32((b & 15) - 8) + xo[k] * np.float32((b >> 4) - 8))
    else:
        for g in range(s.shape[0]):
            sc = _sc(s, g)
            for k in range(g * hg, (g + 1) * hg):
                b = np.int32(w[k])
                acc += sc * (xe[k] * np.float32((b & 15) - 8) + xo[k] * np.float32((b >> 4) - 8))
    return acc


@njit(inline="always", **_KW)
def _q4_shift(gs):
    """log2(gs / 2) if gs / 2 is a power of two, else -1."""
    hg = gs // 2
    if hg > 0 and (hg & (hg - 1)) == 0:
        sh = 0
        while (1 << sh) < hg:
            sh += 1
        return sh
    return -1


_Q4_SIMD = INT_FLAVOR != "portable"


@njit(inline="always", **_KW)
def _q4_prepare_row(x, gs, simd, t, xq, xs, c, xe, xo):
    if simd:
        _q4_prep_simd(x[t], xq[t], xs[t], c[t])
    else:
        _q4_prep_portable(x[t], gs, xe[t], xo[t])


@njit(inline="always", **_KW)
def _q4_prepare(x, gs):
    """Quantize the rows of x [T, N] once per call: (simd, xq, xs, c, xe, xo), the arrays of
    the path not taken empty. Rows in parallel when there are enough of them."""
    T, N = x.shape
    simd = _Q4_SIMD and gs == 32
    xq = np.empty((T, 2 * N if simd else 0), np.int8)
    xs = np.empty((T, N // gs), np.float32)
    c = np.empty((T, N // 4 if simd else 0), np.int32)
    xe = np.empty((T, 0 if simd else N // 2), np.float32)
    xo = np.empty((T, 0 if simd else N // 2), np.float32)
    if T >= 8:
        for t in prange(T):
            _q4_prepare_row(x, gs, simd, t, xq, xs, c, xe, xo)
    else:
        for t in range(T):
            _q4_prepare_row(x, gs, simd, t, xq, xs, c, xe, xo)
    return simd, xq, xs, c, xe, xo


@njit(inline="always", **_KW)
def _q4_out(P, w, s, sh, hg, o, t):
    """Element (t, o) of quantize_activations(x) @ dequant(w, s)^T for x prepared as P (portable
    path; the SIMD path runs through the register tiles below)."""
    simd, xq, xs, c, xe, xo = P
    return _q4_dot_portable(xe[t], xo[t], w[o], s[o], sh, hg)


# --- register tiles: R weight rows x TT tokens per pass over the weights ------------
#
# One pass over the packed weights of R rows computes the pair sums for TT tokens at once: each
# row's nibbles are unpacked once per 64 columns and met by TT activation rows, each activation
# chunk is loaded once and met by R weight rows, and the R x TT accumulators are independent
# chains (the T = 1 loop of one row had a single chain of dependent FMAs). Every (row, token)
# element runs exactly the operations of a 1 x 1 tile in the same order: integer dot products of a
# group pair, int32 -> float, times xs * ws (lanes broadcast per group), fused multiply-add into
# float lanes (8 per row for q4, _make_q4_tile; 16 for q8), the lanes summed in a fixed tree
# order. Results therefore do not depend on the
# tile shape, on T, or on the thread count (tests/test_kernels.py checks it bit for bit).

def _row_ptr(context, builder, aryty, val, row):
    """i8* to the first byte of row ``row`` of a 2-D array value."""
    ary = context.make_array(aryty)(context, builder, value=val)
    strides = cgutils.unpack_tuple(builder, ary.strides, aryty.ndim)
    base = builder.bitcast(ary.data, _I8.as_pointer())
    return builder.gep(base, [builder.mul(row, strides[0])])


def _load_at(builder, base, byte_off, vty, align):
    return builder.load(builder.bitcast(builder.gep(base, [byte_off]), vty.as_pointer()), align=align)


PREFETCH_BYTES = 8192  # software prefetch distance (bytes ahead in each weight row) of the T = 1 tiles
PREFETCH_TT = 4  # tiles of fewer tokens than this prefetch their weights (decode tiles, prefill tails of 1-3 tokens)


def _lane_dot_fn(builder, flavor, nb):
    """``lane_dot(start, u, s)`` on nb-byte vectors (nb 32 or 64): start int32 [nb / 4] plus, per
    dword lane, the sum of its 4 byte products u (unsigned) * s (signed), exact in int32. vnni:
    vpdpbusd (never saturates); bw / avx2: vpmaddubsw, whose pair sums saturate at 16 bits, then
    vpmaddwd (256-bit halves on avx2); portable: plain IR. Callers keep the pair sums in range:
    the int4 tiles (nibbles <= 15 times |q| <= 127), the q8 tile on avx2 (|w| <= 128 times
    |q| <= 127, llama.cpp's sign trick); the q8 tile runs vnni or portable otherwise."""
    mod = builder.module
    nl = nb // 4
    vb, vd = _vec(_I8, nb), _vec(_I32, nl)
    if flavor == "vnni":
        dp = cgutils.get_or_insert_function(mod, ir.FunctionType(vd, [vd, vb, vb]),
                                            f"llvm.x86.avx512.vpdpbusd.{nb * 8}")
        return lambda start, u, s: builder.call(dp, [start, u, s])
    if flavor in ("bw", "avx2"):
        v16i16, v8i32, v32i8 = _vec(_I16, 16), _vec(_I32, 8), _vec(_I8, 32)
        if flavor == "bw" and nb == 64:
            v32i16 = _vec(_I16, 32)
            mub = cgutils.get_or_insert_function(mod, ir.FunctionType(v32i16, [vb, vb]), "llvm.x86.avx512.pmaddubs.w.512")
            mwd = cgutils.get_or_insert_function(mod, ir.FunctionType(vd, [v32i16, v32i16]), "llvm.x86.avx512.pmaddw.d.512")
            ones = _const_vec(_I16, [1] * 32)
            return lambda start, u, s: builder.add(start, builder.call(mwd, [builder.call(mub, [u, s]), ones]))
        mub2 = cgutils.get_or_insert_function(mod, ir.FunctionType(v16i16, [v32i8, v32i8]), "llvm.x86.avx2.pmadd.ub.sw")
        mwd2 = cgutils.get_or_insert_function(mod, ir.FunctionType(v8i32, [v16i16, v16i16]), "llvm.x86.avx2.pmadd.wd")
        ones16 = _const_vec(_I16, [1] * 16)
        if nb == 32:
            return lambda start, u, s: builder.add(start, builder.call(mwd2, [builder.call(mub2, [u, s]), ones16]))
        lo32, hi32 = _const_vec(_I32, range(32)), _const_vec(_I32, range(32, 64))

        def lane_dot(start, u, s):
            half = [builder.call(mwd2, [builder.call(mub2, [builder.shuffle_vector(u, u, m),
                                                            builder.shuffle_vector(s, s, m)]), ones16])
                    for m in (lo32, hi32)]
            return builder.add(start, builder.shuffle_vector(half[0], half[1], _const_vec(_I32, range(16))))
        return lane_dot
    vw = _vec(_I32, nb)

    def lane_dot(start, u, s):  # portable: plain LLVM IR, any target
        prod = builder.mul(builder.zext(u, vw), builder.sext(s, vw))
        for k in range(4):
            start = builder.add(start, builder.shuffle_vector(prod, prod, _const_vec(_I32, range(k, nb, 4))))
        return start
    return lane_dot


def _make_q4_tile(R: int, TT: int, il: int = 0):
    """The int4 register tile (``_make_int_tile("q4", ...)``): rows o0..o0+R-1, tokens
    t0..t0+TT-1, the group-pair sums written to res[r, t0 + t].

    Lanes. Each row's 32 packed bytes of a group pair are one 8-lane unit: dword lane j (bytes
    4j..4j+3) meets the low nibbles with bytes 4j.. of the pair's E block (_q4_prep_simd: the
    even columns) and the high nibbles with bytes 4j.. of its O block (the odd columns), two
    integer dot products into one int32 lane that starts at xc's -8 * sum(q) of both, so it
    holds sum (nibble - 8) * q exactly. Lanes 0-3 belong to the pair's first group, 4-7 to
    its second; each lane is converted to float, multiplied by xs[t, g] * ws[o, g] (rounded
    once) and fused-multiply-added into its float lane; after the last pair a row's 8 lanes are
    summed in a fixed tree order. Two rows side by side fill a 512-bit register (16 lanes), a
    last odd row runs 256-bit: the same lane operations, so the bits depend on neither R, TT,
    T nor the thread count. Per pair and token, a register of two rows (128 multiply-adds)
    costs two integer dot products, one conversion, one multiply and one FMA; the 16-lane-per-row
    layout before took one dot product, conversion, multiply and FMA per row (64). Measured on this project's AMD EPYC
    Zen 4 host (tools/micro_linear_q4.py: linear_q4i on [1024, 2048] and [2048, 1024], T = 128,
    best of 5, in one run): one thread 48.9 / 42.7 -> 65.7 / 54.4 G multiply-adds/s, two
    threads 85.3 / 78.9 -> 128.7 / 109.8; the doubled E / O blocks and lane starts of
    _q4_prep_simd let both rows' register meet plain 64-byte loads (broadcasting 32 bytes per
    token cost ~+10%), and 4-row tiles (_TR4) share each token's loads between two registers.

    Arguments as _make_int_tile's kind "q4": xa int8 [T, >= 128 npairs] (_q4_prep_simd), xs
    float32 [T, G], xc int32 [T, >= 16 npairs] (_q4_prep_simd's lane starts), w uint8 [O, >= 32
    npairs] or, with ``il``, [O / il, npairs, il * 32] (rows o0..o0+R-1 in one group of il),
    ws [O, G] uint16 half bits or float32."""
    def tile(typingctx, xa, xs, xc, w, ws, o0, t0, npairs, res):
        sig = types.void(xa, xs, xc, w, ws, types.intp, types.intp, types.intp, res)

        def codegen(context, builder, signature, args):
            tys = signature.args
            xa_, xs_, xc_, w_, ws_, o0_, t0_, np_, res_ = args
            half_scales = tys[4].dtype == types.uint16
            mod = builder.module
            c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
            v2f = _vec(_F32, 2)
            units = [(r, 2) for r in range(0, R - 1, 2)] + ([(R - 1, 1)] if R % 2 else [])
            widths = sorted({n for _, n in units})
            dots = {n: _lane_dot_fn(builder, INT_FLAVOR, 32 * n) for n in widths}
            fmas = {n: cgutils.get_or_insert_function(mod, ir.FunctionType(_vec(_F32, 8 * n), [_vec(_F32, 8 * n)] * 3),
                                                      f"llvm.fma.v{8 * n}f32") for n in widths}
            if il:  # rows o0.. inside group o0 // il: pair i of row r at i * il * 32 + r * 32
                gbase = _row_ptr(context, builder, tys[3], w_, builder.sdiv(o0_, c64(il)))
                first = builder.mul(builder.srem(o0_, c64(il)), c64(32))
                wrow = [builder.gep(gbase, [builder.add(first, c64(32 * r))]) for r in range(R)]
            else:
                wrow = [_row_ptr(context, builder, tys[3], w_, builder.add(o0_, c64(r))) for r in range(R)]
            wstep = 32 * il if il else 32  # bytes from one pair of a row to its next
            wsrow = [_row_ptr(context, builder, tys[4], ws_, builder.add(o0_, c64(r))) for r in range(R)]
            xrow = [_row_ptr(context, builder, tys[0], xa_, builder.add(t0_, c64(t))) for t in range(TT)]
            xsrow = [_row_ptr(context, builder, tys[1], xs_, builder.add(t0_, c64(t))) for t in range(TT)]
            xcrow = [_row_ptr(context, builder, tys[2], xc_, builder.add(t0_, c64(t))) for t in range(TT)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, 8 * n), [0.0] * (8 * n)))
                     for _ in range(TT)] for _, n in units]
            prefetch = PREFETCH_BYTES and TT < PREFETCH_TT  # decode, and prefill experts few tokens chose
            if prefetch:
                pf = cgutils.get_or_insert_function(
                    mod, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
            lanes8 = [0] * 4 + [1] * 4
            with cgutils.for_range(builder, np_) as loop:
                i = loop.index
                woff = builder.mul(i, c64(wstep))
                if prefetch:
                    # one prefetch per row stream; interleaved: one per 64-byte line of the group's
                    # il x 32 bytes of this pair (a prefetch per pair of one row left half the lines
                    # of a 4-row group to the hardware: 30.9 vs 45.1 GB/s from DRAM, 2 threads)
                    heads = [(gbase, builder.add(woff, c64(PREFETCH_BYTES + 64 * k))) for k in range(max(1, il // 2))] \
                        if il else [(wrow[r], builder.add(woff, c64(PREFETCH_BYTES))) for r in range(R)]
                    for ptr, off in heads:
                        builder.call(pf, [builder.gep(ptr, [off]), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                          ir.Constant(_I32, 1)])
                wlo, whi, wb = [], [], []
                for r, n in units:
                    if n == 2 and il:  # the two rows' pairs are adjacent: one 64-byte load
                        raw = _load_at(builder, wrow[r], woff, _vec(_I8, 64), 1)
                    elif n == 2:
                        raw = builder.shuffle_vector(_load_at(builder, wrow[r], woff, _vec(_I8, 32), 1),
                                                     _load_at(builder, wrow[r + 1], woff, _vec(_I8, 32), 1),
                                                     _const_vec(_I32, range(64)))
                    else:
                        raw = _load_at(builder, wrow[r], woff, _vec(_I8, 32), 1)
                    wlo.append(builder.and_(raw, _const_vec(_I8, [15] * (32 * n))))
                    whi.append(builder.lshr(raw, _const_vec(_I8, [4] * (32 * n))))
                    b2 = []
                    for k in range(n):  # the two group scales of this pair, per row
                        if half_scales:
                            b2.append(builder.fpext(builder.bitcast(
                                _load_at(builder, wsrow[r + k], builder.mul(i, c64(4)), _vec(_I16, 2), 2),
                                _vec(ir.HalfType(), 2)), v2f))
                        else:
                            b2.append(_load_at(builder, wsrow[r + k], builder.mul(i, c64(8)), v2f, 4))
                    if n == 2:
                        wb.append(builder.shuffle_vector(b2[0], b2[1], _const_vec(_I32, lanes8 + [2] * 4 + [3] * 4)))
                    else:
                        wb.append(builder.shuffle_vector(b2[0], ir.Constant(v2f, ir.Undefined), _const_vec(_I32, lanes8)))
                tok = []  # per token: {width: (low-nibble q, high-nibble q, lane starts, lane x scales)}
                for t in range(TT):
                    x0 = builder.mul(i, c64(128))  # _q4_prep_simd: [E, E, O, O] per pair, starts twice
                    a2 = _load_at(builder, xsrow[t], builder.mul(i, c64(8)), v2f, 4)
                    per = {}
                    for n in widths:
                        per[n] = (_load_at(builder, xrow[t], x0, _vec(_I8, 32 * n), 1),
                                  _load_at(builder, xrow[t], builder.add(x0, c64(64)), _vec(_I8, 32 * n), 1),
                                  _load_at(builder, xcrow[t], builder.mul(i, c64(64)), _vec(_I32, 8 * n), 4),
                                  builder.shuffle_vector(a2, ir.Constant(v2f, ir.Undefined), _const_vec(_I32, lanes8 * n)))
                    tok.append(per)
                for u, (r, n) in enumerate(units):
                    for t in range(TT):
                        xlo, xhi, st, xb = tok[t][n]
                        p32 = dots[n](dots[n](st, wlo[u], xlo), whi[u], xhi)
                        sc = _strict(builder.fmul(xb, wb[u]))
                        acc = accs[u][t]
                        builder.store(builder.call(fmas[n], [builder.sitofp(p32, _vec(_F32, 8 * n)), sc,
                                                             builder.load(acc)]), acc)
            for u, (r, n) in enumerate(units):
                for k in range(n):
                    rp = builder.bitcast(_row_ptr(context, builder, tys[8], res_, c64(r + k)), _F32.as_pointer())
                    for t in range(TT):
                        v = builder.load(accs[u][t])
                        part = builder.shuffle_vector(v, v, _const_vec(_I32, range(8 * k, 8 * k + 8))) if n == 2 else v
                        builder.store(_tree_sum(builder, part), builder.gep(rp, [builder.add(t0_, c64(t))]))
            return context.get_dummy_value()
        return sig, codegen
    tile.__name__ = f"_q4_tile_{R}x{TT}" + (f"_il{il}" if il else "")
    return intrinsic(tile)


def _make_int_tile(kind: str, R: int, TT: int, il: int = 0):
    """An intrinsic ``tile(xa, xs, xc, w, ws, o0, t0, npairs, res)`` for rows o0..o0+R-1 of w and
    tokens t0..t0+TT-1, writing the pair sums (before any tail / correction) to
    res[r, t0 + t] (res float32 2-D, row r of the tile).

    kind "q4": built by :func:`_make_q4_tile` (its docstring has the operands and lanes; ``il``,
    the row-interleaved layout of :func:`interleave_q4`, is q4 only).
    kind "q8": xa uint8 [T, >= 64 npairs] = q + 128, xs float32 [T, NB] block scales, w int8
    [O, >= 64 npairs]; xc and ws unused (the row scale is applied by the caller): the sum over
    block pairs of xs[t, b] * sum_j q_j * w_j."""
    if kind == "q4":
        return _make_q4_tile(R, TT, il)
    assert kind == "q8" and not il

    def tile(typingctx, xa, xs, xc, w, ws, o0, t0, npairs, res):
        sig = types.void(xa, xs, xc, w, ws, types.intp, types.intp, types.intp, res)

        def codegen(context, builder, signature, args):
            tys = signature.args
            xa_, xs_, _, w_, _, o0_, t0_, np_, res_ = args  # xc, ws: unused by q8
            mod = builder.module
            v64i8, v32i8, v16i32, v16f, v2f = (_vec(_I8, 64), _vec(_I8, 32), _vec(_I32, 16), _vec(_F32, 16),
                                               _vec(_F32, 2))
            c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
            # q8 runs vnni or avx2 (_Q8_SIMD), and elsewhere compiles the plain-IR version, which
            # the portable q8 kernels never call but LLVM must still be able to select
            flavor = INT_FLAVOR if INT_FLAVOR in ("vnni", "avx2") else "portable"
            lane_dot = _lane_dot_fn(builder, flavor, 64)
            lo32, hi32 = _const_vec(_I32, range(32)), _const_vec(_I32, range(32, 64))
            if flavor == "avx2":
                # the signed weights through llama.cpp's sign trick: |w| times q with w's sign
                # (vpsignb; pairs <= 2 * 128 * 127 < 32767, no saturation)
                psign = cgutils.get_or_insert_function(mod, ir.FunctionType(v32i8, [v32i8, v32i8]),
                                                       "llvm.x86.avx2.psign.b")

                def sign_by(a, b):  # a with b's sign (0 where b is 0), per byte
                    halves = [builder.call(psign, [builder.shuffle_vector(a, a, m),
                                                   builder.shuffle_vector(b, b, m)]) for m in (lo32, hi32)]
                    return builder.shuffle_vector(halves[0], halves[1], _const_vec(_I32, range(64)))
            fma = cgutils.get_or_insert_function(mod, ir.FunctionType(v16f, [v16f, v16f, v16f]),
                                                 "llvm.fma.v16f32")
            zero = ir.Constant(v16i32, [0] * 16)
            lanes = _const_vec(_I32, [0] * 8 + [1] * 8)
            wrow = [_row_ptr(context, builder, tys[3], w_, builder.add(o0_, c64(r))) for r in range(R)]
            xrow = [_row_ptr(context, builder, tys[0], xa_, builder.add(t0_, c64(t))) for t in range(TT)]
            xsrow = [_row_ptr(context, builder, tys[1], xs_, builder.add(t0_, c64(t))) for t in range(TT)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16)) for _ in range(TT)]
                    for _ in range(R)]
            prefetch = PREFETCH_BYTES and TT < PREFETCH_TT  # decode, and prefill rows few tokens meet
            if prefetch:
                pf = cgutils.get_or_insert_function(
                    mod, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0i8")
            with cgutils.for_range(builder, np_) as loop:
                i = loop.index
                i8 = builder.mul(i, c64(8))  # two float32 scales per pair
                if prefetch:  # one prefetch per row stream
                    for r in range(R):
                        builder.call(pf, [builder.gep(wrow[r], [builder.add(builder.mul(i, c64(64)), c64(PREFETCH_BYTES))]),
                                          ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
                wv, wb = [], []
                for r in range(R):
                    raw = _load_at(builder, wrow[r], builder.mul(i, c64(64)), v64i8, 1)
                    wv.append(raw)
                    if flavor == "avx2":  # |w| (as unsigned bytes); q gets w's sign below
                        wb.append(sign_by(raw, raw))
                    else:
                        # start value -128 * sum(w) per lane: (q + 128) * w summed from it is q * w
                        wsum = lane_dot(zero, _const_vec(_I8, [1] * 64), raw)
                        wb.append(builder.sub(zero, builder.shl(wsum, _const_vec(_I32, [7] * 16))))
                xv, xb = [], []
                for t in range(TT):
                    xv.append(_load_at(builder, xrow[t], builder.mul(i, c64(64)), v64i8, 1))
                    a2 = _load_at(builder, xsrow[t], i8, v2f, 4)
                    xb.append(builder.shuffle_vector(a2, ir.Constant(v2f, ir.Undefined), lanes))
                for r in range(R):
                    for t in range(TT):
                        if flavor == "avx2":  # q = (q + 128) xor 128 as a signed byte
                            q = builder.xor(xv[t], _const_vec(_I8, [-128] * 64))
                            p32 = lane_dot(zero, wb[r], sign_by(q, wv[r]))
                        else:
                            p32 = lane_dot(wb[r], xv[t], wv[r])
                        acc = accs[r][t]
                        builder.store(builder.call(fma, [builder.sitofp(p32, v16f), xb[t], builder.load(acc)]), acc)
            for r in range(R):
                rp = builder.bitcast(_row_ptr(context, builder, tys[8], res_, c64(r)), _F32.as_pointer())
                for t in range(TT):
                    builder.store(_tree_sum(builder, builder.load(accs[r][t])),
                                  builder.gep(rp, [builder.add(t0_, c64(t))]))
            return context.get_dummy_value()
        return sig, codegen
    tile.__name__ = f"_{kind}_tile_{R}x{TT}"
    return intrinsic(tile)


RB, TB = 4, 4  # row block of the tiled loops; token tile
# rows per token-tile pass of the q8 tiles in the row block: 2 (2 x 4 tiles, 8 accumulators of
# 16 lanes) on AVX-512's 32 vector registers; 1 on AVX2's 16. Measured with the then q4 tiles
# of the same shape (before _make_q4_tile): AMD EPYC Zen 3, one thread, linear_q4 at
# T = 4-64: by wall time 14-19 G multiply-adds/s with 2 x 4 and 18-26 with 1 x 4, but by
# thread CPU time (the suite running beside it) 1 x 2 to 2 x 4 all ran ~20: a weak preference
_TR = 1 if INT_FLAVOR == "avx2" else 2
# rows per pass of the int4 token tiles (_make_q4_tile): 4 (two 512-bit registers of rows per
# token, 8 accumulators for 4 tokens) with AVX-512's 32 vector registers; 2 on AVX2's 16, where
# a 2-row register is two 256-bit halves
_TR4 = 2 if INT_FLAVOR == "avx2" else RB
_q4_tile_rx4 = _make_int_tile("q4", _TR4, 4)
_q4_tile_1x4 = _make_int_tile("q4", 1, 4)
_q4_tile_1x1 = _make_int_tile("q4", 1, 1)
# Decode (T = 1) of a row-major matrix stays one weight row per pass: R rows are R short
# streams 1 KB apart, while 1 x 1 walks the row block as one sequential stream (a 4 x 1 tile made
# the decode experts ~40% slower). The row-interleaved layout (IL below) lets 4 rows share one
# stream. Variants tried and not kept are in docs/decisions/0002-int4-interleaved-layout.md.
_q8_tile_rx4 = _make_int_tile("q8", _TR, 4)
_q8_tile_1x4 = _make_int_tile("q8", 1, 4)
_q8_tile_1x1 = _make_int_tile("q8", 1, 1)


_q4_tile_1x3 = _make_int_tile("q4", 1, 3)
_q4_tile_1x2 = _make_int_tile("q4", 1, 2)
_q8_tile_1x3 = _make_int_tile("q8", 1, 3)
_q8_tile_1x2 = _make_int_tile("q8", 1, 2)


def _make_tail(tile3, tile2, tile1):
    """Tokens t..t+n-1 (n < TB) of the tiles' rows from o in one pass over them (R x n tiles,
    R = 1, or _TR4 for the interleaved int4 tails; nothing for n = 0): a prefill expert that
    2 or 3 tokens chose reads its weights once, not per token.
    One factory for the q4 and q8 tiles (same arguments: xa, xs, xc, w, ws, o0, t0, npairs, res)."""
    @njit(inline="always", **_KW)
    def tail(xa, xs, xc, w, ws, o, t, n, npairs, res):
        if n == 3:
            tile3(xa, xs, xc, w, ws, o, t, npairs, res)
        elif n == 2:
            tile2(xa, xs, xc, w, ws, o, t, npairs, res)
        elif n == 1:
            tile1(xa, xs, xc, w, ws, o, t, npairs, res)
    return tail


_q4_tail = _make_tail(_q4_tile_1x3, _q4_tile_1x2, _q4_tile_1x1)
_q8_tail = _make_tail(_q8_tile_1x3, _q8_tile_1x2, _q8_tile_1x1)


@njit(inline="always", **_KW)
def _q4_block_pairs(xq, xs, xc, w, ws, o0, nr, npairs, res):
    """Pair sums of rows o0..o0+nr-1 (nr <= RB) for every token into res[:nr, :T]."""
    T = xq.shape[0]
    if nr == RB:
        t = 0
        while t + TB <= T:
            for r2 in range(0, RB, _TR4):
                _q4_tile_rx4(xq, xs, xc, w, ws, o0 + r2, t, npairs, res[r2:])
            t += TB
        for r in range(RB):  # the last T % TB tokens: one weight row per pass (see RB), all of them at once
            _q4_tail(xq, xs, xc, w, ws, o0 + r, t, T - t, npairs, res[r:])
    else:
        for r in range(nr):
            t = 0
            while t + TB <= T:
                _q4_tile_1x4(xq, xs, xc, w, ws, o0 + r, t, npairs, res[r:])
                t += TB
            _q4_tail(xq, xs, xc, w, ws, o0 + r, t, T - t, npairs, res[r:])


@njit(inline="always", **_KW)
def _q8_block_pairs(xu, xs, w, o0, nr, npairs, res):
    """q8 twin of _q4_block_pairs (block pairs of 64 columns; row scales not applied)."""
    T = xu.shape[0]
    if nr == RB:
        t = 0
        while t + TB <= T:
            for r2 in range(0, RB, _TR):
                _q8_tile_rx4(xu, xs, xs, w, xs, o0 + r2, t, npairs, res[r2:])
            t += TB
        for r in range(RB):  # the last T % TB tokens: one weight row per pass (see RB), all of them at once
            _q8_tail(xu, xs, xs, w, xs, o0 + r, t, T - t, npairs, res[r:])
    else:
        for r in range(nr):
            t = 0
            while t + TB <= T:
                _q8_tile_1x4(xu, xs, xs, w, xs, o0 + r, t, npairs, res[r:])
                t += TB
            _q8_tail(xu, xs, xs, w, xs, o0 + r, t, T - t, npairs, res[r:])


@njit(inline="always", **_KW)
def _q4_finish(acc, xq, xs, w, ws):
    """A q4 element from its pair sum plus the last, unpaired group (odd G only)."""
    g = ws.shape[0] - 1
    base = (g // 2) * 128  # _q4_prep_simd's place of the unpaired group
    tot = 0
    for j in range(16):
        b = np.int32(w[g * 16 + j])
        tot += np.int32(xq[base + j]) * ((b & 15) - 8) + np.int32(xq[base + 16 + j]) * ((b >> 4) - 8)
    return _sadd(acc, _smul(np.float32(tot), _smul(xs[g], _sc(ws, g))))


@njit(inline="always", **_KW)
def _q8_finish(acc, xu, xs, w, s):
    """A q8 element from its pair sum: the columns after the last full pair, times the row
    scale, as _q8_out does."""
    N = w.shape[0]
    npairs = N // 64
    lo = npairs * 64
    b = npairs * 2
    while lo < N:
        hi = min(lo + QB, N)
        tot = 0
        for j in range(lo, hi):
            tot += (np.int32(xu[j]) - 128) * np.int32(w[j])
        acc = _sadd(acc, _smul(np.float32(tot), xs[b]))
        lo = hi
        b += 1
    return _smul(acc, s)


@njit(inline="always", **_KW)
def _q4_rows(P, w, s, o0, res):
    """Elements (t, o) for o in o0..o0+nr-1 (nr = min(RB, O - o0)), all t, into res[:nr, :T]
    (the SIMD path; P from _q4_prepare with simd True)."""
    simd, xq, xs, c, xe, xo = P
    nr = min(RB, w.shape[0] - o0)
    _q4_block_pairs(xq, xs, c, w, s, o0, nr, s.shape[1] // 2, res)
    if s.shape[1] % 2:
        for r in range(nr):
            for t in range(xq.shape[0]):
                res[r, t] = _q4_finish(res[r, t], xq[t], xs[t], w[o0 + r], s[o0 + r])


@njit(inline="always", **_KW)
def _q8_rows(P, w, s, o0, res):
    """q8 twin of _q4_rows (P from _q8_prepare with simd True)."""
    simd, xu, xs, xf = P
    nr = min(RB, w.shape[0] - o0)
    _q8_block_pairs(xu, xs, w, o0, nr, w.shape[1] // 64, res)
    for r in range(nr):
        for t in range(xu.shape[0]):
            res[r, t] = _q8_finish(res[r, t], xu[t], xs[t], w[o0 + r], s[o0 + r])




# --- exp: one float32 exponential for every kernel -----------------------------------------

_EXP_TAYLOR = (1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0,
               1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0)  # 1/12! .. 1/0!


@intrinsic
def _exp32(typingctx, x):
    """e**x of a float32 as float32, in plain arithmetic: no call to the C library.

    Every kernel's exponential (SiLU, softmax) goes through here. numba's ``math.exp`` links to
    the C library's ``exp``/``expf``, and which variant that symbol binds to differed between the
    process that compiled a kernel and a later process that loaded it from numba's cache: the
    attention kernel gave other bits at 64+ keys on the first run after install than on every
    run after it, so a whole token stream changed from its 48th decode token on (measured on
    OLMoE-1B-7B int4). Here: n = round(x / ln 2), r = x - n ln 2 in float64 (|r| <= 0.347,
    ln 2 split hi + lo with hi exact in 17 bits, Cody & Waite 1980), e**r by its Taylor series
    to degree 12 in Horner form (truncation < 1e-15 relative), times 2**n built from its bits;
    one rounding to float32, so within half a float32 ulp of e**x but for ties (equal to float64
    exp rounded to float32 on [-110, 90], tests/test_kernels.py). Returns 0 below -104 (under
    the smallest float32), inf above 88.8, NaN for NaN.

    Emitted as strict instructions inlined into the caller (see "strict float operations"):
    the same bits in every kernel, vectorized or scalar, compiled fresh or loaded from the
    cache, whatever fastmath flags the caller has."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        f64 = ir.DoubleType()
        c = lambda v: ir.Constant(f64, v)  # noqa: E731
        v = args[0]
        xd = builder.fpext(v, f64)
        nan = _strict(builder.fcmp_unordered("uno", v, v))
        lo = _strict(builder.fcmp_ordered("<", xd, c(-104.0)))
        hi = _strict(builder.fcmp_ordered(">", xd, c(88.8)))
        # the polynomial on x clamped to [-104, 88.8] (NaN -> 0): finite in every lane
        xc = builder.select(nan, c(0.0), builder.select(lo, c(-104.0), builder.select(hi, c(88.8), xd)))
        floor = builder.module.declare_intrinsic("llvm.floor", [f64])
        nf = builder.call(floor, [_strict(builder.fadd(_strict(builder.fmul(xc, c(1.4426950408889634))), c(0.5)))])
        r = _strict(builder.fsub(xc, _strict(builder.fmul(nf, c(0.693145751953125)))))
        r = _strict(builder.fsub(r, _strict(builder.fmul(nf, c(1.4286068202862268e-06)))))
        p = c(_EXP_TAYLOR[0])
        for k in _EXP_TAYLOR[1:]:
            p = _strict(builder.fadd(_strict(builder.fmul(p, r)), c(k)))
        n = builder.fptosi(nf, _I64)
        two_n = builder.bitcast(builder.shl(builder.add(n, ir.Constant(_I64, 1023)), ir.Constant(_I64, 52)), f64)
        res = builder.fptrunc(_strict(builder.fmul(p, two_n)), _F32)
        return builder.select(nan, v, builder.select(lo, ir.Constant(_F32, 0.0),
                                                     builder.select(hi, ir.Constant(_F32, float("inf")), res)))
    return types.float32(x), codegen
