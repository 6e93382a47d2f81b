"""DeepSeek-V3 / R1 and Kimi-K2 (``model_type: deepseek_v3``).

Follows transformers' models/deepseek_v3/modeling_deepseek_v3.py: multi-head latent attention
with the latent KV cache (engine/models/mla.py; ``rope_interleave``, YaRN with its attention
scale), the sigmoid router with ``e_score_correction_bias`` for the choice only, group-limited
top-K over ``n_group`` groups scored by their two best biased scores (``topk_group`` kept),
weights renormalised when ``norm_topk_prob`` and times ``routed_scaling_factor``
(engine/models/routing.py, "noaux_tc"); ``n_shared_experts`` shared experts of width
``moe_intermediate_size`` (one resident SwiGLU of n_shared x that width, ungated, every token);
the first ``first_k_dense_replace`` layers have a dense MLP of width ``intermediate_size``.

The multi-token-prediction layers (``num_nextn_predict_layers``, checkpoint layers numbered
from num_hidden_layers on) are not part of the decoder: the converter keeps the first as a
speculative drafter (engine/mtp.py) and says it skipped the others.

Checkpoint names: model.layers.N.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}; model.layers.N.mlp.gate.weight and
.e_score_correction_bias; model.layers.N.mlp.experts.E.{gate,up,down}_proj (or fused);
model.layers.N.mlp.shared_experts.{gate,up,down}_proj; dense layers model.layers.N.mlp.*.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import base, mla

MODEL_TYPE = "deepseek_v3"
DISPLAY_NAME = "DeepSeek-V3"
MTP_HEAD = base.DEEPSEEK_MTP_HEAD  # the next-n layers' checkpoint layout (engine/mtp.py)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(mla.MLAArgs):
    """DeepSeek-V3 config.json (DeepseekV3Config names)."""

    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    num_nextn_predict_layers: int = 0

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        return cls(**deepseek_fields(cfg, path, DISPLAY_NAME, v3=True))


def deepseek_fields(cfg: dict, path: str, family: str, *, v3: bool) -> dict:
    """ModelArgs fields of a DeepSeek-V2 / V3 config.json, validated (ConfigError naming
    ``path`` and the key)."""
    cfg = dict(cfg)
    cfg["head_dim"] = cfg.get("qk_rope_head_dim") or 2  # the rotated width (validated by mla_fields)
    v = base.common_args(cfg, path, family, expert_width_key="moe_intermediate_size",
                         experts_keys=("n_routed_experts", "num_local_experts"), rope_types=("default", "yarn"))
    v.update(mla.mla_fields(cfg, path, family, v["num_attention_heads"]))
    L = v["num_hidden_layers"]
    k = base.num(cfg, "first_k_dense_replace", path, 0, L, integer=True, default=0)
    if k:
        v["intermediate_size"] = base.num(cfg, "intermediate_size", path, 1, 1 << 24, integer=True, family=family)
    n_shared = base.num(cfg, "n_shared_experts", path, 0, 1 << 10, integer=True, default=0)
    E = v["num_experts"]
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in allowed:
        raise ConfigError(f"{path}: topk_method {method!r} is not supported for {family} "
                          f"(expected {' or '.join(allowed)})")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ConfigError(f"{path}: scoring_func {scoring!r} is not supported for {family}")
    grouped = method != "greedy"
    n_group, topk_group = base.expert_groups(cfg, path, E, v["num_experts_per_tok"]) if grouped else (1, 1)
    mtp = base.num(cfg, "num_nextn_predict_layers", path, 0, 64, integer=True, default=0)
    return dict(**v, norm_topk_prob=base.flag(cfg, "norm_topk_prob", path, v3),
                attention_bias=base.flag(cfg, "attention_bias", path, False),
                moe_layers=tuple(range(k, L)), layer_windows=(0,) * L,
                first_k_dense_replace=k, n_shared_experts=n_shared,
                shared_expert_intermediate_size=n_shared * v["moe_intermediate_size"], shared_expert_gated=False,
                scoring_func=scoring, topk_method=method, n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=base.num(cfg, "routed_scaling_factor", path, 1e-6, 1e6, integer=False,
                                               default=1.0),
                router_bias=v3, rope_scaling=base.yarn_params(cfg, path, v["max_position_embeddings"]),
                rope_interleave=base.flag(cfg, "rope_interleave", path, True) if v3 else True,
                num_nextn_predict_layers=mtp)


def layer_typed_fields(cfg: dict, path: str, family: str, first_k_dense_default: int) -> dict:
    """:func:`deepseek_fields` (V3 router) for the families whose config.json may list
    ``mlp_layer_types`` ("dense" / "sparse" per layer: GLM-4.7-Flash, DeepSeek-V3.2, GLM-5)
    instead of ``first_k_dense_replace`` (default ``first_k_dense_default``, as transformers).

    Raises:
        ConfigError: naming ``path`` and the key.
    """
    cfg = dict(cfg)
    cfg.setdefault("first_k_dense_replace", first_k_dense_default)
    L = base.num(cfg, "num_hidden_layers", path, 1, 4096, integer=True, family=family)
    types = cfg.get("mlp_layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != L or any(t not in ("dense", "sparse") for t in types):
            raise ConfigError(f"{path}: key 'mlp_layer_types' must list 'dense' or 'sparse' for each of the "
                              f"{L} layers, got {types!r}")
        cfg["first_k_dense_replace"] = types.index("sparse") if "sparse" in types else L
    v = deepseek_fields(cfg, path, family, v3=True)
    if types is not None:
        v["moe_layers"] = tuple(i for i, t in enumerate(types) if t == "sparse")
        if len(v["moe_layers"]) < L:
            v["intermediate_size"] = base.num(cfg, "intermediate_size", path, 1, 1 << 24, integer=True,
                                              family=family)
    return v


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return base.decoder_tensors(args, "mlp", shared="mlp.shared_experts.", attention=mla.attention_tensors)


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.mlp.experts.", fused_prefixes=(f"model.layers.{i}.mlp.experts.",))


split_shapes = mla.split_shapes


def split_tensor(args, t: base.Tensor, w):
    return mla.split_kv_b(args, t, w)


class Model(mla.MLAModel):
    """The DeepSeek-V3 forward: MLA, sigmoid group-limited routing, ungated shared experts."""
