"""Kimi-Linear (``model_type: kimi_linear``; moonshotai/Kimi-Linear-48B-A3B).

Follows transformers' models/kimi_linear/modeling_kimi_linear.py (the arithmetic; its torch
``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention`` are the CPU oracle of the
tests). A hybrid of Kimi Delta Attention (KDA) linear-attention layers and multi-head latent
attention layers, over DeepSeek-V3's MoE (sigmoid router with the correction bias, expert
groups, one ungated shared expert, the first layers dense). Key as base.py, plus H linear
heads of width d (``linear_num_heads`` / ``linear_head_dim``), Kd = H d, Kc =
``linear_conv_kernel_dim``.

``layer_types[i]`` is "linear_attention" or "full_attention" (the published config.json gives
1-based ``linear_attn_config.full_attn_layers`` / ``kda_layers`` instead); ``mlp_layer_types``
"dense" / "sparse" (or ``first_k_dense_replace``, default 1).

MLA layers: mla.py's latent attention and latent KV cache, without RoPE (the checkpoint's
``mla_use_nope``): the qk_rope_head_dim part of q and of the shared key enters the score as
it is; scale (qk_nope + qk_rope)^-1/2. Only these layers have a KV cache.

KDA layers (Kimi Team 2025, "Kimi Linear", arXiv 2510.26692): the gated delta rule of
Qwen3-Next (engine/models/qwen3_next.py) with a decay per key channel instead of per head:

    q, k, v = silu(causal depthwise conv over the last Kc inputs of q_proj(h), k_proj(h), v_proj(h))
    q, k = l2norm per head (eps 1e-6), q *= d^-1/2
    g = -exp(A_log_h) * softplus(f_b_proj(f_a_proj(h)) + dt_bias)            [H, d] per token
    beta = sigmoid(b_proj(h))                                                [H]
    per head: S <- diag(e^g) S;  S <- S + k (beta (v - k^T S))^T;  o = q^T S    (S [d, d])
    out = o_proj(rmsnorm(o) * o_norm.weight * sigmoid(g_b_proj(g_a_proj(h))))  per head over d

The per-channel decay does not fit the engine's per-head ``K.gated_delta`` kernel (its
pair weights e^(c_i - c_j) are one number; here they are a vector over the key channels), so
:func:`kimi_delta` runs the same chunked WY form in numpy, vectorised over the heads.

The recurrent state (per KDA layer: the conv's last Kc - 1 inputs [Kc - 1, 3 Kd] and S [H, d,
d], float32) is held, rewound and snapshotted by Qwen3-Next's machinery (its ``forward``,
``rewind``), so chat prefix reuse, regenerate and rewind stay exact.

Not the one-call decode step (K.decode_layers_t1): KDA layers are not attention, and the
router scores by sigmoids with groups and a bias.

Checkpoint names (as published and as transformers saves them):
model.layers.N.self_attn.{q,k,v}_proj, {q,k,v}_conv1d, f_a_proj, f_b_proj, dt_bias, A_log,
b_proj, g_a_proj, g_b_proj, o_norm, o_proj (KDA) or the MLA names of mla.py;
model.layers.N.block_sparse_moe.gate.{weight, e_score_correction_bias}, .experts.E.{w1,w3,w2},
.shared_experts.{gate,up,down}_proj; dense layers model.layers.N.mlp.{gate,up,down}_proj as
published (a config.json with linear_attn_config), block_sparse_moe.* as transformers saves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from . import base, deepseek_v3, mla, qwen3_next
from .base import K, Linear, LinearGroup, Tensor

MODEL_TYPE = "kimi_linear"
DISPLAY_NAME = "Kimi-Linear"
CHUNK = 64  # tokens per chunk of the chunked delta rule (transformers' default chunk_size)
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True, kw_only=True)
class ModelArgs(mla.MLAArgs):
    """Kimi-Linear config.json (KimiLinearConfig names, or the published checkpoint's)."""

    layer_types: tuple[str, ...] = ()
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    n_shared_experts: int = 0
    published_layout: bool = False  # config.json as published (linear_attn_config), not as transformers saves it

    use_rope = False  # the MLA layers are NoPE; KDA has no positions

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Transformer layers with latent attention: the only ones with a KV cache."""
        return base.layers_of_type(self.layer_types, "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Transformer layers with KDA linear attention (a recurrent state each)."""
        return base.layers_of_type(self.layer_types, "linear_attention")

    @property
    def key_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.key_dim

    @property
    def num_kv_layers(self) -> int:
        return len(self.full_layers)

    @property
    def state_bytes_per_layer(self) -> int:
        """float32 bytes of one KDA layer's state: conv inputs [Kc - 1, 3 Kd] + S [H, d, d]."""
        d = self.linear_head_dim
        return 4 * (self.conv_dim * (self.linear_conv_kernel_dim - 1) + self.linear_num_heads * d * d)

    @property
    def recurrent_state_bytes(self) -> int:
        """The KDA layers' live state and its prefix-reuse snapshot."""
        return 2 * len(self.linear_layers) * self.state_bytes_per_layer

    def dense_param_count(self) -> int:
        return base.tensor_params(self, dense_tensors(self))

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        cfg = dict(cfg)
        # KimiLinearConfig's attribute_map: transformers writes these names, the published
        # config.json too; the shared readers take DeepSeek-V3's
        for ours, theirs in (("n_routed_experts", "num_experts"), ("num_experts_per_tok", "num_experts_per_token"),
                             ("norm_topk_prob", "moe_renormalize"), ("n_group", "num_expert_group"),
                             ("n_shared_experts", "num_shared_experts"),
                             ("max_position_embeddings", "model_max_length")):
            if cfg.get(ours) is None and cfg.get(theirs) is not None:
                cfg[ours] = cfg[theirs]
        cfg.setdefault("n_shared_experts", 1)
        cfg.setdefault("n_group", 1)
        cfg.setdefault("topk_group", 1)
        cfg.setdefault("norm_topk_prob", True)
        cfg.setdefault("routed_scaling_factor", 2.446)
        cfg["topk_method"], cfg["scoring_func"] = "noaux_tc", "sigmoid"
        cfg.pop("rope_scaling", None)  # no RoPE: nothing to scale
        cfg.pop("rope_parameters", None)
        cfg["rope_interleave"] = False
        L = base.num(cfg, "num_hidden_layers", path, 1, 4096, integer=True, family=DISPLAY_NAME)
        lin = cfg.get("linear_attn_config") or {}
        if not isinstance(lin, dict):
            raise ConfigError(f"{path}: key 'linear_attn_config' must be an object, got {lin!r}")
        for ours, theirs in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                             ("linear_conv_kernel_dim", "short_conv_kernel_size")):
            if theirs in lin:
                cfg[ours] = lin[theirs]
        types = cfg.get("layer_types")
        if types is None and "full_attn_layers" in lin and "kda_layers" in lin:
            types = [None] * L
            for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
                for n in lin[key]:
                    if not isinstance(n, int) or not 1 <= n <= L:
                        raise ConfigError(f"{path}: linear_attn_config.{key} lists {n!r}; layers are numbered "
                                          f"1..{L}")
                    types[n - 1] = kind
        elif types is None:  # transformers' default: every 4th layer (from 4) full
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
        if not isinstance(types, list) or len(types) != L or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"{path}: key 'layer_types' must list 'linear_attention' or 'full_attention' for "
                              f"each of the {L} layers, got {types!r}")
        cfg.setdefault("first_k_dense_replace", 1)
        v = deepseek_v3.layer_typed_fields(cfg, path, DISPLAY_NAME, 1)
        v.pop("first_k_dense_replace")
        v.pop("num_nextn_predict_layers")

        def n(key, hi, default):
            return base.num(cfg, key, path, 1, hi, integer=True, family=DISPLAY_NAME, default=default)

        return cls(**v, layer_types=tuple(types), published_layout="linear_attn_config" in cfg,
                   linear_num_heads=n("linear_num_heads", 1 << 12, 32),
                   linear_head_dim=n("linear_head_dim", 1 << 16, 128),
                   linear_conv_kernel_dim=n("linear_conv_kernel_dim", 64, 4))


# --- checkpoint names -------------------------------------------------------------------------

def mixer_tensors(args: ModelArgs, i: int) -> list[Tensor]:
    """Norms and the token mixer of layer i: mla.attention_tensors, or the KDA projections
    ([Kd, D] each, the gates' low-rank pairs f_a / f_b and g_a / g_b), the three conv1d
    [Kd, 1, Kc], dt_bias [Kd], A_log [1, 1, H, 1], o_norm [d] (float32)."""
    if args.layer_types[i] == "full_attention":
        return mla.attention_tensors(args, i)
    D, H, d, Kd = args.hidden_size, args.linear_num_heads, args.linear_head_dim, args.key_dim
    hp, cp = f"model.layers.{i}.", f"layers.{i}."
    a = hp + "self_attn."
    out = [Tensor(hp + "input_layernorm.weight", cp + "input_layernorm", (D,), "keep"),
           Tensor(hp + "post_attention_layernorm.weight", cp + "post_attention_layernorm", (D,), "keep")]
    for p, shape in (("q_proj", (Kd, D)), ("k_proj", (Kd, D)), ("v_proj", (Kd, D)), ("f_a_proj", (d, D)),
                     ("f_b_proj", (Kd, d)), ("b_proj", (H, D)), ("g_a_proj", (d, D)), ("g_b_proj", (Kd, d)),
                     ("o_proj", (D, Kd))):
        out.append(Tensor(f"{a}{p}.weight", cp + p, shape, "quant"))
    for p in ("q_conv1d", "k_conv1d", "v_conv1d"):
        out.append(Tensor(f"{a}{p}.weight", cp + p, (Kd, 1, args.linear_conv_kernel_dim), "keep"))
    return out + [Tensor(a + "dt_bias", cp + "dt_bias", (Kd,), "keep"),
                  Tensor(a + "A_log", cp + "A_log", (1, 1, H, 1), "keep"),
                  Tensor(a + "o_norm.weight", cp + "o_norm", (d,), "keep")]


def dense_tensors(args: ModelArgs) -> list[Tensor]:
    out = base.decoder_tensors(args, "block_sparse_moe", shared="block_sparse_moe.shared_experts.",
                               attention=mixer_tensors)
    if args.published_layout:  # the published checkpoint keeps its dense layers' MLP under mlp
        return out
    # transformers saves them under block_sparse_moe (its load-time rename of it to mlp, reversed)
    return [t._replace(hf=t.hf.replace(".mlp.", ".block_sparse_moe.")) if ".mlp." in t.hf else t for t in out]


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.block_sparse_moe.experts.",
                            hf_proj={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                            fused_prefixes=(f"model.layers.{i}.mlp.experts.",))


split_shapes = mla.split_shapes


def split_tensor(args, t: Tensor, w):
    return mla.split_kv_b(args, t, w)


# --- arithmetic -------------------------------------------------------------------------------

def kimi_delta(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, S: np.ndarray,
               chunk: int = CHUNK) -> np.ndarray:
    """The delta rule with a per-channel decay over T tokens, H heads.

    q, k float32 [H, T, dk] (l2-normed; q scaled), v [H, T, dv], g [H, T, dk] (log decays,
    <= 0), beta [H, T]; S float32 [H, dk, dv] the state before the first token, updated in
    place. Returns out float32 [H, T, dv]: T steps of S <- diag(e^g) S; S <- S + k (beta (v -
    k^T S))^T; o = q^T S (T = 1 is that step).

    Per chunk of n tokens from S0, c = cumsum(g) per channel, D_ij = e^(c_i - c_j) (a vector
    over dk, j <= i, never above 1): the pseudo-values P_i = beta_i (v_i - (k_i e^(c_i))^T S0
    - sum_(j<i) (k_i D_ij . k_j) P_j) by forward substitution, o_i = (q_i e^(c_i))^T S0 +
    sum_(j<=i) (q_i D_ij . k_j) P_j, S = e^(c_n) S0 + sum_j (k_j e^(c_n - c_j)) P_j^T: the WY
    form of transformers' chunk_kimi_delta_attention, O(T n dk) per head for the pair weights.
    """
    H, T, dk = q.shape
    dv = v.shape[2]
    out = np.empty((H, T, dv), np.float32)
    for c0 in range(0, T, chunk):
        n = min(chunk, T - c0)
        qc, kc, vc, bc = q[:, c0:c0 + n], k[:, c0:c0 + n], v[:, c0:c0 + n], beta[:, c0:c0 + n]
        c = np.cumsum(g[:, c0:c0 + n], axis=1, dtype=np.float32)  # [H, n, dk]
        ec = np.exp(c)
        ks0 = np.matmul(kc * ec, S)  # [H, n, dv]: (k_i e^c_i)^T S0
        qs0 = np.matmul(qc * ec, S)
        P = np.empty((H, n, dv), np.float32)
        for i in range(n):
            Dq = np.exp(c[:, i:i + 1] - c[:, :i + 1])  # [H, i + 1, dk]
            kk = np.einsum("he,hje->hj", kc[:, i], kc[:, :i + 1] * Dq)  # [H, i + 1]
            r = vc[:, i] - ks0[:, i] - np.einsum("hj,hjd->hd", kk[:, :i], P[:, :i])
            P[:, i] = bc[:, i, None] * r
            qk = np.einsum("he,hje->hj", qc[:, i], kc[:, :i + 1] * Dq)
            out[:, c0 + i] = qs0[:, i] + np.einsum("hj,hjd->hd", qk, P[:, :i + 1])
        last = c[:, n - 1:n]  # [H, 1, dk]
        S *= np.exp(last).transpose(0, 2, 1)  # rows e of S scale by e^(c_n, e)
        S += np.matmul((kc * np.exp(last - c)).transpose(0, 2, 1), P)
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


class Model(qwen3_next.Model, mla.MLAModel):
    """The Kimi-Linear forward: KDA and NoPE latent-attention layers (the KDA state held,
    rewound and snapshotted by Qwen3-Next's forward and rewind), then DeepSeek-V3's MoE.

    Attributes (beyond MoEModel's): kv_cache [Lf, 1, C, r + dr] for the Lf MLA layers;
    conv_state [Ll, Kc - 1, 3 Kd] and rec_state [Ll, H, d, d] float32 for the Ll KDA layers,
    with their snapshot, state_pos and snap_pos as in qwen3_next.Model."""

    rope = False

    def __init__(self, args, dense, *a, **kw):
        base.MoEModel.__init__(self, args, dense, *a, **kw)  # plain RMSNorm weights (not Qwen3-Next's w - 1)

    def latent_row(self, i: int) -> int:
        return self.kv_row[i]

    def attention_weights(self, dense: dict, p: str) -> dict:
        a, dq, gs = self.args, self.dense_quant, self.gs
        i = int(p.split(".")[1])
        if a.layer_types[i] == "full_attention":
            return mla.MLAModel.attention_weights(self, dense, p)
        ly = {n: Linear(dense, p + n, dq, gs) for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj",
                                                        "b_proj", "g_a_proj", "g_b_proj", "o_proj")}
        ly["in"] = LinearGroup([ly[n] for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_a_proj")])
        conv = np.concatenate([np.asarray(dense[p + n], np.float32) for n in ("q_conv1d", "k_conv1d", "v_conv1d")])
        ly["conv1d"] = np.ascontiguousarray(conv[:, 0, :].T)  # [Kc, 3 Kd]
        ly["neg_A"] = -np.exp(np.asarray(dense[p + "A_log"], np.float32).reshape(-1, 1))  # [H, 1]
        ly["dt_bias"] = np.asarray(dense[p + "dt_bias"], np.float32)
        ly["o_norm"] = np.asarray(dense[p + "o_norm"], np.float32)
        return ly

    def alloc_kv(self) -> None:
        a = self.args
        Lf, Ll = len(a.full_layers), len(a.linear_layers)
        self.kv_row = {i: r for r, i in enumerate(a.full_layers)}
        self.state_row = {i: r for r, i in enumerate(a.linear_layers)}
        self.kv_cache = base.kv_zeros((Lf, 1, self.C, a.kv_lora_rank + a.qk_rope_head_dim),
                                      base.KV_DTYPES[self.kv_dtype])  # [Lf, 1, C, r + dr]
        H, d = a.linear_num_heads, a.linear_head_dim
        self.conv_state = np.zeros((Ll, a.linear_conv_kernel_dim - 1, a.conv_dim), np.float32)
        self.rec_state = np.zeros((Ll, H, d, d), np.float32)
        self.conv_snap = np.zeros_like(self.conv_state)
        self.rec_snap = np.zeros_like(self.rec_state)
        self.state_pos, self.snap_pos = 0, -1
        self.rotary_dim = 0
        self.scale = np.float32(a.qk_head_dim ** -0.5)
        self.perm = None

    @property
    def kv_bytes(self) -> int:
        """The MLA layers' latent cache plus the KDA layers' live and snapshot state."""
        return sum(x.nbytes for x in (self.kv_cache, self.conv_state, self.rec_state, self.conv_snap,
                                      self.rec_snap))

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        if i in self.kv_row:
            return mla.MLAModel.attention(self, i, x, pos0)
        return self._stateful(i, x, pos0, self.kda)

    def kda(self, i: int, x: np.ndarray) -> np.ndarray:
        """Kimi Delta Attention on x [T, D], continuing layer i's conv and recurrent state."""
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, d, Kd = a.linear_num_heads, a.linear_head_dim, a.key_dim
        h = np.empty_like(x)
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        f32 = np.float32
        q, k, v, fa, b, ga = ly["in"](h, tuple(np.empty((T, n), f32) for n in (Kd, Kd, Kd, d, H, d)))
        r = self.state_row[i]
        w = ly["conv1d"]  # [Kc, 3 Kd]
        kc = w.shape[0] - 1
        xe = np.concatenate([self.conv_state[r], np.concatenate([q, k, v], axis=1)])  # [Kc - 1 + T, 3 Kd]
        conv = xe[0:T] * w[0]
        for j in range(1, kc + 1):
            conv += xe[j:j + T] * w[j]
        if kc:
            self.conv_state[r] = xe[T:]
        conv = _silu(conv)
        qh = conv[:, :Kd].reshape(T, H, d)
        kh = conv[:, Kd:2 * Kd].reshape(T, H, d)
        qh = qh / np.sqrt((qh * qh).sum(-1, keepdims=True) + f32(1e-6)) * f32(d ** -0.5)
        kh = kh / np.sqrt((kh * kh).sum(-1, keepdims=True) + f32(1e-6))
        vh = conv[:, 2 * Kd:].reshape(T, H, d)
        graw = ly["f_b_proj"](fa, np.empty((T, Kd), f32)) + ly["dt_bias"]
        sp = np.where(graw > 20.0, graw, np.log(f32(1.0) + np.exp(np.minimum(graw, f32(20.0)))))  # softplus
        g = ly["neg_A"] * sp.reshape(T, H, d)  # [T, H, d]
        beta = _sigmoid(b)  # [T, H]
        o = kimi_delta(*(np.ascontiguousarray(t.transpose(1, 0, 2), f32) for t in (qh, kh, vh, g)),
                       np.ascontiguousarray(beta.T, f32), self.rec_state[r])  # [H, T, d]
        o = o.transpose(1, 0, 2)  # [T, H, d]
        o = o / np.sqrt((o * o).mean(-1, keepdims=True) + f32(a.rms_norm_eps)) * ly["o_norm"]
        gate = ly["g_b_proj"](ga, np.empty((T, Kd), f32)).reshape(T, H, d)
        o = o * _sigmoid(gate)
        return ly["o_proj"](np.ascontiguousarray(o.reshape(T, Kd), f32), np.empty_like(x))
