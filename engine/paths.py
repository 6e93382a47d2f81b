"""Where colibri-desktop keeps user data (platformdirs), and atomic file writes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import platformdirs

APP_NAME = "colibri-desktop"


def user_data_dir() -> Path:
    """Models, chat history, routing heat. ``COLIBRI_DATA_DIR`` overrides (tests use it)."""
    d = os.environ.get("COLIBRI_DATA_DIR")
    p = Path(d) if d else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    p.mkdir(parents=True, exist_ok=True)
    return p


def user_config_dir() -> Path:
    """Settings file. ``COLIBRI_CONFIG_DIR`` overrides (tests use it)."""
    d = os.environ.get("COLIBRI_CONFIG_DIR")
    p = Path(d) if d else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))
    p.mkdir(parents=True, exist_ok=True)
    return p


def models_dir() -> Path:
    p = user_data_dir() / "models"
    p.mkdir(parents=True, exist_ok=True)
    return p


def resources_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "resources"


def fsync_dir(path: Path) -> None:
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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never a mix:
    write a temp file in the same folder, fsync it, rename over, fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
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


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
