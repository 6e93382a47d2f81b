"""Another program takes the chat history's lock while the window runs (a database browser's
write transaction, a backup tool): nothing the user made is lost and the window does not stop.
A message sent meanwhile stays in the box with a note; an answer being written is shown whole
and saved once the lock goes."""

from __future__ import annotations

import sqlite3

from PySide6.QtCore import Qt

from colibri_app.history import COMPLETE
from engine.errors import ErrorKind
from history_lock import hold_lock as _hold, release as _release


def _rows(path):
    conn = sqlite3.connect(str(path))
    try:
        return conn.execute("SELECT role, content, status FROM messages ORDER BY id").fetchall()
    finally:
        conn.close()


def test_a_message_sent_while_the_history_is_locked_stays_in_the_box(qtbot, make_window):
    win = make_window()
    holder = _hold(win.history.path)
    try:
        win.chat.input.setPlainText("What does json.dumps do?")
        qtbot.keyClick(win.chat.input, Qt.Key_Return)
        assert win.chat.input.toPlainText() == "What does json.dumps do?"
        assert win.banner.isVisible() and win.banner.kind == ErrorKind.HISTORY
        assert f"pid {holder.pid}" in win.banner.text.text() and win.answer is None
    finally:
        _release(holder)
    qtbot.waitUntil(lambda: not win.banner.isVisible(), timeout=600_000)   # the retry found it free
    from answer_helpers import wait_finished
    wait_finished(qtbot, win, lambda: qtbot.keyClick(win.chat.input, Qt.Key_Return))
    assert [r[:1] + r[2:] for r in _rows(win.history.path)] == [("user", COMPLETE), ("assistant", COMPLETE)]


def test_an_answer_written_while_the_history_is_locked_is_saved_once_it_is_free(qtbot, make_window):
    from answer_helpers import wait_finished
    win = make_window(max_new_tokens=40)
    holder = []

    def lock_at_the_second_token(ev):
        # on the engine's thread: the answer cannot end before the other program holds the lock
        if len(holder) == 0 and ev.index >= 1:
            holder.append(_hold(win.history.path))

    win.controller.worker.token.connect(lock_at_the_second_token, Qt.DirectConnection)
    try:
        ev = wait_finished(qtbot, win, lambda: win.send("Tell me a long story"))
        assert holder and win.history.waiting_writes > 0 and win.banner.kind == ErrorKind.HISTORY
        assert win.chat.view(win.history.messages(win.conv_id)[-1].id) is not None
    finally:
        for h in holder:
            _release(h)
    qtbot.waitUntil(lambda: win.history.waiting_writes == 0, timeout=600_000)
    assert not win.banner.isVisible()
    assert _rows(win.history.path) == [("user", "Tell me a long story", COMPLETE),
                                       ("assistant", ev.text, COMPLETE)]


def test_a_history_locked_at_start_opens_for_writing_once_it_is_free(qtbot, app_dirs, make_window, monkeypatch):
    """Locked when the window opens: read-only with a note; once the other program lets go the
    same window opens the history for writing and the model, without a restart."""
    from colibri_app import history as hist
    from colibri_app.history import History, history_path
    from answer_helpers import send
    monkeypatch.setattr(hist, "BUSY_WAIT_S", 0.2)
    h, _ = History.open()
    c = h.create_conversation("mine")
    h.add_message(c.id, "user", "q")
    h.close()
    holder = _hold(history_path())
    try:
        win = make_window(wait_loaded=False)
        win.start()
        assert win.read_only and win.read_only_note.isVisible() and win.loaded is None
        assert "as soon as it lets go" in win.read_only_note.text.text()
    finally:
        _release(holder)
    qtbot.waitUntil(lambda: win.loaded is not None, timeout=1_800_000)   # only a hang: a first compile
    assert not win.read_only and not win.read_only_note.isVisible() and win.sidebar.new_btn.isEnabled()
    assert win.sidebar.list.count() == 1
    win.new_chat()
    send(qtbot, win, "a new question")
    assert [r[0] for r in _rows(history_path())] == ["user", "user", "assistant"]
