"""LFM2-MoE (``model_type: lfm2_moe``; LiquidAI/LFM2-8B-A1B).

Follows transformers' models/lfm2_moe/modeling_lfm2_moe.py: a hybrid of short-convolution and
attention layers (``layer_types``: "conv" / "full_attention"). What differs from the shared
decoder:

- Conv layers: in_proj [3D, D] gives B, C, x; B * x runs through a depthwise causal
  convolution of ``conv_L_cache`` taps (optional bias, ``conv_bias``) along the sequence; C times
  its output through out_proj. The state a conv layer carries between calls is its last
  conv_L_cache - 1 inputs; it is held like Qwen3-Next's linear-attention state (live state and
  one prefill snapshot, engine/models/qwen3_next.py's ``rewind``), so chat prefix reuse,
  regenerate and rewind stay exact.
- Attention layers: GQA with per-head RMSNorms on q and k (``q_layernorm`` / ``k_layernorm``),
  rotate-half RoPE, ``out_proj``; KV cache for these layers only.
- The first ``num_dense_layers`` layers have a dense SwiGLU (w1 gate, w3 up, w2 down) of width
  ``intermediate_size``; the others route: sigmoid scores, the top-K of scores +
  ``expert_bias`` (``use_expert_bias``; the bias never enters a weight), weights renormalised
  with + 1e-6 (``norm_topk_prob``) and times ``routed_scaling_factor``.
- The final norm is called ``embedding_norm``; norms use ``norm_eps``.

Not the one-call decode step (K.decode_layers_t1): conv layers are not attention and the router
scores by sigmoids with a bias.

Checkpoint names: model.layers.N.operator_norm / ffn_norm; model.layers.N.conv.{in_proj,
out_proj, conv (weight [D, 1, L], bias)}; model.layers.N.self_attn.{q,k,v}_proj, out_proj,
q_layernorm, k_layernorm; model.layers.N.feed_forward.gate.weight, .expert_bias,
.experts.E.{w1,w3,w2}; dense layers model.layers.N.feed_forward.{w1,w3,w2}; model.embedding_norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..kernel_choice import K
from . import base, qwen3_next
from .base import Linear

MODEL_TYPE = "lfm2_moe"
DISPLAY_NAME = "LFM2-MoE"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """LFM2-MoE config.json (Lfm2MoeConfig names)."""

    layer_types: tuple[str, ...] = ()
    conv_L_cache: int = 3
    conv_bias: bool = False

    @property
    def full_layers(self) -> tuple[int, ...]:
        return base.layers_of_type(self.layer_types, "full_attention")

    @property
    def conv_layers(self) -> tuple[int, ...]:
        """The short-convolution layers (the layers with a recurrent state)."""
        return base.layers_of_type(self.layer_types, "conv")

    @property
    def num_kv_layers(self) -> int:
        return len(self.full_layers)

    @property
    def recurrent_state_bytes(self) -> int:
        """float32 conv states [L - 1, D] per conv layer, live and snapshot."""
        return 2 * len(self.conv_layers) * 4 * (self.conv_L_cache - 1) * self.hidden_size

    def dense_param_count(self) -> int:
        return base.tensor_params(self, dense_tensors(self))

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        cfg = dict(cfg)
        cfg.setdefault("rms_norm_eps", cfg.get("norm_eps", 1e-5))
        if cfg.get("tie_embedding") is not None:
            cfg.setdefault("tie_word_embeddings", cfg["tie_embedding"])
        cfg.setdefault("tie_word_embeddings", True)
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="moe_intermediate_size", eps_default=1e-5,
                             theta_default=1000000.0)
        L = v["num_hidden_layers"]
        types = cfg.get("layer_types")
        if not isinstance(types, list) or len(types) != L or any(t not in ("conv", "full_attention") for t in types):
            raise ConfigError(f"{path}: key 'layer_types' must list 'conv' or 'full_attention' for each of the {L} "
                              f"layers, got {types!r}")
        k = base.num(cfg, "num_dense_layers", path, 0, L, integer=True, default=2)
        if k:
            v["intermediate_size"] = base.num(cfg, "intermediate_size", path, 1, 1 << 24, integer=True,
                                              family=DISPLAY_NAME)
        bias = base.flag(cfg, "use_expert_bias", path, True)
        return cls(**v, norm_topk_prob=base.flag(cfg, "norm_topk_prob", path, True), qk_norm="head",
                   moe_layers=tuple(range(k, L)), layer_windows=(0,) * L, scoring_func="sigmoid", router_bias=bias,
                   routed_scaling_factor=base.num(cfg, "routed_scaling_factor", path, 1e-6, 1e6, integer=False,
                                                  default=1.0),
                   layer_types=tuple(types),
                   conv_L_cache=base.num(cfg, "conv_L_cache", path, 1, 64, integer=True, default=3),
                   conv_bias=base.flag(cfg, "conv_bias", path, False))


_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    D, E = args.hidden_size, args.num_experts
    moe = set(args.moe_layers)
    out: list[base.Tensor] = []
    for i in range(args.num_hidden_layers):
        hp, cp = f"model.layers.{i}.", f"layers.{i}."
        out += [base.Tensor(hp + "operator_norm.weight", cp + "input_layernorm", (D,), "keep"),
                base.Tensor(hp + "ffn_norm.weight", cp + "post_attention_layernorm", (D,), "keep")]
        if args.layer_types[i] == "conv":
            out += [base.Tensor(hp + "conv.in_proj.weight", cp + "in_proj", (3 * D, D), "quant"),
                    base.Tensor(hp + "conv.out_proj.weight", cp + "o_proj", (D, D), "quant"),
                    base.Tensor(hp + "conv.conv.weight", cp + "conv1d", (D, 1, args.conv_L_cache), "keep")]
            if args.conv_bias:
                out += [base.Tensor(hp + "conv.in_proj.bias", cp + "in_proj.bias", (3 * D,), "keep"),
                        base.Tensor(hp + "conv.out_proj.bias", cp + "o_proj.bias", (D,), "keep"),
                        base.Tensor(hp + "conv.conv.bias", cp + "conv1d_bias", (D,), "keep")]
        else:
            S = args.head_dim
            for p, o in (("q_proj", args.q_dim), ("k_proj", args.kv_dim), ("v_proj", args.kv_dim)):
                out.append(base.Tensor(f"{hp}self_attn.{p}.weight", cp + p, (o, D), "quant"))
            out += [base.Tensor(hp + "self_attn.out_proj.weight", cp + "o_proj", (D, args.q_dim), "quant"),
                    base.Tensor(hp + "self_attn.q_layernorm.weight", cp + "q_norm", (S,), "keep"),
                    base.Tensor(hp + "self_attn.k_layernorm.weight", cp + "k_norm", (S,), "keep")]
        if i in moe:
            out.append(base.Tensor(hp + "feed_forward.gate.weight", cp + "router", (E, D), "keep"))
            if args.router_bias:
                out.append(base.Tensor(hp + "feed_forward.expert_bias", cp + "router_bias", (E,), "keep"))
        else:
            out += [t._replace(hf=t.hf.replace(f".{p}.", f".{_W[p]}."))
                    for p, t in zip(base.EXPERT_PROJS,
                                    base.mlp_tensors(hp + "feed_forward.", cp + "mlp.", D, args.intermediate_size))]
    V = args.vocab_size
    lm = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    return out + [base.Tensor("model.embed_tokens.weight", "embed_tokens", (V, D), "quant"),
                  base.Tensor("model.embedding_norm.weight", "norm", (D,), "keep"),
                  base.Tensor(lm, "lm_head", (V, D), "quant")]


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.feed_forward.experts.", hf_proj=dict(_W),
                            fused_prefixes=(f"model.layers.{i}.feed_forward.experts.",))


class Model(qwen3_next.Model):
    """The LFM2-MoE forward: short-convolution and attention layers (the conv state held, rewound
    and snapshotted as Qwen3-Next's linear-attention state; its forward and rewind), then the
    dense or routed feed-forward."""

    def __init__(self, args, dense, *a, **kw):
        base.MoEModel.__init__(self, args, dense, *a, **kw)  # plain RMSNorm weights (not Qwen3-Next's w - 1)

    def attention_weights(self, dense: dict, p: str) -> dict:
        i = int(p.split(".")[1])
        if self.args.layer_types[i] == "full_attention":
            return base.MoEModel.attention_weights(self, dense, p)
        ly = {n: Linear(dense, p + n, self.dense_quant, self.gs) for n in ("in_proj", "o_proj")}
        ly["conv1d"] = np.ascontiguousarray(np.asarray(dense[p + "conv1d"], np.float32)[:, 0, :].T)  # [L, D]
        b = dense.get(p + "conv1d_bias")
        ly["conv1d_bias"] = None if b is None else np.asarray(b, np.float32)
        return ly

    def alloc_kv(self) -> None:
        """KV cache [Lf, Hkv, C, S] of the attention layers; conv state [Lc, L - 1, D] float32
        of the conv layers and its snapshot (the names Qwen3-Next's state machinery uses)."""
        a = self.args
        Lf, Lc = len(a.full_layers), len(a.conv_layers)
        Hkv, S = a.num_key_value_heads, a.head_dim
        self.kv_row = {i: r for r, i in enumerate(a.full_layers)}
        self.state_row = {i: r for r, i in enumerate(a.conv_layers)}
        dt = base.KV_DTYPES[self.kv_dtype]
        self.k_cache = np.empty((Lf, Hkv, self.C, S), dtype=dt)
        self.v_cache = np.empty((Lf, Hkv, self.C, S), dtype=dt)
        self.k_cache.fill(0)  # resident from the start, as the budget plans (see MoEModel)
        self.v_cache.fill(0)
        self.conv_state = np.zeros((Lc, a.conv_L_cache - 1, a.hidden_size), np.float32)
        self.rec_state = np.zeros((Lc, 0), np.float32)  # no recurrent matrix: the conv state is all
        self.conv_snap = np.zeros_like(self.conv_state)
        self.rec_snap = np.zeros_like(self.rec_state)
        self.state_pos, self.snap_pos = 0, -1
        self.rotary_dim = S
        self.cos, self.sin = base.rope_tables(S, a.rope_theta, self.C)
        self.scale = np.float32(S ** -0.5)

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        if i in self.kv_row:
            return self.full_attention(i, x, pos0)
        return self._stateful(i, x, pos0, self.short_conv)

    def full_attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        """GQA with per-head q/k norms before RoPE; writes KV row kv_row[i]."""
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, Hkv, S = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        h = np.empty_like(x)
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        q, k, v = ly["qkv"](h, (np.empty((T, H * S), np.float32), np.empty((T, Hkv * S), np.float32),
                                np.empty((T, Hkv * S), np.float32)))
        self.qk_norm(i, q, k)
        q3, k3 = q.reshape(T, H, S), k.reshape(T, Hkv, S)
        K.rope(q3, self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T])
        K.rope(k3, self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T])
        r = self.kv_row[i]
        self._kv_append(r, pos0, k3, v.reshape(T, Hkv, S))
        att = np.empty((T, H, S), np.float32)
        K.attention(q3, self.k_cache[r], self.v_cache[r], pos0, self.scale, att)
        return ly["o_proj"](att.reshape(T, H * S), np.empty_like(x))

    def short_conv(self, i: int, x: np.ndarray) -> np.ndarray:
        """The gated short convolution on x [T, D], continuing layer i's conv state."""
        a, ly = self.args, self.layers[i]
        T, D = x.shape
        h = np.empty_like(x)
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        bcx = ly["in_proj"](h, np.empty((T, 3 * D), np.float32))
        b, c, xx = bcx[:, :D], bcx[:, D:2 * D], bcx[:, 2 * D:]
        r = self.state_row[i]
        w = ly["conv1d"]  # [L, D]
        kc = w.shape[0] - 1
        xe = np.concatenate([self.conv_state[r], b * xx])  # [L - 1 + T, D]
        conv = xe[0:T] * w[0]
        for j in range(1, kc + 1):
            conv += xe[j:j + T] * w[j]
        if ly["conv1d_bias"] is not None:
            conv += ly["conv1d_bias"]
        if kc:
            self.conv_state[r] = xe[T:]
        return ly["o_proj"](np.ascontiguousarray(c * conv, np.float32), np.empty_like(x))

    def route(self, j: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sigmoid scores; the top-K of scores + expert_bias (larger first, lower id on ties);
        the chosen scores / (their sum + 1e-6) when norm_topk_prob, times routed_scaling_factor."""
        a = self.args
        s = (np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))).astype(np.float32)
        bias = self.layers[self.moe_layer_ids[j]]["router_bias"]
        choice = s if bias is None else s + bias[None, :]
        idx = np.argsort(-choice, axis=1, kind="stable")[:, :a.num_experts_per_tok]
        w = np.take_along_axis(s, idx, axis=1)
        if a.norm_topk_prob:
            w = w / (w.sum(axis=1, keepdims=True) + np.float32(1e-6))
        return idx.astype(np.int64), (w * np.float32(a.routed_scaling_factor)).astype(np.float32)
