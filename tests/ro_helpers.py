"""Run a program with some folders read-only, also as root (who ignores mode bits).

Not root: ``chmod -R a-w`` (the caller restores the modes with :func:`restore_writable`).
Root: read-only bind mounts of the folders in a private mount namespace (``unshare -m``),
which only that one command sees. None when neither works (a test then skips).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path


def read_only_prefix(*folders: Path) -> list[str] | None:
    """A command prefix that runs the command after it with ``folders`` read-only; [] when
    the caller should chmod them itself (:func:`make_read_only`), None if impossible here."""
    if getattr(os, "geteuid", lambda: 1)() != 0:
        return []
    if not shutil.which("unshare"):
        return None
    mounts = " && ".join(f"mount --bind -o ro {shlex.quote(str(f))} {shlex.quote(str(f))}" for f in folders)
    probe = f"{mounts} && ! touch {shlex.quote(str(folders[0]))}/.ro-probe 2>/dev/null"
    try:
        if subprocess.run(["unshare", "-m", "sh", "-c", probe], capture_output=True, timeout=60).returncode != 0:
            return None
    except (OSError, subprocess.SubprocessError):
        return None
    return ["unshare", "-m", "sh", "-c", f'{mounts} && exec "$0" "$@"']


def make_read_only(*folders: Path) -> None:
    """chmod a-w everything under ``folders`` (effective for users other than root)."""
    for top in folders:
        for p in [top, *top.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode & ~0o222)


def restore_writable(*folders: Path) -> None:
    """Give the owner write permission back (so pytest can remove the temp folders)."""
    for top in folders:
        for p in [top, *top.rglob("*")]:
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | 0o200)
