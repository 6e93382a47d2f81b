"""Build the self-contained colibri-desktop bundle: ``python packaging/build.py``.

One command per platform, the same recipe (packaging/colibri.spec, PyInstaller one-folder):

    Linux    dist/colibri-desktop/  (+ .desktop entry, icon, install.sh)  and
             dist/colibri-desktop-<version>-linux-<arch>.tar.gz           (tested here)
    macOS    dist/colibri-desktop.app  and  colibri-desktop-<version>-macos-<arch>.zip   (UNTESTED)
    Windows  dist/colibri-desktop/  (colibri.exe, colibri-desktop.exe)  and  a .zip          (UNTESTED)

Steps: run PyInstaller on the spec with a fixed hash seed; check the bundle (no torch or
transformers, Qt's offscreen and xcb platform plugins and the default model present, and on
Linux the X11 libraries the xcb plugin links, which PyInstaller copies from the build machine);
precompile the engine's shipped .py sources into unchecked-hash .pyc (valid whatever the
files' mtimes after copying); add the desktop entry and icon; write BUILDINFO.json (versions
of every bundled distribution); pack a reproducible archive (sorted members, one mtime:
SOURCE_DATE_EPOCH or the last commit's time, owner root, gzip without a timestamp). Prints the
bundle and archive sizes. Exit code 1 with one line naming the problem when a check fails.

Options: ``--dist DIR`` (default packaging/dist), ``--work DIR`` (PyInstaller's build folder,
default packaging/build), ``--no-archive``.
"""

from __future__ import annotations

import argparse
import compileall
import gzip
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
NAME = "colibri-desktop"
FORBIDDEN = ("torch", "transformers")  # never in a bundle (tests, training and benchmarks only)


class BuildError(Exception):
    """A check of the built bundle failed (the message names what and where)."""


def version() -> str:
    """engine.__version__ of this tree (read from the file: the build must not import numba)."""
    for line in (ROOT / "engine" / "__init__.py").read_text(encoding="utf-8").splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].split("#")[0].strip().strip("\"'")
    raise BuildError(f"{ROOT / 'engine' / '__init__.py'}: no __version__ line")


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH if set, else the last commit's time, else now (seconds)."""
    env = os.environ.get("SOURCE_DATE_EPOCH")
    if env:
        return int(env)
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True,
                             text=True, check=True, timeout=30).stdout.strip()
        return int(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return int(time.time())


def folder_bytes(path: Path) -> int:
    """Bytes of every regular file under ``path`` (symlinks not followed)."""
    total = 0
    for base, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(base, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def run_pyinstaller(dist: Path, work: Path) -> None:
    """PyInstaller on colibri.spec (``--clean``: no stale analysis from another tree)."""
    try:
        import PyInstaller  # noqa: F401
    except ImportError:
        raise BuildError("PyInstaller is not installed: pip install -e '.[packaging]'") from None
    env = dict(os.environ, PYTHONHASHSEED="0")  # PyInstaller's advice for reproducible builds
    cmd = [sys.executable, "-m", "PyInstaller", "--noconfirm", "--clean", "--log-level", "WARN",
           "--distpath", str(dist), "--workpath", str(work), str(HERE / "colibri.spec")]
    print("+", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise BuildError(f"PyInstaller failed (exit code {p.returncode}); its log is above")


def internal_dir(bundle: Path) -> Path:
    """The folder holding the bundled libraries and data (PyInstaller >= 6: ``_internal``)."""
    for cand in (bundle / "_internal", bundle / "Contents" / "Frameworks", bundle):
        if (cand / "resources").is_dir() or (cand / "engine").is_dir():
            return cand
    raise BuildError(f"{bundle}: no _internal folder with resources/ and engine/ (PyInstaller layout changed?)")


def check_bundle(bundle: Path, system: str) -> dict:
    """Checks every bundle must pass; returns facts for BUILDINFO. Raises BuildError."""
    inner = internal_dir(bundle)
    bad = []
    for base, dirs, files in os.walk(bundle):
        for n in dirs + files:
            low = n.lower()
            if any(low == f or low.startswith(f + "-") or low.startswith(f"lib{f}") or low.startswith(f + ".")
                   for f in FORBIDDEN):
                bad.append(os.path.join(base, n))
    if bad:
        raise BuildError(f"torch / transformers found in the bundle (they must be excluded): {bad[:5]}")
    model = inner / "resources" / "models" / "colibri-stdlib-moe"
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (model / f).is_file():
            raise BuildError(f"{model / f}: the bundled default model is incomplete")
    kernels = inner / "engine" / "kernels" / "__init__.py"
    if not kernels.is_file():
        raise BuildError(f"{kernels}: missing; numba's cache needs the engine's .py sources in the bundle")
    plugins = sorted(p.name for p in inner.rglob("platforms/*") if p.is_file())
    need = {"linux": ("libqoffscreen", "libqxcb"), "darwin": ("libqoffscreen", "libqcocoa"),
            "windows": ("qoffscreen", "qwindows")}.get(system, ())
    for n in need:
        if not any(p.startswith(n) for p in plugins):
            raise BuildError(f"Qt platform plugin {n} missing from the bundle (found: {plugins})")
    facts = {"qt_platform_plugins": plugins}
    if system == "linux":
        facts["gui_libraries"] = check_gui_libraries(bundle)
    return facts


def _gui_check():
    """engine/gui_check.py loaded from its file (the build never imports the engine package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("colibri_gui_check", ROOT / "engine" / "gui_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# PyInstaller leaves these to the system on purpose (its exclusion list: the GL stack and
# libxcb itself change with the X server and the graphics driver); any X11 desktop has them
SYSTEM_GUI_LIBS = ("libGL.so.1", "libEGL.so.1", "libxcb.so.1")


def check_gui_libraries(bundle: Path) -> list[str]:
    """The X11 / Qt GUI libraries the bundle ships (every one engine/gui_check.py lists except
    SYSTEM_GUI_LIBS). PyInstaller copies the libraries Qt's xcb plugin links from the build
    machine, so one missing there would be missing from the bundle, and the bundle's window
    would not open on a machine without it. Raises BuildError naming them and the command
    that installs them on the build machine."""
    G = _gui_check()
    want = [so for so in {**G.QT_GUI_LIBS, **G.XCB_LIBS} if so not in SYSTEM_GUI_LIBS]
    have = {p.name for p in bundle.rglob("lib*.so*")}
    missing = sorted(so for so in want if so not in have)
    if missing:
        pkgs = G._packages(missing, 0)
        raise BuildError(f"the bundle lacks {', '.join(missing)}, which Qt's xcb plugin needs: they are not "
                         f"installed on the build machine. Install them (Debian / Ubuntu: sudo apt-get install "
                         f"{' '.join(pkgs)}) and build again")
    return sorted(want)


def precompile_engine(bundle: Path) -> None:
    """Unchecked-hash .pyc for the shipped engine sources: used whatever the files' mtimes (a
    copied bundle keeps them valid) and never rewritten, so a read-only bundle starts as fast."""
    eng = internal_dir(bundle) / "engine"
    ok = compileall.compile_dir(str(eng), quiet=1,
                                invalidation_mode=compileall.py_compile.PycInvalidationMode.UNCHECKED_HASH)
    if not ok:
        raise BuildError(f"{eng}: byte-compiling the engine sources failed")


def distributions(bundle: Path) -> dict[str, str]:
    """{distribution: version} of the package metadata shipped in the bundle (the versions
    `colibri doctor` reports), plus the build tools'."""
    from importlib import metadata
    out = {}
    for d in sorted(internal_dir(bundle).glob("*.dist-info")):
        name, _, ver = d.name[:-len(".dist-info")].partition("-")
        out[name] = ver
    for tool in ("pyinstaller", "pyinstaller-hooks-contrib"):
        try:
            out[f"(build) {tool}"] = metadata.version(tool)
        except metadata.PackageNotFoundError:
            pass
    return out


def add_linux_files(bundle: Path) -> None:
    """Desktop entry, icons and a per-user install script at the bundle's top level."""
    icons = ROOT / "resources" / "icons"
    shutil.copy2(icons / "colibri-desktop.svg", bundle / "colibri-desktop.svg")
    shutil.copy2(icons / "colibri-desktop.png", bundle / "colibri-desktop.png")
    shutil.copy2(HERE / "linux" / "colibri-desktop.desktop", bundle / "colibri-desktop.desktop")
    shutil.copy2(HERE / "linux" / "install.sh", bundle / "install.sh")
    os.chmod(bundle / "install.sh", 0o755)


def _norm(ti: tarfile.TarInfo, mtime: int) -> tarfile.TarInfo:
    ti.mtime = mtime
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    if ti.isdir() or ti.mode & 0o111:
        ti.mode = 0o755
    else:
        ti.mode = 0o644
    return ti


def _members(bundle: Path):
    """(path, archive name) of the bundle and everything in it, sorted (deterministic order)."""
    yield bundle, bundle.name
    for base, dirs, files in os.walk(bundle):
        dirs.sort()
        for n in sorted(dirs + files):
            p = Path(base) / n
            yield p, str(Path(bundle.name) / p.relative_to(bundle))


def make_tarball(bundle: Path, out: Path, mtime: int) -> None:
    """A reproducible .tar.gz of ``bundle`` (same inputs, same bytes)."""
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for p, arc in _members(bundle):
            tar.add(str(p), arcname=arc, recursive=False, filter=lambda ti: _norm(ti, mtime))
    os.replace(tmp, out)


def make_zip(bundle: Path, out: Path, mtime: int) -> None:
    """A reproducible .zip of ``bundle`` (macOS .app / Windows folder). UNTESTED on those systems."""
    tmp = out.with_name(out.name + ".partial")
    stamp = time.gmtime(max(mtime, 315532800))[:6]  # zip dates start in 1980
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for p, arc in _members(bundle):
            if p.is_symlink():  # .app frameworks use symlinks: keep them as links
                zi = zipfile.ZipInfo(arc, stamp)
                zi.create_system = 3
                zi.external_attr = (0o120777 << 16)
                z.writestr(zi, os.readlink(p))
            elif p.is_dir():
                zi = zipfile.ZipInfo(arc + "/", stamp)
                zi.external_attr = (0o40755 << 16)
                z.writestr(zi, b"")
            else:
                zi = zipfile.ZipInfo(arc, stamp)
                zi.external_attr = ((0o100755 if os.access(p, os.X_OK) else 0o100644) << 16)
                zi.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(zi, p.read_bytes())
    os.replace(tmp, out)


def build(dist: Path, work: Path, archive: bool = True) -> dict:
    """Build the bundle into ``dist``; returns the summary printed at the end. Raises BuildError."""
    system = {"linux": "linux", "darwin": "darwin", "win32": "windows"}.get(sys.platform, sys.platform)
    ver = version()
    epoch = source_date_epoch()
    os.environ["SOURCE_DATE_EPOCH"] = str(epoch)
    dist.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    run_pyinstaller(dist, work)
    folder = dist / NAME
    bundle = dist / f"{NAME}.app" if system == "darwin" else folder
    facts = check_bundle(folder, system)
    precompile_engine(folder)
    if system == "linux":
        add_linux_files(folder)
    arch = platform.machine().lower() or "unknown"
    info = {"name": NAME, "version": ver, "platform": system, "arch": arch, "python": platform.python_version(),
            "source_date_epoch": epoch, **facts, "distributions": distributions(folder)}
    (internal_dir(folder) / "BUILDINFO.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    summary = {"bundle": str(bundle), "bundle_bytes": folder_bytes(bundle), "build_seconds": 0.0}
    if archive:
        if system == "linux":
            out = dist / f"{NAME}-{ver}-linux-{arch}.tar.gz"
            make_tarball(folder, out, epoch)
        else:
            out = dist / f"{NAME}-{ver}-{'macos' if system == 'darwin' else 'windows'}-{arch}.zip"
            make_zip(bundle, out, epoch)
        summary["archive"] = str(out)
        summary["archive_bytes"] = out.stat().st_size
    summary["build_seconds"] = round(time.monotonic() - t0, 1)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the self-contained colibri-desktop bundle (PyInstaller).")
    ap.add_argument("--dist", type=Path, default=HERE / "dist", help="output folder (default: packaging/dist)")
    ap.add_argument("--work", type=Path, default=HERE / "build", help="PyInstaller's work folder")
    ap.add_argument("--no-archive", action="store_true", help="skip the tarball / zip")
    a = ap.parse_args(argv)
    try:
        s = build(a.dist.resolve(), a.work.resolve(), archive=not a.no_archive)
    except BuildError as e:
        print(f"build: error: {e}", file=sys.stderr)
        return 1
    print(f"bundle   {s['bundle']}  {mb(s['bundle_bytes'])}")
    if "archive" in s:
        print(f"archive  {s['archive']}  {mb(s['archive_bytes'])}")
    print(f"built in {s['build_seconds']} s")
    print("SUMMARY " + json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
