"""Numba kernels on GGUF's quantized blocks, as a GGUF-born store keeps them (engine.gguf_blocks).

K-quant rows (Q4_K, Q5_K, Q6_K: the types of Q4_K_M, Q5_K_M, Q6_K) run the integer kernels of
engine.kernels.kquants against 8-bit activations (llama.cpp's Q8_K) when every projection of
the call is one of them and the CPU has AVX2 (``linear`` and ``run_expert`` choose). Every other
row, and K-quant rows elsewhere, take the float32 path below:

Each row is decoded block by block into float32 exactly as gguf-py's ``gguf.quants`` decodes it
(the same float32 operations in the same order, no fused multiply-add: the decoded weights equal
gguf's bit for bit, tests/test_gguf_import.py), then multiplied with the activations (float32,
SIMD reductions allowed). A row is decoded once per call and used for all T tokens, so a prefill
chunk pays the decoding once per weight, a decode step (T = 1) once per weight read.

Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL,
IQ4_XS, MXFP4 (ggml type ids, engine.gguf_blocks.BLOCK_TYPES). Block layouts:
ggml/src/ggml-common.h; decoding: gguf-py/gguf/quants.py.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import kernels as K
from .gguf_blocks import BLOCK_TYPES
from .kernels import _KW, F16_TABLE

# decoding: no fastmath (the float32 products and sums of gguf.quants, unfused)
_EXACT = dict(nogil=True, cache=_KW["cache"])
_FAST = dict(nogil=True, cache=_KW["cache"], fastmath=_KW["fastmath"])

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # e2m1 doubled


@njit(inline="always", **_EXACT)
def _h(src, i, lut):
    """The little-endian IEEE half at bytes i, i + 1 of ``src`` as float32."""
    return lut[np.int64(src[i]) | (np.int64(src[i + 1]) << 8)]


@njit(**_EXACT)
def _q8_0(src, o, out, nb, lut):
    for b in range(nb):
        s = b * 34
        d = _h(src, s, lut)
        for j in range(32):
            out[o + b * 32 + j] = np.float32(np.int8(src[s + 2 + j])) * d


@njit(**_EXACT)
def _q4_0(src, o, out, nb, lut):
    for b in range(nb):
        s = b * 18
        d = _h(src, s, lut)
        for j in range(16):
            q = np.int64(src[s + 2 + j])
            out[o + b * 32 + j] = d * np.float32((q & 0x0F) - 8)
            out[o + b * 32 + j + 16] = d * np.float32((q >> 4) - 8)


@njit(**_EXACT)
def _q4_1(src, o, out, nb, lut):
    for b in range(nb):
        s = b * 20
        d = _h(src, s, lut)
        m = _h(src, s + 2, lut)
        for j in range(16):
            q = np.int64(src[s + 4 + j])
            out[o + b * 32 + j] = d * np.float32(q & 0x0F) + m
            out[o + b * 32 + j + 16] = d * np.float32(q >> 4) + m


@njit(inline="always", **_EXACT)
def _qh32(src, s):
    return (np.int64(src[s]) | (np.int64(src[s + 1]) << 8) | (np.int64(src[s + 2]) << 16)
            | (np.int64(src[s + 3]) << 24))


@njit(inline="always", **_EXACT)
def _f32_of(bits):
    """The float32 whose IEEE bits are the low 32 bits of int64 ``bits``."""
    return np.array([bits], np.int64).astype(np.uint32).view(np.float32)[0]


@njit(**_EXACT)
def _q5_0(src, o, out, nb, lut):
    for b in range(nb):
        s = b * 22
        d = _h(src, s, lut)
        qh = _qh32(src, s + 2)
        for j in range(32):
            q = np.int64(src[s + 6 + (j & 15)])
            lo = (q & 0x0F) if j < 16 else (q >> 4)
            v = (lo | (((qh >> j) & 1) << 4)) - 16
            out[o + b * 32 + j] = d * np.float32(v)


@njit(**_EXACT)
def _q5_1(src, o, out, nb, lut):
    for b in range(nb):
        s = b * 24
        d = _h(src, s, lut)
        m = _h(src, s + 2, lut)
        qh = _qh32(src, s + 4)
        for j in range(32):
            q = np.int64(src[s + 8 + (j & 15)])
            lo = (q & 0x0F) if j < 16 else (q >> 4)
            v = lo | (((qh >> j) & 1) << 4)
            out[o + b * 32 + j] = d * np.float32(v) + m


@njit(**_EXACT)
def _q2_k(src, o, out, nb, lut):
    for b in range(nb):
        s = b * 84  # scales[16], qs[64], d, dmin
        d = _h(src, s + 80, lut)
        dmin = _h(src, s + 82, lut)
        for e in range(256):
            half, rest = e // 128, e % 128
            sh, k = rest // 32, rest % 32
            q = (np.int64(src[s + 16 + half * 32 + k]) >> (2 * sh)) & 3
            sc = np.int64(src[s + e // 16])
            dl = d * np.float32(sc & 0x0F)
            ml = dmin * np.float32(sc >> 4)
            out[o + b * 256 + e] = dl * np.float32(q) - ml


@njit(**_EXACT)
def _q3_k(src, o, out, nb, lut):
    for b in range(nb):
        s = b * 110  # hmask[32], qs[64], scales[12], d
        d = _h(src, s + 108, lut)
        for e in range(256):
            g = e // 16
            lsc = (np.int64(src[s + 96 + g]) & 0x0F) if g < 8 else (np.int64(src[s + 96 + g - 8]) >> 4)
            hsc = (np.int64(src[s + 104 + g % 4]) >> (2 * (g // 4))) & 3
            sc = np.float32((lsc | (hsc << 4)) - 32)
            dl = d * sc
            half, rest = e // 128, e % 128
            sh, k = rest // 32, rest % 32
            ql = (np.int64(src[s + 32 + half * 32 + k]) >> (2 * sh)) & 3
            hb = ((np.int64(src[s + (e % 32)]) >> (e // 32)) & 1) ^ 1
            out[o + b * 256 + e] = dl * np.float32(ql - (hb << 2))


@njit(inline="always", **_EXACT)
def _scale_min_k4(src, s, j):
    """(scale, min) of sub-block j (0..7) of a Q4_K / Q5_K block's 12 packed bytes at s."""
    if j < 4:
        return np.int64(src[s + j]) & 0x3F, np.int64(src[s + 4 + j]) & 0x3F
    return ((np.int64(src[s + 8 + j - 4]) & 0x0F) | ((np.int64(src[s + j - 4]) >> 2) & 0x30),
            (np.int64(src[s + 8 + j - 4]) >> 4) | ((np.int64(src[s + 4 + j - 4]) >> 2) & 0x30))


@njit(**_EXACT)
def _q4_k(src, o, out, nb, lut):
    for b in range(nb):
        s = b * 144  # d, dmin, scales[12], qs[128]
        d = _h(src, s, lut)
        dmin = _h(src, s + 2, lut)
        for j in range(8):
            sc, mn = _scale_min_k4(src, s + 4, j)
            dd = d * np.float32(sc)
            dm = dmin * np.float32(mn)
            chunk, nib = j // 2, j % 2
            for k in range(32):
                q = (np.int64(src[s + 16 + chunk * 32 + k]) >> (4 * nib)) & 0x0F
                out[o + b * 256 + j * 32 + k] = dd * np.float32(q) - dm


@njit(**_EXACT)
def _q5_k(src, o, out, nb, lut):
    for b in range(nb):
        s = b * 176  # d, dmin, scales[12], qh[32], qs[128]
        d = _h(src, s, lut)
        dmin = _h(src, s + 2, lut)
        for j in range(8):
            sc, mn = _scale_min_k4(src, s + 4, j)
            dd = d * np.float32(sc)
            dm = dmin * np.float32(mn)
            chunk, nib = j // 2, j % 2
            for k in range(32):
                ql = (np.int64(src[s + 48 + chunk * 32 + k]) >> (4 * nib)) & 0x0F
                qh = (np.int64(src[s + 16 + k]) >> j) & 1
                out[o + b * 256 + j * 32 + k] = dd * np.float32(ql | (qh << 4)) - dm


@njit(**_EXACT)
def _q6_k(src, o, out, nb, lut):
    for b in range(nb):
        s = b * 210  # ql[128], qh[64], scales[16] (int8), d
        d = _h(src, s + 208, lut)
        for e in range(256):
            half, rest = e // 128, e % 128
            sh, k = rest // 32, rest % 32
            ql = (np.int64(src[s + half * 64 + (sh % 2) * 32 + k]) >> (4 * (sh // 2))) & 0x0F
            qh = (np.int64(src[s + 128 + half * 32 + k]) >> (2 * sh)) & 3
            q = (ql | (qh << 4)) - 32
            dl = d * np.float32(np.int8(src[s + 192 + e // 16]))
            out[o + b * 256 + e] = dl * np.float32(q)


@njit(**_EXACT)
def _iq4_nl(src, o, out, nb, lut, kv):
    for b in range(nb):
        s = b * 18
        d = _h(src, s, lut)
        for j in range(16):
            q = np.int64(src[s + 2 + j])
            out[o + b * 32 + j] = d * np.float32(kv[q & 0x0F])
            out[o + b * 32 + j + 16] = d * np.float32(kv[q >> 4])


@njit(**_EXACT)
def _iq4_xs(src, o, out, nb, lut, kv):
    for b in range(nb):
        s = b * 136  # d, scales_h (u16), scales_l[4], qs[128]
        d = _h(src, s, lut)
        sh = np.int64(src[s + 2]) | (np.int64(src[s + 3]) << 8)
        for i in range(8):
            lo = (np.int64(src[s + 4 + i // 2]) >> (4 * (i % 2))) & 0x0F
            hi = (sh >> (2 * i)) & 3
            dl = d * np.float32((lo | (hi << 4)) - 32)
            for k in range(16):
                q = np.int64(src[s + 8 + i * 16 + k])
                out[o + b * 256 + i * 32 + k] = dl * np.float32(kv[q & 0x0F])
                out[o + b * 256 + i * 32 + k + 16] = dl * np.float32(kv[q >> 4])


@njit(**_EXACT)
def _mxfp4(src, o, out, nb, kv):
    for b in range(nb):
        s = b * 17  # e8m0 byte, qs[16]
        e = np.int64(src[s])
        d = _f32_of((0x00200000 << e) if e < 2 else ((e - 1) << 23))  # ggml_e8m0_to_fp32_half
        for j in range(16):
            q = np.int64(src[s + 1 + j])
            out[o + b * 32 + j] = d * np.float32(kv[q & 0x0F])
            out[o + b * 32 + j + 16] = d * np.float32(kv[q >> 4])


@njit(**_EXACT)
def dequant_row(t, src, out, lut, iq4, fp4):
    """Decode one row: ``src`` uint8 (the row's blocks of ggml type ``t``) -> ``out`` float32 [N]
    (N = len(out)), bit-identical to gguf.quants.dequantize. ``lut``: F16_TABLE; ``iq4`` /
    ``fp4``: IQ4_VALUES / MXFP4_VALUES."""
    n = out.shape[0]
    if t == 8:
        _q8_0(src, 0, out, n // 32, lut)
    elif t == 12:
        _q4_k(src, 0, out, n // 256, lut)
    elif t == 14:
        _q6_k(src, 0, out, n // 256, lut)
    elif t == 13:
        _q5_k(src, 0, out, n // 256, lut)
    elif t == 2:
        _q4_0(src, 0, out, n // 32, lut)
    elif t == 3:
        _q4_1(src, 0, out, n // 32, lut)
    elif t == 6:
        _q5_0(src, 0, out, n // 32, lut)
    elif t == 7:
        _q5_1(src, 0, out, n // 32, lut)
    elif t == 10:
        _q2_k(src, 0, out, n // 256, lut)
    elif t == 11:
        _q3_k(src, 0, out, n // 256, lut)
    elif t == 20:
        _iq4_nl(src, 0, out, n // 32, lut, iq4)
    elif t == 23:
        _iq4_xs(src, 0, out, n // 256, lut, iq4)
    elif t == 39:
        _mxfp4(src, 0, out, n // 32, fp4)
    elif t == 0:
        for i in range(n):
            out[i] = _f32_of(_qh32(src, 4 * i))
    elif t == 1:
        for i in range(n):
            out[i] = _h(src, 2 * i, lut)
    elif t == 30:
        for i in range(n):
            out[i] = _f32_of((np.int64(src[2 * i]) << 16) | (np.int64(src[2 * i + 1]) << 24))


@njit(inline="always", **_FAST)
def _dot(a, b):
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


_ROWS = 16  # rows decoded per parallel work item (one scratch row each)


@njit(parallel=True, **_FAST)
def linear_gguf(x, w, t, out, lut, iq4, fp4):
    """out[T, O] = x[T, N] @ W^T for W's rows of ggml type ``t`` in ``w`` uint8 [O, >= row bytes]."""
    T, N = x.shape
    O = out.shape[1]
    for c in prange((O + _ROWS - 1) // _ROWS):
        row = np.empty(N, np.float32)
        for o in range(c * _ROWS, min(O, (c + 1) * _ROWS)):
            dequant_row(t, w[o], row, lut, iq4, fp4)
            for k in range(T):
                out[k, o] = _dot(x[k], row)


@njit(parallel=True, **_FAST)
def expert_gguf(x, types, gw, uw, dw, h, out, lut, iq4, fp4):
    """out[T, D] = down(silu(gate(x)) * up(x)) for x float32 [T, D] with the slab's rows:
    gw, uw uint8 [I, *], dw uint8 [D, *] of the ggml types ``types`` uint8 [>= 3]
    (gate, up, down); h float32 [T, I] scratch."""
    T, D = x.shape
    I = gw.shape[0]
    tg, tu, td = types[0], types[1], types[2]
    for c in prange((I + _ROWS - 1) // _ROWS):
        rg = np.empty(D, np.float32)
        ru = np.empty(D, np.float32)
        for i in range(c * _ROWS, min(I, (c + 1) * _ROWS)):
            dequant_row(tg, gw[i], rg, lut, iq4, fp4)
            dequant_row(tu, uw[i], ru, lut, iq4, fp4)
            for k in range(T):
                g = _dot(x[k], rg)
                u = _dot(x[k], ru)
                h[k, i] = g / (np.float32(1.0) + np.exp(-g)) * u
    for c in prange((D + _ROWS - 1) // _ROWS):
        rd = np.empty(I, np.float32)
        for o in range(c * _ROWS, min(D, (c + 1) * _ROWS)):
            dequant_row(td, dw[o], rd, lut, iq4, fp4)
            for k in range(T):
                out[k, o] = _dot(h[k], rd)


def dequantize(t: int, rows: np.ndarray, n: int) -> np.ndarray:
    """float32 [O, n]: the rows uint8 [O, >= row bytes] of ggml type ``t`` decoded (tests, tools).

    Raises:
        ValueError: a type this engine does not compute on.
    """
    if t not in BLOCK_TYPES:
        raise ValueError(f"ggml type {t} is not one this engine computes on")
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    out = np.empty((rows.shape[0], n), np.float32)
    for o in range(rows.shape[0]):
        dequant_row(t, rows[o], out[o], F16_TABLE, IQ4_VALUES, MXFP4_VALUES)
    return out


def integer_ok(*ts: int) -> bool:
    """Whether rows of the ggml types ``ts`` run the integer K-quant kernels here."""
    return K.KQ_SIMD and all(int(t) in K.KQ_TYPES for t in ts)


def linear(x: np.ndarray, w: np.ndarray, t: int, out: np.ndarray) -> np.ndarray:
    """out[T, O] = x[T, N] @ W^T, W's rows uint8 [O, >= row bytes] of ggml type ``t`` (K-quant
    rows: x quantized to Q8_K, integer products; :func:`integer_ok`)."""
    if integer_ok(t):
        K.linear_kq(np.ascontiguousarray(x, np.float32), w, int(t), out)
        return out
    linear_gguf(np.ascontiguousarray(x, np.float32), w, int(t), out, F16_TABLE, IQ4_VALUES, MXFP4_VALUES)
    return out


def run_expert(v: dict, x: np.ndarray, h: np.ndarray, out: np.ndarray) -> None:
    """out[T, D] = the SwiGLU expert of a GGUF-born slab's views ``v`` (engine.gguf_blocks) at x
    float32 [T, D]; h float32 [T, I] scratch. All three projections K-quants: the integer
    kernel (K.expert_kq; :func:`integer_ok`), else the float32 one."""
    ty = v["types"]
    if integer_ok(ty[0], ty[1], ty[2]):
        K.expert_kq(np.ascontiguousarray(x, np.float32), int(ty[0]), int(ty[1]), int(ty[2]), v["gate_proj.q"],
                    v["up_proj.q"], v["down_proj.q"], h, np.empty_like(h), out)
        return
    expert_gguf(x, v["types"], v["gate_proj.q"], v["up_proj.q"], v["down_proj.q"], h, out, F16_TABLE,
                IQ4_VALUES, MXFP4_VALUES)


T1_FIELDS = ("types", "gate_proj.q", "up_proj.q", "down_proj.q")


def t1_fields(layout: dict) -> np.ndarray | None:
    """Byte offsets int64 [4] inside a GGUF-born slab of T1_FIELDS (for :func:`run_experts_t1`),
    or None for a slab with biases (gpt-oss runs its own expert)."""
    at = {name: int(off) for name, off, _dt, _shape in layout["fields"]}
    if any(name.endswith(".b") for name in at):
        return None
    return np.array([at[f] for f in T1_FIELDS], np.int64)


def run_experts_t1(x: np.ndarray, arena: np.ndarray, offs: np.ndarray, layout: dict, h: np.ndarray,
                   out: np.ndarray) -> None:
    """out[k] = run_expert(expert k)(x) for the n = out.shape[0] GGUF-born slabs whose
    T1_FIELDS sit at byte offsets offs int64 [n, 4] of ``arena`` (the expert cache's), x
    float32 [1, D], h float32 [n, I] scratch: K-quant experts in one call (K.experts_kq_t1,
    bit-identical to run_expert on each), the others one by one."""
    shapes = {name: shape for name, _off, _dt, shape in layout["fields"]}
    (I, wgu), (D, wdn) = shapes["gate_proj.q"], shapes["down_proj.q"]
    ty = arena[offs[0, 0]:offs[0, 0] + 3]  # a layer's experts share their types
    if integer_ok(*ty):
        K.experts_kq_t1(np.ascontiguousarray(x, np.float32), arena, offs, wgu, wdn, h, np.empty_like(h), out)
        return
    for k in range(out.shape[0]):
        v = {"types": arena[offs[k, 0]:offs[k, 0] + 4]}
        for f, (rows, width) in (("gate_proj.q", (I, wgu)), ("up_proj.q", (I, wgu)), ("down_proj.q", (D, wdn))):
            o = offs[k, T1_FIELDS.index(f)]
            v[f] = arena[o:o + rows * width].reshape(rows, width)
        run_expert(v, x, h[k:k + 1], out[k:k + 1])


def run_experts_sorted(x: np.ndarray, tok: np.ndarray, starts: np.ndarray, arena: np.ndarray, offs: np.ndarray,
                       layout: dict, nch: int, h: np.ndarray, out: np.ndarray) -> None:
    """A prefill chunk's resident GGUF-born experts (arguments as K.experts_kq_sorted's: x
    float32 [T, D], tok int64 [M], starts int64 [n + 1], offs int64 [n, 4] of T1_FIELDS, h
    float32 [M, I] scratch, out float32 [M, D]): K-quant experts in one call, bit-identical to
    run_expert on each expert's rows x[tok[lo:hi]]; the others one by one."""
    shapes = {name: shape for name, _off, _dt, shape in layout["fields"]}
    (I, wgu), (D, wdn) = shapes["gate_proj.q"], shapes["down_proj.q"]
    ty = arena[offs[0, 0]:offs[0, 0] + 3]  # a layer's experts share their types
    if integer_ok(*ty):
        K.experts_kq_sorted(np.ascontiguousarray(x, np.float32), tok, starts, arena, offs, wgu, wdn, nch, h,
                            np.empty_like(h), out)
        return
    for e in range(offs.shape[0]):
        lo, hi = int(starts[e]), int(starts[e + 1])
        if hi == lo:
            continue
        v = {"types": arena[offs[e, 0]:offs[e, 0] + 4]}
        for f, (rows, width) in (("gate_proj.q", (I, wgu)), ("up_proj.q", (I, wgu)), ("down_proj.q", (D, wdn))):
            o = offs[e, T1_FIELDS.index(f)]
            v[f] = arena[o:o + rows * width].reshape(rows, width)
        run_expert(v, x[tok[lo:hi]], h[lo:hi], out[lo:hi])
