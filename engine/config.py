"""Model arguments read from a Hugging Face config.json (and, re-exported, the runtime settings).

ModelArgs (engine/models/base.py) follows mlx-lm's ``ModelArgs.from_dict``: the Hugging Face
key names are kept (num_experts, num_experts_per_tok, norm_topk_prob, ...);
``ModelArgs.from_dict`` / ``from_hf_config`` dispatch to the family of config.json's
``model_type`` (engine/models/). The runtime settings (EngineConfig) are declared once, in the
settings table (engine/settings.py).
"""

from __future__ import annotations

from .models import FAMILY_NAMES
from .models import SUPPORTED_MODEL_TYPES as _SUPPORTED
from .models import supported_text
from .models.base import ModelArgs
from .settings import CHECKSUM_MODES, POLICIES, EngineConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArgs", "EngineConfig", "POLICIES", "CHECKSUM_MODES",
           "family_name", "describe_model", "supported_families"]

SUPPORTED_MODEL_TYPES = _SUPPORTED  # config.json model_type values with a family file


def supported_families() -> str:
    """One line naming every supported family, e.g. "olmoe (OLMoE), qwen3_moe (Qwen3-MoE), ..."."""
    return supported_text()


def family_name(model_type: str) -> str:
    """The display name of a family ("Qwen3-MoE" for "qwen3_moe"); unknown types as given."""
    return FAMILY_NAMES.get(model_type, str(model_type))


def describe_model(args: ModelArgs) -> str:
    """One line on the architecture of ``args`` for the wizard, the hub check, the model
    library and ``colibri info``: family, transformer layers (how many with routed experts,
    how many dense), experts per MoE layer and top-k, the expert width and the shared expert.

    Example: "Qwen3-MoE (qwen3_moe): 48 layers (48 MoE), 128 experts, top-8, expert width 768".
    """
    L, M = args.num_hidden_layers, args.num_moe_layers - args.mtp_layers  # a kept MTP head's row is not a layer
    layers = f"{L} layers ({M} MoE" + (f", {L - M} dense" if L > M else "") + ")"
    if args.mtp_layers:
        layers += " + an MTP head"
    shared = (f", shared expert width {args.shared_expert_intermediate_size}"
              if args.shared_expert_intermediate_size else "")
    if getattr(args, "kv_lora_rank", 0):
        shared += f", latent attention (KV rank {args.kv_lora_rank} + {args.qk_rope_head_dim})"
    if getattr(args, "hc_mult", 0):  # DeepSeek-V4: the indexer picks compressed entries, not tokens
        shared += (f", {args.hc_mult} residual streams, compressed sparse attention (top {args.index_topk} "
                   f"compressed entries per query)")
    elif getattr(args, "index_topk", 0):
        shared += f", sparse attention (top {args.index_topk} tokens per query)"
    return (f"{family_name(args.model_type)} ({args.model_type}): {layers}, {args.num_experts} experts, "
            f"top-{args.num_experts_per_tok}, expert width {args.moe_intermediate_size}{shared}, "
            f"hidden {args.hidden_size}")
