"""Start the desktop app: ``python -m colibri_app`` or ``colibri`` with no arguments."""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    """Create the QApplication, load the settings, show the window and open the model.

    The model is ``settings.current_model`` when it exists, else the bundled default model
    (converted into the user data directory on first run, with visible progress, on the
    worker thread). Returns the application's exit code.
    """
    from .refcount_guard import apply as guard_refcounts
    guard_refcounts()   # before any Qt call; see refcount_guard.py
    from PySide6.QtWidgets import QApplication

    from .main_window import MainWindow
    from .resources import apply_theme
    from .settings_store import load_settings

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = QApplication.instance() or QApplication(sys.argv if argv is None else [sys.argv[0], *argv])
    app.setApplicationName("colibri-desktop")
    app.setApplicationDisplayName("colibri")
    app.setOrganizationName("colibri")
    apply_theme(app)
    settings, message = load_settings()
    win = MainWindow(settings, settings_message=message)
    win.show()
    win.start()
    rc = app.exec()
    from .engine_bridge import STUCK_THREADS
    if STUCK_THREADS:
        # a hung engine thread cannot be joined; exiting normally would abort in ~QThread
        logging.shutdown()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
