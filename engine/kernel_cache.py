"""Pre-built compute kernels: numba's cache of the kernels, built for each fixed CPU target
(engine.kernel_facts.KERNEL_TARGETS) and shipped with colibri, so a first start loads the
kernels instead of compiling them (minutes of a core).

numba keys a cached kernel on three things, and each is made portable here:

- the folder: ``<cache>/<source folder name>_<sha1 of the source folder's path>``; an install
  elsewhere looks in another folder, so the shipped files are written into the folder numba
  computes for this install;
- the source stamp: the sha256 of the kernel's source file (of the executable in the frozen
  bundle); a shipped index is used only when this install's source file has the content the
  kernels were built from, and is then written with this install's own stamp;
- each overload's CPU name and features: fixed per target by engine.kernels.setup, so one
  archive serves every CPU of a level.

An archive (``resources/kernels/<python>-numba<version>-<level>.tar.xz``, built by
``tools/build_kernel_cache.py``) holds ``manifest.json`` (Python and numba versions, the
target, the kinds of model it covers: engine.kernel_prepare.kernel_kind, the sha256 of each
kernel source file it was built from) and numba's index and
data files under the source folders' paths (``engine/kernels/...``). Installing merges them
into the user's cache (an overload the user's cache already has is kept), and
engine.kernel_prepare then runs no compile child for the kinds it covers. Anything that does not match (another
Python, numba or target, a kernel source edited since the build, a damaged archive) is
skipped: those kernels compile as before. Never raises.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import lzma
import os
import pickle
import sys
import tarfile
from pathlib import Path

from .fsutil import FileLock, atomic_write_text

log = logging.getLogger(__name__)

SHIPPED_ENV = "COLIBRI_SHIPPED_KERNELS"  # "0": do not install them (their build sets it)
MANIFEST = "manifest.json"
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds engine/


def python_tag() -> str:
    """``cp311`` for CPython 3.11: compiled kernels are keyed on the function's bytecode."""
    return f"{sys.implementation.name[:2]}{sys.version_info[0]}{sys.version_info[1]}"


def archive_name(level: str, numba_version: str, py: str | None = None) -> str:
    """The file name of the archive for a target level, numba version and Python."""
    return f"{py or python_tag()}-numba{numba_version}-{level}.tar.xz"


def shipped_dir() -> Path:
    """The folder of the shipped archives: ``resources/kernels`` beside the engine package (a
    source tree, an editable install, the frozen bundle), else ``kernels`` of the data package
    ``colibri_resources`` of an installed wheel (as engine.library.resources_dir finds the
    default model)."""
    beside = Path(PROJECT_ROOT) / "resources" / "kernels"
    if beside.is_dir():
        return beside
    try:
        spec = importlib.util.find_spec("colibri_resources")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / "kernels").is_dir():
            return Path(loc) / "kernels"
    return beside


def numba_folder(source_dir: str) -> str:
    """The folder name numba's cache uses for kernels whose source files are in ``source_dir``."""
    path = os.path.abspath(source_dir)
    return f"{os.path.basename(path)}_{hashlib.sha1(path.encode()).hexdigest()}"


def _sha256(path: str) -> bytes:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _local_stamp(source: str) -> bytes:
    """numba's source stamp for a kernel in ``source`` in this process (numba.core.caching)."""
    return _sha256(sys.executable if getattr(sys, "frozen", False) else source)


def install_shipped(cache_dir: str | None, target, archive: Path | None = None) -> tuple[str, frozenset]:
    """Merge the shipped kernels for ``target`` (a kernel_facts.KernelTarget) into numba's cache
    at ``cache_dir``, once per archive and install. ``archive``: the file (default: the one for
    this Python, numba and target in :func:`shipped_dir`). Returns what happened (one line, for
    ``colibri doctor``) and the kinds of model (kernel_prepare.kernel_kind tuples) whose kernels
    are now all in the cache: engine.kernel_prepare runs no compile child for them. Never raises."""
    try:
        return _install(cache_dir, target, archive)
    except Exception as e:  # noqa: BLE001 - the kernels then compile, as without an archive
        log.warning("could not use the pre-built kernels (%s: %s); they compile on first use", type(e).__name__, e)
        return f"pre-built kernels not used: {type(e).__name__}: {e}", frozenset()


def _install(cache_dir: str | None, target, archive: Path | None) -> tuple[str, frozenset]:
    import numba
    if os.environ.get(SHIPPED_ENV) == "0":
        return f"pre-built kernels not used ({SHIPPED_ENV}=0)", frozenset()
    if cache_dir is None:
        return "pre-built kernels not used: no writable kernel cache folder", frozenset()
    if not target.fixed:
        return f"no pre-built kernels for the CPU target {target.level} ({target.cpu_name})", frozenset()
    arc = Path(archive) if archive is not None else shipped_dir() / archive_name(target.level, numba.__version__)
    if not arc.is_file():
        return f"no pre-built kernels for {arc.name[:-len('.tar.xz')]}: they compile on first use", frozenset()
    done = _done_path(cache_dir, arc)
    if _done_holds(done, cache_dir):
        return _read_done(done)
    done.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(done.with_suffix(".lock")):  # the app and its compile child start at once
        if _done_holds(done, cache_dir):
            return _read_done(done)
        kinds: list = []
        files: list = []
        try:
            line, kinds, files = _merge(arc, cache_dir, target)
        except (tarfile.TarError, EOFError, lzma.LZMAError, pickle.UnpicklingError, KeyError, ValueError) as e:
            # a damaged archive stays so until colibri is reinstalled (a new archive, a new mark)
            line = f"pre-built kernels not used: {arc.name} is damaged ({type(e).__name__}: {e}); reinstall colibri"
            log.warning("%s", line)
        atomic_write_text(done, json.dumps({"line": line, "kinds": [list(k) for k in kinds], "index_files": files}) + "\n")
    log.info("%s", line)
    return line, frozenset(kinds)


def _done_holds(done: Path, cache_dir: str) -> bool:
    """Whether ``done`` was written and the index files it lists are still in the cache (a
    cache folder emptied by hand is filled again)."""
    try:
        return all((Path(cache_dir) / f).is_file() for f in json.loads(done.read_text())["index_files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _read_done(done: Path) -> tuple[str, frozenset]:
    try:
        d = json.loads(done.read_text())
        return str(d["line"]), frozenset(tuple(k) for k in d["kinds"])
    except (OSError, ValueError, KeyError, TypeError):  # not ours, or cut short: as if none were ready
        return f"pre-built kernels: {done} unreadable; delete it to install them again", frozenset()


def _done_path(cache_dir: str, arc: Path) -> Path:
    """The file saying ``arc`` was merged into ``cache_dir`` for this install (and what it gave)."""
    st = arc.stat()
    key = hashlib.sha256(repr((str(arc), st.st_size, st.st_mtime_ns, PROJECT_ROOT, _local_stamp(__file__) if
                               getattr(sys, "frozen", False) else b"")).encode()).hexdigest()[:24]
    return Path(cache_dir) / "colibri-prepared" / f"shipped-{key}.json"  # beside kernel_prepare's markers


def shipped_status(cache_dir: str | None, target) -> str:
    """What the pre-built kernels give on this machine, found without starting numba (for
    ``colibri doctor``): none for this target / Python / numba, the line of their install, or
    that they are installed at the next start of the kernels."""
    from importlib.metadata import PackageNotFoundError, version
    if not target.fixed:
        return f"none for the CPU target {target.level} ({target.cpu_name}): kernels compile at first use"
    try:
        arc = shipped_dir() / archive_name(target.level, version("numba"))
    except PackageNotFoundError:
        return "none: numba is not installed"
    if not arc.is_file():
        return f"none for {arc.name[:-len('.tar.xz')]}: kernels compile at first use"
    if os.environ.get(SHIPPED_ENV) == "0":
        return f"{arc.name}, not used ({SHIPPED_ENV}=0)"
    done = _done_path(cache_dir, arc) if cache_dir else None
    if done is not None and done.is_file():
        return _read_done(done)[0]
    try:
        stale = stale_sources(arc)
    except (OSError, tarfile.TarError, EOFError, lzma.LZMAError, pickle.UnpicklingError, KeyError, ValueError) as e:
        return f"{arc.name} is damaged ({type(e).__name__}: {e}): kernels compile at first use; reinstall colibri"
    if stale:
        return (f"{arc.name}: built from other versions of {', '.join(stale)}: their kernels compile at the next "
                f"start (rebuild with tools/build_kernel_cache.py)")
    return f"{arc.name}: copied into the kernel cache at the next start"


def stale_sources(arc: Path, root: str = PROJECT_ROOT) -> list[str]:
    """The kernel source files (paths relative to ``root``, e.g. ``engine/kernels/setup.py``)
    whose content differs from what ``arc``'s kernels were built from: a start compiles their
    kernels, and the archive's kinds of model are not ready. Reads only the manifest (its
    ``sources``, written by :func:`pack`), else every index (which loads numba). Raises
    OSError, tarfile.TarError, lzma.LZMAError, pickle.UnpicklingError, KeyError, ValueError."""
    with tarfile.open(arc, "r:xz") as tf:
        first = tf.next()
        if first is None or first.name != MANIFEST:
            raise KeyError(f"{MANIFEST} is not the first member")
        sources = json.loads(tf.extractfile(first).read()).get("sources")
        if sources is None:  # an archive from before the manifest listed its sources
            sources = {}
            for m in tf.getmembers():
                if m.isfile() and m.name.endswith(".nbi"):
                    rel_dir, index = os.path.split(m.name)
                    stamp = _read_index(tf.extractfile(m).read())[1]
                    sources[f"{rel_dir}/{index.split('.', 1)[0]}.py"] = stamp.hex()
    out = []
    for rel, digest in sorted(sources.items()):
        path = os.path.join(root, rel)
        if not os.path.isfile(path) or _sha256(path).hex() != digest:
            out.append(rel)
    return out


def _merge(arc: Path, cache_dir: str, target) -> tuple[str, list, list]:
    """Merge ``arc``'s index and data files into ``cache_dir``. Returns the summary line, the
    kinds of model ready (none when an index was built from other sources) and the index files
    written (relative to ``cache_dir``)."""
    import numba
    # one pass over the stream (a few MB): reading members out of order would restart the
    # xz decompression at each backward seek, once per index file
    with tarfile.open(arc, "r|xz") as tf:
        members = {m.name: tf.extractfile(m).read() for m in tf if m.isfile()}
    man = json.loads(members[MANIFEST])
    if (man.get("numba"), man.get("python"), man.get("level")) != (numba.__version__, python_tag(), target.level):
        return (f"pre-built kernels in {arc.name} not used: built for numba {man.get('numba')}, "
                f"{man.get('python')}, {man.get('level')}"), [], []
    used = stale = 0
    files = []
    for name in sorted(n for n in members if n.endswith(".nbi")):
        rel_dir, index = os.path.split(name)
        source = os.path.join(PROJECT_ROOT, rel_dir, index.split(".", 1)[0] + ".py")
        version, stamp, overloads = _read_index(members[name])
        if version != numba.__version__ or not os.path.isfile(source) or _sha256(source) != stamp:
            stale += 1  # built from another version of this file: numba compiles it
            continue
        folder = os.path.join(cache_dir, numba_folder(os.path.dirname(source)))
        os.makedirs(folder, exist_ok=True)
        _merge_index(rel_dir, overloads, folder, index, _local_stamp(source), members)
        files.append(os.path.join(os.path.basename(folder), index))
        used += 1
    kinds = [tuple(k) for k in man.get("kinds", [])] if stale == 0 else []
    return (f"pre-built kernels for {target.level}: {used} kernel files from {arc.name}"
            + (f", {stale} built from other sources (these compile on first use)" if stale else
               f"; kinds of model ready: {len(kinds)}")), kinds, files


def _read_index(raw: bytes) -> tuple:
    """numba's index file (numba.core.caching.IndexDataCacheFile): the pickled numba version,
    then the pickled (source stamp, {overload key: data file name}). Returns the three."""
    import io
    f = io.BytesIO(raw)
    version = pickle.load(f)
    stamp, overloads = pickle.loads(f.read())
    return version, stamp, overloads


def _merge_index(rel_dir: str, overloads: dict, folder: str, index: str, stamp: bytes, members: dict) -> None:
    """Add the shipped ``overloads`` (their data files in ``members``: archive name -> bytes)
    that the index ``folder/index`` lacks (a missing index, or
    one of other sources, has none), their data files copied as they are (unpickling them would
    import the kernel modules, which are importing this), then write the index with ``stamp``,
    as numba does: the version, then (stamp, overloads); the data before the index, each file
    replaced whole."""
    import numba
    from numba.core.serialize import dumps
    from .fsutil import atomic_write_bytes
    path = os.path.join(folder, index)
    have: dict = {}
    try:
        with open(path, "rb") as f:
            version, old_stamp, old = _read_index(f.read())
        if version == numba.__version__ and old_stamp == stamp:
            have = old
    except (OSError, EOFError, pickle.UnpicklingError, ValueError):
        pass
    taken = set(have.values())
    base = index[:-len(".nbi")]
    n = 0
    for key, data_name in overloads.items():
        if key in have:
            continue
        n += 1
        while f"{base}.{n}.nbc" in taken:
            n += 1
        name = f"{base}.{n}.nbc"
        atomic_write_bytes(os.path.join(folder, name), members[f"{rel_dir}/{data_name}"])
        have[key] = name
        taken.add(name)
    atomic_write_bytes(path, pickle.dumps(numba.__version__, protocol=-1) + dumps((stamp, have)))


def pack(cache_dir: str, out: Path, target, kinds: list) -> dict:
    """Write the archive ``out`` of every kernel in numba's cache ``cache_dir`` whose source is
    in this install's packages (engine/...), for ``target``, covering ``kinds``. Returns the
    manifest. Raises OSError."""
    import numba
    folders = {}
    for d, _, files in os.walk(os.path.join(PROJECT_ROOT, "engine")):
        if any(f.endswith(".py") for f in files):
            folders[numba_folder(d)] = os.path.relpath(d, PROJECT_ROOT)
    man = {"python": python_tag(), "numba": numba.__version__, "level": target.level,
           "cpu_name": target.cpu_name, "cpu_features": target.features,
           "kinds": [list(k) for k in kinds], "folders": [], "sources": {}}
    entries = []
    for sub in sorted(os.listdir(cache_dir)):
        rel = folders.get(sub)
        if rel is None:
            continue
        man["folders"].append(rel)
        for f in sorted(os.listdir(os.path.join(cache_dir, sub))):
            if f.endswith((".nbi", ".nbc")):
                entries.append((os.path.join(cache_dir, sub, f), f"{rel}/{f}"))
            if f.endswith(".nbi"):  # the source stamp of its kernels: stale_sources reads these alone
                with open(os.path.join(cache_dir, sub, f), "rb") as fi:
                    man["sources"][f"{rel}/{f.split('.', 1)[0]}.py"] = _read_index(fi.read())[1].hex()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with tarfile.open(tmp, "w:xz", preset=9) as tf:
        data = json.dumps(man, indent=1).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(data)
        import io
        tf.addfile(info, io.BytesIO(data))
        for path, name in entries:
            tf.add(path, arcname=name, recursive=False)
    os.replace(tmp, out)
    return man
