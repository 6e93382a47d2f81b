"""Durable file writes used by the core and the library: fsync a folder, atomic replace."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def pid_is_gone(pid: int) -> bool:
    """True when no process ``pid`` exists (a process of another user counts as alive)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive (another user's process)
    return False


def fsync_dir(path: Path) -> None:
    """fsync the folder ``path`` so a rename inside it survives a crash (best effort: errors are ignored)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask (from /proc/self/status; elsewhere set-and-restore)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def file_mode() -> int:
    """The mode open() gives a new file (0o666 minus the umask, e.g. 0o644): temp-file
    helpers (mkstemp, safetensors' writer) create 0o600 files no other user can read."""
    return 0o666 & ~umask()


def dir_mode() -> int:
    """The mode mkdir() gives a new folder (0o777 minus the umask); mkdtemp makes 0o700."""
    return 0o777 & ~umask()


def normalize_modes(folder: str | os.PathLike) -> None:
    """Give ``folder`` and everything in it the umask modes of ordinary new files/folders."""
    fm, dm = file_mode(), dir_mode()
    os.chmod(folder, dm)
    for base, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(base, d), dm)
        for f in files:
            os.chmod(os.path.join(base, f), fm)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never a mix:
    write a temp file in the same folder, fsync it, rename over, fsync the folder. The file
    gets ``mode`` (default: the umask mode of a file made by open(), not mkstemp's 0o600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, file_mode() if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"), mode)


class FileLock:
    """An exclusive advisory lock (``flock``) on the file ``path``, for ``with``; the file is
    removed when the lock is released (after success and after an error alike).

    The rule: the lock file's existence means nothing, only the flock held on it does. A
    process killed while holding the lock leaves the file but not the lock (the kernel drops a
    flock when its holder dies), so the next ``FileLock`` on the path takes it at once and then
    removes the stale file. Removing the file while others wait is safe: after taking the flock
    a holder checks that the path still names the inode it locked (``fstat`` vs ``stat``) and
    starts over otherwise, so two holders never lock different files of one name.
    Where ``fcntl`` is missing (Windows) this is a no-op and creates no file.

    Raises (on enter): OSError when the lock file cannot be created (the message names it).
    Source: the lock-file protocol of flock(2) (BSD ``flock``), as in e.g. the ``filelock``
    package's UnixFileLock.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.fd: int | None = None

    def __enter__(self) -> "FileLock":
        try:
            import fcntl
        except ImportError:
            return self
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                self.fd = fd
                return self
            os.close(fd)  # the holder before us removed the file: lock the new one

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            try:
                os.unlink(self.path)  # while still holding the lock (see the class doc)
            except OSError:
                pass
            os.close(self.fd)  # closing releases the flock
            self.fd = None
