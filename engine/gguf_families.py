"""GGUF architectures of dots.llm1 (``dots1``), ERNIE 4.5 MoE (``ernie4_5-moe``), Hunyuan-A13B
(``hunyuan-moe``) and MiniMax-M2 (``minimax-m2``): the Hugging Face config.json of the family from the metadata llama.cpp's
converter writes, and the tensor names that differ from the shared table of engine.gguf_import.

What the files say and what they leave out (llama.cpp's own reading of them):

* ``dots1``: the DeepSeek-V3 router (``expert_gating_func`` 2 = sigmoid, ``exp_probs_b``), groups
  from ``expert_group_count`` / ``expert_group_used_count``, ``expert_weights_scale`` /
  ``expert_weights_norm``, shared experts and leading dense layers; q/k per-head norms; full
  attention in every layer (llama.cpp's dots1 slides in none).
* ``ernie4_5-moe``: the softmax router with its ``exp_probs_b`` correction bias; MoE layers from
  ``leading_dense_block_count`` and ``interleave_moe_layer_step`` up to the last layer holding
  experts; the shared experts' count from ``expert_shared_count`` (their width is
  ``expert_feed_forward_length`` each; the converter writes ``expert_shared_feed_forward_length``
  as intermediate_size / KV heads, which llama.cpp requires to be that sum, as it is in the
  published models). Its adjacent-pair RoPE is ggml's own (NORM), so q/k are as in the checkpoint.
* ``hunyuan-moe``: every layer routed (softmax top-K, renormalised) beside one shared MLP of the
  expert width; q/k norms after RoPE; ``rope.freq_base`` is already the NTK-alpha-stretched base
  (the converter folds alpha in), so the config gets it as a plain base.
* ``minimax-m2``: q/k RMS-normed over the whole projection, rotate-half RoPE (ggml's NEOX) over
  the first ``rope.dimension_count`` values of each head, so q/k are as in the checkpoint; every
  layer routed by sigmoids (``expert_gating_func`` 2) with ``exp_probs_b`` choosing only,
  renormalised top-K (llama.cpp's graph always renormalises this architecture's weights).
"""

from __future__ import annotations

from .errors import ConfigError
from .gguf_file import GGUFModel

# llama.cpp architecture -> our family's model_type
ARCHS = {"dots1": "dots1", "ernie4_5-moe": "ernie4_5_moe", "hunyuan-moe": "hunyuan_v1_moe", "minimax-m2": "minimax_m2"}

# Hugging Face name inside model.layers.N. -> GGUF name inside blk.N., where the shared table differs
LAYER_NAMES = {"ernie4_5-moe": {"mlp.moe_statics.e_score_correction_bias": "exp_probs_b.bias"},
               "hunyuan-moe": {"self_attn.query_layernorm.weight": "attn_q_norm.weight",
                               "self_attn.key_layernorm.weight": "attn_k_norm.weight",
                               "mlp.gate.wg.weight": "ffn_gate_inp.weight",
                               "mlp.shared_mlp.gate_proj.weight": "ffn_gate_shexp.weight",
                               "mlp.shared_mlp.up_proj.weight": "ffn_up_shexp.weight",
                               "mlp.shared_mlp.down_proj.weight": "ffn_down_shexp.weight"},
               "minimax-m2": {"block_sparse_moe.e_score_correction_bias": "exp_probs_b.bias"}}


def hf_config(g: GGUFModel, cfg: dict, E: int) -> dict:
    """config.json of ``g`` (an architecture of ARCHS) from ``cfg``, the keys every architecture
    has (engine.gguf_import.hf_config). Raises ConfigError naming the key."""
    hd = g.key("attention.key_length", optional=True) or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    cfg.update(head_dim=hd, rope_parameters=rope)
    if g.arch == "dots1":
        return _dots1(g, cfg, E)
    if g.arch == "hunyuan-moe":
        return _hunyuan_moe(g, cfg, E)
    if g.arch == "minimax-m2":
        return _minimax_m2(g, cfg, E)
    return _ernie4_5_moe(g, cfg, E)


def _dots1(g: GGUFModel, cfg: dict, E: int) -> dict:
    gating = g.key("expert_gating_func", optional=True, default=2)
    if gating != 2:
        raise ConfigError(f"{g.files[0]}: {g.arch}.expert_gating_func = {gating}: dots.llm1 routes with a sigmoid (2)")
    L, k = cfg["num_hidden_layers"], g.key("leading_dense_block_count", optional=True, default=0)
    n_group = g.key("expert_group_count", optional=True, default=1)
    cfg.update(model_type="dots1", architectures=["Dots1ForCausalLM"], n_routed_experts=E,
               moe_intermediate_size=g.key("expert_feed_forward_length"), first_k_dense_replace=k,
               n_shared_experts=g.key("expert_shared_count", optional=True, default=0), n_group=n_group,
               topk_group=g.key("expert_group_used_count", optional=True, default=n_group),
               norm_topk_prob=bool(g.key("expert_weights_norm", (bool, int), optional=True, default=False)),
               routed_scaling_factor=g.key("expert_weights_scale", (float,), optional=True, default=1.0) or 1.0,
               sliding_window=None, layer_types=["full_attention"] * L)
    if k:
        cfg["intermediate_size"] = g.key("feed_forward_length")
    return cfg


def _ernie4_5_moe(g: GGUFModel, cfg: dict, E: int) -> dict:
    L = cfg["num_hidden_layers"]
    start = g.key("leading_dense_block_count", optional=True, default=0)
    step = g.key("interleave_moe_layer_step", optional=True, default=1)
    if not step:
        raise ConfigError(f"{g.files[0]}: {g.arch}.interleave_moe_layer_step is 0; the file is inconsistent")
    with_experts = [i for i in range(L) if f"blk.{i}.ffn_gate_exps.weight" in g.tensors
                    or f"blk.{i}.ffn_gate_up_exps.weight" in g.tensors]
    cfg.update(model_type="ernie4_5_moe", architectures=["Ernie4_5_MoeForCausalLM"], moe_num_experts=E,
               moe_k=cfg["num_experts_per_tok"], moe_intermediate_size=g.key("expert_feed_forward_length"),
               moe_num_shared_experts=g.key("expert_shared_count", optional=True, default=0),
               moe_layer_start_index=start, moe_layer_interval=step,
               moe_layer_end_index=with_experts[-1] if with_experts else L - 1, use_bias=False,
               intermediate_size=g.key("feed_forward_length", optional=True) or g.key("expert_feed_forward_length"))
    return cfg


def _hunyuan_moe(g: GGUFModel, cfg: dict, E: int) -> dict:
    width = g.key("expert_feed_forward_length")
    shared = g.key("expert_shared_feed_forward_length", optional=True, default=width)
    n_shared = g.key("expert_shared_count", optional=True, default=1)
    if shared != width or n_shared != 1:
        raise ConfigError(f"{g.files[0]}: {g.arch}: {n_shared} shared MLP(s) of width {shared} beside experts of "
                          f"width {width}; Hunyuan-A13B has one shared MLP of the expert width")
    cfg.update(model_type="hunyuan_v1_moe", architectures=["HunYuanMoEV1ForCausalLM"], num_experts=E,
               moe_topk=cfg["num_experts_per_tok"], intermediate_size=width, attention_bias=False)
    return cfg


def _minimax_m2(g: GGUFModel, cfg: dict, E: int) -> dict:
    gating = g.key("expert_gating_func", optional=True, default=2)
    if gating != 2:
        raise ConfigError(f"{g.files[0]}: {g.arch}.expert_gating_func = {gating}: MiniMax-M2 routes with a sigmoid (2)")
    hd = cfg["head_dim"]
    cfg.update(model_type="minimax_m2", architectures=["MiniMaxM2ForCausalLM"], num_local_experts=E,
               intermediate_size=g.key("expert_feed_forward_length"), scoring_func="sigmoid",
               rotary_dim=g.key("rope.dimension_count", optional=True, default=hd))
    return cfg
