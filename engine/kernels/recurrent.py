"""The gated delta rule (Qwen3-Next / Qwen3.5 linear attention), in chunks."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .setup import _KW
from .tiles import _exp32


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
