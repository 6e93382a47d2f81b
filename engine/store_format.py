"""Identity of the converted store format, shared by the writer (convert.py) and the reader
(expert_store.py) so that the reader never imports the converter."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import StoreError

FORMAT_NAME = "colibri-expert-store"  # manifest.json "format"
# manifest.json "version"; bump when the layout changes. The reader opens every version in
# READ_VERSIONS and refuses others (with a reconvert hint).
#   1: each expert entry carries "crc32" (zlib CRC-32 of the slab), manifest "checksum": "crc32"
#   2: each expert entry carries "xxh3_64" (xxHash XXH3 64-bit, seed 0, of the slab), manifest
#      "checksum": "xxh3_64": ~10x less CPU per slab than zlib's CRC-32 (0.25 vs 2.3 ms for a
#      6.3 MB slab on the reference machine), so verification hides behind the next read.
#   3: int4 group scales stored as IEEE half bits (uint16) instead of float32 (engine/quant.py):
#      int4 slabs 10% smaller; checksum as 2. Versions 1 and 2 (float32 scales) are still read.
#   4: manifest "expert_layout": "row_major" or "interleaved_4": int4 expert weights stored
#      row-interleaved by 4 (engine/quant.py interleave_q4; the slab layout's w fields are then
#      [O / 4, N / 64, 128]), which the decode kernels read as one stream per 4 rows. convert's
#      "auto" writes it where the CPU runs the interleaved kernels and the widths allow
#      (int4_interleavable); --expert-layout interleaved_4 asks for it on any CPU.
FORMAT_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
CHECKSUM_OF_VERSION = {1: "crc32", 2: "xxh3_64", 3: "xxh3_64", 4: "xxh3_64"}  # the manifest "checksum" each version writes
EXPERT_LAYOUTS = ("row_major", "interleaved_4")  # manifest "expert_layout" (format 4; earlier: row_major)


def slab_checksum(kind: str, data) -> int:
    """The checksum ``kind`` ("crc32" = zlib CRC-32, "xxh3_64" = xxHash XXH3-64, seed 0) of
    ``data`` (a bytes-like object or a contiguous uint8 array) as an unsigned int.

    Both release the GIL for large buffers (zlib.crc32 above 5 KiB; xxhash always), so a
    reader thread verifying a slab does not stall the compute thread.
    Sources: zlib's crc32 (ISO 3309 / ITU-T V.42); XXH3 from https://github.com/Cyan4973/xxHash
    through the ``xxhash`` package.

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "xxh3_64":
        import xxhash
        return xxhash.xxh3_64_intdigest(data)
    if kind == "crc32":
        import zlib
        return zlib.crc32(data)
    raise ValueError(f"unknown slab checksum {kind!r} (known: crc32, xxh3_64)")


STORE_MARKERS = ("manifest.json", "dense.safetensors", "experts")


def looks_like_store(path: str | os.PathLike) -> bool:
    """True for a folder holding any part of a store (manifest.json, dense.safetensors or
    experts/), healthy or broken: what the library lists and deletes, and what
    ``convert --overwrite`` may replace."""
    p = Path(path)
    return p.is_dir() and not p.is_symlink() and any((p / n).exists() for n in STORE_MARKERS)


def reconvert_command(folder: str | os.PathLike, manifest: dict | None) -> str:
    """The command that converts the store at ``folder`` again, from what its manifest says
    (in backquotes): ``colibri download REPO --quant Q --overwrite`` for a hub model,
    ``colibri convert --overwrite --quant Q [--dense-quant D] [--group-size G] [--expert-layout
    L] SRC FOLDER`` for a local source (the options that shaped it: a bare reconvert could pick
    another layout or dense precision), else a template with HF_FOLDER."""
    m = manifest if isinstance(manifest, dict) else {}
    quant = m.get("quant")
    q = f" --quant {quant}" if quant in ("int8", "int4", "f16", "f32", "mxfp4") else ""
    # the options that shaped it (a bare reconvert could pick another layout or dense precision)
    # (`colibri download` takes only --quant: it converts with the defaults)
    dq, gs, el = m.get("dense_quant"), m.get("group_size"), m.get("expert_layout")
    opts = q
    if dq in ("int8", "int4", "f16", "f32") and quant in ("int8", "int4", "f16", "f32", "mxfp4"):
        opts += f" --dense-quant {dq}"
    if isinstance(gs, int) and not isinstance(gs, bool) and gs != 32:
        opts += f" --group-size {gs}"
    if el in EXPERT_LAYOUTS and quant == "int4":
        opts += f" --expert-layout {el}"
    repo, src = m.get("hub_repo"), m.get("source")
    if isinstance(src, str) and src.startswith("hf://") and not (isinstance(repo, str) and repo):
        repo = src[len("hf://"):].split("@", 1)[0]
    if isinstance(repo, str) and repo:
        gf = m.get("hub_gguf_file")
        if quant == "gguf" and isinstance(gf, str) and gf:  # the same file of a -GGUF repository
            q = f" --gguf {gf}"
        return f"`colibri download {repo}{q} --overwrite`"
    if isinstance(src, str) and src:
        return f"`colibri convert --overwrite{opts} {src} {folder}`"
    return f"`colibri convert --overwrite{opts} HF_FOLDER {folder}`"


def check_store_files(folder: str | os.PathLike, manifest: dict) -> None:
    """Every file a store's manifest names is there with the right size: the dense file and
    each expert file (the manifest's ``files`` sizes when recorded; at least the end of its
    last expert slab always), and the dense file's safetensors header is whole
    (:func:`check_safetensors_header`). Reads a few KB, never a slab.

    Raises:
        StoreError: naming the missing, short or damaged file and saying to re-convert.
    """
    folder = Path(folder)
    redo = f"re-convert it with {reconvert_command(folder, manifest)}"
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
    dense = folder / manifest["dense_file"]
    try:
        why = check_safetensors_header(dense)
    except PermissionError:
        raise StoreError(f"{dense}: permission denied: this user cannot read this store file; make it readable "
                         f"(chmod -R a+rX {folder}) or convert your own copy with `colibri convert`") from None
    if why:
        raise StoreError(f"{dense}: the dense weights file is damaged ({why}); {redo}")


MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header


def check_safetensors_header(path: str | os.PathLike) -> str | None:
    """None when ``path`` starts with a whole safetensors header (8-byte little-endian
    length N, N bytes of JSON object) whose tensors' ``data_offsets`` all end inside the file;
    else what is wrong, in a few words. Reads 8 + N bytes.

    Raises:
        PermissionError: the file may not be read (the caller says what to do).

    Format: https://github.com/huggingface/safetensors (README, "Format").
    """
    import json
    import struct
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return f"header length {n} does not fit in the file's {size} bytes"
            meta = json.loads(f.read(n).decode("utf-8"))
    except PermissionError:
        raise
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    except (ValueError, UnicodeDecodeError) as e:
        return f"the header is not JSON ({e})"
    if not isinstance(meta, dict):
        return "the header is not a JSON object"
    end = 0
    for name, t in meta.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in t["data_offsets"])
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r} has no valid data_offsets"
        if not 0 <= begin <= stop:
            return f"tensor {name!r} has data_offsets {t['data_offsets']}"
        end = max(end, stop)
    if 8 + n + end > size:
        return f"truncated: the tensors need {8 + n + end} bytes, the file has {size}"
    return None
