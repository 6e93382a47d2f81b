"""DeepSeek-V2 and V2-Lite (``model_type: deepseek_v2``).

Follows transformers' models/deepseek_v2/modeling_deepseek_v2.py: multi-head latent attention
with the latent KV cache as DeepSeek-V3 (engine/models/mla.py; V2 rotates interleaved pairs,
which our de-interleaved rotation matches), a softmax router with ``topk_method`` "greedy"
(the K best probabilities) or "group_limited_greedy" (``n_group`` groups scored by their best
probability, ``topk_group`` kept, the rest 0), weights times ``routed_scaling_factor``
(renormalised only when ``norm_topk_prob``, false in the published checkpoints; transformers
never renormalises); ``n_shared_experts`` ungated shared experts; the first
``first_k_dense_replace`` layers dense.

Checkpoint names as DeepSeek-V3, without ``e_score_correction_bias``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import deepseek_v3, mla

MODEL_TYPE = "deepseek_v2"
DISPLAY_NAME = "DeepSeek-V2"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(deepseek_v3.ModelArgs):
    """DeepSeek-V2 config.json (DeepseekV2Config names)."""

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        return cls(**deepseek_v3.deepseek_fields(cfg, path, DISPLAY_NAME, v3=False))


dense_tensors = deepseek_v3.dense_tensors
expert_names = deepseek_v3.expert_names
split_shapes = deepseek_v3.split_shapes
split_tensor = deepseek_v3.split_tensor


class Model(mla.MLAModel):
    """The DeepSeek-V2 forward: MLA, softmax (group-limited) routing, ungated shared experts."""
