"""Guard against a reference-count bug of PySide6 6.12 on Python < 3.12.

PySide6 6.12.0 returns ``None`` from void methods (``QLabel.setText``, ``setData`` ...) and
``True`` from ``SignalInstance.emit`` without taking a reference. From Python 3.12 on these
singletons are immortal and nothing happens; on 3.11 every such call drops one reference and
after a few thousand calls the interpreter aborts ("Fatal Python error: none_dealloc /
bool_dealloc"). A streaming chat makes thousands of those calls a minute.

:func:`apply` gives the singletons a reserve of references (what 3.12 does by making them
immortal). The singletons are never freed anyway, so the extra references cost nothing.
No Qt import here: ``colibri_app/__init__`` applies it before any Qt code runs.
"""

from __future__ import annotations

import ctypes
import sys

RESERVE = 1 << 40
_applied = False


def _shiboken_version() -> str:
    try:
        from importlib.metadata import version
        return version("shiboken6")
    except Exception:  # noqa: BLE001 - not installed / unknown: assume affected
        return ""


def needed() -> bool:
    """True on CPython release builds older than 3.12 (no immortal objects) with shiboken6 6.12.x
    (or an unknown version). pyproject.toml excludes 6.12; this covers installs that still have it."""
    if (sys.implementation.name != "cpython" or sys.version_info >= (3, 12)
            or hasattr(sys, "gettotalrefcount")):   # debug builds lay out PyObject differently
        return False
    v = _shiboken_version()
    return not v or v.startswith("6.12.")


def apply() -> bool:
    """Add RESERVE references to None, True and False once per process; returns True if done."""
    global _applied
    if _applied or not needed():
        return False
    for obj in (None, True, False):
        ctypes.c_ssize_t.from_address(id(obj)).value += RESERVE  # ob_refcnt is PyObject's first field
    _applied = True
    return True
