"""The window starts or says exactly why not: before Qt loads its platform plugin (which aborts
the process naming one library at most), the launcher checks the display and every shared
library Qt's GUI and platform plugins link, and prints one message naming all that is missing
with the distribution's install command; `colibri doctor` prints the same."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from engine import gui_check as G
from engine.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def needed(path: Path) -> list[str]:
    """DT_NEEDED entries of an ELF64 little-endian shared library (what the loader must find)."""
    b = path.read_bytes()
    assert b[:4] == b"\x7fELF" and b[4] == 2 and b[5] == 1, path
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", b, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    out = []
    for _name, typ, _fl, _addr, off, size, link, _info, _al, entsize in secs:
        if typ != 6:  # SHT_DYNAMIC
            continue
        stroff = secs[link][4]
        for k in range(0, size, entsize or 16):
            tag, val = struct.unpack_from("<qQ", b, off + k)
            if tag == 1:  # DT_NEEDED
                out.append(b[stroff + val:b.index(b"\0", stroff + val)].decode())
    return out


def _pyside_dir() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("PySide6")
    return Path(spec.origin).parent


# the C / C++ runtime, and Qt's own libraries (shipped in the wheel)
SYSTEM = ("libc.so", "libm.so", "libstdc++.so", "libgcc_s.so", "libpthread.so", "libdl.so", "librt.so", "ld-linux",
          "libz.so", "libzstd.so", "libresolv.so")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF libraries")
@pytest.mark.parametrize("lib,table", [
    ("Qt/lib/libQt6Gui.so.6", "gui"), ("Qt/lib/libQt6DBus.so.6", "gui"), ("Qt/lib/libQt6Widgets.so.6", "gui"),
    ("Qt/lib/libQt6Network.so.6", "gui"),
    ("Qt/plugins/platforms/libqxcb.so", "xcb"), ("Qt/lib/libQt6XcbQpa.so.6", "xcb"),
    ("Qt/plugins/platforms/libqwayland.so", "wayland"), ("Qt/lib/libQt6WaylandClient.so.6", "wayland")])
def test_the_table_lists_every_library_the_installed_qt_links(lib, table):
    path = _pyside_dir() / lib
    if not path.exists():
        pytest.skip(f"{lib} not in this PySide6 wheel")
    known = set(G.QT_GUI_LIBS) | set(G.PLATFORM_LIBS.get(table, {}))
    outside = [n for n in needed(path) if not n.startswith(("libQt6", "libicu")) and not n.startswith(SYSTEM)]
    assert outside and set(outside) <= known, sorted(set(outside) - known)


def test_missing_libraries_are_named_all_at_once_with_the_command_per_distribution():
    env = {"DISPLAY": ":0"}
    absent = {"libEGL.so.1", "libxcb-icccm.so.4", "libxcb-keysyms.so.1"}

    def load(so):
        return f"{so}: cannot open shared object file: No such file or directory" if so in absent else None

    for os_id, cmd, pkgs in (("debian", "sudo apt-get install --no-install-recommends", "libegl1 libxcb-icccm4 libxcb-keysyms1"),
                             ("fedora", "sudo dnf install", "libglvnd-egl xcb-util-wm xcb-util-keysyms"),
                             ("arch", "sudo pacman -S --needed", "libglvnd xcb-util-wm xcb-util-keysyms")):
        chk = G.check_gui(env, load, {"ID": os_id}, x_server=lambda d: True)
        assert not chk.ok and set(chk.missing) == absent and chk.platform == "xcb"
        assert chk.install == f"{cmd} {pkgs}", chk.install
        assert chk.install in chk.message() and "libxcb-keysyms.so.1" in chk.message()
    ubuntu = G.check_gui(env, load, {"ID": "ubuntu", "ID_LIKE": "debian"}, x_server=lambda d: True)
    assert ubuntu.install.startswith("sudo apt-get install --no-install-recommends libegl1")
    unknown = G.check_gui(env, load, {"ID": "gentoo"}, x_server=lambda d: True)
    assert unknown.install == "" and "libxcb-icccm4" in unknown.message()  # Debian's names as a hint


def test_a_present_library_whose_dependency_is_missing_names_the_dependency():
    def load(so):
        if so == "libxkbcommon-x11.so.0":
            return "libxcb-xkb.so.1: cannot open shared object file: No such file or directory"
        return "libxcb-xkb.so.1: cannot open shared object file" if so == "libxcb-xkb.so.1" else None
    chk = G.check_gui({"DISPLAY": ":0"}, load, {"ID": "debian"}, x_server=lambda d: True)
    assert "libxcb-xkb.so.1" in chk.missing and "libxcb-xkb1" in chk.install


def test_display_cases():
    ok = lambda so: None  # noqa: E731
    none = G.check_gui({}, ok, {"ID": "debian"})
    assert not none.ok and none.platform == "" and "no display" in none.message()
    assert "colibri run" in none.message() and "colibri serve" in none.message()
    dead = G.check_gui({"DISPLAY": ":99"}, ok, {"ID": "debian"}, x_server=lambda d: False)
    assert not dead.ok and ":99 does not answer" in dead.message()
    assert G.check_gui({"DISPLAY": ":0"}, ok, {"ID": "debian"}, x_server=lambda d: True).ok
    off = G.check_gui({"QT_QPA_PLATFORM": "offscreen"}, ok, {"ID": "debian"}, x_server=lambda d: False)
    assert off.ok and off.platform == "offscreen"
    seen = []
    G.check_gui({"QT_QPA_PLATFORM": "offscreen"}, lambda so: seen.append(so), {})
    assert "libdbus-1.so.3" in seen and not any(s.startswith("libxcb") for s in seen)  # no xcb libs needed
    wl = G.check_gui({"WAYLAND_DISPLAY": "wayland-0", "XDG_RUNTIME_DIR": "/nonexistent"}, ok, {})
    assert wl.platform == "wayland" and not wl.ok


SCRIPT = """
import sys
import engine.gui_check as G
absent = set(sys.argv[1].split(",")) if sys.argv[1] else set()
G.load_library = lambda so: (so + ": cannot open shared object file") if so in absent else None
G._x_server_answers = lambda display: True
G.read_os_release = lambda path="/etc/os-release": {"ID": "debian"}
from colibri_app.launcher import main
rc = main([])
print("QtGui loaded:", "PySide6.QtGui" in sys.modules)
sys.exit(rc)
"""


def _launch(env_extra: dict, absent: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env["PATH"] = "/nonexistent"  # no desktop notifier (xmessage would wait on a real display)
    env.update(env_extra)
    return subprocess.run([PY, "-c", SCRIPT, absent], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_launcher_names_every_missing_library_and_exits_without_starting_qt():
    p = _launch({"DISPLAY": ":0"}, "libEGL.so.1,libxcb-cursor.so.0,libxcb-icccm.so.4,libdbus-1.so.3")
    assert p.returncode == G.EXIT_CODE, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "QtGui loaded: False" in p.stdout
    for so in ("libEGL.so.1", "libxcb-cursor.so.0", "libxcb-icccm.so.4", "libdbus-1.so.3"):
        assert so in p.stderr
    assert "sudo apt-get install --no-install-recommends libegl1 libdbus-1-3 libxcb-cursor0 libxcb-icccm4" in p.stderr, p.stderr


def test_started_outside_a_terminal_the_message_is_shown_on_the_desktop(tmp_path):
    """From a menu nobody reads stderr: with a display that answers but a library missing, the
    message goes to the desktop's own dialog program too (here a stand-in zenity recording its
    arguments); without a display nothing is tried."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "seen.txt"
    fake = bin_dir / "zenity"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {seen}\n')
    fake.chmod(0o755)
    p = _launch({"DISPLAY": ":0", "PATH": str(bin_dir)}, "libxcb-cursor.so.0")
    assert p.returncode == G.EXIT_CODE, (p.returncode, p.stderr)
    args = seen.read_text()
    assert "--error" in args and "libxcb-cursor.so.0" in args and "apt-get install" in args
    seen.unlink()
    p = _launch({"PATH": str(bin_dir)})
    assert p.returncode == G.EXIT_CODE and not seen.exists()


def test_the_launcher_without_a_display_says_so_and_suggests_the_command_line():
    p = _launch({})
    assert p.returncode == G.EXIT_CODE, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "no display" in p.stderr
    assert "colibri run" in p.stderr and "colibri serve" in p.stderr
    assert len([ln for ln in p.stderr.splitlines() if ln.strip()]) == 1  # one message, nothing from Qt


def test_doctor_prints_the_same_check(capsys, monkeypatch):
    chk = G.GuiCheck("xcb", ":0", True, {"libxcb-icccm.so.4": "absent"}, "debian", ["libxcb-icccm4"],
                     "sudo apt-get install libxcb-icccm4")
    monkeypatch.setattr(G, "check_gui", lambda: chk)
    assert cli_main(["doctor", "--no-disk-test"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("window") or (ln[:13].strip() == "" and "apt-get" in ln)]
    assert lines[0].startswith("window       colibri cannot open its window") and "libxcb-icccm.so.4" in lines[0]
    assert any("sudo apt-get install libxcb-icccm4" in ln for ln in lines)
    monkeypatch.setattr(G, "check_gui", lambda: G.GuiCheck("xcb", ":0", True))
    assert cli_main(["doctor", "--no-disk-test"]) == 0
    assert "window       can open (xcb on :0" in capsys.readouterr().out


def test_readme_first_command_installs_what_the_window_needs_on_debian():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = next(ln for ln in text.splitlines() if ln.startswith("    ") and "pip install" in ln)
    assert "apt-get install" in first, first
    # the same apt words as the missing-library message (no Recommends: Mesa's Vulkan drivers...)
    assert G.DISTROS["debian"][0].replace(" install", " install -y") in first, first
    for pkg in G.all_debian_packages():
        assert f" {pkg} " in first, pkg
