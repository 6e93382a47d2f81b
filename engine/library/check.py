"""Check a model before any weights move: the files a conversion needs, disk space on both
targets and the RAM verdict (engine.sizing), for a hub repository or a local folder.

The hub is reached with huggingface_hub (``HfApi.model_info(files_metadata=True)`` for sizes
and hashes, ``hf_hub_download`` for config.json). The endpoint is ``HF_ENDPOINT`` (read at call
time), else huggingface.co; the token is the usual huggingface_hub one (``HF_TOKEN`` or ``hf
auth login``) for gated repos. Sizes are bytes.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import tempfile
from urllib.parse import unquote, urlsplit
from dataclasses import dataclass, field
from pathlib import Path

from ..config import SUPPORTED_MODEL_TYPES, ModelArgs, describe_model, supported_families
from ..errors import ConfigError, TokenizerError
from ..quant import QUANTS
from ..sizing import MAX_DEFAULT_CONTEXT, Estimate, estimate, machine_ram, ram_verdict
from ..store_format import looks_like_store
from ..units import format_bytes
from .errors import HubError
from .paths import download_dir_for, free_space, models_dir, same_disk, store_name

# Files a conversion needs (root of the repo only). Everything else (pytorch_model*.bin,
# onnx/, original/, *.gguf, images ...) is never downloaded.
NEEDED_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "config.json",
                   "generation_config.json", "tokenizer*.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt")
WIZARD_QUANTS = ("int8", "int4", "f16")  # f32 is for tests only
DEFAULT_CONTEXT = MAX_DEFAULT_CONTEXT  # the context the RAM verdict assumes by default
DISK_MARGIN_BYTES = 64_000_000  # slack kept free on a target disk (manifest, fs overhead)
PARTIAL_DIR = ".colibri-download"


HUB_HOSTS = ("huggingface.co", "www.huggingface.co", "hf.co")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def parse_repo_id(text: str) -> tuple[str, str | None]:
    """A repository id typed or pasted by the user -> (``owner/name``, revision or None).

    Accepts ``owner/name``, and a hub page address as copied from the browser:
    ``https://huggingface.co/owner/name``, ``.../tree/<revision>[/folder]``,
    ``.../blob/<revision>/<file>``, ``.../resolve/<revision>/<file>``, with or without the scheme,
    ``hf.co`` (or the host of ``HF_ENDPOINT``) too, a query or a fragment. The revision is the one in the address (None when the
    address names none).

    Raises:
        ValueError: the text is neither (message says what a repository id looks like); a
            dataset or Space address is refused with its own sentence.
    """
    t = (text or "").strip()
    example = "use owner/name, for example allenai/OLMoE-1B-7B-0924, or paste the model's hub address"
    if not t:
        raise ValueError(f"enter a repository: {example}")
    low = t.lower()
    hosts = HUB_HOSTS + ((urlsplit(_endpoint()).hostname or "",) if _endpoint() else ())
    if "://" in t or any(low.startswith(h + "/") for h in hosts):
        u = urlsplit(t if "://" in t else "https://" + t)
        if (u.hostname or "").lower() not in hosts:
            raise ValueError(f"{t!r} is not a Hugging Face hub address (host {u.hostname!r}); {example}")
        parts = [unquote(p) for p in u.path.split("/") if p]
        if parts and parts[0] in ("datasets", "spaces"):
            raise ValueError(f"{t!r} is a {parts[0][:-1]}, not a model; {example}")
        if len(parts) < 2:
            raise ValueError(f"{t!r} names no repository (owner/name after the host); {example}")
        repo, rest = f"{parts[0]}/{parts[1]}", parts[2:]
        revision = rest[1] if len(rest) >= 2 and rest[0] in ("tree", "blob", "resolve", "commit") else None
    else:
        repo, revision = t, None
    bits = repo.split("/")
    if len(bits) != 2 or not all(_NAME_RE.match(b) for b in bits):
        raise ValueError(f"{t!r} is not a hub repository id; {example}")
    return repo, revision


@dataclass(frozen=True)
class TokenizerCheck:
    """The tokenizer and chat template of a model folder, checked before converting.

    has_chat_template: the folder ships a chat template that compiles and renders a one-message
    conversation (False: the model can only continue raw text). message: one sentence for the
    user (what was found, what it means)."""

    has_chat_template: bool
    message: str


def check_tokenizer(folder: str | os.PathLike) -> TokenizerCheck:
    """Load the folder's tokenizer (tokenizer.json via engine.Tokenizer) and render a
    one-message conversation with its chat template, as the app will.

    Raises:
        TokenizerError: tokenizer.json missing, a Git LFS pointer or unreadable; a chat
            template that does not compile or fails to render (message names the file and
            what to do). A folder without any chat template is not an error (raw mode).
    """
    from ..tokenizer import Tokenizer
    folder = Path(folder).expanduser()
    tok = Tokenizer.from_dir(folder)
    if not tok.has_chat_template:
        return TokenizerCheck(False, "Tokenizer OK. No chat template: the model can only continue plain "
                                     "text (raw mode), not hold a conversation.")
    try:
        tok.encode_chat([{"role": "user", "content": "Hello"}])
    except TokenizerError as e:
        raise TokenizerError(f"{folder}: the chat template cannot render a conversation ({e}); fix or "
                             f"remove the chat template (tokenizer_config.json / chat_template.jinja)") from None
    return TokenizerCheck(True, "Tokenizer and chat template OK.")


def _hub_tokenizer_check(repo_id: str, names: set[str], fetch) -> TokenizerCheck:
    """check_tokenizer for a hub repository before its weights are downloaded: tokenizer.json
    must be listed; the small tokenizer files are fetched (``fetch(name) -> local path``) into
    a temporary folder and checked as a local folder would be."""
    if "tokenizer.json" not in names:
        raise TokenizerError(
            f"{repo_id}: the repository has no tokenizer.json (the Hugging Face fast tokenizer file); "
            f"colibri cannot read this model's text without it. Choose a repository that includes "
            f"tokenizer.json. Nothing was downloaded.")
    small = [n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                         "chat_template.jinja", "chat_template.json", "generation_config.json") if n in names]
    with tempfile.TemporaryDirectory(prefix="colibri-tok-") as tmp:
        for n in small:
            path = Path(fetch(n, tmp))
            if path.parent != Path(tmp):
                os.replace(path, Path(tmp) / n)
        return check_tokenizer(tmp)


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
    has_chat_template: bool = True
    tokenizer_message: str = ""
    gguf_file: str = ""  # a -GGUF repository: the chosen model's quant (or file), see hub_gguf
    gguf_choices: tuple[str, ...] = ()  # ... and every model it holds, smallest first

    @property
    def ok(self) -> bool:
        """True when the model may be downloaded / converted (RAM warnings allowed)."""
        return self.disk_ok and self.ram_verdict != "refuse"

    def table(self) -> str:
        """A human-readable summary (the CLI prints it; the wizard shows the same numbers)."""
        a = self.args
        lines = [f"model      {self.repo_id}" + (f" @ {self.commit[:12]}" if self.commit else "")
                 + f" ({describe_model(a)})"]
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
        if self.tokenizer_message:
            lines.append(f"tokenizer  {self.tokenizer_message}")
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


def _file_id(f: RepoFile) -> str:
    return (f.sha256 or f.blob_id or f"size{f.size}")[:16]


def _part_path(dest: Path, f: RepoFile) -> Path:
    return dest / PARTIAL_DIR / f"{f.name}.{_file_id(f)}.part"


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
    same = source == "hub" and same_disk(download_dir, store_dir)
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
                  quant, context_length, copied_bytes, tokenizer: TokenizerCheck) -> RepoCheck:
    ests = tuple(estimate(args, q, context_length, copied_bytes) for q in WIZARD_QUANTS)
    est = estimate(args, quant, context_length, copied_bytes)
    store_dir = models_dir() / store_name(model_name, quant)
    total_dl = sum(f.size for f in files)
    missing = sum(f.size - f.present_bytes for f in files)
    dl_free, st_free, same, disk_ok, disk_msg = _decide_disk(dl_dir, missing, store_dir, est.store_bytes, source)
    ram_total, ram_avail = machine_ram()
    verdict, ram_msg = ram_verdict(est, args.num_experts_per_tok, ram_total, ram_avail)
    return RepoCheck(
        source=source, repo_id=repo_id, revision=revision, commit=commit, model_name=model_name, args=args,
        files=tuple(files), ignored_files=tuple(ignored), download_dir=str(dl_dir), download_bytes=total_dl,
        download_missing=missing, download_free=dl_free, quant=quant, store_dir=str(store_dir),
        store_exists=looks_like_store(store_dir), store_bytes=est.store_bytes, store_free=st_free,
        same_disk=same, disk_ok=disk_ok, disk_message=disk_msg, estimate=est, ram_total=ram_total,
        ram_available=ram_avail, ram_verdict=verdict, ram_message=ram_msg, estimates=ests,
        has_chat_template=tokenizer.has_chat_template, tokenizer_message=tokenizer.message)


def _repo_listing(repo_id: str, revision: str | None) -> tuple[str, list]:
    """(commit, every file of the repository as a RepoFile with its size and hashes)."""
    from huggingface_hub import HfApi
    info = _hub_call(lambda: HfApi(endpoint=_endpoint()).model_info(repo_id, revision=revision,
                                                                    files_metadata=True),
                     repo_id, revision, "the file list")
    commit = info.sha or (revision or "main")
    out = []
    for s in info.siblings or []:
        size = s.lfs.size if s.lfs is not None else s.size
        out.append(RepoFile(s.rfilename, -1 if size is None else int(size),
                            s.lfs.sha256 if s.lfs is not None else None, s.blob_id))
    return commit, out


def _sized(repo_id: str, files: list) -> list:
    for f in files:
        if f.size < 0:
            raise HubError(f"{repo_id}: the hub did not report the size of {f.name}; cannot verify "
                           f"the download")
    return files


def _repo_files(repo_id: str, revision: str | None) -> tuple[str, list, list[str]]:
    commit, listing = _repo_listing(repo_id, revision)
    needed = _sized(repo_id, [f for f in listing if _is_needed(f.name)])
    ignored = [f.name for f in listing if not _is_needed(f.name)]
    return commit, sorted(needed, key=lambda f: (f.size, f.name)), sorted(ignored)


def check_hf_repo(repo_id: str, revision: str | None = None, quant: str = "int8",
                  context_length: int = DEFAULT_CONTEXT, dest_root: str | os.PathLike | None = None,
                  listing: tuple[str, list] | None = None) -> RepoCheck:
    """Check a hub model (a Hugging Face checkpoint) before downloading any weights; what
    ``check_repo`` (hub_check.py) calls for a repository that is not one of GGUF models.

    Fetches the repo's file list with sizes and hashes (HfApi.model_info, files_metadata=True)
    and ``config.json`` (hf_hub_download), validates the config (ModelArgs.from_dict), and
    computes download size, store size at ``quant``, free disk space on both targets and the
    RAM needed to run at ``context_length`` tokens (0 = model default) against this machine.

    Args:
        dest_root: download root (default: ``user_data_dir()/downloads``).
        listing: (commit, every file) of the repository when already listed (_repo_listing).
    Returns: a RepoCheck; ``check.ok`` False means refused (disk or RAM), with messages.
    Raises:
        ConfigError: unsupported model_type (message names the supported architectures) or an
            invalid config.json - raised before any weights are requested.
        HubError: repo / revision not found, gated, no safetensors weights, network down.
        TokenizerError: no tokenizer.json in the repository, or a chat template that cannot
            render (the small tokenizer files are fetched to check it; no weights are).
        ValueError: unknown quant or malformed repo id (``repo_id`` may also be a hub address,
            see parse_repo_id; its revision is used when ``revision`` is not given).
    """
    if quant not in QUANTS:
        raise ValueError(f"quantization {quant!r}: choose one of {', '.join(QUANTS)}")
    repo_id, url_revision = parse_repo_id(repo_id)
    revision = (revision or "").strip() or url_revision
    commit, listing = listing or _repo_listing(repo_id, revision)
    files = _sized(repo_id, sorted((f for f in listing if _is_needed(f.name)), key=lambda f: (f.size, f.name)))
    ignored = sorted(f.name for f in listing if not _is_needed(f.name))
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
        raise ConfigError(f"{repo_id}: model_type {mt!r} is not supported; supported families: "
                          f"{supported_families()}. Nothing was downloaded.")
    args = ModelArgs.from_dict(cfg, f"{repo_id}/config.json")
    if not any(n.endswith(".safetensors") for n in names):
        raise HubError(f"{repo_id}: no *.safetensors weights in the repository; only safetensors "
                       f"checkpoints are supported (pickle .bin files are never loaded)")
    dl_dir = download_dir_for(repo_id, dest_root)
    files = [RepoFile(f.name, f.size, f.sha256, f.blob_id, _local_present(dl_dir, f)) for f in files]
    complete = {f.name for f in files if f.present_bytes >= f.size}

    def fetch(name: str, tmp: str) -> str:  # a file already downloaded is read from the download
        if name in complete:
            return shutil.copyfile(dl_dir / name, Path(tmp) / name)
        return _hub_call(lambda: hf_hub_download(repo_id, name, revision=commit, local_dir=tmp,
                                                 endpoint=_endpoint()), repo_id, revision, name)
    tok = _hub_tokenizer_check(repo_id, names, fetch)
    copied = sum(f.size for f in files if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json")
    return _finish_check(source="hub", repo_id=repo_id, revision=revision or "main", commit=commit,
                         model_name=repo_id.split("/")[1], args=args, files=files, ignored=ignored,
                         dl_dir=dl_dir, quant=quant, context_length=context_length, copied_bytes=copied,
                         tokenizer=tok)
