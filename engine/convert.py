"""Convert a Hugging Face OLMoE checkpoint into a colibri expert store.

Store layout (folder)::

    manifest.json        format name/version, model_type, quant, alignment, slab layout,
                         per layer: slot bytes; per expert: file, offset, length, crc32
    dense.safetensors    embeddings, attention, norms, router, lm_head (canonical names)
    experts/layer_NNN.bin  one 4096-aligned contiguous slab per expert holding gate_proj,
                         up_proj, down_proj and their scales (one read loads one expert: the
                         seeds' "consolidated expert I/O")
    config.json, tokenizer files, generation_config.json   copied from the source

The conversion streams tensor by tensor (peak RSS ~ the dense weights plus one expert),
refuses NaN/inf weights (and weights beyond the f16 range in an f16 store) naming the tensor,
and publishes atomically: everything is written to a folder unique to this conversion
(``.DST.<pid>.<random>.partial`` next to DST), fsynced, checked against its manifest (file
list and sizes, the ``files`` table), given the umask's ordinary modes, and renamed to DST
under a lock file (``.DST.lock``). When another process published DST while this one was
converting, its store is verified and used, and this one's copy is discarded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.numpy import save_file

from .checkpoint import Checkpoint, hf_names
from .errors import CheckpointError, EngineError, StoreError
from .events import LoadProgress
from .paths import fsync_dir, normalize_modes
from .quant import ALIGN, QUANTS, check_finite, quantize, slab_layout

log = logging.getLogger(__name__)

FORMAT_NAME = "colibri-expert-store"
FORMAT_VERSION = 1
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                "README.md", "LICENSE")


class ConversionCancelled(EngineError):
    """The user cancelled a conversion; nothing was published."""

    kind = "cancelled"


def dense_quant_for(quant: str) -> str:
    """Quantization of the resident dense matrices: int8 for the int8/int4 stores, else exact."""
    return "int8" if quant in ("int8", "int4") else quant


def _put(dense: dict, name: str, w: np.ndarray, quant: str) -> None:
    for k, v in quantize(w, quant).items():
        dense[f"{name}.{k}"] = np.ascontiguousarray(v)


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, quant: str = "int8",
                       overwrite: bool = False, group_size: int = 32,
                       progress: Callable[[LoadProgress], None] | None = None,
                       cancel: threading.Event | None = None,
                       extra_manifest: dict | None = None) -> Path:
    """Convert the HF OLMoE folder ``src`` into a store at ``dst``.

    Args:
        quant: "int8" (per-row), "int4" (group-wise, ``group_size`` columns per scale, two
            values per byte), "f16" or "f32" (exact, for tests).
        overwrite: replace an existing store at ``dst``.
        progress: called with LoadProgress(stage="convert", done=bytes, total=bytes, unit="B").
        cancel: set it to stop; raises ConversionCancelled and leaves no store behind.

    Returns: the store path.

    Raises:
        ConfigError / CheckpointError: the source is invalid (raised before writing anything).
        FileExistsError: ``dst`` exists and overwrite is False.
        ConversionCancelled: ``cancel`` was set.
    """
    if quant not in QUANTS:
        raise ValueError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    src, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst}: a store already exists; pass --overwrite to replace it")
    ck = Checkpoint(src)
    args = ck.args
    D, I, E, L = args.hidden_size, args.intermediate_size, args.num_experts, args.num_hidden_layers
    if quant == "int4" and (D % group_size or I % group_size):
        raise CheckpointError(f"{src}: int4 needs hidden_size ({D}) and intermediate_size ({I}) to be "
                              f"multiples of the group size {group_size}; use int8")
    dst.parent.mkdir(parents=True, exist_ok=True)
    seen = _identity(dst)
    _remove_stale_temps(dst)
    partial = Path(tempfile.mkdtemp(prefix=f".{dst.name}.{os.getpid()}.", suffix=".partial", dir=dst.parent))

    layout = slab_layout(quant, D, I, group_size)
    total = sum(ck.nbytes(n) for n in hf_names(args))
    done = 0
    last_report = 0.0

    def report(msg: str, force: bool = False) -> None:
        nonlocal last_report
        now = time.monotonic()
        if progress and (force or now - last_report > 0.1):
            last_report = now
            progress(LoadProgress("convert", done, total, "B", msg))

    def check_cancel() -> None:
        if cancel is not None and cancel.is_set():
            raise ConversionCancelled(f"conversion of {src} cancelled; nothing was written to {dst}")

    def get(name: str, stored_as: str) -> np.ndarray:
        w = ck.get(name)
        check_finite(name, w, stored_as, str(ck.file_of(name)))
        return w

    try:
        (partial / "experts").mkdir()
        dq = dense_quant_for(quant)
        dense: dict[str, np.ndarray] = {}
        experts_meta = []
        for i in range(L):
            hp = f"model.layers.{i}."
            cp = f"layers.{i}."
            for hf, ours, how in (("input_layernorm.weight", "input_layernorm", None),
                                  ("post_attention_layernorm.weight", "post_attention_layernorm", None),
                                  ("self_attn.q_norm.weight", "q_norm", None),
                                  ("self_attn.k_norm.weight", "k_norm", None),
                                  ("mlp.gate.weight", "router", None),
                                  ("self_attn.q_proj.weight", "q_proj", dq),
                                  ("self_attn.k_proj.weight", "k_proj", dq),
                                  ("self_attn.v_proj.weight", "v_proj", dq),
                                  ("self_attn.o_proj.weight", "o_proj", dq)):
                check_cancel()
                w = get(hp + hf, how or "f32")
                if how is None:
                    dense[cp + ours] = w  # norms and router stay float32: routing is sensitive
                else:
                    _put(dense, cp + ours, w, how)
                done += ck.nbytes(hp + hf)
                report(hp + hf)
            # Experts: one slab each, appended to this layer's file at 4096-aligned offsets.
            rel = f"experts/layer_{i:03d}.bin"
            metas = []
            slab = np.zeros(layout["slot_bytes"], dtype=np.uint8)
            with open(partial / rel, "wb") as f:
                for e in range(E):
                    check_cancel()
                    slab[:] = 0
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        name = f"{hp}mlp.experts.{e}.{proj}.weight"
                        parts = quantize(get(name, quant), quant, group_size)
                        for k, arr in parts.items():
                            _, off, _, _ = next(x for x in layout["fields"] if x[0] == f"{proj}.{k}")
                            b = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
                            slab[off:off + b.size] = b
                        done += ck.nbytes(name)
                    offset = f.tell()
                    f.write(slab.tobytes())
                    metas.append({"file": rel, "offset": offset, "length": layout["slot_bytes"],
                                  "crc32": zlib.crc32(slab)})
                    report(f"{hp}mlp.experts.{e}")
                f.flush()
                os.fsync(f.fileno())
            experts_meta.append(metas)
        check_cancel()
        for hf, ours in (("model.embed_tokens.weight", "embed_tokens"), ("model.norm.weight", "norm")):
            w = get(hf, "f32" if ours == "norm" else dq)
            if ours == "norm":
                dense["norm"] = w
            else:
                _put(dense, ours, w, dq)
            done += ck.nbytes(hf)
        lm_name = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
        _put(dense, "lm_head", get(lm_name, dq), dq)
        if not args.tie_word_embeddings:
            done += ck.nbytes(lm_name)
        report("dense weights", force=True)
        dense_path = partial / "dense.safetensors"
        save_file(dense, str(dense_path), metadata={"format": FORMAT_NAME, "dense_quant": dq})
        dense_bytes = sum(v.nbytes for v in dense.values())
        del dense
        with open(dense_path, "rb+") as f:
            os.fsync(f.fileno())
        for name in COPIED_FILES:
            if (src / name).exists():
                try:
                    shutil.copyfile(src / name, partial / name)
                except OSError as e:
                    raise CheckpointError(f"{src / name}: cannot be copied into the store ({e})") from None
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model_type": args.model_type,
            "model_name": src.name,
            "source": str(src.resolve()),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "quant": quant,
            "dense_quant": dq,
            "group_size": group_size if quant == "int4" else None,
            "alignment": ALIGN,
            "checksum": "crc32",
            "dense_file": "dense.safetensors",
            "dense_bytes": dense_bytes,
            "slab_layout": {"fields": [list(x) for x in layout["fields"]],
                            "data_bytes": layout["data_bytes"], "slot_bytes": layout["slot_bytes"]},
            "slot_bytes": [layout["slot_bytes"]] * L,
            "num_layers": L,
            "num_experts": E,
            "experts": experts_meta,
            "files": {},
            **(extra_manifest or {}),
        }
        manifest["files"] = {rel: (partial / rel).stat().st_size
                             for rel in [manifest["dense_file"]] + [f"experts/layer_{i:03d}.bin" for i in range(L)]}
        mpath = partial / "manifest.json"
        with open(mpath, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        check_store_files(partial, manifest)
        normalize_modes(partial)
        fsync_dir(partial / "experts")
        fsync_dir(partial)
        check_cancel()
        _publish(partial, dst, seen, manifest, overwrite)
        report("done", force=True)
        return dst
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone after a publish; else nothing half-made stays
        ck.close()


def _identity(path: Path):
    """What is at ``path`` now: None, or (device, inode, manifest 'created') of the folder."""
    try:
        st = path.stat()
    except OSError:
        return None
    try:
        created = json.loads((path / "manifest.json").read_text(encoding="utf-8")).get("created")
    except (OSError, ValueError, AttributeError):
        created = None
    return (st.st_dev, st.st_ino, created)


def _remove_stale_temps(dst: Path) -> None:
    """Delete temp folders of conversions to ``dst`` whose process is gone (a crash or kill)."""
    for p in dst.parent.glob(f".{dst.name}.*.partial"):
        try:
            pid = int(p.name[len(dst.name) + 2:].split(".", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass  # alive (another user's process): leave it


class _PublishLock:
    """An exclusive advisory lock (flock) on ``.DST.lock`` next to the store, held while a
    conversion publishes (no-op where fcntl is missing)."""

    def __init__(self, dst: Path):
        self.path = dst.with_name(f".{dst.name}.lock")
        self.fd = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def _publish(partial: Path, dst: Path, seen, manifest: dict, overwrite: bool) -> None:
    """Rename the finished ``partial`` to ``dst`` (lock held). If a different folder appeared
    at ``dst`` since the conversion started (``seen``), another process published first:
    keep theirs when it verifies and holds the same conversion; otherwise replace it only
    with ``overwrite`` (else FileExistsError)."""
    with _PublishLock(dst):
        now = _identity(dst)
        if now is not None and now != seen:
            try:
                theirs = json.loads((dst / "manifest.json").read_text(encoding="utf-8"))
                check_store_files(dst, theirs)
                same = all(theirs.get(k) == manifest.get(k) for k in ("source", "quant", "group_size"))
                why = "a different conversion"
            except (OSError, ValueError, StoreError, AttributeError) as e:
                same, why = False, f"a broken store ({e})"
            if same:
                log.info("%s: another process published this conversion first; using it", dst)
                return
            if not overwrite:
                raise FileExistsError(f"{dst}: another process published {why} here while this "
                                      f"conversion ran; pass --overwrite to replace it")
            log.warning("%s: replacing %s another process published", dst, why)
        if now is None:
            os.rename(partial, dst)  # fails on an existing non-empty folder, never merges
        else:
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.rename(dst, old)
            os.rename(partial, dst)
            shutil.rmtree(old, ignore_errors=True)
        fsync_dir(dst.parent)


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
