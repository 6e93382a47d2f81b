"""The small default model shipped in resources/models/, converted on first use."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Callable

from ..docs_lookup import INDEX_FILE, DocsIndex
from ..errors import StoreError
from ..events import LoadProgress
from ..expert_store import store_problem
from ..fsutil import atomic_write_bytes
from ..heat import FILENAME as HEAT_FILE
from ..store_format import FORMAT_VERSION
from .paths import models_dir, resources_dir

log = logging.getLogger(__name__)
DEFAULT_MODEL = "colibri-stdlib-moe"
DEFAULT_QUANT = "int8"


def default_model_dir() -> Path:
    """The bundled Hugging Face checkpoint folder."""
    return resources_dir() / "models" / DEFAULT_MODEL


def default_store(progress: Callable[[LoadProgress], None] | None = None,
                  cancel: threading.Event | None = None, quant: str = DEFAULT_QUANT) -> Path:
    """Path of the converted default model in the user data directory, converting it first
    if needed (atomic; a store from an older checkpoint, or a broken one, is rebuilt).

    Raises:
        StoreError: the bundled model is missing from resources/ (broken install).
    """
    src = default_model_dir()
    if not (src / "config.json").exists():
        raise StoreError(f"{src}: the bundled default model is missing; reinstall colibri-desktop "
                         f"or open another model with the wizard")
    dst = models_dir() / f"{DEFAULT_MODEL}-{quant}"
    stamp = int((src / "model.safetensors").stat().st_mtime) if (src / "model.safetensors").exists() else 0
    m = dst / "manifest.json"
    man = None
    if m.exists():
        try:
            man = json.loads(m.read_text(encoding="utf-8"))
            # rebuilt when the checkpoint changed, the store predates this engine's format
            # (a version 1 store still opens; rebuilding gives it the faster checksums) or it
            # is broken (a truncated or missing file: the library's one validation)
            docs_ok = (src / INDEX_FILE).exists() == (dst / INDEX_FILE).exists()  # an index added or removed
            if docs_ok and (dst / INDEX_FILE).exists():
                try:  # a damaged copy of the bundled index is rebuilt, not run without lookup
                    DocsIndex.open(dst / INDEX_FILE)
                except (OSError, ValueError) as e:
                    log.warning("the converted default model's documentation index is damaged (%s); "
                                "converting it again", e)
                    docs_ok = False
            if man.get("source_mtime") == stamp and man.get("version") == FORMAT_VERSION and docs_ok:
                why = store_problem(dst)
                if why is None:
                    return dst
                log.warning("the converted default model is broken (%s); converting it again", why)
        except (OSError, ValueError, AttributeError):
            pass
    # The routing history is the user's (which experts their questions use): it outlives a
    # store converted again from the same checkpoint (or one whose manifest cannot tell)
    heat = None
    if not isinstance(man, dict) or man.get("source_mtime") == stamp:
        try:
            heat = (dst / HEAT_FILE).read_bytes()
        except OSError:
            pass
    from ..convert import convert_checkpoint  # here: naming the default model needs no converter
    convert_checkpoint(src, dst, quant=quant, overwrite=True, progress=progress, cancel=cancel,
                       extra_manifest={"source_mtime": stamp})
    if heat is not None and not (dst / HEAT_FILE).exists():
        atomic_write_bytes(dst / HEAT_FILE, heat)
    return dst
