"""The on-SSD expert store: manifest, dense weights, and one-read-per-expert slab access.

Reads use ``os.preadv`` of one whole 4096-aligned slab into a caller-owned, 4096-aligned
buffer. Uncached reads (bypassing the page cache, so the RAM budget is real: O_DIRECT on Linux,
F_NOCACHE on macOS, FILE_FLAG_NO_BUFFERING on Windows; engine.platform_io) are used where the
platform and filesystem accept them; otherwise buffered reads, with one log line.

Checksums: store version 2 records an XXH3-64 per slab, version 1 a zlib CRC-32 (both still
open; ``checksum_kind`` says which). ``read(..., verify=True)`` verifies in the calling thread:
the expert cache calls it from its reader threads only, never from the compute thread.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from .config import ModelArgs
from .errors import ExpertReadError, StoreError, StoreUnreadable
from .mtp import store_args
from .platform_io import open_for_reads, positional_reader, preadv
from .quant import ALIGN, QUANTS, aligned_empty, huge_empty, slab_layout, slab_views
from .store_format import CHECKSUM_OF_VERSION, EXPERT_LAYOUTS, FORMAT_NAME, FORMAT_VERSION, READ_VERSIONS, check_store_files, slab_checksum

log = logging.getLogger(__name__)


def _denied() -> str:
    """What to say about a store file this user may not read."""
    try:
        import getpass
        who = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (container without passwd entry)
        who = f"uid {os.getuid()}" if hasattr(os, "getuid") else "this user"
    return (f"permission denied: {who} cannot read this store file. Ask the store's owner to make "
            f"it readable (chmod -R a+rX on the store folder) or convert your own copy with "
            f"`colibri convert`")


def read_manifest(path: str | os.PathLike) -> tuple[dict, ModelArgs, str]:
    """Read and check a store's manifest.json against its config.json, and check that every
    file the manifest names is there with its size (store_format.check_store_files: the
    expert files, the dense file and its safetensors header). Reads no expert slab.

    Returns: (manifest dict, ModelArgs of config.json, checksum kind "crc32" / "xxh3_64").
    Raises:
        StoreError: a missing, unreadable, half-written or damaged manifest, an unknown format
            or version, a table that disagrees with config.json, a missing or short file;
            the message names the file and says to re-convert.
        ConfigError: config.json is missing or invalid (message names it).
    """
    path = Path(path)
    mpath = path / "manifest.json"
    if path.name.endswith(".partial"):
        raise StoreError(f"{path}: is an unfinished conversion; run `colibri convert` again")
    try:
        m = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        hint = (f"it looks like a Hugging Face checkpoint: convert it first, e.g. "
                f"`colibri convert {path} {path.name}-int8`"
                if (path / "config.json").exists() and not (path / "dense.safetensors").exists() else
                "`colibri models` lists your converted stores; make a new one with "
                "`colibri convert HF_FOLDER NEW_STORE_FOLDER`")
        raise StoreError(f"{mpath}: not found; {path} is not a converted store ({hint})") from None
    except PermissionError:
        raise StoreUnreadable(f"{mpath}: {_denied()}") from None
    except IsADirectoryError:
        raise StoreError(f"{mpath}: is a folder, not the store's manifest file; re-run `colibri convert`") from None
    except NotADirectoryError:  # a file given as the store (or a file on its path)
        what = (f"a GGUF model: import it first with `colibri convert {path} {path.stem}-gguf` (the file is "
                f"only read), then give that store" if path.suffix.lower() == ".gguf" else
                "a converted model is the folder holding manifest.json; `colibri models` lists yours")
        raise StoreError(f"{path}: is a file, not a folder ({what})") from None
    except OSError as e:  # an I/O error: not known to be broken
        raise StoreUnreadable(f"{mpath}: cannot be read now ({type(e).__name__}: {e}); check the disk, "
                              f"then try again") from None
    except ValueError as e:
        raise StoreError(f"{mpath}: unreadable or half-written ({type(e).__name__}: {e}); re-run "
                         f"`colibri convert --overwrite`") from None
    if not isinstance(m, dict):
        raise StoreError(f"{mpath}: not a store manifest (a JSON object is expected); re-run `colibri convert`")
    if m.get("format") != FORMAT_NAME:
        raise StoreError(f"{mpath}: format {m.get('format')!r} is not {FORMAT_NAME!r}; re-run `colibri convert`")
    if type(m.get("version")) is not int or m["version"] not in READ_VERSIONS:
        raise StoreError(f"{mpath}: store version {m.get('version')!r}, this engine reads versions "
                         f"{', '.join(map(str, READ_VERSIONS))} (it writes {FORMAT_VERSION}); re-run "
                         f"`colibri convert --overwrite` with this engine")
    # the checksum each expert entry carries: the manifest says; version 1 wrote "crc32"
    ck = m.get("checksum") or CHECKSUM_OF_VERSION[m["version"]]
    a = store_args(ModelArgs.from_hf_config(path / "config.json"), m, mpath)  # kept MTP heads: engine/mtp.py
    M = a.num_moe_layers
    # Stores written before families existed have no "moe_layers": every layer was MoE.
    moe_layers = m.get("moe_layers", None)
    if moe_layers is None:
        moe_layers = list(range(m["num_layers"])) if type(m.get("num_layers")) is int else None
    if not isinstance(moe_layers, list) or m.get("model_type", a.model_type) != a.model_type or \
            (m.get("num_layers"), m.get("num_experts")) != (M, a.num_experts) or \
            list(moe_layers) != list(a.moe_layers) or not isinstance(m.get("experts"), list) or len(m["experts"]) != M or \
            any(not isinstance(row, list) or len(row) != a.num_experts for row in m["experts"]):
        raise StoreError(f"{mpath}: expert table does not match config.json ({a.model_type}: "
                         f"{M} MoE layers x {a.num_experts} experts); re-convert")
    _check_manifest(mpath, m, a, ck)
    check_store_files(path, m)
    return m, a, ck


def _check_manifest(mpath: Path, m: dict, a: ModelArgs, ck: str) -> None:
    """Types and ranges of every manifest field the engine uses (a damaged manifest is a
    StoreError naming it, never a KeyError or TypeError later)."""
    try:
        ok_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        if ck not in CHECKSUM_OF_VERSION.values():
            raise ValueError(f"checksum {ck!r}")
        if m["quant"] not in QUANTS + ("gguf",) or m["dense_quant"] not in QUANTS:
            raise ValueError(f"quant {m['quant']!r} / dense_quant {m['dense_quant']!r}")
        gs = m.get("group_size")
        if gs is not None and not (ok_int(gs) and gs > 0 and gs % 2 == 0):
            raise ValueError(f"group_size {gs!r}")
        lay = m["slab_layout"]
        el = m.get("expert_layout", "row_major")
        if el not in EXPERT_LAYOUTS or (el != "row_major" and m["quant"] != "int4"):
            raise ValueError(f"expert_layout {el!r}")
        if el != "row_major" and m["version"] < 4:
            raise ValueError(f"expert_layout {el!r} in a store of version {m['version']} (layouts came with 4)")
        if m["quant"] == "gguf":  # GGUF blocks as published (engine.gguf_blocks)
            from .gguf_blocks import gguf_slab_layout
            want = gguf_slab_layout(a.hidden_size, a.moe_intermediate_size, m["gguf"]["row_bytes"], bias=a.expert_bias)
        else:
            want = slab_layout(m["quant"], a.hidden_size, a.moe_intermediate_size, gs or 32, bias=a.expert_bias,
                               f32_int4_scales=m.get("version", FORMAT_VERSION) < 3,
                               interleaved=el == "interleaved_4")
        got = {"fields": lay["fields"], "data_bytes": lay["data_bytes"], "slot_bytes": lay["slot_bytes"]}
        if got != json.loads(json.dumps(want)):
            raise ValueError("slab_layout does not match config.json and the quantization")
        sb = m["slot_bytes"]
        if not isinstance(sb, list) or len(sb) != a.num_moe_layers or any(v != want["slot_bytes"] for v in sb):
            raise ValueError("slot_bytes per layer")
        if not isinstance(m["dense_file"], str):
            raise ValueError("dense_file")
        for row in m["experts"]:
            for e in row:
                if not (isinstance(e["file"], str) and ok_int(e["offset"]) and e["offset"] >= 0
                        and e["offset"] % ALIGN == 0 and e["length"] == want["slot_bytes"]
                        and ok_int(e[ck])):
                    raise ValueError(f"expert entry {e!r}")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise StoreError(f"{mpath}: damaged ({type(e).__name__}: {e}); re-run `colibri convert --overwrite`") from None


def store_problem(path: str | os.PathLike) -> str | None:
    """None when the store at ``path`` passes :func:`read_manifest`'s checks, else the reason
    (one sentence naming the file, from the StoreError / ConfigError). The one validation
    ``colibri models``, ``colibri doctor`` and the app's model library show. Never raises for
    a broken store (I/O errors become the reason too)."""
    from .errors import EngineError
    try:
        read_manifest(path)
    except (EngineError, OSError) as e:
        return str(e)
    return None


class ExpertStore:
    """An opened store folder.

    Attributes:
        path, manifest (dict), args (ModelArgs), quant ("int8"/"int4"/"f16"/"f32"),
        dense_quant, group_size, expert_layout ("row_major" / "interleaved_4", store format 4),
        layout (slab layout dict), slot_bytes (bytes per expert slab),
        o_direct (bool: whether reads really bypass the page cache).

    Raises (constructor):
        StoreError: missing/unknown manifest, version, or dimensions that disagree with
            config.json; the message says to re-run ``colibri convert``.
    """

    def __init__(self, path: str | os.PathLike, o_direct: bool = True):
        self.path = Path(path)
        m, self.args, self.checksum_kind = read_manifest(self.path)
        self.manifest = m
        a = self.args
        M = a.num_moe_layers
        self.quant = m["quant"]
        self.dense_quant = m["dense_quant"]
        self.group_size = m.get("group_size") or 32
        self.expert_layout = m.get("expert_layout", "row_major")  # store format 4: or "interleaved_4"
        lay = m["slab_layout"]
        self.layout = {"fields": [tuple(f) for f in lay["fields"]], "data_bytes": lay["data_bytes"],
                       "slot_bytes": lay["slot_bytes"]}
        self.slot_bytes = int(lay["slot_bytes"])
        self.experts = m["experts"]
        self._verified = np.zeros((M, a.num_experts), dtype=bool)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._preadv = positional_reader()  # the one read call of the hot path (tests inject faults here)
        self.o_direct = False
        self._open_files(o_direct)

    # --- files --------------------------------------------------------------------------

    def _open_files(self, want_direct: bool) -> None:
        """Open every expert file, uncached (engine.platform_io: O_DIRECT, F_NOCACHE or
        FILE_FLAG_NO_BUFFERING) when ``want_direct`` and every file allows it, else all buffered."""
        files = sorted({e["file"] for row in self.experts for e in row})
        direct_ok = want_direct
        for rel in files:
            p = self.path / rel
            if not p.exists():
                self.close()
                raise StoreError(f"{p}: expert file missing from the store; re-run `colibri convert`")
            if not os.access(p, os.R_OK):
                self.close()
                raise StoreUnreadable(f"{p}: {_denied()}")
            try:
                f = open_for_reads(p, uncached=direct_ok)
                if direct_ok and not f.uncached:
                    # one mode for the whole store: reopen the files opened uncached so far
                    direct_ok = False
                    log.info("uncached reads not available on %s (%s); using buffered reads", p, f.reason)
                    for r, fd in list(self._fds.items()):
                        os.close(fd)
                        self._fds[r] = open_for_reads(self.path / r, uncached=False).fd
            except PermissionError:
                self.close()
                raise StoreUnreadable(f"{p}: {_denied()}") from None
            except OSError as e:
                self.close()
                raise StoreUnreadable(f"{p}: cannot be opened ({e}); check the disk or re-convert the store") from None
            self._fds[rel] = f.fd
        self.o_direct = direct_ok

    def close(self) -> None:
        """Close every file. Idempotent."""
        with self._lock:
            for fd in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()

    @property
    def open_files(self) -> int:
        return len(self._fds)

    # --- dense ----------------------------------------------------------------------------

    def load_dense(self, exclude: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        """All dense tensors but ``exclude`` as in-RAM numpy arrays (canonical names, see
        convert.py; the engine leaves out EMBED_TENSORS, read by :meth:`embedding_rows`), read with
        pread into fresh arrays rather than copied out of a whole-file mmap: mapped pages count
        in RSS, so an mmap copy peaked at twice the dense bytes while the model opened (a
        DeepSeek-V3-shaped store with 3.2 GB of dense weights peaked at 6.5 GB RSS under a 4 GB
        budget); now the peak is the dense bytes plus one read chunk.

        Raises:
            StoreError: dense.safetensors is missing, truncated or lacks a tensor.
        """
        p = self.path / self.manifest["dense_file"]
        try:
            with open(p, "rb"):  # the real errno: safetensors reports EACCES as "No such file"
                pass
            with safe_open(str(p), framework="numpy") as f:  # validates the header and offsets
                names = [k for k in f.keys() if k not in exclude]
            return _pread_safetensors(p, names)
        except PermissionError:
            raise StoreUnreadable(f"{p}: {_denied()}") from None
        except OSError as e:
            if not isinstance(e, FileNotFoundError):  # an I/O error: not known to be broken
                raise StoreUnreadable(f"{p}: cannot read the dense weights now ({e}); check the disk, then "
                                      f"try again") from None
            raise StoreError(f"{p}: cannot read the dense weights ({e}); re-run `colibri convert`") from None
        except (SafetensorError, ValueError, TypeError) as e:
            raise StoreError(f"{p}: cannot read the dense weights ({e}); re-run `colibri convert`") from None

    def embedding_rows(self) -> "EmbeddingRows":
        """The token-embedding table (EMBED_TENSORS) left in the dense file and read row by row
        when a forward needs it (:class:`EmbeddingRows`); its file stays open until
        :meth:`close`.

        Raises:
            StoreError: the dense file is missing or lacks ``embed_tokens.w``.
        """
        p = self.path / self.manifest["dense_file"]
        key = f"{self.manifest['dense_file']}#embed_tokens"
        with self._lock:
            fd = self._fds.get(key)  # a second call shares the first one's descriptor
        fresh = fd is None
        if fresh:
            try:
                fd = open_for_reads(p, uncached=False).fd
            except PermissionError:
                raise StoreUnreadable(f"{p}: {_denied()}") from None
            except OSError as e:
                raise StoreUnreadable(f"{p}: cannot be opened ({e}); check the disk or re-convert the store") from None
        try:
            header, base = _safetensors_header(fd)
            rows = EmbeddingRows(p, self._embed_fd_of(key), header, base)
        except (OSError, ValueError, KeyError) as e:
            if fresh:
                os.close(fd)
            raise StoreError(f"{p}: cannot read the embedding table ({type(e).__name__}: {e}); "
                             f"re-run `colibri convert`") from None
        if fresh:
            with self._lock:
                self._fds[key] = fd  # closed with the store
        return rows

    def _embed_fd_of(self, key: str):
        """The descriptor lookup EmbeddingRows reads through: the open descriptor under ``key``,
        or None once the store is closed (a number kept past close() could name another file)."""
        def fd() -> int | None:
            with self._lock:
                return self._fds.get(key)
        return fd

    # --- experts --------------------------------------------------------------------------

    def new_buffer(self, n_slots: int = 1) -> np.ndarray:
        """One aligned uint8 arena of n_slots x slot_bytes."""
        return aligned_empty(n_slots * self.slot_bytes)

    def read(self, layer: int, expert: int, buf: np.ndarray, verify: bool = False) -> int:
        """Read expert (layer, expert)'s slab into ``buf`` (uint8, slot_bytes, 4096-aligned)
        with one positional read; retry once on failure.

        ``verify``: also check the slab against the manifest's checksum (``checksum_kind``) in
        this thread (the expert cache's reader threads call it; XXH3 costs ~0.25 ms per 6.3 MB).

        Returns: bytes read.
        Raises:
            ExpertReadError: the read failed twice, was short, or the checksum did not match
                (the message names the file, the expert and the layer).
        """
        meta = self.experts[layer][expert]
        n = int(meta["length"])
        last = None
        for _attempt in range(2):
            try:
                fd = self._fds[meta["file"]]
                got = self._preadv(fd, [buf[:n]], int(meta["offset"]))
                if got != n:
                    raise OSError(f"short read: {got} of {n} bytes")
                if verify:
                    self._verify(layer, expert, buf)
                return n
            except ExpertReadError:
                raise
            except (OSError, KeyError) as e:
                last = e
        raise ExpertReadError(f"{self.path / meta['file']}: reading expert {expert} of layer {layer} "
                              f"failed twice ({last}); check the disk or re-convert the store")

    def _verify(self, layer: int, expert: int, buf: np.ndarray) -> None:
        """Raise ExpertReadError (naming the file, expert and layer) when ``buf`` does not hold
        the slab the manifest's checksum describes."""
        meta = self.experts[layer][expert]
        if slab_checksum(self.checksum_kind, buf[:int(meta["length"])]) != meta[self.checksum_kind]:
            raise ExpertReadError(
                f"{self.path / meta['file']}: expert {expert} of layer {layer} fails its "
                f"{self.checksum_kind} checksum; the store is corrupt - re-run `colibri convert --overwrite`")

    def read_run(self, layer: int, experts, bufs, verify) -> list[tuple[int, Exception | None]]:
        """Read the slabs of ``experts`` (ints, ascending: file order) of ``layer`` into ``bufs``
        (one slot_bytes, 4096-aligned uint8 buffer each), the experts that lie back to back in
        one file with one positional read of many buffers (``preadv``), so a sequential pass
        over the store reads at the disk's sequential rate instead of one slab per call.
        ``verify``: one bool per expert, as :meth:`read`'s. A group read that fails or comes
        back short is read again one slab at a time (:meth:`read`: retried once, named).

        Returns: one (bytes read, None) or (0, ExpertReadError) per expert, in order."""
        out: list[tuple[int, Exception | None]] = []
        rows = self.experts[layer]
        i = 0
        while i < len(experts):
            m0 = rows[experts[i]]
            end, j = int(m0["offset"]) + int(m0["length"]), i + 1
            while j < len(experts):
                m = rows[experts[j]]
                if m["file"] != m0["file"] or int(m["offset"]) != end:
                    break
                end += int(m["length"])
                j += 1
            group = None
            if j - i > 1:
                try:
                    parts = [bufs[k][:int(rows[experts[k]]["length"])] for k in range(i, j)]
                    if self._preadv(self._fds[m0["file"]], parts, int(m0["offset"])) == end - int(m0["offset"]):
                        group = []
                        for k, part in zip(range(i, j), parts):
                            try:
                                if verify[k]:
                                    self._verify(layer, int(experts[k]), bufs[k])
                                group.append((part.nbytes, None))
                            except ExpertReadError as e:
                                group.append((0, e))
                except (OSError, KeyError):
                    group = None
            if group is None:
                group = []
                for k in range(i, j):
                    try:
                        group.append((self.read(layer, int(experts[k]), bufs[k], verify=bool(verify[k])), None))
                    except ExpertReadError as e:
                        group.append((0, e))
            out.extend(group)
            i = j
        return out

    def views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        return slab_views(buf, self.layout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


EMBED_TENSORS = ("embed_tokens.w", "embed_tokens.s")
EMBED_ROWS_KEPT_BYTES = 4 << 20  # the recently embedded rows EmbeddingRows keeps in RAM


class EmbeddingRows:
    """A store's token-embedding table read row by row from its dense file (one positional read
    of each distinct id's row and scale row, engine.platform_io) when a forward embeds tokens, never held in RAM
    whole (the rows of recently embedded ids are kept, EMBED_ROWS_KEPT_BYTES of them): a decode
    step reads one row of D values (2 KB at int8 for D = 2048), and the RAM the V x D table
    took goes to the expert cache (OLMoE-1B-7B: 103 MB, ~29 int4 experts; DeepSeek-V3: 0.9 GB
    at int8). llama.cpp likewise leaves token_embd in its mmap'd file. The rows come back
    bit-identical, so the embedding's values do not change.

    Args:
        path: the dense file (for messages). fd: a function giving an open descriptor of it,
            or None once the store that owns it is closed. header: its safetensors header
            (dict); base: the byte where its data starts (8 + header length).
    Attributes:
        w, s: zero-row arrays with the table's dtype and row shape (``s`` None when the table
            is not quantized): what engine.quant.kind_of reads. num_rows: V. nbytes: the
            table's bytes in the file.
    Raises:
        KeyError: the header has no ``embed_tokens.w``. ValueError: a dtype no store holds, or
            a tensor whose byte span does not match its shape.
    """

    def __init__(self, path: Path, fd, header: dict, base: int):
        self.path, self._fd = Path(path), fd
        self._read = positional_reader()
        self.parts = []  # (name, dtype, row shape, byte offset of row 0, bytes per row)
        for name in EMBED_TENSORS:
            v = header.get(name)
            if v is None:
                if name == EMBED_TENSORS[0]:
                    raise KeyError(name)
                continue
            if v["dtype"] not in _ST_DTYPES:
                raise ValueError(f"tensor {name!r} has dtype {v['dtype']}, which a colibri store never holds")
            dt = np.dtype(_ST_DTYPES[v["dtype"]])
            shape = tuple(int(d) for d in v["shape"])
            s0, e0 = v["data_offsets"]
            row = int(np.prod(shape[1:], dtype=np.int64)) * dt.itemsize
            if row * shape[0] != e0 - s0:
                raise ValueError(f"tensor {name!r}: {e0 - s0} bytes for shape {list(shape)} {v['dtype']}")
            self.parts.append((name, dt, shape[1:], base + int(s0), row))
        self.num_rows = int(header[EMBED_TENSORS[0]]["shape"][0])
        empty = [np.empty((0,) + shape, dt) for _n, dt, shape, _o, _r in self.parts]
        self.w = empty[0]
        self.s = empty[1] if len(empty) > 1 else None
        self.nbytes = sum(r * self.num_rows for *_x, r in self.parts)
        # the rows of recently embedded ids (id -> one row per part), least recent first: a
        # decode step embeds one token, and reading its row from the disk each step cost ~2 ms
        # of a ~30 ms token (two reads at the disk's latency; the dense file's pages are not cached)
        self._recent: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._recent_max = max(1, EMBED_ROWS_KEPT_BYTES // max(1, sum(r for *_x, r in self.parts)))
        self._recent_lock = threading.Lock()

    def will_need(self) -> bool:
        """Ask the OS to read the whole table into its page cache in the background
        (POSIX_FADV_WILLNEED; no RSS of ours, given back under memory pressure), for a store
        that fits the RAM budget: a decode step then finds its row in memory instead of at the
        disk's latency (two reads of ~0.35 ms each per new id, OLMoE-1B-7B, this VM, of a ~25 ms
        token), as llama.cpp finds token_embd in its mapped file. Returns whether it was asked
        (False where the platform has no posix_fadvise or the store is closed)."""
        fd = self._fd()
        if fd is None or not hasattr(os, "posix_fadvise"):
            return False
        try:
            for _n, _dt, _shape, off, row in self.parts:
                os.posix_fadvise(fd, off, row * self.num_rows, os.POSIX_FADV_WILLNEED)
        except OSError:
            return False
        return True

    def rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(local int64 [T], w, s): the rows of the distinct ids among ``ids`` (int [T]), in
        ascending id order, and each id's index among them, so that ``table[ids] ==
        w[local]`` (and the scales likewise).

        Raises:
            ValueError: an id outside 0..V-1 (named). StoreError: a read failed or was short.
        """
        ids = np.asarray(ids, np.int64)
        uniq, local = np.unique(ids, return_inverse=True)
        if uniq.size and (uniq[0] < 0 or uniq[-1] >= self.num_rows):
            bad = int(uniq[0] if uniq[0] < 0 else uniq[-1])
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{self.num_rows - 1})")
        fd = self._fd()
        if fd is None:
            raise StoreError(f"{self.path}: the store is closed; open the model again")
        out = [np.empty((uniq.size,) + shape, dt) for _n, dt, shape, _o, _r in self.parts]
        flats = [arr.reshape(uniq.size, -1).view(np.uint8) for arr in out]
        for i, t in enumerate(uniq.tolist()):
            with self._recent_lock:
                kept = self._recent.get(t)
                if kept is not None:
                    self._recent.move_to_end(t)
            if kept is not None:
                for flat, r in zip(flats, kept):
                    flat[i] = r
                continue
            for flat, (name, _dt, _shape, off, row) in zip(flats, self.parts):
                try:
                    got = self._read(fd, [flat[i]], off + t * row)
                except OSError as e:
                    raise StoreUnreadable(f"{self.path}: reading row {t} of {name} failed ({e}); check the disk") from None
                if got != row:
                    raise StoreError(f"{self.path}: short read of row {t} of {name} ({got} of {row} bytes); "
                                     f"the file is truncated - re-run `colibri convert`")
            with self._recent_lock:
                self._recent[t] = [flat[i].copy() for flat in flats]
                while len(self._recent) > self._recent_max:
                    self._recent.popitem(last=False)
        return local.reshape(ids.shape), out[0], out[1] if len(out) > 1 else None


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "U8": np.uint8, "I32": np.int32,
              "I64": np.int64, "F64": np.float64, "I16": np.int16, "U16": np.uint16, "BOOL": np.bool_}


def _safetensors_header(fd: int) -> tuple[dict, int]:
    """(header dict, byte where the data starts) of the safetensors file open as ``fd``: an
    8-byte little-endian length, then that many bytes of JSON (engine.platform_io's positional
    reads). Raises ValueError for a short file or a header that is not JSON."""
    head = np.empty(8, np.uint8)
    if preadv(fd, [head], 0) != 8:
        raise ValueError("no safetensors header")
    n = int(head.view("<u8")[0])
    raw = np.empty(n, np.uint8)
    if preadv(fd, [raw], 8) != n:
        raise ValueError("truncated safetensors header")
    return json.loads(raw.tobytes()), 8 + n


def _pread_safetensors(path: Path, names: list[str], chunk: int = 64 << 20) -> dict[str, np.ndarray]:
    """Tensors ``names`` of the safetensors file ``path`` (header already validated by
    ``safe_open``) read with positional reads (engine.platform_io) into new arrays, ``chunk`` bytes per call, and the
    file's page cache dropped behind each tensor (``posix_fadvise DONTNEED``) so the open does not
    also fill the cgroup's page cache with the dense bytes. Layout: the safetensors format
    (8-byte little-endian header length, JSON header, data; offsets relative to the data).

    Raises:
        ValueError: a dtype this store format never writes, or a short read (truncated file).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        header, base = _safetensors_header(fd)
        out = {}
        for k in names:
            v = header[k]
            if v["dtype"] not in _ST_DTYPES:
                raise ValueError(f"tensor {k!r} has dtype {v['dtype']}, which a colibri store never holds")
            s, e = v["data_offsets"]
            arr = huge_empty(v["shape"], _ST_DTYPES[v["dtype"]])  # streamed every token: huge pages
            flat = arr.reshape(-1).view(np.uint8)
            if flat.size != e - s:
                raise ValueError(f"tensor {k!r}: {e - s} bytes for shape {v['shape']} {v['dtype']}")
            done = 0
            while done < flat.size:
                got = preadv(fd, [flat[done:done + chunk]], base + s + done)
                if got <= 0:
                    raise ValueError(f"tensor {k!r}: short read at byte {base + s + done} (truncated file)")
                done += got
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, base + s, e - s, os.POSIX_FADV_DONTNEED)
            out[k] = arr
        return out
    finally:
        os.close(fd)
