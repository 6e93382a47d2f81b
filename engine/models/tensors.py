"""The checkpoint-name mapping: which resident tensors a family's checkpoint holds (Hugging Face
name -> store name, shape, kind) and where its routed experts live. Re-exported by
engine/models/base.py (``base.Tensor``, ``base.decoder_tensors``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .args import ModelArgs

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # slab field names (store canonical)

# --- checkpoint-name mapping ------------------------------------------------------------------

class Tensor(NamedTuple):
    """One resident tensor: Hugging Face name -> store canonical name.

    kind: "keep" (stored float32 as is: norms, routers, biases, gates) or "quant" (a matrix
    stored in the store's dense quantization). split: "" (stored as one tensor named
    ``ours``) or the name of a family transform that stores it as several tensors (MLA's
    kv_b_proj: ``family.split_shapes(args, t)`` lists them, ``family.split_tensor(args, t, w)``
    makes them from the float32 checkpoint tensor).
    """

    hf: str
    ours: str
    shape: tuple[int, ...]
    kind: str
    split: str = ""


@dataclass(frozen=True)
class HeadLayout:
    """How a family publishes its multi-token-prediction (next-n) layers (engine/mtp.py).

    ``count_key``: config.json's number of next-n layers. ``block``: the checkpoint prefix of
    next-n layer k's decoder block ("{L}": its transformer layer number L + k, "{k}": k).
    ``names``: the checkpoint names of the head's own tensors, in the order of engine/mtp.py's
    HEAD_TENSORS (enorm, hnorm, eh_proj, shared_head.norm; "{block}": the block's prefix).
    ``zero_first``: the runtime zeroes the embedding at position 0. ``norm_one``: the head's
    norms are zero-centred (x / rms(x) * (1 + w)). ``block_types``: the block's ``layer_types``
    in a family whose layers have types. ``layers``: the prefix of the decoder's layers in the
    family's checkpoint names (a multimodal checkpoint's language model's). ``block_indexer``:
    the block runs its own sparse-attention indexer (DSA families: the block is listed in
    ``indexer_layers``; it has no earlier layer whose selection it could reuse)."""

    count_key: str
    block: str
    names: tuple
    zero_first: bool
    norm_one: bool = False
    block_types: tuple = ()
    layers: str = "model.layers."
    block_indexer: bool = False

    def prefix(self, L: int, k: int) -> str:
        """The checkpoint prefix of next-n layer k's block in a decoder of L layers."""
        return self.block.format(L=L + k, k=k)

    def block_prefix(self, args, i: int) -> str:
        """The checkpoint prefix of transformer layer ``i`` of ``args`` (a kept next-n layer when
        i >= num_hidden_layers)."""
        L = args.num_hidden_layers
        return self.prefix(L, i - L) if i >= L else f"{self.layers}{i}."


# DeepSeek-V3's and GLM-4.5's next-n layers: checkpoint layers num_hidden_layers.. (vLLM's
# deepseek_mtp.py), the embedding at position 0 zeroed
DEEPSEEK_MTP_HEAD = HeadLayout("num_nextn_predict_layers", "model.layers.{L}.",
                               ("{block}enorm.weight", "{block}hnorm.weight", "{block}eh_proj.weight",
                                "{block}shared_head.norm.weight"), zero_first=True)


@dataclass(frozen=True)
class ExpertNames:
    """Where layer ``layer``'s routed experts live in a checkpoint.

    Per-expert names (published checkpoints, and transformers' save_pretrained):
    ``f"{prefix}{e}.{hf_proj[p]}.weight"`` for p in gate_proj / up_proj / down_proj.
    Fused 3-D names (transformers 5's in-memory layout, written by some tools):
    ``{fused_prefix}gate_up_proj`` [E, 2I, D] (gate rows first, then up) and
    ``{fused_prefix}down_proj`` [E, D, I].
    """

    layer: int
    prefix: str
    hf_proj: dict = field(default_factory=lambda: {p: p for p in EXPERT_PROJS})
    fused_prefixes: tuple[str, ...] = ()

    def name(self, e: int, proj: str) -> str:
        return f"{self.prefix}{e}.{self.hf_proj[proj]}.weight"


def attention_tensors(args: ModelArgs, i: int) -> list[Tensor]:
    """Norms and attention of transformer layer i (q/k norms and biases as args say)."""
    D, S = args.hidden_size, args.head_dim
    hp, cp = f"model.layers.{i}.", f"layers.{i}."
    out = [Tensor(hp + "input_layernorm.weight", cp + "input_layernorm", (D,), "keep"),
           Tensor(hp + "post_attention_layernorm.weight", cp + "post_attention_layernorm", (D,), "keep")]
    for p, o in (("q_proj", args.q_dim), ("k_proj", args.kv_dim), ("v_proj", args.kv_dim)):
        out.append(Tensor(f"{hp}self_attn.{p}.weight", cp + p, (o, D), "quant"))
    out.append(Tensor(hp + "self_attn.o_proj.weight", cp + "o_proj", (D, args.q_dim), "quant"))
    if args.qk_norm != "none":
        qn, kn = (args.q_dim, args.kv_dim) if args.qk_norm == "proj" else (S, S)
        out += [Tensor(hp + "self_attn.q_norm.weight", cp + "q_norm", (qn,), "keep"),
                Tensor(hp + "self_attn.k_norm.weight", cp + "k_norm", (kn,), "keep")]
    if args.attention_bias:
        out += [Tensor(f"{hp}self_attn.{p}.bias", f"{cp}{p}.bias", (o,), "keep")
                for p, o in (("q_proj", args.q_dim), ("k_proj", args.kv_dim), ("v_proj", args.kv_dim))]
    return out


def mlp_tensors(hf_prefix: str, our_prefix: str, D: int, I: int) -> list[Tensor]:
    """A resident SwiGLU MLP (dense layer or shared expert): gate/up [I, D], down [D, I]."""
    return [Tensor(f"{hf_prefix}gate_proj.weight", our_prefix + "gate_proj", (I, D), "quant"),
            Tensor(f"{hf_prefix}up_proj.weight", our_prefix + "up_proj", (I, D), "quant"),
            Tensor(f"{hf_prefix}down_proj.weight", our_prefix + "down_proj", (D, I), "quant")]


def global_tensors(args: ModelArgs) -> list[Tensor]:
    """Embeddings, final norm and lm_head (the tied embedding when tie_word_embeddings)."""
    D, V = args.hidden_size, args.vocab_size
    lm = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    return [Tensor("model.embed_tokens.weight", "embed_tokens", (V, D), "quant"),
            Tensor("model.norm.weight", "norm", (D,), "keep"),
            Tensor(lm, "lm_head", (V, D), "quant")]


def decoder_tensors(args: ModelArgs, block: str = "mlp", shared: str = "mlp.shared_expert.",
                    attention=None) -> list[Tensor]:
    """Every resident tensor of a pre-norm MoE decoder, Hugging Face -> store names.

    ``block``: the module holding the router and experts ("mlp" for OLMoE / Qwen,
    "block_sparse_moe" for Mixtral). MoE layers: router ``{block}.gate.weight`` [E, D] ->
    ``layers.i.router`` (float32), plus the shared expert (``mlp.shared_expert.*`` ->
    ``layers.i.shared_expert.*``, ``mlp.shared_expert_gate.weight`` [1, D]) when args has one.
    Dense layers: ``mlp.{gate,up,down}_proj`` -> ``layers.i.mlp.*``. ``shared``: the shared
    expert's module prefix (DeepSeek / GLM: "mlp.shared_experts."); its gate only when
    ``args.shared_expert_gated``; the router's ``e_score_correction_bias`` [E] ->
    ``layers.i.router_bias`` when ``args.router_bias``. ``attention``: the family's
    ``(args, i) -> [Tensor]`` for layer i's norms and attention (default
    :func:`attention_tensors`).
    """
    D, E = args.hidden_size, args.num_experts
    moe = set(args.moe_layers)
    out: list[Tensor] = []
    for i in range(args.num_hidden_layers):
        hp, cp = f"model.layers.{i}.", f"layers.{i}."
        out += (attention or attention_tensors)(args, i)
        if i in moe:
            out.append(Tensor(f"{hp}{block}.gate.weight", cp + "router", (E, D), "keep"))
            if args.router_bias:
                out.append(Tensor(f"{hp}{block}.gate.e_score_correction_bias", cp + "router_bias", (E,), "keep"))
            Is = args.shared_expert_intermediate_size
            if Is:
                out += mlp_tensors(hp + shared, cp + "shared_expert.", D, Is)
                if args.shared_expert_gated:
                    out.append(Tensor(hp + "mlp.shared_expert_gate.weight", cp + "shared_expert_gate", (1, D), "keep"))
        else:
            out += mlp_tensors(hp + "mlp.", cp + "mlp.", D, args.intermediate_size)
    return out + global_tensors(args)


def expert_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    D, I = args.hidden_size, args.moe_intermediate_size
    return {"gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I)}


def hf_names(family, args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a per-expert checkpoint of ``family`` holds, with its shape, in a fixed
    order (global tensors, then layer by layer: resident tensors, then experts; the seeded
    synthetic checkpoints draw tensor n from the seed [seed, n], so the order is part of them)."""
    tensors = family.dense_tensors(args)
    names = {t.hf: t.shape for t in tensors if not t.hf.startswith("model.layers.")}
    by_layer: dict[int, list[Tensor]] = {}
    for t in tensors:
        if t.hf.startswith("model.layers."):
            by_layer.setdefault(int(t.hf.split(".")[2]), []).append(t)
    shapes = expert_shapes(args)
    moe = set(args.moe_layers)
    for i in range(args.num_hidden_layers):
        names.update({t.hf: t.shape for t in by_layer.get(i, [])})
        if i in moe and hasattr(family, "expert_tensors"):  # fused experts only (gpt-oss)
            names.update(family.expert_tensors(args, i))
        elif i in moe:
            en = family.expert_names(args, i)
            for e in range(args.num_experts):
                for p in EXPERT_PROJS:
                    names[en.name(e, p)] = shapes[p]
    return names


def layers_of_type(layer_types: tuple[str, ...], kind: str) -> tuple[int, ...]:
    """The indices of the transformer layers whose ``layer_types`` entry is ``kind``."""
    return tuple(i for i, t in enumerate(layer_types) if t == kind)


def tensor_params(args, tensors) -> int:
    """Parameters of ``tensors`` (the family's dense_tensors), a tied lm_head counted once."""
    return sum(int(np.prod(t.shape)) for t in tensors
               if not (args.tie_word_embeddings and t.ours == "lm_head"))
