"""Qwen3.5 MoE, the text model (``model_type: qwen3_5_moe_text``; Qwen3.5-35B-A3B,
Qwen3.5-397B-A17B's language model).

Follows transformers' models/qwen3_5_moe/modeling_qwen3_5_moe.py (Qwen3_5MoeForCausalLM over
Qwen3_5MoeTextConfig): the Qwen3-Next decoder (engine/models/qwen3_next.py: Gated DeltaNet and
gated full-attention layers, zero-centred RMSNorms, routed experts plus the sigmoid-gated
shared expert) with three differences: the linear layers' projections are separate
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, the layout our stores use for
both families), every layer is an MoE layer (the config has no ``mlp_only_layers`` /
``decoder_sparse_step``; transformers ignores them) and the router always renormalises its
top-K weights (no ``norm_topk_prob``). The multimodal RoPE (``mrope_section``) gives a text-only
sequence the same angle in all three sections, i.e. the plain partial RoPE used here.

Checkpoint names: as Qwen3-Next, with model.layers.N.linear_attn.{in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a}.weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import base, qwen3_next

MODEL_TYPE = "qwen3_5_moe_text"
DISPLAY_NAME = "Qwen3.5-MoE (text)"
DEFAULTED_KEYS = qwen3_next.DEFAULTED_KEYS  # absent keys take transformers' defaults, named on a mismatch
MTP_HEAD = qwen3_next.MTP_HEAD  # Qwen3-Next's mtp.* layout (engine/mtp.py)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(qwen3_next.ModelArgs):
    """Qwen3.5 MoE text config.json (Qwen3_5MoeTextConfig names)."""

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = qwen3_next.hybrid_fields(cfg, path, DISPLAY_NAME)
        return cls(**v, norm_topk_prob=True, moe_layers=tuple(range(v["num_hidden_layers"])),
                   num_nextn_predict_layers=base.num(cfg, MTP_HEAD.count_key, path, 0, 64, integer=True, default=0))


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return base.decoder_tensors(args, "mlp", attention=lambda a, i: qwen3_next.mixer_tensors(a, i, False))


expert_names = qwen3_next.expert_names


class Model(qwen3_next.Model):
    """The Qwen3.5 MoE text forward (the Qwen3-Next one over separate projections)."""
