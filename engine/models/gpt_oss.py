"""gpt-oss (openai/gpt-oss-20b, openai/gpt-oss-120b; ``model_type: gpt_oss``).

Follows transformers' models/gpt_oss/modeling_gpt_oss.py (and OpenAI's gpt-oss model card):

- attention: grouped-query with biases on q, k, v and o (``attention_bias``), rotate-half RoPE
  with YaRN (``rope_parameters``: factor 32 over 4096 positions, ``truncate`` false; the
  attention factor scales cos / sin), softmax scale head_dim^-0.5, and a learned *sink* logit
  per query head (``self_attn.sinks`` [H]) that joins each softmax as one more column and is
  then dropped, so the weights of the real keys sum to less than one (kernels.attention_sink);
- ``layer_types``: "sliding_attention" layers see the last ``sliding_window`` positions (the
  query itself included), "full_attention" layers every earlier one; by default they alternate,
  sliding first;
- router: logits = W h + b (``mlp.router.weight`` [E, D], ``.bias`` [E]); the top-K logits,
  softmax over those K only (equal to a renormalised softmax over all E, computed the direct way);
- experts: gate and up are one fused matrix whose output columns interleave (gate = even,
  up = odd), each with a bias; the clamped SwiGLU
  ``glu = min(gate, limit) * sigmoid(alpha * min(gate, limit))``,
  ``h = (clip(up, -limit, limit) + 1) * glu``, ``out = down h + b_down``
  (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0).

Every layer is a MoE layer. Checkpoint names (transformers' save_pretrained, bf16 / f32):
model.layers.N.mlp.experts.gate_up_proj [E, D, 2I] (x @ W layout, gate/up interleaved on the
last axis), gate_up_proj_bias [E, 2I], down_proj [E, I, D], down_proj_bias [E, D]. As published
by OpenAI (MXFP4, ``quantization_config.quant_method: mxfp4``): gate_up_proj_blocks
[E, 2I, D/32, 16] uint8 + gate_up_proj_scales [E, 2I, D/32] uint8 (e8m0), down_proj_blocks
[E, D, I/32, 16] + down_proj_scales [E, D, I/32], the biases as above (engine/quant.py describes
the format; transformers' integrations/mxfp4.py dequantizes it the same way). The store holds
each expert as gate_proj [I, D], up_proj [I, D], down_proj [D, I] (de-interleaved, in the
[out, in] layout of every family) with the three biases in the same slab; an MXFP4 checkpoint
converted at ``--quant mxfp4`` keeps its codes and scales byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..quant import MXFP4_BLOCK, dequantize_mxfp4
from . import base
from .base import linear_views

MODEL_TYPE = "gpt_oss"
DISPLAY_NAME = "gpt-oss"
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True, kw_only=True)
class ModelArgs(base.ModelArgs):
    """gpt-oss config.json (GptOssConfig names). ``layer_types``: one of LAYER_TYPES per layer."""

    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        v = base.common_args(cfg, path, DISPLAY_NAME, expert_width_key="intermediate_size",
                             experts_keys=("num_local_experts", "num_experts"), eps_default=1e-5,
                             theta_default=150000.0, rope_types=("default", "yarn"))
        L = v["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None:
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)]
        if not isinstance(types, list) or len(types) != L or any(t not in LAYER_TYPES for t in types):
            raise ConfigError(f"{path}: key 'layer_types' must list {L} entries, each "
                              f"{' or '.join(repr(t) for t in LAYER_TYPES)}; got {types!r}")
        window = 0
        if "sliding_attention" in types:
            window = base.num(cfg, "sliding_window", path, 1, 1 << 24, integer=True, default=128,
                              family=DISPLAY_NAME)
        alpha = base.num(cfg, "swiglu_alpha", path, 1e-6, 1e6, integer=False, default=1.702)
        limit = base.num(cfg, "swiglu_limit", path, 1e-6, 1e12, integer=False, default=7.0)
        return cls(**v, norm_topk_prob=True, attention_bias=base.flag(cfg, "attention_bias", path, True),
                   moe_layers=tuple(range(L)),
                   layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                   rope_scaling=base.yarn_params(cfg, path, v["max_position_embeddings"]), expert_bias=True,
                   sliding_window=window, layer_types=tuple(types), swiglu_alpha=alpha, swiglu_limit=limit)

    def dense_param_count(self) -> int:
        """Parameters that stay resident: every tensor of :func:`dense_tensors` (a tied lm_head once)."""
        return sum(int(np.prod(t.shape)) for t in {t.hf: t for t in dense_tensors(self)}.values())

    def moe_resident_params(self) -> int:
        """Router weight [E, D] and bias [E] of one MoE layer."""
        return self.num_experts * (self.hidden_size + 1)


def _attention_tensors(args: ModelArgs, i: int) -> list[base.Tensor]:
    D, H = args.hidden_size, args.num_attention_heads
    hp, cp = f"model.layers.{i}.", f"layers.{i}."
    dims = (("q_proj", args.q_dim, D), ("k_proj", args.kv_dim, D), ("v_proj", args.kv_dim, D),
            ("o_proj", D, args.q_dim))
    out = [base.Tensor(hp + "input_layernorm.weight", cp + "input_layernorm", (D,), "keep"),
           base.Tensor(hp + "post_attention_layernorm.weight", cp + "post_attention_layernorm", (D,), "keep")]
    out += [base.Tensor(f"{hp}self_attn.{p}.weight", cp + p, (o, n), "quant") for p, o, n in dims]
    if args.attention_bias:
        out += [base.Tensor(f"{hp}self_attn.{p}.bias", f"{cp}{p}.bias", (o,), "keep") for p, o, _ in dims]
    out.append(base.Tensor(hp + "self_attn.sinks", cp + "sinks", (H,), "keep"))
    return out


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    """Norms, attention (+ biases, sinks), router weight and bias per layer; embeddings, norm, lm_head."""
    D, E = args.hidden_size, args.num_experts
    out: list[base.Tensor] = []
    for i in range(args.num_hidden_layers):
        out += _attention_tensors(args, i)
        out += [base.Tensor(f"model.layers.{i}.mlp.router.weight", f"layers.{i}.router", (E, D), "keep"),
                base.Tensor(f"model.layers.{i}.mlp.router.bias", f"layers.{i}.router.bias", (E,), "keep")]
    return out + base.global_tensors(args)


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    """Names for messages (the experts of a gpt-oss checkpoint are fused: :func:`expert_tensors`)."""
    return base.ExpertNames(i, f"model.layers.{i}.mlp.experts.",
                            hf_proj={"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"})


def expert_tensors(args: ModelArgs, i: int, mxfp4: bool = False) -> dict[str, tuple[int, ...]]:
    """The fused expert tensors of transformer layer i with their shapes: the bf16 / f32 layout
    (save_pretrained), or with ``mxfp4`` the published blocks / scales layout."""
    D, I, E = args.hidden_size, args.moe_intermediate_size, args.num_experts
    p = f"model.layers.{i}.mlp.experts."
    if mxfp4:
        B = MXFP4_BLOCK
        return {p + "gate_up_proj_blocks": (E, 2 * I, D // B, B // 2), p + "gate_up_proj_scales": (E, 2 * I, D // B),
                p + "gate_up_proj_bias": (E, 2 * I),
                p + "down_proj_blocks": (E, D, I // B, B // 2), p + "down_proj_scales": (E, D, I // B),
                p + "down_proj_bias": (E, D)}
    return {p + "gate_up_proj": (E, D, 2 * I), p + "gate_up_proj_bias": (E, 2 * I),
            p + "down_proj": (E, I, D), p + "down_proj_bias": (E, D)}


def expert_from_fused(args: ModelArgs, i: int, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One expert's slices of :func:`expert_tensors` (float32, keyed by the full names, the expert
    axis removed) -> the store's float32 parts: gate_proj / up_proj [I, D], down_proj [D, I] and
    their biases "gate_proj.b" [I], "up_proj.b" [I], "down_proj.b" [D]. Gate = even columns of
    gate_up_proj, up = odd (transformers' GptOssExperts._apply_gate)."""
    p = f"model.layers.{i}.mlp.experts."
    gu, gub = rows[p + "gate_up_proj"], rows[p + "gate_up_proj_bias"]  # [D, 2I], [2I]
    return {"gate_proj": np.ascontiguousarray(gu[:, 0::2].T), "up_proj": np.ascontiguousarray(gu[:, 1::2].T),
            "down_proj": np.ascontiguousarray(rows[p + "down_proj"].T),
            "gate_proj.b": np.ascontiguousarray(gub[0::2]), "up_proj.b": np.ascontiguousarray(gub[1::2]),
            "down_proj.b": np.ascontiguousarray(rows[p + "down_proj_bias"])}


def expert_from_mxfp4(args: ModelArgs, i: int, rows: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """One expert's slices of the MXFP4 :func:`expert_tensors` (blocks / scales uint8 as stored,
    biases float32) -> the store's parts {proj: {"w": codes uint8 [O, N/2], "s": scale bytes
    uint8 [O, N/32], "b": float32 [O]}}: gate = even rows of gate_up_proj, up = odd rows, codes
    kept byte for byte (a blocks row [N/32, 16] is the row's N/2 code bytes in column order)."""
    p = f"model.layers.{i}.mlp.experts."
    gb, gs = rows[p + "gate_up_proj_blocks"], rows[p + "gate_up_proj_scales"]  # [2I, G, 16], [2I, G]
    db, ds = rows[p + "down_proj_blocks"], rows[p + "down_proj_scales"]  # [D, G', 16], [D, G']
    gub = rows[p + "gate_up_proj_bias"]

    def flat(b):
        return np.ascontiguousarray(b.reshape(b.shape[0], -1))

    return {"gate_proj": {"w": flat(gb[0::2]), "s": np.ascontiguousarray(gs[0::2]),
                          "b": np.ascontiguousarray(gub[0::2], dtype=np.float32)},
            "up_proj": {"w": flat(gb[1::2]), "s": np.ascontiguousarray(gs[1::2]),
                        "b": np.ascontiguousarray(gub[1::2], dtype=np.float32)},
            "down_proj": {"w": flat(db), "s": np.ascontiguousarray(ds),
                          "b": np.ascontiguousarray(rows[p + "down_proj_bias"], dtype=np.float32)}}


def dequantized_expert(args: ModelArgs, i: int, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The float32 parts (as :func:`expert_from_fused`) of one MXFP4 expert, decoded exactly."""
    out = {}
    for proj, parts in expert_from_mxfp4(args, i, rows).items():
        out[proj] = dequantize_mxfp4(parts["w"], parts["s"])
        out[proj + ".b"] = parts["b"]
    return out


class Model(base.MoEModel):
    """The gpt-oss forward: the shared decoder with attention sinks, q/k/v/o biases, per-layer
    sliding windows, the biased top-K-softmax router and the clamped-SwiGLU experts with biases."""

    def __init__(self, args, dense, *a, **kw):
        super().__init__(args, dense, *a, **kw)
        for i, ly in enumerate(self.layers):
            ly["router_logit_bias"] = dense[f"layers.{i}.router.bias"]

    def attention_weights(self, dense: dict, p: str) -> dict:
        ly = super().attention_weights(dense, p)
        ly["sinks"] = np.ascontiguousarray(dense[p + "sinks"], dtype=np.float32)
        return ly

    def router_logits(self, j: int, h: np.ndarray) -> np.ndarray:
        """Router logits W h + b, float32 [T, E], of MoE layer j for normed rows h [T, D]."""
        out = super().router_logits(j, h)
        out += self.layers[self.moe_layer_ids[j]]["router_logit_bias"]
        return out

    def route(self, j: int, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The K largest logits (larger first, lower index on ties), weights = softmax over them."""
        k = self.args.num_experts_per_tok
        idx = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # [T, K]
        top = np.take_along_axis(logits, idx, axis=1)
        w = np.exp(top - top[:, :1])  # top[:, 0] is the row's largest
        w /= w.sum(axis=1, keepdims=True)
        return idx.astype(np.int64), w.astype(np.float32)

    def expert_forward(self, views: dict, x: np.ndarray, h: np.ndarray, out: np.ndarray) -> None:
        """out = down((clip(up x + b_u, +-limit) + 1) * glu(min(gate x + b_g, limit))) + b_d,
        glu(g) = g * sigmoid(alpha g); x [T, D], h [T, I] scratch, out [T, D]."""
        a, kind = self.args, self.expert_quant
        g = linear_views(kind, views, "gate_proj", x, h, self.gs)  # [T, I]
        u = linear_views(kind, views, "up_proj", x, np.empty_like(h), self.gs)
        lim = np.float32(a.swiglu_limit)
        np.minimum(g, lim, out=g)
        np.clip(u, -lim, lim, out=u)
        g *= np.float32(1.0) / (np.float32(1.0) + np.exp(np.float32(-a.swiglu_alpha) * g))
        u += np.float32(1.0)
        g *= u
        linear_views(kind, views, "down_proj", g, out, self.gs)


__all__ = ["ModelArgs", "Model", "dense_tensors", "expert_names", "expert_tensors", "expert_from_fused",
           "expert_from_mxfp4", "dequantized_expert"]
