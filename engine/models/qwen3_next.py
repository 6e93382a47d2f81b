"""Qwen3-Next (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): the hybrid decoder of Gated DeltaNet
linear-attention layers and gated full-attention layers, with routed experts and a sigmoid-gated
shared expert. Also the base of the Qwen3.5 MoE language model (engine/models/qwen3_5_moe_text.py;
the published multimodal checkpoints: qwen3_5_moe.py).

Follows transformers' models/qwen3_next/modeling_qwen3_next.py (the arithmetic; its torch
fallback ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` /
``causal_conv1d_fn`` is the CPU oracle of the tests). Key as base.py, plus: nk / nv linear key /
value heads (``linear_num_key_heads`` / ``linear_num_value_heads``), dk / dv their widths,
Kd = nk dk, Vd = nv dv, Cc = 2 Kd + Vd conv channels, Kc = ``linear_conv_kernel_dim``.

``layer_types[i]`` is "linear_attention" or "full_attention" (default: every
``full_attention_interval``-th layer (4) is full). Every RMSNorm of the decoder (input /
post-attention, the final norm, attention's q / k norms) is zero-centred: x / rms(x) * (1 + w);
the stores hold the checkpoint's w and the model adds the 1 at load. The gated RMSNorm of the
linear layers multiplies by w itself.

Full-attention layer (gated, partial RoPE): q_proj gives per head [q (S), gate (S)];
per-head q / k norm, RoPE on the first ``partial_rotary_factor`` x S values of each head
(rotate-half), causal GQA, output times sigmoid(gate), o_proj.

Linear-attention layer (Gated DeltaNet, Yang et al. 2024, "Gated Delta Networks: Improving
Mamba2 with Delta Rule", arXiv 2412.06464):

    qkv = in_proj_qkv(h) [Cc], z = in_proj_z(h) [Vd], b, a = in_proj_b(h), in_proj_a(h) [nv]
    qkv = silu(causal depthwise conv over the last Kc inputs (conv1d [Cc, 1, Kc], no bias))
    q, k = l2norm per head (eps 1e-6), q *= dk^-0.5; value head h reads key head h // (nv / nk)
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)                  [nv]
    per value head: S <- exp(g) S;  S <- S + k (beta (v - k^T S))^T;  o = q^T S   (S [dk, dv])
    out = out_proj(rmsnorm(o) * norm.weight * silu(z))                          per head over dv

The rule runs as one numba kernel (engine/kernels/recurrent.py ``gated_delta``, numpy twin in
kernels_ref.py) in chunks of CHUNK = 64 tokens, the WY / UT-transform form of transformers'
torch_chunk_gated_delta_rule and the paper's section 3: inside a chunk of n tokens with
cumulative log decays c_i, a unit lower-triangular system (I + strict_lower(beta_i k_i.k_j
e^(c_i - c_j))) gives the pseudo-values of all n tokens at once, so a prefill costs
O(T (dk dv + n (dk + dv))) per head, never quadratic in T; a decode step (T = 1) is the
one-step recurrence.

Checkpoint names (Qwen3-Next): model.layers.N.linear_attn.{in_proj_qkvz, in_proj_ba, conv1d,
dt_bias, A_log, norm, out_proj} or model.layers.N.self_attn.{q,k,v,o}_proj / q_norm / k_norm;
model.layers.N.mlp.{gate, experts.E.*, shared_expert.*, shared_expert_gate} (dense layers:
mlp.{gate,up,down}_proj). in_proj_qkvz / in_proj_ba interleave q, k, v, z (and b, a) per key-head
group; the converter stores them regrouped as in_proj_qkv (q of every head, then k, then v),
in_proj_z, in_proj_b and in_proj_a (Qwen3.5's layout), so one forward serves both families.

The recurrent state (per linear layer: the conv's last Kc - 1 inputs [Kc - 1, Cc] and S
[nv, dk, dv], float32 whatever kv_dtype) is carried across forward calls. Prefix reuse (see
:meth:`Model.rewind`): the state is snapshotted once per prefill, at the prompt's last position
but one; generate resumes from the live state, the snapshot or position 0, whichever is the
latest not after the reused prefix, and recomputes the rest. The budget counts the live state
and the snapshot with the KV cache (:attr:`ModelArgs.recurrent_state_bytes`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from . import base
from .base import PREFILL_CHUNK, K, Linear, LinearGroup, Tensor

MODEL_TYPE = "qwen3_next"
DISPLAY_NAME = "Qwen3-Next"
CHUNK = 64  # tokens per chunk of the chunked gated delta rule (transformers' default chunk_size)
LAYER_TYPES = ("linear_attention", "full_attention")
# The multi-token-prediction layer (engine/mtp.py, vLLM's qwen3_next_mtp.py): mtp.fc over
# [pre_fc_norm_embedding(embedding) ; pre_fc_norm_hidden(final hidden state)], one full-attention
# MoE layer mtp.layers.0, mtp.norm, the main lm_head; its norms zero-centred as the decoder's
MTP_HEAD = base.HeadLayout("mtp_num_hidden_layers", "mtp.layers.{k}.",
                           ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                            "mtp.norm.weight"), zero_first=False, norm_one=True, block_types=("full_attention",))
# config.json keys that may be absent, with transformers' Qwen3NextConfig defaults (the widths of
# Qwen3-Next-80B); the checkpoint names an absent one when a weight's shape then disagrees
DEFAULTED_KEYS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32}


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """Qwen3-Next config.json (Qwen3NextConfig names). ``layer_types``: per transformer layer,
    "linear_attention" or "full_attention"."""

    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0  # config.json's mtp_num_hidden_layers

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = hybrid_fields(cfg, path, DISPLAY_NAME)
        layers = base.sparse_layers(cfg, path, v, DISPLAY_NAME)
        return cls(**v, norm_topk_prob=base.flag(cfg, "norm_topk_prob", path, True), **layers,
                   num_nextn_predict_layers=base.num(cfg, MTP_HEAD.count_key, path, 0, 64, integer=True, default=0))

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Transformer layers with (gated) full attention: the only ones with a KV cache."""
        return base.layers_of_type(self.layer_types, "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Transformer layers with Gated DeltaNet linear attention (a recurrent state each)."""
        return base.layers_of_type(self.layer_types, "linear_attention")

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def num_kv_layers(self) -> int:
        """Layers holding a KV cache: the full-attention ones."""
        return len(self.full_layers)

    @property
    def state_bytes_per_layer(self) -> int:
        """float32 bytes of one linear layer's state: conv inputs [Kc - 1, Cc] + S [nv, dk, dv]."""
        return 4 * (self.conv_dim * (self.linear_conv_kernel_dim - 1)
                    + self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim)

    @property
    def recurrent_state_bytes(self) -> int:
        """Bytes of the linear layers' states the model holds whatever the context length: the
        live state and the prefix-reuse snapshot (2 x per layer x linear layers)."""
        return 2 * len(self.linear_layers) * self.state_bytes_per_layer

    def dense_param_count(self) -> int:
        """Parameters that stay resident (everything but the routed experts)."""
        D, V, S = self.hidden_size, self.vocab_size, self.head_dim
        full = D * 2 * self.q_dim + 2 * D * self.kv_dim + self.q_dim * D + 2 * S
        nv = self.linear_num_value_heads
        lin = (D * (self.conv_dim + self.value_dim + 2 * nv) + self.conv_dim * self.linear_conv_kernel_dim
               + 2 * nv + self.linear_value_head_dim + self.value_dim * D)
        M, L = self.num_moe_layers, self.num_hidden_layers
        mix = len(self.full_layers) * full + len(self.linear_layers) * lin
        return (V * D * (1 if self.tie_word_embeddings else 2) + mix + L * 2 * D + M * self.moe_resident_params()
                + (L - M) * 3 * D * self.intermediate_size + D)


def hybrid_fields(cfg: dict, path: str, family: str) -> dict:
    """The ModelArgs fields Qwen3-Next and Qwen3.5-MoE share (attention, linear attention,
    layer types, shared expert, RoPE), validated: ConfigError naming ``path`` and the key."""
    v = base.common_args(cfg, path, family, expert_width_key="moe_intermediate_size",
                         experts_keys=("num_experts", "num_local_experts"))
    L, S = v["num_hidden_layers"], v["head_dim"]
    if cfg.get("attention_bias"):
        raise ConfigError(f"{path}: attention_bias=true is not supported for {family}")

    def n(key, lo, hi, default=None):
        return base.num(cfg, key, path, lo, hi, integer=True, family=family, default=default)

    lin = {k: n(k, 1, hi, DEFAULTED_KEYS[k]) for k, hi in (
        ("linear_conv_kernel_dim", 64), ("linear_key_head_dim", 1 << 16), ("linear_value_head_dim", 1 << 16),
        ("linear_num_key_heads", 1 << 12), ("linear_num_value_heads", 1 << 12))}
    if lin["linear_num_value_heads"] % lin["linear_num_key_heads"]:
        gone = [k for k in ("linear_num_value_heads", "linear_num_key_heads") if k not in cfg]
        raise ConfigError(f"{path}: linear_num_value_heads ({lin['linear_num_value_heads']}) must be a multiple "
                          f"of linear_num_key_heads ({lin['linear_num_key_heads']})"
                          + "".join(f"; '{k}' is absent (transformers' default {DEFAULTED_KEYS[k]}): add the "
                                    f"model's value" for k in gone))
    types = cfg.get("layer_types")
    if types is None:
        every = n("full_attention_interval", 1, 1 << 16, 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(L)]
    if not isinstance(types, list) or len(types) != L or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"{path}: key 'layer_types' must list 'linear_attention' or 'full_attention' for each "
                          f"of the {L} layers, got {types!r}")
    rope = cfg.get("rope_parameters") or {}
    prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
        raise ConfigError(f"{path}: partial_rotary_factor {prf!r} must be a number in (0, 1]")
    rd = int(S * prf)
    if rd < 2 or rd % 2:
        raise ConfigError(f"{path}: partial_rotary_factor {prf} x head_dim {S} = {rd} rotary values must be even")
    v["head_dim"] = S
    return dict(**v, qk_norm="head", rotary_dim=rd, layer_windows=(0,) * L, layer_types=tuple(types),
                shared_expert_intermediate_size=n("shared_expert_intermediate_size", 1, 1 << 24),
                shared_expert_gated=True, **lin)


# --- checkpoint names -------------------------------------------------------------------------

def mixer_tensors(args: ModelArgs, i: int, fused_projections: bool = True) -> list[Tensor]:
    """Norms and the token mixer of layer i, Hugging Face -> store names. Full attention:
    q_proj [2 H S, D] (q and gate per head), k/v/o, q_norm / k_norm [S]. Linear attention:
    ``fused_projections`` (Qwen3-Next) in_proj_qkvz / in_proj_ba, stored regrouped
    (``split`` "qkvz" / "ba", :func:`split_tensor`), else (Qwen3.5) in_proj_qkv / z / b / a;
    conv1d [Cc, 1, Kc], dt_bias / A_log [nv], norm [dv] (float32), out_proj [D, Vd]."""
    D, S, H = args.hidden_size, args.head_dim, args.num_attention_heads
    hp, cp = f"model.layers.{i}.", f"layers.{i}."
    out = [Tensor(hp + "input_layernorm.weight", cp + "input_layernorm", (D,), "keep"),
           Tensor(hp + "post_attention_layernorm.weight", cp + "post_attention_layernorm", (D,), "keep")]
    if args.layer_types[i] == "full_attention":
        a = hp + "self_attn."
        return out + [Tensor(a + "q_proj.weight", cp + "q_proj", (2 * H * S, D), "quant"),
                      Tensor(a + "k_proj.weight", cp + "k_proj", (args.kv_dim, D), "quant"),
                      Tensor(a + "v_proj.weight", cp + "v_proj", (args.kv_dim, D), "quant"),
                      Tensor(a + "o_proj.weight", cp + "o_proj", (D, args.q_dim), "quant"),
                      Tensor(a + "q_norm.weight", cp + "q_norm", (S,), "keep"),
                      Tensor(a + "k_norm.weight", cp + "k_norm", (S,), "keep")]
    a, nv = hp + "linear_attn.", args.linear_num_value_heads
    if fused_projections:
        out += [Tensor(a + "in_proj_qkvz.weight", cp + "in_proj_qkvz", (args.conv_dim + args.value_dim, D),
                       "quant", "qkvz"),
                Tensor(a + "in_proj_ba.weight", cp + "in_proj_ba", (2 * nv, D), "quant", "ba")]
    else:
        out += [Tensor(a + "in_proj_qkv.weight", cp + "in_proj_qkv", (args.conv_dim, D), "quant"),
                Tensor(a + "in_proj_z.weight", cp + "in_proj_z", (args.value_dim, D), "quant"),
                Tensor(a + "in_proj_b.weight", cp + "in_proj_b", (nv, D), "quant"),
                Tensor(a + "in_proj_a.weight", cp + "in_proj_a", (nv, D), "quant")]
    return out + [Tensor(a + "conv1d.weight", cp + "conv1d", (args.conv_dim, 1, args.linear_conv_kernel_dim), "keep"),
                  Tensor(a + "dt_bias", cp + "dt_bias", (nv,), "keep"),
                  Tensor(a + "A_log", cp + "A_log", (nv,), "keep"),
                  Tensor(a + "norm.weight", cp + "linear_norm", (args.linear_value_head_dim,), "keep"),
                  Tensor(a + "out_proj.weight", cp + "out_proj", (D, args.value_dim), "quant")]


def dense_tensors(args: ModelArgs) -> list[Tensor]:
    return base.decoder_tensors(args, "mlp", attention=mixer_tensors)


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    p = MTP_HEAD.block_prefix(args, i) + "mlp.experts."  # a kept MTP layer's: mtp.layers.k.
    return base.ExpertNames(i, p, fused_prefixes=(p,))


def split_shapes(args: ModelArgs, t: Tensor) -> list[tuple[str, tuple[int, int]]]:
    """The stored tensors a fused projection becomes: (store name, shape)."""
    D, nv = args.hidden_size, args.linear_num_value_heads
    p = t.ours[: t.ours.rindex(".") + 1]
    if t.split == "qkvz":
        return [(p + "in_proj_qkv", (args.conv_dim, D)), (p + "in_proj_z", (args.value_dim, D))]
    if t.split == "ba":
        return [(p + "in_proj_b", (nv, D)), (p + "in_proj_a", (nv, D))]
    raise ValueError(f"{t.hf}: unknown split {t.split!r}")


def split_tensor(args: ModelArgs, t: Tensor, w: np.ndarray) -> dict[str, np.ndarray]:
    """Regroup a fused projection (float32 rows) into Qwen3.5's layout.

    in_proj_qkvz [nk * (2 dk + 2 r dv), D], per key head g: q_g (dk rows), k_g (dk), v of its
    r = nv / nk value heads (r dv), z of them (r dv) -> in_proj_qkv [q_0..q_nk-1, k_0.., v_0..]
    and in_proj_z [z_0..]. in_proj_ba [nk * 2r, D], per key head: b (r), a (r) -> in_proj_b,
    in_proj_a [nv, D]. Source: transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering.
    """
    nk, dk, dv = args.linear_num_key_heads, args.linear_key_head_dim, args.linear_value_head_dim
    r = args.linear_num_value_heads // nk
    (n1, s1), (n2, s2) = split_shapes(args, t)
    g = w.reshape(nk, -1, w.shape[-1])  # [nk, rows per group, D]
    if t.split == "qkvz":
        q, k = g[:, :dk], g[:, dk:2 * dk]
        v, z = g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]
        qkv = np.concatenate([q.reshape(-1, w.shape[-1]), k.reshape(-1, w.shape[-1]), v.reshape(-1, w.shape[-1])])
        return {n1: np.ascontiguousarray(qkv).reshape(s1), n2: np.ascontiguousarray(z).reshape(s2)}
    return {n1: np.ascontiguousarray(g[:, :r]).reshape(s1), n2: np.ascontiguousarray(g[:, r:]).reshape(s2)}


# --- arithmetic -------------------------------------------------------------------------------

def _silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def _l2norm(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis (transformers' / FLA's l2norm)."""
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + np.float32(1e-6))


class Model(base.MoEModel):
    """The Qwen3-Next forward: Gated DeltaNet and gated full-attention layers over the shared
    MoE decoder (routed experts + the sigmoid-gated shared expert).

    Attributes (beyond MoEModel's): k_cache / v_cache [Lf, Hkv, C, S] for the Lf full-attention
    layers only; conv_state [Ll, Kc - 1, Cc] and rec_state [Ll, nv, dk, dv] float32 for the Ll
    linear layers, and their snapshot; state_pos: the position the live state is at (the
    tokens before it are folded in; -1 = unknown after a cancelled forward); snap_pos: the
    snapshot's position (-1 = none).
    """

    _hist = None  # verify's per-token states (conv [T, ...], rec [T, ...], pos0) until accept

    def __init__(self, args, dense, dense_quant, expert_quant, experts, context_length, group_size=32,
                 kv_dtype="f16", embed_rows=None):
        super().__init__(args, dense, dense_quant, expert_quant, experts, context_length, group_size,
                         kv_dtype=kv_dtype, embed_rows=embed_rows)
        # zero-centred RMSNorm weights: the kernels multiply by w, the checkpoint holds w - 1
        one = np.float32(1.0)
        for ly in self.layers:
            for n in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"):
                if ly.get(n) is not None:
                    ly[n] = (ly[n] + one).astype(np.float32)
        self.norm = (self.norm + one).astype(np.float32)

    def attention_weights(self, dense: dict, p: str) -> dict:
        a, dq, gs = self.args, self.dense_quant, self.gs
        i = int(p.split(".")[1])
        if a.layer_types[i] == "full_attention":
            return super().attention_weights(dense, p)
        ly = {n: Linear(dense, p + n, dq, gs) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                                        "out_proj")}
        ly["in_proj_qkvz"] = LinearGroup([ly["in_proj_qkv"], ly["in_proj_z"]])  # one call each (same input)
        ly["in_proj_ba"] = LinearGroup([ly["in_proj_b"], ly["in_proj_a"]])
        conv = np.asarray(dense[p + "conv1d"], np.float32)  # [Cc, 1, Kc]
        ly["conv1d"] = np.ascontiguousarray(conv[:, 0, :].T)  # [Kc, Cc]
        ly["neg_A"] = -np.exp(np.asarray(dense[p + "A_log"], np.float32))  # [nv]
        ly["dt_bias"] = np.asarray(dense[p + "dt_bias"], np.float32)
        ly["linear_norm"] = np.asarray(dense[p + "linear_norm"], np.float32)  # [dv]
        return ly

    def alloc_kv(self) -> None:
        a = self.args
        Lf, Ll = len(a.full_layers), len(a.linear_layers)
        Hkv, S = a.num_key_value_heads, a.head_dim
        self.kv_row = {i: r for r, i in enumerate(a.full_layers)}
        self.state_row = {i: r for r, i in enumerate(a.linear_layers)}
        dt = base.KV_DTYPES[self.kv_dtype]
        self.k_cache = base.kv_zeros((Lf, Hkv, self.C, S), dt)  # [Lf, Hkv, C, S]
        self.v_cache = base.kv_zeros((Lf, Hkv, self.C, S), dt)
        kc = a.linear_conv_kernel_dim - 1
        nv, dk, dv = a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
        self.conv_state = np.zeros((Ll, kc, a.conv_dim), np.float32)  # [Ll, Kc - 1, Cc]
        self.rec_state = np.zeros((Ll, nv, dk, dv), np.float32)  # [Ll, nv, dk, dv]
        self.conv_snap = np.zeros_like(self.conv_state)
        self.rec_snap = np.zeros_like(self.rec_state)
        self.state_pos, self.snap_pos = 0, -1
        self.rotary_dim = a.rotary_dim
        self.cos, self.sin = base.rope_tables(self.rotary_dim, a.rope_theta, self.C, a.rope_scaling)
        self.scale = np.float32(S ** -0.5)

    @property
    def kv_bytes(self) -> int:
        """KV cache of the full-attention layers plus the linear layers' live and snapshot state."""
        return sum(x.nbytes for x in (self.k_cache, self.v_cache, self.conv_state, self.rec_state,
                                      self.conv_snap, self.rec_snap))

    # --- the recurrent state and prefix reuse ------------------------------------------------

    def rewind(self, p: int) -> int:
        """Prepare to continue at a position s <= p whose state is known, and return s: the
        live state if it is at s, else the prefill snapshot, else 0 (zero state). The KV rows
        below p stay valid; the caller recomputes positions s..p-1 (the KV rows they rewrite
        come out as before, up to the float rounding of another chunking).

        Why a snapshot and not only recomputation: generate's reused prefix ends where the
        previous prompt and answer diverge from the new prompt, which for the next chat turn is
        the end of the previous run (the live state) and for "regenerate" the previous prompt
        but its last token (the snapshot); anywhere else the snapshot (or 0) is the nearest
        earlier state, and at most the previous answer is recomputed. One snapshot costs one
        more state (counted in the budget); states at more positions would cost one each.
        """
        self._hist = None  # a verify whose accept never came (its generation failed) is dropped
        if not self.state_row:  # no linear layer: the KV cache alone, positional
            return p
        s = max((x for x in (self.state_pos, self.snap_pos) if 0 <= x <= p), default=0)
        self._state_at(s)
        return s

    def _state_at(self, pos0: int) -> None:
        """Make the live state the state at ``pos0`` (live, snapshot or zero).

        Raises:
            ValueError: no state at ``pos0`` is known (call :meth:`rewind` first)."""
        if pos0 == self.state_pos or not self.state_row:
            self.state_pos = pos0
            return
        if pos0 == self.snap_pos:
            self.conv_state[:] = self.conv_snap
            self.rec_state[:] = self.rec_snap
        elif pos0 == 0:
            self.conv_state.fill(0)
            self.rec_state.fill(0)
        else:
            raise ValueError(f"{DISPLAY_NAME}: the linear-attention state is at position {self.state_pos}, not "
                             f"{pos0}; call rewind({pos0}) and continue from the position it returns")
        self.state_pos = pos0

    def _snapshot(self, pos: int) -> None:
        self.conv_snap[:] = self.conv_state
        self.rec_snap[:] = self.rec_state
        self.snap_pos = pos

    def verify(self, ids: np.ndarray, pos0: int, cancel: threading.Event | None = None) -> np.ndarray:
        """As MoEModel.verify: the stateful layers step token by token (the one-token
        recurrence, bit-identical to decoding; the chunked rule of a prefill rounds otherwise)
        and keep their state after each token, for :meth:`accept`; no prefill snapshot is
        taken (the draft's tokens may be rejected). Holds T copies of the state meanwhile."""
        T = len(ids)
        self._hist = (np.empty((T, *self.conv_state.shape), np.float32),
                      np.empty((T, *self.rec_state.shape), np.float32), pos0)
        try:
            return super().verify(ids, pos0, cancel)
        except BaseException:
            self._hist = None
            raise

    def accept(self, n: int) -> None:
        """The state after the first ``n`` positions of the last :meth:`verify` becomes the live one."""
        hist, self._hist = self._hist, None
        if hist is None or not self.state_row:
            return
        conv, rec, pos0 = hist
        if pos0 + n != self.state_pos:
            self.conv_state[:] = conv[n - 1]
            self.rec_state[:] = rec[n - 1]
            self.state_pos = pos0 + n

    def _stateful(self, i: int, x: np.ndarray, pos0: int, mixer) -> np.ndarray:
        """``mixer(i, x)`` of stateful layer i on x [T, D] at positions pos0.. (its state carried
        across calls); during :meth:`verify` one token at a time, recording the state after each."""
        hist = self._hist
        if hist is None:
            return mixer(i, x)
        r = self.state_row[i]
        out = np.empty_like(x)
        for t in range(x.shape[0]):
            out[t:t + 1] = mixer(i, x[t:t + 1])
            hist[0][pos0 - hist[2] + t, r] = self.conv_state[r]
            hist[1][pos0 - hist[2] + t, r] = self.rec_state[r]
        return out

    def forward(self, ids: np.ndarray, pos0: int, all_logits: bool = False,
                cancel: threading.Event | None = None) -> np.ndarray:
        """As MoEModel.forward, from the linear layers' state at ``pos0`` (live, snapshot or
        zero at 0; else ValueError), leaving it at pos0 + T. A prefill (T > 1) runs its last
        token as a chunk of its own and snapshots the state before it.

        Raises:
            Cancelled: ``cancel`` was set (the live state is then unknown until rewound).
            ValueError: no tokens, the positions are negative or exceed the context capacity, or no
                state at pos0.
        """
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        if T == 0:
            raise ValueError("forward needs at least one token")
        if pos0 < 0:  # numpy's slices would wrap (the KV row of a negative position is the cache's end)
            raise ValueError(f"position {pos0} is negative: positions start at 0")
        if pos0 + T > self.C:
            raise ValueError(f"positions {pos0}..{pos0 + T - 1} exceed the context of {self.C} tokens")
        self._state_at(pos0)
        self.state_pos = -1  # unknown until this forward completes
        if pos0 < self.snap_pos:
            self.snap_pos = -1  # the tokens it folded in are being rewritten
        self.observers.publish("on_forward_start", pos0, T)
        bounds = [(c0, min(c0 + PREFILL_CHUNK, T - 1)) for c0 in range(0, T - 1, PREFILL_CHUNK)] + [(T - 1, T)]
        outs, rows = [], []
        sink = self.hidden_sink
        for c0, c1 in bounds:
            if c0 == T - 1 and T > 1 and self._hist is None:
                self._snapshot(pos0 + T - 1)
            x = self._layers(ids[c0:c1], pos0 + c0, cancel)
            if sink is not None:
                rows.append(x)
            if all_logits:
                outs.append(self.logits(x))
        if sink is not None:  # once, as MoEModel.forward: a verify's first token alone is final
            sink(pos0, ids, rows[0] if len(rows) == 1 else np.concatenate(rows), 1 if all_logits else T)
        self.state_pos = pos0 + T
        if not all_logits:
            return self.logits(x[-1:])
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _layers(self, ids: np.ndarray, pos0: int, cancel) -> np.ndarray:
        """Every layer over tokens ``ids`` at pos0..: the final residual [t, D]."""
        x = self.embed(ids)  # [t, D]
        self._run_layers(x, pos0, 0, cancel)  # the base loop; this family's attention / mlp through it
        return x

    # --- token mixers ------------------------------------------------------------------------

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        """Layer i's token mixer on x [T, D] (positions pos0..): gated attention or Gated DeltaNet."""
        if i in self.kv_row:
            return self.full_attention(i, x, pos0)
        return self._stateful(i, x, pos0, self.linear_attention)

    def full_attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        """Gated GQA with per-head q/k norms and partial RoPE; writes KV row kv_row[i]."""
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, Hkv, S, R = a.num_attention_heads, a.num_key_value_heads, a.head_dim, self.rotary_dim
        h = np.empty_like(x)
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        qg, k, v = ly["qkv"](h, (np.empty((T, 2 * H * S), np.float32), np.empty((T, Hkv * S), np.float32),
                                 np.empty((T, Hkv * S), np.float32)))
        qg = qg.reshape(T, H, 2 * S)
        q = np.ascontiguousarray(qg[:, :, :S])  # [T, H, S]
        gate = qg[:, :, S:].reshape(T, H * S)
        q2, k2 = q.reshape(-1, S), k.reshape(-1, S)
        K.rmsnorm(q2, ly["q_norm"], a.rms_norm_eps, q2)
        K.rmsnorm(k2, ly["k_norm"], a.rms_norm_eps, k2)
        k3 = k.reshape(T, Hkv, S)
        cos, sin = self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T]
        for t3 in (q, k3):
            part = np.ascontiguousarray(t3[:, :, :R])
            K.rope(part, cos, sin)
            t3[:, :, :R] = part
        r = self.kv_row[i]
        self._kv_append(r, pos0, k3, v.reshape(T, Hkv, S))
        att = np.empty((T, H, S), np.float32)
        K.attention(q, self.k_cache[r], self.v_cache[r], pos0, self.scale, att)
        o = att.reshape(T, H * S) * _sigmoid(gate)
        return ly["o_proj"](np.ascontiguousarray(o, np.float32), np.empty_like(x))

    def linear_attention(self, i: int, x: np.ndarray) -> np.ndarray:
        """Gated DeltaNet on x [T, D], continuing layer i's conv and recurrent state."""
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        nk, nv = a.linear_num_key_heads, a.linear_num_value_heads
        dk, dv = a.linear_key_head_dim, a.linear_value_head_dim
        Kd, Vd = a.key_dim, a.value_dim
        h = np.empty_like(x)
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        qkv, z = ly["in_proj_qkvz"](h, (np.empty((T, a.conv_dim), np.float32),  # [T, Cc]
                                        np.empty((T, Vd), np.float32)))
        b, ga = ly["in_proj_ba"](h, (np.empty((T, nv), np.float32), np.empty((T, nv), np.float32)))
        r = self.state_row[i]
        w = ly["conv1d"]  # [Kc, Cc]
        kc = w.shape[0] - 1
        xe = np.concatenate([self.conv_state[r], qkv])  # [Kc - 1 + T, Cc]
        conv = xe[0:T] * w[0]
        for j in range(1, kc + 1):
            conv += xe[j:j + T] * w[j]
        if kc:
            self.conv_state[r] = xe[T:]
        conv = _silu(conv)
        rep = nv // nk
        q = _l2norm(conv[:, :Kd].reshape(T, nk, dk)) * np.float32(dk ** -0.5)
        k = _l2norm(conv[:, Kd:2 * Kd].reshape(T, nk, dk))
        v = conv[:, 2 * Kd:].reshape(T, nv, dv)
        if rep > 1:
            q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
        beta = _sigmoid(b)  # [T, nv]
        g = ly["neg_A"] * np.logaddexp(np.float32(0.0), ga + ly["dt_bias"]).astype(np.float32)  # [T, nv]
        o = np.empty((nv, T, dv), np.float32)  # [nv, T, dv]
        K.gated_delta(*(np.ascontiguousarray(t.transpose(1, 0, 2), np.float32) for t in (q, k, v)),
                      np.ascontiguousarray(g.T, np.float32), np.ascontiguousarray(beta.T, np.float32),
                      self.rec_state[self.state_row[i]], CHUNK, o)
        o = o.transpose(1, 0, 2)  # [T, nv, dv]
        o = o / np.sqrt((o * o).mean(-1, keepdims=True) + np.float32(a.rms_norm_eps))
        o = o * ly["linear_norm"] * _silu(z.reshape(T, nv, dv))
        return ly["out_proj"](np.ascontiguousarray(o.reshape(T, Vd), np.float32), np.empty_like(x))
