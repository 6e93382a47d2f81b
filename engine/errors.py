"""Engine error types. Every message names the file, tensor or setting and what to do."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose.

    ``kind`` is a short tag the GUI uses to pick a banner: config, store, budget, context,
    io, tokenizer, internal.
    """

    kind = "internal"


class ConfigError(EngineError, ValueError):
    """A config.json / settings value is missing, of the wrong type or out of range."""

    kind = "config"


class CheckpointError(EngineError, ValueError):
    """A Hugging Face checkpoint file is missing, truncated, a Git LFS pointer or inconsistent."""

    kind = "store"


class StoreError(EngineError, ValueError):
    """A converted expert store is missing, of an unknown version or corrupt."""

    kind = "store"


class ContextOverflowError(EngineError, ValueError):
    """The prompt (plus the requested tokens) does not fit in the context window."""

    kind = "context"


class BudgetError(EngineError, MemoryError):
    """The RAM budget cannot hold the dense weights, the KV cache and one expert slot per layer."""

    kind = "budget"


class ExpertReadError(EngineError, OSError):
    """Reading an expert slab from the store failed twice."""

    kind = "io"


class TokenizerError(EngineError, ValueError):
    """Tokenizer files or the chat template are missing or invalid."""

    kind = "tokenizer"
