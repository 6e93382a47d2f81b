"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Follows transformers' models/qwen2_moe/modeling_qwen2_moe.py: grouped-query attention with
q/k/v biases (``qkv_bias``, default true; o_proj has none), no q/k norms; softmax router over
all experts, top-K, renormalised only when ``norm_topk_prob`` (false in the published
checkpoints); every MoE layer also runs a resident shared expert of width
``shared_expert_intermediate_size``, scaled by sigmoid(``shared_expert_gate`` h), for every
token. Layers in ``mlp_only_layers`` or failing (i + 1) % ``decoder_sparse_step`` == 0 have a
dense MLP of width ``intermediate_size``. Sliding window: per ``layer_types`` when config.json
lists them, else as transformers 5 derives them (even layers below ``max_window_layers`` when
``use_sliding_window``).

Checkpoint names: model.layers.N.mlp.gate (router), model.layers.N.mlp.experts.E.*,
model.layers.N.mlp.shared_expert.{gate,up,down}_proj, model.layers.N.mlp.shared_expert_gate.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import base

MODEL_TYPE = "qwen2_moe"
DISPLAY_NAME = "Qwen2-MoE"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """Qwen2-MoE config.json (Qwen2MoeConfig names)."""

    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="moe_intermediate_size")
        L = v["num_hidden_layers"]
        layers = base.sparse_layers(cfg, path, v, DISPLAY_NAME)
        shared = base.num(cfg, "shared_expert_intermediate_size", path, 1, 1 << 24, integer=True,
                          family=DISPLAY_NAME)
        windows = [0] * L
        if base.flag(cfg, "use_sliding_window", path, False):
            w = base.num(cfg, "sliding_window", path, 1, 1 << 24, integer=True, family=DISPLAY_NAME)
            types = cfg.get("layer_types")
            if types is None:
                mwl = base.num(cfg, "max_window_layers", path, 0, 1 << 16, integer=True, default=28)
                types = ["sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention" for i in range(L)]
            if not isinstance(types, list) or len(types) != L or \
                    any(t not in ("sliding_attention", "full_attention") for t in types):
                raise ConfigError(f"{path}: key 'layer_types' must list 'sliding_attention' or "
                                  f"'full_attention' for each of the {L} layers")
            windows = [w if t == "sliding_attention" else 0 for t in types]
        return cls(**v, norm_topk_prob=base.flag(cfg, "norm_topk_prob", path, False),
                   attention_bias=base.flag(cfg, "qkv_bias", path, True),
                   shared_expert_intermediate_size=shared, layer_windows=tuple(windows), **layers)


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return base.decoder_tensors(args, "mlp")


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.mlp.experts.", fused_prefixes=(f"model.layers.{i}.mlp.experts.",))


class Model(base.MoEModel):
    """The Qwen2-MoE forward: the shared decoder with q/k/v biases and the gated shared expert."""
