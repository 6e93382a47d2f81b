"""Can the desktop window open here? Checked before Qt loads its platform plugin, which on a
machine without a display or without one of the X11 libraries it links aborts the process
(SIGABRT) naming at most the first missing library.

The check (no Qt import; ctypes only):

- the platform Qt will use: ``QT_QPA_PLATFORM`` when set, else Wayland when
  ``WAYLAND_DISPLAY`` is set and the session is Wayland, else xcb (X11) when ``DISPLAY`` is
  set; none of them is "no display" (an ssh session, a server);
- a display to connect to: the X server of ``DISPLAY`` answers (``xcb_connect``), the Wayland
  socket exists; platforms that need none (offscreen, minimal, vnc, ...) skip this;
- the shared libraries QtGui, QtDBus, QtNetwork and that platform's plugin link (``NEEDED`` of
  PySide6's libQt6Gui, libQt6DBus, libQt6Network, libqxcb / libQt6XcbQpa and libqwayland; tests/test_gui_check.py
  compares this table with the installed wheel's files), each loaded by its soname as the
  dynamic loader would, then from PySide6's own Qt/lib and the frozen bundle's folder.

The result names every missing library at once, with the command that installs them on this
distribution (/etc/os-release: apt-get on Debian / Ubuntu, dnf on Fedora / RHEL, pacman on
Arch). Linux only: other systems always pass (their Qt plugins need nothing outside Qt).
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

# soname -> (Debian / Ubuntu package, Fedora package, Arch package)
QT_GUI_LIBS = {  # QtGui, QtWidgets, QtDBus, QtNetwork: needed by every platform plugin
    "libEGL.so.1": ("libegl1", "libglvnd-egl", "libglvnd"),
    "libGL.so.1": ("libgl1", "libglvnd-glx", "libglvnd"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype", "freetype2"),
    "libX11.so.6": ("libx11-6", "libX11", "libx11"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2", "glib2"),
    "libgthread-2.0.so.0": ("libglib2.0-0", "glib2", "glib2"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon", "libxkbcommon"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs", "dbus"),
    # QtNetwork: the app's one-instance socket (QLocalServer) loads it before any window
    "libgssapi_krb5.so.2": ("libgssapi-krb5-2", "krb5-libs", "krb5"),
    "libbrotlidec.so.1": ("libbrotli1", "libbrotli", "brotli"),
    "libbrotlicommon.so.1": ("libbrotli1", "libbrotli", "brotli"),
}
XCB_LIBS = {  # the xcb platform plugin (libqxcb.so and libQt6XcbQpa)
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11", "libxkbcommon-x11"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb", "libx11"),
    "libxcb.so.1": ("libxcb1", "libxcb", "libxcb"),
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm", "xcb-util-wm"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image", "xcb-util-image"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms", "xcb-util-keysyms"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb", "libxcb"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil", "xcb-util-renderutil"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb", "libxcb"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util", "xcb-util"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb", "libxcb"),
}
WAYLAND_LIBS = {  # the wayland platform plugin (libqwayland.so and libQt6WaylandClient)
    "libwayland-client.so.0": ("libwayland-client0", "libwayland-client", "wayland"),
    "libwayland-cursor.so.0": ("libwayland-cursor0", "libwayland-cursor", "wayland"),
}
PLATFORM_LIBS = {"xcb": XCB_LIBS, "wayland": WAYLAND_LIBS}
NO_DISPLAY_PLATFORMS = ("offscreen", "minimal", "minimalegl", "vnc", "linuxfb", "eglfs", "vkkhrdisplay")
# apt without Recommends: Mesa's Vulkan drivers, dbus' daemon and shared-mime-info would add a
# third to the install time, and the window needs none of them
DISTROS = {"debian": ("sudo apt-get install --no-install-recommends", 0), "fedora": ("sudo dnf install", 1),
           "arch": ("sudo pacman -S --needed", 2)}
# os-release IDs (ID, then ID_LIKE) of each family
DISTRO_IDS = {"debian": "debian", "ubuntu": "debian", "linuxmint": "debian", "pop": "debian", "raspbian": "debian",
              "fedora": "fedora", "rhel": "fedora", "centos": "fedora", "rocky": "fedora", "almalinux": "fedora",
              "arch": "arch", "manjaro": "arch", "endeavouros": "arch"}
EXIT_CODE = 3  # the window cannot open here (2 stays "bad input / unusable folder")


def _search_dirs() -> list[Path]:
    """Folders besides the loader's path where Qt's own libraries are found: PySide6's Qt/lib
    (found without importing PySide6) and the frozen bundle's folder."""
    out = []
    base = getattr(sys, "_MEIPASS", None)  # PyInstaller's documented bundle folder
    if base:
        out.append(Path(base))
    for p in sys.path:
        qt = Path(p or ".") / "PySide6" / "Qt" / "lib"
        if qt.is_dir():
            out.append(qt)
            break
    return out


def load_library(soname: str) -> str | None:
    """None when ``soname`` loads (by name, as the dynamic loader finds it, else from
    PySide6's Qt/lib or the bundle's folder), else the loader's reason. A library that is
    present but whose own dependency is missing fails with that dependency's name in the
    reason."""
    mode = getattr(os, "RTLD_LAZY", 1) | getattr(os, "RTLD_LOCAL", 0)
    try:
        ctypes.CDLL(soname, mode=mode)
        return None
    except OSError as e:
        why = str(e)
    for d in _search_dirs():
        if (d / soname).exists():
            try:
                ctypes.CDLL(str(d / soname), mode=mode)
                return None
            except OSError as e:
                why = str(e)
    return why


def _x_server_answers(display: str) -> bool | None:
    """True when the X server of ``display`` accepts a connection, False when it refuses,
    None when libxcb is absent (the library check reports that)."""
    try:
        xcb = ctypes.CDLL("libxcb.so.1")
    except OSError:
        return None
    xcb.xcb_connect.restype = ctypes.c_void_p
    xcb.xcb_connect.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    xcb.xcb_connection_has_error.argtypes = [ctypes.c_void_p]
    xcb.xcb_disconnect.argtypes = [ctypes.c_void_p]
    conn = xcb.xcb_connect(display.encode(), None)
    try:
        return bool(conn) and xcb.xcb_connection_has_error(conn) == 0
    finally:
        if conn:
            xcb.xcb_disconnect(conn)  # an errored connection is freed the same way


def _wayland_socket(env: dict) -> bool:
    name = env.get("WAYLAND_DISPLAY", "")
    path = Path(name) if os.path.isabs(name) else Path(env.get("XDG_RUNTIME_DIR", "/nonexistent")) / name
    return path.exists()


def read_os_release(path: str = "/etc/os-release") -> dict:
    """The KEY=value pairs of os-release (empty when unreadable)."""
    out = {}
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip().strip("\"'")
    return out


def distro_family(os_release: dict) -> str:
    """"debian", "fedora", "arch" or "" from os-release's ID and ID_LIKE."""
    for ident in [os_release.get("ID", "")] + os_release.get("ID_LIKE", "").split():
        fam = DISTRO_IDS.get(ident.lower())
        if fam:
            return fam
    return ""


@dataclass
class GuiCheck:
    """What :func:`check_gui` found. ``platform``: the Qt platform plugin that will load
    ("xcb", "wayland", "offscreen", ..., or "" for no display); ``display``: what the window
    would open on; ``display_ok``: it answers (True for platforms that need none);
    ``missing``: sonames that do not load, with the loader's reason; ``packages``: the
    distribution's packages providing them; ``install``: the command installing them ("" on
    an unknown distribution)."""

    platform: str
    display: str
    display_ok: bool
    missing: dict[str, str] = field(default_factory=dict)
    distro: str = ""
    packages: list[str] = field(default_factory=list)
    install: str = ""

    exit_code = EXIT_CODE

    @property
    def ok(self) -> bool:
        return self.display_ok and not self.missing

    def message(self) -> str:
        """The one message printed when the window cannot open ("" when it can)."""
        if self.ok:
            return ""
        terminal = ("In a terminal, `colibri run --prompt \"What does json.dumps do?\"` answers and "
                    "`colibri serve` serves the model to other programs, without a window.")
        if not self.platform:
            return ("colibri cannot open its window: there is no display (neither DISPLAY nor WAYLAND_DISPLAY "
                    "is set: an ssh session or a server?). " + terminal + " For the window, start it from the "
                    "desktop, or connect with `ssh -X`.")
        if not self.missing:
            return (f"colibri cannot open its window: the display {self.display} does not answer (its "
                    f"{'X server' if self.platform == 'xcb' else 'compositor'} is not running, or this user "
                    f"may not use it). " + terminal)
        names = ", ".join(sorted(self.missing))
        what = {"xcb": "Qt's X11 (xcb) platform plugin", "wayland": "Qt's Wayland platform plugin"}.get(
            self.platform, "Qt")
        text = (f"colibri cannot open its window: {what} needs {len(self.missing)} "
                f"{'library' if len(self.missing) == 1 else 'libraries'} this system lacks: {names}.\n")
        if self.install:
            text += f"Install {'it' if len(self.missing) == 1 else 'them'} with:\n\n    {self.install}\n\n"
        else:
            text += ("Install the packages of your distribution that provide them (on Debian / Ubuntu: "
                     f"{' '.join(_packages(self.missing, 0))}).\n")
        return text + "then run `colibri` again (`colibri doctor` repeats this check). " + terminal


def _packages(missing, col: int) -> list[str]:
    table = {**QT_GUI_LIBS, **XCB_LIBS, **WAYLAND_LIBS}
    out = []
    for so in sorted(missing):
        pkg = table.get(so, (None, None, None))[col]
        if pkg and pkg not in out:
            out.append(pkg)
    return out


def qt_platform(env: dict) -> tuple[str, str]:
    """(platform plugin Qt will try, the display it names) from the environment: "" when
    there is no display at all."""
    forced = env.get("QT_QPA_PLATFORM", "").split(";")[0].split(":")[0].strip().lower()
    if forced:
        return forced, env.get("WAYLAND_DISPLAY", "") if forced.startswith("wayland") else env.get("DISPLAY", "")
    wayland = env.get("WAYLAND_DISPLAY", "")
    if wayland and (env.get("XDG_SESSION_TYPE", "").lower() == "wayland" or not env.get("DISPLAY")):
        return "wayland", wayland
    if env.get("DISPLAY"):
        return "xcb", env["DISPLAY"]
    return "", ""


def check_gui(env: dict | None = None, load=None, os_release: dict | None = None,
              x_server=None) -> GuiCheck:
    """Whether the desktop window can open here (see the module doc). ``env`` (default
    os.environ), ``load`` (soname -> None or the reason it does not load; default
    :func:`load_library`), ``os_release`` and ``x_server`` (display -> bool or None) are
    parameters so tests can stand in for the machine. Never raises."""
    env = dict(os.environ if env is None else env)
    load = load or load_library
    x_server = x_server or _x_server_answers
    fam = distro_family(read_os_release() if os_release is None else os_release)
    if not sys.platform.startswith("linux"):
        return GuiCheck("native", "", True, distro=fam)
    plat, display = qt_platform(env)
    base = plat.split("-")[0]  # "wayland-egl" uses the wayland libraries
    libs = dict(QT_GUI_LIBS)
    libs.update(PLATFORM_LIBS.get("wayland" if base.startswith("wayland") else base, {}))
    missing = {}
    if plat:
        for so in libs:
            why = load(so)
            if why is not None:
                missing[so] = why
        # a library that is there but whose own dependency is not: name the dependency too
        for so, why in list(missing.items()):
            dep = why.split(":", 1)[0].strip()
            if dep.startswith("lib") and ".so" in dep and dep != so and dep not in missing and "/" not in dep:
                missing[dep] = why
    if not plat:
        display_ok = False
    elif base in NO_DISPLAY_PLATFORMS:
        display_ok = True
    elif base == "xcb":
        answer = x_server(display) if display else False
        display_ok = answer is not False  # None: libxcb missing, reported with the libraries
    elif base.startswith("wayland"):
        display_ok = bool(display) and _wayland_socket(env)
    else:
        display_ok = True  # a platform we do not know: let Qt try it
    col = DISTROS[fam][1] if fam else 0
    pkgs = _packages(missing, col)
    install = f"{DISTROS[fam][0]} {' '.join(pkgs)}" if fam and pkgs else ""
    return GuiCheck(plat, display, display_ok, missing, fam, pkgs, install)


def all_debian_packages() -> list[str]:
    """Every Debian / Ubuntu package the window may need (X11 and the common Qt libraries):
    the README's install line."""
    return _packages(list(QT_GUI_LIBS) + list(XCB_LIBS), 0)
