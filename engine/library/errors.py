"""Errors of the model library (hub, disk, verification). Cancelling is engine.errors.Cancelled."""

from __future__ import annotations

from ..errors import Cancelled, EngineError, ErrorKind


class HubError(EngineError):
    """The hub could not be reached, the repo / revision / file does not exist or is gated,
    or a download failed. The message says what to do."""

    kind = ErrorKind.IO


class DiskSpaceError(HubError):
    """A target disk has not enough free space; the message gives needed and free bytes."""

    kind = ErrorKind.DISK


class VerificationError(HubError):
    """A downloaded file does not match the hub's size / sha256; the bad file was removed."""

    kind = ErrorKind.IO


class FolderError(EngineError, NotADirectoryError):
    """A user folder (data, config, models, downloads) cannot be used: it is a file, or it
    cannot be created. An OSError too, so callers that catch OSError keep working; the
    message names the path (and the environment variable that chose it) and what to do."""

    kind = ErrorKind.DISK


DownloadCancelled = Cancelled  # the old name; one Cancelled class for every cancel
