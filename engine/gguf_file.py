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
        CheckpointError: a part that is not a GGUF file, of a GGUF version the reader does not
            read, truncated (inside its header, or tensor data past its end: the bytes expected
            and found), with a damaged header (one line naming the file and what to do).
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
    """gguf.GGUFReader of ``f``, its failures as one CheckpointError line naming the file: not a
    GGUF file, a GGUF version the reader does not read, truncated (inside the header, or tensor
    data past the end: expected and actual bytes), a damaged header."""
    import gguf
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS
    again = "an interrupted or damaged download; download it again"
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(24)  # magic, version, tensor count, metadata count
    except OSError as e:
        raise CheckpointError(f"{f}: cannot be read ({e.strerror or e})") from None
    if size == 0:
        raise CheckpointError(f"{f}: the file is empty (0 bytes): {again}")
    if head[:4] != b"GGUF"[:len(head[:4])]:  # a prefix of the magic: truncated, below
        raise CheckpointError(f"{f}: not a GGUF file (it does not start with 'GGUF'); give a model file "
                              f"from a -GGUF repository, LM Studio or Ollama")
    if len(head) < 24:
        raise CheckpointError(f"{f}: truncated GGUF file: {size} bytes, shorter than the 24 bytes of its "
                              f"fixed header: {again}")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        version = int.from_bytes(head[4:8], "big")
    if version not in READER_SUPPORTED_VERSIONS:
        known = " and ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
        if version == 0 or version > 0xFFFF:
            raise CheckpointError(f"{f}: damaged GGUF header (its version field reads {version}): {again}")
        do = ("download a conversion made by a recent llama.cpp" if version < min(READER_SUPPORTED_VERSIONS)
              else "update the gguf package (pip install -U gguf)")
        raise CheckpointError(f"{f}: GGUF version {version}, which cannot be read (versions {known} can); {do}")

    class _Reader(gguf.GGUFReader):
        # keeps the tensor list parsed from the header, so that data running past the end of the
        # file is reported with the bytes the header asks for
        def _build_tensors(self, start_offs, fields):
            self.tensor_fields = (start_offs, fields)
            return super()._build_tensors(start_offs, fields)

    r = _Reader.__new__(_Reader)
    try:
        r.__init__(f, "r")
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as e:
        damage = _gguf_own(e)
        if not damage and isinstance(e, (ValueError, IndexError)):
            fields = getattr(r, "tensor_fields", None)
            end = _tensors_end(*fields) if fields else None
            if end is not None and end > size:
                raise CheckpointError(f"{f}: truncated GGUF file: {size} bytes, but its tensor data ends at "
                                      f"{end} bytes: {again}") from None
            # the reader's reads ran past the last byte before the tensor list was complete
            raise CheckpointError(f"{f}: truncated GGUF file: it ends at {size} bytes, inside its header "
                                  f"(the metadata and tensor list): {again}") from None
        damage = damage or "a count, length or name that does not parse"
        raise CheckpointError(f"{f}: damaged GGUF header ({damage}): {again}") from None
    ends = [t.data_offset + t.n_bytes for t in r.tensors]
    if ends and max(ends) > size:
        raise CheckpointError(f"{f}: truncated GGUF file: {size} bytes, but its tensor data ends at "
                              f"{max(ends)} bytes: {again}")
    return r


def _gguf_own(e: Exception) -> str:
    """The gguf reader's own word for a damaged header (an unknown value or tensor type, a bad
    alignment, a name twice), or '' for any other failure (numpy's, reading past the end of the file)."""
    msg = str(e)
    for key, say in (("field type", "an unknown metadata value type"),
                     ("GGUFValueType", "an unknown metadata value type"),
                     ("GGMLQuantizationType", "an unknown tensor type"), ("alignment", "a bad general.alignment"),
                     ("uplicate", "a name written twice")):
        if key in msg:
            return say
    return ""


def _tensors_end(start: int, fields) -> int | None:
    """The byte offset where the last tensor's data ends, from the header's tensor list (gguf
    ReaderFields: name length, name, n_dims, dims, ggml type, offset), or None when a field is
    cut short (the list itself runs past the end of the file) or does not parse."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    end = start
    try:
        for fd in fields:
            dims, ggml_type, offset = fd.parts[3], fd.parts[4], fd.parts[5]
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type[0]))]
            n = 1
            for d in dims.tolist():
                n *= int(d)
            end = max(end, start + int(offset[0]) + n * type_size // block)
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return end
