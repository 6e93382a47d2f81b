"""MiniMax-M2 (``model_type: minimax_m2``; MiniMaxAI/MiniMax-M2, M2.1).

Follows transformers' models/minimax_m2/modeling_minimax_m2.py: grouped-query attention whose
q and k are RMS-normed over the whole projection (q_norm [H x S], k_norm [Hkv x S]: OLMoE's
kind) before a partial rotate-half RoPE over the first ``rotary_dim`` values of each head
(``rotary_dim``, or ``partial_rotary_factor`` x head_dim); every layer a MoE layer whose router
scores with sigmoids, chooses the top-K of scores + ``e_score_correction_bias`` (the bias never
enters a weight) and renormalises the chosen scores (engine/models/routing.py "noaux_tc" with
one group); experts of width ``intermediate_size``, no shared expert.

Not the one-call decode step (K.decode_layers_t1): it routes by the plain softmax top-k without
a bias, and its attention rotates every value of a head.

Checkpoint names (Mixtral's): model.layers.N.self_attn.{q,k,v,o}_proj, q_norm, k_norm;
model.layers.N.block_sparse_moe.gate.weight, model.layers.N.block_sparse_moe.e_score_correction_bias,
model.layers.N.block_sparse_moe.experts.E.w1 (gate) / w3 (up) / w2 (down).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import base

MODEL_TYPE = "minimax_m2"
DISPLAY_NAME = "MiniMax-M2"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """MiniMax-M2 config.json (MiniMaxM2Config names)."""

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="intermediate_size",
                             experts_keys=("num_local_experts",), theta_default=5000000.0)
        L, S = v["num_hidden_layers"], v["head_dim"]
        rope = cfg.get("rope_parameters") or {}
        if cfg.get("rotary_dim") is not None:
            rd = base.num(cfg, "rotary_dim", path, 2, S, integer=True)
        else:
            prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
            if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
                raise ConfigError(f"{path}: partial_rotary_factor {prf!r} must be a number in (0, 1]")
            rd = int(S * prf)
        if rd < 2 or rd % 2:
            raise ConfigError(f"{path}: the rotary width {rd} of head_dim {S} must be even and at least 2")
        for key in ("scoring_func",):
            if cfg.get(key) not in (None, "sigmoid"):
                raise ConfigError(f"{path}: {key} {cfg[key]!r} is not supported for {DISPLAY_NAME} (expected 'sigmoid')")
        return cls(**v, norm_topk_prob=True, qk_norm="proj", rotary_dim=0 if rd == S else rd,
                   moe_layers=tuple(range(L)), layer_windows=(0,) * L, scoring_func="sigmoid",
                   topk_method="noaux_tc", router_bias=True)


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return [t._replace(hf=t.hf.replace("block_sparse_moe.gate.e_score_correction_bias",
                                       "block_sparse_moe.e_score_correction_bias"))
            for t in base.decoder_tensors(args, "block_sparse_moe")]


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.block_sparse_moe.experts.",
                            hf_proj={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
                            fused_prefixes=(f"model.layers.{i}.mlp.experts.",
                                            f"model.layers.{i}.block_sparse_moe.experts."))


class Model(base.MoEModel):
    """The MiniMax-M2 forward: whole-projection q/k norms, partial RoPE, sigmoid routing with
    the selection-only correction bias."""
