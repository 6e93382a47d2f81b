"""Gemma 4's MoE language model (``model_type: gemma4_text``; the text tower of
google/gemma-4-26B-A4B, engine/models/gemma4.py for the multimodal checkpoint).

Follows transformers' models/gemma4/modeling_gemma4.py (Gemma4TextModel with
``enable_moe_block``). What differs from the shared decoder:

- Two attention kinds per ``layer_types``: sliding layers (window ``sliding_window``, head_dim,
  num_key_value_heads, plain RoPE of their own theta) and full layers with their own head size
  and KV heads (``per_layer_config``, or ``global_head_dim`` / ``num_global_key_value_heads``),
  "proportional" RoPE (only the first partial_rotary_factor x head_dim / 2 frequencies turn;
  the rest have frequency 0) and, with ``attention_k_eq_v``, no v_proj: V is the raw K
  projection. q and k get a weighted per-head RMSNorm, v a weightless one; scores are not
  divided by sqrt(head_dim) (scale 1). So the KV cache is one array per layer, of its shape.
- Norms around each block (post-attention, pre- / post-feed-forward) and, in every layer, a
  dense GeGLU MLP (tanh-approximated GELU) beside the routed experts: the router reads the
  residual (weightless RMSNorm x ``router.scale`` x hidden^-1/2), softmax top-K renormalised and
  times ``per_expert_scale``; the experts (GeGLU, fused gate_up_proj / down_proj) read the
  residual through ``pre_feedforward_layernorm_2``; the two branches are normed
  (``post_feedforward_layernorm_1`` / ``_2``) and summed, normed again and added; then the
  whole hidden state is multiplied by the layer's ``layer_scalar``.
- Embeddings times sqrt(hidden); logits soft-capped: cap x tanh(logits / cap)
  (``final_logit_softcapping``).

Refused with a clear error: the per-layer input embeddings (``hidden_size_per_layer_input``,
the small dense Gemma 4 models), KV sharing across layers (``num_kv_shared_layers``),
bidirectional attention and a config without the MoE block.

Not the one-call decode step (K.decode_layers_t1) nor the arena kernels of SwiGLU experts: the
experts are GeGLU, and the layer (two MLP branches, norms, scalar) is not the kernel's.

Checkpoint names: model.layers.N.self_attn.{q,k,v,o}_proj, q_norm, k_norm;
model.layers.N.{input,post_attention,pre_feedforward,post_feedforward}_layernorm,
post_feedforward_layernorm_1 / _2, pre_feedforward_layernorm_2, layer_scalar [1];
model.layers.N.mlp.{gate,up,down}_proj; model.layers.N.router.{proj.weight, scale,
per_expert_scale}; model.layers.N.experts.{gate_up_proj [E, 2I, D], down_proj [E, D, I]}.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..errors import Cancelled, ConfigError
from ..kernel_choice import K
from . import base

MODEL_TYPE = "gemma4_text"
DISPLAY_NAME = "Gemma 4"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """Gemma 4 text config.json (Gemma4TextConfig names). head_dim / num_key_value_heads /
    rope_theta are the sliding layers'; ``full_head_dim`` / ``full_kv_heads`` / ``full_rope_theta``
    / ``full_rotary_angles`` the full layers' (``layer_windows``[i] == 0)."""

    full_head_dim: int = 0
    full_kv_heads: int = 0
    full_rope_theta: float = 1e6
    full_rotary_angles: int = 0
    full_rope_factor: float = 1.0
    attention_k_eq_v: bool = False
    final_logit_softcapping: float = 0.0

    def layer_shape(self, i: int) -> tuple[int, int]:
        """(KV heads, head size) of layer i."""
        return (self.full_kv_heads, self.full_head_dim) if not self.layer_windows[i] else \
            (self.num_key_value_heads, self.head_dim)

    @property
    def kv_values_all_layers(self) -> int:
        return sum(2 * h * s for h, s in map(self.layer_shape, range(self.num_hidden_layers)))

    def dense_param_count(self) -> int:
        """Parameters that stay resident: every dense tensor (a tied lm_head counted once)."""
        return base.tensor_params(self, dense_tensors(self))

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        return cls(**text_fields(cfg, path, DISPLAY_NAME))


def text_fields(cfg: dict, path: str, family: str) -> dict:
    """ModelArgs fields of a Gemma 4 text config, validated (ConfigError naming ``path`` and the key)."""
    cfg = dict(cfg)
    for key, why in (("hidden_size_per_layer_input", "per-layer input embeddings (the small dense Gemma 4)"),
                     ("num_kv_shared_layers", "KV sharing across layers")):
        if cfg.get(key):
            raise ConfigError(f"{path}: {key}={cfg[key]!r} ({why}) is not supported; colibri runs the Gemma 4 "
                              f"mixture-of-experts models (e.g. gemma-4-26B-A4B)")
    if not base.flag(cfg, "enable_moe_block", path, False):
        raise ConfigError(f"{path}: enable_moe_block is not true: this Gemma 4 is a dense model, not a "
                          f"mixture of experts; colibri runs the MoE ones (e.g. gemma-4-26B-A4B)")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{path}: use_bidirectional_attention is not supported for {family}")
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"{path}: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    cfg["hidden_act"] = "silu"  # the shared validator's key; the activation is checked above
    cfg["num_experts_per_tok"] = cfg.get("top_k_experts")
    rope = cfg.get("rope_parameters")
    if rope is None:
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0}}
    if not isinstance(rope, dict) or not all(isinstance(rope.get(k), dict)
                                             for k in ("sliding_attention", "full_attention")):
        raise ConfigError(f"{path}: key 'rope_parameters' must hold 'sliding_attention' and 'full_attention' "
                          f"objects")
    sl, fu = rope["sliding_attention"], rope["full_attention"]
    if (sl.get("rope_type") or "default") != "default" or (fu.get("rope_type") or "default") not in (
            "default", "proportional"):
        raise ConfigError(f"{path}: rope_parameters: only 'default' sliding and 'default' / 'proportional' full "
                          f"RoPE are supported, got {sl.get('rope_type')!r} / {fu.get('rope_type')!r}")
    c = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
    c["rope_theta"] = base.num(sl, "rope_theta", path + " rope_parameters.sliding_attention", 1.0, 1e12,
                               integer=False, default=10000.0)
    v = base.common_args(c, path, family, expert_width_key="moe_intermediate_size", eps_default=1e-6)
    L, S = v["num_hidden_layers"], v["head_dim"]
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(L)]
    if not isinstance(types, list) or len(types) != L or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConfigError(f"{path}: key 'layer_types' must list 'sliding_attention' or 'full_attention' for each "
                          f"of the {L} layers")
    types = types[:-1] + ["full_attention"]  # transformers forces the last layer to full attention
    w = base.num(cfg, "sliding_window", path, 1, 1 << 24, integer=True, default=512)
    k_eq_v = base.flag(cfg, "attention_k_eq_v", path, False)
    full_s = base.num(cfg, "global_head_dim", path, 2, 1 << 16, integer=True, default=512)
    full_kv = v["num_key_value_heads"]
    if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
        full_kv = base.num(cfg, "num_global_key_value_heads", path, 1, v["num_attention_heads"], integer=True)
    plc = cfg.get("per_layer_config")
    if plc is not None:  # as transformers saves it: {"layer index": {"head_dim": .., "num_key_value_heads": ..}}
        if not isinstance(plc, dict):
            raise ConfigError(f"{path}: key 'per_layer_config' must be an object")
        over = [o for i, o in plc.items() if str(i).isdigit() and int(i) < L and types[int(i)] == "full_attention"]
        if any(not isinstance(o, dict) for o in over) or len({repr(sorted(o.items())) for o in over}) > 1:
            raise ConfigError(f"{path}: per_layer_config must give every full-attention layer the same head_dim "
                              f"and num_key_value_heads")
        if over:
            full_s = base.num(over[0], "head_dim", path + " per_layer_config", 2, 1 << 16, integer=True,
                              default=S)
            full_kv = base.num(over[0], "num_key_value_heads", path + " per_layer_config", 1,
                               v["num_attention_heads"], integer=True, default=v["num_key_value_heads"])
        else:
            full_s = S
    if v["num_attention_heads"] % full_kv or full_s % 2:
        raise ConfigError(f"{path}: full-attention layers need an even head_dim and KV heads dividing the "
                          f"{v['num_attention_heads']} heads (got {full_s}, {full_kv})")
    where = path + " rope_parameters.full_attention"
    prf = fu.get("partial_rotary_factor", 1.0) if (fu.get("rope_type") or "default") == "proportional" else 1.0
    if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 <= prf <= 1:
        raise ConfigError(f"{where}: partial_rotary_factor {prf!r} must be a number in [0, 1]")
    cap = cfg.get("final_logit_softcapping")
    return dict(**v, norm_topk_prob=True, moe_layers=tuple(range(L)),
                layer_windows=tuple(w if t == "sliding_attention" else 0 for t in types), qk_norm="head",
                full_head_dim=full_s, full_kv_heads=full_kv,
                full_rope_theta=base.num(fu, "rope_theta", where, 1.0, 1e12, integer=False, default=1000000.0),
                full_rotary_angles=int(prf * full_s // 2),
                full_rope_factor=base.num(fu, "factor", where, 1e-6, 1e6, integer=False, default=1.0),
                attention_k_eq_v=k_eq_v,
                final_logit_softcapping=0.0 if cap is None else base.num(cfg, "final_logit_softcapping", path,
                                                                         1e-6, 1e6, integer=False))


def layer_tensors(args: ModelArgs, i: int, prefix: str = "model.") -> list[base.Tensor]:
    """Layer i's resident tensors: norms, attention of the layer's kind, the dense MLP, the router."""
    D, E, H, I = args.hidden_size, args.num_experts, args.num_attention_heads, args.intermediate_size
    Hkv, S = args.layer_shape(i)
    hp, cp = f"{prefix}layers.{i}.", f"layers.{i}."
    out = [base.Tensor(f"{hp}{n}.weight", cp + n, (D,), "keep")
           for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2")]
    out.append(base.Tensor(hp + "layer_scalar", cp + "layer_scalar", (1,), "keep"))
    projs = [("q_proj", H * S), ("k_proj", Hkv * S)]
    if not (args.attention_k_eq_v and not args.layer_windows[i]):
        projs.append(("v_proj", Hkv * S))
    out += [base.Tensor(f"{hp}self_attn.{p}.weight", cp + p, (o, D), "quant") for p, o in projs]
    out.append(base.Tensor(hp + "self_attn.o_proj.weight", cp + "o_proj", (D, H * S), "quant"))
    out += [base.Tensor(hp + "self_attn.q_norm.weight", cp + "q_norm", (S,), "keep"),
            base.Tensor(hp + "self_attn.k_norm.weight", cp + "k_norm", (S,), "keep")]
    out += base.mlp_tensors(hp + "mlp.", cp + "mlp.", D, I)
    out += [base.Tensor(hp + "router.proj.weight", cp + "router", (E, D), "keep"),
            base.Tensor(hp + "router.scale", cp + "router_scale", (D,), "keep"),
            base.Tensor(hp + "router.per_expert_scale", cp + "per_expert_scale", (E,), "keep")]
    return out


def dense_tensors(args: ModelArgs, prefix: str = "model.") -> list[base.Tensor]:
    """Every resident tensor under ``prefix`` ("model." here; "model.language_model." in the
    multimodal checkpoint, whose tied lm_head is the embedding)."""
    out = []
    for i in range(args.num_hidden_layers):
        out += layer_tensors(args, i, prefix)
    D, V = args.hidden_size, args.vocab_size
    emb = f"{prefix}embed_tokens.weight"
    return out + [base.Tensor(emb, "embed_tokens", (V, D), "quant"),
                  base.Tensor(f"{prefix}norm.weight", "norm", (D,), "keep"),
                  base.Tensor(emb if args.tie_word_embeddings else "lm_head.weight", "lm_head", (V, D), "quant")]


def expert_names(args: ModelArgs, i: int, prefix: str = "model.") -> base.ExpertNames:
    p = f"{prefix}layers.{i}.experts."
    return base.ExpertNames(i, p, fused_prefixes=(p,))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """transformers' gelu_pytorch_tanh in float32: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    c = np.float32(0.7978845608028654)
    return (np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))).astype(
        np.float32)


def geglu(kind: str, views: dict, x: np.ndarray, width: int, gs: int, out: np.ndarray) -> np.ndarray:
    """out float32 [T, D] = down(gelu_tanh(gate(x)) * up(x)) for x float32 [T, D] with weight
    views ``views`` of kind ``kind`` (slab fields "gate_proj.w", ...) and width ``width``."""
    T = x.shape[0]
    g = base.linear_views(kind, views, "gate_proj", x, np.empty((T, width), np.float32), gs)
    u = base.linear_views(kind, views, "up_proj", x, np.empty((T, width), np.float32), gs)
    h = gelu_tanh(g) * u
    return base.linear_views(kind, views, "down_proj", h, out, gs)


class Model(base.MoEModel):
    """The Gemma 4 MoE forward (see the module docstring)."""

    def __init__(self, args, dense, *a, **kw):
        super().__init__(args, dense, *a, **kw)
        D = args.hidden_size
        for i, ly in enumerate(self.layers):
            p = f"layers.{i}."
            for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                      "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2", "router_scale",
                      "per_expert_scale"):
                ly[n] = dense[p + n]
            ly["layer_scalar"] = np.float32(dense[p + "layer_scalar"].reshape(-1)[0])
            ly["mlp"] = base.mlp_views(dense, p + "mlp.")
        self.unit = np.ones(max(args.head_dim, args.full_head_dim), np.float32)
        self.ones = np.ones(D, np.float32)
        self.embed_scale = np.float32(D ** 0.5)
        self.root = np.float32(D ** -0.5)

    def attention_weights(self, dense: dict, p: str) -> dict:
        ly = {"q_norm": dense[p + "q_norm"], "k_norm": dense[p + "k_norm"]}
        names = [n for n in ("q_proj", "k_proj", "v_proj") if p + n + ".w" in dense]
        for n in names + ["o_proj"]:
            ly[n] = base.Linear(dense, p + n, self.dense_quant, self.gs).interleave()
        ly["qkv"] = base.LinearGroup([ly[n] for n in names])
        return ly

    def alloc_kv(self) -> None:
        """One K and one V cache per layer, [Hkv_l, C, S_l] (KV_DTYPES[kv_dtype]), and the RoPE
        tables of both kinds."""
        a = self.args
        dt = base.KV_DTYPES[self.kv_dtype]
        self.k_cache, self.v_cache = [], []
        for i in range(a.num_hidden_layers):
            h, s = a.layer_shape(i)
            for lst in (self.k_cache, self.v_cache):
                arr = np.empty((h, self.C, s), dt)
                arr.fill(0)  # resident from the start, as the budget plans (see MoEModel)
                lst.append(arr)
        self.rotary_dim = a.head_dim
        self.cos, self.sin = base.rope_tables(a.head_dim, a.rope_theta, self.C)
        S = a.full_head_dim
        n = a.full_rotary_angles
        inv = np.zeros(S // 2, np.float32)
        inv[:n] = np.float32(1.0) / (np.float32(a.full_rope_theta) ** (np.arange(0, 2 * n, 2, dtype=np.float32)
                                                                       / np.float32(S)))
        inv /= np.float32(a.full_rope_factor)
        ang = np.arange(self.C, dtype=np.float32)[:, None] * inv[None, :]
        self.cos_full, self.sin_full = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        self.scale = np.float32(1.0)

    @property
    def kv_bytes(self) -> int:
        return sum(x.nbytes for x in self.k_cache + self.v_cache)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        x = super().embed(ids)
        x *= self.embed_scale
        return x

    def logits(self, x: np.ndarray) -> np.ndarray:
        out = super().logits(x)
        cap = self.args.final_logit_softcapping
        if cap:
            out = (np.tanh(out / np.float32(cap)) * np.float32(cap)).astype(np.float32)
        return out

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        K.rmsnorm(x, w, self.args.rms_norm_eps, out)
        return out

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        """Layer i's attention block on x float32 [T, D] at positions pos0.., its output already
        through post_attention_layernorm (float32 [T, D])."""
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H = a.num_attention_heads
        Hkv, S = a.layer_shape(i)
        w = a.layer_windows[i]
        h = self._norm(x, ly["input_layernorm"])
        shapes = [(T, H * S), (T, Hkv * S), (T, Hkv * S)][:len(ly["qkv"].parts)]
        outs = ly["qkv"](h, tuple(np.empty(s, np.float32) for s in shapes))
        q, k = outs[0], outs[1]
        v = outs[2] if len(outs) == 3 else k.copy()  # K = V layers: the raw K projection
        q2, k2, v2 = q.reshape(-1, S), k.reshape(-1, S), v.reshape(-1, S)
        eps = a.rms_norm_eps
        K.rmsnorm(q2, ly["q_norm"], eps, q2)
        K.rmsnorm(k2, ly["k_norm"], eps, k2)
        K.rmsnorm(v2, self.unit[:S], eps, v2)
        cos, sin = (self.cos, self.sin) if w else (self.cos_full, self.sin_full)
        q3, k3 = q.reshape(T, H, S), k.reshape(T, Hkv, S)
        K.rope(q3, cos[pos0:pos0 + T], sin[pos0:pos0 + T])
        K.rope(k3, cos[pos0:pos0 + T], sin[pos0:pos0 + T])
        kc, vc = self.k_cache[i], self.v_cache[i]
        self._kv_write(kc[:, pos0:pos0 + T].transpose(1, 0, 2), k3)
        self._kv_write(vc[:, pos0:pos0 + T].transpose(1, 0, 2), v.reshape(T, Hkv, S))
        att = np.empty((T, H, S), np.float32)
        n_full = T if not w else min(T, max(0, w - pos0))
        if n_full:
            K.attention(q3[:n_full], kc, vc, pos0, self.scale, att[:n_full])
        for t in range(n_full, T):  # the window's keys: p - w + 1 .. p
            j0 = pos0 + t - w + 1
            K.attention(q3[t:t + 1], kc[:, j0:], vc[:, j0:], w - 1, self.scale, att[t:t + 1])
        return self._norm(ly["o_proj"](att.reshape(T, H * S), np.empty_like(x)), ly["post_attention_layernorm"])

    def moe_norm(self, j: int) -> np.ndarray:
        """The router's input weights (router.scale x hidden^-1/2 on the weightless RMSNorm of the residual)."""
        return (self.layers[self.moe_layer_ids[j]]["router_scale"] * self.root).astype(np.float32)

    def route(self, j: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Softmax top-K renormalised (lower id on ties), times the chosen experts' per_expert_scale."""
        idx, w = base.route(logits, self.args.num_experts_per_tok, True)
        return idx, (w * self.layers[self.moe_layer_ids[j]]["per_expert_scale"][idx]).astype(np.float32)

    def expert_forward(self, views: dict, x: np.ndarray, h: np.ndarray, out: np.ndarray) -> None:
        """One GeGLU expert on rows x [T, D] into out [T, D] (h [T, I] unused scratch)."""
        geglu(self.expert_quant, views, x, self.args.moe_intermediate_size, self.gs, out)

    def mlp(self, i: int, x: np.ndarray) -> np.ndarray:
        """Layer i's feed-forward block on the residual x [T, D], post_feedforward_layernorm
        applied: the dense GeGLU branch and the routed experts, each normed, summed."""
        a, ly = self.args, self.layers[i]
        j = self.moe_index[i]
        h1 = self._norm(geglu(self.dense_quant, ly["mlp"], self._norm(x, ly["pre_feedforward_layernorm"]),
                              a.intermediate_size, self.gs, np.empty_like(x)), ly["post_feedforward_layernorm_1"])
        r = self._norm(x, self.ones)  # the router's weightless norm, then its scales in transformers' order
        r *= ly["router_scale"]
        r *= self.root
        logits = self.router_logits(j, r)
        idx, w = self.route(j, logits)
        self.observers.publish("on_route", j, idx, logits)
        h2 = self._moe_grouped(j, self._norm(x, ly["pre_feedforward_layernorm_2"]), idx, w)
        h2 = self._norm(h2, ly["post_feedforward_layernorm_2"])
        return self._norm(h1 + h2, ly["post_feedforward_layernorm"])

    def _run_layers(self, x: np.ndarray, pos0: int, first: int, cancel: threading.Event | None) -> None:
        """Decoder layers first.. on x float32 [T, D] in place: x += attention; x = (x + mlp) x
        layer_scalar; with the observers' per-layer hooks (every layer is a MoE layer)."""
        obs = self.observers
        for i in range(first, self.args.num_hidden_layers):
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            obs.publish("on_layer_start", i)
            x += self.attention(i, x, pos0)
            obs.publish("on_after_attention", i, x)
            x += self.mlp(i, x)
            x *= self.layers[i]["layer_scalar"]
            obs.publish("on_after_moe", i, x)
