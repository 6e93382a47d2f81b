"""A GGUF model on disk: which files make it (one ``.gguf``, the parts of a split
``NAME-00001-of-0000N.gguf``, or a folder holding one model's files) and its header, metadata
and tensors read with the ``gguf`` package (llama.cpp's own reader), every failure one line
naming the file. engine/gguf_import.py turns it into a store.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import CheckpointError, ConfigError

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def is_gguf_path(path: str | os.PathLike) -> bool:
    """True for a ``.gguf`` file, a file that starts with GGUF's magic (Ollama's blobs have no
    suffix) or a folder holding a .gguf (and no config.json): what ``colibri convert`` hands to
    :func:`convert_gguf`."""
    p = Path(path)
    if p.suffix.lower() == ".gguf" and not p.is_dir():
        return True
    try:
        if p.is_file():
            with open(p, "rb") as f:
                return f.read(4) == b"GGUF"
        return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))
    except OSError:
        return False


def gguf_files(src: str | os.PathLike) -> list[Path]:
    """The file(s) of the GGUF model at ``src``, in part order: the file itself, every part of a
    split model (``-0000K-of-0000N.gguf``; any part may be given), or the one model in a folder
    (projector files ``mmproj*.gguf`` left out).

    Raises:
        CheckpointError: missing file, a part of a split missing, a folder with no GGUF or with
            several models (naming them: give the file).
    """
    p = Path(src)
    if p.is_dir():
        found = sorted(x for x in p.glob("*.gguf") if x.is_file() and not x.name.lower().startswith("mmproj"))
        if not found:
            raise CheckpointError(f"{p}: holds no .gguf file; give a GGUF file or a folder holding one")
        models = {SPLIT_RE.match(x.name).group("stem") if SPLIT_RE.match(x.name) else x.name for x in found}
        if len(models) > 1:
            names = ", ".join(sorted(models)[:4]) + (", ..." if len(models) > 4 else "")
            raise CheckpointError(f"{p}: holds {len(models)} GGUF models ({names}); give the file of the one "
                                  f"to import")
        p = found[0]
    if not p.is_file():
        raise CheckpointError(f"{p}: no such file; give a .gguf file or a folder holding one")
    m = SPLIT_RE.match(p.name)
    if m is None:
        return [p]
    count = int(m.group("count"))
    parts = [p.with_name(f"{m.group('stem')}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]
    missing = [x.name for x in parts if not x.is_file()]
    if missing:
        raise CheckpointError(f"{p}: part of a model split in {count} files, but {missing[0]}"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} is missing "
                              f"beside it; download every part into the same folder")
    return parts


class GGUFModel:
    """One GGUF model opened (every part of a split), metadata and tensors indexed.

    Attributes:
        files: its part files. kv: metadata key -> Python value. arch: general.architecture.
        tensors: GGUF name -> gguf ReaderTensor (``data`` a read-only memory map).

    Raises (constructor):
        CheckpointError: a part that is not a GGUF file, a truncated header, tensor data shorter
            than the header says (one line naming the file and what to do).
    """

    def __init__(self, src: str | os.PathLike):
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise CheckpointError("reading GGUF files needs the 'gguf' package: pip install gguf") from None
        self.files = gguf_files(src)
        self.kv: dict = {}
        self.tensors: dict = {}
        self._readers = []
        for i, f in enumerate(self.files):
            r = _open_reader(f)
            self._readers.append(r)
            for name, field in r.fields.items():
                if i == 0 or name not in self.kv:
                    try:
                        self.kv[name] = field.contents()
                    except Exception:  # noqa: BLE001 - a value gguf cannot decode: absent, as if not written
                        continue
            for t in r.tensors:
                if t.name in self.tensors:
                    raise CheckpointError(f"{f}: tensor {t.name} is also in {self.files[0].name}; the parts "
                                          f"belong to different models - download the model again")
                self.tensors[t.name] = t
        self.arch = self.kv.get("general.architecture")
        if not isinstance(self.arch, str):
            raise CheckpointError(f"{self.files[0]}: no general.architecture in its metadata; not a model file "
                                  f"(a vocabulary- or adapter-only GGUF?)")

    @property
    def name(self) -> str:
        """The file's name without .gguf and split suffix; for a content-addressed blob (Ollama's
        ``sha256-<hex>``) the metadata's ``general.name`` when it has one."""
        m = SPLIT_RE.match(self.files[0].name)
        stem = m.group("stem") if m else self.files[0].stem
        meta = self.kv.get("general.name")
        if re.fullmatch(r"sha256-[0-9a-f]{64}", stem) and isinstance(meta, str) and meta.strip():
            return re.sub(r"[^\w.+-]+", "-", meta.strip()).strip("-") or stem
        return stem

    def close(self) -> None:
        """Drop the memory maps (the files stay as they are)."""
        # numpy closes a memory map when its last array goes; the readers and the tensor views
        # dropped here are those arrays
        self._readers, self.tensors = [], {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def key(self, name: str, kinds=(int,), optional: bool = False, default=None):
        """Metadata ``<arch>.name`` (or ``name`` itself when it has a dot prefix like
        ``general.``/``tokenizer.``) as a value of one of ``kinds``.

        Raises:
            ConfigError: the key is missing (unless ``optional``) or of another type, naming it.
        """
        full = name if name.startswith(("general.", "tokenizer.", "split.")) else f"{self.arch}.{name}"
        v = self.kv.get(full)
        if v is None:
            if optional:
                return default
            raise ConfigError(f"{self.files[0]}: the GGUF metadata has no {full}; this file cannot be imported "
                              f"(a damaged or unusual conversion - try another download of the model)")
        if float in kinds and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, tuple(kinds)) or isinstance(v, bool) and bool not in kinds:
            raise ConfigError(f"{self.files[0]}: GGUF metadata {full} = {v!r} is not a "
                              f"{'/'.join(k.__name__ for k in kinds)}")
        return v

    def tensor(self, name: str):
        """The ReaderTensor ``name``. Raises CheckpointError naming it when the file lacks it."""
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.files[0]}: has no tensor {name}, which a {self.arch} model needs; "
                                  f"the file is incomplete or of another layout - download it again")
        return t


def _open_reader(f: Path):
    """gguf.GGUFReader of ``f``, its failures as one CheckpointError line naming the file."""
    from gguf import GGUFReader
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise CheckpointError(f"{f}: cannot be read ({e.strerror or e})") from None
    if magic != b"GGUF":
        raise CheckpointError(f"{f}: not a GGUF file (it does not start with 'GGUF'); give a model file "
                              f"from a -GGUF repository, LM Studio or Ollama")
    try:
        r = GGUFReader(f, "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as e:
        if "reshape" in str(e) or "cannot" in str(e) and "size" in str(e):
            raise CheckpointError(f"{f}: the tensor data is short (the file ends at {size} bytes, before the "
                                  f"data its header lists): an interrupted download; download it again") from None
        raise CheckpointError(f"{f}: truncated or damaged GGUF header ({type(e).__name__}: {e}); download it "
                              f"again") from None
    ends = [t.data_offset + t.n_bytes for t in r.tensors]
    if ends and max(ends) > size:
        raise CheckpointError(f"{f}: the tensor data is short (the file is {size} bytes, its tensors end at "
                              f"{max(ends)}): an interrupted download; download it again")
    return r
