"""One app instance per data folder.

Two windows writing one data folder race on the history and on first-start conversions. The
first instance holds a ``QLockFile`` in the data folder (``colibri-app.lock``; a lock left by a
process that died is taken over, Qt checks the pid) and listens on a ``QLocalServer`` whose name
is derived from the folder. A second start of the same user on the same folder:

1. asks the first over the local socket to come to the front; if it answers, the second start
   ends at once (exit code 0): the user gets the window that already runs;
2. if nobody answers within ``timeout_ms`` (the first is hung, or another program holds the
   lock), it runs **read-only**: the history is opened read-only (never repaired or written),
   no model is opened, and a note in the window says why.
"""

from __future__ import annotations

import getpass
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QLockFile, QObject
from PySide6.QtNetwork import QLocalServer, QLocalSocket

log = logging.getLogger(__name__)

LOCK_NAME = "colibri-app.lock"
ACTIVATE = b"activate\n"
ACK = b"ok\n"
PRIMARY, FOCUSED, READ_ONLY = "primary", "focused", "read-only"


def server_name(data_dir: str | os.PathLike) -> str:
    """The local-socket name of the instance that owns ``data_dir`` (per user and folder)."""
    key = f"{os.getuid() if hasattr(os, 'getuid') else getpass.getuser()}:{Path(data_dir).resolve()}"
    return "colibri-" + hashlib.sha1(key.encode("utf-8")).hexdigest()[:20]


@dataclass
class Claim:
    """The outcome of :func:`claim`.

    mode: PRIMARY (this process owns the folder), FOCUSED (the running instance was asked to
        come to the front: end this start), or READ_ONLY (someone else holds the folder).
    owner: who holds the lock ("pid 1234 on host"), for the read-only note.
    """

    mode: str
    data_dir: Path
    lock: QLockFile | None = None
    owner: str = ""
    server: "ActivationServer | None" = None
    problem: str = ""   # READ_ONLY because the lock could not be taken at all (e.g. no write permission)

    @property
    def read_only_reason(self) -> str:
        """The sentence the read-only window shows (empty unless READ_ONLY)."""
        if self.mode != READ_ONLY:
            return ""
        if self.problem:
            return (f"The data folder {self.data_dir} cannot be locked for this window ({self.problem}). "
                    f"This window shows your chats read-only: it does not open a model or change the history. "
                    f"Check the folder's permissions, or set COLIBRI_DATA_DIR to a folder you can write.")
        who = f" ({self.owner})" if self.owner else ""
        return (f"Another colibri window{who} is using the data folder {self.data_dir} and did not answer. "
                f"This window shows your chats read-only: it does not open a model or change the history. "
                f"Close it and use the other window to chat.")

    def listen(self, on_activate: Callable[[], None]) -> None:
        """PRIMARY only: answer later starts by calling ``on_activate`` (GUI thread)."""
        if self.mode == PRIMARY and self.server is None:
            self.server = ActivationServer(server_name(self.data_dir), on_activate)

    def release(self) -> None:
        """Stop listening and unlock the folder (idempotent)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.lock is not None:
            self.lock.unlock()
            self.lock = None


class ActivationServer(QObject):
    """The first instance's end of the socket: each ``activate`` line calls ``on_activate``."""

    def __init__(self, name: str, on_activate: Callable[[], None]):
        super().__init__()
        self.on_activate = on_activate
        self.server = QLocalServer(self)
        self.server.setSocketOptions(QLocalServer.UserAccessOption)
        QLocalServer.removeServer(name)   # we hold the lock: any socket left there is stale
        if not self.server.listen(name):
            log.warning("cannot listen on %s: %s (a second start will open read-only)", name,
                        self.server.errorString())
        self.server.newConnection.connect(self._accept)

    def _accept(self) -> None:
        while self.server.hasPendingConnections():
            sock = self.server.nextPendingConnection()
            sock.readyRead.connect(lambda s=sock: self._read(s))
            sock.disconnected.connect(sock.deleteLater)

    def _read(self, sock: QLocalSocket) -> None:
        if bytes(sock.readAll()).startswith(ACTIVATE.strip()):
            sock.write(ACK)
            sock.flush()
            self.on_activate()

    def close(self) -> None:
        self.server.close()


def ask_to_activate(name: str, timeout_ms: int) -> bool:
    """Ask the instance listening on ``name`` to come to the front; True if it answered."""
    sock = QLocalSocket()
    sock.connectToServer(name)
    if not sock.waitForConnected(timeout_ms):
        return False
    sock.write(ACTIVATE)
    sock.flush()
    ok = sock.waitForReadyRead(timeout_ms) and bytes(sock.readAll()).startswith(ACK.strip())
    sock.disconnectFromServer()
    return bool(ok)


def claim(data_dir: str | os.PathLike, timeout_ms: int = 3000) -> Claim:
    """Take the data folder for this process, or find out who has it (see the module doc).
    Needs a QCoreApplication. Creates ``data_dir`` if missing (if it cannot, READ_ONLY)."""
    d = Path(data_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return Claim(READ_ONLY, d, problem=f"it cannot be created: {e.strerror or e}")
    lock = QLockFile(str(d / LOCK_NAME))
    lock.setStaleLockTime(0)   # only a dead owner makes the lock stale, never its age
    if lock.tryLock(0):
        return Claim(PRIMARY, d, lock)
    if lock.error() != QLockFile.LockError.LockFailedError:   # not held by another process
        problem = {QLockFile.LockError.PermissionError: "no permission to create the lock file"}.get(
            lock.error(), "the lock file could not be created")
        log.warning("cannot lock %s: %s", d / LOCK_NAME, problem)
        return Claim(READ_ONLY, d, problem=problem)
    info = lock.getLockInfo()   # PySide6: (pid, hostname, appname), or a false value
    owner = f"pid {info[0]} on {info[1]}" if info and len(info) >= 2 and info[0] else ""
    if ask_to_activate(server_name(d), timeout_ms):
        return Claim(FOCUSED, d, owner=owner)
    return Claim(READ_ONLY, d, owner=owner)
