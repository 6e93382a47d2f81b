"""Convert a Hugging Face MoE checkpoint (any family of engine/models) into a colibri expert store.

Store layout (folder)::

    manifest.json        format name/version, model_type (the family), quant, alignment, slab
                         layout; num_layers = M MoE layers (rows of the expert table),
                         num_hidden_layers = L, moe_layers = the transformer layer of each
                         row; per MoE layer: slot bytes; per expert: file, offset, length, xxh3_64
                         (store version 3: int4 scales in half precision; 4: "expert_layout",
                         int4 expert weights row-interleaved by 4 where it fits; versions 1-3
                         still open)
    dense.safetensors    embeddings, attention (+ biases, q/k norms), norms, routers, lm_head,
                         shared experts and dense-layer MLPs (canonical names, see
                         engine/models/base.py decoder_tensors): all resident
    experts/layer_NNN.bin  (NNN = MoE-layer index) one 4096-aligned contiguous slab per expert
                         holding gate_proj, up_proj, down_proj and their scales (one read loads
                         one expert: the seeds' "consolidated expert I/O"); Mixtral's w1/w3/w2
                         are stored as gate_proj/up_proj/down_proj
    config.json, tokenizer files, generation_config.json   copied from the source

The conversion streams tensor by tensor (peak RSS ~ the dense weights plus one expert),
refuses NaN/inf weights (and weights beyond the f16 range in an f16 store) naming the tensor,
and publishes atomically: everything is written to a folder unique to this conversion
(``.DST.<pid>.<random>.partial`` next to DST), fsynced, checked against its manifest (file
list and sizes, the ``files`` table), given the umask's ordinary modes, and renamed to DST
under a lock file (``.DST.lock``, removed afterwards; engine.fsutil.FileLock). When another process published DST while this one was
converting, its store is verified and used, and this one's copy is discarded.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.numpy import save_file

from .checkpoint import Checkpoint
from .errors import Cancelled, CheckpointError, StoreError
from .events import LoadProgress
from .fsutil import FileLock, fsync_dir, normalize_modes, pid_is_gone  # noqa: F401  (pid_is_gone: also here)
from .mtp import dense_tensors
from .quant import (ALIGN, EXPERT_ONLY_QUANTS, QUANTS, check_finite, int4_interleavable, interleave_q4,
                    quantize, slab_layout)
from .store_format import (CHECKSUM_OF_VERSION, EXPERT_LAYOUTS, FORMAT_NAME, FORMAT_VERSION, check_store_files,
                           looks_like_store,
                           slab_checksum)

log = logging.getLogger(__name__)
CHECKSUM = CHECKSUM_OF_VERSION[FORMAT_VERSION]  # each expert entry's checksum field (and the manifest's "checksum")

COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                "README.md", "LICENSE", "docs_index.jsonl")


ConversionCancelled = Cancelled  # the old name (one Cancelled class: engine.errors.Cancelled)


def dense_quant_for(quant: str) -> str:
    """Default quantization of the resident dense matrices (attention, embedding, lm_head):
    int8 for the int8, int4 and mxfp4 stores, else exact. ``convert --dense-quant`` overrides it."""
    return "int8" if quant in ("int8", "int4", "mxfp4") else quant


# --dense-quant int4 quantizes the attention matrices only; embedding and lm_head stay int8.
# Measured on tests/test_parity.py's int4 model (teacher-forced mean KL vs transformers):
# dense int8 8.2e-4 nats, int4 attention 1.3e-2, int4 attention + lm_head + embedding 2.1e-2
# (llama.cpp's Q4_0 files likewise keep the output matrix at higher precision). The default
# stays int8 for that quality; int4 dense is the option for speed.
from .quant import LM_HEAD_QUANT  # noqa: E402  (kept there: sizing reads it without the converter)


def check_destination(dst: Path, overwrite: bool) -> None:
    """Refuse a destination a conversion must not write: a file, a folder that is not a
    store (never deleted, even with ``overwrite``: it may hold the user's files), or an
    existing store (healthy or broken: store_format.looks_like_store) without ``overwrite``.
    A missing or empty folder is fine.

    Raises:
        FileExistsError: naming ``dst`` and what to do.
    """
    dst = Path(dst)
    if not dst.exists() and not dst.is_symlink():
        return
    if not dst.is_dir() or dst.is_symlink():
        raise FileExistsError(f"{dst}: exists and is not a folder; give a new folder path for the store")
    if looks_like_store(dst):  # healthy or broken (say, its manifest.json is gone)
        if not overwrite:
            raise FileExistsError(f"{dst}: a store already exists; pass --overwrite to replace it")
        return
    try:
        n = sum(1 for _ in dst.iterdir())
    except OSError as e:
        raise FileExistsError(f"{dst}: exists and cannot be listed ({e}); give a new folder path") from None
    if n:
        raise FileExistsError(f"{dst}: exists and is not a colibri store ({n} entries in it); nothing "
                              f"was written and nothing there is touched - give a new or empty folder "
                              f"for the store (--overwrite only replaces a store)")


def check_group_size(group_size, int4: bool) -> None:
    """Refuse a ``--group-size`` that is not an integer in 2..4096, or odd when ``int4`` is used.

    Raises: ValueError naming the setting and what to give."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 2 <= group_size <= 4096:
        raise ValueError(f"--group-size {group_size}: give an even number of columns per int4 scale "
                         f"between 2 and 4096 (32 is the default)")
    if int4 and group_size % 2:
        raise ValueError(f"--group-size {group_size}: int4 needs an even group size (32 is the default)")


def check_int4_dense(label, fam, args, tensors, group_size: int, name_of=lambda t: t.hf,
                     other_widths: tuple[int, ...] = ()) -> None:
    """Refuse ``--dense-quant int4`` when a dense matrix it would quantize (``tensors`` of kind
    "quant", the split parts of a split one, not the embedding / lm_head, which stay int8) has an
    input width (last dimension) that is not a multiple of ``group_size``; checked from the
    shapes alone, before any tensor is read. ``name_of(t)``: the tensor's name in the source
    file; ``other_widths``: widths the same group size must also divide (int4 experts').

    Raises: CheckpointError naming ``label``, the first such tensor, its shape, the group size
    and what to do (--dense-quant int8, or a --group-size that divides every width)."""
    mats = []
    for t in tensors:
        if t.kind == "keep" or t.ours in ("embed_tokens", "lm_head") and LM_HEAD_QUANT.get("int4") != "int4":
            continue
        for ours, shape in (fam.split_shapes(args, t) if t.split else [(t.ours, t.shape)]):
            mats.append((name_of(t) if not t.split else f"{name_of(t)} (as {ours.rsplit('.', 1)[-1]})", shape))
    bad = [(n, shape) for n, shape in mats if shape[-1] % group_size]
    if not bad:
        return
    g = math.gcd(*{shape[-1] for _, shape in mats}, *other_widths)
    fit = max((k for k in range(2, min(g, 4096) + 1, 2) if g % k == 0), default=0)
    n, shape = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise CheckpointError(f"{label}: --dense-quant int4 needs the input width of every dense matrix to be a "
                          f"multiple of the group size {group_size}, but {n} is {' x '.join(map(str, shape))} "
                          f"({shape[-1]} columns){more}; use --dense-quant int8"
                          + (f", or --group-size {fit}" if fit else ""))


def _put(dense: dict, name: str, w: np.ndarray, quant: str, group_size: int = 32) -> None:
    for k, v in quantize(w, quant, group_size).items():
        dense[f"{name}.{k}"] = np.ascontiguousarray(v)


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, quant: str = "int8",
                       overwrite: bool = False, group_size: int = 32,
                       progress: Callable[[LoadProgress], None] | None = None,
                       cancel: threading.Event | None = None,
                       extra_manifest: dict | None = None, dense_quant: str | None = None,
                       expert_layout: str = "auto") -> Path:
    """Convert the Hugging Face folder ``src`` (any family of engine/models) into a store at ``dst``.

    Args:
        quant: "int8" (per-row), "int4" (group-wise, ``group_size`` columns per scale, two
            values per byte), "mxfp4" (routed experts as MXFP4: an MXFP4 checkpoint's blocks
            and scales kept as they are, a float one rounded to it), "f16" or "f32" (exact).
        dense_quant: quantization of the resident dense matrices (one of QUANTS; None = the
            default of :func:`dense_quant_for`). int4 uses ``group_size`` like the experts.
        expert_layout: int4 expert weights "interleaved_4" (engine.quant.interleave_q4: what
            the decode kernels read fastest), "row_major", or "auto": interleaved where this
            CPU runs the interleaved kernels and the widths allow (:func:`expert_layout_for`).
        overwrite: replace an existing store at ``dst``.
        progress: called with LoadProgress(stage="convert", done=bytes, total=bytes, unit="B").
        cancel: set it to stop; raises Cancelled and leaves no store behind.

    Returns: the store path.

    Raises:
        ConfigError / CheckpointError: the source is invalid (raised before writing anything).
        FileExistsError: ``dst`` exists and overwrite is False.
        ValueError: an unknown ``quant`` or ``expert_layout`` (before the source is opened).
        Cancelled: ``cancel`` was set.
    """
    if quant not in QUANTS:
        raise ValueError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    if expert_layout not in EXPERT_LAYOUT_CHOICES:
        raise ValueError(f"expert layout {expert_layout!r}: choose one of {', '.join(EXPERT_LAYOUT_CHOICES)}")
    src, dst = Path(src), Path(dst)
    check_destination(dst, overwrite)
    check_docs_index(Path(src))
    ck = Checkpoint(src)
    try:
        return write_store(ck, src, dst, quant, group_size, progress, cancel, extra_manifest, overwrite,
                           dense_quant, expert_layout)
    finally:
        ck.close()


EXPERT_LAYOUT_CHOICES = ("auto",) + EXPERT_LAYOUTS


def expert_layout_for(quant: str, hidden_size: int, intermediate_size: int, group_size: int,
                      choice: str = "auto") -> str:
    """The manifest "expert_layout" a store of these widths gets: "interleaved_4" for int4
    experts whose widths allow it (engine.quant.int4_interleavable) when ``choice`` asks for it,
    or when it is "auto" and this CPU runs the interleaved kernels (K.q4_interleaved_ok; a
    store is converted where it runs); else "row_major". Either layout gives the same values.

    Raises:
        ValueError: an unknown choice, or "interleaved_4" for a store that cannot have it.
    """
    if choice not in EXPERT_LAYOUT_CHOICES:
        raise ValueError(f"expert layout {choice!r}: choose one of {', '.join(EXPERT_LAYOUT_CHOICES)}")
    fits = quant == "int4" and int4_interleavable(hidden_size, intermediate_size, group_size)
    if choice == "interleaved_4" and not fits:
        raise ValueError(f"expert layout interleaved_4 needs int4 experts with group size 32 and widths "
                         f"that are multiples of 64 (this store: {quant}, hidden {hidden_size}, expert "
                         f"width {intermediate_size}, group size {group_size}); use auto or row_major")
    if choice == "auto":
        from .models.base import K
        return "interleaved_4" if fits and K.q4_interleaved_ok(group_size) else "row_major"
    return choice


def check_docs_index(folder: Path) -> None:
    """A documentation index shipped in ``folder`` (engine.docs_lookup) must read before it is
    copied into a store.

    Raises:
        CheckpointError: naming the file, the line and what is wrong, and what to do.
    """
    from .docs_lookup import INDEX_FILE, DocsIndex
    p = folder / INDEX_FILE
    if p.exists():
        try:
            DocsIndex.open(p)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{e}. Fix the file, or delete it: the model then runs without "
                                  f"documentation lookup") from None


def write_dense(folder: Path, dense: dict, dense_quant: str) -> int:
    """``folder``/dense.safetensors from ``dense`` (name -> array), synced to the disk before
    the store is published. Returns its tensors' bytes."""
    path = folder / "dense.safetensors"
    save_file(dense, str(path), metadata={"format": FORMAT_NAME, "dense_quant": dense_quant})
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return sum(v.nbytes for v in dense.values())


def write_store(source, source_folder: Path, dst: Path, quant: str, group_size: int = 32,
                progress: Callable[[LoadProgress], None] | None = None,
                cancel: threading.Event | None = None, extra_manifest: dict | None = None,
                overwrite: bool = False, dense_quant: str | None = None, expert_layout: str = "auto") -> Path:
    """Write a store from a tensor ``source`` (a Checkpoint, or synthetic.SeededSource).

    ``source`` provides ``args``, ``family``, ``get(hf_name)`` and ``nbytes(hf_name)`` for the
    family's dense tensors, ``expert(layer, e)`` and ``expert_nbytes(layer)`` for routed
    experts (float32 arrays); optionally ``quantized_expert(layer, e, quant, group_size)``
    returning ``{proj: quantize(...)-shaped parts}`` (or None) to skip the float draw and the
    quantization. Streaming: the dense dict plus one expert are in RAM at a time.
    config.json and the tokenizer files are copied from ``source_folder``.

    ``expert_layout``: as :func:`convert_checkpoint`'s.

    Raises:
        CheckpointError: int4 with widths that are not multiples of ``group_size``.
        ValueError: an ``expert_layout`` the quantization or widths do not allow.
        ConversionCancelled: ``cancel`` was set (the partial folder is removed).
    """
    args, fam = source.args, source.family
    D, I, E, M = args.hidden_size, args.moe_intermediate_size, args.num_experts, args.num_moe_layers
    label = source_folder
    dq = dense_quant_for(quant) if dense_quant is None else dense_quant
    if dq not in QUANTS or dq in EXPERT_ONLY_QUANTS:
        raise ValueError(f"--dense-quant {dq!r}: choose one of "
                         f"{', '.join(q for q in QUANTS if q not in EXPERT_ONLY_QUANTS)}")
    check_group_size(group_size, "int4" in (quant, dq))
    if quant == "int4" and (D % group_size or I % group_size):
        # the largest even group size (at most 4096) that divides both widths, 0 if none
        fit = max((g for g in range(2, min(math.gcd(D, I), 4096) + 1, 2) if D % g == 0 and I % g == 0), default=0)
        bad = (f"gate_proj and up_proj are {I} x {D} ({D} columns)" if D % group_size else
               f"down_proj is {D} x {I} ({I} columns)")
        raise CheckpointError(f"{label}: int4 needs hidden_size ({D}) and the expert width ({I}) to be "
                              f"multiples of the group size {group_size}, but each routed expert's {bad}; "
                              f"use int8" + (f", or int4 with --group-size {fit}" if fit else ""))
    if quant == "mxfp4" and (D % 32 or I % 32):
        raise CheckpointError(f"{label}: mxfp4 needs hidden_size ({D}) and the expert width ({I}) to be "
                              f"multiples of 32; use int8")
    tensors = dense_tensors(fam, args)  # the family's and the kept MTP heads' (engine/mtp.py)
    if dq == "int4":
        check_int4_dense(label, fam, args, tensors, group_size, other_widths=(D, I) if quant == "int4" else ())
    el = expert_layout_for(quant, D, I, group_size, expert_layout)
    check_destination(dst, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    seen = _identity(dst)
    _remove_stale_temps(dst)
    partial = Path(tempfile.mkdtemp(prefix=f".{dst.name}.{os.getpid()}.", suffix=".partial", dir=dst.parent))

    layout = slab_layout(quant, D, I, group_size, bias=args.expert_bias, interleaved=el == "interleaved_4")
    total = sum(source.nbytes(h) for h in {t.hf for t in tensors})
    total += sum(source.expert_nbytes(i) * E for i in args.moe_layers)
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
            raise Cancelled(f"conversion of {label} cancelled; nothing was written to {dst}")

    def _finite(name: str, w: np.ndarray) -> np.ndarray:
        """``w``, refused when it holds NaN/inf (or, in f16, values beyond its range)."""
        check_finite(name, w, quant, str(label))
        return w

    def get(name: str, stored_as: str) -> np.ndarray:
        """``source.get(name)``, refused when it holds NaN/inf (or, in f16, beyond its range)."""
        w = source.get(name)
        file_of = getattr(source, "file_of", None)
        check_finite(name, w, stored_as, str(file_of(name)) if file_of else str(label))
        return w

    # the checkpoint's tensors config.json does not use (MTP layers, q/k norms under
    # use_qk_norm false, ...): named as notes and in the manifest, only when some exist
    skipped = list(getattr(source, "skipped_tensors", lambda: [])())
    try:
        for line in skipped:
            report(f"skipping {line}", force=True)
        (partial / "experts").mkdir()
        dense: dict[str, np.ndarray] = {}
        counted: set[str] = set()
        for t in tensors:
            check_cancel()
            w = get(t.hf, "f32" if t.kind == "keep" else dq)
            if t.split:  # one checkpoint tensor stored as several (MLA's kv_b_proj)
                for name, part in fam.split_tensor(args, t, w).items():
                    _put(dense, name, part, dq, group_size)
            elif t.kind == "keep":
                dense[t.ours] = w  # norms, routers, biases, gates stay float32: routing is sensitive
            elif t.ours in ("embed_tokens", "lm_head"):  # one embedding row read per token: int4 saves nothing
                _put(dense, t.ours, w, LM_HEAD_QUANT.get(dq, dq), group_size)
            else:
                _put(dense, t.ours, w, dq, group_size)
            if t.hf not in counted:  # a tied lm_head is the embedding, read twice, counted once
                counted.add(t.hf)
                done += source.nbytes(t.hf)
            report(t.hf)
        experts_meta = []
        for j, i in enumerate(args.moe_layers):
            # Experts: one slab each, appended to this MoE layer's file at 4096-aligned offsets.
            rel = f"experts/layer_{j:03d}.bin"
            en = fam.expert_names(args, i)  # checkpoint names, for error messages
            metas = []
            slab = np.zeros(layout["slot_bytes"], dtype=np.uint8)
            with open(partial / rel, "wb") as f:
                for e in range(E):
                    check_cancel()
                    slab[:] = 0
                    # A source may hand over quantized parts directly (synthetic "codes" draw).
                    drawn = getattr(source, "quantized_expert", None)
                    drawn = drawn(i, e, quant, group_size) if drawn is not None else None
                    for proj, parts in (drawn.items() if drawn is not None else
                                        _expert_parts(source.expert(i, e), en, e, quant, group_size, _finite)):
                        for k, arr in parts.items():
                            _, off, _, shape = next(x for x in layout["fields"] if x[0] == f"{proj}.{k}")
                            if len(shape) == 3:  # int4 weights in the interleaved layout
                                arr = interleave_q4(np.asarray(arr))
                            b = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
                            slab[off:off + b.size] = b
                    done += source.expert_nbytes(i)
                    offset = f.tell()
                    f.write(slab.tobytes())
                    metas.append({"file": rel, "offset": offset, "length": layout["slot_bytes"],
                                  CHECKSUM: slab_checksum(CHECKSUM, slab)})
                    report(f"model.layers.{i} expert {e}")
                f.flush()
                os.fsync(f.fileno())
            experts_meta.append(metas)
        check_cancel()
        report("dense weights", force=True)
        dense_bytes = write_dense(partial, dense, dq)
        del dense
        for name in COPIED_FILES:
            if (source_folder / name).exists():
                try:
                    shutil.copyfile(source_folder / name, partial / name)
                except OSError as e:
                    raise CheckpointError(f"{source_folder / name}: cannot be copied into the store ({e})") from None
        manifest = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model_type": args.model_type,
            "model_name": source_folder.name,
            "source": str(source_folder.resolve()),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "quant": quant,
            "dense_quant": dq,
            "group_size": group_size if "int4" in (quant, dq) else None,
            "expert_layout": el,
            "alignment": ALIGN,
            "checksum": CHECKSUM,
            "dense_file": "dense.safetensors",
            "dense_bytes": dense_bytes,
            "slab_layout": {"fields": [list(x) for x in layout["fields"]],
                            "data_bytes": layout["data_bytes"], "slot_bytes": layout["slot_bytes"]},
            "slot_bytes": [layout["slot_bytes"]] * M,
            "num_layers": M,
            "num_hidden_layers": args.num_hidden_layers,
            "moe_layers": list(args.moe_layers),
            **({"mtp_layers": args.mtp_layers} if args.mtp_layers else {}),
            "num_experts": E,
            "experts": experts_meta,
            "files": {},
            **({"skipped": skipped} if skipped else {}),
            **(extra_manifest or {}),
        }
        manifest["files"] = {rel: (partial / rel).stat().st_size
                             for rel in [manifest["dense_file"]] + [f"experts/layer_{j:03d}.bin" for j in range(M)]}
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


def _expert_parts(expert: dict, en, e: int, quant: str, group_size: int, finite):
    """(proj, {field: array}) of one float32 expert {proj: [O, N], "proj.b": [O] (gpt-oss biases)}:
    matrices quantized to ``quant``, biases kept float32 as field "b"."""
    for key, w in expert.items():
        proj, _, sub = key.partition(".")
        w = finite(en.name(e, proj), w)
        yield proj, ({sub: np.asarray(w, dtype=np.float32)} if sub else quantize(w, quant, group_size))


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
    """Delete what a conversion to ``dst`` whose process is gone (a crash or kill) left: its
    temp folder ``.DST.<pid>.<random>.partial`` and the old store it was replacing,
    ``.DST.old-<pid>``. (A stale ``.DST.lock`` needs nothing: fsutil.FileLock.)"""
    for p in dst.parent.glob(f".{dst.name}.*.partial"):
        try:
            pid = int(p.name[len(dst.name) + 2:].split(".", 1)[0])
        except ValueError:
            continue
        if pid_is_gone(pid):
            shutil.rmtree(p, ignore_errors=True)
    for p in dst.parent.glob(f".{dst.name}.old-*"):
        try:
            pid = int(p.name.rsplit("-", 1)[1])
        except (ValueError, IndexError):
            continue
        if pid_is_gone(pid):
            shutil.rmtree(p, ignore_errors=True)


def _publish_lock(dst: Path) -> FileLock:
    """The lock held while a conversion publishes ``dst``: ``.DST.lock`` next to it, removed on
    release (success or failure); a stale one from a killed process never blocks (fsutil.FileLock)."""
    return FileLock(dst.with_name(f".{dst.name}.lock"))


def _publish(partial: Path, dst: Path, seen, manifest: dict, overwrite: bool) -> None:
    """Rename the finished ``partial`` to ``dst`` (lock held). If a different folder appeared
    at ``dst`` since the conversion started (``seen``), another process published first:
    keep theirs when it verifies and holds the same conversion; otherwise replace it only
    with ``overwrite`` (else FileExistsError)."""
    with _publish_lock(dst):
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
        if now is not None:
            check_destination(dst, True)  # never replace a folder that is not a store
        if now is None:
            os.rename(partial, dst)  # fails on an existing non-empty folder, never merges
        else:
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.rename(dst, old)
            os.rename(partial, dst)
            shutil.rmtree(old, ignore_errors=True)
        fsync_dir(dst.parent)
