"""Seeded random MoE checkpoints (any family of engine/models) in Hugging Face layout, written
without torch, and stores written directly from the seed.

Used by the tests (tiny models), the benchmarks (1B-parameter, OLMoE-1B-7B-, Qwen3-30B-A3B- and
Mixtral-8x7B-shaped models) and nowhere at run time. Tensors are written shard by shard through
safetensors, so peak RSS stays near one shard (``shard_bytes``) whatever the model size.

Tensor n of ``checkpoint.hf_names(args)`` is drawn from ``np.random.default_rng([seed, n])``:
N(0, std) for matrices, 1 + N(0, 0.05) for vectors, rounded to the checkpoint dtype. The same
draw feeds :func:`write_store_from_seed`, so a store written from the seed equals the store
``convert_checkpoint`` makes from :func:`write_checkpoint`'s output with the same arguments.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from ..checkpoint import hf_names
from ..config import ModelArgs
from ..models import base, family_for
from ..fsutil import normalize_modes

TOKENIZER_SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def olmoe_config(**kw) -> dict:
    """A config.json dict for OLMoE with the given overrides."""
    cfg = {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 300,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "norm_topk_prob": False, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "clip_qkv": None, "eos_token_id": 0, "pad_token_id": 0,
        "bos_token_id": None, "router_aux_loss_coef": 0.01, "output_router_logits": False,
    }
    cfg.update(kw)
    return cfg


def qwen3_moe_config(**kw) -> dict:
    """A tiny Qwen3-MoE config.json dict (Qwen3MoeConfig names) with the given overrides."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "vocab_size": 300, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "norm_topk_prob": True, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "use_sliding_window": False, "sliding_window": None, "eos_token_id": 0, "bos_token_id": None,
    }
    cfg.update(kw)
    return cfg


def mixtral_config(**kw) -> dict:
    """A tiny Mixtral config.json dict (MixtralConfig names) with the given overrides."""
    cfg = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": None, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "sliding_window": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 2, "bos_token_id": 1,
    }
    cfg.update(kw)
    return cfg


def qwen2_moe_config(**kw) -> dict:
    """A tiny Qwen2-MoE config.json dict (Qwen2MoeConfig names) with the given overrides."""
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 8,
        "num_experts_per_tok": 2, "vocab_size": 300, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "norm_topk_prob": False, "tie_word_embeddings": False, "hidden_act": "silu", "qkv_bias": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": 28, "eos_token_id": 0, "bos_token_id": None,
    }
    cfg.update(kw)
    return cfg


def deepseek_v3_config(**kw) -> dict:
    """A tiny DeepSeek-V3 config.json dict (DeepseekV3Config names) with the given overrides:
    MLA with q LoRA, 8 experts in 4 groups (2 kept), a shared expert, layer 0 dense."""
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4,
        "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "rope_interleave": True,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "num_nextn_predict_layers": 1, "eos_token_id": 0, "bos_token_id": None,
    }
    cfg.update(kw)
    return cfg


def deepseek_v2_config(**kw) -> dict:
    """A tiny DeepSeek-V2-Lite-like config.json dict (plain q_proj, softmax greedy routing)."""
    cfg = deepseek_v3_config(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
                             topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
                             routed_scaling_factor=1.0, n_shared_experts=2, n_group=None, topk_group=None)
    for k in ("rope_interleave", "num_nextn_predict_layers"):
        cfg.pop(k)
    cfg.update(kw)
    return cfg


def glm4_moe_config(**kw) -> dict:
    """A tiny GLM-4.5-like config.json dict (Glm4MoeConfig names): GQA 8/2, biases, q/k norm,
    partial rotary 0.5, one dense layer, sigmoid routing over 2 groups."""
    cfg = {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
        "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.5, "use_qk_norm": True,
        "attention_bias": True, "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "tie_word_embeddings": False, "hidden_act": "silu", "num_nextn_predict_layers": 1,
        "eos_token_id": 0, "bos_token_id": None,
    }
    cfg.update(kw)
    return cfg


def glm4_moe_lite_config(**kw) -> dict:
    """A tiny GLM-4.7-Flash config.json dict (Glm4MoeLiteConfig names): deepseek_v3_config's MLA
    and router with ``mlp_layer_types`` (layer 0 dense) instead of first_k_dense_replace."""
    cfg = deepseek_v3_config(architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", n_group=2,
                             topk_group=1, rms_norm_eps=1e-5, routed_scaling_factor=1.8)
    for k in ("topk_method", "scoring_func", "first_k_dense_replace"):
        cfg.pop(k)
    cfg.update(kw)
    cfg.setdefault("mlp_layer_types", ["dense"] + ["sparse"] * (cfg["num_hidden_layers"] - 1))
    return cfg


def deepseek_v32_config(**kw) -> dict:
    """A tiny DeepSeek-V3.2 config.json dict: deepseek_v3_config's model plus the sparse-attention
    indexer (16 heads of 16, index_topk 8, so prompts of more than 8 tokens are sparse)."""
    cfg = deepseek_v3_config(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                             index_n_heads=16, index_head_dim=16, index_topk=8)
    cfg.pop("rope_interleave")
    cfg.update(kw)
    return cfg


def glm_moe_dsa_config(**kw) -> dict:
    """A tiny GLM-5 config.json dict (GlmMoeDsaConfig names): DeepSeek-V3.2's layer with 2 groups
    (1 kept), layer 0 dense, and the last layer "shared" (it reuses the previous layer's indexer
    selection) unless ``indexer_types`` is given."""
    cfg = deepseek_v32_config(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", n_group=2,
                              topk_group=1, rms_norm_eps=1e-5)
    cfg.pop("topk_method")
    cfg.pop("scoring_func")
    cfg.update(kw)
    L = cfg["num_hidden_layers"]
    cfg.setdefault("indexer_types", ["full"] + ["shared" if i == L - 1 else "full" for i in range(1, L)])
    return cfg


def gpt_oss_config(**kw) -> dict:
    """A tiny gpt-oss config.json dict (GptOssConfig names): GQA 4/2, head_dim 16, 8 experts
    top-2 of width 32, alternating sliding (window 6) / full layers, YaRN as published."""
    cfg = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 300,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "sliding_window": 6,
        "layer_types": None, "attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 0, "bos_token_id": None,
    }
    cfg.update(kw)
    if cfg["layer_types"] is None:
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(cfg["num_hidden_layers"])]
    return cfg




def ernie4_5_moe_config(**kw) -> dict:
    """A tiny ERNIE-4.5-21B-A3B-like config.json dict (Ernie4_5_MoeConfig names): GQA 4/2,
    layer 0 dense, 8 experts top-2 (``moe_k``) with one shared expert, tied embeddings."""
    cfg = {
        "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "moe_num_experts": 8, "moe_k": 2, "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1, "moe_layer_end_index": -1, "moe_layer_interval": 1, "moe_norm_min": 1e-12,
        "use_bias": False, "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": True,
        "hidden_act": "silu", "eos_token_id": 0, "bos_token_id": None, "pad_token_id": 0,
    }
    cfg.update(kw)
    return cfg


def dots1_config(**kw) -> dict:
    """A tiny dots.llm1-like config.json dict (Dots1Config names): GQA 4/2 with per-head q/k
    norms, layer 0 dense, 8 experts top-2 in 2 groups (1 kept) with one shared expert, scaled
    sigmoid routing; the last layer slides over 6 positions."""
    cfg = {
        "architectures": ["Dots1ForCausalLM"], "model_type": "dots1", "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "sliding_window": 6,
        "max_window_layers": 2, "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 0,
        "bos_token_id": None,
    }
    cfg.update(kw)
    return cfg


def hunyuan_v1_moe_config(**kw) -> dict:
    """A tiny Hunyuan-A13B-like config.json dict (HunYuanMoEV1Config names): GQA 4/2 with q/k
    norms after RoPE, NTK-alpha RoPE, 8 experts top-2 (``moe_topk``) of width 32 and a shared MLP."""
    cfg = {
        "architectures": ["HunYuanMoEV1ForCausalLM"], "model_type": "hunyuan_v1_moe", "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_experts": 8, "moe_topk": 2, "vocab_size": 300, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                  "rope_theta": 10000.0},
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 0,
        "bos_token_id": None,
    }
    cfg.update(kw)
    return cfg


def minimax_m2_config(**kw) -> dict:
    """A tiny MiniMax-M2-like config.json dict (MiniMaxM2Config names): GQA 4/2 of head_dim 16
    with whole-projection q/k norms and rotary_dim 8, 8 experts top-2 of width 32, sigmoid
    routing with the correction bias."""
    cfg = {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "rotary_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 300,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
        "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 0, "bos_token_id": None,
    }
    cfg.update(kw)
    return cfg


def llama4_text_config(**kw) -> dict:
    """A tiny Llama-4-like text config.json dict (Llama4TextConfig names): GQA 4/2 of head_dim 16,
    layer 3 of 4 without RoPE, chunks of 8, MoE on layers 1 and 3 (8 experts top-1 of width 32 and
    a shared expert), dense MLPs of 96, llama3 RoPE scaling, temperature tuning from position 3."""
    cfg = {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_size": 64,
        "intermediate_size": 32, "intermediate_size_mlp": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2, "no_rope_layer_interval": 4, "attention_chunk_size": 8,
        "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.1,
        "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 0, "bos_token_id": None,
    }
    cfg.update(kw)
    return cfg


def llama4_config(**kw) -> dict:
    """A tiny Llama 4 config.json dict as published (Llama4Config: :func:`llama4_text_config` with
    ``kw`` under ``text_config``; a vision tower config beside it, whose weights the synthetic
    checkpoint leaves out)."""
    text = llama4_text_config(**kw)
    text.pop("architectures")
    return {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
            "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 32, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "intermediate_size": 32, "image_size": 28, "patch_size": 14,
                              "vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 64},
            "eos_token_id": text.get("eos_token_id")}


def gemma4_text_config(**kw) -> dict:
    """A tiny Gemma-4-26B-A4B-like text config.json dict (Gemma4TextConfig names): sliding layers
    (window 6, 2 KV heads of 16; even layers but the last) and full layers (one KV head of 32 that is also V, proportional
    RoPE), a dense GeGLU of 64 beside 8 experts top-2 of width 32, logits soft-capped at 30."""
    cfg = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "hidden_size": 64,
        "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
        "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "sliding_window": 6, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 300, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6, "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}},
        "tie_word_embeddings": True, "eos_token_id": 0, "bos_token_id": None, "pad_token_id": 0,
    }
    cfg.update(kw)
    if "layer_types" not in kw:  # sliding, full, sliding, ..., the last one full
        L = cfg["num_hidden_layers"]
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 and i < L - 1 else "full_attention" for i in range(L)]
    return cfg


def gemma4_config(**kw) -> dict:
    """A tiny Gemma 4 config.json dict as published (Gemma4Config: :func:`gemma4_text_config` with
    ``kw`` under ``text_config``, no vision or audio tower)."""
    text = gemma4_text_config(**kw)
    text.pop("architectures")
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
            "vision_config": None, "audio_config": None,
            "tie_word_embeddings": text.pop("tie_word_embeddings", True), "eos_token_id": text.get("eos_token_id")}


def lfm2_moe_config(**kw) -> dict:
    """A tiny LFM2-8B-A1B-like config.json dict (Lfm2MoeConfig names): conv layers (3 taps) around
    a GQA 4/2 attention layer, layer 0 dense, 8 experts top-2 with the expert bias."""
    cfg = {
        "architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2, "num_dense_layers": 1,
        "use_expert_bias": True, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "conv_L_cache": 3,
        "conv_bias": False, "vocab_size": 300, "max_position_embeddings": 2048, "norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True,
        "eos_token_id": 0, "bos_token_id": None, "pad_token_id": 0,
    }
    cfg.update(kw)
    if "layer_types" not in kw:  # conv, attention, conv, conv, attention, ...
        cfg["layer_types"] = ["full_attention" if i % 3 == 1 else "conv" for i in range(cfg["num_hidden_layers"])]
    return cfg


def granitemoehybrid_config(**kw) -> dict:
    """A tiny Granite-4.0-H-like config.json dict (GraniteMoeHybridConfig names): Mamba2 layers
    (4 heads of 32 in 2 groups, d_state 8, 4-tap conv) around a NoPE GQA 4/2 layer, 8 experts
    top-2 of width 32 beside a shared MLP of 64, Granite multipliers."""
    cfg = {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": 64,
        "intermediate_size": 32, "shared_intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2, "mamba_n_heads": 4,
        "mamba_d_head": 32, "mamba_d_state": 8, "mamba_n_groups": 2, "mamba_expand": 2, "mamba_d_conv": 4,
        "mamba_conv_bias": True, "mamba_proj_bias": False, "position_embedding_type": None,
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.0625,
        "logits_scaling": 2.0, "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False,
        "hidden_act": "silu", "eos_token_id": 0, "bos_token_id": None,
    }
    cfg.update(kw)
    if "layer_types" not in kw:  # Mamba2, attention, Mamba2, Mamba2, attention, ...
        cfg["layer_types"] = ["full_attention" if i % 3 == 1 else "linear_attention"
                              for i in range(cfg["num_hidden_layers"])]
    return cfg


def kimi_linear_config(**kw) -> dict:
    """A tiny Kimi-Linear config.json dict (KimiLinearConfig names, as transformers saves them):
    KDA layers (4 heads of 16, 4-tap conv) around a NoPE MLA layer (kv LoRA 32, nope / rope / v
    16), layer 0 dense, 8 experts in 2 groups (1 kept) top-2 with the correction bias, one
    shared expert."""
    cfg = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_token": 2, "num_expert_group": 2,
        "topk_group": 1, "num_shared_experts": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446,
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
        "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": 300,
        "model_max_length": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
        "eos_token_id": 0, "bos_token_id": None, "pad_token_id": 0,
    }
    cfg.update(kw)
    L = cfg["num_hidden_layers"]
    if "layer_types" not in kw and "linear_attn_config" not in kw:  # KDA, MLA, KDA, KDA, MLA, ...
        cfg["layer_types"] = ["full_attention" if i % 3 == 1 else "linear_attention" for i in range(L)]
    if "mlp_layer_types" not in kw and "first_k_dense_replace" not in kw:
        cfg["mlp_layer_types"] = ["dense" if i < 1 else "sparse" for i in range(L)]
    return cfg


def deepseek_v4_config(**kw) -> dict:
    """A tiny DeepSeek-V4 config.json dict (DeepseekV4Config names): 4 heads over one shared KV
    head of 32 (rotary 8), 3 residual streams, a sliding layer (window 8), compressed sparse
    layers (every 4 positions, the indexer keeps 3) and a heavily compressed one (every 8),
    YaRN on the compressed branch, the first layer hash-routed, 8 experts top-2 with the
    correction bias, one shared expert."""
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 64,
        "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 32, "q_lora_rank": 32, "partial_rotary_factor": 0.25, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "hc_mult": 3, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "sliding_window": 8,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 8, "index_head_dim": 16, "index_topk": 3,
        "swiglu_limit": 10.0, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                         "attention_factor": 1.0, "partial_rotary_factor": 0.25}},
        "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "hidden_act": "silu", "eos_token_id": 0, "bos_token_id": None, "pad_token_id": 0,
    }
    cfg.update(kw)
    L = cfg["num_hidden_layers"]
    if "layer_types" not in kw:  # sliding, CSA, HCA, CSA, ...
        cfg["layer_types"] = ["sliding_attention"] + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(1, L)]
    if "mlp_layer_types" not in kw:
        cfg["mlp_layer_types"] = ["hash_moe"] + ["moe"] * (L - 1)
    return cfg


def qwen3_next_config(**kw) -> dict:
    """A tiny Qwen3-Next config.json dict (Qwen3NextConfig names): Gated DeltaNet layers (2 key /
    4 value heads of 16) with a gated full-attention layer every 4th (the last one when fewer
    layers), GQA 4/2, partial rotary 0.25, 8 experts top-2 and a gated shared expert."""
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "norm_topk_prob": True, "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": 0,
        "bos_token_id": None,
    }
    cfg.update(kw)
    if "layer_types" not in kw:
        L, every = cfg["num_hidden_layers"], min(4, cfg["num_hidden_layers"])
        cfg["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(L)]
    return cfg


def qwen3_5_moe_text_config(**kw) -> dict:
    """A tiny Qwen3.5-MoE text config.json dict (Qwen3_5MoeTextConfig names): as
    :func:`qwen3_next_config`, every layer MoE (mlp_only_layers / decoder_sparse_step / intermediate_size
    are not Qwen3.5 keys and are dropped)."""
    cfg = qwen3_next_config(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", **kw)
    for k in ("intermediate_size", "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob"):
        cfg.pop(k, None)
    return cfg


def qwen3_5_moe_config(**kw) -> dict:
    """A tiny Qwen3.5-MoE config.json dict as published (Qwen3_5MoeConfig: the language model's
    keys, :func:`qwen3_5_moe_text_config` with ``kw``, under ``text_config``; a vision tower
    config beside it, whose weights the synthetic checkpoint leaves out)."""
    text = qwen3_5_moe_text_config(**kw)
    text.pop("architectures")
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text, "tie_word_embeddings": text.pop("tie_word_embeddings", False),
            "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 32, "num_heads": 2,
                              "intermediate_size": 32, "out_hidden_size": text["hidden_size"]},
            "eos_token_id": text.get("eos_token_id")}


CONFIGS = {"olmoe": olmoe_config, "qwen3_moe": qwen3_moe_config, "mixtral": mixtral_config,
           "qwen2_moe": qwen2_moe_config, "deepseek_v2": deepseek_v2_config, "deepseek_v3": deepseek_v3_config,
           "glm4_moe": glm4_moe_config, "gpt_oss": gpt_oss_config, "deepseek_v32": deepseek_v32_config,
           "glm_moe_dsa": glm_moe_dsa_config, "glm4_moe_lite": glm4_moe_lite_config, "qwen3_next": qwen3_next_config,
           "qwen3_5_moe_text": qwen3_5_moe_text_config, "qwen3_5_moe": qwen3_5_moe_config,
           "ernie4_5_moe": ernie4_5_moe_config, "dots1": dots1_config, "hunyuan_v1_moe": hunyuan_v1_moe_config,
           "minimax_m2": minimax_m2_config, "llama4_text": llama4_text_config, "llama4": llama4_config,
           "gemma4_text": gemma4_text_config, "gemma4": gemma4_config, "lfm2_moe": lfm2_moe_config,
           "granitemoehybrid": granitemoehybrid_config, "kimi_linear": kimi_linear_config,
           "deepseek_v4": deepseek_v4_config}

# Exact shapes of published checkpoints (their config.json values; weights are random).
PRESETS = {
    # Qwen/Qwen3-Next-80B-A3B (and Qwen3-Coder-Next): 48 layers, every 4th gated full attention
    # (16 heads, 2 KV heads of 256, rotary 64), the others Gated DeltaNet (16 key / 32 value heads
    # of 128); 512 experts of width 512, top-10, a gated shared expert of 512.
    "qwen3-next-80b-a3b": qwen3_next_config(
        hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, vocab_size=151936,
        max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], bos_token_id=151643, eos_token_id=151645),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct (its published config.json keys): 27 layers, 7 of
    # them NoPE MLA (32 heads, kv LoRA 512, nope 128, rope 64, v 128), the others KDA (32 heads of
    # 128, 4-tap conv); layer 1 dense; 256 experts of width 1024, top-8, one shared expert.
    "kimi-linear-48b-a3b": {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": 2304,
        "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
            "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 256, "num_experts_per_token": 8,
        "num_shared_experts": 1, "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "routed_scaling_factor": 2.446, "use_grouped_topk": True,
        "model_max_length": 1048576, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "vocab_size": 163840, "bos_token_id": 163584,
        "eos_token_id": 163586, "pad_token_id": 163839},
    # google/gemma-4-26B-A4B(-it)'s text tower (text_config of its config.json): 30 layers, five
    # sliding (1024; 8 KV heads of 256) then one full (2 KV heads of 512, K reused as V,
    # proportional RoPE on a quarter), a GeGLU of 2112 beside 128 experts of width 704, top-8.
    "gemma-4-26b-a4b": gemma4_text_config(
        hidden_size=2816, intermediate_size=2112, moe_intermediate_size=704, num_hidden_layers=30,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
        num_global_key_value_heads=2, attention_k_eq_v=True, enable_moe_block=True, num_experts=128,
        top_k_experts=8, hidden_size_per_layer_input=0, num_kv_shared_layers=0, sliding_window=1024,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", vocab_size=262144,
        max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0}},
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
        tie_word_embeddings=True, eos_token_id=[1, 106], pad_token_id=0),
    # Qwen/Qwen3-30B-A3B: 48 layers x 128 experts, top-8, ~31 GB at int8, ~16 GB at int4.
    "qwen3-30b-a3b": qwen3_moe_config(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, norm_topk_prob=True,
        max_window_layers=48, sliding_window=None, use_sliding_window=False,
        bos_token_id=151643, eos_token_id=151645),
    # mistralai/Mixtral-8x7B-v0.1: 32 layers x 8 experts, top-2.
    "mixtral-8x7b": mixtral_config(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, sliding_window=None),
    # deepseek-ai/DeepSeek-V3 (and Kimi-K2's layout with 384 experts): 61 layers, the first 3
    # dense, 256 routed experts of width 2048 in 8 groups (4 kept), top-8, one shared expert,
    # MLA (q LoRA 1536, kv LoRA 512, rope 64, nope 128, v 128), YaRN x40.
    "deepseek-v3": deepseek_v3_config(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        vocab_size=129280, max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        bos_token_id=0, eos_token_id=1),
    # openai/gpt-oss-120b: 36 layers x 128 experts of width 2880, top-4, GQA 64/8 x 64, sliding
    # window 128 on every other layer, YaRN x32; published with MXFP4 experts (~61 GB at mxfp4).
    "gpt-oss-120b": gpt_oss_config(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4, vocab_size=201088,
        max_position_embeddings=131072, sliding_window=128, layer_types=None,
        bos_token_id=199998, eos_token_id=200002),
    # openai/gpt-oss-20b: 24 layers x 32 experts, top-4 (same widths as 120b).
    "gpt-oss-20b": gpt_oss_config(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        max_position_embeddings=131072, sliding_window=128, layer_types=None,
        bos_token_id=199998, eos_token_id=200002),
    # GLM-5 (zai-org/GLM-5) as transformers' GlmMoeDsaConfig defaults give it: 78 layers, the
    # first 3 dense, 256 experts of width 2048, top-8, one shared expert, MLA (q LoRA 2048, kv
    # LoRA 512, rope 64, nope 192, v 256) with DeepSeek sparse attention (32 indexer heads of 128,
    # index_topk 2048, an indexer on every layer).
    "glm-5": glm_moe_dsa_config(
        hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048, num_hidden_layers=78,
        num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, first_k_dense_replace=3, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        vocab_size=154880, max_position_embeddings=202752, index_n_heads=32, index_head_dim=128,
        index_topk=2048, indexer_types=["full"] * 78, bos_token_id=0, eos_token_id=1),
}


def write_tokenizer(folder: Path, vocab_size: int, corpus: list[str] | None = None) -> None:
    """A byte-level BPE tokenizer (tokenizers library) with chat markers and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = corpus or [
        "def dumps(obj): return a JSON string. The quick brown fox jumps over the lazy dog.",
        "Return the number of items in a container. héllo wörld 日本語 😀",
        "import os\nimport sys\n\nclass Path:\n    def __init__(self, name):\n        self.name = name\n",
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size, 256 + len(TOKENIZER_SPECIALS)),
                                  special_tokens=TOKENIZER_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|end|>", "bos_token": None,
        "pad_token": "<|endoftext|>"}))
    end_id = tok.token_to_id("<|end|>")
    eot_id = tok.token_to_id("<|endoftext|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_id, eot_id]}))


DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}
# How write_store_from_seed draws routed experts: "exact" = write_checkpoint's float tensors,
# quantized; "codes" = quantized codes drawn directly (SeededSource.quantized_expert).
EXPERT_DRAWS = ("exact", "codes")
CODE_QUANTS = ("int8", "int4", "mxfp4")  # the quantizations expert_draw="codes" draws directly


def seeded_tensor(seed: int, n: int, shape: tuple[int, ...], std: float, name: str = "",
                  num_experts: int = 0) -> np.ndarray:
    """Tensor number ``n`` of a seeded checkpoint, float32 of ``shape``: 1 + N(0, 0.05) for a
    vector (norms), N(0, std) otherwise, drawn from default_rng([seed, n]); a hash-routing table
    (``*.tid2eid`` [V, K], DeepSeek-V4) holds K distinct expert ids below ``num_experts`` per row."""
    rng = np.random.default_rng([seed, n])
    if name.endswith(".tid2eid"):
        return np.argsort(rng.random((shape[0], num_experts)), axis=1)[:, :shape[1]].astype(np.float32)
    if len(shape) == 1:
        return 1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)
    return std * rng.standard_normal(shape, dtype=np.float32)


def write_checkpoint(folder: str | os.PathLike, config: dict, seed: int = 0, dtype: str = "bf16",
                     shard_bytes: int = 1 << 30, tokenizer: bool = True, std: float = 0.05) -> Path:
    """Write a random checkpoint of ``config``'s family (config.json, model*.safetensors
    [+ index], tokenizer), per-expert tensor names as published checkpoints have them.

    Weights: see the module docstring (seeded per tensor, independent of sharding). Written to
    ``folder.partial`` then renamed (atomic).

    Raises:
        ConfigError: ``config`` is not a valid config of a supported family.
    """
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    args = ModelArgs.from_dict(config)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    names = hf_names(args)
    shard: dict[str, np.ndarray] = {}
    size = 0
    shards: list[tuple[str, list[str]]] = []

    def flush():
        nonlocal shard, size
        if not shard:
            return
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        shards.append((name, list(shard)))
        shard, size = {}, 0

    for i, (name, shape) in enumerate(names.items()):
        arr = seeded_tensor(seed, i, shape, std, name, args.num_experts).astype(DTYPES[dtype])
        shard[name] = arr
        size += arr.nbytes
        if size >= shard_bytes:
            flush()
    flush()
    if len(shards) == 1:
        os.replace(tmp / shards[0][0], tmp / "model.safetensors")
    else:
        total = sum((tmp / n).stat().st_size for n, _ in shards)
        wm = {t: n for n, ts in shards for t in ts}
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=1))
    if tokenizer:
        write_tokenizer(tmp, args.vocab_size)
    normalize_modes(tmp)  # safetensors writes 0600 files
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


class SeededSource:
    """The tensors :func:`write_checkpoint` would write, computed on demand (the ``source`` of
    convert.write_store): ``get(hf_name)``, ``expert(layer, e)`` float32 rounded through
    ``dtype``; ``nbytes`` as the checkpoint would store them."""

    def __init__(self, config: dict, seed: int = 0, dtype: str = "bf16", std: float = 0.05,
                 expert_draw: str = "exact"):
        if expert_draw not in EXPERT_DRAWS:
            raise ValueError(f"expert_draw {expert_draw!r}: choose one of {', '.join(EXPERT_DRAWS)}")
        self.expert_draw = expert_draw
        self.args = ModelArgs.from_dict(config)
        self.family = family_for(self.args.model_type)
        self.seed, self.std, self.dtype = seed, std, DTYPES[dtype]
        self.names = hf_names(self.args)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.itemsize = np.dtype(self.dtype).itemsize

    def get(self, name: str) -> np.ndarray:
        w = seeded_tensor(self.seed, self.index[name], self.names[name], self.std, name, self.args.num_experts)
        return w.astype(self.dtype).astype(np.float32)

    def nbytes(self, name: str) -> int:
        return int(np.prod(self.names[name])) * self.itemsize

    def expert(self, layer: int, e: int) -> dict[str, np.ndarray]:
        if hasattr(self.family, "expert_tensors"):  # fused-only families (gpt-oss): slice expert e
            rows = {n: self.get(n)[e] for n in self.family.expert_tensors(self.args, layer)}
            return self.family.expert_from_fused(self.args, layer, rows)
        en = self.family.expert_names(self.args, layer)
        return {p: self.get(en.name(e, p)) for p in base.EXPERT_PROJS}

    def quantized_expert(self, layer: int, e: int, quant: str, group_size: int
                         ) -> dict[str, dict[str, np.ndarray]] | None:
        """With ``expert_draw="codes"``: expert ``e`` of MoE layer ``layer`` drawn directly as
        quantized parts ({proj: {"w": codes, "s": scales}}, quantize()'s shapes and dtypes), else
        None (write_store then quantizes :meth:`expert`).

        Codes are uniform random bytes from ``default_rng([seed, 1 << 30, layer, e])`` (int8:
        -128..127; int4: two nibbles -8..7 per byte); scales are ``std / rms(code)`` x U(0.9, 1.1)
        (int4: rounded to half precision, stored as uint16 bits),
        so dequantized weights have std ~``std`` like the exact draw. About 100x less CPU than
        the float draw + quantization; the values differ from :meth:`expert`'s. mxfp4: uniform
        random code bytes and e8m0 scale bytes X with 2^(X - 127) ~ std / rms(e2m1 code) (3.0).
        Families with expert biases (gpt-oss) get biases N(0, std) ("b").
        Raises: ValueError: quant is not int8, int4 or mxfp4.
        """
        if self.expert_draw != "codes":
            return None
        if quant not in CODE_QUANTS:
            raise ValueError(f"expert_draw 'codes' needs quant {', '.join(CODE_QUANTS)}, not {quant!r}")
        rng = np.random.default_rng([self.seed, 1 << 30, layer, e])
        D, I = self.args.hidden_size, self.args.moe_intermediate_size
        rms = 73.9 if quant == "int8" else 4.64  # sqrt(E[q^2]) of uniform -128..127 / -8..7
        out = {}
        for proj, (O, N) in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            if quant == "mxfp4":
                w = np.frombuffer(rng.bytes(O * N // 2), np.uint8).reshape(O, N // 2)
                x = np.log2(self.std / 3.0) + 127 + rng.integers(-1, 2, (O, N // 32))
                out[proj] = {"w": w, "s": np.clip(np.rint(x), 0, 254).astype(np.uint8)}
                if self.args.expert_bias:
                    out[proj]["b"] = self.std * rng.standard_normal(O, dtype=np.float32)
                continue
            if quant == "int8":
                w = np.frombuffer(rng.bytes(O * N), np.int8).reshape(O, N)
                ns = O
            else:
                w = np.frombuffer(rng.bytes(O * N // 2), np.uint8).reshape(O, N // 2)
                ns = O * (N // group_size)
            s = ((self.std / rms) * (0.9 + 0.2 * rng.random(ns, dtype=np.float32))).astype(np.float32)
            if quant == "int4":  # store format 3: half-precision group scales (engine/quant.py)
                s = s.astype(np.float16).view(np.uint16)
            out[proj] = {"w": w, "s": s.reshape((O,) if quant == "int8" else (O, -1))}
            if self.args.expert_bias:
                out[proj]["b"] = self.std * rng.standard_normal(O, dtype=np.float32)
        return out

    def expert_nbytes(self, layer: int) -> int:
        if hasattr(self.family, "expert_tensors"):
            return sum(self.nbytes(n) for n in self.family.expert_tensors(self.args, layer)) // self.args.num_experts
        en = self.family.expert_names(self.args, layer)
        return sum(self.nbytes(en.name(0, p)) for p in base.EXPERT_PROJS)


def write_store_from_seed(dst: str | os.PathLike, config: dict, quant: str = "int8", seed: int = 0,
                          dtype: str = "bf16", std: float = 0.05, group_size: int = 32,
                          overwrite: bool = False, tokenizer: bool = True, progress=None,
                          cancel=None, expert_draw: str = "exact", expert_layout: str = "auto",
                          dense_quant: str | None = None) -> Path:
    """Write a store (convert.py's layout) of ``config``'s family straight from the seed, for
    shapes too large to write as a bf16 checkpoint first (Qwen3-30B-A3B: 61 GB of bf16).

    The weights equal those of ``convert_checkpoint(write_checkpoint(folder, config, seed,
    dtype, std=std), dst, quant)``; peak RSS is the resident tensors plus one expert. What it
    skips: no Hugging Face checkpoint exists, so nothing can be compared with transformers (no
    oracle, no ``colibri convert`` of it, no llama.cpp GGUF); the tokenizer is the small
    synthetic BPE (:func:`write_tokenizer`), whose vocabulary may be smaller than the model's
    ``vocab_size``; the weights are random, so text is meaningless (benchmarks force token ids).
    ``expert_draw="codes"`` also skips the float draw of the routed experts: their quantized
    codes and scales are drawn directly (:meth:`SeededSource.quantized_expert`), ~100x less CPU
    (Qwen3-30B-A3B int4: minutes instead of an hour and a half on a loaded 2-core machine); dense
    tensors stay exact, expert slabs then differ from convert_checkpoint's (same layout, sizes,
    std). Recorded in the manifest's ``source``.

    Args:
        dst: the store folder. config: a config.json dict (e.g. ``PRESETS["qwen3-30b-a3b"]``).
        quant: "int8", "int4", "f16" or "f32". seed / dtype / std: as write_checkpoint.
        expert_draw: "exact" (default) or "codes" (int8 / int4 only; see above).
        overwrite: replace an existing store. progress / cancel / expert_layout / dense_quant: as
            convert_checkpoint (dense_quant None: the default for ``quant``).

    Returns: the store path.
    Raises:
        ConfigError: invalid config. FileExistsError: ``dst`` exists and overwrite is False.
        ConversionCancelled: ``cancel`` was set (nothing is left behind).
    """
    from ..convert import check_destination, write_store
    from ..quant import QUANTS
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: choose one of {', '.join(QUANTS)}")
    dst = Path(dst)
    check_destination(dst, overwrite)
    src = SeededSource(config, seed, dtype, std, expert_draw)
    if expert_draw == "codes" and quant not in CODE_QUANTS:
        raise ValueError(f"expert_draw 'codes' needs quant {', '.join(CODE_QUANTS)}, not {quant!r}")
    side = dst.with_name(dst.name + ".files")  # config + tokenizer, copied into the store
    shutil.rmtree(side, ignore_errors=True)
    side.mkdir(parents=True)
    try:
        (side / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        if tokenizer:
            write_tokenizer(side, src.args.vocab_size)
        return write_store(src, side, dst, quant, group_size, progress, cancel, overwrite=overwrite,
                           expert_layout=expert_layout, dense_quant=dense_quant,
                           extra_manifest={"model_name": dst.name,
                                           "source": f"synthetic seed {seed} ({dtype}, std {std}"
                                                     + (", expert codes drawn directly)" if expert_draw == "codes" else ")")})
    finally:
        shutil.rmtree(side, ignore_errors=True)
