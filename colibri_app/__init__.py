"""colibri-desktop GUI (PySide6 + pyqtgraph). Imports only the engine's public API.

PySide6-Essentials is pinned below 6.12 in pyproject.toml: 6.12.0 drops a reference to
None/True on every void call and ``emit`` (fatal on Python 3.11), so no workaround is needed.
"""
