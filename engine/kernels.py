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

q4 speed (issue #19): the activation row is split once per call into its even and odd columns
(xe, xo [T, N // 2]), so byte k of a weight row meets xe[k] (low nibble) and xo[k] (high
nibble): one long unit-stride loop that LLVM vectorizes to AVX-512 (the old loop read x with
stride 2 and compiled to gathers, ~30x slower). The group scale of byte k is s[k >> log2(gs/2)].

Process-wide setup done here, before the first kernel compiles (issue #18, faults 7 and 8):

- numba's on-disk cache goes to the user cache folder (platformdirs), not next to the package:
  a read-only install with no writable home would otherwise fail at import with numba's "no
  locator available". ``NUMBA_CACHE_DIR`` set by the user wins; if no folder is writable the
  kernels compile uncached (``CACHE_DIR is None``).
- threading layer: OpenMP, then TBB, then numba's ``workqueue`` (unless the user set
  ``NUMBA_THREADING_LAYER``). ``workqueue`` aborts the process when two threads launch parallel
  kernels at once, so under it (``SERIALIZED``) every parallel kernel runs under one lock.
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
from numba import njit, prange  # noqa: E402

if _numba_was_loaded:  # numba read its config before us: apply the same choices directly
    if CACHE_DIR is not None:
        numba.config.CACHE_DIR = CACHE_DIR
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


def _start_threading_layer() -> str:
    """Start numba's thread pool now and return the layer it chose ("omp", "tbb",
    "workqueue"), or "unknown" if numba's (internal) launcher is unavailable."""
    try:
        from numba.np.ufunc import parallel as _parallel
        _parallel._launch_threads()
        return str(numba.threading_layer())
    except Exception:
        return "unknown"


THREADING_LAYER = _start_threading_layer()
SERIALIZED = THREADING_LAYER not in ("omp", "tbb")  # workqueue (or unknown): not thread-safe

_FM = {"reassoc", "contract", "nsz", "arcp"}  # allow SIMD reductions; no inf/nan shortcuts
_KW = dict(nogil=True, fastmath=_FM, cache=CACHE_DIR is not None)

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


@njit(inline="always", **_KW)
def _dot_q4(xe, xo, w, s, sh, hg):
    """One q4 row: xe, xo float32 [N/2] (even / odd columns of x), w uint8 [N/2], s [G].
    sh = log2(gs / 2) when gs / 2 is a power of two (one vectorized loop), else -1 and
    hg = gs / 2 bytes per group (a loop per group)."""
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


@njit(inline="always", **_KW)
def _split_even_odd(x, xe, xo):
    """xe[t, k] = x[t, 2k], xo[t, k] = x[t, 2k + 1]."""
    for t in range(x.shape[0]):
        for k in range(xe.shape[1]):
            xe[t, k] = x[t, 2 * k]
            xo[t, k] = x[t, 2 * k + 1]


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
    for o in prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _dot_q8(x[t], w[o], s[o])


@njit(parallel=True, **_KW)
def linear_q4(x, w, s, gs, out):
    half = w.shape[1]
    xe = np.empty((x.shape[0], half), np.float32)
    xo = np.empty((x.shape[0], half), np.float32)
    _split_even_odd(x, xe, xo)
    sh = _q4_shift(gs)
    hg = gs // 2
    for o in prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _dot_q4(xe[t], xo[t], w[o], s[o], sh, hg)


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
    for i in prange(gw.shape[0]):
        for t in range(x.shape[0]):
            h[t, i] = _silu_mul(_dot_q8(x[t], gw[i], gs[i]), _dot_q8(x[t], uw[i], us[i]))
    for o in prange(dw.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _dot_q8(h[t], dw[o], ds[o])


@njit(parallel=True, **_KW)
def expert_q4(x, gw, gs, uw, us, dw, ds, gsz, h, out):
    T = x.shape[0]
    xe = np.empty((T, gw.shape[1]), np.float32)
    xo = np.empty((T, gw.shape[1]), np.float32)
    _split_even_odd(x, xe, xo)
    sh = _q4_shift(gsz)
    hg = gsz // 2
    for i in prange(gw.shape[0]):
        for t in range(T):
            h[t, i] = _silu_mul(_dot_q4(xe[t], xo[t], gw[i], gs[i], sh, hg),
                                _dot_q4(xe[t], xo[t], uw[i], us[i], sh, hg))
    he = np.empty((T, dw.shape[1]), np.float32)
    ho = np.empty((T, dw.shape[1]), np.float32)
    _split_even_odd(h, he, ho)
    for o in prange(dw.shape[0]):
        for t in range(T):
            out[t, o] = _dot_q4(he[t], ho[t], dw[o], ds[o], sh, hg)


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
