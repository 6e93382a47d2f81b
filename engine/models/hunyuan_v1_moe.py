"""Hunyuan-A13B (``model_type: hunyuan_v1_moe``; tencent/Hunyuan-A13B-Instruct).

Follows transformers' models/hunyuan_v1_moe/modeling_hunyuan_v1_moe.py. What differs from the
shared decoder:

- The per-head RMSNorms of q and k (``query_layernorm`` / ``key_layernorm``) come after RoPE,
  not before it (a rotation keeps a head's RMS but not which values the norm's weights scale).
- RoPE with NTK-alpha scaling: config.json's ``rope_parameters`` (or ``rope_scaling``) of type
  "dynamic" with an ``alpha`` stretches the base to theta x alpha^(S / (S - 2)) once, whatever
  the length (transformers' ``ntk_alpha``); "dynamic" without alpha is refused.
- Every layer is a MoE layer: softmax top-K renormalised, experts of width
  ``intermediate_size``, and beside them an ungated shared MLP (``mlp.shared_mlp``) of the same
  width for every token. ``moe_topk`` is the K (an int, or one value per layer, all equal).

Not the one-call decode step (K.decode_layers_t1): its attention norms q and k before RoPE and
it runs no shared MLP.

Checkpoint names: model.layers.N.self_attn.{q,k,v,o}_proj, query_layernorm / key_layernorm
[head_dim]; model.layers.N.mlp.gate.wg.weight [E, D]; model.layers.N.mlp.experts.E.*;
model.layers.N.mlp.shared_mlp.{gate,up,down}_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..kernel_choice import K
from . import base

MODEL_TYPE = "hunyuan_v1_moe"
DISPLAY_NAME = "Hunyuan-MoE"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """Hunyuan-A13B config.json (HunYuanMoEV1Config names)."""

    rope_alpha: float = 0.0

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        cfg = dict(cfg)
        topk = cfg.get("moe_topk")
        if isinstance(topk, list):
            if not topk or len(set(map(repr, topk))) != 1:
                raise ConfigError(f"{path}: key 'moe_topk' must be one number, or the same number for every "
                                  f"layer, got {topk!r}")
            topk = topk[0]
        cfg["num_experts_per_tok"] = topk
        if isinstance(cfg.get("num_experts"), list):
            raise ConfigError(f"{path}: key 'num_experts' must be one number (per-layer expert counts are not "
                              f"supported)")
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="intermediate_size",
                             experts_keys=("num_experts", "num_local_experts"), eps_default=1e-5,
                             rope_types=("default", "dynamic"))
        if base.flag(cfg, "attention_bias", path, False):
            raise ConfigError(f"{path}: attention_bias=true is not supported for {DISPLAY_NAME}")
        alpha = 0.0
        if base.rope_type(cfg, path) == "dynamic":
            rope, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}
            src = {**scaling, **rope}
            if src.get("alpha") is None:
                raise ConfigError(f"{path}: rope_type 'dynamic' without 'alpha' (dynamic NTK scaling) is not "
                                  f"supported; remove rope_scaling from config.json to run at the native length")
            alpha = base.num(src, "alpha", path + " rope_parameters", 1.0, 1e12, integer=False)
            S = v["head_dim"]
            v["rope_theta"] = v["rope_theta"] * alpha ** (S / (S - 2))
        L = v["num_hidden_layers"]
        return cls(**v, norm_topk_prob=True, qk_norm="head", moe_layers=tuple(range(L)), layer_windows=(0,) * L,
                   shared_expert_intermediate_size=v["intermediate_size"], shared_expert_gated=False,
                   rope_alpha=alpha)


_RENAMES = (("self_attn.q_norm.", "self_attn.query_layernorm."), ("self_attn.k_norm.", "self_attn.key_layernorm."),
            ("mlp.gate.weight", "mlp.gate.wg.weight"))


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    out = []
    for t in base.decoder_tensors(args, "mlp", shared="mlp.shared_mlp."):
        for a, b in _RENAMES:
            t = t._replace(hf=t.hf.replace(a, b))
        out.append(t)
    return out


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.mlp.experts.", fused_prefixes=(f"model.layers.{i}.mlp.experts.",))


class Model(base.MoEModel):
    """The Hunyuan-MoE forward: q/k norms after RoPE (NTK-alpha base), softmax top-K experts
    plus the shared MLP."""

    def attention(self, i: int, x: np.ndarray, pos0: int) -> np.ndarray:
        """Grouped-query causal attention of layer i on x float32 [T, D] at positions pos0..:
        project, RoPE, then the per-head RMSNorms of q and k; K and V into the cache."""
        a, ly = self.args, self.layers[i]
        T = x.shape[0]
        H, Hkv, S = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        h = np.empty_like(x)
        K.rmsnorm(x, ly["input_layernorm"], a.rms_norm_eps, h)
        q, k, v = ly["qkv"](h, (np.empty((T, H * S), np.float32), np.empty((T, Hkv * S), np.float32),
                                np.empty((T, Hkv * S), np.float32)))
        q3, k3 = q.reshape(T, H, S), k.reshape(T, Hkv, S)
        cos, sin = self.cos[pos0:pos0 + T], self.sin[pos0:pos0 + T]
        K.rope(q3, cos, sin)
        K.rope(k3, cos, sin)
        q2, k2 = q.reshape(-1, S), k.reshape(-1, S)
        K.rmsnorm(q2, ly["q_norm"], a.rms_norm_eps, q2)
        K.rmsnorm(k2, ly["k_norm"], a.rms_norm_eps, k2)
        self._kv_append(i, pos0, k3, v.reshape(T, Hkv, S))
        att = np.empty((T, H, S), np.float32)
        self._attend(q3, self.k_cache[i], self.v_cache[i], pos0, None, att)
        return ly["o_proj"](att.reshape(T, H * S), np.empty_like(x))
