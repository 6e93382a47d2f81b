"""The model library: check a model (hub repository or local folder) before any weights move,
download it (resumable, verified), convert it into a store, self-test it, list and delete
converted stores, the bundled default model, and the user folders. No Qt here.

Floor: above the inference core (``engine``), below the benchmarks and the CLI. The app uses
these names only (docs/engine-api.md); the modules are split by concern:

    paths          user folders (platformdirs), store names, free disk space
    check          what a download / conversion will take: files, disk, RAM verdict, tokenizer
    gguf_check     the same for a GGUF model (file, split part or folder of them)
    hub_gguf       the same for a -GGUF hub repository (its models by quant, headers only)
    hub_check      check_repo: a hub repository, Hugging Face checkpoint or GGUF models
    local_check    check_local: a model on this computer, Hugging Face folder or GGUF
    download       resumable verified downloads from the hub
    models         convert a download, self-test, list / delete converted stores
    default_model  the small bundled model, converted on first use
    errors         HubError, DiskSpaceError, VerificationError
    catalog        MoE models people run, sized for this computer ("Recommended" in the wizard)
    disk           a short read-speed test of the disk under a folder (doctor, the wizard)
The RAM numbers come from engine.sizing (the rule Engine.open applies); they are re-exported
here for the wizard.
"""

import sys
import types

# name -> the module that defines it, imported at the first use of a name (PEP 562): listing the
# folders or the models must not pull in the converter, numpy or the kernels
_WHERE = {
    "Cancelled": "engine.errors",
    "atomic_write_text": "engine.fsutil",
    "BudgetPlan": "engine.sizing", "Estimate": "engine.sizing", "estimate": "engine.sizing", "machine_ram": "engine.sizing", "plan_for_store": "engine.sizing", "ram_verdict": "engine.sizing",
    "format_bytes": "engine.units", "format_duration": "engine.units",
    "DISK_MARGIN_BYTES": "engine.library.check", "HUB_HOSTS": "engine.library.check", "NEEDED_PATTERNS": "engine.library.check", "PARTIAL_DIR": "engine.library.check", "WIZARD_QUANTS": "engine.library.check", "RepoCheck": "engine.library.check", "RepoFile": "engine.library.check", "TokenizerCheck": "engine.library.check", "check_local": "engine.library.local_check", "check_repo": "engine.library.hub_check", "check_tokenizer": "engine.library.check", "parse_repo_id": "engine.library.check",
    "DEFAULT_MODEL": "engine.library.default_model", "default_model_dir": "engine.library.default_model", "default_store": "engine.library.default_model",
    "check_weight_file": "engine.library.download", "delete_download": "engine.library.download", "download": "engine.library.download",
    "DiskSpaceError": "engine.library.errors", "DownloadCancelled": "engine.library.errors", "FolderError": "engine.library.errors", "HubError": "engine.library.errors", "VerificationError": "engine.library.errors",
    "store_problem": "engine.expert_store",
    "ModelEntry": "engine.library.models", "convert_downloaded": "engine.library.models", "delete_model": "engine.library.models", "list_models": "engine.library.models", "looks_like_store": "engine.library.models", "repair_advice": "engine.library.models", "self_test": "engine.library.models", "self_test_says_broken": "engine.library.models",
    "CATALOG": "engine.library.catalog", "CatalogModel": "engine.library.catalog",
    "Recommendation": "engine.library.catalog", "recommend": "engine.library.catalog",
    "DiskSpeed": "engine.library.disk", "disk_read_speed": "engine.library.disk",
    "FoundGGUF": "engine.library.gguf_found", "find_gguf_models": "engine.library.gguf_found",
    "check_gguf": "engine.library.gguf_check", "is_gguf_path": "engine.gguf_import",
    "blocking_file": "engine.library.paths", "download_dir_for": "engine.library.paths", "downloads_dir": "engine.library.paths", "folder_problem": "engine.library.paths", "free_space": "engine.library.paths", "models_dir": "engine.library.paths", "resources_dir": "engine.library.paths", "store_name": "engine.library.paths", "user_config_dir": "engine.library.paths", "user_data_dir": "engine.library.paths",
}


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module
    value = getattr(import_module(mod), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))


class _Library(types.ModuleType):
    """The import system binds a submodule to its name on the package when it is imported;
    ``download`` names the function here (as it did when this file imported it), not its module."""

    def __setattr__(self, name, value):
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Library


__all__ = [
    "Cancelled", "atomic_write_text", "BudgetPlan", "Estimate", "estimate", "machine_ram", "plan_for_store",
    "ram_verdict", "format_bytes", "format_duration", "DISK_MARGIN_BYTES", "NEEDED_PATTERNS", "PARTIAL_DIR",
    "WIZARD_QUANTS", "HUB_HOSTS", "RepoCheck", "RepoFile", "TokenizerCheck", "check_local", "check_repo", "check_tokenizer",
    "parse_repo_id", "DEFAULT_MODEL",
    "default_model_dir", "default_store", "check_weight_file", "delete_download", "download",
    "DiskSpaceError", "DownloadCancelled", "FolderError", "blocking_file", "folder_problem", "HubError", "VerificationError", "ModelEntry",
    "convert_downloaded", "delete_model", "list_models", "looks_like_store", "repair_advice", "self_test",
    "self_test_says_broken",
    "store_problem", "download_dir_for", "downloads_dir",
    "free_space", "models_dir", "resources_dir", "store_name", "user_config_dir", "user_data_dir",
    "FoundGGUF", "find_gguf_models", "check_gguf", "is_gguf_path",
    "CATALOG", "CatalogModel", "Recommendation", "recommend", "DiskSpeed", "disk_read_speed",
]
