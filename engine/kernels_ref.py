"""Plain-numpy twins of kernels.py: same names, same signatures, same ``out`` convention.

They are the test oracle for the numba kernels and the fallback when numba is unavailable
(``COLIBRI_NO_NUMBA=1``). Shapes and weight kinds are documented in kernels.py.
"""

from __future__ import annotations

import numpy as np

from .quant import IL, deinterleave_q4

F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def _q4(w, s, gs):
    O, half = w.shape
    q = np.empty((O, half * 2), dtype=np.float32)
    q[:, 0::2] = (w & 15).astype(np.float32) - 8
    q[:, 1::2] = (w >> 4).astype(np.float32) - 8
    s = s.view(np.float16).astype(np.float32) if s.dtype == np.uint16 else s  # half bits (format 3)
    return (q.reshape(O, -1, gs) * s[:, :, None]).reshape(O, -1)


def linear_f32(x, w, out):
    out[...] = x @ w.T


def linear_f16(x, w, lut, out):
    out[...] = x @ lut[w].T


def linear_q8(x, w, s, out):
    out[...] = (quantize_activations(x, QB) @ w.astype(np.float32).T) * s


def quantize_activations(x, gs):
    """The activations the q4 and q8 kernels multiply: each row of x [T, N] quantized per block
    of gs columns (the last block may be shorter) to int8 with d = max|x_b| / 127,
    q = rint(x * (127 / max|x_b|)); returns q * d (float32 [T, N]), as llama.cpp's Q8_0
    activations meet its Q4_0 / Q8_0 weights. q4 uses its group size, q8 blocks of 32."""
    x = np.asarray(x, np.float32)
    out = np.empty_like(x)
    for lo in range(0, x.shape[1], gs):
        g = x[:, lo:lo + gs]
        m = np.abs(g).max(axis=1, keepdims=True)
        with np.errstate(divide="ignore"):
            inv = np.where(m > 0, np.float32(127.0) / m, np.float32(0.0)).astype(np.float32)
        d = (m / np.float32(127.0)).astype(np.float32)
        out[:, lo:lo + gs] = np.rint(g * inv).astype(np.float32) * d
    return out


QB = 32  # activation block of the q8 kernels


def linear_q4(x, w, s, gs, out):
    out[...] = quantize_activations(x, gs) @ _q4(w, s, gs).T


def linears_q4(x, w, s, gs, out):
    for wm, sm, om in zip(w, s, out):
        linear_q4(x, wm, sm, gs, om)


def linears_q8(x, w, s, out):
    for wm, sm, om in zip(w, s, out):
        linear_q8(x, wm, sm, om)


_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def linear_mxfp4(x, w, s, out):
    O, half = w.shape
    v = np.empty((O, half * 2), dtype=np.float32)
    v[:, 0::2] = _FP4[w & 15]
    v[:, 1::2] = _FP4[w >> 4]
    sc = np.ldexp(np.float32(1.0), s.astype(np.int32) - 127).astype(np.float32)
    out[...] = x @ (v.reshape(O, -1, 32) * sc[:, :, None]).reshape(O, -1).T


def _silu(g):
    return g / (1.0 + np.exp(-g))


def expert_f32(x, gw, uw, dw, h, out):
    h[...] = _silu(x @ gw.T) * (x @ uw.T)
    out[...] = h @ dw.T


def expert_f16(x, gw, uw, dw, lut, h, out):
    expert_f32(x, lut[gw], lut[uw], lut[dw], h, out)


def expert_q8(x, gw, gs, uw, us, dw, ds, h, out):
    xq = quantize_activations(x, QB)
    h[...] = _silu((xq @ gw.astype(np.float32).T) * gs) * ((xq @ uw.astype(np.float32).T) * us)
    out[...] = (quantize_activations(h, QB) @ dw.astype(np.float32).T) * ds


def expert_q4(x, gw, gs, uw, us, dw, ds, gsz, h, out):
    xq = quantize_activations(x, gsz)
    h[...] = _silu(xq @ _q4(gw, gs, gsz).T) * (xq @ _q4(uw, us, gsz).T)
    out[...] = quantize_activations(h, gsz) @ _q4(dw, ds, gsz).T


def _arena_at(arena, o, n, dt, shape):
    return arena[o:o + n * np.dtype(dt).itemsize].view(dt).reshape(shape)


def _arena_q4(arena, off, O, N, gsz, il=False):
    w = (deinterleave_q4(_arena_at(arena, off[0], O * N // 2, np.uint8, (O // IL, N // 64, IL * 32))) if il
         else _arena_at(arena, off[0], O * N // 2, np.uint8, (O, N // 2)))
    return w, _arena_at(arena, off[1], O * (N // gsz), np.uint16, (O, N // gsz))


def q4_interleavable(w, s, gs):
    """The twins keep attention matrices row-major (Linear.interleave is a no-op here)."""
    return False


def q4_interleaved_ok(gs):
    """Interleaved expert slabs are run de-interleaved here (run_expert copies them row-major;
    the arena twins below take il)."""
    return False


def _arena_q8(arena, off, O, N):
    return _arena_at(arena, off[0], O * N, np.int8, (O, N)), _arena_at(arena, off[1], O, np.float32, (O,))


def experts_q4_t1(x, arena, offs, I, gsz, h, out, il=False):
    D = x.shape[1]
    for k in range(out.shape[0]):
        o = offs[k]
        expert_q4(x, *_arena_q4(arena, o[0:2], I, D, gsz, il), *_arena_q4(arena, o[2:4], I, D, gsz, il),
                  *_arena_q4(arena, o[4:6], D, I, gsz, il), gsz, h[k:k + 1], out[k:k + 1])


def experts_q8_t1(x, arena, offs, I, h, out):
    D = x.shape[1]
    for k in range(out.shape[0]):
        o = offs[k]
        expert_q8(x, *_arena_q8(arena, o[0:2], I, D), *_arena_q8(arena, o[2:4], I, D),
                  *_arena_q8(arena, o[4:6], D, I), h[k:k + 1], out[k:k + 1])


def experts_q4_sorted(x, tok, starts, arena, offs, I, gsz, nch, h, out, il=False):
    D = x.shape[1]
    for e in range(starts.shape[0] - 1):
        lo, hi = starts[e], starts[e + 1]
        if hi > lo:
            o = offs[e]
            expert_q4(x[tok[lo:hi]], *_arena_q4(arena, o[0:2], I, D, gsz, il),
                      *_arena_q4(arena, o[2:4], I, D, gsz, il), *_arena_q4(arena, o[4:6], D, I, gsz, il),
                      gsz, h[lo:hi], out[lo:hi])


def cache_take_resident(where, state, busy, last_use, routed_now, pinned, spec, ea, clock, resident, ss, pm):
    if len(ea) and (ea.min() < 0 or ea.max() >= len(where) or len(np.unique(ea)) != len(ea)):
        return -1
    sl = where[ea]
    if (sl < 0).any() or (state[np.maximum(sl, 0)] != resident).any():
        return -1
    ss[:] = sl
    routed_now[:] = False
    routed_now[ea] = True
    pm[:] = pinned[ea]
    busy[sl] += 1
    last_use[ea] = np.arange(clock + 1, clock + 1 + len(ea))
    return int(spec[sl].sum())


def route_softmax(logits, k, norm, idx, w, p):
    """kernels.route_softmax in numpy: e**z as float64 exp rounded to float32 (kernels._exp32
    gives those bits), sums in order (cumsum), the lowest id first among equal probabilities
    (a stable sort)."""
    with np.errstate(over="ignore", invalid="ignore"):
        z = logits - logits.max(axis=1, keepdims=True)
        e = np.exp(z.astype(np.float64)).astype(np.float32)
        p[...] = e / np.cumsum(e, axis=1, dtype=np.float32)[:, -1:]
    idx[...] = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w[...] = np.take_along_axis(p, idx, axis=1)
    if norm:
        w /= np.cumsum(w, axis=1, dtype=np.float32)[:, -1:]


def combine_ranked(y, w, out):
    out[...] = y[:, 0] * w[:, 0:1]
    for k in range(1, y.shape[1]):
        out += y[:, k] * w[:, k:k + 1]


def combine_sorted(y, pos, w, out):
    out[...] = y[pos[:, 0]] * w[:, 0:1]
    for k in range(1, pos.shape[1]):
        out += y[pos[:, k]] * w[:, k:k + 1]


def embed_q8(ids, w, s, out):
    out[...] = w[ids].astype(np.float32) * s[ids][:, None]


def embed_q4(ids, w, s, gs, out):
    out[...] = _q4(w[ids], s[ids], gs)


def rmsnorm(x, w, eps, out):
    var = np.mean(x.astype(np.float32) ** 2, axis=1, keepdims=True)
    out[...] = w * (x / np.sqrt(var + np.float32(eps)))


def rope(x, cos, sin):
    half = x.shape[2] // 2
    a = x[:, :, :half].copy()
    b = x[:, :, half:].copy()
    c = cos[:, None, :]
    s = sin[:, None, :]
    x[:, :, :half] = a * c - b * s
    x[:, :, half:] = b * c + a * s


def kv_f32(a):
    """float32 values of a KV cache array: float32 as is, uint16 as IEEE half bits."""
    return a.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else a


def kv_put_f16(src, dst):
    """dst[...] = IEEE half bits of src clipped to the finite half range (numpy's rounding)."""
    dst[...] = np.clip(src, -65504.0, 65504.0).astype(np.float16).view(np.uint16)


def attention(q, kc, vc, pos0, scale, out):
    n_used = pos0 + q.shape[0]
    kc, vc = kv_f32(kc[:, :n_used]), kv_f32(vc[:, :n_used])
    T, H, S = q.shape
    rep = H // kc.shape[0]
    for t in range(T):
        n = pos0 + t + 1
        for h in range(H):
            kh = h // rep
            sc = kc[kh, :n] @ q[t, h] * scale
            p = np.exp(sc - sc.max())
            out[t, h] = (p / p.sum()) @ vc[kh, :n]


def attention_sink(q, kc, vc, pos0, scale, sinks, out):
    n_used = pos0 + q.shape[0]
    kc, vc = kv_f32(kc[:, :n_used]), kv_f32(vc[:, :n_used])
    T, H, S = q.shape
    rep = H // kc.shape[0]
    for t in range(T):
        n = pos0 + t + 1
        for h in range(H):
            kh = h // rep
            sc = kc[kh, :n] @ q[t, h] * scale
            m = max(sc.max(), sinks[h])
            p = np.exp(sc - m)
            out[t, h] = (p / (p.sum() + np.exp(sinks[h] - m))) @ vc[kh, :n]


DELTA_EXP_FLOOR = np.float32(-80.0)
DELTA_TINY = np.float32(1e-30)


def _exp_floor(x):
    x = np.asarray(x, np.float32)
    return np.exp(np.where(x < DELTA_EXP_FLOOR, np.float32(-np.inf), x)).astype(np.float32)


def gated_delta(q, k, v, g, beta, S, chunk, out):
    """The chunked gated delta rule in matrix form (transformers' torch_chunk_gated_delta_rule:
    (I + A) [U | W] = [beta v | beta k e^c], P = U - W S0), per chunk for all heads at once."""
    H, T, dk = q.shape
    dv = v.shape[-1]
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        n = c1 - c0
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        c = np.cumsum(g[:, c0:c1], axis=1, dtype=np.float32)  # [H, n]
        lower = np.tril(np.ones((n, n), bool))
        decay = _exp_floor(np.where(lower, c[:, :, None] - c[:, None, :], np.float32(-np.inf)))  # [H, n, n]
        kb = kc * bc[..., None]
        M = np.tril((kb @ kc.transpose(0, 2, 1)) * decay, -1) + np.eye(n, dtype=np.float32)
        ec = _exp_floor(c)[..., None]  # [H, n, 1]
        sol = np.linalg.solve(M, np.concatenate([vc * bc[..., None], kb * ec], axis=-1)).astype(np.float32)
        P = sol[..., :dv] - sol[..., dv:] @ S  # [H, n, dv]
        out[:, c0:c1] = (qc * ec) @ S + ((qc @ kc.transpose(0, 2, 1)) * decay) @ P
        last = c[:, -1]
        S *= _exp_floor(last)[:, None, None]
        S += (kc * _exp_floor(last[:, None] - c)[..., None]).transpose(0, 2, 1) @ P
        S[np.abs(S) < DELTA_TINY] = 0


def current_threads() -> int:
    """The twins run on one thread (kernels.current_threads: the calling thread's kernel threads)."""
    return 1


def set_threads(n: int) -> None:
    """Twin of kernels.set_threads: numpy runs on the calling thread; nothing to set."""
