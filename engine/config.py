"""Model arguments read from a Hugging Face config.json (and, re-exported, the runtime settings).

ModelArgs (engine/models/base.py) follows mlx-lm's ``ModelArgs.from_dict``: the Hugging Face
key names are kept (num_experts, num_experts_per_tok, norm_topk_prob, ...);
``ModelArgs.from_dict`` / ``from_hf_config`` dispatch to the family of config.json's
``model_type`` (engine/models/). The runtime settings (EngineConfig) are declared once, in the
settings table (engine/settings.py).
"""

from __future__ import annotations

from .models import SUPPORTED_MODEL_TYPES as _SUPPORTED
from .models.base import ModelArgs
from .settings import CHECKSUM_MODES, POLICIES, EngineConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArgs", "EngineConfig", "POLICIES", "CHECKSUM_MODES"]

SUPPORTED_MODEL_TYPES = _SUPPORTED  # config.json model_type values with a family file
