"""Gemma 4 as published (``model_type: gemma4``; google/gemma-4-26B-A4B(-it)): the multimodal
checkpoint, of which colibri runs the language model.

config.json is transformers' Gemma4Config: the language model's keys are in ``text_config``
(Gemma4TextConfig names, engine/models/gemma4_text.py) beside ``vision_config`` /
``audio_config`` and the top-level ``tie_word_embeddings`` (true by default: the logits use the
embedding). The weights are the text model's under ``model.language_model.``; the vision and
audio towers and their embedders (``model.vision_tower.*``, ``model.embed_vision.*``, ...) are
not read. On input ids alone transformers' Gemma4ForConditionalGeneration is its language
model with the soft-capped logits (tests/test_moe_families_parity.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from . import base, gemma4_text

MODEL_TYPE = "gemma4"
DISPLAY_NAME = "Gemma 4 (multimodal)"
PREFIX = "model.language_model."


@dataclass(frozen=True, kw_only=True)
class ModelArgs(gemma4_text.ModelArgs):
    """The language model of a Gemma 4 config.json (``text_config``)."""

    def dense_param_count(self) -> int:
        return base.tensor_params(self, dense_tensors(self))

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config.json") -> "ModelArgs":
        """Raises: ConfigError naming ``path`` and the key."""
        tc = cfg.get("text_config")
        if not isinstance(tc, dict):
            raise ConfigError(f"{path}: key 'text_config' (the language model's settings) must be an object; "
                              f"this is not a complete {DISPLAY_NAME} config.json (re-download it)")
        merged = {**tc, "model_type": MODEL_TYPE,
                  "tie_word_embeddings": base.flag(cfg, "tie_word_embeddings", path, True)}
        return cls(**gemma4_text.text_fields(merged, f"{path} text_config", DISPLAY_NAME))


def dense_tensors(args: ModelArgs) -> list[base.Tensor]:
    return gemma4_text.dense_tensors(args, PREFIX)


def expert_names(args: ModelArgs, i: int) -> base.ExpertNames:
    return gemma4_text.expert_names(args, i, PREFIX)


class Model(gemma4_text.Model):
    """The Gemma 4 language model's forward (as the text model's)."""
