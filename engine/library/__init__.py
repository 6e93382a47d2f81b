"""The model library: check a model (hub repository or local folder) before any weights move,
download it (resumable, verified), convert it into a store, self-test it, list and delete
converted stores, the bundled default model, and the user folders. No Qt here.

Floor: above the inference core (``engine``), below the benchmarks and the CLI. The app uses
these names only (docs/engine-api.md); the modules are split by concern:

    paths          user folders (platformdirs), store names, free disk space
    check          what a download / conversion will take: files, disk, RAM verdict, tokenizer
    download       resumable verified downloads from the hub
    models         convert a download, self-test, list / delete converted stores
    default_model  the small bundled model, converted on first use
    errors         HubError, DiskSpaceError, VerificationError
The RAM numbers come from engine.sizing (the rule Engine.open applies); they are re-exported
here for the wizard.
"""

from ..errors import Cancelled
from ..fsutil import atomic_write_text
from ..sizing import BudgetPlan, Estimate, estimate, machine_ram, plan_for_store, ram_verdict
from ..units import format_bytes, format_duration
from .check import (DISK_MARGIN_BYTES, HUB_HOSTS, NEEDED_PATTERNS, PARTIAL_DIR, WIZARD_QUANTS, RepoCheck,
                    RepoFile, TokenizerCheck, check_local, check_repo, check_tokenizer, parse_repo_id)
from .default_model import DEFAULT_MODEL, default_model_dir, default_store
from .download import check_weight_file, delete_download, download
from .errors import DiskSpaceError, DownloadCancelled, FolderError, HubError, VerificationError
from ..expert_store import store_problem
from .models import (ModelEntry, convert_downloaded, delete_model, list_models, looks_like_store, repair_advice,
                     self_test, self_test_says_broken)
from .paths import (blocking_file, download_dir_for, downloads_dir, folder_problem, free_space, models_dir,
                    resources_dir, store_name, user_config_dir, user_data_dir)

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
]
