"""A ``-GGUF`` repository on the Hugging Face hub (the files llama.cpp, LM Studio and Ollama users
download): its GGUF models grouped by quant, one chosen, and checked (family, sizes, RAM verdict,
tokenizer) from the headers alone before its weights are downloaded. The download itself is
download.download of the chosen file(s); the import is gguf_check.import_gguf.

A GGUF's header (metadata, vocabulary, tensor list) sits at the start of the file: it is fetched
with ``Range`` requests through huggingface_hub's own HTTP session into a sparse file of the
published size, which the ``gguf`` reader then opens as it opens a downloaded file (the tensor
data reads as zeros and is never used by the check).
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, ConfigError, TokenizerError
from ..gguf_file import SPLIT_RE
from .check import RepoCheck, RepoFile, _decide_disk, _endpoint, _hub_call, _local_present, _sized
from .errors import HubError

# llama.cpp's file-type names as the -GGUF repositories spell them in their file names
# (Qwen3-30B-A3B-Q4_K_M.gguf, gpt-oss-20b-MXFP4.gguf, ...-UD-Q4_K_XL-00001-of-00003.gguf)
_QUANT_RE = re.compile(r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|TQ\d_\d|BF16|F16|F32|MXFP4(?:_MOE)?))"
                       r"(?![A-Za-z0-9])", re.IGNORECASE)
# the choice when none is given: the common one first, then others of about its size
PREFERRED = ("Q4_K_M", "Q4_K_S", "UD-Q4_K_XL", "IQ4_XS", "MXFP4_MOE", "MXFP4", "Q4_0", "Q5_K_M", "Q6_K", "Q8_0")
HEADER_BYTES = 8 << 20  # first fetch of a header; grown fourfold until the header fits


@dataclass(frozen=True)
class HubGGUF:
    """One GGUF model of a repository: ``quant`` as its file name says ("" when it names none),
    ``files`` its part(s) in order (repository paths, sizes and hashes)."""

    quant: str
    files: tuple[RepoFile, ...]

    @property
    def label(self) -> str:
        """What a user types to choose it: the quant, else the first file's path."""
        return self.quant or self.files[0].name

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def gguf_models(files: list[RepoFile]) -> list[HubGGUF]:
    """The GGUF models among a repository's ``files``: single ``.gguf`` files and the parts of
    split ones (``NAME-0000K-of-0000N.gguf``, in any folder) grouped, projector files
    (``mmproj*``) and incomplete splits left out; sorted by size."""
    singles, splits = [], {}
    for f in files:
        base = f.name.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        m = SPLIT_RE.match(base)
        if m is None:
            singles.append((base[:-len(".gguf")], (f,)))
        else:
            key = (f.name[:len(f.name) - len(base)] + m.group("stem"), int(m.group("count")))
            splits.setdefault(key, {})[int(m.group("no"))] = f
    for (path, count), parts in splits.items():
        if sorted(parts) == list(range(1, count + 1)):
            singles.append((path, tuple(parts[k] for k in range(1, count + 1))))
    out = []
    for stem, fs in singles:
        found = _QUANT_RE.findall(stem.rsplit("/", 1)[-1])
        out.append(HubGGUF(found[-1].upper() if found else "", fs))
    return sorted(out, key=lambda m: (m.size, m.label))


def choose_gguf(repo_id: str, models: list[HubGGUF], want: str | None) -> HubGGUF:
    """The model ``want`` names (a quant such as ``Q4_K_M``, any case, or a file's path), else
    the first of PREFERRED the repository has, else the smallest.

    Raises:
        ConfigError: ``want`` names none of them (the choices listed), or there is none.
    """
    if not models:
        raise ConfigError(f"{repo_id}: holds no GGUF model file")
    if want:
        w = want.strip().lower()
        for m in models:
            if m.quant.lower() == w or any(f.name.lower() == w or f.name.rsplit("/", 1)[-1].lower() == w
                                           for f in m.files):
                return m
        raise ConfigError(f"{repo_id}: no GGUF file of {want!r}; it holds {', '.join(m.label for m in models)}. "
                          f"Nothing was downloaded.")
    by_quant = {m.quant: m for m in models}
    for q in PREFERRED:
        if q in by_quant:
            return by_quant[q]
    return models[0]


def _fetch_prefix(repo_id: str, commit: str, f: RepoFile, n: int, out: Path) -> int:
    """Write the first ``n`` bytes of the hub file ``f`` into ``out``, extended (sparse) to its
    published size; returns the bytes fetched. A server that ignores ``Range`` is read only as
    far as needed."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
    from .download import _CHUNK
    n = min(n, f.size)
    url = hf_hub_url(repo_id, f.name, revision=commit, endpoint=_endpoint())
    headers = {**build_hf_headers(), "Accept-Encoding": "identity", "Range": f"bytes=0-{n - 1}"}
    got = 0

    def fetch():
        nonlocal got
        with get_session().stream("GET", url, headers=headers, follow_redirects=True) as r, open(out, "wb") as fh:
            hf_raise_for_status(r)
            for chunk in r.iter_bytes(_CHUNK):
                fh.write(chunk[:n - got])
                got = min(n, got + len(chunk))
                if got >= n:
                    break
            fh.truncate(f.size)
    _hub_call(fetch, repo_id, commit, f"the header of {f.name}")
    if got < n:
        raise HubError(f"{repo_id}: the hub sent {got} bytes of {f.name}'s first {n}; try again later")
    return got


def _header_fits(path: Path, fetched: int) -> bool:
    """True when the gguf reader parses ``path`` with every header byte among the ``fetched``
    first ones (beyond them the sparse file holds zeros, which may parse as something else)."""
    from gguf import GGUFReader
    try:
        r = GGUFReader(path, "r")
    except Exception:  # noqa: BLE001 - zeros past the fetched bytes: not a header yet
        return False
    return r.data_offset <= fetched


def fetch_headers(repo_id: str, commit: str, model: HubGGUF, folder: Path) -> list[Path]:
    """Each part of ``model`` as a sparse file in ``folder`` (its base name) holding the part's
    header; the fetch grows fourfold from HEADER_BYTES until the header fits.

    Raises:
        HubError: network / hub errors. CheckpointError: a part that is not a GGUF file.
    """
    paths = []
    for f in model.files:
        p = folder / f.name.rsplit("/", 1)[-1]
        n = HEADER_BYTES
        while True:
            got = _fetch_prefix(repo_id, commit, f, n, p)
            with open(p, "rb") as fh:
                if fh.read(4) != b"GGUF":
                    raise CheckpointError(f"{repo_id}: {f.name} is not a GGUF file (it does not start with "
                                          f"'GGUF'). Nothing was downloaded.")
            if got >= f.size or _header_fits(p, got):
                break
            n *= 4
        paths.append(p)
    return paths


def check_hub_gguf(repo_id: str, revision: str | None, commit: str, listing: list[RepoFile],
                   want: str | None, context_length: int, dl_dir: Path) -> RepoCheck:
    """check_repo for a repository of GGUF models: the model ``want`` names (choose_gguf), its
    headers fetched and checked as a local GGUF (gguf_check.check_gguf), the download being its
    part(s) only.

    Returns: a RepoCheck with source "hub", quant "gguf", ``files`` the chosen part(s) (present
    bytes counted), ``gguf_file`` its label and ``gguf_choices`` every model's label.
    Raises: ConfigError (no such quant, unsupported architecture or block type, a missing key),
        CheckpointError (not a GGUF), TokenizerError, HubError: as check_gguf and check_repo.
    """
    from .gguf_check import check_gguf
    models = gguf_models(listing)
    model = choose_gguf(repo_id, models, want)
    _sized(repo_id, list(model.files))
    with tempfile.TemporaryDirectory(prefix="colibri-gguf-") as tmp:
        parts = fetch_headers(repo_id, commit, model, Path(tmp))
        try:
            local = check_gguf(parts[0], context_length)
        except (ConfigError, CheckpointError, TokenizerError) as e:  # name the repository's file, not the temporary one
            raise type(e)(str(e).replace(str(parts[0]), f"{repo_id}: {model.files[0].name}")
                          + " Nothing was downloaded.") from None
    files = [dataclasses.replace(f, present_bytes=_local_present(dl_dir, f)) for f in model.files]
    missing = sum(f.size - f.present_bytes for f in files)
    dl_free, st_free, same, disk_ok, disk_msg = _decide_disk(dl_dir, missing, Path(local.store_dir),
                                                             local.store_bytes, "hub")
    chosen = {f.name for f in files}
    return dataclasses.replace(
        local, source="hub", repo_id=repo_id, revision=revision or "main", commit=commit, files=tuple(files),
        ignored_files=tuple(sorted(f.name for f in listing if f.name not in chosen)), download_dir=str(dl_dir),
        download_bytes=sum(f.size for f in files), download_missing=missing, download_free=dl_free,
        store_free=st_free, same_disk=same, disk_ok=disk_ok, disk_message=disk_msg, gguf_file=model.label,
        gguf_choices=tuple(m.label for m in models))


def is_gguf_repo(listing: list[RepoFile]) -> bool:
    """True for a repository with GGUF models and no config.json at its root (a -GGUF repository)."""
    names = {f.name for f in listing}
    return "config.json" not in names and bool(gguf_models(listing))

