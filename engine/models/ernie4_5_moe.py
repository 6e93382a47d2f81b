"""ERNIE 4.5 MoE (``model_type: ernie4_5_moe``; baidu/ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B).

Follows transformers' models/ernie4_5_moe/modeling_ernie4_5_moe.py. What differs from the
shared decoder:

- RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... of each head (GPT-J style) rather than
  the two halves. A score q.k does not change when the same permutation reorders the values of
  both q and k, so at load the rows of q_proj and k_proj are reordered head by head (evens,
  then odds): the pairs become the halves and the shared rotate-half attention computes the
  same scores (the values v and the output are untouched).
- The router scores with a softmax over all experts; the choice adds the
  ``moe_statics.e_score_correction_bias`` to those probabilities, the weights are the
  unbiased probabilities of the chosen experts divided by their sum (clamped below at
  ``moe_norm_min``). Every MoE layer also runs ``moe_num_shared_experts`` ungated shared
  experts of width ``moe_intermediate_size`` (one resident SwiGLU of their summed width).
- Layer i has routed experts iff ``moe_layer_start_index`` <= i <= ``moe_layer_end_index``
  (-1: the last layer) and (i + 1) % ``moe_layer_interval`` == 0; the others have a dense MLP
  of width ``intermediate_size``. The embedding is tied by default.

Not the one-call decode step (K.decode_layers_t1): its router is the plain softmax top-k,
without the correction bias every ERNIE MoE layer has, and it runs no shared expert.

Checkpoint names: model.layers.N.self_attn.{q,k,v,o}_proj; model.layers.N.mlp.gate.weight
[E, D]; model.layers.N.mlp.moe_statics.e_score_correction_bias [1, E];
model.layers.N.mlp.experts.E.{gate,up,down}_proj; model.layers.N.mlp.shared_experts.*; dense
layers model.layers.N.mlp.*. The multi-token-prediction layer (``mtp_*``) is not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from . import base

MODEL_TYPE = "ernie4_5_moe"
DISPLAY_NAME = "ERNIE 4.5 (MoE)"


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """ERNIE 4.5 MoE config.json (Ernie4_5_MoeConfig names)."""

    moe_norm_min: float = 1e-12
    n_shared_experts: int = 0

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        cfg = dict(cfg)
        if cfg.get("moe_k") is not None:  # the published name of num_experts_per_tok
            cfg["num_experts_per_tok"] = cfg["moe_k"]
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="moe_intermediate_size",
                             experts_keys=("moe_num_experts", "num_experts"), eps_default=1e-5,
                             theta_default=500000.0)
        if base.flag(cfg, "use_bias", path, False):
            raise ConfigError(f"{path}: use_bias=true is not supported for {DISPLAY_NAME} (the published "
                              f"checkpoints have no projection biases)")
        L = v["num_hidden_layers"]
        start = base.num(cfg, "moe_layer_start_index", path, 0, L, integer=True, default=1)
        end = cfg.get("moe_layer_end_index", -1)
        end = L - 1 if end in (None, -1) else base.num(cfg, "moe_layer_end_index", path, 0, L - 1, integer=True)
        step = base.num(cfg, "moe_layer_interval", path, 1, L, integer=True, default=1)
        moe = tuple(i for i in range(L) if start <= i <= end and (i + 1) % step == 0)
        if len(moe) < L:
            v["intermediate_size"] = base.num(cfg, "intermediate_size", path, 1, 1 << 24, integer=True,
                                              family=DISPLAY_NAME)
        n_shared = base.num(cfg, "moe_num_shared_experts", path, 0, 1 << 10, integer=True, default=0)
        v["tie_word_embeddings"] = base.flag(cfg, "tie_word_embeddings", path, True)
        return cls(**v, norm_topk_prob=True, moe_layers=moe, layer_windows=(0,) * L, router_bias=True,
                   n_shared_experts=n_shared, shared_expert_intermediate_size=n_shared * v["moe_intermediate_size"],
                   shared_expert_gated=False,
                   moe_norm_min=base.num(cfg, "moe_norm_min", path, 0.0, 1.0, integer=False, default=1e-12))


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    """The shared decoder's tensors, with the correction bias under ``mlp.moe_statics`` ([1, E])."""
    out = []
    for t in base.decoder_tensors(args, "mlp", shared="mlp.shared_experts."):
        if t.ours.endswith(".router_bias"):
            t = t._replace(hf=t.hf.replace("mlp.gate.e_score_correction_bias", "mlp.moe_statics.e_score_correction_bias"),
                           shape=(1, args.num_experts))
        out.append(t)
    return out


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"model.layers.{i}.mlp.experts.", fused_prefixes=(f"model.layers.{i}.mlp.experts.",))


def pairs_to_halves(S: int) -> np.ndarray:
    """int64 [S]: the order of a head's values that turns its rotated pairs (2j, 2j + 1) into
    the halves (j, S/2 + j): evens, then odds."""
    return np.concatenate([np.arange(0, S, 2), np.arange(1, S, 2)])


class Model(base.MoEModel):
    """The ERNIE 4.5 MoE forward: pair-rotated RoPE (by reordered q/k rows), the softmax router
    with its selection-only correction bias, ungated shared experts."""

    def attention_weights(self, dense: dict, p: str) -> dict:
        """q_proj's and k_proj's rows reordered head by head (:func:`pairs_to_halves`): the
        quantized rows carry their own scales, so the reorder is exact at every quantization."""
        a = self.args
        S = a.head_dim
        dense = dict(dense)
        for n, heads in (("q_proj", a.num_attention_heads), ("k_proj", a.num_key_value_heads)):
            rows = (np.arange(heads)[:, None] * S + pairs_to_halves(S)[None, :]).reshape(-1)
            for f in (".w", ".s", ".bias"):
                arr = dense.get(p + n + f)
                if arr is not None:
                    dense[p + n + f] = np.ascontiguousarray(arr[rows])
        return super().attention_weights(dense, p)

    def route(self, j: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Softmax probabilities; the top-K of probabilities + correction bias (larger first,
        lower id on ties); weights the chosen probabilities / max(their sum, moe_norm_min)."""
        a = self.args
        z = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        p = p.astype(np.float32)
        bias = self.layers[self.moe_layer_ids[j]]["router_bias"].reshape(-1)
        idx = np.argsort(-(p + bias[None, :]), axis=1, kind="stable")[:, :a.num_experts_per_tok]
        w = np.take_along_axis(p, idx, axis=1)
        w /= np.maximum(w.sum(axis=1, keepdims=True), np.float32(a.moe_norm_min))
        return idx.astype(np.int64), w.astype(np.float32)
