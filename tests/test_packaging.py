"""The packaging recipe's own logic, fast (the real build is tests/test_bundle.py, slow): the
bundle checks refuse torch / transformers and a missing Qt plugin or model, archives are
byte-reproducible, the version has one source, the desktop entry and install.sh work."""

from __future__ import annotations

import configparser
import importlib.util
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

import engine

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def B():
    spec = importlib.util.spec_from_file_location("colibri_build", ROOT / "packaging" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_bundle(base: Path) -> Path:
    b = base / "colibri-desktop"
    inner = b / "_internal"
    m = inner / "resources" / "models" / "colibri-stdlib-moe"
    m.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (m / f).write_text("x")
    (inner / "engine").mkdir()
    (inner / "engine" / "kernels").mkdir()
    (inner / "engine" / "kernels" / "__init__.py").write_text("x = 1\n")
    plat = inner / "PySide6" / "Qt" / "plugins" / "platforms"
    plat.mkdir(parents=True)
    for f in ("libqoffscreen.so", "libqxcb.so"):
        (plat / f).write_text("")
    from engine import gui_check as G
    for so in {**G.QT_GUI_LIBS, **G.XCB_LIBS}:
        if so not in ("libGL.so.1", "libEGL.so.1", "libxcb.so.1"):
            (inner / so).write_text("")
    (b / "colibri").write_text("#!/bin/sh\n")
    (b / "colibri").chmod(0o755)
    return b


def test_check_bundle_refuses_a_bundle_without_the_x11_libraries(B, tmp_path):
    """PyInstaller copies the xcb plugin's libraries from the build machine; one missing there
    would leave a bundle whose window aborts on a machine without it."""
    b = _fake_bundle(tmp_path)
    (b / "_internal" / "libxcb-icccm.so.4").unlink()
    (b / "_internal" / "libxcb-keysyms.so.1").unlink()
    with pytest.raises(B.BuildError, match=r"libxcb-icccm.so.4, libxcb-keysyms.so.1.*apt-get install "
                                           r"libxcb-icccm4 libxcb-keysyms1"):
        B.check_bundle(b, "linux")
    assert "libxcb-cursor.so.0" in B.check_bundle(_fake_bundle(tmp_path / "ok"), "linux")["gui_libraries"]


def test_version_has_one_source(B):
    assert B.version() == engine.__version__


def test_check_bundle_accepts_a_complete_bundle(B, tmp_path):
    facts = B.check_bundle(_fake_bundle(tmp_path), "linux")
    assert facts["qt_platform_plugins"] == ["libqoffscreen.so", "libqxcb.so"]


@pytest.mark.parametrize("intruder", ["torch", "transformers", "libtorch_cpu.so", "torch-2.13.0.dist-info",
                                      "transformers-4.50.0.dist-info"])
def test_check_bundle_refuses_torch_and_transformers(B, tmp_path, intruder):
    b = _fake_bundle(tmp_path)
    (b / "_internal" / intruder).mkdir()
    with pytest.raises(B.BuildError, match="torch / transformers found"):
        B.check_bundle(b, "linux")


def test_check_bundle_refuses_missing_plugin_or_model(B, tmp_path):
    b = _fake_bundle(tmp_path)
    (b / "_internal" / "PySide6" / "Qt" / "plugins" / "platforms" / "libqxcb.so").unlink()
    with pytest.raises(B.BuildError, match="libqxcb missing"):
        B.check_bundle(b, "linux")
    b2 = _fake_bundle(tmp_path / "two")
    (b2 / "_internal" / "resources" / "models" / "colibri-stdlib-moe" / "model.safetensors").unlink()
    with pytest.raises(B.BuildError, match="default model is incomplete"):
        B.check_bundle(b2, "linux")


def test_precompiled_engine_sources_survive_a_copy(B, tmp_path):
    b = _fake_bundle(tmp_path)
    B.precompile_engine(b)
    pyc = list((b / "_internal" / "engine" / "kernels" / "__pycache__").glob("__init__.*.pyc"))
    assert len(pyc) == 1
    flags = int.from_bytes(pyc[0].read_bytes()[4:8], "little")
    assert flags == 0b01  # hash-based, unchecked (PEP 552): valid whatever the source mtime


def test_archives_are_reproducible(B, tmp_path):
    b = _fake_bundle(tmp_path)
    B.make_tarball(b, tmp_path / "a.tar.gz", 1_700_000_000)
    for p in b.rglob("*"):
        os.utime(p, (1, 1))  # other mtimes, same content
    B.make_tarball(b, tmp_path / "b.tar.gz", 1_700_000_000)
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()
    with tarfile.open(tmp_path / "a.tar.gz") as t:
        ms = t.getmembers()
        assert ms[0].name == "colibri-desktop" and all(m.name.startswith("colibri-desktop/") for m in ms[1:])
        assert {m.mtime for m in ms} == {1_700_000_000} and {m.uid for m in ms} == {0}
        assert t.getmember("colibri-desktop/colibri").mode == 0o755
    B.make_zip(b, tmp_path / "a.zip", 1_700_000_000)
    B.make_zip(b, tmp_path / "b.zip", 1_700_000_000)
    assert (tmp_path / "a.zip").read_bytes() == (tmp_path / "b.zip").read_bytes()
    assert not list(tmp_path.glob("*.partial"))


def test_desktop_entry():
    cp = configparser.ConfigParser(interpolation=None)
    cp.optionxform = str
    cp.read(ROOT / "packaging" / "linux" / "colibri-desktop.desktop", encoding="utf-8")
    e = cp["Desktop Entry"]
    assert e["Type"] == "Application" and e["Exec"] == "colibri" and e["Icon"] == "colibri-desktop"
    assert e["Terminal"] == "false" and e["Categories"].endswith(";")
    for icon in ("colibri-desktop.svg", "colibri-desktop.png"):
        assert (ROOT / "resources" / "icons" / icon).stat().st_size > 500


def test_install_script_installs_and_uninstalls(B, tmp_path):
    b = _fake_bundle(tmp_path)
    B.add_linux_files(b)
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    p = subprocess.run(["sh", str(b / "install.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    link = home / ".local" / "bin" / "colibri"
    assert link.is_symlink() and link.resolve() == (b / "colibri").resolve()
    entry = (home / ".local" / "share" / "applications" / "colibri-desktop.desktop").read_text(encoding="utf-8")
    assert f'Exec="{b.resolve()}/colibri"' in entry and "Icon=colibri-desktop" in entry
    assert (home / ".local/share/icons/hicolor/256x256/apps/colibri-desktop.png").is_file()
    assert (home / ".local/share/icons/hicolor/scalable/apps/colibri-desktop.svg").is_file()
    p = subprocess.run(["sh", str(b / "install.sh"), "--uninstall"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert not link.exists() and not link.is_symlink()
    assert not (home / ".local" / "share" / "applications" / "colibri-desktop.desktop").exists()
    assert (b / "colibri").is_file()  # the bundle itself is never touched


def test_the_docs_agree_on_how_the_tests_run():
    """The README's test command is CI's and reaches only PyPI (CI's machines reach no other
    index; the CPU build of torch is an optional step the README names beside it); the bundle
    test is marked slow and both READMEs say the default run skips it (packaging/README said it
    was part of the default run)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    cmd = next(ln.strip() for ln in readme.splitlines() if ln.startswith("    ") and "pytest -q" in ln)
    assert cmd in ci.splitlines()
    assert "--index-url" not in ci and "--index-url" not in cmd
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme
    assert "torch==2.13.0" in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    bundle = (ROOT / "tests" / "test_bundle.py").read_text(encoding="utf-8")
    assert "pytest.mark.slow" in bundle
    assert "addopts = \"-m 'not slow'\"" in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    pack = " ".join((ROOT / "packaging" / "README.md").read_text(encoding="utf-8").split())
    assert "part of the default" not in pack and "the default `python -m pytest -q` run skips it" in pack
    assert "That default run skips the tests marked slow (the self-contained bundle" in " ".join(readme.split())
