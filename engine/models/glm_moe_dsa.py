"""GLM-5 (``model_type: glm_moe_dsa``): MLA with DeepSeek sparse attention and GLM routing.

Follows transformers' models/glm_moe_dsa/modeling_glm_moe_dsa.py: DeepSeek-V3.2's layer
(engine/models/dsa.py: MLA with q LoRA and interleaved RoPE, the sparse-attention indexer and
its key cache) with the indexer rotating interleaved pairs, and GLM-5's cross-layer sharing:
``indexer_types`` (or ``index_topk_pattern`` / ``index_topk_freq`` + ``index_skip_topk_offset``)
marks layers "shared" that have no indexer and reuse the previous layer's selection; the
sigmoid router with ``e_score_correction_bias``, ``n_group`` / ``topk_group``,
``routed_scaling_factor``; ``n_shared_experts`` shared experts; the first
``first_k_dense_replace`` layers dense (or ``mlp_layer_types``). The first MTP layer
(``num_nextn_predict_layers``: a full decoder layer with its own indexer after the decoder, as
DeepSeek-V3's) is kept as a speculative drafter (engine/mtp.py), the others are skipped.

Checkpoint names as DeepSeek-V3.2 (indexer tensors only on "full" layers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import base, deepseek_v3, dsa

MODEL_TYPE = "glm_moe_dsa"
DISPLAY_NAME = "GLM-5 (MoE, sparse attention)"
# DeepSeek-V3's next-n layout; the block runs its own indexer and index-key cache (engine/mtp.py)
MTP_HEAD = replace(base.DEEPSEEK_MTP_HEAD, block_indexer=True)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(dsa.DSAArgs):
    """GLM-MoE-DSA config.json (GlmMoeDsaConfig names)."""

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        return cls(**dsa.dsa_fields(cfg, path, DISPLAY_NAME, shared_layers=True))


dense_tensors = dsa.dense_tensors
expert_names = deepseek_v3.expert_names
split_shapes = deepseek_v3.split_shapes
split_tensor = deepseek_v3.split_tensor


class Model(dsa.DSAModel):
    """The GLM-5 forward: MLA with sparse attention (shared layers), sigmoid grouped routing."""
