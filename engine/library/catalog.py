"""Mixture-of-experts models people run, and which of them suit this computer.

CATALOG is the one table: each entry's Hugging Face repository id and the shape fields of its
published config.json (enough for ModelArgs and engine.sizing; tests/test_catalog.py parses
every one with the family's own config parser). :func:`recommend` sizes each for a machine
(total and available RAM, disk read speed) with engine.sizing: the store and download sizes
(sizing.estimate at the store's quantization and at the published one), the RAM budget the
engine would take (sizing.plan_before_open: the automatic budget before loading), the expert slots
per layer it holds, the expected decode speed (sizing.expected_speed_range) and the verdict
before a download (sizing.ram_verdict, which judges the same plan: sizing.plan_before_open); the quantization to take is the larger one whose
budget still holds the experts one token routes in every layer, else int4.

Every entry is a safetensors repository converted by `colibri download`; an entry with a
``-GGUF`` repository (``gguf``: the repository and llama.cpp file type, sized by
sizing.estimate_gguf) recommends that file instead where it is the smaller download and not
much slower here (`colibri download REPO-GGUF --gguf Q4_K_M` imports its blocks as published).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelArgs
from ..sizing import (DISK_READ_BYTES_PER_S, Estimate, estimate, estimate_gguf, expected_speed_range, plan_before_open,
                      ram_verdict)
from ..errors import BudgetError


MIN_TOKENS_PER_S = 1.0  # below one token a second (the low end of the range) a chat is not usable
SPEED_FOR_QUALITY = 2 / 3  # take the larger quantization unless it is slower than this share of the fastest


@dataclass(frozen=True)
class CatalogModel:
    """One model of the catalog: ``repo_id`` on the Hugging Face hub, a display ``name``, what
    it is good at (``note``), the quantization its weights are published in (``published``:
    "f16" for bf16 / f16 safetensors, "mxfp4" for gpt-oss's MXFP4 experts) and the shape
    fields of its config.json (``config``); ``gguf``: (repository, file type) of its GGUF
    conversion on the hub, () when none is listed (the file type one of sizing.GGUF_FILE_TYPES)."""

    repo_id: str
    name: str
    note: str
    config: dict
    published: str = "f16"
    quants: tuple[str, ...] = ("int8", "int4")  # store quantizations worth offering (the wizard's), best first
    gguf: tuple[str, ...] = ()

    def args(self) -> ModelArgs:
        """The ModelArgs of ``config`` (the family's own parser). Raises ConfigError."""
        return ModelArgs.from_dict(dict(self.config), f"{self.repo_id}/config.json")


_QWEN3_30B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=False)

CATALOG: tuple[CatalogModel, ...] = (
    CatalogModel("allenai/OLMoE-1B-7B-0125-Instruct", "OLMoE-1B-7B Instruct",
                 "small and quick: general chat in English, 1.3 B active parameters",
                 dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                      norm_topk_prob=False, vocab_size=50304, max_position_embeddings=4096, rope_theta=10000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
                 gguf=("allenai/OLMoE-1B-7B-0125-Instruct-GGUF", "Q4_K_M")),
    CatalogModel("Qwen/Qwen1.5-MoE-A2.7B-Chat", "Qwen1.5-MoE-A2.7B Chat",
                 "small multilingual chat model with a shared expert",
                 dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                      num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, max_position_embeddings=8192,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    CatalogModel("deepseek-ai/DeepSeek-V2-Lite-Chat", "DeepSeek-V2-Lite Chat",
                 "16 B, latent attention (a small KV cache): chat and code",
                 dict(model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
                      moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                      num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                      first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=None,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", n_group=1,
                      topk_group=1, routed_scaling_factor=1.0, scoring_func="softmax", norm_topk_prob=False,
                      vocab_size=102400, max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6,
                      rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                        beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
                      tie_word_embeddings=False)),
    CatalogModel("openai/gpt-oss-20b", "gpt-oss-20b",
                 "reasoning and tool use; its experts are published in 4 bits (MXFP4), so int4 loses little",
                 dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                      num_experts_per_tok=4, experts_per_token=4, vocab_size=201088,
                      max_position_embeddings=131072, sliding_window=128, rope_theta=150000.0,
                      rope_scaling=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                        beta_fast=32.0, beta_slow=1.0), swiglu_limit=7.0, rms_norm_eps=1e-5,
                      layer_types=["sliding_attention", "full_attention"] * 12, tie_word_embeddings=False),
                 published="mxfp4", quants=("int4",), gguf=("ggml-org/gpt-oss-20b-GGUF", "MXFP4")),
    CatalogModel("Qwen/Qwen3-30B-A3B", "Qwen3-30B-A3B",
                 "strong general model with thinking mode; 3.3 B active parameters",
                 dict(_QWEN3_30B, max_position_embeddings=40960, rope_theta=1000000.0),
                 gguf=("Qwen/Qwen3-30B-A3B-GGUF", "Q4_K_M")),
    CatalogModel("Qwen/Qwen3-Coder-30B-A3B-Instruct", "Qwen3-Coder-30B-A3B Instruct",
                 "code: the 30B-A3B shape trained for programming and tool calls",
                 dict(_QWEN3_30B, max_position_embeddings=262144, rope_theta=10000000.0),
                 gguf=("unsloth/Qwen3-Coder-30B-A3B-Instruct-GGUF", "Q4_K_M")),
    CatalogModel("mistralai/Mixtral-8x7B-Instruct-v0.1", "Mixtral-8x7B Instruct",
                 "47 B, 8 large experts (2 per token): chat in European languages",
                 dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                      vocab_size=32000, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False)),
    CatalogModel("openai/gpt-oss-120b", "gpt-oss-120b",
                 "large reasoning model; experts published in 4 bits (MXFP4), so int4 loses little",
                 dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
                      num_experts_per_tok=4, experts_per_token=4, vocab_size=201088,
                      max_position_embeddings=131072, sliding_window=128, rope_theta=150000.0,
                      rope_scaling=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                        beta_fast=32.0, beta_slow=1.0), swiglu_limit=7.0, rms_norm_eps=1e-5,
                      layer_types=["sliding_attention", "full_attention"] * 18, tie_word_embeddings=False),
                 published="mxfp4", quants=("int4",), gguf=("ggml-org/gpt-oss-120b-GGUF", "MXFP4")),
    CatalogModel("zai-org/GLM-4.5-Air", "GLM-4.5-Air",
                 "106 B agentic / coding model with a shared expert",
                 dict(model_type="glm4_moe", hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                      num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                      n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
                      n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                      partial_rotary_factor=0.5, use_qk_norm=False, attention_bias=True, vocab_size=151552,
                      max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-5,
                      num_nextn_predict_layers=1, tie_word_embeddings=False),
                 gguf=("unsloth/GLM-4.5-Air-GGUF", "Q4_K_M")),
    CatalogModel("Qwen/Qwen3-235B-A22B", "Qwen3-235B-A22B",
                 "the large Qwen3: 22 B active parameters, for a big machine and a fast SSD",
                 dict(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                      num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                      num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=False),
                 gguf=("Qwen/Qwen3-235B-A22B-GGUF", "Q4_K_M")),
)


@dataclass(frozen=True)
class Recommendation:
    """One catalog model sized for one machine (bytes; speed in tokens per second).

    quant: the store quantization to take ("gguf": the GGUF file, its blocks as published).
    gguf: the GGUF file type to take from ``repo_id`` ("" for the safetensors). download_bytes:
    what to download (about: sizing.estimate at the published quantization, or
    sizing.estimate_gguf's file); safetensors_bytes: the safetensors' either way; gguf_bytes /
    gguf_tokens_per_s: the GGUF file's download and speed here when it is listed but not taken
    (0 and (0, 0) otherwise). estimate:
    sizing.Estimate of the store (store size, RAM minimum). budget_bytes / slots_per_layer: the automatic RAM budget (at
    most what every expert in RAM needs) and the expert slots it holds in every layer (0 when it holds none: the model does
    not open here). tokens_per_s: (low, high) of sizing.expected_speed_range ((0, 0) when it
    does not open). disk_bytes_per_s / disk_measured: the disk speed assumed or measured.
    verdict / message: sizing.ram_verdict ("ok", "warn", "refuse"). recommended: it opens
    and reads at most a few experts per token from the disk.
    """

    model: CatalogModel
    quant: str
    download_bytes: int
    estimate: Estimate
    budget_bytes: int
    slots_per_layer: int
    tokens_per_s: tuple[float, float]
    verdict: str
    message: str
    recommended: bool
    disk_bytes_per_s: float = DISK_READ_BYTES_PER_S
    disk_measured: bool = False
    gguf: str = ""
    safetensors_bytes: int = 0
    gguf_bytes: int = 0
    gguf_tokens_per_s: tuple[float, float] = (0.0, 0.0)

    @property
    def repo_id(self) -> str:
        """The hub repository to download: the -GGUF one when a GGUF file is taken."""
        return self.model.gguf[0] if self.gguf else self.model.repo_id

    @property
    def take(self) -> str:
        """What to take, as the wizard's table says it: "GGUF Q4_K_M", "int8", ..."""
        return f"GGUF {self.gguf}" if self.gguf else self.quant


def _size(m: CatalogModel, args: ModelArgs, quant: str, total: int, available: int, context_length: int,
          disk_bytes_per_s: float, est: Estimate | None = None) -> tuple[Estimate, int, int, tuple[float, float], str, str]:
    est = est or estimate(args, quant, context_length)
    verdict, message = ram_verdict(est, args.num_experts_per_tok, total, available)
    try:
        plan = plan_before_open(est, available)
        fit = plan.slots // max(1, plan.layers)
        speed = expected_speed_range(est, fit, disk_bytes_per_s)
        budget = min(plan.budget, est.all_in_ram_bytes)  # never more than every expert in RAM uses
    except BudgetError:
        fit, speed, budget = 0, (0.0, 0.0), 0
    return est, budget, fit, speed, verdict, message


def recommend(total: int, available: int, disk_bytes_per_s: float | None = None, context_length: int = 0,
              catalog: tuple[CatalogModel, ...] = CATALOG) -> list[Recommendation]:
    """Every catalog model sized for a machine with ``total`` and ``available`` bytes of RAM
    and a disk reading ``disk_bytes_per_s`` (None: sizing.DISK_READ_BYTES_PER_S, assumed),
    at ``context_length`` tokens (0: the engine's default). Per model the quantization is the
    first of its ``quants`` (int8 before int4) whose expected speed is at least
    SPEED_FOR_QUALITY of the fastest one's; its GGUF file (``gguf``) instead when that is the
    smaller download and at least SPEED_FOR_QUALITY as fast as that choice. Recommended: it opens here (not refused, one slot
    per layer fits) and the low end of its speed range is at least MIN_TOKENS_PER_S. Sorted:
    recommended first (fastest first), then the others by the RAM they need."""
    disk = float(disk_bytes_per_s or DISK_READ_BYTES_PER_S)
    out = []
    for m in catalog:
        args = m.args()
        sized = {q: _size(m, args, q, total, available, context_length, disk) for q in m.quants}
        best = max(s[3][0] for s in sized.values())
        quant = next(q for q in m.quants if sized[q][3][0] >= SPEED_FOR_QUALITY * best)
        est, budget, fit, speed, verdict, message = sized[quant]
        download = safetensors = estimate(args, m.published, context_length).store_bytes
        gguf, gguf_other = "", (0, (0.0, 0.0))
        if m.gguf:
            g = estimate_gguf(args, m.gguf[1], context_length)
            g_sized = _size(m, args, "gguf", total, available, context_length, disk, g.estimate)
            if g.download_bytes < safetensors and g_sized[3][0] >= SPEED_FOR_QUALITY * speed[0]:
                quant, gguf, download = "gguf", m.gguf[1], g.download_bytes
                est, budget, fit, speed, verdict, message = g_sized
            else:
                gguf_other = (g.download_bytes, g_sized[3])
        ok = verdict != "refuse" and fit >= 1 and speed[0] >= MIN_TOKENS_PER_S
        out.append(Recommendation(m, quant, download, est, budget, fit, speed, verdict, message, ok, disk,
                                  disk_bytes_per_s is not None, gguf, safetensors, *gguf_other))
    out.sort(key=lambda r: (not r.recommended, -r.tokens_per_s[0] if r.recommended else r.estimate.ram_needed))
    return out
