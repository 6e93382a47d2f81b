"""DeepSeek-V4 (``model_type: deepseek_v4``; DeepSeek-V4-Flash, DeepSeek-V4-Pro).

Follows transformers' models/deepseek_v4/modeling_deepseek_v4.py (the eager path is the oracle
of the tests). Key as base.py, plus N = ``hc_mult`` residual streams, S = ``head_dim`` (the one
shared KV head), R = ``qk_rope_head_dim`` (the trailing rotated values of a head), m the
compression rate of a layer, W = ``sliding_window``, G = ``o_groups``, r = ``o_lora_rank``.

What differs from the shared decoder:

- Hyper-connections (mHC): the residual is N streams X [T, N, D]. Before each block (attention,
  then the MoE) a small perceptron over rms(X) gives pre [N], post [N] and comb [N, N]
  (sigmoid, 2 sigmoid, softmax then ``hc_sinkhorn_iters`` Sinkhorn steps towards a doubly
  stochastic matrix); the block reads sum_n pre_n X_n and the streams become
  X'_k = post_k out + sum_j comb_jk X_j. ``hc_head`` collapses the streams before the final norm.
- Attention: q = q_b_proj(rms_w(q_a_proj(h))), each head RMS-normed without weight; one shared
  head kv = rms_w(kv_proj(h)) is both key and value (MQA); RoPE on the trailing R values of
  each head with adjacent pairs rotated (interleaved); softmax with one learned sink logit per
  head; the output's rotated values get the inverse rotation at the query's position; a
  grouped low-rank output projection (o_a_proj: head group g [H S / G] -> r, then o_b_proj).
- Three layer kinds (``layer_types``): "sliding_attention" (the last W positions),
  "heavily_compressed_attention" (HCA: plus one compressed entry per closed window of m
  positions: softmax over the window (per value, gate + position_bias) of kv_proj rows, RMS-
  normed, rotated at the window's first position), "compressed_sparse_attention" (CSA: entries
  over 2m positions: the previous window's first half-series and this window's second; a
  Lightning Indexer (its own compressor at index_head_dim, q from q_b_proj of the q LoRA, score
  sum_h w_h relu(q_h . k)) keeps the ``index_topk`` best closed entries per query). A query at
  position p sees entry w only once its window closed: w < (p + 1) // m.
- RoPE: sliding layers theta ``rope_theta``; compressed layers and their compressors
  ``compress_rope_theta`` with YaRN when configured (attention factor 1, as transformers).
- MoE on every layer: sqrt(softplus(logits)) scores; the first layers ("hash_moe") take the
  experts of a fixed token -> experts table (``tid2eid``), the others the top-K of scores +
  ``e_score_correction_bias``; weights = chosen scores / their sum x ``routed_scaling_factor``.
  Experts and the shared expert are the clamped SwiGLU silu(min(g, L)) clip(u, -L, L)
  (``swiglu_limit``), so the family runs its own expert MLP (never the SwiGLU arena kernels).

Caches, per layer (float32, or IEEE half for kv_dtype "f16", like every KV cache): the sliding keys kv_cache
[L, C, S] (one row per position: rewind and prefix reuse stay positional); on compressed
layers the compressor's inputs per position (kv and gate rows, 2S wide on CSA, S on HCA, and
the indexer's 2 index_head_dim) and the compressed entries [C / m, S] (and the indexer's
keys), recomputed from the stored inputs when a rewind moves back into their window. Sizing
counts all of it per token (:attr:`ModelArgs.kv_values_all_layers`).

Not the one-call decode step (K.decode_layers_t1): every block is mixed through the streams.

Checkpoint names as transformers saves them (the published names, ``model.`` prefixed):
model.layers.N.{attn_norm, ffn_norm}, .hc_{attn,ffn}_{fn,base,scale}, .attn.{wq_a, q_norm, wq_b,
wkv, norm, wo_a, wo_b, attn_sink}, .attn.compressor.{wkv, wgate, ape, norm},
.attn.indexer.{wq_b, weights_proj, compressor.{wkv, wgate, ape, norm}}, .ffn.gate.{weight, bias
| tid2eid}, .ffn.experts.E.{w1,w3,w2}, .ffn.shared_experts.{w1,w3,w2}; model.embed_tokens,
model.norm, model.hc_head.{hc_fn, hc_base, hc_scale}, head.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..errors import Cancelled, ConfigError
from . import base
from .base import K, Linear, Tensor, linear_views

MODEL_TYPE = "deepseek_v4"
DISPLAY_NAME = "DeepSeek-V4"
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_TYPES = ("hash_moe", "moe")
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TYPES = {0: "sliding_attention", 4: CSA, 128: HCA}  # legacy per-layer compress_ratios


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """DeepSeek-V4 config.json (DeepseekV4Config names)."""

    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    sliding_window: int = 128
    csa_rate: int = 4
    hca_rate: int = 128
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: tuple[tuple[str, float], ...] = ()
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    swiglu_limit: float = 10.0
    n_shared_experts: int = 1

    def rate(self, i: int) -> int:
        """Compression rate m of layer i (0: sliding only)."""
        return {CSA: self.csa_rate, HCA: self.hca_rate}.get(self.layer_types[i], 0)

    def compress_width(self, i: int) -> int:
        """Values per position of layer i's compressor inputs (kv and gate rows; CSA: two series
        of S, plus the indexer's two of index_head_dim)."""
        t = self.layer_types[i]
        if t == CSA:
            return 2 * (2 * self.head_dim) + 2 * (2 * self.index_head_dim)
        return 2 * self.head_dim if t == HCA else 0

    @property
    def kv_values_per_token(self) -> int:
        """The sliding key row of one layer (S values: the one shared K = V head)."""
        return self.head_dim

    @property
    def kv_values_all_layers(self) -> int:
        """Per token over all layers: the sliding key rows, the compressor inputs kept for
        recomputation, and the compressed entries (S / m, plus index_head_dim / m on CSA)."""
        n = 0
        for i, t in enumerate(self.layer_types):
            n += self.head_dim + self.compress_width(i)
            m = self.rate(i)
            if m:
                n += -(-(self.head_dim + (self.index_head_dim if t == CSA else 0)) // m)
        return n

    def dense_param_count(self) -> int:
        return base.tensor_params(self, dense_tensors(self))

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        cfg = dict(cfg)
        cfg.setdefault("num_key_value_heads", 1)
        rp = cfg.get("rope_parameters") or {}
        main = rp.get("main") if isinstance(rp.get("main"), dict) else {}
        comp = rp.get("compress") if isinstance(rp.get("compress"), dict) else \
            {k: v for k, v in rp.items() if k not in ("main", "compress")}
        cfg.pop("rope_parameters", None)
        cfg.pop("rope_scaling", None)
        cfg["rope_theta"] = main.get("rope_theta", cfg.get("rope_theta", 10000.0))
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="moe_intermediate_size",
                             experts_keys=("n_routed_experts", "num_local_experts"))
        L, S = v["num_hidden_layers"], v["head_dim"]
        if v["num_key_value_heads"] != 1:
            raise ConfigError(f"{path}: num_key_value_heads {v['num_key_value_heads']} is not supported for "
                              f"{DISPLAY_NAME} (one shared KV head)")

        def n(key, lo, hi, default=None, integer=True):
            return base.num(cfg, key, path, lo, hi, integer=integer, family=DISPLAY_NAME, default=default)

        prf = cfg.get("partial_rotary_factor")
        rd = int(S * prf) if isinstance(prf, (int, float)) and not isinstance(prf, bool) else \
            n("qk_rope_head_dim", 2, S, default=S // 8)
        if rd < 2 or rd % 2 or rd > S:
            raise ConfigError(f"{path}: the rotated width {rd} (partial_rotary_factor x head_dim) must be even "
                              f"and at most head_dim {S}")
        rates = dict(cfg.get("compress_rates") or {})
        for key, name in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if cfg.get(key) is not None:
                rates[name] = cfg[key]
        csa = base.num(rates, CSA, path + " compress_rates", 1, 1 << 16, integer=True, default=4)
        hca = base.num(rates, HCA, path + " compress_rates", 1, 1 << 16, integer=True, default=128)
        types = cfg.get("layer_types")
        if types is None and isinstance(cfg.get("compress_ratios"), list):
            types = [_RATIO_TYPES.get(r) for r in cfg["compress_ratios"]][:L]
        if types is None:
            types = ([HCA] * min(L, 2) + [CSA if i % 2 else HCA for i in range(max(L - 2, 0))])
        types = list(types)[:L]
        if len(types) != L or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"{path}: key 'layer_types' must list one of {', '.join(LAYER_TYPES)} for each of the "
                              f"{L} layers, got {types!r}")
        mlp = cfg.get("mlp_layer_types")
        if mlp is None:
            k = n("num_hash_layers", 0, L, default=3)
            mlp = ["hash_moe"] * min(L, k) + ["moe"] * max(0, L - k)
        mlp = list(mlp)[:L]
        if len(mlp) != L or any(t not in MLP_TYPES for t in mlp):
            raise ConfigError(f"{path}: key 'mlp_layer_types' must list 'hash_moe' or 'moe' for each of the {L} "
                              f"layers, got {mlp!r}")
        scoring = cfg.get("scoring_func", "sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise ConfigError(f"{path}: scoring_func {scoring!r} is not supported for {DISPLAY_NAME} "
                              f"(expected 'sqrtsoftplus')")
        scaling = ()
        if comp.get("rope_type", "default") == "yarn":
            scaling = base.yarn_params({"rope_parameters": {**comp}, "max_position_embeddings":
                                        v["max_position_embeddings"]}, path, v["max_position_embeddings"])
            if "attention_factor" not in dict(scaling):  # transformers: 1, not YaRN's mscale
                scaling = tuple(sorted(dict(scaling, attention_factor=1.0).items()))
        ctheta = comp.get("rope_theta", cfg.get("compress_rope_theta", 160000.0))
        heads, G = v["num_attention_heads"], n("o_groups", 1, 1 << 12, default=8)
        if heads % G:
            raise ConfigError(f"{path}: num_attention_heads ({heads}) must be a multiple of o_groups ({G})")
        n_shared = n("n_shared_experts", 0, 1 << 10, default=1)
        return cls(**v, norm_topk_prob=True, moe_layers=tuple(range(L)), layer_windows=(0,) * L,
                   layer_types=tuple(types), mlp_layer_types=tuple(mlp),
                   q_lora_rank=n("q_lora_rank", 1, 1 << 20, default=1024), qk_rope_head_dim=rd,
                   hc_mult=n("hc_mult", 1, 64, default=4), hc_sinkhorn_iters=n("hc_sinkhorn_iters", 1, 1000, default=20),
                   hc_eps=n("hc_eps", 0.0, 1.0, default=1e-6, integer=False),
                   sliding_window=n("sliding_window", 1, 1 << 24, default=128), csa_rate=csa, hca_rate=hca,
                   compress_rope_theta=float(ctheta), compress_rope_scaling=scaling, o_groups=G,
                   o_lora_rank=n("o_lora_rank", 1, 1 << 20, default=1024),
                   index_n_heads=n("index_n_heads", 1, 1 << 12, default=64),
                   index_head_dim=n("index_head_dim", 2, 1 << 16, default=128),
                   index_topk=n("index_topk", 1, 1 << 24, default=512),
                   swiglu_limit=n("swiglu_limit", 1e-6, 1e12, default=10.0, integer=False),
                   n_shared_experts=n_shared,
                   # transformers builds the one shared expert whatever n_shared_experts says
                   shared_expert_intermediate_size=v["moe_intermediate_size"],
                   shared_expert_gated=False, scoring_func="sqrtsoftplus", router_bias=True,
                   routed_scaling_factor=n("routed_scaling_factor", 1e-6, 1e6, default=1.5, integer=False))


# --- checkpoint names -------------------------------------------------------------------------

def _layer_tensors(args: ModelArgs, i: int) -> list[Tensor]:
    D, S, H, N = args.hidden_size, args.head_dim, args.num_attention_heads, args.hc_mult
    qr, G, r, E = args.q_lora_rank, args.o_groups, args.o_lora_rank, args.num_experts
    hp, cp = f"model.layers.{i}.", f"layers.{i}."
    a = hp + "attn."
    hc = (2 + N) * N
    out = [Tensor(hp + "attn_norm.weight", cp + "input_layernorm", (D,), "keep"),
           Tensor(hp + "ffn_norm.weight", cp + "post_attention_layernorm", (D,), "keep")]
    for blk in ("attn", "ffn"):
        out += [Tensor(f"{hp}hc_{blk}_fn", f"{cp}hc_{blk}_fn", (hc, N * D), "keep"),
                Tensor(f"{hp}hc_{blk}_base", f"{cp}hc_{blk}_base", (hc,), "keep"),
                Tensor(f"{hp}hc_{blk}_scale", f"{cp}hc_{blk}_scale", (3,), "keep")]
    out += [Tensor(a + "wq_a.weight", cp + "q_a_proj", (qr, D), "quant"),
            Tensor(a + "q_norm.weight", cp + "q_a_norm", (qr,), "keep"),
            Tensor(a + "wq_b.weight", cp + "q_b_proj", (H * S, qr), "quant"),
            Tensor(a + "wkv.weight", cp + "kv_proj", (S, D), "quant"),
            Tensor(a + "norm.weight", cp + "kv_norm", (S,), "keep"),
            Tensor(a + "wo_a.weight", cp + "o_a_proj", (G * r, H * S // G), "quant"),
            Tensor(a + "wo_b.weight", cp + "o_b_proj", (D, G * r), "quant"),
            Tensor(a + "attn_sink", cp + "sinks", (H,), "keep")]
    t, m = args.layer_types[i], args.rate(i)
    if t != "sliding_attention":
        cw = 2 * S if t == CSA else S
        c = a + "compressor."
        out += [Tensor(c + "wkv.weight", cp + "comp_kv", (cw, D), "quant"),
                Tensor(c + "wgate.weight", cp + "comp_gate", (cw, D), "quant"),
                Tensor(c + "ape", cp + "comp_bias", (m, cw), "keep"),
                Tensor(c + "norm.weight", cp + "comp_norm", (S,), "keep")]
    if t == CSA:
        Ih, Id = args.index_n_heads, args.index_head_dim
        x = a + "indexer."
        out += [Tensor(x + "compressor.wkv.weight", cp + "idx_kv", (2 * Id, D), "quant"),
                Tensor(x + "compressor.wgate.weight", cp + "idx_gate", (2 * Id, D), "quant"),
                Tensor(x + "compressor.ape", cp + "idx_bias", (m, 2 * Id), "keep"),
                Tensor(x + "compressor.norm.weight", cp + "idx_norm", (Id,), "keep"),
                Tensor(x + "wq_b.weight", cp + "idx_q_b_proj", (Ih * Id, qr), "quant"),
                Tensor(x + "weights_proj.weight", cp + "idx_weights", (Ih, D), "keep")]
    f = hp + "ffn."
    out.append(Tensor(f + "gate.weight", cp + "router", (E, D), "keep"))
    if args.mlp_layer_types[i] == "hash_moe":
        out.append(Tensor(f + "gate.tid2eid", cp + "tid2eid", (args.vocab_size, args.num_experts_per_tok), "keep"))
    else:
        out.append(Tensor(f + "gate.bias", cp + "router_bias", (E,), "keep"))
    if args.shared_expert_intermediate_size:
        for p, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            I = args.shared_expert_intermediate_size
            out.append(Tensor(f"{f}shared_experts.{w}.weight", f"{cp}shared_expert.{p}",
                              (D, I) if p == "down_proj" else (I, D), "quant"))
    return out


def dense_tensors(args: ModelArgs) -> list[Tensor]:
    D, V, N = args.hidden_size, args.vocab_size, args.hc_mult
    out = []
    for i in range(args.num_hidden_layers):
        out += _layer_tensors(args, i)
    lm = "model.embed_tokens.weight" if args.tie_word_embeddings else "head.weight"
    return out + [Tensor("model.embed_tokens.weight", "embed_tokens", (V, D), "quant"),
                  Tensor("model.norm.weight", "norm", (D,), "keep"),
                  Tensor("model.hc_head.hc_fn", "hc_head_fn", (N, N * D), "keep"),
                  Tensor("model.hc_head.hc_base", "hc_head_base", (N,), "keep"),
                  Tensor("model.hc_head.hc_scale", "hc_head_scale", (1,), "keep"),
                  Tensor(lm, "lm_head", (V, D), "quant")]


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.ffn.experts.",
                            hf_proj={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                            fused_prefixes=(f"model.layers.{i}.mlp.experts.",))


# --- arithmetic -------------------------------------------------------------------------------

def _rms(x: np.ndarray, eps: float, w: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm over the last axis (float32), times ``w`` when given."""
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps))
    return (y if w is None else y * w).astype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, np.float32(20.0))))).astype(np.float32)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved RoPE on the trailing 2 cos.shape[-1] values of x [T, ..., S]; cos / sin
    [T, R/2] broadcast over the middle axes. Returns a new array."""
    R = 2 * cos.shape[-1]
    out = x.copy()
    ev, od = x[..., -R::2], x[..., -R + 1::2]
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    out[..., -R::2] = ev * c - od * s
    out[..., -R + 1::2] = od * c + ev * s
    return out


class Model(base.MoEModel):
    """The DeepSeek-V4 forward: N residual streams mixed around every block, shared-KV
    attention with sinks over a sliding window plus compressed entries, sqrt-softplus (or
    hashed) routing to clamped-SwiGLU experts.

    Attributes (beyond MoEModel's): kv_cache [L, C, S] sliding keys; comp_in [L] per-position
    compressor inputs (CSA / HCA layers, float32 [C, width]); comp [L] compressed entries
    [C // m, S] and idx_keys [L] the indexer's [C // m, index_head_dim]; n_comp [L] entries
    computed (valid) so far."""

    def attention_weights(self, dense: dict, p: str) -> dict:
        dq, gs = self.dense_quant, self.gs
        i = int(p.split(".")[1])
        ly = {}
        for n in ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "comp_kv", "comp_gate", "idx_kv",
                  "idx_gate", "idx_q_b_proj"):
            if p + n + ".w" in dense:
                ly[n] = Linear(dense, p + n, dq, gs)
        for n in ("q_a_norm", "kv_norm", "sinks", "comp_bias", "comp_norm", "idx_bias", "idx_norm", "idx_weights",
                  "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"):
            if p + n in dense:
                ly[n] = np.asarray(dense[p + n], np.float32)
        t = dense.get(p + "tid2eid")
        ly["tid2eid"] = None if t is None else np.asarray(t).astype(np.int64)
        ly["kind"] = self.args.layer_types[i]
        return ly

    def __init__(self, args, dense, *a, **kw):
        super().__init__(args, dense, *a, **kw)
        self.hc_head = (np.asarray(dense["hc_head_fn"], np.float32), np.asarray(dense["hc_head_base"], np.float32),
                        np.asarray(dense["hc_head_scale"], np.float32))
        self._ids = None  # the token ids of the forward running (hash routing)

    def alloc_kv(self) -> None:
        a = self.args
        S, C = a.head_dim, self.C
        dt = base.KV_DTYPES[self.kv_dtype]
        self.kv_cache = base.kv_zeros((a.num_hidden_layers, C, S), dt)  # [L, C, S]
        self.comp_in, self.comp, self.idx_keys = {}, {}, {}
        for i in range(a.num_hidden_layers):
            m = a.rate(i)
            if m:
                self.comp_in[i] = base.kv_zeros((C, a.compress_width(i)), dt)
                self.comp[i] = base.kv_zeros((-(-C // m), S), dt)
                if a.layer_types[i] == CSA:
                    self.idx_keys[i] = base.kv_zeros((-(-C // m), a.index_head_dim), dt)
        self.n_comp = np.zeros(a.num_hidden_layers, np.int64)
        R = a.qk_rope_head_dim
        self.cos, self.sin = base.rope_tables(R, a.rope_theta, C)
        self.ccos, self.csin = base.rope_tables(R, a.compress_rope_theta, C, a.compress_rope_scaling)
        self.scale = np.float32(S ** -0.5)

    @property
    def kv_bytes(self) -> int:
        return self.kv_cache.nbytes + sum(x.nbytes for d in (self.comp_in, self.comp, self.idx_keys)
                                          for x in d.values())

    # --- the forward ---------------------------------------------------------------------------

    def forward(self, ids: np.ndarray, pos0: int, all_logits: bool = False,
                cancel: threading.Event | None = None) -> np.ndarray:
        """As MoEModel.forward (the residual as N streams; compressed entries past pos0 are
        recomputed from their stored inputs)."""
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        if T == 0:
            raise ValueError("forward needs at least one token")
        if pos0 < 0:
            raise ValueError(f"position {pos0} is negative: positions start at 0")
        if pos0 + T > self.C:
            raise ValueError(f"positions {pos0}..{pos0 + T - 1} exceed the context of {self.C} tokens")
        for i in self.comp:  # entries whose window reaches past pos0 are rewritten
            self.n_comp[i] = min(self.n_comp[i], pos0 // self.args.rate(i))
        self.observers.publish("on_forward_start", pos0, T)
        outs = []
        for c0 in range(0, T, base.PREFILL_CHUNK):
            chunk = ids[c0:c0 + base.PREFILL_CHUNK]
            x = self._layers(chunk, pos0 + c0, cancel)
            if all_logits:
                outs.append(self.logits(x))
            elif c0 + base.PREFILL_CHUNK >= T:
                outs.append(self.logits(x[-1:]))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _layers(self, ids: np.ndarray, pos0: int, cancel) -> np.ndarray:
        """Every layer over ``ids`` at pos0..: the collapsed final residual [t, D]."""
        a = self.args
        e = self.embed(ids)  # [t, D]
        X = np.repeat(e[:, None, :], a.hc_mult, axis=1)  # [t, N, D]
        self._ids = ids
        obs = self.observers
        for i in range(a.num_hidden_layers):
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            ly = self.layers[i]
            j = self.moe_index[i]
            obs.publish("on_layer_start", j)
            post, comb, h = self._hc(ly, "attn", X)
            X = self._mix(post, comb, X, self.attention(i, h, pos0))
            obs.publish("on_after_attention", j, self._collapse_mean(X))
            post, comb, h = self._hc(ly, "ffn", X)
            X = self._mix(post, comb, X, self.moe(j, h))
            obs.publish("on_after_moe", j, self._collapse_mean(X))
        fn, b, s = self.hc_head
        flat = _rms(X.reshape(len(X), -1), a.rms_norm_eps)
        pre = _sigmoid(flat @ fn.T * s[0] + b) + np.float32(a.hc_eps)  # [t, N]
        return np.ascontiguousarray((pre[:, :, None] * X).sum(1), np.float32)

    @staticmethod
    def _collapse_mean(X: np.ndarray) -> np.ndarray:
        """The streams' mean [t, D]: what observers of the residual (PILOT) read."""
        return np.ascontiguousarray(X.mean(1), np.float32)

    def _hc(self, ly: dict, blk: str, X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(post [t, N], comb [t, N, N], the block input [t, D]) of one hyper-connection."""
        a = self.args
        N, eps = a.hc_mult, np.float32(a.hc_eps)
        fn, b, s = ly[f"hc_{blk}_fn"], ly[f"hc_{blk}_base"], ly[f"hc_{blk}_scale"]
        mix = _rms(X.reshape(len(X), -1), a.rms_norm_eps) @ fn.T  # [t, (2 + N) N]
        pre = _sigmoid(mix[:, :N] * s[0] + b[:N]) + eps
        post = np.float32(2.0) * _sigmoid(mix[:, N:2 * N] * s[1] + b[N:2 * N])
        z = mix[:, 2 * N:].reshape(-1, N, N) * s[2] + b[2 * N:].reshape(N, N)
        z = np.exp(z - z.max(-1, keepdims=True))
        comb = z / z.sum(-1, keepdims=True) + eps
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
        for _ in range(a.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdims=True) + eps)
            comb = comb / (comb.sum(-2, keepdims=True) + eps)
        h = np.ascontiguousarray((pre[:, :, None] * X).sum(1), np.float32)
        return post.astype(np.float32), comb.astype(np.float32), h

    @staticmethod
    def _mix(post: np.ndarray, comb: np.ndarray, X: np.ndarray, out: np.ndarray) -> np.ndarray:
        """X'_k = post_k out + sum_j comb_jk X_j."""
        return (post[:, :, None] * out[:, None, :] + np.einsum("tjk,tjd->tkd", comb, X)).astype(np.float32)

    # --- attention -----------------------------------------------------------------------------

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        """Layer i's attention on the collapsed block input x [T, D] (normed here)."""
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, S, eps = a.num_attention_heads, a.head_dim, a.rms_norm_eps
        h = np.empty_like(x)
        K.rmsnorm(x, ly["input_layernorm"], eps, h)
        comp = ly["kind"] != "sliding_attention"
        cos, sin = (self.ccos, self.csin) if comp else (self.cos, self.sin)
        cos, sin = cos[pos0:pos0 + T], sin[pos0:pos0 + T]
        qa = _rms(ly["q_a_proj"](h, np.empty((T, a.q_lora_rank), np.float32)), eps, ly["q_a_norm"])
        q = ly["q_b_proj"](qa, np.empty((T, H * S), np.float32)).reshape(T, H, S)
        q = _rope(_rms(q, eps), cos, sin)  # [T, H, S]
        kv = _rms(ly["kv_proj"](h, np.empty((T, S), np.float32)), eps, ly["kv_norm"])
        kv = _rope(kv[:, None, :], cos, sin)[:, 0]  # [T, S]
        self._kv_write(self.kv_cache[i, pos0:pos0 + T], kv)
        sel = None
        if comp:
            self._compress(i, h, pos0, T)
            if ly["kind"] == CSA:
                sel = self._index(i, h, qa, pos0, T)
        o = np.empty((T, H, S), np.float32)
        W, m = a.sliding_window, a.rate(i)
        sinks = ly["sinks"]
        for t in range(T):
            p = pos0 + t
            lo = max(0, p - W + 1)
            keys = self._rows(self.kv_cache[i, lo:p + 1])  # [n, S]
            if m:
                ready = (p + 1) // m
                ks = self.comp[i][:ready] if sel is None else self.comp[i][sel[t]]
                keys = np.concatenate([keys, self._rows(ks)])
            s = (q[t] @ keys.T) * self.scale  # [H, n]
            mx = np.maximum(s.max(-1), sinks)
            e = np.exp(s - mx[:, None])
            den = e.sum(-1) + np.exp(sinks - mx)
            o[t] = (e / den[:, None]) @ keys
        o = _rope(o, cos, -sin)  # undo the values' rotation at the query position
        G, r = a.o_groups, a.o_lora_rank
        og = o.reshape(T, G, H * S // G)
        w = ly["o_a_proj"]
        ya = np.empty((T, G * r), np.float32)
        # o_a_proj is block diagonal: group g's rows g r..(g+1) r read only group g's inputs
        for g in range(G):
            part = object.__new__(Linear)
            part.w = w.w[g * r:(g + 1) * r]
            part.s = None if w.s is None else w.s[g * r:(g + 1) * r]
            part.kind, part.bias, part.gs, part.out_features, part.il = w.kind, None, w.gs, r, False
            ya[:, g * r:(g + 1) * r] = part(np.ascontiguousarray(og[:, g]), np.empty((T, r), np.float32))
        return ly["o_b_proj"](ya, np.empty_like(x))

    def _rows(self, rows: np.ndarray) -> np.ndarray:
        return rows if self.kv_dtype == "f32" else rows.view(np.float16).astype(np.float32)

    def _compress(self, i: int, h: np.ndarray, pos0: int, T: int) -> None:
        """Store layer i's compressor inputs of positions pos0.. and compute the entries of the
        windows that closed (from the first not yet computed)."""
        a, ly = self.args, self.layers[i]
        S, m, csa = a.head_dim, a.rate(i), ly["kind"] == CSA
        cw = 2 * S if csa else S
        parts = [ly["comp_kv"](h, np.empty((T, cw), np.float32)), ly["comp_gate"](h, np.empty((T, cw), np.float32))]
        if csa:
            Id = a.index_head_dim
            parts += [ly["idx_kv"](h, np.empty((T, 2 * Id), np.float32)),
                      ly["idx_gate"](h, np.empty((T, 2 * Id), np.float32))]
        self._kv_write(self.comp_in[i][pos0:pos0 + T], np.concatenate(parts, axis=1))
        done = (pos0 + T) // m
        first = int(self.n_comp[i])
        if done <= first:
            return
        lo = max(0, (first - 1) * m)  # the inputs the new entries read (the previous window's too)
        rows = np.zeros((done * m, self.comp_in[i].shape[1]), np.float32)
        rows[lo:] = self._rows(self.comp_in[i][lo:done * m])
        for w in range(first, done):
            self._kv_write(self.comp[i][w:w + 1],
                           self._entry(rows[:, :2 * cw], w, m, S, ly["comp_bias"], ly["comp_norm"], csa)[None])
            if csa:
                self._kv_write(self.idx_keys[i][w:w + 1],
                               self._entry(rows[:, 2 * cw:], w, m, a.index_head_dim, ly["idx_bias"],
                                           ly["idx_norm"], True)[None])
        self.n_comp[i] = done

    def _entry(self, rows: np.ndarray, w: int, m: int, d: int, bias: np.ndarray, norm: np.ndarray,
               overlap: bool) -> np.ndarray:
        """Compressed entry w [d] from the per-position [kv | gate] rows: overlap (CSA): the
        previous window's first series and this window's second, 2m slots; else this window's
        m rows. Softmax over the slots per value, RMS-normed, rotated at position w m."""
        a = self.args
        cw = rows.shape[1] // 2
        kv, gate = rows[w * m:(w + 1) * m, :cw], rows[w * m:(w + 1) * m, cw:] + bias  # [m, cw]
        if overlap:
            ks, gs_ = [kv[:, d:]], [gate[:, d:]]
            if w > 0:
                pkv = rows[(w - 1) * m:w * m, :cw]
                pg = rows[(w - 1) * m:w * m, cw:] + bias
                ks.insert(0, pkv[:, :d])
                gs_.insert(0, pg[:, :d])
            kv, gate = np.concatenate(ks), np.concatenate(gs_)
        g = np.exp(gate - gate.max(0, keepdims=True))
        c = (kv * (g / g.sum(0, keepdims=True))).sum(0)
        c = _rms(c[None, :], a.rms_norm_eps, norm)
        p = w * m
        return _rope(c[:, None, :], self.ccos[p:p + 1], self.csin[p:p + 1])[0, 0]

    def _index(self, i: int, h: np.ndarray, qa: np.ndarray, pos0: int, T: int) -> list:
        """Per query: the indexer's chosen entries (ascending int64), the index_topk best-scored
        closed ones (all closed ones when fewer)."""
        a, ly = self.args, self.layers[i]
        Ih, Id, m = a.index_n_heads, a.index_head_dim, a.rate(i)
        q = ly["idx_q_b_proj"](qa, np.empty((T, Ih * Id), np.float32)).reshape(T, Ih, Id)
        q = _rope(q, self.ccos[pos0:pos0 + T], self.csin[pos0:pos0 + T])
        wts = (h @ ly["idx_weights"].T) * np.float32(Ih ** -0.5)  # [T, Ih]
        out = []
        for t in range(T):
            ready = (pos0 + t + 1) // m
            if ready == 0:
                out.append(np.zeros(0, np.int64))
                continue
            keys = self._rows(self.idx_keys[i][:ready])  # [n, Id]
            sc = (np.maximum(q[t] @ keys.T, 0) * np.float32(Id ** -0.5) * wts[t][:, None]).sum(0)  # [n]
            k = min(a.index_topk, ready)
            top = np.argsort(-sc, kind="stable")[:k]
            out.append(np.sort(top).astype(np.int64))
        return out

    # --- the MoE -------------------------------------------------------------------------------

    def moe(self, j: int, x: np.ndarray) -> np.ndarray:
        """Routed experts (hashed or by sqrt-softplus scores) plus the shared expert on the
        collapsed block input x [T, D] (normed here)."""
        a = self.args
        i = self.moe_layer_ids[j]
        ly = self.layers[i]
        h = np.empty_like(x)
        K.rmsnorm(x, ly["post_attention_layernorm"], a.rms_norm_eps, h)
        logits = self.router_logits(j, h)
        scores = np.sqrt(_softplus(logits))
        if ly["tid2eid"] is not None:
            idx = ly["tid2eid"][self._ids]
        else:
            idx = np.argsort(-(scores + ly["router_bias"]), axis=1, kind="stable")[:, :a.num_experts_per_tok]
        w = np.take_along_axis(scores, idx, axis=1)
        w = (w / (w.sum(1, keepdims=True) + np.float32(1e-20)) * np.float32(a.routed_scaling_factor))
        self.observers.publish("on_route", j, idx.astype(np.int64), logits)
        out = self._moe_grouped(j, h, idx.astype(np.int64), w.astype(np.float32))
        if "shared_expert" in ly:
            out += self._clamped(self.dense_quant, ly["shared_expert"], h, a.shared_expert_intermediate_size)
        return out

    def route(self, j: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The learned router's choice (PILOT's prediction; a hashed layer's real choice
        depends on the token ids, which :meth:`moe` reads)."""
        a = self.args
        ly = self.layers[self.moe_layer_ids[j]]
        scores = np.sqrt(_softplus(logits))
        bias = ly["router_bias"] if ly["router_bias"] is not None else 0
        idx = np.argsort(-(scores + bias), axis=1, kind="stable")[:, :a.num_experts_per_tok]
        w = np.take_along_axis(scores, idx, axis=1)
        return idx.astype(np.int64), (w / (w.sum(1, keepdims=True) + np.float32(1e-20))).astype(np.float32)

    def _clamped(self, kind: str, views: dict, x: np.ndarray, width: int) -> np.ndarray:
        """down(silu(min(gate x, L)) clip(up x, -L, L)) on x [T, D]."""
        L = np.float32(self.args.swiglu_limit)
        T = x.shape[0]
        g = np.minimum(linear_views(kind, views, "gate_proj", x, np.empty((T, width), np.float32), self.gs), L)
        u = np.clip(linear_views(kind, views, "up_proj", x, np.empty((T, width), np.float32), self.gs), -L, L)
        hh = np.ascontiguousarray(g / (np.float32(1.0) + np.exp(-g)) * u, np.float32)
        return linear_views(kind, views, "down_proj", hh, np.empty_like(x), self.gs)

    def expert_forward(self, views: dict, x: np.ndarray, h: np.ndarray, out: np.ndarray) -> None:
        """One clamped-SwiGLU expert on rows x [T, D] into out [T, D] (h unused scratch)."""
        out[:] = self._clamped(self.expert_quant, views, x, self.args.moe_intermediate_size)
