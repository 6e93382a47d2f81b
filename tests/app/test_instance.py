"""One app instance per data folder. A second start of the app on
the same data folder either brings the first window to the front (and ends with exit code 0),
or, when the first does not answer, runs read-only on the history with a visible note. Each
test runs the other instance in a second process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent.parent
SHOTS = os.environ.get("COLIBRI_SHOTS_DIR")

FIRST_WINDOW = textwrap.dedent(r'''
    import sys
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication
    from engine import EngineConfig, SamplingParams
    from engine import library as paths
    from colibri_app.instance import PRIMARY, claim
    from colibri_app.main_window import MainWindow
    from colibri_app.settings_store import Settings
    app = QApplication([])
    inst = claim(paths.user_data_dir())
    assert inst.mode == PRIMARY, inst.mode
    win = MainWindow(Settings(engine=EngineConfig(), sampling=SamplingParams(), current_model=""))
    win.show()
    def activated():
        win.bring_to_front()
        print("activated:", win.statusBar().currentMessage(), flush=True)
        QTimer.singleShot(100, win.close)
    inst.listen(activated)
    print("ready", flush=True)
    QTimer.singleShot(60000, app.quit)   # safety net
    app.exec()
    inst.release()
''')

HUNG_FIRST = textwrap.dedent(r'''
    import sys
    from PySide6.QtCore import QCoreApplication
    from engine import library as paths
    from colibri_app.history import STREAMING, History
    from colibri_app.instance import PRIMARY, claim
    app = QCoreApplication([])
    inst = claim(paths.user_data_dir())
    assert inst.mode == PRIMARY, inst.mode
    h, _ = History.open()
    c = h.create_conversation("being answered in the first window")
    h.add_message(c.id, "user", "a question")
    h.add_message(c.id, "assistant", "half an answer", STREAMING)
    print("ready", flush=True)
    sys.stdin.read()          # holds the folder (and never answers the socket) until told to end
''')


def _start(code: str, env: dict) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise AssertionError(f"the first instance did not start: {line}{p.stderr.read()[-3000:]}")
    return p


def _env() -> dict:
    return dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT))


def test_second_start_brings_the_first_window_forward(app_dirs):
    env = _env()
    first = _start(FIRST_WINDOW, env)
    try:
        # the second start hands over and ends (a hang, not a slow machine, trips the timeout)
        second = subprocess.run([sys.executable, "-m", "colibri_app"], capture_output=True, text=True,
                                timeout=600, env=env, cwd=str(ROOT))
        assert second.returncode == 0, second.stderr[-3000:]
        assert "already running" in second.stdout and f"pid {first.pid}" in second.stdout, second.stdout
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    assert "activated: colibri is already running" in out, out + err[-3000:]
    assert first.returncode == 0, err[-3000:]


def test_second_start_runs_read_only_when_the_first_does_not_answer(qtbot, app_dirs):
    from PySide6.QtCore import Qt
    from engine import EngineConfig, SamplingParams
    from engine import library as paths
    from colibri_app.history import STREAMING, History
    from colibri_app.instance import PRIMARY, READ_ONLY, claim
    from colibri_app.main_window import MainWindow, ui_state_path
    from colibri_app.settings_store import Settings

    first = _start(HUNG_FIRST, _env())
    try:
        inst = claim(paths.user_data_dir(), timeout_ms=500)
        assert inst.mode == READ_ONLY and f"pid {first.pid}" in inst.owner
        win = MainWindow(Settings(engine=EngineConfig(), sampling=SamplingParams(), current_model=""),
                         read_only=inst.read_only_reason)
        qtbot.addWidget(win)
        win.show()
        win.start()
        assert win.read_only_note.isVisible()
        assert "Another colibri window" in win.read_only_note.text.text() and "read-only" in win.read_only_note.text.text()
        # the history of the first instance is shown, not repaired: its answer is still streaming
        assert win.sidebar.list.count() == 1
        conv = win.sidebar.list.item(0).data(Qt.UserRole)
        win.select_conversation(conv)
        assert [v.status for v in win.chat.views.values()] == ["complete", STREAMING]
        # nothing can be written or opened from here
        assert not win.chat.send_btn.isEnabled() and "Read-only" in win.chat.input.placeholderText()
        assert not any(a.isEnabled() for a in (win.act_settings, win.act_add, win.act_models, win.act_new))
        assert not win.sidebar.rename_btn.isEnabled() and not win.sidebar.delete_btn.isEnabled()
        win.delete_conversation(conv, confirm=False)
        win.rename_conversation(conv, "renamed")
        assert win.controller.lane.tasks() == [] and win.loaded is None
        if SHOTS:
            from PySide6.QtWidgets import QApplication
            from colibri_app.resources import apply_theme
            apply_theme(QApplication.instance())
            qtbot.wait(300)
            win.grab().save(os.path.join(SHOTS, "read-only-window.png"))
        win.close()
        assert not ui_state_path().exists()
        h, _ = History.open(read_only=True)
        msgs = h.messages(conv)
        assert h.conversation(conv).title == "being answered in the first window"
        assert [(m.content, m.status) for m in msgs][-1] == ("half an answer", STREAMING)
        h.close()
    finally:
        first.stdin.close()
        first.wait(600)
    # the first instance ended: its lock is taken over
    again = claim(paths.user_data_dir(), timeout_ms=500)
    try:
        assert again.mode == PRIMARY
    finally:
        again.release()


def test_a_data_folder_that_cannot_be_locked_opens_read_only_and_says_why(qtbot, tmp_path):
    from colibri_app.instance import READ_ONLY, claim
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    c = claim(blocker / "data", timeout_ms=200)
    assert c.mode == READ_ONLY and c.problem
    assert "cannot be locked" in c.read_only_reason and "COLIBRI_DATA_DIR" in c.read_only_reason
