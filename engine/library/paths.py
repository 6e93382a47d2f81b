"""Where colibri-desktop keeps user data (platformdirs): models, downloads, settings; free disk space."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import platformdirs

from .errors import FolderError

APP_NAME = "colibri-desktop"


def blocking_file(p: str | os.PathLike) -> Path | None:
    """The regular file (or other non-folder) that keeps ``p`` from being a folder: ``p``
    itself or its nearest existing ancestor; None when ``p`` is a folder or can be made one."""
    q = Path(p).expanduser().absolute()
    for a in (q, *q.parents):
        if a.is_dir():
            return None
        if a.exists() or a.is_symlink():
            return a
    return None


def folder_problem(p: str | os.PathLike, env: str | None = None, what: str = "data") -> str | None:
    """None when ``p`` is (or can be created as) a folder, else one sentence: which path is a
    file, not a folder, and what to do (``env``: the environment variable that chose ``p``,
    None for a platform default)."""
    p = Path(p).expanduser()
    f = blocking_file(p)
    if f is None:
        return None
    if f == p.absolute():
        head = f"{p} is a file, not a folder"
    else:
        head = f"{p} cannot be created: {f} is a file, not a folder"
    if env and os.environ.get(env):
        return (f"{env}={os.environ[env]}: {head}. Point {env} at a folder for colibri's {what} (it is "
                f"created if missing), or unset it to use the default folder.")
    return f"{head}. Move or rename that file: colibri keeps its {what} in {p}."


def _ensure_folder(p: Path, env: str | None, what: str) -> Path:
    """Create the folder ``p`` (and parents); a clear FolderError otherwise."""
    why = folder_problem(p, env, what)
    if why:
        raise FolderError(why)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        via = f" ({env}={os.environ[env]})" if env and os.environ.get(env) else ""
        raise FolderError(f"{p}{via}: the folder for {what} cannot be created ({e.strerror or e}); check its "
                          f"permissions" + (f", or point {env} at a folder you can write" if env else "")) from None
    return p


def user_data_dir(create: bool = True) -> Path:
    """Models, chat history, routing heat. ``COLIBRI_DATA_DIR`` overrides (tests use it).
    Created if missing unless ``create`` is False (then it may not exist, or be a file:
    :func:`folder_problem` says).

    Raises:
        FolderError (an OSError): it cannot be created, e.g. the path is a file; the message
            names the path, the variable and what to do.
    """
    d = os.environ.get("COLIBRI_DATA_DIR")
    p = Path(d).expanduser() if d else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    if create:
        _ensure_folder(p, "COLIBRI_DATA_DIR", "models, downloads and chats")
    return p


def user_config_dir(create: bool = True) -> Path:
    """Settings file. ``COLIBRI_CONFIG_DIR`` overrides (tests use it). Created if missing
    unless ``create`` is False.

    Raises:
        FolderError (an OSError): it cannot be created (as user_data_dir).
    """
    d = os.environ.get("COLIBRI_CONFIG_DIR")
    p = Path(d).expanduser() if d else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))
    if create:
        _ensure_folder(p, "COLIBRI_CONFIG_DIR", "settings")
    return p


def models_dir() -> Path:
    """Converted stores: ``user_data_dir()/models`` (created if missing). Raises FolderError."""
    return _ensure_folder(user_data_dir() / "models", None, "converted models")


RESOURCES_PACKAGE = "colibri_resources"


def resources_dir() -> Path:
    """The folder holding the bundled data (``models/<name>/``, the default model).

    Two layouts: a source tree, an editable install or a frozen bundle keeps ``resources/``
    beside the ``engine`` package; an installed wheel (``pip install .``, pipx) carries the same
    files as the data-only package ``colibri_resources`` (pyproject.toml package data), found
    with importlib.  The folder beside ``engine`` wins when it has ``models/``, so a source tree
    always uses its own copy.  If neither exists the beside-path is returned (callers report
    the missing model with this path).
    """
    beside = Path(__file__).resolve().parent.parent.parent / "resources"
    if (beside / "models").is_dir():
        return beside
    try:
        spec = importlib.util.find_spec(RESOURCES_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / "models").is_dir():
                return Path(loc)
    return beside


def downloads_dir() -> Path:
    """Where hub downloads go: ``user_data_dir()/downloads`` (created). Raises FolderError."""
    return _ensure_folder(user_data_dir() / "downloads", None, "downloads")


def download_dir_for(repo_id: str, dest_root: str | os.PathLike | None = None) -> Path:
    """The download folder of ``repo_id``: ``<root>/<owner>--<name>``."""
    root = Path(dest_root) if dest_root else downloads_dir()
    return root / repo_id.replace("/", "--")


def store_name(model_name: str, quant: str) -> str:
    """Folder name of a converted store: ``<name>-<quant>``."""
    return f"{model_name}-{quant}"


def _existing_ancestor(p: Path) -> Path:
    p = Path(p).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_space(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``path`` (shutil.disk_usage)."""
    return int(shutil.disk_usage(_existing_ancestor(Path(path))).free)


def same_disk(a: Path, b: Path) -> bool:
    """True when ``a`` and ``b`` (or their nearest existing ancestors) are on one filesystem."""
    try:
        return os.stat(_existing_ancestor(a)).st_dev == os.stat(_existing_ancestor(b)).st_dev
    except OSError:
        return False
