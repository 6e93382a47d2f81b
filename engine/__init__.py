"""colibri-desktop engine: mixture-of-experts inference with experts streamed from the SSD.

Public API of the inference core (the app uses these names, ``engine.library`` for the model
library and ``engine.cli.main`` for the console script); see docs/engine-api.md and
docs/architecture.md. This package never imports the library, the benchmarks or the CLI.
"""

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

from .config import SUPPORTED_MODEL_TYPES, ModelArgs, describe_model, family_name, supported_families
from .convert import ConversionCancelled, convert_checkpoint
from .errors import (BudgetError, Cancelled, CheckpointError, ConfigError, ContextOverflowError, EngineError,
                     ErrorKind, ExpertReadError, StoreError, TokenizerError, error_kind)
from .events import (ABSENT, LOADING, PINNED, REMOTE, RESIDENT, ChatMessage, EngineFailure, Finished, FinishReason,
                     GenerateRequest, Loaded, LoadProgress, ResidencySnapshot, SamplingParams,
                     StepMetrics, TokenEvent)
from .chat_template import reasoning_open, split_reasoning
from .docs_lookup import DocEntry, DocsIndex
from .fsutil import atomic_write_text
from .gui_check import GuiCheck, check_gui
from .generate import Engine
from .sampling import fresh_seed
from .settings import (APP, CHECKSUM_MODES, ENGINE, POLICIES, SAMPLING, AppSettings, EngineConfig, Setting,
                       settings_table, upgrade_keys, validate)
from .units import format_bytes, format_duration

__all__ = [
    "POLICIES", "CHECKSUM_MODES", "SUPPORTED_MODEL_TYPES", "EngineConfig", "ModelArgs", "ConversionCancelled",
    "convert_checkpoint", "BudgetError", "Cancelled", "CheckpointError", "ConfigError", "ContextOverflowError",
    "EngineError", "ErrorKind", "ExpertReadError", "StoreError", "TokenizerError", "error_kind", "ABSENT", "REMOTE",
    "LOADING", "PINNED", "RESIDENT", "ChatMessage", "EngineFailure", "Finished", "FinishReason",
    "GenerateRequest", "Loaded",
    "LoadProgress", "ResidencySnapshot", "SamplingParams", "StepMetrics", "TokenEvent", "atomic_write_text",
    "Engine", "ENGINE", "SAMPLING", "APP", "AppSettings", "Setting", "settings_table", "upgrade_keys", "validate", "format_bytes",
    "format_duration", "fresh_seed", "DocEntry", "DocsIndex", "split_reasoning", "reasoning_open", "describe_model", "family_name", "supported_families",
    "GuiCheck", "check_gui",
]
