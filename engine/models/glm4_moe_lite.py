"""GLM-4.7-Flash class models (``model_type: glm4_moe_lite``): DeepSeek-V3's multi-head latent
attention with GLM-4.5's MoE.

Follows transformers' models/glm4_moe_lite/modeling_glm4_moe_lite.py: the attention is
DeepseekV3Attention (q LoRA or plain q_proj, ``kv_a_proj_with_mqa`` + ``kv_a_layernorm`` +
``kv_b_proj``, ``rope_interleave``; engine/models/mla.py with the latent KV cache), the router
Glm4MoeTopkRouter (sigmoid, ``e_score_correction_bias`` for the choice, ``n_group`` /
``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``: the same rule as DeepSeek-V3's),
``n_shared_experts`` ungated shared experts, and ``mlp_layer_types`` (default: layer 0 dense,
the rest MoE). The rotary embedding rotates all qk_rope_head_dim values (a
``partial_rotary_factor`` below 1 is refused: transformers' attention cannot run it either).

Checkpoint names as DeepSeek-V3.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import deepseek_v3, mla

MODEL_TYPE = "glm4_moe_lite"
DISPLAY_NAME = "GLM-4.7-Flash (MoE, latent attention)"
MTP_HEAD = deepseek_v3.MTP_HEAD  # its next-n layer, published as DeepSeek-V3's (engine/mtp.py)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(deepseek_v3.ModelArgs):
    """Glm4MoeLiteConfig names (DeepSeek-V3's, plus ``mlp_layer_types``)."""

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        prf = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if prf not in (None, 1, 1.0):
            raise ConfigError(f"{path}: partial_rotary_factor {prf!r} is not supported for {DISPLAY_NAME} "
                              f"(its latent attention rotates all qk_rope_head_dim values)")
        return cls(**deepseek_v3.layer_typed_fields(cfg, path, DISPLAY_NAME, first_k_dense_default=1))


dense_tensors = deepseek_v3.dense_tensors
expert_names = deepseek_v3.expert_names
split_shapes = deepseek_v3.split_shapes
split_tensor = deepseek_v3.split_tensor


class Model(mla.MLAModel):
    """The GLM-4.7-Flash forward: MLA (latent KV cache), sigmoid grouped routing, shared experts."""
