"""Qwen3.5 MoE as published (``model_type: qwen3_5_moe``; Qwen/Qwen3.5-35B-A3B,
Qwen3.5-397B-A17B): the multimodal checkpoint, of which colibri runs the language model.

config.json is transformers' Qwen3_5MoeConfig: the language model's keys are in
``text_config`` (Qwen3_5MoeTextConfig names, engine/models/qwen3_5_moe_text.py), beside
``vision_config`` and the top-level ``tie_word_embeddings``. The weights are the text model's
under ``model.language_model.`` (``lm_head.weight`` at the top level); the vision tower
(``model.visual.*``) is not read; the multi-token-prediction layer (``mtp.*``,
``text_config.mtp_num_hidden_layers``) is kept as a speculative drafter (engine/mtp.py). A text-only
sequence gets the same position in the three multimodal RoPE sections, so the forward is the
text model's (transformers' Qwen3_5MoeForConditionalGeneration on input ids alone equals
Qwen3_5MoeForCausalLM on the same weights; tests/test_hybrid_parity.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError
from . import base, qwen3_5_moe_text, qwen3_next

MODEL_TYPE = "qwen3_5_moe"
DISPLAY_NAME = "Qwen3.5-MoE"
DEFAULTED_KEYS = qwen3_next.DEFAULTED_KEYS  # absent keys take transformers' defaults, named on a mismatch
PREFIX = "model.language_model."
# the multi-token-prediction layer: Qwen3-Next's mtp.* layout beside the language model (engine/mtp.py)
MTP_HEAD = replace(qwen3_next.MTP_HEAD, layers=PREFIX + "layers.")


@dataclass(frozen=True, kw_only=True)
class ModelArgs(qwen3_5_moe_text.ModelArgs):
    """The language model of a Qwen3.5 MoE config.json (``text_config``)."""

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        tc = cfg.get("text_config")
        if not isinstance(tc, dict):
            raise ConfigError(f"{path}: key 'text_config' (the language model's settings) must be an object; "
                              f"this is not a complete {DISPLAY_NAME} config.json (re-download it)")
        merged = {**tc, "model_type": MODEL_TYPE}
        if cfg.get("tie_word_embeddings") is not None:
            merged["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        v = qwen3_next.hybrid_fields(merged, f"{path} text_config", DISPLAY_NAME)
        return cls(**v, norm_topk_prob=True, moe_layers=tuple(range(v["num_hidden_layers"])),
                   num_nextn_predict_layers=base.num(merged, MTP_HEAD.count_key, f"{path} text_config", 0, 64,
                                                     integer=True, default=0))


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    """The text model's tensors (qwen3_5_moe_text.dense_tensors) under ``model.language_model.``."""
    return [t._replace(hf=PREFIX + t.hf[len("model."):]) if t.hf.startswith("model.") else t
            for t in qwen3_5_moe_text.dense_tensors(args)]


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    p = MTP_HEAD.block_prefix(args, i) + "mlp.experts."  # a kept MTP layer's: mtp.layers.k.
    return base.ExpertNames(i, p, fused_prefixes=(p,))


class Model(qwen3_next.Model):
    """The Qwen3.5 MoE language model's forward (as the text model's)."""
