"""What a first start shows: the bundled model says what it is, what it is good at and where it
is wrong, with a link to the recommendations; the prompt box's placeholder is repainted when
its text changes (it stayed on "Loading the model…" after "Model ready")."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


from engine import library  # noqa: E402
from colibri_app import wizard as wz  # noqa: E402
from colibri_app.chat_view import PromptEdit  # noqa: E402


def _on_screen_as_drawn(w) -> bool:
    """What the window system shows of ``w`` equals what ``w`` draws now."""
    from PySide6.QtWidgets import QApplication
    shown = QApplication.primaryScreen().grabWindow(w.window().winId(), *_origin(w), w.width(), w.height()).toImage()
    drawn = w.grab().toImage()
    return shown.convertToFormat(drawn.format()) == drawn


def _origin(w) -> tuple[int, int]:
    p = w.mapTo(w.window(), w.rect().topLeft())
    return p.x(), p.y()


def test_a_new_placeholder_over_a_shown_one_reaches_the_screen(qtbot):
    """On a real window system (and the offscreen one) the old placeholder stayed on screen:
    Qt repaints the box only when the placeholder appears or disappears."""
    box = PromptEdit()
    qtbot.addWidget(box)
    box.resize(600, 40)
    box.show()
    qtbot.waitExposed(box)
    box.set_placeholders("Loading the model…")
    qtbot.waitUntil(lambda: _on_screen_as_drawn(box.viewport()), timeout=1_800_000)
    box.set_placeholders("Message the model…  (Enter to send)")
    qtbot.waitUntil(lambda: _on_screen_as_drawn(box.viewport()), timeout=1_800_000)


def test_the_bundled_model_says_what_it_is_and_links_to_the_recommendations(make_window, qtbot, monkeypatch):
    win = make_window()
    assert "bundled" not in win.chat.empty_label.text()  # another model: the general line
    assert win.chat.input.placeholderText().startswith("Message the model")
    win.on_loaded(replace(win.loaded, model_name=library.DEFAULT_MODEL))
    intro = win.chat.empty_label.text()
    for part in ("bundled model", "offline", "standard library", "What does", "How do I", "follow-up",
                 "Recommended for this computer"):
        assert part in intro, part
    assert win.chat.empty_label.isVisible()
    assert "json.dumps" in win.chat.input.placeholderText()
    shown = []
    monkeypatch.setattr(win, "_show_dialog", lambda dlg: shown.append(dlg))
    win.chat.empty_label.linkActivated.emit("recommended")
    assert shown and shown[0].startId() == wz.PAGE_RECOMMENDED
    shown[0].deleteLater()
    win.on_loaded(replace(win.loaded, model_name="tiny-olmoe"))  # switching away: the general texts again
    assert "bundled" not in win.chat.empty_label.text()
    assert win.chat.input.placeholderText().startswith("Message the model")


def test_editing_the_first_message_renames_the_chat_unless_renamed(qtbot, make_window):
    """The chat is named after its first message; editing that message names it anew (the
    title kept the old text). A title the user chose stays."""
    from answer_helpers import send, wait_finished
    from PySide6.QtCore import Qt
    win = make_window(max_new_tokens=3)
    send(qtbot, win, "What does len do?")
    conv = win.conv_id
    assert win.history.conversation(conv).title == "What does len do?"
    first = win.history.messages(conv)[0].id
    win.edit_message(first)
    win.chat.input.setPlainText("What does json.dumps do?")
    wait_finished(qtbot, win, lambda: qtbot.keyClick(win.chat.input, Qt.Key_Return))
    assert win.history.conversation(conv).title == "What does json.dumps do?"
    assert win.chat.title_label.text() == "What does json.dumps do?"
    assert win.sidebar.list.item(0).text().startswith("What does json.dumps do?") or any(
        "json.dumps" in win.sidebar.list.item(i).text() for i in range(win.sidebar.list.count()))
    win.rename_conversation(conv, "My chat")
    first = win.history.messages(conv)[0].id
    win.edit_message(first)
    win.chat.input.setPlainText("What does os.path.join do?")
    wait_finished(qtbot, win, lambda: qtbot.keyClick(win.chat.input, Qt.Key_Return))
    assert win.history.conversation(conv).title == "My chat"


def test_the_model_library_is_wide_enough_for_its_columns(qtbot, app_dirs, monkeypatch):
    from colibri_app.library import ModelLibraryDialog
    from engine.library import ModelEntry
    long = ModelEntry("Qwen3-Coder-30B-A3B-Instruct", "hf://Qwen/Qwen3-Coder-30B-A3B-Instruct@0123456789abcdef",
                      "int4", 17_890_000_000, "2026-12-07T08:00:00Z", "/home/u/.local/share/colibri-desktop/models/x",
                      family="qwen3_moe")
    from PySide6.QtCore import QRect

    class Screen:  # a desktop wider than the test platform's 800 px
        def availableGeometry(self):  # noqa: N802 - Qt's name
            return QRect(0, 0, 1920, 1080)
    monkeypatch.setattr(ModelLibraryDialog, "screen", lambda self: Screen())
    dlg = ModelLibraryDialog(None)
    qtbot.addWidget(dlg)
    dlg.show()
    dlg._show([long])
    t = dlg.table
    need = sum(max(t.sizeHintForColumn(j), t.horizontalHeader().sectionSizeHint(j)) for j in range(t.columnCount()))
    assert dlg.width() >= need, (dlg.width(), need)
    for j in range(dlg.table.columnCount()):  # no column is cut: each at least its contents' width
        assert dlg.table.columnWidth(j) >= dlg.table.sizeHintForColumn(j) - 1, j


def test_the_model_library_stays_on_the_screen_when_it_widens(qtbot, app_dirs, monkeypatch):
    """The dialog is placed for its first size, then widened for its table when the scan ends:
    its right part and Close button went past the screen's edge."""
    from PySide6.QtCore import QRect
    from colibri_app.library import ModelLibraryDialog
    from engine.library import ModelEntry
    long = ModelEntry("Qwen3-Coder-30B-A3B-Instruct", "hf://Qwen/Qwen3-Coder-30B-A3B-Instruct@0123456789abcdef",
                      "int4", 17_890_000_000, "2026-12-07T08:00:00Z", "/home/u/.local/share/colibri-desktop/models/x",
                      family="qwen3_moe")

    class Screen:
        def availableGeometry(self):  # noqa: N802 - Qt's name
            return QRect(0, 0, 1400, 900)
    monkeypatch.setattr(ModelLibraryDialog, "screen", lambda self: Screen())
    dlg = ModelLibraryDialog(None)
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.move(600, 230)
    dlg._show([long])
    assert dlg.width() > 1400 - 600
    assert 0 <= dlg.frameGeometry().left() and dlg.frameGeometry().right() < 1400


def test_a_newly_opened_model_does_not_show_the_last_ones_speed(qtbot, make_window):
    """After switching models (or a setting that reopens it) the status bar kept the previous
    model's tok/s and TTFT beside the new model's name, while the plots started anew."""
    from answer_helpers import send
    win = make_window(max_new_tokens=3)
    send(qtbot, win, "What does len do?")
    assert win.st_speed.text()[0].isdigit() and win.st_ttft.text() != "TTFT –"
    win.on_loaded(replace(win.loaded, model_name="another-model"))
    assert win.st_speed.text() == "– tok/s" and win.st_ttft.text() == "TTFT –"
