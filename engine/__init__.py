"""colibri-desktop engine: OLMoE inference with experts streamed from the SSD.

Public API (the only names colibri_app may use); see docs/engine-api.md.
"""

from . import hub, paths
from .config import POLICIES, SUPPORTED_MODEL_TYPES, EngineConfig, ModelArgs
from .convert import ConversionCancelled, convert_checkpoint
from .default_model import default_model_dir, default_store
from .errors import (BudgetError, CheckpointError, ConfigError, ContextOverflowError, EngineError,
                     ExpertReadError, StoreError, TokenizerError)
from .events import (ABSENT, LOADING, PINNED, RESIDENT, ChatMessage, EngineFailure, Finished,
                     GenerateRequest, Loaded, LoadProgress, ResidencySnapshot, SamplingParams,
                     StepMetrics, TokenEvent)
from .chat_template import reasoning_open, split_reasoning
from .generate import Engine

__all__ = [
    "hub", "paths", "POLICIES", "SUPPORTED_MODEL_TYPES", "EngineConfig", "ModelArgs", "ConversionCancelled",
    "convert_checkpoint", "default_model_dir", "default_store", "BudgetError", "CheckpointError",
    "ConfigError", "ContextOverflowError", "EngineError", "ExpertReadError", "StoreError",
    "TokenizerError", "ABSENT", "LOADING", "PINNED", "RESIDENT", "ChatMessage", "EngineFailure",
    "Finished", "GenerateRequest", "Loaded", "LoadProgress", "ResidencySnapshot", "SamplingParams",
    "StepMetrics", "TokenEvent", "Engine", "split_reasoning", "reasoning_open",
]
