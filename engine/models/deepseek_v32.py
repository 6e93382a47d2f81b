"""DeepSeek-V3.2 (``model_type: deepseek_v32``): DeepSeek-V3 with DeepSeek sparse attention.

Follows transformers' models/deepseek_v32/modeling_deepseek_v32.py: DeepSeek-V3's MLA (q LoRA
required, interleaved RoPE, YaRN), router, shared experts and dense first layers
(``first_k_dense_replace``, default 3, or ``mlp_layer_types``), plus on every layer the
sparse-attention indexer (``index_n_heads``, ``index_head_dim``, ``index_topk``; rotate-half
RoPE on its first qk_rope_head_dim values) that picks the past tokens each query attends
(engine/models/dsa.py, with the indexer-key cache). The first MTP layer
(``num_nextn_predict_layers``: a full decoder layer with its own indexer after the decoder, as
DeepSeek-V3's) is kept as a speculative drafter (engine/mtp.py), the others are skipped.

Checkpoint names: DeepSeek-V3's plus model.layers.N.self_attn.indexer.{wq_b, wk, weights_proj}.weight
and .indexer.k_norm.{weight, bias}.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import base, deepseek_v3, dsa

MODEL_TYPE = "deepseek_v32"
DISPLAY_NAME = "DeepSeek-V3.2"
# DeepSeek-V3's next-n layout; the block runs its own indexer and index-key cache (engine/mtp.py)
MTP_HEAD = replace(base.DEEPSEEK_MTP_HEAD, block_indexer=True)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(dsa.DSAArgs):
    """DeepSeek-V3.2 config.json (DeepseekV32Config names)."""

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        return cls(**dsa.dsa_fields(cfg, path, DISPLAY_NAME, shared_layers=False))


dense_tensors = dsa.dense_tensors
expert_names = deepseek_v3.expert_names
split_shapes = deepseek_v3.split_shapes
split_tensor = deepseek_v3.split_tensor


class Model(dsa.DSAModel):
    """The DeepSeek-V3.2 forward: MLA with sparse attention, sigmoid group-limited routing."""
