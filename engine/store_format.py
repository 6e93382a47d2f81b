"""Identity of the converted store format, shared by the writer (convert.py) and the reader
(expert_store.py) so that the reader never imports the converter."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import StoreError

FORMAT_NAME = "colibri-expert-store"  # manifest.json "format"
FORMAT_VERSION = 1  # manifest.json "version"; bump when the layout changes (the reader refuses others)


def check_store_files(folder: str | os.PathLike, manifest: dict) -> None:
    """Every file a store's manifest names is there with the right size: the dense file and
    each expert file (the manifest's ``files`` sizes when recorded; at least the end of its
    last expert slab always).

    Raises:
        StoreError: naming the missing or short file and saying to re-convert.
    """
    folder = Path(folder)
    src = manifest.get("source") if isinstance(manifest, dict) else None
    redo = (f"re-convert it: colibri convert --overwrite {src} {folder}" if src else
            f"re-convert it with `colibri convert --overwrite SRC {folder}`")
    try:
        need: dict[str, int] = {}
        for row in manifest["experts"]:
            for e in row:
                need[e["file"]] = max(need.get(e["file"], 0), int(e["offset"]) + int(e["length"]))
        need.setdefault(manifest["dense_file"], 1)
        for rel, size in (manifest.get("files") or {}).items():
            need[rel] = int(size)
        exact = set(manifest.get("files") or {})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StoreError(f"{folder / 'manifest.json'}: the file table is malformed ({e!r}); {redo}") from None
    for rel, size in need.items():
        p = folder / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise StoreError(f"{folder / 'manifest.json'}: names a file outside the store ({rel}); {redo}")
        try:
            got = p.stat().st_size
        except FileNotFoundError:
            raise StoreError(f"{p}: missing from the store (an interrupted or concurrent conversion); "
                             f"{redo}") from None
        except OSError as e:
            raise StoreError(f"{p}: cannot be checked ({e}); {redo}") from None
        if got < size or (rel in exact and got != size):
            raise StoreError(f"{p}: is {got} bytes but the manifest says {size} (an interrupted or "
                             f"concurrent conversion); {redo}")
