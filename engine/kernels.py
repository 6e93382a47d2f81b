"""Numba kernels: the engine's whole arithmetic. The only module that imports numba.

Key: T tokens (rows), N input width, O output rows, D hidden, I expert width, H query heads,
Hkv key/value heads, S head size, C context capacity, E experts, G = N // group_size.

Every kernel is ``nogil=True`` so expert-loader threads run while it computes, writes into a
preallocated ``out``, and has a same-signature numpy twin in kernels_ref.py (the test oracle
and the fallback when numba is missing). Each output element is one sequential dot product,
so results do not depend on T, on thread count, or on where an expert's bytes came from.

Weight kinds: f32 (w float32 [O, N]), f16 (w uint16 IEEE-half bits [O, N], decoded through a
65536-entry table), q8 (w int8 [O, N], s float32 [O]), q4 (w uint8 [O, N // 2], two values
per byte, low nibble = even column, value = nibble - 8; s float32 [O, G]).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

_FM = {"reassoc", "contract", "nsz", "arcp"}  # allow SIMD reductions; no inf/nan shortcuts
_KW = dict(nogil=True, fastmath=_FM, cache=True)

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
def _dot_q4(x, w, s, gs):
    acc = np.float32(0.0)
    half = gs // 2
    for g in range(s.shape[0]):
        a = np.float32(0.0)
        base = g * gs
        for j in range(half):
            b = w[g * half + j]
            a += x[base + 2 * j] * np.float32((b & 15) - 8) + x[base + 2 * j + 1] * np.float32((b >> 4) - 8)
        acc += a * s[g]
    return acc


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
    for o in prange(w.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _dot_q4(x[t], w[o], s[o], gs)


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
    for i in prange(gw.shape[0]):
        for t in range(x.shape[0]):
            h[t, i] = _silu_mul(_dot_q4(x[t], gw[i], gs[i], gsz), _dot_q4(x[t], uw[i], us[i], gsz))
    for o in prange(dw.shape[0]):
        for t in range(x.shape[0]):
            out[t, o] = _dot_q4(h[t], dw[o], ds[o], gsz)


# --- embeddings -------------------------------------------------------------------------

@njit(**_KW)
def embed_q8(ids, w, s, out):
    """out[T, D] = dequantized rows ``ids`` of the int8 table w [V, D] with scales s [V]."""
    for t in range(ids.shape[0]):
        r = ids[t]
        for i in range(w.shape[1]):
            out[t, i] = np.float32(w[r, i]) * s[r]


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
