"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B).

Follows transformers' models/qwen3_moe/modeling_qwen3_moe.py: grouped-query attention with a
per-head RMSNorm over head_dim on q and k (before RoPE), RoPE theta from ``rope_parameters``
(transformers 5) or ``rope_theta``; softmax router over all experts, top-K, renormalised when
``norm_topk_prob``. Layer i has routed experts iff i is not in ``mlp_only_layers`` and
(i + 1) % ``decoder_sparse_step`` == 0; the other layers have a dense SwiGLU MLP of width
``intermediate_size`` (resident). With ``use_sliding_window`` every layer attends to the last
``sliding_window`` positions (transformers 5 builds one sliding mask for all layers).

Checkpoint names: model.layers.N.self_attn.{q,k,v,o}_proj / q_norm [S] / k_norm [S];
model.layers.N.mlp.gate (router) and model.layers.N.mlp.experts.E.{gate,up,down}_proj;
dense layers model.layers.N.mlp.{gate,up,down}_proj. transformers 5 writes the expert count
as ``num_local_experts`` in config.json; published checkpoints say ``num_experts``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import base

MODEL_TYPE = "qwen3_moe"
DISPLAY_NAME = "Qwen3-MoE"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """Qwen3-MoE config.json (Qwen3MoeConfig names)."""

    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="moe_intermediate_size",
                             experts_keys=("num_experts", "num_local_experts"))
        L = v["num_hidden_layers"]
        if cfg.get("attention_bias"):
            raise ConfigError(f"{path}: attention_bias=true is not supported for {DISPLAY_NAME}")
        layers = base.sparse_layers(cfg, path, v, DISPLAY_NAME)
        window = None
        if base.flag(cfg, "use_sliding_window", path, False):
            window = base.num(cfg, "sliding_window", path, 1, 1 << 24, integer=True, family=DISPLAY_NAME)
        return cls(**v, norm_topk_prob=base.flag(cfg, "norm_topk_prob", path, False), qk_norm="head",
                   layer_windows=(window or 0,) * L, sliding_window=window, **layers)


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return base.decoder_tensors(args, "mlp")


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.mlp.experts.", fused_prefixes=(f"model.layers.{i}.mlp.experts.",))


class Model(base.MoEModel):
    """The Qwen3-MoE forward: the shared decoder with per-head q/k norms."""
