"""Where colibri-desktop keeps user data (platformdirs): models, downloads, settings; free disk space."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import platformdirs

APP_NAME = "colibri-desktop"


def user_data_dir(create: bool = True) -> Path:
    """Models, chat history, routing heat. ``COLIBRI_DATA_DIR`` overrides (tests use it).
    Created if missing unless ``create`` is False (then it may not exist). Raises OSError when
    it cannot be created."""
    d = os.environ.get("COLIBRI_DATA_DIR")
    p = Path(d) if d else Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))
    if create:
        p.mkdir(parents=True, exist_ok=True)
    return p


def user_config_dir(create: bool = True) -> Path:
    """Settings file. ``COLIBRI_CONFIG_DIR`` overrides (tests use it). Created if missing
    unless ``create`` is False. Raises OSError when it cannot be created."""
    d = os.environ.get("COLIBRI_CONFIG_DIR")
    p = Path(d) if d else Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))
    if create:
        p.mkdir(parents=True, exist_ok=True)
    return p


def models_dir() -> Path:
    """Converted stores: ``user_data_dir()/models`` (created if missing)."""
    p = user_data_dir() / "models"
    p.mkdir(parents=True, exist_ok=True)
    return p


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
    """Where hub downloads go: ``user_data_dir()/downloads``."""
    p = user_data_dir() / "downloads"
    p.mkdir(parents=True, exist_ok=True)
    return p


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
