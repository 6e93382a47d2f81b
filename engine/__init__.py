"""colibri-desktop engine: mixture-of-experts inference with experts streamed from the SSD.

Public API of the inference core (the app uses these names, ``engine.library`` for the model
library and ``engine.cli.main`` for the console script); see docs/engine-api.md and
docs/architecture.md. This package never imports the library, the benchmarks or the CLI.
"""

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

# name -> the module that defines it: imported at the first use of a name (PEP 562), so that
# `import engine` (the command line, the launcher's window check) starts no numpy or numba
_WHERE = {
    "SUPPORTED_MODEL_TYPES": "config", "ModelArgs": "config", "describe_model": "config", "family_name": "config", "supported_families": "config",
    "ConversionCancelled": "convert", "convert_checkpoint": "convert",
    "BudgetError": "errors", "Cancelled": "errors", "CheckpointError": "errors", "ConfigError": "errors", "ContextOverflowError": "errors", "EngineError": "errors", "ErrorKind": "errors", "ExpertReadError": "errors", "StoreError": "errors", "StoreUnreadable": "errors", "TokenizerError": "errors", "error_kind": "errors",
    "ABSENT": "events", "LOADING": "events", "PINNED": "events", "REMOTE": "events", "RESIDENT": "events", "ChatMessage": "events", "EngineFailure": "events", "Finished": "events", "FinishReason": "events", "GenerateRequest": "events", "Loaded": "events", "LoadProgress": "events", "ResidencySnapshot": "events", "SamplingParams": "events", "StepMetrics": "events", "TokenEvent": "events",
    "reasoning_open": "chat_template", "split_reasoning": "chat_template",
    "DocEntry": "docs_lookup", "DocsIndex": "docs_lookup",
    "atomic_write_text": "fsutil",
    "error_text": "errors",
    "GuiCheck": "gui_check", "check_gui": "gui_check",
    "Engine": "generate",
    "compile_needed": "kernel_prepare", "prepare_kernel_variants": "generate",
    "fresh_seed": "sampling",
    "APP": "settings", "CHECKSUM_MODES": "settings", "ENGINE": "settings", "POLICIES": "settings", "SAMPLING": "settings", "AppSettings": "settings", "EngineConfig": "settings", "Setting": "settings", "settings_table": "settings", "upgrade_keys": "settings", "validate": "settings",
    "format_bytes": "units", "format_duration": "units",
}


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    from importlib import import_module
    value = getattr(import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "POLICIES", "CHECKSUM_MODES", "SUPPORTED_MODEL_TYPES", "EngineConfig", "ModelArgs", "ConversionCancelled",
    "convert_checkpoint", "BudgetError", "Cancelled", "CheckpointError", "ConfigError", "ContextOverflowError",
    "EngineError", "ErrorKind", "ExpertReadError", "StoreError", "StoreUnreadable", "TokenizerError", "error_kind", "ABSENT", "REMOTE",
    "LOADING", "PINNED", "RESIDENT", "ChatMessage", "EngineFailure", "Finished", "FinishReason",
    "GenerateRequest", "Loaded",
    "LoadProgress", "ResidencySnapshot", "SamplingParams", "StepMetrics", "TokenEvent", "atomic_write_text",
    "Engine", "ENGINE", "SAMPLING", "APP", "AppSettings", "Setting", "settings_table", "upgrade_keys", "validate", "format_bytes",
    "format_duration", "fresh_seed", "DocEntry", "DocsIndex", "split_reasoning", "reasoning_open", "describe_model", "family_name", "supported_families",
    "GuiCheck", "check_gui", "compile_needed", "prepare_kernel_variants",
    "error_text",
]
