"""The fused decode step (T = 1): the attention block of a layer in one call, and every layer
of a step in one call while its routed experts are resident. The same kernels in the same order
as the per-layer Python forward (engine/models/base.py), so the values are bit-identical."""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .setup import _FM, _KW
from .linears import linear_f32, linear_q4i, linear_q8, linears_q4i, linears_q8
from .experts import experts_q4_t1, experts_q8_t1
from .cache_take import cache_take_resident
from .routing import combine_ranked, _route_row
from .attention import attention, kv_put_f16, rmsnorm, rope


# --- the attention block of a decode step, in one call ---------------------------------------

# The kernels the composite below calls, bound to names the SERIALIZED rebinding (launch safety,
# engine/kernels/__init__.py) leaves alone: numba resolves an njit function's globals when it compiles.
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
