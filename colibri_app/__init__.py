"""colibri-desktop GUI (PySide6 + pyqtgraph). Imports only the engine's public API."""

from . import refcount_guard as _refcount_guard

_refcount_guard.apply()  # PySide6 6.12 + Python 3.11 reference bug; see refcount_guard.py
