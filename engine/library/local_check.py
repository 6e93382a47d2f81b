"""The check of a model on this computer before its import: a Hugging Face checkpoint folder
(check.py's checks, without a download) or a GGUF model (gguf_check.py). One entry for both, so
neither of those modules imports the other's caller.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import ModelArgs
from .check import DEFAULT_CONTEXT, RepoCheck, RepoFile, _finish_check, _is_needed, check_tokenizer


def check_local(folder: str | os.PathLike, quant: str = "int8",
                context_length: int = DEFAULT_CONTEXT) -> RepoCheck:
    """Check a local Hugging Face checkpoint folder (as check_repo, without a download), or a
    GGUF model (gguf_check.check_gguf: a .gguf file, a split's part, a folder of them).

    Raises:
        ConfigError: unsupported model_type / invalid config.json.
        CheckpointError: missing or truncated weight files, Git LFS pointers, wrong shapes.
        TokenizerError: no usable tokenizer.json, or a chat template that cannot render
            (check_tokenizer).
    """
    folder = Path(folder).expanduser()
    from ..gguf_import import is_gguf_path
    if is_gguf_path(folder):  # a .gguf file, a split's part or a folder of GGUFs: imported as published
        from .gguf_check import check_gguf
        return check_gguf(folder, context_length)
    args = ModelArgs.from_hf_config(folder)  # refuses unsupported model types with the list
    from ..checkpoint import Checkpoint  # here: listing or sizing models never loads ml_dtypes
    with Checkpoint(folder):  # pointers, truncated headers, missing tensors, shapes
        pass
    tok = check_tokenizer(folder)
    files, ignored = [], []
    for p in sorted(folder.iterdir()):
        if p.is_file() and _is_needed(p.name):
            files.append(RepoFile(p.name, p.stat().st_size, present_bytes=p.stat().st_size))
        elif p.is_file():
            ignored.append(p.name)
    copied = sum(f.size for f in files if not f.name.endswith(".safetensors"))
    return _finish_check(source="local", repo_id=str(folder), revision="", commit="", model_name=folder.name,
                         args=args, files=files, ignored=ignored, dl_dir=folder, quant=quant,
                         context_length=context_length, copied_bytes=copied, tokenizer=tok)
