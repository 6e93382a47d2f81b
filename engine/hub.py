"""Models from the Hugging Face hub: check, download (resumable, verified), convert, list.

Shared by the ``colibri download`` / ``colibri models`` commands and the GUI model wizard
(no Qt here). Sizes are bytes, times seconds.

Download design (huggingface_hub 2.4): ``hf_hub_download`` writes every file to a
process-unique ``*.incomplete`` temporary file and deletes it when the download fails or is
interrupted (huggingface_hub PR #4228), so it only resumes *within* one call (its automatic
retries); a cancel, a crash or a lost connection that outlasts the retries loses the bytes.
Model weights are many GB, so the weight files are fetched here with the hub's own HTTP
session and ``Range`` requests into ``DEST/.colibri-download/<file>.<id>.part``, which
survives anything and is resumed from its size on the next call. Each file is checked
against the hub's size and sha256 (LFS files) or git blob id (small files) before it is
moved into place. ``config.json`` for the check is fetched with ``hf_hub_download``.

The endpoint is ``HF_ENDPOINT`` (read at call time), else huggingface.co; the token is the
usual huggingface_hub one (``HF_TOKEN`` or ``hf auth login``) for gated repos.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import paths
from .checkpoint import Checkpoint, is_lfs_pointer
from .config import SUPPORTED_MODEL_TYPES, ModelArgs
from .errors import CheckpointError, ConfigError, EngineError
from .events import LoadProgress
from .quant import QUANTS, slab_layout
from .ram_budget import AVAILABLE_SHARE, RESERVE_BYTES

# Files a conversion needs (root of the repo only). Everything else (pytorch_model*.bin,
# onnx/, original/, *.gguf, images ...) is never downloaded.
NEEDED_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "config.json",
                   "generation_config.json", "tokenizer*.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "vocab.txt", "merges.txt")
WIZARD_QUANTS = ("int8", "int4", "f16")  # f32 is for tests only
DEFAULT_CONTEXT = 4096  # the engine's context when the setting is 0 (capped by the model's)
DISK_MARGIN_BYTES = 64_000_000  # slack kept free on a target disk (manifest, fs overhead)
PARTIAL_DIR = ".colibri-download"
_CHUNK = 1 << 20


# --- errors -----------------------------------------------------------------------------


class HubError(EngineError):
    """The hub could not be reached, the repo / revision / file does not exist or is gated,
    or a download failed. The message says what to do."""

    kind = "io"


class DiskSpaceError(HubError):
    """A target disk has not enough free space; the message gives needed and free bytes."""

    kind = "disk"


class VerificationError(HubError):
    """A downloaded file does not match the hub's size / sha256; the bad file was removed."""

    kind = "io"


class DownloadCancelled(HubError):
    """The user cancelled a download; the bytes fetched so far are kept for resuming."""

    kind = "cancelled"


# --- formatting ---------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """``n`` bytes as a short decimal string ("1.23 GB")."""
    n = float(n)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def format_duration(s: float) -> str:
    """``s`` seconds as "1 h 02 min", "3 min 05 s" or "12 s"."""
    if s != s or s == float("inf"):
        return "unknown"
    s = int(round(max(s, 0)))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"


# --- size and RAM estimates ---------------------------------------------------------------


def _qbytes(rows: int, cols: int, quant: str) -> int:
    """Bytes of one [rows, cols] matrix stored by convert._put at ``quant`` (dense quant)."""
    if quant == "int8":
        return rows * cols + rows * 4
    if quant == "f16":
        return rows * cols * 2
    return rows * cols * 4


def dense_bytes_estimate(args: ModelArgs, quant: str) -> int:
    """Resident dense bytes of a store converted at ``quant`` (mirrors convert.py exactly:
    attention and embeddings at the dense quant, norms and routers float32)."""
    dq = "int8" if quant in ("int8", "int4") else quant
    D, E, V = args.hidden_size, args.num_experts, args.vocab_size
    q, kv = args.q_dim, args.kv_dim
    per_layer = (2 * D + q + kv + E * D) * 4  # two norms, q_norm, k_norm, router (float32)
    per_layer += _qbytes(q, D, dq) + 2 * _qbytes(kv, D, dq) + _qbytes(D, q, dq)
    return args.num_hidden_layers * per_layer + 2 * _qbytes(V, D, dq) + D * 4


def kv_bytes_estimate(args: ModelArgs, context_length: int) -> int:
    """KV cache bytes at ``context_length`` tokens (float32 K and V), as Engine.open sizes it."""
    return 2 * args.num_hidden_layers * args.num_key_value_heads * context_length * args.head_dim * 4


def effective_context(args: ModelArgs, context_length: int) -> int:
    """The context Engine.open uses for the setting ``context_length`` (0 = model default)."""
    return context_length or min(args.max_position_embeddings, DEFAULT_CONTEXT)


@dataclass(frozen=True)
class Estimate:
    """Disk and RAM numbers of one model at one quantization (bytes).

    ram_needed = dense + kv + one expert slot per layer + reserve: the minimum Engine.open
    accepts (ram_budget.plan_cap). all_experts_bytes: every expert (cache holding all of them).
    """

    quant: str
    slot_bytes: int
    expert_bytes: int
    dense_bytes: int
    store_bytes: int
    kv_bytes: int
    slots_bytes: int
    reserve_bytes: int
    ram_needed: int
    context_length: int

    @property
    def all_in_ram_bytes(self) -> int:
        return self.dense_bytes + self.kv_bytes + self.expert_bytes + self.reserve_bytes


def estimate(args: ModelArgs, quant: str = "int8", context_length: int = DEFAULT_CONTEXT,
             extra_store_bytes: int = 0) -> Estimate:
    """Store size and minimum RAM of ``args`` converted at ``quant``.

    Args:
        context_length: tokens of KV cache (0 = the engine's default for this model).
        extra_store_bytes: copied files (tokenizer, config) to add to the store size.
    Raises:
        ValueError: unknown quant.
    """
    if quant not in QUANTS:
        raise ValueError(f"quantization {quant!r}: choose one of {', '.join(QUANTS)}")
    ctx = effective_context(args, context_length)
    slot = slab_layout(quant, args.hidden_size, args.intermediate_size)["slot_bytes"]
    L, E = args.num_hidden_layers, args.num_experts
    experts = L * E * slot
    dense = dense_bytes_estimate(args, quant)
    kv = kv_bytes_estimate(args, ctx)
    slots = L * slot
    # + manifest (~100 B per expert) + dense.safetensors header (~128 B per tensor)
    store = experts + dense + extra_store_bytes + 4096 + 120 * L * E + 128 * (13 * L + 6)
    return Estimate(quant, slot, experts, dense, store, kv, slots, RESERVE_BYTES,
                    dense + kv + slots + RESERVE_BYTES, ctx)


def machine_ram() -> tuple[int, int]:
    """(total, available) RAM in bytes this process may use (psutil, cut to the cgroup limit)."""
    from .sysinfo import memory
    return memory()


def ram_verdict(est: Estimate, num_experts_per_tok: int, total: int, available: int) -> tuple[str, str]:
    """("ok" | "warn" | "refuse", message with the numbers).

    refuse: the minimum (dense + KV + one slot per layer + reserve) exceeds physical RAM.
    warn: it exceeds the share of available RAM the engine budgets (AVAILABLE_SHARE), or
    fewer expert slots per layer fit than experts are routed per token (every token then
    reads experts from the SSD).
    """
    need = est.ram_needed
    usable = int(AVAILABLE_SHARE * available)
    head = (f"needs at least {format_bytes(need)} (dense {format_bytes(est.dense_bytes)} + KV "
            f"{format_bytes(est.kv_bytes)} at {est.context_length} tokens + one expert slot per layer "
            f"{format_bytes(est.slots_bytes)} + reserve {format_bytes(est.reserve_bytes)}); this machine has "
            f"{format_bytes(total)} RAM, {format_bytes(available)} available")
    if need > total:
        return "refuse", (f"Not enough RAM: the model {head}. Lower the context length or choose a "
                          f"smaller quantization.")
    if need > usable:
        return "warn", (f"Tight on RAM: the model {head}. Close other programs or lower the context "
                        f"length before opening it.")
    num_experts = est.expert_bytes // max(1, est.slots_bytes)
    room = usable - (need - est.slots_bytes)
    fit = int(min(room // max(1, est.slots_bytes), num_experts))  # as ram_budget.plan_cap
    if fit < num_experts_per_tok:
        return "warn", (f"Runs, but slowly: the model {head}; only about {fit} expert slots per layer fit "
                        f"while {num_experts_per_tok} experts are routed per token, so most experts are "
                        f"read from the SSD for every token.")
    whole = fit >= num_experts
    return "ok", (f"The model {head}; about {fit} expert slots per layer fit"
                  + (" (the whole model fits in RAM)." if whole else "; the rest streams from the SSD."))


# --- disk ---------------------------------------------------------------------------------


def _existing_ancestor(p: Path) -> Path:
    p = Path(p).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_space(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``path`` (shutil.disk_usage)."""
    return int(shutil.disk_usage(_existing_ancestor(Path(path))).free)


def _same_disk(a: Path, b: Path) -> bool:
    try:
        return os.stat(_existing_ancestor(a)).st_dev == os.stat(_existing_ancestor(b)).st_dev
    except OSError:
        return False


def downloads_dir() -> Path:
    """Where hub downloads go: ``user_data_dir()/downloads``."""
    p = paths.user_data_dir() / "downloads"
    p.mkdir(parents=True, exist_ok=True)
    return p


def download_dir_for(repo_id: str, dest_root: str | os.PathLike | None = None) -> Path:
    """The download folder of ``repo_id``: ``<root>/<owner>--<name>``."""
    root = Path(dest_root) if dest_root else downloads_dir()
    return root / repo_id.replace("/", "--")


def store_name(model_name: str, quant: str) -> str:
    """Folder name of a converted store: ``<name>-<quant>``."""
    return f"{model_name}-{quant}"


# --- the check ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RepoFile:
    """One file the conversion needs. sha256: LFS files only; blob_id: git object id."""

    name: str
    size: int
    sha256: str | None = None
    blob_id: str | None = None
    present_bytes: int = 0  # already in the download folder (complete or partial)


@dataclass(frozen=True)
class RepoCheck:
    """What downloading and converting a model will take, decided before any weights move.

    source: "hub" or "local". commit: the resolved revision (hub). files: the needed files.
    download_bytes: all needed files; download_missing: bytes still to fetch. store_bytes:
    the converted store at ``quant``. disk_ok False means refused (disk_message says why
    with numbers). ram_verdict: "ok" / "warn" / "refuse" with ram_message.
    estimates: the same numbers for every wizard quantization.
    """

    source: str
    repo_id: str
    revision: str
    commit: str
    model_name: str
    args: ModelArgs
    files: tuple[RepoFile, ...]
    ignored_files: tuple[str, ...]
    download_dir: str
    download_bytes: int
    download_missing: int
    download_free: int
    quant: str
    store_dir: str
    store_exists: bool
    store_bytes: int
    store_free: int
    same_disk: bool
    disk_ok: bool
    disk_message: str
    estimate: Estimate
    ram_total: int
    ram_available: int
    ram_verdict: str
    ram_message: str
    estimates: tuple[Estimate, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when the model may be downloaded / converted (RAM warnings allowed)."""
        return self.disk_ok and self.ram_verdict != "refuse"

    def table(self) -> str:
        """A human-readable summary (the CLI prints it; the wizard shows the same numbers)."""
        a = self.args
        lines = [f"model      {self.repo_id}" + (f" @ {self.commit[:12]}" if self.commit else "")
                 + f" ({a.model_type}: {a.num_hidden_layers} layers x {a.num_experts} experts, "
                   f"{a.num_experts_per_tok} per token, hidden {a.hidden_size})"]
        if self.source == "hub":
            lines.append("files:")
            for f in self.files:
                have = "" if not f.present_bytes else (
                    "  (present)" if f.present_bytes >= f.size else f"  ({format_bytes(f.present_bytes)} present)")
                lines.append(f"  {f.name:<48} {format_bytes(f.size):>10}{have}")
            if self.ignored_files:
                lines.append(f"  ({len(self.ignored_files)} other files are not needed and are skipped)")
            lines.append(f"download   {format_bytes(self.download_bytes)} "
                         f"({format_bytes(self.download_missing)} still to fetch) into {self.download_dir}; "
                         f"{format_bytes(self.download_free)} free there")
        lines.append(f"store      {format_bytes(self.store_bytes)} at {self.quant} in {self.store_dir}; "
                     f"{format_bytes(self.store_free)} free there"
                     + (" (same disk as the download)" if self.same_disk and self.source == "hub" else ""))
        for e in self.estimates:
            lines.append(f"  {e.quant:<5} store {format_bytes(e.store_bytes):>10}, RAM needed "
                         f"{format_bytes(e.ram_needed):>10}")
        lines.append(f"disk       {'OK' if self.disk_ok else 'NOT ENOUGH'}: {self.disk_message}")
        lines.append(f"RAM        {self.ram_verdict.upper()}: {self.ram_message}")
        return "\n".join(lines)


def _is_needed(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatchcase(name, p) for p in NEEDED_PATTERNS)


def _endpoint() -> str | None:
    ep = os.environ.get("HF_ENDPOINT", "").strip().rstrip("/")
    return ep or None


def _hub_error(e: BaseException, repo_id: str, revision: str | None, what: str) -> HubError:
    """Map huggingface_hub / network exceptions to a HubError with advice."""
    from huggingface_hub import errors as he
    rev = f" at revision {revision!r}" if revision else ""
    if isinstance(e, he.GatedRepoError):
        return HubError(f"{repo_id} is gated: accept its license on the model page and log in "
                        f"(`hf auth login` or the HF_TOKEN environment variable), then try again")
    if isinstance(e, he.RepositoryNotFoundError):
        return HubError(f"repository {repo_id!r} was not found on the hub (check the spelling "
                        f"'owner/name'; private repos need a token)")
    if isinstance(e, he.RevisionNotFoundError):
        return HubError(f"revision {revision!r} of {repo_id} was not found (use a branch, tag or commit)")
    if isinstance(e, (he.EntryNotFoundError, he.RemoteEntryNotFoundError)):
        return HubError(f"{repo_id}{rev}: {what} was not found in the repository")
    if isinstance(e, he.HfHubHTTPError):
        return HubError(f"{repo_id}{rev}: the hub answered with an error while fetching {what} ({e}); "
                        f"try again later")
    return HubError(f"{repo_id}{rev}: cannot reach the hub while fetching {what} ({type(e).__name__}: {e}); "
                    f"check the network connection (and HF_ENDPOINT / proxy settings) and try again")


def _hub_call(fn, repo_id, revision, what):
    import httpx2
    from huggingface_hub import errors as he
    try:
        return fn()
    except (he.HfHubHTTPError, httpx2.HTTPError, he.LocalEntryNotFoundError, OSError) as e:
        raise _hub_error(e, repo_id, revision, what) from None


def _local_present(dest: Path, f: RepoFile) -> int:
    """Bytes of ``f`` already in ``dest`` (the complete file, else its partial file)."""
    p = dest / f.name
    try:
        if p.is_file() and p.stat().st_size == f.size:
            return f.size
    except OSError:
        pass
    part = _part_path(dest, f)
    try:
        return min(part.stat().st_size, f.size)
    except OSError:
        return 0


def _decide_disk(download_dir: Path, missing: int, store_dir: Path, store_bytes: int,
                 source: str) -> tuple[int, int, bool, bool, str]:
    dl_free = free_space(download_dir) if source == "hub" else 0
    st_free = free_space(store_dir)
    same = source == "hub" and _same_disk(download_dir, store_dir)
    if same:
        need = missing + store_bytes + DISK_MARGIN_BYTES
        ok = need <= st_free
        msg = (f"{format_bytes(missing)} download + {format_bytes(store_bytes)} store = "
               f"{format_bytes(need - DISK_MARGIN_BYTES)} needed on one disk, {format_bytes(st_free)} free")
    else:
        ok_dl = source != "hub" or missing + DISK_MARGIN_BYTES <= dl_free
        ok_st = store_bytes + DISK_MARGIN_BYTES <= st_free
        ok = ok_dl and ok_st
        parts = []
        if source == "hub":
            parts.append(f"download {format_bytes(missing)} needed, {format_bytes(dl_free)} free at {download_dir}")
        parts.append(f"store {format_bytes(store_bytes)} needed, {format_bytes(st_free)} free at {store_dir}")
        msg = "; ".join(parts)
    if not ok:
        msg = "Not enough disk space: " + msg + ". Free some space or choose a smaller quantization."
    return dl_free, st_free, same, ok, msg


def _finish_check(*, source, repo_id, revision, commit, model_name, args, files, ignored, dl_dir,
                  quant, context_length, copied_bytes) -> RepoCheck:
    ests = tuple(estimate(args, q, context_length, copied_bytes) for q in WIZARD_QUANTS)
    est = estimate(args, quant, context_length, copied_bytes)
    store_dir = paths.models_dir() / store_name(model_name, quant)
    total_dl = sum(f.size for f in files)
    missing = sum(f.size - f.present_bytes for f in files)
    dl_free, st_free, same, disk_ok, disk_msg = _decide_disk(dl_dir, missing, store_dir, est.store_bytes, source)
    ram_total, ram_avail = machine_ram()
    verdict, ram_msg = ram_verdict(est, args.num_experts_per_tok, ram_total, ram_avail)
    return RepoCheck(
        source=source, repo_id=repo_id, revision=revision, commit=commit, model_name=model_name, args=args,
        files=tuple(files), ignored_files=tuple(ignored), download_dir=str(dl_dir), download_bytes=total_dl,
        download_missing=missing, download_free=dl_free, quant=quant, store_dir=str(store_dir),
        store_exists=(store_dir / "manifest.json").exists(), store_bytes=est.store_bytes, store_free=st_free,
        same_disk=same, disk_ok=disk_ok, disk_message=disk_msg, estimate=est, ram_total=ram_total,
        ram_available=ram_avail, ram_verdict=verdict, ram_message=ram_msg, estimates=ests)


def _repo_files(repo_id: str, revision: str | None) -> tuple[str, list, list[str]]:
    from huggingface_hub import HfApi
    info = _hub_call(lambda: HfApi(endpoint=_endpoint()).model_info(repo_id, revision=revision,
                                                                    files_metadata=True),
                     repo_id, revision, "the file list")
    commit = info.sha or (revision or "main")
    needed, ignored = [], []
    for s in info.siblings or []:
        if not _is_needed(s.rfilename):
            ignored.append(s.rfilename)
            continue
        size = s.lfs.size if s.lfs is not None else s.size
        if size is None:
            raise HubError(f"{repo_id}: the hub did not report the size of {s.rfilename}; cannot verify "
                           f"the download")
        needed.append(RepoFile(s.rfilename, int(size), s.lfs.sha256 if s.lfs is not None else None,
                               s.blob_id))
    return commit, sorted(needed, key=lambda f: (f.size, f.name)), sorted(ignored)


def check_repo(repo_id: str, revision: str | None = None, quant: str = "int8",
               context_length: int = DEFAULT_CONTEXT, dest_root: str | os.PathLike | None = None) -> RepoCheck:
    """Check a hub model before downloading any weights.

    Fetches the repo's file list with sizes and hashes (HfApi.model_info, files_metadata=True)
    and ``config.json`` (hf_hub_download), validates the config (ModelArgs.from_dict), and
    computes download size, store size at ``quant``, free disk space on both targets and the
    RAM needed to run at ``context_length`` tokens (0 = model default) against this machine.

    Args:
        dest_root: download root (default: ``user_data_dir()/downloads``).
    Returns: a RepoCheck; ``check.ok`` False means refused (disk or RAM), with messages.
    Raises:
        ConfigError: unsupported model_type (message names the supported architectures) or an
            invalid config.json - raised before any weights are requested.
        HubError: repo / revision not found, gated, no safetensors weights, network down.
        ValueError: unknown quant or malformed repo id.
    """
    if quant not in QUANTS:
        raise ValueError(f"quantization {quant!r}: choose one of {', '.join(QUANTS)}")
    repo_id = (repo_id or "").strip()
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"{repo_id!r} is not a hub repository id; use 'owner/name' "
                         f"(for example allenai/OLMoE-1B-7B-0924)")
    revision = (revision or "").strip() or None
    commit, files, ignored = _repo_files(repo_id, revision)
    names = {f.name for f in files}
    if "config.json" not in names:
        raise HubError(f"{repo_id}: the repository has no config.json; it is not a Hugging Face "
                       f"transformers model")
    from huggingface_hub import hf_hub_download
    with tempfile.TemporaryDirectory(prefix="colibri-check-") as tmp:
        cfg_path = _hub_call(lambda: hf_hub_download(repo_id, "config.json", revision=commit, local_dir=tmp,
                                                     endpoint=_endpoint()),
                             repo_id, revision, "config.json")
        try:
            cfg = json.loads(Path(cfg_path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{repo_id}: config.json is not valid JSON ({e})") from None
    mt = cfg.get("model_type") if isinstance(cfg, dict) else None
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{repo_id}: model_type {mt!r} is not supported; colibri runs these "
                          f"architectures: {', '.join(SUPPORTED_MODEL_TYPES)} (OLMoE mixture-of-experts "
                          f"models, e.g. allenai/OLMoE-1B-7B-0924). Nothing was downloaded.")
    args = ModelArgs.from_dict(cfg, f"{repo_id}/config.json")
    if not any(n.endswith(".safetensors") for n in names):
        raise HubError(f"{repo_id}: no *.safetensors weights in the repository; only safetensors "
                       f"checkpoints are supported (pickle .bin files are never loaded)")
    dl_dir = download_dir_for(repo_id, dest_root)
    files = [RepoFile(f.name, f.size, f.sha256, f.blob_id, _local_present(dl_dir, f)) for f in files]
    copied = sum(f.size for f in files if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json")
    return _finish_check(source="hub", repo_id=repo_id, revision=revision or "main", commit=commit,
                         model_name=repo_id.split("/")[1], args=args, files=files, ignored=ignored,
                         dl_dir=dl_dir, quant=quant, context_length=context_length, copied_bytes=copied)


def check_local(folder: str | os.PathLike, quant: str = "int8",
                context_length: int = DEFAULT_CONTEXT) -> RepoCheck:
    """Check a local Hugging Face checkpoint folder (as check_repo, without a download).

    Raises:
        ConfigError: unsupported model_type / invalid config.json.
        CheckpointError: missing or truncated weight files, Git LFS pointers, wrong shapes.
    """
    folder = Path(folder).expanduser()
    args = ModelArgs.from_hf_config(folder)  # refuses unsupported model types with the list
    with Checkpoint(folder):  # pointers, truncated headers, missing tensors, shapes
        pass
    files, ignored = [], []
    for p in sorted(folder.iterdir()):
        if p.is_file() and _is_needed(p.name):
            files.append(RepoFile(p.name, p.stat().st_size, present_bytes=p.stat().st_size))
        elif p.is_file():
            ignored.append(p.name)
    copied = sum(f.size for f in files if not f.name.endswith(".safetensors"))
    return _finish_check(source="local", repo_id=str(folder), revision="", commit="", model_name=folder.name,
                         args=args, files=files, ignored=ignored, dl_dir=folder, quant=quant,
                         context_length=context_length, copied_bytes=copied)


# --- download -----------------------------------------------------------------------------


def _file_id(f: RepoFile) -> str:
    return (f.sha256 or f.blob_id or f"size{f.size}")[:16]


def _part_path(dest: Path, f: RepoFile) -> Path:
    return dest / PARTIAL_DIR / f"{f.name}.{_file_id(f)}.part"


class _Hasher:
    """sha256 (LFS files) or git blob sha1 (others) computed while bytes arrive."""

    def __init__(self, f: RepoFile):
        self.f = f
        if f.sha256:
            self.h, self.want = hashlib.sha256(), f.sha256.lower()
        elif f.blob_id:
            self.h, self.want = hashlib.sha1(b"blob %d\0" % f.size), f.blob_id.lower()
        else:
            self.h, self.want = None, None

    def update(self, b: bytes) -> None:
        if self.h is not None:
            self.h.update(b)

    def ok(self) -> bool:
        return self.h is None or self.h.hexdigest() == self.want

    def got(self) -> str:
        return self.h.hexdigest() if self.h is not None else ""


def _verified_path(dest: Path) -> Path:
    return dest / PARTIAL_DIR / "verified.json"


def _load_verified(dest: Path) -> dict:
    try:
        d = json.loads(_verified_path(dest).read_text(encoding="utf-8"))
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _mark_verified(dest: Path, f: RepoFile) -> None:
    d = _load_verified(dest)
    st = (dest / f.name).stat()
    d[f.name] = {"id": _file_id(f), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    paths.atomic_write_text(_verified_path(dest), json.dumps(d, indent=1))


def _is_complete(dest: Path, f: RepoFile, verified: dict, cancel: threading.Event | None) -> bool:
    """True if ``dest/f.name`` is already the right file (marker, else a full hash check)."""
    p = dest / f.name
    try:
        st = p.stat()
    except OSError:
        return False
    if st.st_size != f.size:
        return False
    v = verified.get(f.name)
    if v and v.get("id") == _file_id(f) and v.get("size") == st.st_size and v.get("mtime_ns") == st.st_mtime_ns:
        return True
    h = _Hasher(f)
    if h.h is None:
        return True
    with open(p, "rb") as fh:
        for b in iter(lambda: fh.read(_CHUNK), b""):
            if cancel is not None and cancel.is_set():
                raise DownloadCancelled("download cancelled while checking the files already present")
            h.update(b)
    if h.ok():
        _mark_verified(dest, f)
        return True
    return False


def check_weight_file(path: str | os.PathLike) -> None:
    """Refuse a Git LFS pointer or a truncated/corrupt safetensors file.

    Raises:
        CheckpointError: naming the file and what to do.
    """
    path = Path(path)
    if is_lfs_pointer(path):
        raise CheckpointError(f"{path.name} is a Git LFS pointer file ({path.stat().st_size} bytes of text), "
                              f"not the weights: the server or mirror serves LFS pointers instead of the data. "
                              f"Download from huggingface.co (unset HF_ENDPOINT), or fetch the real file with "
                              f"`git lfs pull` and open the folder as a local model.")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open
        try:
            with safe_open(str(path), framework="numpy") as h:
                h.keys()
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path.name}: not a complete safetensors file ({e}); it is truncated or "
                                  f"corrupt - delete it and download the model again") from None


def _refuse_pointer(part: Path, f: RepoFile) -> None:
    """Raise CheckpointError (and remove the file) if the server sent a Git LFS pointer."""
    if is_lfs_pointer(part):
        part.unlink(missing_ok=True)
        raise CheckpointError(f"{f.name}: the server sent a Git LFS pointer file instead of the data; the bad "
                              f"file was removed. Download from huggingface.co (unset HF_ENDPOINT), or fetch the "
                              f"real file with `git lfs pull` and open the folder as a local model.")


class _Progress:
    """Aggregates bytes over files; reports LoadProgress(stage="download") with speed and ETA."""

    def __init__(self, total: int, done: int, cb: Callable[[LoadProgress], None] | None):
        self.total, self.done, self.cb = total, done, cb
        self.window: deque[tuple[float, int]] = deque()
        self.fetched = 0
        self.last = 0.0
        self.name = ""

    def speed(self) -> float:
        if len(self.window) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self.window[0], self.window[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0

    def add(self, n: int) -> None:
        self.done += n
        self.fetched += n
        now = time.monotonic()
        self.window.append((now, self.fetched))
        while len(self.window) > 2 and now - self.window[0][0] > 5.0:
            self.window.popleft()
        self.report()

    def report(self, force: bool = False, note: str = "") -> None:
        now = time.monotonic()
        if self.cb is None or (not force and now - self.last < 0.1):
            return
        self.last = now
        sp = self.speed()
        if note:
            msg = note
        elif sp > 0:
            msg = (f"{self.name} · {format_bytes(sp)}/s · ETA "
                   f"{format_duration((self.total - self.done) / sp)}")
        else:
            msg = f"{self.name} · starting"
        self.cb(LoadProgress("download", self.done, self.total, "B", msg))


def _fetch(url: str, headers: dict, f: RepoFile, part: Path, prog: _Progress, cancel: threading.Event,
           retries: int, timeout: float) -> _Hasher:
    """Fetch ``url`` into ``part`` (appending from its current size). Returns the hasher."""
    import httpx2
    from huggingface_hub import errors as he
    from huggingface_hub.utils import get_session, hf_raise_for_status
    hasher = _Hasher(f)
    have = part.stat().st_size if part.exists() else 0
    if have > f.size:  # not this file: start over
        part.unlink()
        prog.done -= f.size
        have = 0
    if have:
        prog.report(force=True, note=f"{f.name} · verifying {format_bytes(have)} already downloaded")
        with open(part, "rb") as fh:
            left = have
            while left:
                b = fh.read(min(_CHUNK, left))
                if not b:
                    break
                if cancel.is_set():
                    raise DownloadCancelled(f"download of {f.name} cancelled; run it again to resume")
                hasher.update(b)
                left -= len(b)
    failures = 0
    while have < f.size:
        if cancel.is_set():
            raise DownloadCancelled(f"download of {f.name} cancelled at {format_bytes(have)} of "
                                    f"{format_bytes(f.size)}; run it again to resume")
        h = dict(headers)
        h["Accept-Encoding"] = "identity"
        if have:
            h["Range"] = f"bytes={have}-"
        got_any = False
        try:
            with get_session().stream("GET", url, headers=h, timeout=timeout, follow_redirects=True) as r:
                if r.status_code == 416 and have:
                    part.unlink(missing_ok=True)
                    raise VerificationError(f"{f.name}: the server refused to resume at byte {have} of "
                                            f"{f.size}; the partial file was removed - run the download again")
                hf_raise_for_status(r)
                if have and r.status_code == 200:  # the server ignored Range: start over
                    prog.done -= have
                    have = 0
                    hasher = _Hasher(f)
                    part.unlink(missing_ok=True)
                elif have:
                    cr = r.headers.get("Content-Range", "")
                    if not cr.startswith(f"bytes {have}-"):
                        raise HubError(f"{f.name}: the server answered the resume request with "
                                       f"Content-Range {cr!r}; delete {part} and try again")
                with open(part, "ab") as out:
                    for chunk in r.iter_bytes():
                        if not chunk:
                            continue
                        if have + len(chunk) > f.size:
                            chunk = chunk[:f.size - have]
                        out.write(chunk)
                        hasher.update(chunk)
                        have += len(chunk)
                        got_any = True
                        prog.add(len(chunk))
                        if cancel.is_set():
                            out.flush()
                            raise DownloadCancelled(
                                f"download of {f.name} cancelled at {format_bytes(have)} of "
                                f"{format_bytes(f.size)}; run it again to resume")
                        if have >= f.size:
                            break
                    out.flush()
                    os.fsync(out.fileno())
        except (httpx2.TransportError, httpx2.StreamError, he.HfHubHTTPError) as e:
            if isinstance(e, he.HfHubHTTPError) and (e.response is None or e.response.status_code not in
                                                     (408, 429, 500, 502, 503, 504)):
                raise  # not transient (404, 401, ...)
            failures = 0 if got_any else failures + 1
            if failures > retries:
                raise HubError(f"{f.name}: the connection failed {failures} times ({type(e).__name__}: {e}); "
                               f"{format_bytes(have)} of {format_bytes(f.size)} are kept - run the download "
                               f"again to resume") from None
            cancel.wait(min(8.0, 0.5 * 2 ** failures) if failures else 0.2)
            continue
        if have < f.size and have <= 1024:
            _refuse_pointer(part, f)
        if have < f.size and not got_any:
            failures += 1
            if failures > retries:
                raise HubError(f"{f.name}: the server stopped sending at {format_bytes(have)} of "
                               f"{format_bytes(f.size)}; run the download again to resume")
    return hasher


def download(repo_id: str, revision: str | None = None, dest: str | os.PathLike | None = None,
             progress: Callable[[LoadProgress], None] | None = None,
             cancel: threading.Event | None = None, *, check: RepoCheck | None = None,
             retries: int = 5) -> Path:
    """Download the files a conversion needs from ``repo_id`` into ``dest``; resumable.

    Files already complete (size and hash match) are skipped; a partial file left by a
    cancel, a crash or a lost connection is resumed from its size with a Range request.
    Each file is verified against the hub's size and sha256 (LFS) or git blob id, then moved
    into place; weight files are checked for Git LFS pointers and truncated headers.

    Args:
        revision: branch, tag or commit (default main); resolved to a commit first so every
            file comes from the same commit. ``check``: a RepoCheck of the same repo (skips
            listing the files again).
        dest: folder (default ``download_dir_for(repo_id)``).
        progress: gets LoadProgress(stage="download", done=bytes, total=bytes, unit="B",
            message="<file> · <speed>/s · ETA <time>"), at most ~10 per second.
        cancel: set it to stop (within one network chunk); raises DownloadCancelled.
        retries: connection failures in a row tolerated per file (with backoff).
    Returns: ``dest``.
    Raises:
        DownloadCancelled; DiskSpaceError (before fetching); VerificationError (file named,
        bad file removed); CheckpointError (LFS pointer / truncated safetensors, file removed);
        HubError (network, repo or revision not found).
    """
    import httpx2
    from huggingface_hub import constants as hc
    from huggingface_hub import errors as he
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers
    cancel = cancel or threading.Event()
    if check is not None and check.source == "hub" and check.repo_id == repo_id:
        commit, files = check.commit, list(check.files)
    else:
        commit, files, _ = _repo_files(repo_id, revision)
    dest = Path(dest) if dest else download_dir_for(repo_id)
    (dest / PARTIAL_DIR).mkdir(parents=True, exist_ok=True)
    paths.atomic_write_text(dest / PARTIAL_DIR / "source.json",
                            json.dumps({"repo_id": repo_id, "revision": revision or "main", "commit": commit}))
    verified = _load_verified(dest)
    todo, done = [], 0
    for f in files:
        if _is_complete(dest, f, verified, cancel):
            done += f.size
        else:
            todo.append(f)
            part = _part_path(dest, f)
            if part.exists():
                done += min(part.stat().st_size, f.size)
    total = sum(f.size for f in files)
    missing = total - done
    free = free_space(dest)
    if missing + DISK_MARGIN_BYTES > free:
        raise DiskSpaceError(f"Not enough disk space at {dest}: {format_bytes(missing)} still to download, "
                             f"{format_bytes(free)} free. Free some space and try again.")
    prog = _Progress(total, done, progress)
    prog.report(force=True, note=f"{len(files) - len(todo)} of {len(files)} files already present")
    headers = build_hf_headers()
    timeout = float(hc.HF_HUB_DOWNLOAD_TIMEOUT)
    ep = _endpoint()
    for f in todo:
        prog.name = f.name
        url = hf_hub_url(repo_id, f.name, revision=commit, endpoint=ep)
        part = _part_path(dest, f)
        part.parent.mkdir(parents=True, exist_ok=True)
        for stale in part.parent.glob("*.part"):  # partial files of an older version of this file
            stem, _, rest = stale.name[:-len(".part")].rpartition(".")
            if stem == f.name and stale != part:
                stale.unlink(missing_ok=True)
        try:
            hasher = _fetch(url, headers, f, part, prog, cancel, retries, timeout)
        except (he.HfHubHTTPError, httpx2.HTTPError) as e:
            raise _hub_error(e, repo_id, revision, f.name) from None
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DiskSpaceError(f"the disk holding {dest} is full while writing {f.name}; the bytes "
                                     f"downloaded so far are kept - free some space and resume") from None
            raise
        size = part.stat().st_size
        _refuse_pointer(part, f)
        if size != f.size or not hasher.ok():
            part.unlink(missing_ok=True)
            what = (f"{size} bytes instead of {f.size}" if size != f.size else
                    f"{'sha256' if f.sha256 else 'git blob id'} {hasher.got()[:16]}... instead of "
                    f"{(f.sha256 or f.blob_id or '')[:16]}...")
            raise VerificationError(f"{f.name}: the downloaded file does not match the hub ({what}); the bad file "
                                    f"was removed. Run the download again; if it happens again the repository or a "
                                    f"proxy is serving corrupt data.")
        final = dest / f.name
        os.replace(part, final)
        paths.fsync_dir(dest)
        if f.name.endswith(".safetensors"):
            try:
                check_weight_file(final)
            except CheckpointError:
                final.unlink(missing_ok=True)
                raise
        _mark_verified(dest, f)
        prog.report(force=True)
    for f in files:
        if f.name.endswith(".safetensors"):
            check_weight_file(dest / f.name)
    prog.report(force=True, note=f"downloaded {len(files)} files ({format_bytes(total)})")
    return dest


def delete_download(path: str | os.PathLike) -> None:
    """Remove a download folder (only inside ``downloads_dir()``).

    Raises:
        ValueError: ``path`` is not a folder inside the downloads directory.
    """
    root = downloads_dir().resolve()
    p = Path(path).resolve()
    if p == root or root not in p.parents or not p.is_dir():
        raise ValueError(f"{p}: not a download folder inside {root}; refusing to delete it")
    shutil.rmtree(p)


# --- convert, self-test -------------------------------------------------------------------


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
    """Convert a downloaded (or local) checkpoint into ``models_dir()/<name>-<quant>``.

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
        ConfigError / CheckpointError: invalid source; ConversionCancelled: ``cancel`` set.
    """
    from .convert import convert_checkpoint
    src = Path(src)
    info = _source_info(src)
    model_name = name or (info["repo_id"].split("/")[-1] if info.get("repo_id") else src.name)
    dst = paths.models_dir() / store_name(model_name, quant)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst}: a store already exists; delete it in the model library or choose "
                              f"to replace it")
    args = ModelArgs.from_hf_config(src)
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
        EngineError (StoreError, BudgetError, ...): the store cannot be opened;
        HubError: generation ended with an error (message included).
    """
    from .config import EngineConfig
    from .events import ChatMessage, Finished, GenerateRequest, SamplingParams
    from .generate import Engine
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
    if fin is None or fin.finish_reason == "error":
        raise HubError(f"{store}: self-test generation failed ({fin.error if fin else 'no result'}); the store "
                       f"may be corrupt - delete it and convert again")
    return fin.text


# --- library ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelEntry:
    """A converted store in models_dir(): size_bytes on disk, created (ISO time, UTC)."""

    name: str
    source: str
    quantization: str
    size_bytes: int
    created: str
    path: str


def _dir_size(p: Path) -> int:
    n = 0
    for root, _dirs, files in os.walk(p):
        for fn in files:
            try:
                n += os.lstat(os.path.join(root, fn)).st_size
            except OSError:
                pass
    return n


def list_models() -> list[ModelEntry]:
    """Converted stores in ``models_dir()`` (folders with a manifest.json), newest first.

    Unfinished conversions (``*.partial``) and unreadable manifests are skipped.
    """
    out = []
    for p in sorted(paths.models_dir().iterdir()):
        if not p.is_dir() or p.name.endswith(".partial") or ".old-" in p.name or ".deleting-" in p.name:
            continue
        try:
            m = json.loads((p / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(m, dict):
            continue
        out.append(ModelEntry(name=str(m.get("model_name") or p.name), source=str(m.get("source") or ""),
                              quantization=str(m.get("quant") or "?"), size_bytes=_dir_size(p),
                              created=str(m.get("created") or ""), path=str(p)))
    out.sort(key=lambda e: e.created, reverse=True)
    return out


def delete_model(path: str | os.PathLike) -> None:
    """Delete a converted store; only folders inside ``models_dir()`` holding a manifest.json.

    Raises:
        ValueError: ``path`` is outside models_dir(), is models_dir() itself, or not a store.
    """
    root = paths.models_dir().resolve()
    p = Path(path).resolve()
    if p == root or root not in p.parents:
        raise ValueError(f"{p}: not inside the models folder {root}; refusing to delete it")
    if not (p / "manifest.json").is_file():
        raise ValueError(f"{p}: not a converted store (no manifest.json); refusing to delete it")
    trash = p.with_name(p.name + f".deleting-{os.getpid()}")
    os.replace(p, trash)  # disappears from the library at once, even if removal is slow
    shutil.rmtree(trash, ignore_errors=True)


# --- CLI ----------------------------------------------------------------------------------


def cli_progress(label: str):
    """A LoadProgress callback printing one updating stderr line (at most twice a second)."""
    last = [0.0]

    def cb(ev: LoadProgress) -> None:
        now = time.monotonic()
        if now - last[0] < 0.5 and ev.done < ev.total:
            return
        last[0] = now
        pct = 100 * ev.done / ev.total if ev.total else 100.0
        print(f"\r{label}: {format_bytes(ev.done):>9} / {format_bytes(ev.total)} ({pct:5.1f}%) "
              f"{ev.message[:60]:<60}", end="", file=sys.stderr, flush=True)
        if ev.total and ev.done >= ev.total:
            print(file=sys.stderr)
    return cb


def cmd_download(a) -> int:
    """``colibri download REPO``: check, download, convert, self-test, print the store path."""
    try:
        chk = check_repo(a.repo, a.revision, a.quant, a.context_length)
    except ValueError as e:  # ConfigError included (unsupported model type)
        print(f"colibri: error: {e}", file=sys.stderr)
        return 2
    print(chk.table())
    if not chk.disk_ok:
        print(f"colibri: refused: {chk.disk_message}", file=sys.stderr)
        return 2
    if chk.ram_verdict == "refuse":
        print(f"colibri: refused: {chk.ram_message}", file=sys.stderr)
        return 2
    if chk.ram_verdict == "warn" and not a.yes:
        if not sys.stdin.isatty():
            print("colibri: RAM warning; pass --yes to continue anyway", file=sys.stderr)
            return 2
        if input("Continue anyway? [y/N] ").strip().lower() not in ("y", "yes"):
            return 1
    if chk.store_exists and not a.overwrite:
        print(f"colibri: {chk.store_dir} already exists; pass --overwrite to convert again", file=sys.stderr)
        return 2
    cancel = threading.Event()
    try:
        src = download(a.repo, a.revision, None, cli_progress("downloading"), cancel, check=chk)
    except KeyboardInterrupt:
        cancel.set()
        print("\ninterrupted; the bytes fetched so far are kept - run the same command again to resume",
              file=sys.stderr)
        return 130
    print(file=sys.stderr)
    t0 = time.perf_counter()
    try:
        store = convert_downloaded(src, a.quant, cli_progress(f"converting ({a.quant})"),
                                   overwrite=a.overwrite)
    except KeyboardInterrupt:
        print(f"\ninterrupted; no store was written (the download is kept in {src})", file=sys.stderr)
        return 130
    print(f"\nconverted in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    text = self_test(store)
    print(f"self-test (8 greedy tokens): {text!r}", file=sys.stderr)
    if not a.keep_download:
        shutil.rmtree(src, ignore_errors=True)
    print(store)
    return 0


def cmd_models(a) -> int:
    """``colibri models``: table of converted stores."""
    ms = list_models()
    if not ms:
        print(f"no converted models in {paths.models_dir()} (add one with `colibri download REPO`)")
        return 0
    print(f"{'name':<32} {'quant':<5} {'size':>10}  {'created':<20} source / path")
    for m in ms:
        print(f"{m.name[:32]:<32} {m.quantization:<5} {format_bytes(m.size_bytes):>10}  {m.created:<20} "
              f"{m.source}\n{'':<71}{m.path}")
    return 0


def add_hub_parsers(sub) -> None:
    """Add ``download`` and ``models`` to the ``colibri`` argparse subparsers ``sub``."""
    d = sub.add_parser("download", help="download a model from the Hugging Face hub, check it and convert it",
                       description="Check (disk, RAM), download only the needed files (resumable), "
                                   "convert into a store in the user data folder, self-test, print the path.")
    d.add_argument("repo", help="hub repository id, e.g. allenai/OLMoE-1B-7B-0924")
    d.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    d.add_argument("--quant", choices=WIZARD_QUANTS + ("f32",), default="int8", help="store quantization")
    d.add_argument("--context-length", type=int, default=0,
                   help="context the RAM estimate assumes (0 = model default, up to 4096)")
    d.add_argument("--yes", action="store_true", help="continue despite a RAM warning")
    d.add_argument("--overwrite", action="store_true", help="replace an existing store of this model and quant")
    d.add_argument("--keep-download", action="store_true",
                   help="keep the downloaded Hugging Face files after converting")
    d.set_defaults(fn=cmd_download)
    m = sub.add_parser("models", help="list converted models")
    m.set_defaults(fn=cmd_models)
