"""colibri-desktop GUI (PySide6 + pyqtgraph). Imports only the engine's public API."""
