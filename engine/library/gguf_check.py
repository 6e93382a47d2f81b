"""The model library's check of a GGUF model on this computer (a file, a split's part, or a folder
holding one), as check_local is for a Hugging Face folder: family, sizes, RAM verdict and the
tokenizer, before anything is written. The import itself is engine.gguf_import.convert_gguf."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Callable

from ..errors import TokenizerError
from ..events import LoadProgress
from ..gguf_import import GGUFModel, GGUFSource, convert_gguf, gguf_estimate
from ..gguf_tokenizer import tokenizer_files
from ..sizing import machine_ram, ram_verdict
from ..store_format import looks_like_store
from .check import DEFAULT_CONTEXT, DISK_MARGIN_BYTES, RepoCheck, RepoFile, TokenizerCheck, _decide_disk, check_tokenizer
from .errors import DiskSpaceError
from .paths import free_space, models_dir, store_name

GGUF_QUANT = "gguf"  # the library's quantization label of an imported GGUF (its blocks as published)


def check_gguf(path: str | os.PathLike, context_length: int = DEFAULT_CONTEXT, name: str | None = None) -> RepoCheck:
    """Check the GGUF model at ``path`` for import (reads the header and metadata only);
    ``name``: the model's name (default the file's, see GGUFModel.name), e.g. Ollama's ``name:tag``.

    Returns: a RepoCheck with source "local", quant "gguf" and one estimate; ``download_dir``
    is the path to import from.
    Raises:
        CheckpointError / ConfigError: not a GGUF, truncated, unsupported architecture or
            block type, a missing key (one line naming it).
        TokenizerError: a chat template that cannot render (check_tokenizer).
    """
    path = Path(path).expanduser()
    with GGUFModel(path) as g:
        source = GGUFSource(g)
        tok_files = tokenizer_files(g)
        files = [RepoFile(f.name, f.stat().st_size, present_bytes=f.stat().st_size) for f in g.files]
        name = name or g.name
        if tok_files:
            with tempfile.TemporaryDirectory() as td:
                for n, text in tok_files.items():
                    Path(td, n).write_text(text, encoding="utf-8")
                try:
                    tok = check_tokenizer(td)
                except TokenizerError as e:
                    raise TokenizerError(f"{g.files[0]}: its vocabulary or tokenizer.chat_template does not load "
                                         f"or render ({str(e).replace(td, 'tokenizer')})") from None
        else:
            tok = TokenizerCheck(False, "the file has no vocabulary: the model runs on token ids only")
        extra = sum(len(t.encode("utf-8")) for t in tok_files.values())
        est = gguf_estimate(source, context_length, extra_store_bytes=extra)
        args = source.args
    store_dir = models_dir() / store_name(name, GGUF_QUANT)
    dl_free, st_free, same, disk_ok, disk_msg = _decide_disk(path.parent, 0, store_dir, est.store_bytes, "local")
    ram_total, ram_avail = machine_ram()
    verdict, ram_msg = ram_verdict(est, args.num_experts_per_tok, ram_total, ram_avail)
    total = sum(f.size for f in files)
    return RepoCheck(
        source="local", repo_id=str(path), revision="", commit="", model_name=name, args=args, files=tuple(files),
        ignored_files=(), download_dir=str(path), download_bytes=total, download_missing=0, download_free=dl_free,
        quant=GGUF_QUANT, store_dir=str(store_dir), store_exists=looks_like_store(store_dir),
        store_bytes=est.store_bytes, store_free=st_free, same_disk=same, disk_ok=disk_ok, disk_message=disk_msg,
        estimate=est, ram_total=ram_total, ram_available=ram_avail, ram_verdict=verdict, ram_message=ram_msg,
        estimates=(est,), has_chat_template=tok.has_chat_template, tokenizer_message=tok.message)


def import_gguf(src: str | os.PathLike, progress: Callable[[LoadProgress], None] | None = None,
                cancel: threading.Event | None = None, *, overwrite: bool = False, name: str | None = None,
                extra_manifest: dict | None = None) -> Path:
    """Import the GGUF model at ``src`` into ``models_dir()/<name>-gguf`` (convert_downloaded's
    counterpart; the file is only read, never moved or changed).

    Raises:
        DiskSpaceError: the store does not fit (numbers given), before writing.
        FileExistsError: the store exists and overwrite is False.
        CheckpointError / ConfigError / TokenizerError: as check_gguf; Cancelled: ``cancel`` set.
    """
    from ..units import format_bytes
    chk = check_gguf(src, 0)
    dst = models_dir() / store_name(name or chk.model_name, GGUF_QUANT)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst}: a store already exists; delete it in the model library or choose "
                              f"to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    free = free_space(dst.parent)
    if chk.store_bytes + DISK_MARGIN_BYTES > free:
        raise DiskSpaceError(f"Not enough disk space for the store at {dst.parent}: {format_bytes(chk.store_bytes)} "
                             f"needed, {format_bytes(free)} free. Free some space first.")
    return convert_gguf(src, dst, overwrite=overwrite, progress=progress, cancel=cancel, extra_manifest=extra_manifest)
