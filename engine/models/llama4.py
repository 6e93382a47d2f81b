"""Llama 4 as published (``model_type: llama4``; meta-llama/Llama-4-Scout-17B-16E(-Instruct),
Llama-4-Maverick-17B-128E(-Instruct)): the multimodal checkpoint, of which colibri runs the
language model.

config.json is transformers' Llama4Config: the language model's keys are in ``text_config``
(Llama4TextConfig names, engine/models/llama4_text.py) beside ``vision_config``. The weights
are the text model's under ``language_model.model.`` with ``language_model.lm_head.weight``;
the vision tower (``vision_model.*``) and its projector (``multi_modal_projector.*``) are not
read. On input ids alone transformers' Llama4ForConditionalGeneration is its language model
(tests/test_moe_families_parity.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from . import base, llama4_text

MODEL_TYPE = "llama4"
DISPLAY_NAME = "Llama 4 (multimodal)"
PREFIX = "language_model.model."


@dataclass(frozen=True, kw_only=True)
class ModelArgs(llama4_text.ModelArgs):
    """The language model of a Llama 4 config.json (``text_config``)."""

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
        return cls(**llama4_text.text_fields(merged, f"{path} text_config", DISPLAY_NAME))


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return llama4_text.dense_tensors(args, PREFIX)


def expert_tensors(args: ModelArgs, i: int, mxfp4: bool = False) -> dict:
    return llama4_text.expert_tensors(args, i, mxfp4, PREFIX)


def expert_from_fused(args: ModelArgs, i: int, rows: dict) -> dict:
    return llama4_text.expert_from_fused(args, i, rows, PREFIX)


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return base.ExpertNames(i, f"{PREFIX}layers.{i}.feed_forward.experts.")


class Model(llama4_text.Model):
    """The Llama 4 language model's forward (as the text model's)."""
