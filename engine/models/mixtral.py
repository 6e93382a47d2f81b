"""Mixtral (Mixtral-8x7B, Mixtral-8x22B).

Follows transformers' models/mixtral/modeling_mixtral.py: grouped-query attention without q/k
norms or biases, ``head_dim`` from config.json when given (else hidden / heads), RoPE; the
router takes a softmax over all ``num_local_experts`` logits, keeps the top-K and renormalises
them, which equals a softmax over the selected logits (so norm_topk_prob is always true).
``sliding_window`` (when set) limits every layer to the last sliding_window positions.
Every layer is a MoE layer.

Checkpoint names: model.layers.N.block_sparse_moe.gate (router) and
model.layers.N.block_sparse_moe.experts.E.w1 (gate) / w3 (up) / w2 (down); transformers 5
holds them fused in memory as model.layers.N.mlp.experts.{gate_up_proj, down_proj}.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import base

MODEL_TYPE = "mixtral"
DISPLAY_NAME = "Mixtral"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """Mixtral config.json (MixtralConfig names): num_local_experts, intermediate_size = expert width."""

    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="intermediate_size",
                             experts_keys=("num_local_experts", "num_experts"), eps_default=1e-5,
                             theta_default=1e6)
        L = v["num_hidden_layers"]
        window = None
        if cfg.get("sliding_window") is not None:
            window = base.num(cfg, "sliding_window", path, 1, 1 << 24, integer=True, family=DISPLAY_NAME)
        return cls(**v, norm_topk_prob=True, moe_layers=tuple(range(L)), layer_windows=(window or 0,) * L,
                   sliding_window=window)


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return base.decoder_tensors(args, "block_sparse_moe")


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.block_sparse_moe.experts.",
                            hf_proj={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                            fused_prefixes=(f"model.layers.{i}.mlp.experts.",
                                            f"model.layers.{i}.block_sparse_moe.experts."))


class Model(base.MoEModel):
    """The Mixtral forward: the shared decoder, no q/k norms, renormalised top-K routing."""
