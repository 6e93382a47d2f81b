"""Resumable, verified downloads of the files a conversion needs (no Qt here). Sizes are bytes,
times seconds.

Design (huggingface_hub 2.4): ``hf_hub_download`` writes every file to a process-unique
``*.incomplete`` temporary file and deletes it when the download fails or is interrupted
(huggingface_hub PR #4228), so it only resumes *within* one call (its automatic retries); a
cancel, a crash or a lost connection that outlasts the retries loses the bytes. Model weights
are many GB, so the weight files are fetched here with the hub's own HTTP session and
``Range`` requests into ``DEST/.colibri-download/<file>.<id>.part``, which survives anything
and is resumed from its size on the next call. Each file is checked against the hub's size
and sha256 (LFS files) or git blob id (small files) before it is moved into place.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from ..checkpoint import is_lfs_pointer
from ..errors import Cancelled, CheckpointError
from ..events import LoadProgress
from ..fsutil import atomic_write_text, fsync_dir
from ..units import format_bytes, format_duration
from .check import (DISK_MARGIN_BYTES, PARTIAL_DIR, RepoCheck, RepoFile, _endpoint, _file_id, _hub_error, _part_path,
                    _repo_files)
from .errors import DiskSpaceError, HubError, VerificationError
from .paths import download_dir_for, downloads_dir, free_space

_CHUNK = 1 << 20


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
    atomic_write_text(_verified_path(dest), json.dumps(d, indent=1))


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
                raise Cancelled("download cancelled while checking the files already present")
            h.update(b)
    if h.ok():
        _mark_verified(dest, f)
        return True
    return False


class UnreadableWeightFile(CheckpointError):
    """The weight file could not be read now (permissions, an I/O error): it is not known to
    be broken, so it is never deleted for this."""


def check_weight_file(path: str | os.PathLike) -> None:
    """Refuse a Git LFS pointer or a truncated/corrupt safetensors file.

    Raises:
        CheckpointError: naming the file and what to do (UnreadableWeightFile when the file
            could not be read, which says nothing about its content).
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
        except SafetensorError as e:
            raise CheckpointError(f"{path.name}: not a complete safetensors file ({e}); it is truncated or "
                                  f"corrupt - delete it and download the model again") from None
        except OSError as e:
            raise UnreadableWeightFile(f"{path.name}: could not be read ({e.strerror or e}); check the file's "
                                       f"permissions and the disk, then try again") from None


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
                    raise Cancelled(f"download of {f.name} cancelled; run it again to resume")
                hasher.update(b)
                left -= len(b)
    failures = 0
    while have < f.size:
        if cancel.is_set():
            raise Cancelled(f"download of {f.name} cancelled at {format_bytes(have)} of "
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
                            raise Cancelled(
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
        cancel: set it to stop (within one network chunk); raises Cancelled.
        retries: connection failures in a row tolerated per file (with backoff).
    Returns: ``dest``.
    Raises:
        Cancelled; DiskSpaceError (before fetching); VerificationError (file named,
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
    atomic_write_text(dest / PARTIAL_DIR / "source.json",
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
        final.parent.mkdir(parents=True, exist_ok=True)  # a -GGUF repository's quant folders
        os.replace(part, final)
        fsync_dir(dest)
        if f.name.endswith(".safetensors"):
            try:
                check_weight_file(final)
            except UnreadableWeightFile:  # not known to be broken: the verified bytes are kept
                raise
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
