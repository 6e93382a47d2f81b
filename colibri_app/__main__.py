"""Start the desktop app: ``python -m colibri_app`` or ``colibri`` with no arguments."""

from __future__ import annotations

import logging
import os
import signal
import sys


def folder_problem_at_start() -> str | None:
    """None when the data and config folders exist or could be created, else the sentence
    saying which one is a file (or cannot be created) and what to do (engine.library)."""
    from engine import library as paths
    for folder in (paths.user_data_dir, paths.user_config_dir):
        try:
            folder()
        except OSError as e:  # FolderError: the message names the path, the variable and the remedy
            return str(e)
    return None


def window_problem_at_start() -> tuple[str, int] | None:
    """None when the window can open here, else (the message naming the missing display or
    every missing library with the install command, the exit code): checked before Qt loads
    its platform plugin, which would abort the process naming one library at most."""
    qtw = sys.modules.get("PySide6.QtWidgets")
    if qtw is not None and qtw.QApplication.instance() is not None:
        return None  # Qt is up already (an embedding program, the tests)
    from engine import check_gui
    chk = check_gui()
    return None if chk.ok else (chk.message(), chk.exit_code)


# programs a desktop has for a message from a process without a window, the modal ones first
# (zenity: GNOME and most others, kdialog: KDE, xmessage: any X server), then a notification
NOTIFIERS = (("zenity", "--error", "--no-wrap", "--title=colibri cannot start", "--text={}"),
             ("kdialog", "--title", "colibri cannot start", "--error", "{}"),
             ("xmessage", "-center", "{}"),
             ("notify-send", "--urgency=critical", "colibri cannot start", "{}"))


def tell_outside_terminal(text: str, stream=None) -> str:
    """When ``stream`` (stderr) is no terminal (started from a menu or a file manager, where
    nobody reads stderr) and the window cannot open although a display answers (a missing
    library), show ``text`` with the first of NOTIFIERS on the PATH (waiting until it is
    closed). Returns the notifier's name, "" when none was used."""
    import shutil
    import subprocess
    stream = sys.stderr if stream is None else stream
    try:
        if stream.isatty():
            return ""
    except (AttributeError, ValueError):  # a closed or replaced stream: nobody reads it either
        pass
    for name, *args in NOTIFIERS:
        exe = shutil.which(name)
        if exe is None:
            continue
        body = text.replace("`", "'") if name != "zenity" else text.replace("&", "&amp;").replace("<", "&lt;")
        try:
            subprocess.run([exe, *(x.format(body) for x in args)], timeout=3600, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            continue
        return name
    return ""


def show_fatal(text: str) -> None:
    """Tell the user why the app cannot start (a modal message box; tests replace it)."""
    from PySide6.QtWidgets import QMessageBox
    QMessageBox.critical(None, "colibri cannot start", text)


def main(argv: list[str] | None = None) -> int:
    """Create the QApplication, load the settings, show the window and open the model.

    The model is ``settings.current_model`` when it exists, else the bundled default model
    (converted into the user data directory on first run, with visible progress, on the
    worker thread). Returns the application's exit code (2, after a message box, when the data
    or config folder cannot be used: folder_problem_at_start; 3, after one message on stderr,
    when there is no display or a library the window needs is missing: window_problem_at_start).
    """
    problem = window_problem_at_start()
    if problem:
        print(problem[0], file=sys.stderr)
        if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
            tell_outside_terminal(problem[0])  # a display may answer while Qt cannot load
        return problem[1]
    from PySide6.QtCore import QTimer
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication

    from engine import library as paths

    from .instance import FOCUSED, claim
    from .main_window import MainWindow
    from .resources import apply_theme
    from .settings_store import load_settings

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = QApplication.instance() or QApplication(sys.argv if argv is None else [sys.argv[0], *argv])
    app.setApplicationName("colibri-desktop")
    app.setApplicationDisplayName("colibri")
    app.setOrganizationName("colibri")
    app.setDesktopFileName("colibri-desktop")  # matches packaging/linux/colibri-desktop.desktop
    icon = paths.resources_dir() / "icons" / "colibri-desktop.png"
    if icon.is_file():
        app.setWindowIcon(QIcon(str(icon)))
    why = folder_problem_at_start()
    if why:
        print(f"colibri: error: {why}", file=sys.stderr)
        show_fatal(why)
        return 2
    # one instance per data folder: a second start brings the first window to the front, or
    # (when the first does not answer) opens the history read-only
    inst = claim(paths.user_data_dir())
    if inst.mode == FOCUSED:
        print(f"colibri is already running on {inst.data_dir} ({inst.owner}); brought its window to the front.")
        return 0
    settings, message = load_settings()
    apply_theme(app, settings.app.theme)
    win = MainWindow(settings, settings_message=message, read_only=inst.read_only_reason)
    inst.listen(win.bring_to_front)
    win.show()
    win.start()
    # Ctrl+C / SIGTERM close the window the normal way (stop, store the answer, close the engine);
    # the timer lets the interpreter run its signal handlers while Qt's loop is in C++.
    previous = {sig: signal.signal(sig, lambda *_: QTimer.singleShot(0, win.close))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    tick = QTimer()
    tick.timeout.connect(lambda: None)
    tick.start(250)
    try:
        rc = app.exec()
    finally:
        tick.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    from .workers import STUCK, shutdown_all
    shutdown_all()   # normally a no-op: the window joined its tasks when it closed
    inst.release()
    if STUCK:
        # a hung worker thread cannot be joined; exiting normally would wait for it forever
        logging.shutdown()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
