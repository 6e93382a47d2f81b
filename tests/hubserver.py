"""A local stand-in for the Hugging Face hub, served to the real huggingface_hub client.

Implements what ``HfApi.model_info(files_metadata=True)``, ``hf_hub_download`` and
engine.library's resumable downloader call (huggingface_hub 2.4):

- ``GET /api/models/{owner}/{name}[/revision/{rev}]?blobs=true`` -> JSON {id, sha, siblings:
  [{rfilename, size, blobId, lfs: {sha256, size, pointerSize}}]}
- ``HEAD|GET /{owner}/{name}/resolve/{rev}/{file}`` with X-Repo-Commit, ETag, X-Linked-Etag and
  X-Linked-Size (LFS files), Content-Length, Accept-Ranges, and ``Range: bytes=N-`` (or
  ``bytes=N-M``) -> 206 with Content-Range. Unknown repo / revision / file -> 404 with the hub's X-Error-Code.

Fault injection: ``drop_after[file] = n`` closes the connection after n body bytes on the next
GET of that file (once); ``slow[file] = (n, seconds)`` sends n bytes at once then the rest in
small pieces with pauses; ``served_override[file] = bytes`` serves other content than the
listed metadata describes; ``listing_override[file] = dict`` changes the listing; ``fail_next[file] = [503, ...]`` answers
the next GETs of that file with these statuses.
Every request is logged in ``requests`` as (method, file-or-path, range start or None); every
finished file body in ``served_log`` as (file, range start, bytes sent).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: list[tuple[str, str, int | None]] = field(default_factory=list)
    bytes_served: Counter = field(default_factory=Counter)
    drop_after: dict[str, int] = field(default_factory=dict)
    slow: dict[str, tuple[int, float]] = field(default_factory=dict)
    served_override: dict[str, bytes] = field(default_factory=dict)
    listing_override: dict[str, dict] = field(default_factory=dict)
    fail_next: dict[str, list[int]] = field(default_factory=dict)
    served_log: list[tuple[str, int | None, int]] = field(default_factory=list)  # (file, range start, bytes)  # file -> HTTP statuses to answer first
    server: ThreadingHTTPServer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    # --- setup -----------------------------------------------------------------------------

    def add_folder(self, repo_id: str, folder: Path, extra: dict[str, bytes] | None = None) -> FakeRepo:
        files = {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
        files.update(extra or {})
        r = FakeRepo(repo_id, files)
        self.repos[repo_id] = r
        return r

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            pass
        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self.url

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()

    # --- queries ---------------------------------------------------------------------------

    def gets(self, name: str) -> list[int | None]:
        """Range starts of the GET requests of file ``name`` (None = no Range)."""
        with self.lock:
            return [r for m, n, r in self.requests if m == "GET" and n == name]

    def weight_requests(self) -> list[tuple[str, str, int | None]]:
        with self.lock:
            return [x for x in self.requests if x[1].endswith(".safetensors")]

    def sibling(self, repo: FakeRepo, name: str) -> dict:
        data = repo.files[name]
        if repo.is_lfs(name):
            ptr = lfs_pointer(data)
            d = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(ptr),
                 "lfs": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(ptr)}}
        else:
            d = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
        d.update(self.listing_override.get(name, {}))
        if d.get("lfs") is None:
            d.pop("lfs", None)
        return d


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.0"

    def log_message(self, *a):  # quiet
        pass

    def _log(self, name: str, start: int | None) -> None:
        with self.hub.lock:
            self.hub.requests.append((self.command, name, start))

    def _error(self, code: int, err: str, msg: str) -> None:
        body = json.dumps({"error": msg}).encode()
        self.send_response(code)
        self.send_header("X-Error-Code", err)
        self.send_header("X-Error-Message", msg)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _repo(self, repo_id: str, rev: str | None) -> FakeRepo | None:
        r = self.hub.repos.get(repo_id)
        if r is None:
            self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
            return None
        if rev not in (None, "main", r.sha):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return r

    def do_GET(self):
        self._serve()

    def do_HEAD(self):
        self._serve()

    def _serve(self):
        path = unquote(urlparse(self.path).path)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            self._log(path, None)
            repo = self._repo(m.group(1), m.group(2))
            if repo is None:
                return
            body = json.dumps({"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha, "private": False,
                               "siblings": [self.hub.sibling(repo, n) for n in repo.files]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            return
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not m:
            self._log(path, None)
            self._error(404, "EntryNotFound", "unknown endpoint")
            return
        repo_id, rev, name = m.groups()
        rng = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        start = int(rng.group(1)) if rng else None
        end = int(rng.group(2)) + 1 if rng and rng.group(2) else None  # a bounded range: bytes=start-last
        self._log(name, start)
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        with self.hub.lock:
            codes = self.hub.fail_next.get(name)
            code = codes.pop(0) if codes and self.command == "GET" else None
        if code is not None:
            self._error(code, "EntryNotFound" if code == 404 else "ServiceUnavailable", "try again later")
            return
        if name not in repo.files:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("X-Repo-Commit", repo.sha)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = self.hub.served_override.get(name, repo.files[name])
        listed = self.hub.sibling(repo, name)
        size = len(data)
        if start is not None and start >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if start or end else 200)
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("Accept-Ranges", "bytes")
        if listed.get("lfs"):
            self.send_header("ETag", f'"{listed["blobId"]}"')
            self.send_header("X-Linked-Etag", f'"{listed["lfs"]["sha256"]}"')
            self.send_header("X-Linked-Size", str(listed["lfs"]["size"]))
        else:
            self.send_header("ETag", f'"{listed["blobId"]}"')
        body = data[start or 0:end]
        if start or end:
            self.send_header("Content-Range", f"bytes {start}-{(start or 0) + len(body) - 1}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if self.command == "HEAD":
            return
        with self.hub.lock:
            drop = self.hub.drop_after.pop(name, None)
            slow = self.hub.slow.get(name)
        sent = 0

        def send(piece: bytes) -> None:
            nonlocal sent
            self.wfile.write(piece)
            self.wfile.flush()
            sent += len(piece)
            with self.hub.lock:
                self.hub.bytes_served[name] += len(piece)
        try:
            if drop is not None:
                send(body[:drop])
                self.close_connection = True
            elif slow is not None:
                first, pause = slow
                send(body[:first])
                for pos in range(first, len(body), 4096):
                    time.sleep(pause)
                    send(body[pos:pos + 4096])
            else:
                send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with self.hub.lock:
                self.hub.served_log.append((name, start, sent))


def hub_env(monkeypatch, tmp_path: Path, url: str) -> None:
    """Point huggingface_hub and colibri at temporary folders and the fake hub."""
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "5")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLIBRI_CONFIG_DIR", str(tmp_path / "config"))


TINY_REPO = "allenai/tiny-olmoe"  # the repo id the tests serve tiny_checkpoint under
_TINY_CACHE: dict[str, Path] = {}


def tiny_checkpoint(root: Path, **cfg) -> Path:
    """engine.bench.synthetic's tiny OLMoE checkpoint (written once per root and config)."""
    from engine.bench import synthetic
    key = json.dumps(cfg, sort_keys=True)
    folder = root / ("tiny-" + hashlib.sha1(key.encode()).hexdigest()[:8])
    if not (folder / "config.json").exists():
        synthetic.write_checkpoint(folder, synthetic.olmoe_config(**cfg), seed=0)
    return folder
