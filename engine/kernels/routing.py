"""Routing: softmax top-k over a router's logits, and the combine of the K experts' outputs
in rank order."""

from __future__ import annotations

import numpy as np
from numba import njit

from .setup import _KW
from .tiles import _exp32


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
