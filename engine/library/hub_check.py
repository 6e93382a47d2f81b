"""The check of a hub repository before its download: a Hugging Face checkpoint (check.py) or a
repository of GGUF models (hub_gguf.py). One entry for both, as local_check is for a model on this
computer, so neither of those modules imports the other's caller."""

from __future__ import annotations

import os

from ..errors import ConfigError
from ..quant import QUANTS
from .check import DEFAULT_CONTEXT, RepoCheck, _repo_listing, check_hf_repo, parse_repo_id
from .hub_gguf import check_hub_gguf, gguf_models, is_gguf_repo
from .paths import download_dir_for


def check_repo(repo_id: str, revision: str | None = None, quant: str = "int8",
               context_length: int = DEFAULT_CONTEXT, dest_root: str | os.PathLike | None = None,
               gguf: str | None = None) -> RepoCheck:
    """Check a hub model before downloading any weights: check.check_hf_repo for a Hugging Face
    checkpoint; for a repository of GGUF models (.gguf files and no config.json: the ``-GGUF``
    repositories, or any repository when ``gguf`` is given) hub_gguf.check_hub_gguf of the model
    ``gguf`` names (a quant such as Q4_K_M, or a file; default Q4_K_M when it has one), from its
    header alone (``quant`` does not apply: the RepoCheck's quant is "gguf").

    Args:
        dest_root: download root (default: ``user_data_dir()/downloads``).
    Returns: a RepoCheck; ``check.ok`` False means refused (disk or RAM), with messages.
    Raises:
        ConfigError: unsupported model_type / architecture, an invalid config.json, a GGUF
            quant the repository does not hold (naming those it does), ``gguf`` given for a
            repository without GGUF files - before any weights move.
        CheckpointError: a GGUF file that is not one or whose header is damaged.
        HubError: repo / revision not found, gated, no weights, network down.
        TokenizerError: no usable tokenizer, or a chat template that cannot render.
        ValueError: unknown quant or malformed repo id (a hub address is accepted, see
            parse_repo_id; its revision is used when ``revision`` is not given).
    """
    if quant not in QUANTS:
        raise ValueError(f"quantization {quant!r}: choose one of {', '.join(QUANTS)}")
    repo_id, url_revision = parse_repo_id(repo_id)
    revision = (revision or "").strip() or url_revision
    commit, listing = _repo_listing(repo_id, revision)
    if gguf and not gguf_models(listing):
        raise ConfigError(f"{repo_id}: holds no GGUF model file, so there is none of {gguf!r} to choose; leave the "
                          f"GGUF choice out to download its Hugging Face checkpoint. Nothing was downloaded.")
    if is_gguf_repo(listing) or gguf:
        return check_hub_gguf(repo_id, revision, commit, listing, gguf, context_length,
                              download_dir_for(repo_id, dest_root))
    return check_hf_repo(repo_id, revision, quant, context_length, dest_root, listing=(commit, listing))
