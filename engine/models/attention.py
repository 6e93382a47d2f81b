"""The attention half of the shared decoder layer: grouped-query attention with optional q / k
norms, biases, clipping, partial rotary, sliding windows and sinks, over a positional KV cache.
``MoEModel`` (engine/models/base.py) composes it; a family with another attention (MLA,
linear attention, Gemma 4's) overrides :meth:`Attention.attention` and its weights in its own file.

Key: T tokens, D hidden, H query heads, Hkv KV heads, S head size, C context capacity.
"""

from __future__ import annotations

import numpy as np

from ..kernel_choice import K


class Attention:
    """Mixin of MoEModel: reads ``args``, ``layers``, ``k_cache`` / ``v_cache`` [L, Hkv, C, S],
    ``cos`` / ``sin``, ``rotary_dim``, ``scale``, ``windows``, ``kv_dtype``, ``dense_quant`` and
    ``gs``; its decode step runs in one K.attention_t1 call where ``_attention_t1_args`` (the
    fused path's guard, base.py) allows."""

    def qk_norm(self, i: int, q: np.ndarray, k: np.ndarray) -> None:
        """In place: OLMoE ("proj") normalises the whole projection [T, H*S]; Qwen3 ("head")
        each head's S values (rows of the [T*H, S] view)."""
        a, ly = self.args, self.layers[i]
        if a.qk_norm == "proj":
            K.rmsnorm(q, ly["q_norm"], a.rms_norm_eps, q)
            K.rmsnorm(k, ly["k_norm"], a.rms_norm_eps, k)
        elif a.qk_norm == "head":
            S = a.head_dim
            q2, k2 = q.reshape(-1, S), k.reshape(-1, S)
            K.rmsnorm(q2, ly["q_norm"], a.rms_norm_eps, q2)
            K.rmsnorm(k2, ly["k_norm"], a.rms_norm_eps, k2)

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, Hkv, S = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        if T == 1:
            f = self._attention_t1_args(i)
            if f is not None:  # one kernel call, the same values as the steps below
                ln_w, eps, w, s, gs, qkn, qn_w, kn_w, ow, osc = f
                out = np.empty_like(x)
                K.attention_t1(x, ln_w, eps, w, s, gs, qkn, qn_w, kn_w, self.cos[pos0:pos0 + 1],
                               self.sin[pos0:pos0 + 1], self.k_cache[i], self.v_cache[i], pos0, self.scale,
                               ow, osc, np.empty_like(x), np.empty((1, H * S), np.float32),
                               np.empty((1, Hkv * S), np.float32), np.empty((1, Hkv * S), np.float32),
                               np.empty((1, H * S), np.float32), out)
                return out
        h = np.empty_like(x)  # [T, D]
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        q, k, v = ly["qkv"](h, (np.empty((T, H * S), np.float32),  # [T, H*S]
                                np.empty((T, Hkv * S), np.float32),  # [T, Hkv*S]
                                np.empty((T, Hkv * S), np.float32)))  # [T, Hkv*S]
        self.qk_norm(i, q, k)
        if a.clip_qkv is not None:
            for t in (q, k, v):
                np.clip(t, -a.clip_qkv, a.clip_qkv, out=t)
        q3 = q.reshape(T, H, S)
        k3 = k.reshape(T, Hkv, S)
        cos, sin = self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T]
        if self.rotary_dim == S:
            K.rope(q3, cos, sin)
            K.rope(k3, cos, sin)
        else:  # partial rotary (GLM): the first rotary_dim values of each head turn
            R = self.rotary_dim
            for t3 in (q3, k3):
                part = np.ascontiguousarray(t3[:, :, :R])
                K.rope(part, cos, sin)
                t3[:, :, :R] = part
        self._kv_append(i, pos0, k3, v.reshape(T, Hkv, S))
        att = np.empty((T, H, S), np.float32)  # [T, H, S]
        kc, vc = self.k_cache[i], self.v_cache[i]
        w = self.windows[i]
        # Sliding window w: the query at position p sees keys p - w + 1 .. p (transformers'
        # mask kv_idx > q_idx - w). Queries at p < w see every earlier key (one causal call);
        # later ones attend a cache view starting at their window's first key.
        n_full = T if not w else min(T, max(0, w - pos0))
        sinks = ly.get("sinks")  # gpt-oss: a learned sink logit per head joins the softmax
        if n_full:
            self._attend(q3[:n_full], kc, vc, pos0, sinks, att[:n_full])
        for t in range(n_full, T):
            j0 = pos0 + t - w + 1
            self._attend(q3[t:t + 1], kc[:, j0:], vc[:, j0:], w - 1, sinks, att[t:t + 1])
        return ly["o_proj"](att.reshape(T, H * S), np.empty_like(x))  # [T, D]

    def draft_attention(self, j: int, x: np.ndarray, pos: int) -> np.ndarray | None:
        """Attention of MoE layer ``j``'s decoder layer on a draft residual x float32 [1, D] at
        position ``pos``, for a look ahead (PILOT's draft, engine/prefetch.py): float32 [1, D],
        the model left as it was (the KV rows the call writes at ``pos`` are put back). None
        when the family computes attention its own way (MLA, linear attention: more state than
        one row), or pos is outside the context; the caller then predicts without it."""
        if type(self).attention is not Attention.attention or x.shape[0] != 1 or not 0 <= pos < self.C:
            return None
        i = self.moe_layer_ids[j]
        k_row, v_row = self.k_cache[i, :, pos].copy(), self.v_cache[i, :, pos].copy()
        try:
            return self.attention(i, x, pos)
        finally:
            self.k_cache[i, :, pos] = k_row
            self.v_cache[i, :, pos] = v_row

    def _attend(self, q, kc, vc, pos0, sinks, out) -> None:
        if sinks is None:
            K.attention(q, kc, vc, pos0, self.scale, out)
        else:
            K.attention_sink(q, kc, vc, pos0, self.scale, sinks, out)

    def _kv_append(self, r: int, pos0: int, k3: np.ndarray, v3: np.ndarray) -> None:
        """Store the K and V rows k3, v3 float32 [T, Hkv, S] of positions pos0..pos0+T-1 in
        row r of the KV cache (k_cache / v_cache [L, Hkv, C, S])."""
        T = k3.shape[0]
        self._kv_write(self.k_cache[r, :, pos0:pos0 + T].transpose(1, 0, 2), k3)  # [T, Hkv, S] views
        self._kv_write(self.v_cache[r, :, pos0:pos0 + T].transpose(1, 0, 2), v3)

    def _kv_write(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Write float32 K or V rows src into the cache slice dst (same shape, 2-D or 3-D, any
        strides) as the cache holds them: float32 as is; f16 rounded to nearest even and
        clipped to the finite half range, so a huge value stays finite instead of becoming inf
        (K.kv_put_f16: numpy's rounding bit for bit, without numpy's temporaries)."""
        if self.kv_dtype == "f32":
            dst[...] = src
        elif src.ndim == 2:
            K.kv_put_f16(src[None], dst[None])
        else:
            K.kv_put_f16(src, dst)
