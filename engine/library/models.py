"""The local model library: convert a downloaded checkpoint into a store, self-test it, list
and delete converted stores (only inside ``models_dir()``)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import ModelArgs, family_name
from ..events import LoadProgress
from ..sizing import estimate
from ..store_format import looks_like_store
from ..units import format_bytes
from .check import DISK_MARGIN_BYTES, PARTIAL_DIR, check_tokenizer
from ..errors import StoreError, StoreUnreadable
from .errors import DiskSpaceError
from .paths import free_space, models_dir, store_name


def _source_info(src: Path) -> dict:
    try:
        d = json.loads((src / PARTIAL_DIR / "source.json").read_text(encoding="utf-8"))
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def convert_downloaded(src: str | os.PathLike, quant: str = "int8",
                       progress: Callable[[LoadProgress], None] | None = None,
                       cancel: threading.Event | None = None, *, overwrite: bool = False,
                       name: str | None = None) -> Path:
    """Convert a downloaded (or local) checkpoint into ``models_dir()/<name>-<quant>`` (quant
    "gguf": import the GGUF model at ``src``, gguf_check.import_gguf).

    Atomic (engine.convert_checkpoint writes a unique ``.DST.*.partial`` and renames): a cancel or an
    error leaves no store. The manifest records model_name and source (``hf://repo@commit``
    for hub downloads).

    Args:
        name: model name (default: the repo name, else the folder name).
        overwrite: replace an existing store of the same name and quant.
    Returns: the store path.
    Raises:
        DiskSpaceError: the store does not fit (numbers given), before writing.
        FileExistsError: the store exists and overwrite is False.
        ConfigError / CheckpointError: invalid source; Cancelled: ``cancel`` set.
        TokenizerError: no usable tokenizer.json or a broken chat template (check_tokenizer),
            before anything is written.
    """
    from ..convert import convert_checkpoint
    if quant == "gguf":  # a GGUF model: its expert blocks imported as published
        from .gguf_check import import_gguf
        # a hub download's file is deleted once imported: the manifest names its repository (and the
        # file, for `colibri download REPO --gguf FILE`), not the download's path
        extra = {}
        for root in Path(src).parents:
            info = _source_info(root)
            if info.get("repo_id"):
                extra = {"source": f"hf://{info['repo_id']}@{info.get('commit', '')}", "hub_repo": info["repo_id"],
                         "hub_revision": info.get("revision"), "hub_commit": info.get("commit"),
                         "hub_gguf_file": Path(src).relative_to(root).as_posix()}
                break
        return import_gguf(src, progress, cancel, overwrite=overwrite, name=name, extra_manifest=extra)
    src = Path(src)
    info = _source_info(src)
    model_name = name or (info["repo_id"].split("/")[-1] if info.get("repo_id") else src.name)
    dst = models_dir() / store_name(model_name, quant)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst}: a store already exists; delete it in the model library or choose "
                              f"to replace it")
    args = ModelArgs.from_hf_config(src)
    check_tokenizer(src)  # a model without a usable tokenizer is refused before any conversion
    copied = sum(p.stat().st_size for p in src.iterdir() if p.is_file() and not p.name.endswith(".safetensors"))
    need = estimate(args, quant, 0, copied).store_bytes
    free = free_space(dst.parent)
    if need + DISK_MARGIN_BYTES > free:
        raise DiskSpaceError(f"Not enough disk space for the {quant} store at {dst.parent}: "
                             f"{format_bytes(need)} needed, {format_bytes(free)} free. Free some space or "
                             f"choose a smaller quantization.")
    extra = {"model_name": model_name}
    if info.get("repo_id"):
        extra.update(source=f"hf://{info['repo_id']}@{info.get('commit', '')}", hub_repo=info["repo_id"],
                     hub_revision=info.get("revision"), hub_commit=info.get("commit"))
    return convert_checkpoint(src, dst, quant=quant, overwrite=overwrite, progress=progress, cancel=cancel,
                              extra_manifest=extra)


def self_test(store: str | os.PathLike, max_new_tokens: int = 8) -> str:
    """Open ``store`` with a small context and generate ``max_new_tokens`` greedy tokens.

    Returns: the generated text (may be empty or odd for tiny models; it proves the store runs).
    Raises:
        EngineError (StoreError, BudgetError, StoreUnreadable, ...): the store cannot be opened;
        StoreUnreadable: generation ended because reading the store failed (a disk or
            permission error: not known to be broken);
        StoreError: generation ended with another error (message included).
    """
    from ..config import EngineConfig
    from ..events import ChatMessage, Finished, FinishReason, GenerateRequest, SamplingParams
    from ..generate import Engine
    cfg = EngineConfig(store=str(store), context_length=256, pinning=False, history=False, pilot=0)
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    with Engine.open(cfg) as eng:
        if eng.has_chat_template:
            req = GenerateRequest(messages=(ChatMessage("user", "Hello! Who are you?"),), sampling=sp)
        else:
            req = GenerateRequest(prompt="Hello, my name is", sampling=sp)
        fin = None
        for ev in eng.generate(req, threading.Event()):
            if isinstance(ev, Finished):
                fin = ev
        read_errors = eng.cache.stats.read_errors
    # a read that failed, whichever read it was (an expert's counted by the cache, or a token's
    # embedding row, which may come first): not known to be broken
    if fin is not None and fin.finish_reason == FinishReason.ERROR and (read_errors or fin.error_kind == "io"):
        raise StoreUnreadable(f"{store}: the self-test could not read the store ({fin.error}); check the disk, "
                              f"then try again")
    if fin is None or fin.finish_reason == FinishReason.ERROR:
        raise StoreError(f"{store}: self-test generation failed ({fin.error if fin else 'no result'}); the store "
                         f"may be corrupt - delete it and convert again")
    return fin.text


def self_test_says_broken(kind) -> bool:
    """Whether a :func:`self_test` failure of ErrorKind ``kind`` says the store itself is
    broken (a store converted just now is then removed). A RAM shortfall, a cancel, a disk,
    read or permission error (StoreUnreadable, ExpertReadError), or a bug say nothing about
    the store: it is kept."""
    from ..errors import ErrorKind
    return ErrorKind(kind) not in (ErrorKind.BUDGET, ErrorKind.CANCELLED, ErrorKind.DISK, ErrorKind.IO,
                                   ErrorKind.INTERNAL, ErrorKind.CONTEXT)


@dataclass(frozen=True)
class ModelEntry:
    """A converted store in models_dir(): size_bytes on disk, created (ISO time, UTC),
    family: the manifest's model_type ("olmoe" for stores written before families).

    problem: "" for a healthy store, else why it cannot be used (one sentence naming the
    broken file: engine.expert_store.store_problem); advice: what to do about it (re-convert
    with the command that made it, or delete it)."""

    name: str
    source: str
    quantization: str
    size_bytes: int
    created: str
    path: str
    family: str = "olmoe"
    problem: str = ""
    advice: str = ""

    @property
    def ok(self) -> bool:
        """True when the store passed the checks (it can be opened)."""
        return not self.problem

    @property
    def family_label(self) -> str:
        """The family's display name, e.g. "Qwen3-MoE"."""
        return family_name(self.family) if self.family else "?"


def _dir_size(p: Path) -> int:
    n = 0
    for root, _dirs, files in os.walk(p):
        for fn in files:
            try:
                n += os.lstat(os.path.join(root, fn)).st_size
            except OSError:
                pass
    return n


def repair_advice(path: Path, manifest: dict | None) -> str:
    """What to do about a broken store: re-convert it (the command that made it, when the
    manifest says: store_format.reconvert_command) or delete it."""
    from ..store_format import reconvert_command
    return (f"Re-convert it with {reconvert_command(path, manifest)} (or Add model… in the app), or "
            f"delete it (Models › Delete… in the app, or remove the folder {path}).")


def _entry(p: Path) -> ModelEntry | None:
    """The library entry of the folder ``p`` (None when it holds no part of a store)."""
    from ..expert_store import store_problem
    if not looks_like_store(p):
        return None
    try:
        m = json.loads((p / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        m = None
    if not isinstance(m, dict):
        m = None
    d = m or {}
    problem = store_problem(p) or ""
    return ModelEntry(name=str(d.get("model_name") or p.name), source=str(d.get("source") or ""),
                      quantization=str(d.get("quant") or "?"), size_bytes=_dir_size(p),
                      created=str(d.get("created") or ""), path=str(p),
                      family=str(d.get("model_type") or ("olmoe" if m else "")),
                      problem=problem, advice=repair_advice(p, m) if problem else "")


def list_models() -> list[ModelEntry]:
    """Converted stores in ``models_dir()``, newest first: every folder holding a part of a
    store (manifest.json, dense.safetensors or experts/). Each is checked with the engine's one
    store validation (engine.expert_store.store_problem: manifest, config.json, every file's
    size, the dense header); a broken one is listed with ``problem`` and ``advice`` set,
    never skipped and never raised.

    Skipped: hidden folders (unfinished ``.NAME.*.partial`` conversions, ``.old-`` leftovers),
    files, folders with no part of a store. A ``NAME.deleting-PID`` folder whose process is
    gone (a delete killed mid-way) is removed.
    Raises:
        OSError: the models folder cannot be created or listed (the message names it).
    """
    from ..fsutil import pid_is_gone
    out = []
    for p in sorted(models_dir().iterdir()):
        if ".deleting-" in p.name:  # a delete_model that was killed mid-way: finish it
            pid = p.name.rsplit("-", 1)[1]
            if pid.isdigit() and pid_is_gone(int(pid)):
                shutil.rmtree(p, ignore_errors=True)
            continue
        if p.name.startswith(".") or p.name.endswith(".partial") or ".old-" in p.name:
            continue
        e = _entry(p)
        if e is not None:
            out.append(e)
    out.sort(key=lambda e: e.created, reverse=True)
    return out


def delete_model(path: str | os.PathLike) -> None:
    """Delete a converted store, healthy or broken; only folders inside ``models_dir()``
    holding a part of a store (:func:`looks_like_store`).

    Raises:
        ValueError: ``path`` is outside models_dir(), is models_dir() itself, or not a store.
    """
    root = models_dir().resolve()
    p = Path(path).resolve()
    if p == root or root not in p.parents:
        raise ValueError(f"{p}: not inside the models folder {root}; refusing to delete it")
    if not looks_like_store(p):
        raise ValueError(f"{p}: not a converted store (no manifest.json, dense.safetensors or experts/); "
                         f"refusing to delete it")
    trash = p.with_name(p.name + f".deleting-{os.getpid()}")
    os.replace(p, trash)  # disappears from the library at once, even if removal is slow
    shutil.rmtree(trash, ignore_errors=True)
