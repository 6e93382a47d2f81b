"""dots.llm1 (``model_type: dots1``; rednote-hilab/dots.llm1.base and .inst).

Follows transformers' models/dots1/modeling_dots1.py: grouped-query attention with a per-head
RMSNorm on q and k (always; Qwen3's), full rotate-half RoPE (``attention_bias`` true, which no
published checkpoint sets, is refused); the DeepSeek-V3 router (sigmoid scores, ``e_score_correction_bias`` for the
choice only, ``n_group`` / ``topk_group`` groups by the sum of their two best biased scores,
renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``;
engine/models/routing.py "noaux_tc"); ``n_shared_experts`` ungated shared experts of width
``moe_intermediate_size`` each (one resident SwiGLU of their summed width); the first
``first_k_dense_replace`` layers dense (width ``intermediate_size``). Sliding layers per
``layer_types``, else as transformers derives them (layers from ``max_window_layers`` on slide
over ``sliding_window`` when it is set).

Not the one-call decode step (K.decode_layers_t1): it routes by the plain softmax top-k, and
dots1 scores by sigmoids with a correction bias and adds shared experts on every MoE layer.

Checkpoint names: model.layers.N.self_attn.{q,k,v,o}_proj, q_norm / k_norm [head_dim];
model.layers.N.mlp.gate.weight and .e_score_correction_bias; model.layers.N.mlp.experts.E.*;
model.layers.N.mlp.shared_experts.*; dense layers model.layers.N.mlp.*.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import base

MODEL_TYPE = "dots1"
DISPLAY_NAME = "dots.llm1"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """dots.llm1 config.json (Dots1Config names)."""

    first_k_dense_replace: int = 0
    n_shared_experts: int = 0

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="moe_intermediate_size",
                             experts_keys=("n_routed_experts", "num_local_experts"))
        L, E = v["num_hidden_layers"], v["num_experts"]
        k = base.num(cfg, "first_k_dense_replace", path, 0, L, integer=True, default=0)
        if k:
            v["intermediate_size"] = base.num(cfg, "intermediate_size", path, 1, 1 << 24, integer=True,
                                              family=DISPLAY_NAME)
        n_group, topk_group = base.expert_groups(cfg, path, E, v["num_experts_per_tok"], topk_group_default=1)
        n_shared = base.num(cfg, "n_shared_experts", path, 0, 1 << 10, integer=True, default=0)
        if base.flag(cfg, "attention_bias", path, False):
            raise ConfigError(f"{path}: attention_bias=true is not supported for {DISPLAY_NAME}")
        return cls(**v, norm_topk_prob=base.flag(cfg, "norm_topk_prob", path, False), qk_norm="head",
                   moe_layers=tuple(range(k, L)), layer_windows=layer_windows(cfg, path, L),
                   first_k_dense_replace=k, n_shared_experts=n_shared,
                   shared_expert_intermediate_size=n_shared * v["moe_intermediate_size"], shared_expert_gated=False,
                   scoring_func="sigmoid", topk_method="noaux_tc", n_group=n_group, topk_group=topk_group,
                   router_bias=True,
                   routed_scaling_factor=base.num(cfg, "routed_scaling_factor", path, 1e-6, 1e6, integer=False,
                                                  default=1.0))


def layer_windows(cfg: dict, path: str, L: int) -> tuple[int, ...]:
    """Per layer the sliding window (0 = full attention): ``layer_types`` when listed, else
    "sliding" from ``max_window_layers`` on when ``sliding_window`` is set (Dots1Config).

    Raises:
        ConfigError: naming ``path`` and the key.
    """
    w = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        mwl = base.num(cfg, "max_window_layers", path, 0, 1 << 16, integer=True, default=62)
        types = ["sliding_attention" if w is not None and i >= mwl else "full_attention" for i in range(L)]
    if not isinstance(types, list) or len(types) != L or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConfigError(f"{path}: key 'layer_types' must list 'sliding_attention' or 'full_attention' for "
                          f"each of the {L} layers")
    if "sliding_attention" in types:
        w = base.num(cfg, "sliding_window", path, 1, 1 << 24, integer=True, family=DISPLAY_NAME)
    return tuple(w if t == "sliding_attention" else 0 for t in types)


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return base.decoder_tensors(args, "mlp", shared="mlp.shared_experts.")


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.mlp.experts.", fused_prefixes=(f"model.layers.{i}.mlp.experts.",))


class Model(base.MoEModel):
    """The dots.llm1 forward: the shared decoder with per-head q/k norms, sigmoid group-limited
    routing with the correction bias, ungated shared experts."""
