"""Engine error types and the one list of error kinds. Every message names the file, tensor or
setting and what to do."""

from __future__ import annotations

from enum import StrEnum


class ErrorKind(StrEnum):
    """What went wrong, as a machine tag the GUI uses to pick a banner title and hint.

    A ``StrEnum``: ``ErrorKind.STORE == "store"``, so the values also serialize as plain text.
    Engine errors carry one as ``kind``; the app's ``EngineFailure.kind`` is one of these.
    The last four are app notices (history reset, settings file, missing model, feature not
    available), listed here so that no kind is a free string anywhere.
    """

    CONFIG = "config"          # a config.json or settings value is invalid
    STORE = "store"            # a store or checkpoint is missing, corrupt or inconsistent
    BUDGET = "budget"          # the RAM budget cannot hold the model's minimum
    CONTEXT = "context"        # the prompt does not fit in the context window
    IO = "io"                  # reading from disk or the network failed
    DISK = "disk"              # not enough free disk space (or another OS error writing)
    TOKENIZER = "tokenizer"    # tokenizer files or the chat template are invalid
    CANCELLED = "cancelled"    # the user cancelled (conversion, download, generation)
    EXISTS = "exists"          # the target (store folder) already exists
    REQUEST = "request"        # an invalid generation request (empty prompt, bad ids)
    GENERATION = "error"       # generation stopped with an engine error (Finished.error)
    INTERNAL = "internal"      # a bug: anything not raised on purpose
    HISTORY = "history"        # app notice: the chat history was reset
    SETTINGS = "settings"      # app notice: the settings file could not be used or saved
    MODEL = "model"            # app notice: the chosen model was not found
    UNAVAILABLE = "unavailable"  # app notice: a feature is not in this build


class EngineError(Exception):
    """Base class of every error the engine raises on purpose; ``kind`` is an ErrorKind."""

    kind: ErrorKind = ErrorKind.INTERNAL


class ConfigError(EngineError, ValueError):
    """A config.json / settings value is missing, of the wrong type or out of range."""

    kind = ErrorKind.CONFIG


class CheckpointError(EngineError, ValueError):
    """A Hugging Face checkpoint file is missing, truncated, a Git LFS pointer or inconsistent."""

    kind = ErrorKind.STORE


class StoreError(EngineError, ValueError):
    """A converted expert store is missing, of an unknown version or corrupt."""

    kind = ErrorKind.STORE


class StoreUnreadable(StoreError):
    """A store file could not be read now (permissions, an I/O error, too many open files):
    the store is not known to be broken, so nothing deletes it for this."""

    kind = ErrorKind.IO


class ContextOverflowError(EngineError, ValueError):
    """The prompt (plus the requested tokens) does not fit in the context window."""

    kind = ErrorKind.CONTEXT


class BudgetError(EngineError, MemoryError):
    """The RAM budget cannot hold the dense weights, the KV cache and one expert slot per layer."""

    kind = ErrorKind.BUDGET


class ExpertReadError(EngineError, OSError):
    """Reading an expert slab from the store failed twice."""

    kind = ErrorKind.IO


class TokenizerError(EngineError, ValueError):
    """Tokenizer files or the chat template are missing or invalid."""

    kind = ErrorKind.TOKENIZER


class Cancelled(EngineError):
    """The user cancelled through a cancel event (generation, conversion, download).

    What was finished stays valid: a cancelled conversion publishes nothing, a cancelled
    download keeps its partial files for resuming, a cancelled generation ends with
    ``Finished(finish_reason="cancelled")``.
    """

    kind = ErrorKind.CANCELLED


def error_kind(e: BaseException) -> ErrorKind:
    """The ErrorKind of any exception: its ``kind`` for engine errors, EXISTS for
    FileExistsError, DISK for other OS errors, else INTERNAL."""
    if isinstance(e, EngineError):
        return ErrorKind(e.kind)
    if isinstance(e, FileExistsError):
        return ErrorKind.EXISTS
    if isinstance(e, OSError):
        return ErrorKind.DISK
    return ErrorKind.INTERNAL


def error_text(e: BaseException) -> str:
    """The words of an error for a person: an OSError's own words without Python's "[Errno N]"
    prefix (its strerror, then the file names it carries), any other error as it reads."""
    if isinstance(e, OSError) and e.strerror and type(e).__str__ is OSError.__str__:
        names = [repr(str(f)) for f in (e.filename, e.filename2) if f is not None]
        return e.strerror + (f": {' -> '.join(names)}" if names else "")
    return str(e)
