"""GLM-4.5 / 4.6 and GLM-4.5-Air (``model_type: glm4_moe``).

Follows transformers' models/glm4_moe/modeling_glm4_moe.py: grouped-query attention with q/k/v
biases (``attention_bias``; o_proj has none), an optional per-head RMSNorm on q and k
(``use_qk_norm``), partial rotary embeddings (the first ``partial_rotary_factor`` x head_dim
values of each head, rotate-half); the DeepSeek-V3 router (sigmoid scores,
``e_score_correction_bias`` for the choice only, ``n_group`` / ``topk_group``, renormalised
when ``norm_topk_prob``, times ``routed_scaling_factor``); ``n_shared_experts`` ungated shared
experts of width ``moe_intermediate_size`` each; the first ``first_k_dense_replace`` layers
dense (width ``intermediate_size``). The first MTP layer (``num_nextn_predict_layers``) is kept
as a speculative drafter (engine/mtp.py), the others are skipped.

Checkpoint names: model.layers.N.self_attn.{q,k,v,o}_proj (+ .bias on q/k/v), q_norm / k_norm
[head_dim]; model.layers.N.mlp.gate.weight and .e_score_correction_bias;
model.layers.N.mlp.experts.E.*; model.layers.N.mlp.shared_experts.*.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import base

MODEL_TYPE = "glm4_moe"
DISPLAY_NAME = "GLM-4.5 (MoE)"
MTP_HEAD = base.DEEPSEEK_MTP_HEAD  # the next-n layers' checkpoint layout (engine/mtp.py)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """GLM-4-MoE config.json (Glm4MoeConfig names)."""

    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="moe_intermediate_size",
                             experts_keys=("n_routed_experts", "num_local_experts"), eps_default=1e-5,
                             rope_types=("default", "yarn"))
        L, E, S = v["num_hidden_layers"], v["num_experts"], v["head_dim"]
        k = base.num(cfg, "first_k_dense_replace", path, 0, L, integer=True, default=1)
        if k:
            v["intermediate_size"] = base.num(cfg, "intermediate_size", path, 1, 1 << 24, integer=True,
                                              family=DISPLAY_NAME)
        rope = cfg.get("rope_parameters") or {}
        prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
        if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
            raise ConfigError(f"{path}: partial_rotary_factor {prf!r} must be a number in (0, 1]")
        rd = int(S * prf)
        if rd < 2 or rd % 2:
            raise ConfigError(f"{path}: partial_rotary_factor {prf} x head_dim {S} = {rd} rotary values must be even")
        n_group, topk_group = base.expert_groups(cfg, path, E, v["num_experts_per_tok"], topk_group_default=1)
        n_shared = base.num(cfg, "n_shared_experts", path, 0, 1 << 10, integer=True, default=1)
        return cls(**v, norm_topk_prob=base.flag(cfg, "norm_topk_prob", path, True),
                   qk_norm="head" if base.flag(cfg, "use_qk_norm", path, False) else "none",
                   attention_bias=base.flag(cfg, "attention_bias", path, False), rotary_dim=rd,
                   rope_scaling=base.yarn_params(cfg, path, v["max_position_embeddings"]),
                   moe_layers=tuple(range(k, L)), layer_windows=(0,) * L, first_k_dense_replace=k,
                   n_shared_experts=n_shared, shared_expert_intermediate_size=n_shared * v["moe_intermediate_size"],
                   shared_expert_gated=False, scoring_func="sigmoid", topk_method="noaux_tc", n_group=n_group,
                   topk_group=topk_group, router_bias=True,
                   routed_scaling_factor=base.num(cfg, "routed_scaling_factor", path, 1e-6, 1e6, integer=False,
                                                  default=1.0),
                   num_nextn_predict_layers=base.num(cfg, "num_nextn_predict_layers", path, 0, 64, integer=True,
                                                     default=0))


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return base.decoder_tensors(args, "mlp", shared="mlp.shared_experts.")


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.mlp.experts.", fused_prefixes=(f"model.layers.{i}.mlp.experts.",))


class Model(base.MoEModel):
    """The GLM-4-MoE forward: GQA with biases, partial RoPE, sigmoid group-limited routing."""
