"""Import a GGUF model (llama.cpp's file format: LM Studio, Ollama, the -GGUF repositories) as a store.

``convert_gguf(SRC, DST)``: SRC is one ``.gguf`` file, the first (or any) part of a split model
``NAME-00001-of-0000N.gguf``, or a folder holding one model's GGUF file(s). The file is read
with the ``gguf`` package (llama.cpp's own reader); nothing is written next to it and it is never
changed or moved.

What the store gets:
  - config.json: the Hugging Face config of the architecture's family, from the GGUF metadata
    (``<arch>.block_count``, ``.embedding_length``, ``.attention.head_count`` ...); a missing
    key is one error naming it, before anything is written.
  - routed experts: their blocks as published (no second rounding). GGUF stacks a layer's
    experts in ``blk.N.ffn_{gate,up,down}_exps`` (numpy [E, O, row bytes]); each expert's three
    row sets are copied into one slab (engine.gguf_blocks), so one read loads one expert as in
    every store, and the kernels of engine.kernels_gguf compute on the blocks.
  - dense tensors (attention, embeddings, output, norms, router, shared experts): decoded with
    gguf.quants and stored in the store's dense formats (int8 by default, ``dense_quant``):
    the resident kernels, the row-by-row embedding reads and sizing stay the ones every store
    uses. Norms, routers and biases stay float32 as published (GGUF keeps them F32).
  - the first multi-token-prediction layer llama.cpp wrote (``glm4moe``, ``deepseek2``: block
    ``block_count - nextn_predict_layers`` with its ``blk.N.nextn.*`` tensors) kept as the MTP
    head, as a checkpoint's conversion keeps it (engine/mtp.py).
  - tokenizer.json / tokenizer_config.json built from ``tokenizer.ggml.*`` and
    ``tokenizer.chat_template`` (engine.gguf_tokenizer).

Architectures: ``qwen3moe``, ``olmoe``, ``qwen2moe``, ``llama`` with experts (Mixtral; its
q/k rows are un-permuted back to the rotate-half order the converter permuted them from),
``gpt-oss`` (the experts' biases ``ffn_*_exps.bias`` go into each slab beside the blocks),
``deepseek2`` (DeepSeek-V2 / V3, Kimi-K2: MLA, whose ``attn_k_b`` / ``attn_v_b`` are the store's
absorbed tensors; the router's gating function picks the family), ``glm4moe`` (GLM-4.5 / 4.6),
``qwen3next`` (its linear-attention tensors mapped back from llama.cpp's layout), ``dots1``,
``ernie4_5-moe``, ``hunyuan-moe`` and ``minimax-m2`` (engine.gguf_families).

Errors (one line, before any work, nothing left in DST): not a GGUF, a truncated header, tensor
data shorter than the header says, a split with a part missing, an architecture or block type
this engine does not run, a missing metadata key or tensor.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import Cancelled, CheckpointError, ConfigError
from .events import LoadProgress
from .gguf_blocks import BLOCK_TYPES, PROJS, gguf_slab_layout, row_bytes, type_name
from .gguf_file import SPLIT_RE, GGUFModel, gguf_files, is_gguf_path  # noqa: F401 - the names callers use
from . import gguf_families

log = logging.getLogger(__name__)


# llama.cpp architecture -> our family's model_type
ARCHS = {"qwen3moe": "qwen3_moe", "olmoe": "olmoe", "qwen2moe": "qwen2_moe", "llama": "mixtral", "gpt-oss": "gpt_oss",
         "deepseek2": "deepseek_v3", "glm4moe": "glm4_moe", "qwen3next": "qwen3_next"}

# per-layer tensors: Hugging Face name inside model.layers.N. -> GGUF name inside blk.N.
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # DeepSeek / GLM: MLA, the routers' score bias, ungated shared experts
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    # a kept multi-token-prediction layer's own tensors (blk.{num_hidden_layers}.nextn.*, engine/mtp.py)
    "enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight",
    "eh_proj.weight": "nextn.eh_proj.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_EXPERT_NAMES = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                 "down_proj": "ffn_down_exps.weight"}
# Mixtral files converted before llama.cpp stacked the experts: one tensor per expert, blk.N.ffn_gate.E.weight
_PER_EXPERT_NAMES = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


# gpt-oss's and GLM-4 MoE's norm after attention is "post_attention_norm" in GGUF (ffn_norm elsewhere)
_ARCH_LAYER_NAMES = {"gpt-oss": {"post_attention_layernorm.weight": "post_attention_norm.weight"},
                     "glm4moe": {"post_attention_layernorm.weight": "post_attention_norm.weight"},
                     "qwen3next": {"post_attention_layernorm.weight": "post_attention_norm.weight",
                                   "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
                                   "linear_attn.in_proj_qkvz.weight": "attn_qkv.weight",  # + attn_gate
                                   "linear_attn.conv1d.weight": "ssm_conv1d.weight",
                                   "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a",
                                   "linear_attn.norm.weight": "ssm_norm.weight",
                                   "linear_attn.out_proj.weight": "ssm_out.weight"}}
ARCHS.update(gguf_families.ARCHS)
_ARCH_LAYER_NAMES.update(gguf_families.LAYER_NAMES)
# Qwen3-Next: llama.cpp's converter writes in_proj_qkvz as two tensors (see GGUFSource._qkvz) and
# stores these zero-centred norms' weights plus one
_QWEN3NEXT_QKVZ = ("attn_qkv.weight", "attn_gate.weight")
_PLUS_ONE_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                   "self_attn.k_norm.weight", "model.norm.weight")


def gguf_name(hf: str, arch: str = "") -> str:
    """The GGUF tensor name of the Hugging Face tensor ``hf`` in architecture ``arch`` (KeyError
    when GGUF has none)."""
    if hf in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf]
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", hf)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if m is None or m.group(2) not in names:
        raise KeyError(hf)
    return f"blk.{m.group(1)}.{names[m.group(2)]}"


# --- metadata -> config.json ------------------------------------------------------------------

def hf_config(g: GGUFModel) -> dict:
    """The Hugging Face config.json dict of ``g``'s family, from its metadata and tensor shapes.

    Raises:
        ConfigError: an architecture this engine does not run (naming it and the ones it does),
            a dense model, a missing or ill-typed key (naming it), a RoPE scaling not supported.
    """
    arch = g.arch
    if arch not in ARCHS:
        raise ConfigError(f"{g.files[0]}: GGUF architecture {arch!r} is not supported; colibri imports "
                          f"{', '.join(ARCHS)} (mixture-of-experts models)")
    E = g.key("expert_count", optional=True, default=0)
    if not E:
        raise ConfigError(f"{g.files[0]}: a dense {arch} model ({arch}.expert_count is absent or 0); colibri "
                          f"runs mixture-of-experts models only")
    D = g.key("embedding_length")
    heads = g.key("attention.head_count")
    kvh = g.key("attention.head_count_kv", optional=True, default=heads)
    L = g.key("block_count")
    tokens = g.kv.get("tokenizer.ggml.tokens")
    vocab = g.key("vocab_size", optional=True) or (len(tokens) if tokens else None)
    if vocab is None:
        vocab = int(g.tensor("token_embd.weight").shape[1])
    scaling = g.key("rope.scaling.type", (str,), optional=True, default="none")
    yarn = arch in ("gpt-oss", "deepseek2") and scaling == "yarn"
    if not yarn and (scaling not in ("none", "linear") or
                     (scaling == "linear" and g.key("rope.scaling.factor", (float,), optional=True, default=1.0) != 1.0)):
        raise ConfigError(f"{g.files[0]}: {arch}.rope.scaling.type = {scaling!r}: RoPE scaling is not supported "
                          f"for GGUF imports yet")
    cfg = {
        "hidden_size": D, "num_hidden_layers": L, "num_attention_heads": heads, "num_key_value_heads": kvh,
        "num_experts_per_tok": g.key("expert_used_count"), "vocab_size": int(vocab),
        "max_position_embeddings": g.key("context_length", optional=True, default=4096),
        "rms_norm_eps": g.key("attention.layer_norm_rms_epsilon", (float,)),
        "rope_theta": g.key("rope.freq_base", (float,), optional=True, default=10000.0),
        "tie_word_embeddings": "output.weight" not in g.tensors, "hidden_act": "silu",
    }
    if arch == "deepseek2":
        return _deepseek2_config(g, cfg, E, yarn)
    if arch in gguf_families.ARCHS:
        return _special_ids(g, gguf_families.hf_config(g, cfg, E))
    hd = g.key("attention.key_length", optional=True)
    if hd is not None:
        vd = g.key("attention.value_length", optional=True, default=hd)
        if vd != hd:
            raise ConfigError(f"{g.files[0]}: {arch}.attention.key_length {hd} != value_length {vd}; not supported")
        cfg["head_dim"] = hd
    ff = g.key("feed_forward_length", optional=True)
    if arch == "qwen3moe":
        cfg.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=E,
                   moe_intermediate_size=g.key("expert_feed_forward_length"), norm_topk_prob=True,
                   intermediate_size=ff or g.key("expert_feed_forward_length"))
    elif arch == "qwen2moe":
        cfg.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=E,
                   moe_intermediate_size=g.key("expert_feed_forward_length"), norm_topk_prob=False,
                   shared_expert_intermediate_size=g.key("expert_shared_feed_forward_length"),
                   intermediate_size=ff or g.key("expert_feed_forward_length"),
                   qkv_bias="blk.0.attn_q.bias" in g.tensors)
    elif arch == "olmoe":
        cfg.update(model_type="olmoe", architectures=["OlmoeForCausalLM"], num_experts=E,
                   intermediate_size=_expert_width(g, ff), norm_topk_prob=False, clip_qkv=None)
    elif arch == "glm4moe":
        return _glm4moe_config(g, cfg, E)
    elif arch == "qwen3next":
        return _qwen3next_config(g, cfg, E)
    elif arch == "gpt-oss":  # sliding-window layers first, then every other (llama.cpp's swa pattern 2)
        cfg.update(model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_local_experts=E,
                   intermediate_size=_expert_width(g, ff), attention_bias="blk.0.attn_q.bias" in g.tensors,
                   sliding_window=g.key("attention.sliding_window"),
                   layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)])
        rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        if yarn:
            rope.update(rope_type="yarn", factor=g.key("rope.scaling.factor", (float,)),
                        original_max_position_embeddings=g.key("rope.scaling.original_context_length"),
                        beta_fast=g.key("rope.scaling.yarn_beta_fast", (float,), optional=True, default=32.0),
                        beta_slow=g.key("rope.scaling.yarn_beta_slow", (float,), optional=True, default=1.0),
                        truncate=False)
        cfg["rope_parameters"] = rope
    else:  # llama with experts: Mixtral
        cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=E,
                   intermediate_size=_expert_width(g, ff))
    if g.key("expert_weights_scale", (float,), optional=True, default=1.0) not in (0.0, 1.0):
        raise ConfigError(f"{g.files[0]}: {arch}.expert_weights_scale != 1 is not supported")
    return _special_ids(g, cfg)


def _special_ids(g: GGUFModel, cfg: dict) -> dict:
    for k, gk in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        v = g.kv.get(gk)
        if isinstance(v, int) and not isinstance(v, bool):
            cfg[k] = v
    return cfg


def _glm4moe_config(g: GGUFModel, cfg: dict, E: int) -> dict:
    """config.json of a ``glm4moe`` GGUF (GLM-4.5 / 4.6 / 4.5-Air). llama.cpp's converter counts
    the multi-token-prediction layers in ``block_count`` (``nextn_predict_layers`` of them, last):
    they are not decoder layers (``num_nextn_predict_layers``; the import keeps the first as the
    MTP head, :class:`GGUFSource`). The rotary width is ``rope.dimension_count`` of each head's ``head_dim``
    (rotate-half, as transformers: nothing permuted); q/k norms and q/k/v biases when the file has
    them; the router renormalises only when ``expert_weights_norm`` says so (llama.cpp's default)."""
    L = cfg["num_hidden_layers"] - g.key("nextn_predict_layers", optional=True, default=0)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rd = g.key("rope.dimension_count", optional=True, default=hd // 2)
    k_dense = g.key("leading_dense_block_count", optional=True, default=0)
    gating = g.key("expert_gating_func", optional=True, default=2)
    if _GATING.get(gating) != "sigmoid":
        raise ConfigError(f"{g.files[0]}: {g.arch}.expert_gating_func = {gating}: GLM-4 MoE routes with a sigmoid (2)")
    n_group = g.key("expert_group_count", optional=True, default=1)
    cfg.update(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], num_hidden_layers=L, head_dim=hd,
               n_routed_experts=E, moe_intermediate_size=g.key("expert_feed_forward_length"),
               n_shared_experts=g.key("expert_shared_count", optional=True, default=0),
               first_k_dense_replace=k_dense, n_group=n_group,
               topk_group=g.key("expert_group_used_count", optional=True, default=n_group),
               norm_topk_prob=bool(g.key("expert_weights_norm", (bool, int), optional=True, default=False)),
               routed_scaling_factor=g.key("expert_weights_scale", (float,), optional=True, default=1.0) or 1.0,
               use_qk_norm="blk.0.attn_q_norm.weight" in g.tensors, attention_bias="blk.0.attn_q.bias" in g.tensors,
               num_nextn_predict_layers=cfg["num_hidden_layers"] - L,
               rope_parameters={"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
                                "partial_rotary_factor": rd / hd})
    if k_dense:
        cfg["intermediate_size"] = g.key("feed_forward_length")
    return _special_ids(g, cfg)


def _qwen3next_config(g: GGUFModel, cfg: dict, E: int) -> dict:
    """config.json of a ``qwen3next`` GGUF (Qwen3-Next). Gated DeltaNet sizes from the ``ssm.*``
    keys as llama.cpp's converter writes them (``state_size`` = key head dim, ``group_count`` =
    key heads, ``time_step_rank`` = value heads, ``inner_size`` = value heads x value head dim);
    which layers are linear from ``attention.recurrent_layers``, else ``full_attention_interval``
    (llama.cpp's rule); the multi-token-prediction layers counted in ``block_count`` left out."""
    L = cfg["num_hidden_layers"] - g.key("nextn_predict_layers", optional=True, default=0)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    nv, nk = g.key("ssm.time_step_rank"), g.key("ssm.group_count")
    inner = g.key("ssm.inner_size")
    if not nv or not nk or inner % nv:
        raise ConfigError(f"{g.files[0]}: {g.arch}.ssm.inner_size {inner} is not a multiple of "
                          f"{g.arch}.ssm.time_step_rank {nv} (or a head count is 0); the file is inconsistent")
    rec = g.kv.get(f"{g.arch}.attention.recurrent_layers")
    if isinstance(rec, list) and len(rec) >= L:
        linear = [bool(x) for x in rec[:L]]
    else:
        every = g.key("full_attention_interval", optional=True, default=4)
        linear = [(i + 1) % every != 0 for i in range(L)]
    ff = g.key("expert_feed_forward_length")
    cfg.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], num_hidden_layers=L, head_dim=hd,
               num_experts=E, moe_intermediate_size=ff, norm_topk_prob=True,
               shared_expert_intermediate_size=g.key("expert_shared_feed_forward_length"),
               intermediate_size=g.key("feed_forward_length", optional=True) or ff,
               linear_conv_kernel_dim=g.key("ssm.conv_kernel"), linear_key_head_dim=g.key("ssm.state_size"),
               linear_num_key_heads=nk, linear_num_value_heads=nv, linear_value_head_dim=inner // nv,
               layer_types=["linear_attention" if x else "full_attention" for x in linear],
               rope_parameters={"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
                                "partial_rotary_factor": g.key("rope.dimension_count", optional=True,
                                                               default=hd // 4) / hd})
    if g.key("expert_weights_scale", (float,), optional=True, default=1.0) not in (0.0, 1.0):
        raise ConfigError(f"{g.files[0]}: {g.arch}.expert_weights_scale != 1 is not supported")
    return _special_ids(g, cfg)


# llama.cpp's expert_gating_func values
_GATING = {1: "softmax", 2: "sigmoid"}


def _deepseek2_config(g: GGUFModel, cfg: dict, E: int, yarn: bool) -> dict:
    """config.json of a ``deepseek2`` GGUF (DeepSeek-V2 / V3, Kimi-K2): a sigmoid router
    (``expert_gating_func`` 2, with ``exp_probs_b``) is DeepSeek-V3's family, a softmax one
    (1, or absent as in the first V2 files, as llama.cpp reads them) DeepSeek-V2's.

    MLA sizes: llama.cpp writes the latent view as ``attention.key_length`` = kv_lora_rank +
    rope width and ``value_length`` = kv_lora_rank, the per-head sizes as ``key_length_mla`` /
    ``value_length_mla``; files older than those two keys carry the per-head sizes in
    ``key_length`` / ``value_length``.
    """
    L = cfg["num_hidden_layers"] - g.key("nextn_predict_layers", optional=True, default=0)
    dr = g.key("rope.dimension_count")
    if g.key("attention.key_length_mla", optional=True) is not None:
        qk, dv = g.key("attention.key_length_mla"), g.key("attention.value_length_mla")
    else:
        qk, dv = g.key("attention.key_length"), g.key("attention.value_length")
    if qk <= dr:
        raise ConfigError(f"{g.files[0]}: {g.arch}.attention.key_length_mla ({qk}) is not larger than "
                          f"{g.arch}.rope.dimension_count ({dr}); the file is inconsistent")
    gating = g.key("expert_gating_func", optional=True, default=1)
    if gating not in _GATING:
        raise ConfigError(f"{g.files[0]}: {g.arch}.expert_gating_func = {gating} is not supported "
                          f"(1 softmax or 2 sigmoid)")
    v3 = _GATING[gating] == "sigmoid"
    n_group = g.key("expert_group_count", optional=True, default=1)
    topk_group = g.key("expert_group_used_count", optional=True, default=n_group)
    k_dense = g.key("leading_dense_block_count", optional=True, default=0)
    qr = g.key("attention.q_lora_rank", optional=True, default=0)
    cfg.update(num_hidden_layers=L, num_key_value_heads=cfg["num_attention_heads"], n_routed_experts=E,
               q_lora_rank=qr or None, kv_lora_rank=g.key("attention.kv_lora_rank"),
               qk_nope_head_dim=qk - dr, qk_rope_head_dim=dr, v_head_dim=dv,
               moe_intermediate_size=g.key("expert_feed_forward_length"),
               n_shared_experts=g.key("expert_shared_count", optional=True, default=0),
               first_k_dense_replace=k_dense,
               norm_topk_prob=bool(g.key("expert_weights_norm", (bool, int), optional=True, default=False)),
               routed_scaling_factor=g.key("expert_weights_scale", (float,), optional=True, default=1.0) or 1.0,
               scoring_func=_GATING[gating], n_group=n_group, topk_group=topk_group, rope_interleave=True,
               attention_bias=False)
    if k_dense:
        cfg["intermediate_size"] = g.key("feed_forward_length")
    if v3:  # its multi-token-prediction layers as GLM-4.5's (DeepSeek-V2 has none)
        cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], topk_method="noaux_tc",
                   num_nextn_predict_layers=g.key("nextn_predict_layers", optional=True, default=0))
    else:
        cfg.update(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"],
                   topk_method="group_limited_greedy" if n_group > 1 else "greedy")
    rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if yarn:
        # llama.cpp stores 0.1 * mscale_all_dim as the log multiplier and takes mscale equal to it
        mall = g.key("rope.scaling.yarn_log_multiplier", (float,), optional=True, default=0.0) / 0.1
        rope.update(rope_type="yarn", factor=g.key("rope.scaling.factor", (float,)),
                    original_max_position_embeddings=g.key("rope.scaling.original_context_length"),
                    beta_fast=g.key("rope.scaling.yarn_beta_fast", (float,), optional=True, default=32.0),
                    beta_slow=g.key("rope.scaling.yarn_beta_slow", (float,), optional=True, default=1.0))
        if mall:
            rope.update(mscale=mall, mscale_all_dim=mall)
    cfg["rope_parameters"] = rope
    return _special_ids(g, cfg)


def _expert_width(g: GGUFModel, ff) -> int:
    """The routed expert width: ``expert_feed_forward_length`` when written, else
    ``feed_forward_length`` (OLMoE's and Mixtral's converters write the expert width there)."""
    w = g.key("expert_feed_forward_length", optional=True)
    if w:
        return w
    if ff is None:
        raise ConfigError(f"{g.files[0]}: the GGUF metadata has neither {g.arch}.expert_feed_forward_length nor "
                          f"{g.arch}.feed_forward_length; this file cannot be imported")
    return ff


# --- tensors ------------------------------------------------------------------------------------

def _dequantize(t) -> np.ndarray:
    """float32 numpy array of a ReaderTensor (gguf.quants' decoding), numpy shape."""
    from gguf.quants import dequantize
    return np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32)


def _dequantize_rows(t, e: int) -> np.ndarray:
    """float32 values of index ``e`` of a stacked ReaderTensor's first numpy axis."""
    from gguf.quants import dequantize
    return np.asarray(dequantize(np.asarray(t.data[e]), t.tensor_type), dtype=np.float32).reshape(-1)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's Llama converter's q/k row permutation (it permutes rotate-half
    rows into the interleaved pairs ggml's RoPE rotates): rows [n_head, S/2, 2] -> [n_head, 2, S/2]."""
    rows = w.shape[0]
    return np.ascontiguousarray(w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2)).reshape(w.shape)


class _PerExpert:
    """A layer's per-expert tensors (blk.N.ffn_gate.E.weight) seen as one stacked tensor: ``data[e]``
    is expert e's rows, ``shape`` ggml's [N, O, E], the type and name those of expert 0."""

    def __init__(self, tensors: list):
        self.tensors = tensors
        t0 = tensors[0]
        self.name, self.tensor_type = t0.name, t0.tensor_type
        self.types = [int(t.tensor_type) for t in tensors]
        self.shape = [int(t0.shape[0]), int(t0.shape[1]), len(tensors)]
        self.data = [t.data for t in tensors]
        for t in tensors:
            if [int(x) for x in t.shape] != self.shape[:2]:
                raise CheckpointError(f"{t.name} has ggml shape {[int(x) for x in t.shape]}, expert 0 "
                                      f"{self.shape[:2]}; the file is inconsistent")


class _InFile:
    """The Hugging Face names whose GGUF tensor ``g`` holds (``name in _InFile(g)``; MLA's
    kv_b_proj also as llama.cpp's split attn_k_b / attn_v_b)."""

    def __init__(self, g: GGUFModel):
        self.g = g

    def __contains__(self, hf: str) -> bool:
        try:
            name = gguf_name(hf, self.g.arch)
        except KeyError:
            return False
        return name in self.g.tensors or (name.endswith(".attn_kv_b.weight") and
                                          name.replace(".attn_kv_b.", ".attn_k_b.") in self.g.tensors)


class GGUFSource:
    """The tensors of a GGUF model under the family's Hugging Face names (float32) and its routed
    experts as block rows, for :func:`convert_gguf`.

    Raises (constructor): ConfigError / CheckpointError as hf_config and GGUFModel; a missing
    tensor, a tensor whose shape disagrees with the metadata, or an expert block type this
    engine does not compute on (naming the tensor and its type).
    """

    def __init__(self, g: GGUFModel):
        from .models import family_for
        from .mtp import dense_tensors, kept_heads, with_heads
        self.g = g
        self.config = hf_config(g)
        self.family = family_for(self.config["model_type"])
        try:
            self.args = self.family.ModelArgs.from_dict(self.config, f"{g.files[0]} (metadata)")
        except ConfigError:
            raise
        # the first next-n layer (blk.{L}.* and blk.{L}.nextn.*) as the MTP head, as a checkpoint's conversion
        a = self.args = with_heads(self.args, kept_heads(self.args, _InFile(g)))
        D, I = a.hidden_size, a.moe_intermediate_size
        self.tensors = dense_tensors(self.family, a)
        for t in self.tensors:
            if self._kv_b_parts(t.hf):
                H, r = a.num_attention_heads, a.kv_lora_rank
                want = {"attn_k_b": H * r * a.qk_nope_head_dim, "attn_v_b": H * a.v_head_dim * r}
                parts = [(gt, want[gt.name.split(".")[2]]) for gt in self._kv_b_parts(t.hf)]
            elif self._qkvz_parts(t.hf):
                parts = list(zip(self._qkvz_parts(t.hf), (a.conv_dim * D, a.value_dim * D)))
            else:
                parts = [(self._gguf_tensor(t.hf), int(np.prod(t.shape)))]
            for gt, n in parts:
                if int(gt.n_elements) != n:
                    raise CheckpointError(f"{g.files[0]}: tensor {gt.name} holds {gt.n_elements} values, the "
                                          f"metadata implies {n}; the file is inconsistent")
        # experts: per MoE layer, per projection: (tensor, ggml type, row bytes)
        self.expert_rows: list[dict] = []
        self.expert_biases: list[dict] = []  # per MoE layer: proj -> (bias tensor numpy [E, rows], first row)
        shapes = {"gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I)}
        for i in a.moe_layers:
            row, biases = {}, {}
            fused = g.tensors.get(f"blk.{i}.ffn_gate_up_exps.weight")
            for proj in PROJS:
                stacked = f"blk.{i}.{_EXPERT_NAMES[proj]}"
                old = f"blk.{i}.{_PER_EXPERT_NAMES[proj]}.%d.weight"
                if fused is not None and proj != "down_proj":
                    t, lo = fused, (0 if proj == "gate_proj" else I)
                elif stacked not in g.tensors and old % 0 in g.tensors:
                    t, lo = _PerExpert([g.tensor(old % e) for e in range(a.num_experts)]), 0
                else:
                    t, lo = g.tensor(stacked), 0
                O, N = shapes[proj]
                ty = int(t.tensor_type)
                if ty not in BLOCK_TYPES:
                    raise CheckpointError(f"{g.files[0]}: {t.name} is {t.tensor_type.name}, a block type colibri "
                                          f"does not compute on yet; supported: "
                                          f"{', '.join(n for n, _b, _s in BLOCK_TYPES.values())}")
                want_rows = 2 * I if t is fused else O
                if [int(x) for x in t.shape] != [N, want_rows, a.num_experts]:
                    raise CheckpointError(f"{g.files[0]}: {t.name} has ggml shape {[int(x) for x in t.shape]}, the "
                                          f"metadata implies {[N, want_rows, a.num_experts]}")
                row[proj] = (t, ty, row_bytes(ty, N), lo)
                if a.expert_bias:  # gpt-oss: ffn_*_exps.bias, float32 [E, rows]
                    bt = g.tensor(t.name[:-len(".weight")] + ".bias")
                    if [int(x) for x in bt.shape] != [want_rows, a.num_experts]:
                        raise CheckpointError(f"{g.files[0]}: {bt.name} has ggml shape {[int(x) for x in bt.shape]}, "
                                              f"the metadata implies {[want_rows, a.num_experts]}")
                    biases[proj] = (bt, lo)
            self.expert_rows.append(row)
            self.expert_biases.append(biases)
        self.widths = {p: max(r[p][2] for r in self.expert_rows) for p in PROJS}

    def _gguf_tensor(self, hf: str):
        try:
            name = gguf_name(hf, self.g.arch)
        except KeyError:
            raise CheckpointError(f"{self.g.files[0]}: the {self.g.arch} import has no GGUF name for {hf}") from None
        return self.g.tensor(name)

    def _kv_b_parts(self, hf: str) -> list:
        """[attn_k_b, attn_v_b] when ``hf`` is MLA's kv_b_proj and the file holds it split as
        llama.cpp's converter writes it since its absorbed-MLA layout; [] otherwise."""
        if not hf.endswith("self_attn.kv_b_proj.weight"):
            return []
        blk = gguf_name(hf, self.g.arch)[: -len("attn_kv_b.weight")]
        if blk + "attn_kv_b.weight" in self.g.tensors:
            return []
        return [self.g.tensor(blk + "attn_k_b.weight"), self.g.tensor(blk + "attn_v_b.weight")]

    def _qkvz_parts(self, hf: str) -> list:
        """[attn_qkv, attn_gate] when ``hf`` is Qwen3-Next's in_proj_qkvz (llama.cpp's converter
        writes it as those two); [] otherwise."""
        if self.g.arch != "qwen3next" or not hf.endswith("linear_attn.in_proj_qkvz.weight"):
            return []
        blk = "blk." + hf.split(".")[2] + "."
        return [self.g.tensor(blk + n) for n in _QWEN3NEXT_QKVZ]

    def _qwen3next(self, hf: str, shape: tuple) -> np.ndarray:
        """float32 Hugging Face tensor ``hf`` of a ``qwen3next`` file: the inverse of llama.cpp's
        converter, which regroups in_proj_qkvz [nk * (q dk, k dk, v r dv, z r dv), D] into attn_qkv
        [q of every key head, then k, then v; D] and attn_gate [z; D], stores A_log as
        ssm_a = -exp(A_log), conv1d [Cc, 1, Kc] squeezed to [Cc, Kc], and the zero-centred norms'
        weights plus one (the linear attention's own norm excepted)."""
        a = self.args
        if self._qkvz_parts(hf):
            nk, dk, dv = a.linear_num_key_heads, a.linear_key_head_dim, a.linear_value_head_dim
            qkv, z = (_dequantize(t) for t in self._qkvz_parts(hf))
            D = qkv.shape[-1]
            qkv = qkv.reshape(-1, D)
            q, k, v = (qkv[:nk * dk], qkv[nk * dk:2 * nk * dk], qkv[2 * nk * dk:])
            groups = [x.reshape(nk, -1, D) for x in (q, k, v, z.reshape(-1, D))]
            return np.ascontiguousarray(np.concatenate(groups, axis=1)).reshape(shape)
        w = _dequantize(self._gguf_tensor(hf)).reshape(shape)
        if hf.endswith("linear_attn.A_log"):
            with np.errstate(divide="ignore", invalid="ignore"):
                return np.log(-w).astype(np.float32)  # a value >= 0 gives NaN: check_finite names it
        if hf.endswith(_PLUS_ONE_NORMS):
            return (w - np.float32(1)).astype(np.float32)
        return w

    def get(self, hf: str, shape: tuple) -> np.ndarray:
        """float32 tensor ``hf`` in its Hugging Face shape (q/k un-permuted for llama; MLA's
        kv_b_proj joined again from llama.cpp's attn_k_b [H, r, dn] and attn_v_b [H, dv, r])."""
        split = self._kv_b_parts(hf)
        if split:
            a = self.args
            H, r, dn, dv = a.num_attention_heads, a.kv_lora_rank, a.qk_nope_head_dim, a.v_head_dim
            kb = _dequantize(split[0]).reshape(H, r, dn).transpose(0, 2, 1)
            vb = _dequantize(split[1]).reshape(H, dv, r)
            return np.ascontiguousarray(np.concatenate([kb, vb], axis=1)).reshape(shape)
        if self.g.arch == "qwen3next":
            return self._qwen3next(hf, shape)
        w = _dequantize(self._gguf_tensor(hf)).reshape(shape)
        if self.g.arch == "llama" and hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = self.args.num_attention_heads if ".q_proj" in hf else self.args.num_key_value_heads
            w = _unpermute(w, heads)
        return w

    def nbytes(self, hf: str) -> int:
        split = self._kv_b_parts(hf) or self._qkvz_parts(hf)
        return sum(int(t.n_bytes) for t in split) if split else int(self._gguf_tensor(hf).n_bytes)

    def expert_block_rows(self, j: int, e: int, proj: str) -> tuple[int, np.ndarray]:
        """(ggml type, uint8 [O, row bytes]) of expert ``e``'s ``proj`` in MoE layer ``j``."""
        t, ty, rb, lo = self.expert_rows[j][proj]
        O = self.args.moe_intermediate_size if proj != "down_proj" else self.args.hidden_size
        data = np.asarray(t.data[e])
        if int(t.tensor_type if not isinstance(t, _PerExpert) else t.types[e]) != ty:
            raise CheckpointError(f"{self.g.files[0]}: the experts of {t.name} are of different block types; "
                                  f"not supported")
        return ty, np.ascontiguousarray(data[lo:lo + O]).view(np.uint8).reshape(O, rb)

    def expert_bias(self, j: int, e: int, proj: str) -> np.ndarray:
        """float32 [O]: expert ``e``'s bias of ``proj`` in MoE layer ``j`` (gpt-oss)."""
        bt, lo = self.expert_biases[j][proj]
        O = self.args.moe_intermediate_size if proj != "down_proj" else self.args.hidden_size
        return _dequantize_rows(bt, e)[lo:lo + O]

    def expert_nbytes(self, j: int) -> int:
        return sum(r[2] * (self.args.moe_intermediate_size if p != "down_proj" else self.args.hidden_size)
                   for p, r in self.expert_rows[j].items())


# --- the store ----------------------------------------------------------------------------------

def convert_gguf(src: str | os.PathLike, dst: str | os.PathLike, overwrite: bool = False,
                 dense_quant: str = "int8", group_size: int = 32,
                 progress: Callable[[LoadProgress], None] | None = None,
                 cancel: threading.Event | None = None, extra_manifest: dict | None = None) -> Path:
    """Import the GGUF model at ``src`` (a file, a split's part, or a folder) as a store at ``dst``.

    Args:
        dense_quant: the resident dense matrices' format ("int8", "int4", "f16", "f32"); the
            routed experts keep their GGUF blocks.
        progress: LoadProgress(stage="convert", done=bytes, total=bytes, unit="B").
        cancel: set to stop; raises Cancelled, leaving nothing.
        extra_manifest: keys added to (or replacing) the manifest's (a hub download's source).

    Returns: the store path.

    Raises:
        CheckpointError / ConfigError: the file(s) cannot be imported (one line, raised before
            anything is written). FileExistsError: as convert.check_destination.
        ValueError: an unknown ``dense_quant``. Cancelled: ``cancel`` was set.
    """
    from .convert import check_destination, check_group_size, check_int4_dense
    from .quant import EXPERT_ONLY_QUANTS, QUANTS
    if dense_quant not in QUANTS or dense_quant in EXPERT_ONLY_QUANTS:
        raise ValueError(f"--dense-quant {dense_quant!r}: choose one of "
                         f"{', '.join(q for q in QUANTS if q not in EXPERT_ONLY_QUANTS)}")
    check_group_size(group_size, dense_quant == "int4")
    src, dst = Path(src), Path(dst)
    check_destination(dst, overwrite)
    with GGUFModel(src) as g:
        source = GGUFSource(g)
        if dense_quant == "int4":
            check_int4_dense(g.files[0], source.family, source.args, source.tensors, group_size,
                             name_of=lambda t: gguf_name(t.hf, g.arch))
        from .gguf_tokenizer import tokenizer_files
        tok = tokenizer_files(g)  # checked before anything is written
        return _write_store(source, tok, dst, overwrite, dense_quant, group_size, progress, cancel,
                            extra_manifest)


def _write_store(source: GGUFSource, tok: dict, dst: Path, overwrite: bool, dq: str, group_size: int,
                 progress, cancel, extra_manifest: dict | None = None) -> Path:
    from .convert import (CHECKSUM, LM_HEAD_QUANT, _identity, _publish, _put, _remove_stale_temps,
                          check_destination, write_dense)
    from .fsutil import fsync_dir, normalize_modes
    from .quant import ALIGN, check_finite
    from .store_format import FORMAT_NAME, FORMAT_VERSION, check_store_files, slab_checksum

    g, a, fam = source.g, source.args, source.family
    label = g.files[0]
    D, I, E, M = a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_moe_layers
    layout = gguf_slab_layout(D, I, source.widths, bias=a.expert_bias)
    check_destination(dst, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    seen = _identity(dst)
    _remove_stale_temps(dst)
    partial = Path(tempfile.mkdtemp(prefix=f".{dst.name}.{os.getpid()}.", suffix=".partial", dir=dst.parent))
    total = sum(source.nbytes(t.hf) for t in {t.hf: t for t in source.tensors}.values())
    total += sum(source.expert_nbytes(j) * E for j in range(M))
    done, last = 0, 0.0

    def report(msg: str, force: bool = False) -> None:
        nonlocal last
        now = time.monotonic()
        if progress and (force or now - last > 0.1):
            last = now
            progress(LoadProgress("convert", done, total, "B", msg))

    def check_cancel() -> None:
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"import of {label} cancelled; nothing was written to {dst}")

    try:
        (partial / "experts").mkdir()
        dense: dict[str, np.ndarray] = {}
        counted: set[str] = set()
        for t in source.tensors:
            check_cancel()
            w = source.get(t.hf, t.shape)
            check_finite(gguf_name(t.hf, g.arch), w, "f32" if t.kind == "keep" else dq, str(label))
            if t.split:  # one tensor stored as several (MLA's kv_b_proj: k_absorb, v_absorb)
                for name, part in fam.split_tensor(a, t, w).items():
                    _put(dense, name, part, dq, group_size)
            elif t.kind == "keep":
                dense[t.ours] = np.ascontiguousarray(w, np.float32)
            elif t.ours in ("embed_tokens", "lm_head"):
                _put(dense, t.ours, w, LM_HEAD_QUANT.get(dq, dq), group_size)
            else:
                _put(dense, t.ours, w, dq, group_size)
            if t.hf not in counted:
                counted.add(t.hf)
                done += source.nbytes(t.hf)
            report(gguf_name(t.hf, g.arch))
        experts_meta, types_meta = [], []
        slab = np.zeros(layout["slot_bytes"], np.uint8)
        offs = {name: (off, shape) for name, off, _dt, shape in layout["fields"]}
        for j, i in enumerate(a.moe_layers):
            rel = f"experts/layer_{j:03d}.bin"
            metas = []
            types_meta.append([type_name(source.expert_rows[j][p][1]) for p in PROJS])
            with open(partial / rel, "wb") as f:
                for e in range(E):
                    check_cancel()
                    slab[:] = 0
                    for k, proj in enumerate(PROJS):
                        ty, rows = source.expert_block_rows(j, e, proj)
                        slab[k] = ty
                        off, (O, width) = offs[f"{proj}.q"]
                        view = slab[off:off + O * width].reshape(O, width)
                        view[:, :rows.shape[1]] = rows
                        if a.expert_bias:
                            boff, (bo,) = offs[f"{proj}.b"]
                            slab[boff:boff + 4 * bo].view(np.float32)[:] = source.expert_bias(j, e, proj)
                    done += source.expert_nbytes(j)
                    metas.append({"file": rel, "offset": f.tell(), "length": layout["slot_bytes"],
                                  CHECKSUM: slab_checksum(CHECKSUM, slab)})
                    f.write(slab.tobytes())
                    report(f"blk.{i} expert {e}")
                f.flush()
                os.fsync(f.fileno())
            experts_meta.append(metas)
        check_cancel()
        report("dense weights", force=True)
        dense_bytes = write_dense(partial, dense, dq)
        del dense
        cfg = dict(source.config)
        (partial / "config.json").write_text(json.dumps(cfg, indent=1), encoding="utf-8")
        for name, text in tok.items():
            (partial / name).write_text(text, encoding="utf-8")
        manifest = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "model_type": a.model_type,
            "model_name": g.name, "source": str(g.files[0].resolve()),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "quant": "gguf", "dense_quant": dq, "group_size": group_size if dq == "int4" else None,
            "expert_layout": "row_major", "alignment": ALIGN, "checksum": CHECKSUM,
            "dense_file": "dense.safetensors", "dense_bytes": dense_bytes,
            "slab_layout": {"fields": [list(x) for x in layout["fields"]], "data_bytes": layout["data_bytes"],
                            "slot_bytes": layout["slot_bytes"]},
            "slot_bytes": [layout["slot_bytes"]] * M, "num_layers": M, "num_hidden_layers": a.num_hidden_layers,
            "moe_layers": list(a.moe_layers), **({"mtp_layers": a.mtp_layers} if a.mtp_layers else {}),
            "num_experts": E, "experts": experts_meta, "files": {},
            "gguf": {"architecture": g.arch, "files": [x.name for x in g.files],
                     "file_type": g.kv.get("general.file_type"), "row_bytes": source.widths,
                     "expert_types": types_meta},
            **(extra_manifest or {}),
        }
        manifest["files"] = {rel: (partial / rel).stat().st_size
                             for rel in ["dense.safetensors"] + [f"experts/layer_{j:03d}.bin" for j in range(M)]}
        with open(partial / "manifest.json", "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        check_store_files(partial, manifest)
        normalize_modes(partial)
        fsync_dir(partial / "experts")
        fsync_dir(partial)
        check_cancel()
        _publish(partial, dst, seen, manifest, overwrite)
        report("done", force=True)
        return dst
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def gguf_estimate(source: GGUFSource, context_length: int = 0, dense_quant: str = "int8",
                  extra_store_bytes: int = 0):
    """engine.sizing.Estimate of the store ``source`` imports to (quant "gguf": the experts' slabs
    at their published sizes, the dense weights at ``dense_quant``) before any import."""
    from .sizing import gguf_store_estimate
    return gguf_store_estimate(source.args, source.widths, context_length, dense_quant, extra_store_bytes)
