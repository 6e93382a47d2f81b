"""Numba kernels: the engine's whole arithmetic. The only module that imports numba.

Key: T tokens (rows), N input width, O output rows, D hidden, I expert width, H query heads,
Hkv key/value heads, S head size, C context capacity, E experts, G = N // group_size.

Every kernel is ``nogil=True`` so expert-loader threads run while it computes, writes into a
preallocated ``out``, and has a same-signature numpy twin in kernels_ref.py (the test oracle
and the fallback when numba is missing; tests/test_kernels.py compares every pair). Each
output element is one dot product computed by the same inlined code whatever T is, so results
do not depend on T, on thread count, or on where an expert's bytes came from.

Weight kinds: f32 (w float32 [O, N]), f16 (w uint16 IEEE-half bits [O, N], decoded through a
65536-entry table), q8 (w int8 [O, N], s float32 [O]), q4 (w uint8 [O, N // 2], two values
per byte, low nibble = even column, value = nibble - 8; s float32 [O, G]).

int8 and int4 (issue #19): the activation rows are quantized once per call to int8 per block
(32 columns for q8, the weight group for q4; llama.cpp's Q8_0 activations) and the block dot
products are integer: AVX-512 VNNI ``vpdpbusd`` through numba intrinsics (LLVM vector IR) on
CPUs that have it (``INT_FLAVOR`` "vnni"), AVX-512BW ``vpmaddubsw`` for q4 ("bw"), plain
vectorizable numba loops on the dequantized activations elsewhere ("portable"). Every path
computes the same real-valued expression, quantize_activations(x) @ dequant(W)^T, which is
what kernels_ref computes. Measured on this repo's machine (AMD EPYC, AVX-512 VNNI; one
thread, thread CPU time, 2048 x 1024 expert, T = 1 / 16): q8 41 / 33 -> 45 / 51 and q4
2.7 / 2.5 -> 45 / 49 G multiply-adds per second (the old q4 loop read x with stride 2 and
compiled to gathers).

Process-wide setup done here, before the first kernel compiles (issue #18, faults 7 and 8):

- numba's on-disk cache goes to the user cache folder (platformdirs), not next to the package:
  a read-only install with no writable home would otherwise fail at import with numba's "no
  locator available". ``NUMBA_CACHE_DIR`` set by the user wins; if no folder is writable the
  kernels compile uncached (``CACHE_DIR is None``).
- threading layer: OpenMP, then TBB, then numba's ``workqueue`` (unless the user set
  ``NUMBA_THREADING_LAYER``). ``workqueue`` aborts the process when two threads launch parallel
  kernels at once, so under it (``SERIALIZED``) every parallel kernel runs under one lock.
- OpenMP wait policy: left to libgomp (spin a while, then sleep). Spinning threads fight any
  other busy program for its core (issue 17: ~800 -> 10 tok/s with one core busy), but
  ``OMP_WAIT_POLICY=PASSIVE`` cost 80% of the quiet speed of the default model (a futex wake
  at each of the many small parallel regions of a token); instead the engine runs only as many
  threads as there are free cores (threads = 0: engine.sysinfo.FreeCores). Measured by
  ``colibri bench contention`` (bench/results/contention_*.md).
"""

from __future__ import annotations

import functools
import math
import os
import sys
import tempfile
import threading


def _writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe", dir=path)
        os.close(fd)
        os.unlink(probe)
        return True
    except OSError:
        return False


def _numba_cache_dir() -> str | None:
    """The folder numba caches compiled kernels in, or None when no folder is writable.

    ``NUMBA_CACHE_DIR`` if the user set it (and it is writable), else
    ``<platformdirs user cache>/colibri-desktop/numba``."""
    user = os.environ.get("NUMBA_CACHE_DIR")
    if user:
        return user if _writable_dir(user) else None
    try:
        import platformdirs
        d = os.path.join(platformdirs.user_cache_dir("colibri-desktop", appauthor=False), "numba")
    except Exception:  # platformdirs cannot name a folder (no HOME at all)
        return None
    return d if _writable_dir(d) else None


CACHE_DIR = _numba_cache_dir()
if CACHE_DIR is not None:
    os.environ["NUMBA_CACHE_DIR"] = CACHE_DIR
if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
    os.environ["NUMBA_THREADING_LAYER_PRIORITY"] = "omp tbb workqueue"
_numba_was_loaded = "numba" in sys.modules

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

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



def _int_flavor() -> str:
    """How the q4 / q8 dot products run on this CPU: "vnni" (AVX-512 VNNI vpdpbusd: q4 and q8),
    "bw" (AVX-512BW vpmaddubsw + vpmaddwd: q4; q8 portable) or "portable" (plain numba loops,
    any CPU). All paths compute the same real-valued expression. ``COLIBRI_INT_KERNEL``
    forces one (tests use it to check every path here); a forced choice compiles uncached, so
    the on-disk cache only ever holds this machine's own choice."""
    forced = os.environ.get("COLIBRI_INT_KERNEL")
    if forced:
        if forced not in ("vnni", "bw", "portable"):
            raise ValueError(f"COLIBRI_INT_KERNEL={forced!r}: choose vnni, bw or portable")
        return forced
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "portable"
    try:
        import llvmlite.binding as llb
        feats = llb.get_host_cpu_features()
    except Exception:
        return "portable"
    if feats.get("avx512bw") and feats.get("avx512f"):
        return "vnni" if feats.get("avx512vnni") else "bw"
    return "portable"


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


def _tree_sum(builder, v):
    """Sum of the lanes of a float vector in a fixed pairwise order (deterministic)."""
    width = v.type.count
    while width > 1:
        half = width // 2
        v = builder.fadd(builder.shuffle_vector(v, v, _const_vec(_I32, range(half))),
                         builder.shuffle_vector(v, v, _const_vec(_I32, range(half, width))))
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


@intrinsic
def _q8_pairs_simd(typingctx, xu, xs, w, npairs):
    """sum over block pairs p < npairs of xs[b] * sum_j (xu_j - 128) * w_j, blocks of 32.

    xu uint8 [>= 64 npairs] = q + 128; xs float32 [>= 2 npairs]; w int8 [>= 64 npairs].
    16 float lanes accumulate in registers, summed at the end in a fixed tree order."""
    sig = types.float32(xu, xs, w, types.intp)

    def codegen(context, builder, signature, args):
        xup, xsp, wp = [context.make_array(signature.args[i])(context, builder, value=args[i]).data
                        for i in range(3)]
        mod = builder.module
        v64i8, v16i32, v16f, v2f = _vec(_I8, 64), _vec(_I32, 16), _vec(_F32, 16), _vec(_F32, 2)
        dp = cgutils.get_or_insert_function(mod, ir.FunctionType(v16i32, [v16i32, v64i8, v64i8]),
                                            "llvm.x86.avx512.vpdpbusd.512")
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
        zero = ir.Constant(v16i32, [0] * 16)
        lanes = _const_vec(_I32, [0] * 8 + [1] * 8)  # dword lane -> block A/B
        with cgutils.for_range(builder, args[3]) as loop:
            i = loop.index
            off = builder.mul(i, ir.Constant(_I64, 64))
            wv = builder.load(builder.bitcast(builder.gep(wp, [off]), v64i8.as_pointer()), align=1)
            xv = builder.load(builder.bitcast(builder.gep(xup, [off]), v64i8.as_pointer()), align=1)
            p = builder.call(dp, [zero, xv, wv])
            wsum = builder.call(dp, [zero, _const_vec(_I8, [1] * 64), wv])
            p = builder.sub(p, builder.shl(wsum, _const_vec(_I32, [7] * 16)))
            a2 = builder.load(builder.bitcast(builder.gep(xsp, [builder.mul(i, ir.Constant(_I64, 2))]),
                                              v2f.as_pointer()), align=4)
            sc = builder.shuffle_vector(a2, ir.Constant(v2f, ir.Undefined), lanes)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(builder.sitofp(p, v16f), sc)), acc)
        return _tree_sum(builder, builder.load(acc))
    return sig, codegen


_Q8_SIMD = INT_FLAVOR == "vnni"


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
    """Element (t, o) of quantize_activations(x) @ (w * s)^T for x prepared as P."""
    simd, xu, xs, xf = P
    if not simd:
        return _dot_q8(xf[t], w[o], s[o])
    N = w.shape[1]
    npairs = N // 64
    acc = _q8_pairs_simd(xu[t], xs[t], w[o], npairs)
    lo = npairs * 64
    b = npairs * 2
    while lo < N:
        hi = min(lo + QB, N)
        tot = 0
        for j in range(lo, hi):
            tot += (np.int32(xu[t, j]) - 128) * np.int32(w[o, j])
        acc += np.float32(tot) * xs[t, b]
        lo = hi
        b += 1
    return acc * s[o]


# --- q4: activations quantized like llama.cpp's Q8_0, integer dot products --------------------
#
# Per call, each activation row x [N] is quantized per weight group (gs columns) to int8:
# d = max|x_g| / 127, q = rint(x * (127 / max|x_g|)), the x the weights meet is q * d (exactly
# what kernels_ref.quantize_activations does). A group's dot product is then
# d * s_w * sum_j q_j * (nibble_j - 8) = d * s_w * (sum_j q_j * nibble_j - 8 * sum_j q_j):
# unsigned nibbles times signed bytes, the operand shape of AVX-512 VNNI's vpdpbusd, with the
# "- 8" folded into c_g = 8 * d * sum_j q_j (computed once per row and group).

@intrinsic
def _q4_pairs_simd(typingctx, xq, xs, w, ws, npairs):
    """sum over group pairs p < npairs of xs[g] * ws[g] * sum_j nibble_j * xq_j, for gs = 32.

    xq int8 [>= 64 npairs]: per pair of groups (A, B) the bytes [even columns of A (16),
    of B (16), odd columns of A (16), of B (16)], which lines up with one 32-byte load of
    the packed weights split into low nibbles then high nibbles. xs, ws float32 [>= 2 npairs];
    w uint8 [>= 32 npairs]. 16 float lanes accumulate in registers, summed at the end in a
    fixed tree order (deterministic)."""
    sig = types.float32(xq, xs, w, ws, types.intp)

    def codegen(context, builder, signature, args):
        ptrs = [context.make_array(signature.args[i])(context, builder, value=args[i]).data for i in range(4)]
        xqp, xsp, wp, wsp = ptrs
        mod = builder.module
        v64i8, v32i8, v32i16, v16i32, v16f, v2f = (_vec(_I8, 64), _vec(_I8, 32), _vec(_I16, 32),
                                                   _vec(_I32, 16), _vec(_F32, 16), _vec(_F32, 2))
        if INT_FLAVOR == "vnni":
            dp = cgutils.get_or_insert_function(mod, ir.FunctionType(v16i32, [v16i32, v64i8, v64i8]),
                                                "llvm.x86.avx512.vpdpbusd.512")
        else:
            mub = cgutils.get_or_insert_function(mod, ir.FunctionType(v32i16, [v64i8, v64i8]),
                                                 "llvm.x86.avx512.pmaddubs.w.512")
            mwd = cgutils.get_or_insert_function(mod, ir.FunctionType(v16i32, [v32i16, v32i16]),
                                                 "llvm.x86.avx512.pmaddw.d.512")
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
        cat = _const_vec(_I32, range(64))
        lanes = _const_vec(_I32, [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4)  # dword lane -> group A/B
        with cgutils.for_range(builder, args[4]) as loop:
            i = loop.index
            wv = builder.load(builder.bitcast(builder.gep(wp, [builder.mul(i, ir.Constant(_I64, 32))]),
                                              v32i8.as_pointer()), align=1)
            nib = builder.shuffle_vector(builder.and_(wv, _const_vec(_I8, [15] * 32)),
                                         builder.lshr(wv, _const_vec(_I8, [4] * 32)), cat)
            xv = builder.load(builder.bitcast(builder.gep(xqp, [builder.mul(i, ir.Constant(_I64, 64))]),
                                              v64i8.as_pointer()), align=1)
            if INT_FLAVOR == "vnni":
                p32 = builder.call(dp, [ir.Constant(v16i32, [0] * 16), nib, xv])
            else:
                p32 = builder.call(mwd, [builder.call(mub, [nib, xv]), _const_vec(_I16, [1] * 32)])
            g2 = builder.mul(i, ir.Constant(_I64, 2))
            a2 = builder.load(builder.bitcast(builder.gep(xsp, [g2]), v2f.as_pointer()), align=4)
            b2 = builder.load(builder.bitcast(builder.gep(wsp, [g2]), v2f.as_pointer()), align=4)
            sc = builder.shuffle_vector(builder.fmul(a2, b2), ir.Constant(v2f, ir.Undefined), lanes)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(builder.sitofp(p32, v16f), sc)), acc)
        return _tree_sum(builder, builder.load(acc))
    return sig, codegen


@njit(inline="always", **_KW)
def _q4_prep_simd(x, xq, xs, c):
    """Quantize x [N] (gs = 32) into the pair layout of _q4_pairs_simd; a last unpaired group
    holds [16 even | 16 odd]. xs [G] scales, c [G] = 8 * xs * sum(q)."""
    G = xs.shape[0]
    paired = (G // 2) * 2
    for g in range(G):
        d, inv = _quant_group(x, g * 32, 32)
        xs[g] = d
        base = (g // 2) * 64 + (g % 2) * 16
        odd = 32 if g < paired else 16
        tot = 0
        for j in range(16):
            a = np.int32(np.rint(x[g * 32 + 2 * j] * inv))
            b = np.int32(np.rint(x[g * 32 + 2 * j + 1] * inv))
            xq[base + j] = a
            xq[base + odd + j] = b
            tot += a + b
        c[g] = np.float32(8.0) * d * np.float32(tot)


@njit(inline="always", **_KW)
def _q4_dot_simd(xq, xs, c, w, ws):
    """One q4 row (gs = 32) against a row prepared by _q4_prep_simd."""
    G = ws.shape[0]
    acc = _q4_pairs_simd(xq, xs, w, ws, G // 2)
    if G % 2:
        g = G - 1
        tot = 0
        for j in range(16):
            b = np.int32(w[g * 16 + j])
            tot += np.int32(xq[g * 32 + j]) * (b & 15) + np.int32(xq[g * 32 + 16 + j]) * (b >> 4)
        acc += np.float32(tot) * (xs[g] * ws[g])
    corr = np.float32(0.0)
    for g in range(G):
        corr += ws[g] * c[g]
    return acc - corr


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
            acc += s[k >> sh] * (xe[k] * np.float32((b & 15) - 8) + xo[k] * np.float32((b >> 4) - 8))
    else:
        for g in range(s.shape[0]):
            sc = s[g]
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
    xq = np.empty((T, N if simd else 0), np.int8)
    xs = np.empty((T, N // gs), np.float32)
    c = np.empty((T, N // gs), np.float32)
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
    """Element (t, o) of quantize_activations(x) @ dequant(w, s)^T for x prepared as P."""
    simd, xq, xs, c, xe, xo = P
    if simd:
        return _q4_dot_simd(xq[t], xs[t], c[t], w[o], s[o])
    return _q4_dot_portable(xe[t], xo[t], w[o], s[o], sh, hg)


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
    for o in prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _q8_out(P, w, s, o, t)


@njit(parallel=True, **_KW)
def linear_q4(x, w, s, gs, out):
    P = _q4_prepare(x, gs)
    sh, hg = _q4_shift(gs), gs // 2
    for o in prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _q4_out(P, w, s, sh, hg, o, t)


# --- expert FFN: out[T, D] = down(silu(gate(x)) * up(x)) -----------------------------------

@njit(inline="always", **_KW)
def _silu_mul(g, u):
    return g / (np.float32(1.0) + np.float32(math.exp(-g))) * u


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
    for i in prange(gw.shape[0]):
        for t in range(x.shape[0]):
            h[t, i] = _silu_mul(_q8_out(P, gw, gs, i, t), _q8_out(P, uw, us, i, t))
    Q = _q8_prepare(h)
    for o in prange(dw.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _q8_out(Q, dw, ds, o, t)


@njit(parallel=True, **_KW)
def expert_q4(x, gw, gs, uw, us, dw, ds, gsz, h, out):
    P = _q4_prepare(x, gsz)
    sh, hg = _q4_shift(gsz), gsz // 2
    for i in prange(gw.shape[0]):
        for t in range(x.shape[0]):
            h[t, i] = _silu_mul(_q4_out(P, gw, gs, sh, hg, i, t), _q4_out(P, uw, us, sh, hg, i, t))
    Q = _q4_prepare(h, gsz)
    for o in prange(dw.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _q4_out(Q, dw, ds, sh, hg, o, t)


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
            sc = s[r, (2 * k) // gs]
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


@njit(parallel=True, **_KW)
def attention(q, kc, vc, pos0, scale, out):
    """Causal attention of T new queries at positions pos0..pos0+T-1 over the KV cache.

    q [T, H, S]; kc, vc [Hkv, C, S] (positions < pos0 + T already written); out [T, H, S].
    Grouped-query: query head h reads KV head h // (H // Hkv).
    """
    T, H, S = q.shape
    rep = H // kc.shape[0]
    for th in prange(T * H):
        t = th // H
        h = th - t * H
        kh = h // rep
        n = pos0 + t + 1
        sc = np.empty(n, dtype=np.float32)
        m = np.float32(-np.inf)
        for j in range(n):
            v = _dot_f32(q[t, h], kc[kh, j]) * scale
            sc[j] = v
            if v > m:
                m = v
        tot = np.float32(0.0)
        for j in range(n):
            e = np.float32(math.exp(sc[j] - m))
            sc[j] = e
            tot += e
        inv = np.float32(1.0) / tot
        for d in range(S):
            out[t, h, d] = 0.0
        for j in range(n):
            p = sc[j] * inv
            for d in range(S):
                out[t, h, d] += p * vc[kh, j, d]


# --- launch safety ------------------------------------------------------------------------

PARALLEL_KERNELS = ("linear_f32", "linear_f16", "linear_q8", "linear_q4", "expert_f32", "expert_f16",
                    "expert_q8", "expert_q4", "attention")
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


def cpu_features() -> dict[str, bool]:
    """The host CPU's instruction-set features as LLVM (llvmlite) reports them, e.g.
    {"avx2": True, "avx512f": True, "avx512vnni": False, ...}; {} when unknown. For reports
    (``colibri doctor``); the kernels choose their path with INT_FLAVOR."""
    try:
        import llvmlite.binding as llb
        return {str(k): bool(v) for k, v in llb.get_host_cpu_features().items()}
    except Exception:  # noqa: BLE001 - llvmlite without host feature support
        return {}


def thread_limit() -> int:
    """The most threads a parallel kernel may use in this process (NUMBA_NUM_THREADS)."""
    return int(numba.config.NUMBA_NUM_THREADS)


def current_threads() -> int:
    """Threads of the parallel kernels launched from the calling thread now."""
    return int(numba.get_num_threads())
