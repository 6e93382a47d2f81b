"""The self-contained Linux bundle, built and started for real (slow: minutes).

One build (``python packaging/build.py`` into a temp folder) serves every test here. The bundle
is then copied to a fresh place and made read-only (a read-only bind mount as root, chmod a-w
otherwise), HOME is read-only too, and the bundle runs with no Python of ours on the path:

- ``colibri run`` with a fresh data folder converts the bundled default model, answers one
  prompt, and numba caches its kernels in the cache folder the environment names
  (XDG_CACHE_HOME), never in the bundle or HOME;
- with no writable cache anywhere numba compiles uncached and the answer is the same;
- ``colibri doctor`` inside the bundle reports the bundle, every library version, the
  uncached numba and the read-only HOME without a traceback;
- the desktop app starts offscreen (Qt's platform plugin from the bundle) and closes cleanly on
  SIGTERM.

The bundle's size is printed (and checked to hold neither torch nor transformers).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from ro_helpers import make_read_only, read_only_prefix, restore_writable  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "What does the len() function return?"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="the tested bundle is the Linux one")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(bundle folder, build summary) of one build in a temp folder."""
    pytest.importorskip("PyInstaller", reason="pip install -e '.[test]' installs PyInstaller")
    out = tmp_path_factory.mktemp("bundle-build")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "COLIBRI_"))}
    p = subprocess.run([sys.executable, str(ROOT / "packaging" / "build.py"), "--dist", str(out / "dist"),
                        "--work", str(out / "work")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=3600)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-5000:])
    line = next(x for x in p.stdout.splitlines() if x.startswith("SUMMARY "))
    summary = json.loads(line[len("SUMMARY "):])
    shutil.rmtree(out / "work", ignore_errors=True)
    yield Path(summary["bundle"]), summary
    shutil.rmtree(out, ignore_errors=True)  # ~0.7 GB: not kept among pytest's last temp folders


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory):
    """A read-only copy of the bundle, a read-only HOME, and a runner for commands in it."""
    bundle, summary = built
    base = tmp_path_factory.mktemp("bundle-run")
    app = base / "opt" / "colibri-desktop"
    shutil.copytree(bundle, app, symlinks=True)
    home = base / "home"
    (home / ".cache").mkdir(parents=True)
    make_read_only(app, home)
    pre = read_only_prefix(app, home)
    if pre is None:
        restore_writable(app, home)
        pytest.skip("cannot make the bundle read-only here (root without mount namespaces)")

    def run(args, data, cache=None, timeout=1800, popen=False):
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "QT_QPA_PLATFORM": "offscreen",
               "XDG_DATA_HOME": str(data / "share"), "XDG_CONFIG_HOME": str(data / "config"),
               "XDG_RUNTIME_DIR": str(data / "run"), "OMP_WAIT_POLICY": "PASSIVE"}
        (data / "run").mkdir(parents=True, exist_ok=True, mode=0o700)
        if cache is not None:
            env["XDG_CACHE_HOME"] = str(cache)
        cmd = pre + [str(app / "colibri"), *args]
        if popen:
            return subprocess.Popen(cmd, env=env, cwd=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return subprocess.run(cmd, env=env, cwd=base, capture_output=True, text=True, timeout=timeout)

    yield app, home, run, summary
    restore_writable(app, home)
    shutil.rmtree(base, ignore_errors=True)


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_bundle_contents_and_size(built):
    bundle, s = built
    with_sizes = f"bundle {s['bundle_bytes'] / 1e6:.0f} MB, tarball {s['archive_bytes'] / 1e6:.0f} MB"
    print(f"\n[bundle] {with_sizes}; built in {s['build_seconds']:.0f} s", file=sys.__stderr__)
    inner = bundle / "_internal"
    names = {p.name.lower() for p in bundle.rglob("*")}
    assert not {n for n in names if n in ("torch", "transformers") or n.startswith(("libtorch", "torch-", "transformers-"))}
    assert (inner / "resources" / "models" / "colibri-stdlib-moe" / "model.safetensors").is_file()
    plugins = {p.name for p in (inner / "PySide6" / "Qt" / "plugins" / "platforms").iterdir()}
    assert {"libqoffscreen.so", "libqxcb.so"} <= plugins
    for f in ("colibri", "colibri-desktop.desktop", "colibri-desktop.png", "colibri-desktop.svg", "install.sh"):
        assert (bundle / f).is_file(), f
    desktop = (bundle / "colibri-desktop.desktop").read_text(encoding="utf-8")
    assert "Exec=colibri" in desktop and "Icon=colibri-desktop" in desktop
    info = json.loads((inner / "BUILDINFO.json").read_text(encoding="utf-8"))
    assert not any(k.lower() in ("torch", "transformers") for k in info["distributions"])
    assert Path(s["archive"]).stat().st_size == s["archive_bytes"] > 0
    assert s["bundle_bytes"] < 1_000_000_000  # torch alone would be ~1 GB


def test_run_answers_from_a_read_only_bundle(installed, tmp_path):
    """Fresh data folder, read-only bundle and HOME, numba's cache where XDG_CACHE_HOME says."""
    app, home, run, _ = installed
    data, cache = tmp_path / "data", tmp_path / "cache"
    t0 = time.monotonic()
    p = run(["run", "--prompt", PROMPT, "--max-new-tokens", "16", "--temperature", "0"], data, cache)
    dt = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Traceback" not in p.stderr
    answer = p.stdout.strip()
    assert len(answer) >= 8, (p.stdout, p.stderr[-2000:])
    store = data / "share" / "colibri-desktop" / "models" / "colibri-stdlib-moe-int8"
    assert (store / "manifest.json").is_file()  # the bundled model, converted on first use
    cached = [f for f in _files(cache / "colibri-desktop" / "numba") if f.suffix in (".nbi", ".nbc")]
    assert cached, "numba cached nothing in the XDG cache folder"
    assert not list((home / ".cache").iterdir())
    assert not [f for f in _files(app) if f.suffix in (".nbi", ".nbc")]  # never a cache in the bundle
    print(f"\n[bundle] first run (convert + compile + answer) {dt:.0f} s: {answer[:60]!r}", file=sys.__stderr__)
    # second run: kernels load from the cache; same greedy answer
    p2 = run(["run", "--prompt", PROMPT, "--max-new-tokens", "16", "--temperature", "0"], data, cache)
    assert p2.returncode == 0, p2.stderr[-4000:]
    assert p2.stdout.strip() == answer


def test_run_without_any_writable_cache_compiles_uncached(installed, tmp_path):
    """HOME read-only and no XDG_CACHE_HOME: numba falls back to uncached, the answer comes."""
    app, home, run, _ = installed
    data = tmp_path / "data"
    p = run(["doctor", "--disk-test-mb", "4"], data, cache=None)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Traceback" not in p.stderr
    out = p.stdout
    assert "PyInstaller bundle" in out and "not installed" not in out, out
    assert "numba cache  none" in out, out
    assert "threading layer unknown" not in out
    p = run(["run", "--prompt", PROMPT, "--max-new-tokens", "16", "--temperature", "0"], data, cache=None)
    assert p.returncode == 0, p.stderr[-4000:]
    assert len(p.stdout.strip()) >= 8
    assert not list((home / ".cache").iterdir())


def test_app_starts_offscreen_and_closes_on_sigterm(installed, tmp_path):
    app, home, run, _ = installed
    data = tmp_path / "data"
    cache = tmp_path / "cache"
    proc = run([], data, cache, popen=True)
    lock = data / "share" / "colibri-desktop" / "colibri-app.lock"
    deadline = time.monotonic() + 600
    try:
        while not lock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert lock.exists(), "the app did not claim its data folder in 10 minutes"
        time.sleep(5)  # the window is up and the model is opening
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    assert "Traceback" not in err and "Could not load the Qt platform plugin" not in err, err[-4000:]
