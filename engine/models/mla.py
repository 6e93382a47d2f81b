"""Multi-head latent attention (MLA, DeepSeek-V2 / V3, Kimi-K2, GLM-4.7-Flash) with the latent
KV cache, shared by the DeepSeek families.

Per layer and token (H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim,
r = kv_lora_rank, qr = q_lora_rank):

    q   = q_b_proj(rmsnorm(q_a_proj(h)))  or q_proj(h)        [H, dn + dr]
    ckv = kv_a_proj_with_mqa(h)                                 [r + dr]
    c   = rmsnorm(ckv[:r])  (kv_a_layernorm), k_pe = rope(ckv[r:])  (one RoPE key for all heads)
    k_h = [W_uk_h c, k_pe], v_h = W_uv_h c                      (kv_b_proj = [W_uk; W_uv] per head)
    out = o_proj(concat_h softmax(q_h . k_h * scale) v_h)

The cache holds only ``c`` and ``k_pe`` per token and layer: r + dr values (576 for
DeepSeek-V3 against 2 x 128 x 192 = 49,152 for the expanded heads). Decode and prefill run the
*absorbed* form (DeepSeek-V2 paper, section 2.1.2; the reference implementations' "absorb"
path): q_lat_h = W_uk_h^T q_nope_h, score = q_lat_h . c + q_pe_h . k_pe, o_lat_h =
softmax . c, out_h = W_uv_h o_lat_h. It equals the expanded form exactly in real arithmetic;
``MLAModel(absorb=False)`` runs the expanded form (expanding every cached position each call,
for tests). The converter stores kv_b_proj as two tensors ready for that:
``layers.i.k_absorb`` [H * r, dn] (W_uk_h^T stacked by head) and ``layers.i.v_absorb``
[H * dv, r] (W_uv_h), each quantized like the other dense matrices.

RoPE. ``rope_interleave`` (V3's default; V2 always): the rotary values come in adjacent pairs
(x0, x1), (x2, x3), ...; we de-interleave q_pe and k_pe (evens, then odds) and apply the
rotate-half RoPE, which rotates the same pairs by the same angles. The attention score only
sees q . k, so the layout of the rotated values does not matter as long as q and k share it.
Softmax scale (dn + dr)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN
(transformers' yarn_apply_mscale); YaRN's attention factor scales cos / sin.

Sources: transformers' models/deepseek_v2/modeling_deepseek_v2.py and
models/deepseek_v3/modeling_deepseek_v3.py (DeepseekV3Attention); DeepSeek-V2 (arXiv
2405.04434) for the absorbed form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from . import base
from .base import K, Linear, Tensor

ABSORB_PARTS = ("k_absorb", "v_absorb")


@dataclass(frozen=True, kw_only=True)
class MLAArgs(base.ModelArgs):
    """ModelArgs plus the MLA sizes (Hugging Face names). ``head_dim`` is qk_rope_head_dim
    (the rotated width, as transformers sets it); q_lora_rank 0 = a plain q_proj."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_values_per_token(self) -> int:
        """The latent cache: kv_lora_rank + qk_rope_head_dim values per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.qk_head_dim

    def dense_param_count(self) -> int:
        """Parameters that stay resident (everything but the routed experts)."""
        D, H, r, dr = self.hidden_size, self.num_attention_heads, self.kv_lora_rank, self.qk_rope_head_dim
        q = (D * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.q_dim) if self.q_lora_rank \
            else D * self.q_dim
        attn = q + D * (r + dr) + r + H * (self.qk_nope_head_dim + self.v_head_dim) * r + H * self.v_head_dim * D
        M, L, V = self.num_moe_layers, self.num_hidden_layers, self.vocab_size
        moe = self.moe_resident_params()
        return (V * D * (1 if self.tie_word_embeddings else 2) + L * (attn + 2 * D) + M * moe
                + (L - M) * 3 * D * self.intermediate_size + D)


def mla_fields(cfg: dict, path: str, family: str, heads: int) -> dict:
    """The MLA keys of config.json, validated (ConfigError naming ``path`` and the key)."""
    def n(key, lo, hi, default=None):
        return base.num(cfg, key, path, lo, hi, integer=True, family=family, default=default)

    qr = cfg.get("q_lora_rank")
    v = {"q_lora_rank": 0 if qr is None else n("q_lora_rank", 1, 1 << 20),
         "kv_lora_rank": n("kv_lora_rank", 1, 1 << 20),
         "qk_nope_head_dim": n("qk_nope_head_dim", 1, 1 << 16),
         "qk_rope_head_dim": n("qk_rope_head_dim", 2, 1 << 16),
         "v_head_dim": n("v_head_dim", 1, 1 << 16)}
    if v["qk_rope_head_dim"] % 2:
        raise ConfigError(f"{path}: qk_rope_head_dim ({v['qk_rope_head_dim']}) must be even for rotary embeddings")
    v["head_dim"] = v["qk_rope_head_dim"]
    v["num_key_value_heads"] = heads
    return v


def attention_tensors(args: MLAArgs, i: int) -> list[Tensor]:
    """Norms and MLA attention of transformer layer i, Hugging Face -> store names. kv_b_proj
    is stored split (``split="mla_kv_b"``, see :func:`split_kv_b`)."""
    D, H = args.hidden_size, args.num_attention_heads
    r, dr, qr = args.kv_lora_rank, args.qk_rope_head_dim, args.q_lora_rank
    hp, cp = f"model.layers.{i}.", f"layers.{i}."
    a = hp + "self_attn."
    out = [Tensor(hp + "input_layernorm.weight", cp + "input_layernorm", (D,), "keep"),
           Tensor(hp + "post_attention_layernorm.weight", cp + "post_attention_layernorm", (D,), "keep")]
    if qr:
        out += [Tensor(a + "q_a_proj.weight", cp + "q_a_proj", (qr, D), "quant"),
                Tensor(a + "q_a_layernorm.weight", cp + "q_a_layernorm", (qr,), "keep"),
                Tensor(a + "q_b_proj.weight", cp + "q_b_proj", (args.q_dim, qr), "quant")]
    else:
        out.append(Tensor(a + "q_proj.weight", cp + "q_proj", (args.q_dim, D), "quant"))
    out += [Tensor(a + "kv_a_proj_with_mqa.weight", cp + "kv_a_proj_with_mqa", (r + dr, D), "quant"),
            Tensor(a + "kv_a_layernorm.weight", cp + "kv_a_layernorm", (r,), "keep"),
            Tensor(a + "kv_b_proj.weight", cp + "kv_b_proj", (H * (args.qk_nope_head_dim + args.v_head_dim), r),
                   "quant", "mla_kv_b"),
            Tensor(a + "o_proj.weight", cp + "o_proj", (D, H * args.v_head_dim), "quant")]
    if args.attention_bias:
        if qr:
            out.append(Tensor(a + "q_a_proj.bias", cp + "q_a_proj.bias", (qr,), "keep"))
        out += [Tensor(a + "kv_a_proj_with_mqa.bias", cp + "kv_a_proj_with_mqa.bias", (r + dr,), "keep"),
                Tensor(a + "o_proj.bias", cp + "o_proj.bias", (D,), "keep")]
    return out


def split_shapes(args: MLAArgs, t: Tensor) -> list[tuple[str, tuple[int, int]]]:
    """The stored tensors a split tensor becomes: (store name, shape) for k_absorb, v_absorb."""
    H, r = args.num_attention_heads, args.kv_lora_rank
    p = t.ours[: -len("kv_b_proj")]
    return [(p + "k_absorb", (H * r, args.qk_nope_head_dim)), (p + "v_absorb", (H * args.v_head_dim, r))]


def split_kv_b(args: MLAArgs, t: Tensor, w: np.ndarray) -> dict[str, np.ndarray]:
    """kv_b_proj float32 [H * (dn + dv), r] -> {k_absorb [H * r, dn] (W_uk_h^T by head),
    v_absorb [H * dv, r]} (float32, before quantization)."""
    H, dn, dv, r = args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim, args.kv_lora_rank
    wb = w.reshape(H, dn + dv, r)
    (kn, ks), (vn, vs) = split_shapes(args, t)
    return {kn: np.ascontiguousarray(wb[:, :dn, :].transpose(0, 2, 1)).reshape(ks),
            vn: np.ascontiguousarray(wb[:, dn:, :]).reshape(vs)}


def _rows(lin: Linear, n: int) -> list[Linear]:
    """``lin`` [H * n, N] cut into H Linear views of n rows each (no copy)."""
    out = []
    for h in range(lin.out_features // n):
        part = object.__new__(Linear)
        part.w = lin.w[h * n:(h + 1) * n]
        part.s = None if lin.s is None else lin.s[h * n:(h + 1) * n]
        part.kind, part.bias, part.gs, part.out_features = lin.kind, None, lin.gs, n
        out.append(part)
    return out


class MLAModel(base.MoEModel):
    """The shared decoder with multi-head latent attention and the latent KV cache.

    Args (beyond MoEModel's): absorb: run the absorbed form (default) or expand the cached
        latents into per-head keys and values (reference; same values up to rounding).
    The cache ``kv_cache`` [L, 1, C, r + dr] (float32, or IEEE-half bits as uint16 for kv_dtype
    "f16") holds c (first r) and k_pe per position.
    """

    absorb = True
    rope = True  # False: the "rope" part of q and k enters the score unrotated (Kimi-Linear's NoPE MLA)

    def latent_row(self, i: int) -> int:
        """Row of ``kv_cache`` holding transformer layer i's latents (every layer has one here;
        a hybrid family caches its MLA layers only)."""
        return i

    def attention_weights(self, dense: dict, p: str) -> dict:
        a, dq, gs = self.args, self.dense_quant, self.gs
        ly = {"q_a_layernorm": dense.get(p + "q_a_layernorm"), "kv_a_layernorm": dense[p + "kv_a_layernorm"]}
        for n in ("q_a_proj", "q_b_proj", "q_proj"):
            if p + n + ".w" in dense:
                ly[n] = Linear(dense, p + n, dq, gs)
        ly["kv_a_proj_with_mqa"] = Linear(dense, p + "kv_a_proj_with_mqa", dq, gs)
        ly["o_proj"] = Linear(dense, p + "o_proj", dq, gs)
        ly["k_absorb"] = _rows(Linear(dense, p + "k_absorb", dq, gs), a.kv_lora_rank)
        ly["v_absorb"] = _rows(Linear(dense, p + "v_absorb", dq, gs), a.v_head_dim)
        return ly

    def alloc_kv(self) -> None:
        a = self.args
        L, W = a.num_hidden_layers, a.kv_lora_rank + a.qk_rope_head_dim
        self.kv_cache = base.kv_zeros((L, 1, self.C, W), base.KV_DTYPES[self.kv_dtype])  # [L, 1, C, r + dr]
        self.rotary_dim = a.qk_rope_head_dim
        self.cos, self.sin = base.rope_tables(a.qk_rope_head_dim, a.rope_theta, self.C, a.rope_scaling)
        scale = a.qk_head_dim ** -0.5
        sc = dict(a.rope_scaling)
        if sc.get("mscale_all_dim"):
            scale *= base.yarn_mscale(sc["factor"], sc["mscale_all_dim"]) ** 2
        self.scale = np.float32(scale)
        dr = a.qk_rope_head_dim
        self.perm = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)]) if a.rope_interleave else None

    @property
    def kv_bytes(self) -> int:
        return self.kv_cache.nbytes

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, dn, dr, dv, r = (a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim,
                            a.kv_lora_rank)
        eps = a.rms_norm_eps
        h = np.empty_like(x)  # [T, D]
        K.rmsnorm(x, ly["input_layernorm"], eps, h)
        qa = None
        if "q_a_proj" in ly:
            qa = ly["q_a_proj"](h, np.empty((T, a.q_lora_rank), np.float32))  # [T, qr]
            K.rmsnorm(qa, ly["q_a_layernorm"], eps, qa)
            q = ly["q_b_proj"](qa, np.empty((T, H * (dn + dr)), np.float32))
        else:
            q = ly["q_proj"](h, np.empty((T, H * (dn + dr)), np.float32))
        q3 = q.reshape(T, H, dn + dr)
        ckv = ly["kv_a_proj_with_mqa"](h, np.empty((T, r + dr), np.float32))  # [T, r + dr]
        c = np.ascontiguousarray(ckv[:, :r])
        K.rmsnorm(c, ly["kv_a_layernorm"], eps, c)
        q_pe = q3[:, :, dn:]
        k_pe = ckv[:, None, r:]
        if self.perm is not None:
            q_pe, k_pe = q_pe[:, :, self.perm], k_pe[:, :, self.perm]
        q_pe, k_pe = np.ascontiguousarray(q_pe), np.ascontiguousarray(k_pe)  # [T, H, dr], [T, 1, dr]
        if self.rope:
            cos, sin = self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T]
            K.rope(q_pe, cos, sin)
            K.rope(k_pe, cos, sin)
        cache = self.kv_cache[self.latent_row(i)]  # [1, C, r + dr]
        self._kv_write(cache[0, pos0:pos0 + T, :r], c)
        self._kv_write(cache[0, pos0:pos0 + T, r:], k_pe[:, 0])
        sel = self.select(i, h, qa, pos0, T)
        if self.absorb:
            qc = np.empty((T, H, r + dr), np.float32)  # [T, H, r + dr]: (q_lat, q_pe)
            lat = np.empty((T, r), np.float32)
            for hh in range(H):
                qc[:, hh, :r] = ly["k_absorb"][hh](np.ascontiguousarray(q3[:, hh, :dn]), lat)
            qc[:, :, r:] = q_pe
            o = np.empty((T, H, r + dr), np.float32)
            if sel is None:
                K.attention(qc, cache, cache, pos0, self.scale, o)  # one latent "KV head" for all heads
            else:
                self._attend_selected(qc, cache, pos0, sel, o)
            att = np.empty((T, H, dv), np.float32)
            vh = np.empty((T, dv), np.float32)
            for hh in range(H):
                att[:, hh] = ly["v_absorb"][hh](np.ascontiguousarray(o[:, hh, :r]), vh)
        else:
            att = self._expanded(ly, q3, q_pe, cache, pos0, T, sel)
        return ly["o_proj"](att.reshape(T, H * dv), np.empty_like(x))  # [T, D]

    def select(self, i: int, h: np.ndarray, qa: np.ndarray | None, pos0: int, T: int) -> list | None:
        """The past positions each of the T queries at pos0.. may attend: None = all (causal
        attention), or a list of T entries, each None (all causal positions) or int64 [k]
        ascending positions. Plain MLA: None; DeepSeek sparse attention (dsa.py) overrides it.
        h: the normed layer input float32 [T, D]; qa: q_a_layernorm(q_a_proj(h)) [T, qr] or None."""
        return None

    def _attend_selected(self, qc: np.ndarray, cache: np.ndarray, pos0: int, sel: list, o: np.ndarray) -> None:
        """Absorbed attention where query t sees only the cached positions ``sel[t]`` (None:
        every position <= pos0 + t). Queries with None come first (positions before the
        selection starts to matter) and run as one causal call; each other query attends the
        rows it selected, gathered in ascending order."""
        T = qc.shape[0]
        n_all = 0
        while n_all < T and sel[n_all] is None:
            n_all += 1
        if n_all:
            K.attention(qc[:n_all], cache, cache, pos0, self.scale, o[:n_all])
        for t in range(n_all, T):
            g = np.ascontiguousarray(cache[:, sel[t]])  # [1, k, r + dr]
            K.attention(qc[t:t + 1], g, g, g.shape[1] - 1, self.scale, o[t:t + 1])

    def _expanded(self, ly, q3, q_pe, cache, pos0: int, T: int, sel: list | None = None) -> np.ndarray:
        """The expanded form: per-head keys [W_uk c, k_pe] and values W_uv c for every cached
        position (float32 weights dequantized on the fly; reference only); ``sel`` as
        :meth:`select` returns it masks the positions a query did not select."""
        a = self.args
        H, dn, dr, dv, r = (a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim,
                            a.kv_lora_rank)
        n = pos0 + T
        lat = cache[0, :n] if self.kv_dtype == "f32" else cache[0, :n].view(np.float16).astype(np.float32)
        c, kpe = lat[:, :r], lat[:, r:]  # [n, r], [n, dr]
        eye_k, eye_v = np.eye(dn, dtype=np.float32), np.eye(r, dtype=np.float32)
        kc = np.empty((H, n, dn + dr), np.float32)
        vc = np.empty((H, n, dv), np.float32)
        for hh in range(H):
            wk = ly["k_absorb"][hh](eye_k, np.empty((dn, r), np.float32))  # W_uk_h [dn, r]
            wv = ly["v_absorb"][hh](eye_v, np.empty((r, dv), np.float32))  # W_uv_h^T [r, dv]
            kc[hh, :, :dn] = c @ wk.T
            kc[hh, :, dn:] = kpe
            vc[hh] = c @ wv
        q = np.concatenate([q3[:, :, :dn], q_pe], axis=2)  # [T, H, dn + dr]
        s = np.einsum("thd,hnd->thn", q, kc) * self.scale  # [T, H, n]
        mask = np.arange(n)[None, :] > (pos0 + np.arange(T))[:, None]  # [T, n] future keys
        for t, st in enumerate(sel or ()):
            if st is not None:
                mask[t] = True
                mask[t, st] = False
        s = np.where(mask[:, None, :], -np.inf, s)
        s = np.exp(s - s.max(axis=2, keepdims=True))
        s /= s.sum(axis=2, keepdims=True)
        return np.einsum("thn,hnv->thv", s, vc).astype(np.float32)
