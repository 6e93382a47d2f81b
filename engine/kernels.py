"""Numba kernels: the engine's whole arithmetic. The only module that imports numba.

Key: T tokens (rows), N input width, O output rows, D hidden, I expert width, H query heads,
Hkv key/value heads, S head size, C context capacity, E experts, G = N // group_size.

Every kernel is ``nogil=True`` so expert-loader threads run while it computes, writes into a
preallocated ``out``, and has a same-signature numpy twin in kernels_ref.py (the test oracle
and the fallback when numba is missing; tests/test_kernels.py compares every pair), except the
kernels of interleaved int4 weights (linear_q4i, linears_q4i, expert_q4i), which the fallback
never calls (it runs interleaved store slabs de-interleaved) and which tests compare bit for
bit with the row-major kernels instead. Each
output element is one dot product computed by the same inlined code whatever T is, so results
do not depend on T, on thread count, or on where an expert's bytes came from.

Weight kinds: f32 (w float32 [O, N]), f16 (w uint16 IEEE-half bits [O, N], decoded through a
65536-entry table), q8 (w int8 [O, N], s float32 [O]), q4 (w uint8 [O, N // 2], two values
per byte, low nibble = even column, value = nibble - 8; s [O, G] uint16 half bits, or float32 in stores before format 3;
or w interleaved by 4 rows, uint8 [O / 4, N / 64, 128]: engine.quant.interleave_q4), mxfp4 (w uint8
[O, N // 2] e2m1 codes, low nibble = even column; s uint8 [O, N // 32] e8m0 exponents).

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

Process-wide setup done here, before the first kernel compiles:

- numba's on-disk cache goes to the user cache folder (platformdirs), not next to the package:
  a read-only install with no writable home would otherwise fail at import with numba's "no
  locator available". ``NUMBA_CACHE_DIR`` set by the user wins; if no folder is writable the
  kernels compile uncached (``CACHE_DIR is None``).
- threading layer: OpenMP, then TBB, then numba's ``workqueue`` (unless the user set
  ``NUMBA_THREADING_LAYER``). ``workqueue`` aborts the process when two threads launch parallel
  kernels at once, so under it (``SERIALIZED``) every parallel kernel runs under one lock.
- OpenMP wait policy: spin a while, then sleep. Spinning threads fight any other busy program
  for its core, but ``OMP_WAIT_POLICY=PASSIVE`` pays a futex wake at each of the many small
  parallel regions of a token; instead the engine runs only as many threads as there are free
  cores (threads = 0: engine.sysinfo.FreeCores). The spin is shortened from libgomp's 300000
  to ``GOMP_SPINCOUNT=30000`` (unless the user set GOMP_SPINCOUNT or OMP_WAIT_POLICY):
  libgomp's default kept a core spinning ~5-8 ms after every parallel region while a
  streaming decode waited for the disk, and ~0.5 ms still covers the gaps between a token's
  kernels (docs/decisions/0005-compute-threads-auto.md).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import tempfile
import threading


# the cache folder, the integer-kernel path and the CPU features are worked out without numba
# (engine.kernel_facts) so that `colibri doctor` can report them without starting it
from .kernel_facts import (_cache_dir_problem, numba_cache_dir, _writable_dir,  # noqa: E402,F401
                           cpu_features, int_flavor as _int_flavor)


CACHE_DIR, CACHE_PROBLEM = numba_cache_dir()  # CACHE_PROBLEM: why CACHE_DIR is None ("" otherwise)
if CACHE_DIR is not None:
    os.environ["NUMBA_CACHE_DIR"] = CACHE_DIR
if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
    os.environ["NUMBA_THREADING_LAYER_PRIORITY"] = "omp tbb workqueue"
GOMP_SPINCOUNT_DEFAULT = "30000"  # see the module docstring; read by libgomp when it loads


def default_spin_env(environ) -> dict:
    """The environment the kernels' OpenMP threads get from the engine: GOMP_SPINCOUNT=30000
    unless ``environ`` (a mapping) sets GOMP_SPINCOUNT or OMP_WAIT_POLICY (the user's choice
    wins). Returns the variables to add ({} when none)."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return {}
    return {"GOMP_SPINCOUNT": GOMP_SPINCOUNT_DEFAULT}


os.environ.update(default_spin_env(os.environ))
_numba_was_loaded = "numba" in sys.modules

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic, overload  # noqa: E402

if _numba_was_loaded:  # numba read its config before us: apply the same choices directly
    if CACHE_DIR is not None:
        numba.config.CACHE_DIR = CACHE_DIR
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


def _start_threading_layer() -> str:
    """Start numba's thread pool now (one call of a tiny parallel kernel: numba's public way)
    and return the layer it chose ("omp", "tbb", "workqueue"), or "unknown" if none started."""
    try:
        # cached like every kernel, i.e. only when a cache folder is writable: cache=True with
        # none would make numba raise "no locator available" and leave the layer unstarted
        @njit(parallel=True, cache=CACHE_DIR is not None)
        def _touch(n):
            acc = 0
            for i in prange(n):
                acc += i
            return acc

        _touch(2)
        return str(numba.threading_layer())
    except Exception:  # noqa: BLE001 - no layer at all: kernels then run serialized
        return "unknown"


THREADING_LAYER = _start_threading_layer()
SERIALIZED = THREADING_LAYER not in ("omp", "tbb")  # workqueue (or unknown): not thread-safe



INT_FLAVOR = _int_flavor()


_FM = {"reassoc", "contract", "nsz", "arcp"}  # allow SIMD reductions; no inf/nan shortcuts
_KW = dict(nogil=True, fastmath=_FM,
           cache=CACHE_DIR is not None and not os.environ.get("COLIBRI_INT_KERNEL"))

F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


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
from .quant import IL, deinterleave_q4, interleave_q4  # noqa: E402,F401  (the layout lives with the store's)
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


# --- expert FFN: out[T, D] = down(silu(gate(x)) * up(x)) -----------------------------------

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


# --- routing: softmax top-k -----------------------------------------------------------------

@njit(inline="always", nogil=True, cache=_KW["cache"])  # no fastmath: the sums in order
def _route_row(lg, k, norm, idx, w, p):
    """One row of :func:`route_softmax` (lg [E] logits -> idx [k], w [k], p [E])."""
    E = lg.shape[0]
    m = lg[0]
    for e in range(1, E):
        if lg[e] > m:
            m = lg[e]
    tot = np.float32(0.0)
    for e in range(E):
        p[e] = _exp32(lg[e] - m)
        tot += p[e]
    for e in range(E):
        p[e] = p[e] / tot
    taken = np.zeros(E, np.bool_)
    for r in range(k):
        best = -1
        for e in range(E):  # strict >: the lowest id among equal probabilities
            if not taken[e] and (best < 0 or p[e] > p[best]):
                best = e
        taken[best] = True
        idx[r] = best
        w[r] = p[best]
    if norm:
        t = np.float32(0.0)
        for r in range(k):
            t += w[r]
        for r in range(k):
            w[r] = w[r] / t


@njit(nogil=True, cache=_KW["cache"])
def route_softmax(logits, k, norm, idx, w, p):
    """Softmax router, top-k: p = softmax(logits) per row (e**(z - max) by _exp32, summed in
    expert order in float32, each divided by the sum); idx = the k largest p, descending, the
    lowest id first among equal ones; w = their p, divided by their sum (summed in rank order)
    when ``norm`` (transformers' ``norm_topk_prob``). Bit-identical to kernels_ref.route_softmax
    (but for the sign of a NaN, which a row with a NaN logit gets everywhere).

    logits float32 [T, E]; idx int64 [T, k], w float32 [T, k], p float32 [T, E] outputs."""
    for t in range(logits.shape[0]):
        _route_row(logits[t], k, norm, idx[t], w[t], p[t])


# --- embeddings -------------------------------------------------------------------------

@njit(nogil=True, cache=_KW["cache"])  # no fastmath: no FMA contraction, numpy's rounding
def combine_ranked(y, w, out):
    """out[t] = y[t, 0] * w[t, 0] + y[t, 1] * w[t, 1] + ... in rank order, each product and
    each sum rounded to float32 (the same operations, in the same order, as numpy's
    ``out = y[:, 0] * w[:, 0:1]; out += y[:, k] * w[:, k:k + 1]``: bit-identical to it).

    y float32 [T, K, D] expert outputs by rank, w float32 [T, K] routing weights, out float32
    [T, D]. One call instead of 2K numpy operations per MoE layer."""
    T, Kk, D = y.shape
    for t in range(T):
        w0 = w[t, 0]
        for d in range(D):
            out[t, d] = y[t, 0, d] * w0
        for k in range(1, Kk):
            wk = w[t, k]
            for d in range(D):
                out[t, d] = out[t, d] + y[t, k, d] * wk


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


# --- the attention block of a decode step, in one call ---------------------------------------

# The kernels the composite below calls, bound to names the SERIALIZED rebinding (launch safety,
# the end of this module) leaves alone: numba resolves an njit function's globals when it compiles.
_k_rmsnorm, _k_linears_q4i, _k_linear_q4i, _k_rope, _k_kv_put_f16, _k_attention = (
    rmsnorm, linears_q4i, linear_q4i, rope, kv_put_f16, attention)
_k_cache_take_resident, _k_combine_ranked = cache_take_resident, combine_ranked


def _kv_store(src, dst):
    """dst = src as the KV cache holds it (typed by dst's dtype; see _kv_store_ov)."""


@overload(_kv_store, jit_options={"fastmath": _FM})
def _kv_store_ov(src, dst):
    if dst.dtype == types.uint16:  # the 16-bit cache: numpy's rounding, clipped (kv_put_f16)
        def impl(src, dst):
            _k_kv_put_f16(src, dst)
    else:  # float32: the values as they are
        def impl(src, dst):
            A, B, S = src.shape
            for a in range(A):
                for b in range(B):
                    for c in range(S):
                        dst[a, b, c] = src[a, b, c]
    return impl


_k_linears_q8, _k_linear_q8 = linears_q8, linear_q8


def _linears_t1(x, w, s, gs, out):
    """q, k, v = x @ W^T for the attention's matrices in one launch (typed by w; see below)."""


@overload(_linears_t1, jit_options={"fastmath": _FM})
def _linears_t1_ov(x, w, s, gs, out):
    first = w.types[0] if isinstance(w, types.BaseTuple) else w
    if first.dtype == types.int8:  # int8 rows, per-row scales
        def impl(x, w, s, gs, out):
            _k_linears_q8(x, w, s, out)
    else:  # int4 rows interleaved by 4
        def impl(x, w, s, gs, out):
            _k_linears_q4i(x, w, s, gs, out)
    return impl


def _linear_t1(x, w, s, gs, out):
    """out = x @ W^T for o_proj (typed by w, as _linears_t1)."""


@overload(_linear_t1, jit_options={"fastmath": _FM})
def _linear_t1_ov(x, w, s, gs, out):
    if w.dtype == types.int8:
        def impl(x, w, s, gs, out):
            _k_linear_q8(x, w, s, out)
    else:
        def impl(x, w, s, gs, out):
            _k_linear_q4i(x, w, s, gs, out)
    return impl


@njit(**_KW)
def attention_t1(x, ln_w, eps, w, s, gs, qkn, qn_w, kn_w, cos, sin, kc, vc, pos, scale, ow, osc, h, q, k, v,
                 att, out):
    """The attention block of one decode step (T = 1), the calls engine.models.base.MoEModel.
    attention makes, made here in one call from Python (each kernel launch from Python costs
    its dispatch; ~10 per layer): h = rmsnorm(x); q, k, v = linears_q4i(h); the q / k norm;
    RoPE on every dimension; K and V written at position ``pos`` of the cache; attention over
    positions 0..pos; out = linear_q4i(att). The same kernels in the same order, so the values
    are bit-identical to that path (tests/test_families.py).

    x float32 [1, D]; ln_w float32 [D] input_layernorm; w, s: the q / k / v weights and scales,
    either interleaved int4 (uint8 [O / IL, D / 64, IL * 32], half-bit scales uint16 [O, D /
    gs]: linears_q4i / linear_q4i) or int8 (int8 [O, D], float32 [O]: linears_q8 / linear_q8,
    gs unused), chosen when the kernel compiles for the arrays' types; qkn 0
    no q / k norm, 1 over the whole projection ("proj", qn_w [H * S], kn_w [Hkv * S]), 2 per
    head ("head", [S] each); cos, sin float32 [1, S / 2] of position pos; kc, vc [Hkv, C, S]
    this layer's cache (float32, or uint16 half bits); ow, osc: o_proj as w / s; h float32
    [1, D], q [1, H * S], k, v [1, Hkv * S], att [1, H * S] scratch; out float32 [1, D]."""
    _k_rmsnorm(x, ln_w, eps, h)
    _linears_t1(h, w, s, gs, (q, k, v))
    Hkv, S = kc.shape[0], kc.shape[2]
    H = q.shape[1] // S
    if qkn == 1:
        _k_rmsnorm(q, qn_w, eps, q)
        _k_rmsnorm(k, kn_w, eps, k)
    elif qkn == 2:
        q2, k2 = q.reshape((H, S)), k.reshape((Hkv, S))
        _k_rmsnorm(q2, qn_w, eps, q2)
        _k_rmsnorm(k2, kn_w, eps, k2)
    q3, k3, v3 = q.reshape((1, H, S)), k.reshape((1, Hkv, S)), v.reshape((1, Hkv, S))
    _k_rope(q3, cos, sin)
    _k_rope(k3, cos, sin)
    _kv_store(k3, kc[:, pos:pos + 1].transpose((1, 0, 2)))
    _kv_store(v3, vc[:, pos:pos + 1].transpose((1, 0, 2)))
    att3 = att.reshape((1, H, S))
    _k_attention(q3, kc, vc, pos, scale, att3)
    _linear_t1(att, ow, osc, gs, out)


# --- every layer of a decode step, in one call -----------------------------------------------

_k_attention_t1, _k_linear_f32, _k_experts_q4_t1, _k_experts_q8_t1 = (
    attention_t1, linear_f32, experts_q4_t1, experts_q8_t1)


@njit(nogil=True, cache=_KW["cache"])  # no fastmath: the residual adds as numpy's
def decode_layers_t1(x, pos, cos, sin, kc, vc, scale, eps, ln_w, qkv_w, qkv_s, gs, qkn, qn_w, kn_w, o_w, o_s,
                     post_w, router_w, topk, norm, where, state, busy, last_use, routed_now, pinned, spec,
                     resident, clock, arena, max_cap, slot_bytes, fields, I, egs, q4, il,
                     idx, w, logits, ss, pm, nspec, l0, forced_logits, use_forced,
                     look, look_want, look_forced, use_look_forced, look_logits, upto):
    """The layers l0.. of one decode step (T = 1) of a model whose layers are all plain MoE
    layers, while their routed experts are resident in the expert cache's arena: for each layer l,
    the calls engine.models.base.MoEModel.forward makes from Python, in the same order with
    the same kernels, so the values are bit-identical to that path (tests/test_families.py):

    x += attention_t1(x); h = rmsnorm(x, post_w[l]); logits[l] = h @ router_w[l]^T;
    route_softmax; the experts taken in ascending id order as cache_take_resident does
    (ExpertCache.take_split, the caller holds the cache's lock); experts_q4_t1 / _q8_t1 on
    their slabs; combine_ranked in rank order; x += that; the slots given back.

    x float32 [1, D] (updated in place); pos the position; cos, sin float32 [1, S / 2]; kc, vc
    [L, Hkv, C, S] the KV cache; ln_w, qkv_w, qkv_s, qn_w, kn_w, o_w, o_s, post_w, router_w:
    typed lists of L per-layer items (attention_t1's arguments, qkv_w / qkv_s tuples of the q,
    k, v arrays; post_attention_layernorm float32 [D]; router float32 [E, D]); where .. spec: the cache's [L, ...] arrays; clock its use
    clock; arena uint8, max_cap, slot_bytes: its slabs (slot s of layer l at (l * max_cap + s)
    * slot_bytes); fields int64 [6] the weight offsets inside a slab; I, egs, q4, il: expert
    width, int4 group size, int4 (else int8), interleaved slabs. Outputs per layer: idx int64
    [L, k], w float32 [L, k] (rank order), logits float32 [L, E], ss int64 [L, k] the slots
    and pm bool [L, k] whether pinned (both in ascending id order), nspec int64 [L] the taken
    slots still flagged speculative.

    Returns the use clock after the step, or -1 - l when an expert of layer l was not
    resident: layers l0..l-1 ran (their cache rows as after their take and release), layer
    l's attention ran (x as after it, its K / V written) and its routing (idx[l], w[l],
    logits[l]), its take did not (its cache rows untouched). The caller then runs layer l's
    experts its own way and may continue from l0 = l + 1.

    ``use_forced``: each layer's router logits are forced_logits[l] (float32 [L, E]) instead of
    h @ router_w[l]^T: a replayed routing (engine.trace.RecordedRouting), as the per-layer
    path gets it from the replaced ``router_logits``.

    ``look`` (PILOT inside the run, engine.prefetch.Pilot.run_plan): at each layer l whose next
    layer is wanted (``look_want`` bool [L], row l + 1), PILOT mode 1's prediction of layer
    l + 1 from layer l's post-attention residual, rmsnorm(x; post_w[l + 1]) @ router_w[l + 1]^T
    (or ``look_forced[l + 1]`` with ``use_look_forced``: a replayed routing's recorded
    predictor), goes to ``look_logits[l + 1]``; when one of its top-k experts is not in the
    cache (``where`` < 0: neither resident nor loading), the run stops after layer l's experts,
    ``upto[0] = l + 1``, and returns the clock (>= 0), so the caller can start that read while
    layer l + 1 computes. ``upto[0]`` is L otherwise. The prediction changes no value."""
    L = len(ln_w)
    D = x.shape[1]
    E = logits.shape[1]
    h = np.empty((1, D), np.float32)
    ao = np.empty((1, D), np.float32)
    hn = np.empty((1, D), np.float32)
    HS, KS = qkv_s[0][0].shape[0], qkv_s[0][1].shape[0]  # rows of q, of k (= of v)
    q = np.empty((1, HS), np.float32)
    kk = np.empty((1, KS), np.float32)
    vv = np.empty((1, KS), np.float32)
    att = np.empty((1, HS), np.float32)
    p = np.empty((1, E), np.float32)
    ea = np.empty(topk, np.int64)
    order = np.empty(topk, np.int64)
    offs = np.empty((topk, 6), np.int64)
    hs = np.empty((topk, I), np.float32)
    out = np.empty((topk, D), np.float32)
    y = np.empty((1, topk, D), np.float32)
    moe = np.empty((1, D), np.float32)
    hl = np.empty((1, D), np.float32)
    pidx = np.empty(topk, np.int64)
    pw = np.empty(topk, np.float32)
    upto[0] = L
    for l in range(l0, L):
        _k_attention_t1(x, ln_w[l], eps, qkv_w[l], qkv_s[l], gs, qkn, qn_w[l], kn_w[l], cos, sin, kc[l], vc[l],
                        pos, scale, o_w[l], o_s[l], h, q, kk, vv, att, ao)
        for d in range(D):
            x[0, d] = x[0, d] + ao[0, d]
        _k_rmsnorm(x, post_w[l], eps, hn)
        if use_forced:
            for e in range(E):
                logits[l, e] = forced_logits[l, e]
        else:
            _k_linear_f32(hn, router_w[l], logits[l:l + 1])
        _route_row(logits[l], topk, norm, idx[l], w[l], p[0])
        order[:] = np.argsort(idx[l])  # distinct ids: the ascending order take_split is given
        for i in range(topk):
            ea[i] = idx[l, order[i]]
        n = _k_cache_take_resident(where[l], state[l], busy[l], last_use[l], routed_now[l], pinned[l], spec[l],
                                   ea, clock, resident, ss[l], pm[l])
        if n < 0:
            return -1 - l
        nspec[l] = n
        clock += topk
        absent = False
        if look and l + 1 < L and look_want[l + 1]:
            if use_look_forced:
                for e in range(E):
                    look_logits[l + 1, e] = look_forced[l + 1, e]
            else:
                _k_rmsnorm(x, post_w[l + 1], eps, hl)
                _k_linear_f32(hl, router_w[l + 1], look_logits[l + 1:l + 2])
            _route_row(look_logits[l + 1], topk, norm, pidx, pw, p[0])  # the experts route would pick
            for r in range(topk):
                if where[l + 1, pidx[r]] < 0:
                    absent = True
        base = (np.int64(l) * max_cap) * slot_bytes
        for i in range(topk):
            so = base + ss[l, i] * slot_bytes
            for f in range(6):
                offs[i, f] = so + fields[f]
        if q4:
            _k_experts_q4_t1(hn, arena, offs, I, egs, hs, out, il)
        else:
            _k_experts_q8_t1(hn, arena, offs, I, hs, out)
        for i in range(topk):
            y[0, order[i]] = out[i]
        _k_combine_ranked(y, w[l:l + 1], moe)
        for d in range(D):
            x[0, d] = x[0, d] + moe[0, d]
        for i in range(topk):
            busy[l, ss[l, i]] -= 1
        if absent:
            upto[0] = l + 1
            return clock
    return clock


# --- gated delta rule (Qwen3-Next / Qwen3.5 linear attention) -----------------------------

DELTA_EXP_FLOOR = np.float32(-80.0)  # e^x below e^-80 taken as 0: no float32 subnormals (x86: ~100x slower)
DELTA_TINY = np.float32(1e-30)  # state entries below this become 0, for the same reason


@njit(parallel=True, **_KW)
def gated_delta(q, k, v, g, beta, S, chunk, out):
    """The gated delta rule of T tokens for H value heads, in chunks of ``chunk`` tokens.

    q, k float32 [H, T, dk] (l2-normed; q scaled by dk^-0.5), v [H, T, dv], g (log decay,
    <= 0) and beta [H, T]; S float32 [H, dk, dv] the state before the first token, updated in
    place to the state after the last; out float32 [H, T, dv]. Equal to T steps of
    S <- e^g S; S <- S + k (beta (v - k^T S))^T; o = q^T S (T = 1 is that step).

    Per chunk of n tokens from state S0, c = cumsum(g), D_ij = e^(c_i - c_j) (j <= i): the
    pseudo-values P solve (I + A) P = beta (v - e^c k^T S0) with A_ij = beta_i (k_i.k_j) D_ij
    (j < i; forward substitution), o_i = e^(c_i) q_i^T S0 + sum_(j<=i) (q_i.k_j) D_ij P_j,
    S = e^(c_n) S0 + sum_j e^(c_n - c_j) k_j P_j^T: O(T (dk dv + n (dk + dv))) per head, never
    quadratic in T. Source: the WY / UT-transform chunking of transformers'
    torch_chunk_gated_delta_rule (Yang et al. 2024, "Gated Delta Networks", arXiv 2412.06464).
    Decays below e^DELTA_EXP_FLOOR count as 0 and state entries below DELTA_TINY are flushed.
    """
    H, T, dk = q.shape
    dv = v.shape[2]
    m = min(chunk, T)
    for h in prange(H):
        c = np.empty(m, np.float32)
        D = np.zeros((m, m), np.float32)
        P = np.empty((m, dv), np.float32)
        ks = np.empty(dv, np.float32)
        for c0 in range(0, T, chunk):
            n = min(chunk, T - c0)
            acc = np.float32(0.0)
            for i in range(n):
                acc += g[h, c0 + i]
                c[i] = acc
            for i in range(n):
                for j in range(i + 1):
                    x = c[i] - c[j]
                    D[i, j] = _exp32(x) if x >= DELTA_EXP_FLOOR else np.float32(0.0)
            for i in range(n):  # pseudo-values, and the read of S0 into the outputs
                t = c0 + i
                ei = _exp32(c[i]) if c[i] >= DELTA_EXP_FLOOR else np.float32(0.0)
                for d in range(dv):
                    ks[d] = 0.0
                    out[h, t, d] = 0.0
                if ei != 0.0:
                    for e in range(dk):
                        ke, qe = k[h, t, e], q[h, t, e]
                        for d in range(dv):
                            ks[d] += ke * S[h, e, d]
                            out[h, t, d] += qe * S[h, e, d]
                    for d in range(dv):
                        out[h, t, d] *= ei
                b = beta[h, t]
                for d in range(dv):
                    P[i, d] = b * (v[h, t, d] - ei * ks[d])
                for j in range(i):
                    if D[i, j] != 0.0:
                        kk = np.float32(0.0)
                        for e in range(dk):
                            kk += k[h, t, e] * k[h, c0 + j, e]
                        a = b * kk * D[i, j]
                        for d in range(dv):
                            P[i, d] -= a * P[j, d]
            for i in range(n):  # the chunk's own part of the outputs
                t = c0 + i
                for j in range(i + 1):
                    if D[i, j] != 0.0:
                        qk = np.float32(0.0)
                        for e in range(dk):
                            qk += q[h, t, e] * k[h, c0 + j, e]
                        a = qk * D[i, j]
                        for d in range(dv):
                            out[h, t, d] += a * P[j, d]
            last = c[n - 1]
            en = _exp32(last) if last >= DELTA_EXP_FLOOR else np.float32(0.0)
            if en != 1.0:
                for e in range(dk):
                    for d in range(dv):
                        S[h, e, d] *= en
            for j in range(n):
                x = last - c[j]
                w = _exp32(x) if x >= DELTA_EXP_FLOOR else np.float32(0.0)
                if w != 0.0:
                    for e in range(dk):
                        kw = k[h, c0 + j, e] * w
                        for d in range(dv):
                            S[h, e, d] += kw * P[j, d]
            for e in range(dk):
                for d in range(dv):
                    if abs(S[h, e, d]) < DELTA_TINY:
                        S[h, e, d] = 0.0


# --- launch safety ------------------------------------------------------------------------

# Every parallel kernel: with a threading layer that is not thread-safe (SERIALIZED), each is
# launched under one lock (a list was defined twice here, the second one missing the decode
# experts, MXFP4 and sink attention kernels).
PARALLEL_KERNELS = ("linear_f32", "linear_f16", "linear_q8", "linear_q4", "linears_q8", "linears_q4",
                    "linear_q4i", "linears_q4i",
                    "linear_mxfp4", "expert_f32",
                    "expert_f16", "expert_q8", "expert_q4", "expert_q4i", "experts_q4_t1", "experts_q8_t1",
                    "experts_q4_sorted", "combine_sorted",
                    "attention", "attention_sink", "gated_delta", "kv_put_f16", "attention_t1",
                    "decode_layers_t1")
_LAUNCH_LOCK = threading.Lock()


def _serialized(kernel):
    @functools.wraps(kernel)
    def run(*args):
        with _LAUNCH_LOCK:
            return kernel(*args)
    run.kernel = kernel
    return run


if SERIALIZED:  # no njit function calls these names, so rebinding them is safe
    for _name in PARALLEL_KERNELS:
        globals()[_name] = _serialized(globals()[_name])


def set_threads(n: int) -> None:
    """Threads of the parallel kernels launched from the calling thread (numba's count is per
    thread), clamped to 1..NUMBA_NUM_THREADS."""
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))


def thread_limit() -> int:
    """The most threads a parallel kernel may use in this process (NUMBA_NUM_THREADS)."""
    return int(numba.config.NUMBA_NUM_THREADS)


def current_threads() -> int:
    """Threads of the parallel kernels launched from the calling thread now."""
    return int(numba.get_num_threads())
