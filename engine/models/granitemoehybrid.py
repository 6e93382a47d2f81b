"""Granite 4.0 hybrids (``model_type: granitemoehybrid``; ibm-granite/granite-4.0-h-small,
-h-tiny, -h-micro).

Follows transformers' models/granitemoehybrid/modeling_granitemoehybrid.py: Mamba2 layers and
attention layers (``layer_types``: "linear_attention" / "full_attention", or
``layers_block_type``: "mamba" / "attention"). What differs from the shared decoder:

- Mamba2 layers: in_proj gives the gate z, the convolved x / B / C and dt per head; a depthwise
  causal convolution (``mamba_d_conv`` taps, optional bias) with SiLU over x, B, C; dt =
  softplus(dt + dt_bias) clipped to ``time_step_limit``; per head h the state
  S <- exp(dt A) S + dt x B^T (A = -exp(A_log); B, C shared by the heads of a group of
  ``mamba_n_groups``), y = S C + D x; then y x silu(z) through an RMSNorm per group and out_proj.
  The state a layer carries (its last d_conv - 1 convolution inputs and S) is held, rewound and
  snapshotted by Qwen3-Next's machinery (engine/models/qwen3_next.py's ``rewind``), so chat
  prefix reuse and regenerate stay exact. The recurrence runs token by token (transformers
  computes the same values in chunks).
- Attention layers: GQA, scores times ``attention_multiplier`` (not 1/sqrt(head_dim)), RoPE
  only when ``position_embedding_type`` is "rope" (the published hybrids use none).
- Granite multipliers: embeddings times ``embedding_multiplier``, each block's output times
  ``residual_multiplier`` before it joins the residual, logits divided by ``logits_scaling``.
- Every layer: the routed experts (softmax over the top-K logits; fused
  ``block_sparse_moe.input_linear`` [E, 2I, D] gate rows then up, ``output_linear`` [E, D, I])
  plus an ungated shared MLP (``shared_mlp.input_linear`` [2 Is, D] split into gate and up at
  conversion, ``output_linear``).

Not the one-call decode step (K.decode_layers_t1): Mamba2 layers are not attention, and the
shared MLP and multipliers are not the kernel's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..kernel_choice import K
from . import base, qwen3_next
from .base import Linear

MODEL_TYPE = "granitemoehybrid"
DISPLAY_NAME = "Granite 4.0 (hybrid MoE)"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """Granite 4.0 hybrid config.json (GraniteMoeHybridConfig names)."""

    layer_types: tuple[str, ...] = ()
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_d_state: int = 0
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_conv_bias: bool = True
    time_step_min: float = 0.0
    time_step_max: float = math.inf
    use_rope: bool = False
    attention_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @property
    def full_layers(self) -> tuple[int, ...]:
        return base.layers_of_type(self.layer_types, "full_attention")

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return base.layers_of_type(self.layer_types, "linear_attention")

    @property
    def mamba_width(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_width + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def num_kv_layers(self) -> int:
        return len(self.full_layers)

    @property
    def recurrent_state_bytes(self) -> int:
        """float32 conv inputs [d_conv - 1, conv_dim] and states [heads, d_head, d_state] per Mamba2
        layer, live and snapshot."""
        per = (self.mamba_d_conv - 1) * self.mamba_conv_dim + self.mamba_n_heads * self.mamba_d_head * self.mamba_d_state
        return 2 * len(self.mamba_layers) * 4 * per

    def dense_param_count(self) -> int:
        return base.tensor_params(self, dense_tensors(self))

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="intermediate_size",
                             experts_keys=("num_local_experts",))
        L = v["num_hidden_layers"]
        names = {"mamba": "linear_attention", "attention": "full_attention", "linear_attention": "linear_attention",
                 "full_attention": "full_attention"}
        types = cfg.get("layer_types") or cfg.get("layers_block_type")
        if not isinstance(types, list) or len(types) != L or any(t not in names for t in types):
            raise ConfigError(f"{path}: key 'layer_types' must list 'linear_attention' (Mamba2) or "
                              f"'full_attention' for each of the {L} layers, got {types!r}")
        for key in ("mamba_proj_bias", "attention_bias"):
            if base.flag(cfg, key, path, False):
                raise ConfigError(f"{path}: {key}=true is not supported for {DISPLAY_NAME}")
        pet = cfg.get("position_embedding_type")
        if pet not in (None, "nope", "rope"):
            raise ConfigError(f"{path}: position_embedding_type {pet!r} is not supported (expected 'rope' or none)")

        def n(key, lo, hi, default):
            return base.num(cfg, key, path, lo, hi, integer=True, default=default)

        def f(key, default):
            return base.num(cfg, key, path, 1e-12, 1e12, integer=False, default=default)

        heads, d_head = n("mamba_n_heads", 1, 1 << 16, 128), n("mamba_d_head", 1, 1 << 16, 64)
        groups, expand = n("mamba_n_groups", 1, 1 << 16, 1), n("mamba_expand", 1, 64, 2)
        width = expand * v["hidden_size"]
        if heads * d_head != width or heads % groups or width % groups:
            raise ConfigError(f"{path}: mamba_n_heads x mamba_d_head ({heads} x {d_head}) must equal mamba_expand x "
                              f"hidden_size ({width}), and mamba_n_groups ({groups}) divide the heads")
        lim = cfg.get("time_step_limit") or [0.0, math.inf]
        lo, hi = (float(x["__float__"]) if isinstance(x, dict) else float(x) for x in lim)
        shared = n("shared_intermediate_size", 1, 1 << 24, None)
        return cls(**v, norm_topk_prob=True, moe_layers=tuple(range(L)), layer_windows=(0,) * L,
                   layer_types=tuple(names[t] for t in types), mamba_n_heads=heads, mamba_d_head=d_head,
                   mamba_d_state=n("mamba_d_state", 1, 1 << 16, 256), mamba_n_groups=groups,
                   mamba_d_conv=n("mamba_d_conv", 1, 64, 4), mamba_expand=expand,
                   mamba_conv_bias=base.flag(cfg, "mamba_conv_bias", path, True), time_step_min=lo,
                   time_step_max=hi, use_rope=pet == "rope",
                   shared_expert_intermediate_size=shared, shared_expert_gated=False,
                   attention_multiplier=f("attention_multiplier", 1.0),
                   embedding_multiplier=f("embedding_multiplier", 1.0),
                   residual_multiplier=f("residual_multiplier", 1.0), logits_scaling=f("logits_scaling", 1.0))


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    D, E, Is = args.hidden_size, args.num_experts, args.shared_expert_intermediate_size
    out: list[base.Tensor] = []
    for i in range(args.num_hidden_layers):
        hp, cp = f"model.layers.{i}.", f"layers.{i}."
        if args.layer_types[i] == "full_attention":
            out += base.attention_tensors(args, i)
        else:
            W, Cd, H = args.mamba_width, args.mamba_conv_dim, args.mamba_n_heads
            m = hp + "mamba."
            out += [base.Tensor(hp + "input_layernorm.weight", cp + "input_layernorm", (D,), "keep"),
                    base.Tensor(hp + "post_attention_layernorm.weight", cp + "post_attention_layernorm", (D,), "keep"),
                    base.Tensor(m + "in_proj.weight", cp + "in_proj", (W + Cd + H, D), "quant"),
                    base.Tensor(m + "out_proj.weight", cp + "o_proj", (D, W), "quant"),
                    base.Tensor(m + "conv1d.weight", cp + "conv1d", (Cd, 1, args.mamba_d_conv), "keep"),
                    base.Tensor(m + "A_log", cp + "A_log", (H,), "keep"),
                    base.Tensor(m + "D", cp + "D", (H,), "keep"),
                    base.Tensor(m + "dt_bias", cp + "dt_bias", (H,), "keep"),
                    base.Tensor(m + "norm.weight", cp + "mamba_norm", (W,), "keep")]
            if args.mamba_conv_bias:
                out.append(base.Tensor(m + "conv1d.bias", cp + "conv1d_bias", (Cd,), "keep"))
        out += [base.Tensor(hp + "block_sparse_moe.router.layer.weight", cp + "router", (E, D), "keep"),
                base.Tensor(hp + "shared_mlp.input_linear.weight", cp + "shared_expert.gate_up", (2 * Is, D), "quant",
                            split="glu"),
                base.Tensor(hp + "shared_mlp.output_linear.weight", cp + "shared_expert.down_proj", (D, Is), "quant")]
    return out + base.global_tensors(args)


def split_shapes(args: ModelArgs, t: base.Tensor) -> list[tuple[str, tuple[int, int]]]:
    """The shared MLP's input_linear [2 Is, D] is stored as gate_proj and up_proj [Is, D]."""
    p = t.ours[:-len("gate_up")]
    Is, D = args.shared_expert_intermediate_size, args.hidden_size
    return [(p + "gate_proj", (Is, D)), (p + "up_proj", (Is, D))]


def split_tensor(args: ModelArgs, t: base.Tensor, w: np.ndarray) -> dict[str, np.ndarray]:
    (g, _), (u, _) = split_shapes(args, t)
    Is = args.shared_expert_intermediate_size
    return {g: np.ascontiguousarray(w[:Is]), u: np.ascontiguousarray(w[Is:])}


def expert_tensors(args: ModelArgs, i: int, mxfp4: bool = False) -> dict:
    """Layer i's fused experts (``mxfp4``: a layout Granite is never published in)."""
    D, I, E = args.hidden_size, args.moe_intermediate_size, args.num_experts
    p = f"model.layers.{i}.block_sparse_moe."
    if mxfp4:
        return {p + "input_linear_blocks": (E, 2 * I, D)}
    return {p + "input_linear.weight": (E, 2 * I, D), p + "output_linear.weight": (E, D, I)}


def expert_from_fused(args: ModelArgs, i: int, rows: dict[str, np.ndarray]) -> dict:
    """One expert's input_linear [2I, D] (gate rows, then up) and output_linear [D, I]."""
    p = f"model.layers.{i}.block_sparse_moe."
    I = args.moe_intermediate_size
    gu = rows[p + "input_linear.weight"]
    return {"gate_proj": np.ascontiguousarray(gu[:I]), "up_proj": np.ascontiguousarray(gu[I:]),
            "down_proj": np.ascontiguousarray(rows[p + "output_linear.weight"])}


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.block_sparse_moe.experts.")


def _silu(x: np.ndarray) -> np.ndarray:
    return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


class Model(qwen3_next.Model):
    """The Granite 4.0 hybrid forward (see the module docstring)."""

    def __init__(self, args, dense, *a, **kw):
        base.MoEModel.__init__(self, args, dense, *a, **kw)  # plain RMSNorm weights (not Qwen3-Next's w - 1)

    def attention_weights(self, dense: dict, p: str) -> dict:
        i = int(p.split(".")[1])
        if self.args.layer_types[i] == "full_attention":
            return base.MoEModel.attention_weights(self, dense, p)
        ly = {n: Linear(dense, p + n, self.dense_quant, self.gs) for n in ("in_proj", "o_proj")}
        ly["conv1d"] = np.ascontiguousarray(np.asarray(dense[p + "conv1d"], np.float32)[:, 0, :].T)  # [K, Cd]
        b = dense.get(p + "conv1d_bias")
        ly["conv1d_bias"] = None if b is None else np.asarray(b, np.float32)
        ly["A"] = -np.exp(np.asarray(dense[p + "A_log"], np.float32))
        for n in ("D", "dt_bias", "mamba_norm"):
            ly[n] = np.asarray(dense[p + n], np.float32)
        return ly

    def alloc_kv(self) -> None:
        """KV cache [Lf, Hkv, C, S] of the attention layers; per Mamba2 layer the conv inputs
        [d_conv - 1, conv_dim] and the state [heads, d_head, d_state] (float32), and their snapshot."""
        a = self.args
        Lf, Lm = len(a.full_layers), len(a.mamba_layers)
        Hkv, S = a.num_key_value_heads, a.head_dim
        self.kv_row = {i: r for r, i in enumerate(a.full_layers)}
        self.state_row = {i: r for r, i in enumerate(a.mamba_layers)}
        dt = base.KV_DTYPES[self.kv_dtype]
        self.k_cache = np.empty((Lf, Hkv, self.C, S), dtype=dt)
        self.v_cache = np.empty((Lf, Hkv, self.C, S), dtype=dt)
        self.k_cache.fill(0)  # resident from the start, as the budget plans (see MoEModel)
        self.v_cache.fill(0)
        self.conv_state = np.zeros((Lm, a.mamba_d_conv - 1, a.mamba_conv_dim), np.float32)
        self.rec_state = np.zeros((Lm, a.mamba_n_heads, a.mamba_d_head, a.mamba_d_state), np.float32)
        self.conv_snap = np.zeros_like(self.conv_state)
        self.rec_snap = np.zeros_like(self.rec_state)
        self.state_pos, self.snap_pos = 0, -1
        self.rotary_dim = S
        self.cos, self.sin = base.rope_tables(S, a.rope_theta, self.C)
        self.scale = np.float32(a.attention_multiplier)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        x = super().embed(ids)
        x *= np.float32(self.args.embedding_multiplier)
        return x

    def logits(self, x: np.ndarray) -> np.ndarray:
        out = super().logits(x)
        out /= np.float32(self.args.logits_scaling)
        return out

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        out = self.full_attention(i, x, pos0) if i in self.kv_row else self._stateful(i, x, pos0, self.mamba)
        out *= np.float32(self.args.residual_multiplier)
        return out

    def mlp(self, i: int, x: np.ndarray) -> np.ndarray:
        out = base.MoEModel.mlp(self, i, x)  # routed experts + the shared MLP
        out *= np.float32(self.args.residual_multiplier)
        return out

    def full_attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        """GQA scaled by attention_multiplier, RoPE when the config asks for it."""
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, Hkv, S = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        h = np.empty_like(x)
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        q, k, v = ly["qkv"](h, (np.empty((T, H * S), np.float32), np.empty((T, Hkv * S), np.float32),
                                np.empty((T, Hkv * S), np.float32)))
        q3, k3 = q.reshape(T, H, S), k.reshape(T, Hkv, S)
        if a.use_rope:
            K.rope(q3, self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T])
            K.rope(k3, self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T])
        r = self.kv_row[i]
        self._kv_append(r, pos0, k3, v.reshape(T, Hkv, S))
        att = np.empty((T, H, S), np.float32)
        K.attention(q3, self.k_cache[r], self.v_cache[r], pos0, self.scale, att)
        return ly["o_proj"](att.reshape(T, H * S), np.empty_like(x))

    def mamba(self, i: int, x: np.ndarray) -> np.ndarray:
        """The Mamba2 mixer on x [T, D], continuing layer i's conv inputs and state."""
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        W, Cd, H, P, N, G = (a.mamba_width, a.mamba_conv_dim, a.mamba_n_heads, a.mamba_d_head, a.mamba_d_state,
                             a.mamba_n_groups)
        h = np.empty_like(x)
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        proj = ly["in_proj"](h, np.empty((T, W + Cd + H), np.float32))
        z, xbc, dt = proj[:, :W], proj[:, W:W + Cd], proj[:, W + Cd:]
        r = self.state_row[i]
        w = ly["conv1d"]  # [K, Cd]
        kc = w.shape[0] - 1
        xe = np.concatenate([self.conv_state[r], xbc])  # [K - 1 + T, Cd]
        conv = xe[0:T] * w[0]
        for j in range(1, kc + 1):
            conv += xe[j:j + T] * w[j]
        if ly["conv1d_bias"] is not None:
            conv += ly["conv1d_bias"]
        if kc:
            self.conv_state[r] = xe[T:]
        conv = _silu(conv)
        xs = conv[:, :W].reshape(T, H, P)
        Bm = conv[:, W:W + G * N].reshape(T, G, N)
        Cm = conv[:, W + G * N:].reshape(T, G, N)
        dt = np.logaddexp(np.float32(0.0), dt + ly["dt_bias"]).astype(np.float32)  # softplus, [T, H]
        dt = np.clip(dt, np.float32(a.time_step_min), np.float32(a.time_step_max)).astype(np.float32)
        grp = np.arange(H) // (H // G)  # the group of each head
        state = self.rec_state[r]  # [H, P, N], updated in place
        y = np.empty((T, H, P), np.float32)
        for t in range(T):
            dA = np.exp(dt[t] * ly["A"]).astype(np.float32)  # [H]
            b = Bm[t][grp]  # [H, N]
            state *= dA[:, None, None]
            state += (dt[t][:, None] * xs[t])[:, :, None] * b[:, None, :]
            y[t] = np.einsum("hpn,hn->hp", state, Cm[t][grp]) + ly["D"][:, None] * xs[t]
        g = y.reshape(T, W) * _silu(z)
        g = g.reshape(T, G, W // G)
        g = g / np.sqrt((g * g).mean(-1, keepdims=True) + np.float32(a.rms_norm_eps))
        g = (g.reshape(T, W) * ly["mamba_norm"]).astype(np.float32)
        return ly["o_proj"](np.ascontiguousarray(g), np.empty_like(x))
