"""OLMoE (allenai/OLMoE-1B-7B and the bundled default model).

Follows transformers' models/olmoe/modeling_olmoe.py: pre-norm blocks; q_norm / k_norm
RMSNorms over the whole projected q and k; optional clip_qkv; rotate-half RoPE; softmax router
over all E experts, top-K (lowest id wins ties), optional renormalisation (norm_topk_prob).
Every layer is a MoE layer.

Checkpoint names: model.layers.N.self_attn.{q,k,v,o}_proj / q_norm / k_norm,
model.layers.N.mlp.gate (router), model.layers.N.mlp.experts.E.{gate,up,down}_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import base

MODEL_TYPE = "olmoe"
DISPLAY_NAME = "OLMoE"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """OLMoE config.json: intermediate_size is the expert width; heads x head_dim == hidden."""

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="intermediate_size",
                             head_dim_must_tile=True, eps_default=1e-5)
        if cfg.get("attention_bias"):
            raise ConfigError(f"{path}: attention_bias=true is not supported for OLMoE")
        clip = cfg.get("clip_qkv")
        if clip is not None:
            clip = base.num(cfg, "clip_qkv", path, 0.0, 1e9, integer=False)
        return cls(**v, norm_topk_prob=base.flag(cfg, "norm_topk_prob", path, False), clip_qkv=clip,
                   qk_norm="proj", moe_layers=tuple(range(v["num_hidden_layers"])))


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return base.decoder_tensors(args, "mlp")


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.mlp.experts.", fused_prefixes=(f"model.layers.{i}.mlp.experts.",))


class Model(base.MoEModel):
    """The OLMoE forward: the shared decoder with whole-projection q/k norms."""
