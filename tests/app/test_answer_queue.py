"""One engine, several chats. A message sent in another chat while an answer
is being written is kept and waits its turn with a visible note (never silently dropped); Stop
shows only in the chat being answered and stops only that answer; the sidebar marks the chat
being answered and the chats waiting. Also its siblings: Regenerate in another chat, and taking
a waiting message back ("Don't send")."""

from __future__ import annotations

import os
from dataclasses import replace

from PySide6.QtCore import Qt

from engine import SamplingParams
from colibri_app.history import COMPLETE, STOPPED

SHOTS = os.environ.get("COLIBRI_SHOTS_DIR")   # set to save screenshots of the new states


def _marks(win) -> dict:
    lst = win.sidebar.list
    return {lst.item(i).data(Qt.UserRole): lst.item(i).data(Qt.UserRole + 1) for i in range(lst.count())}


def _long_answer(qtbot, win, text):
    seen = []
    win.controller.worker.token.connect(seen.append, Qt.DirectConnection)
    win.send(text)
    qtbot.waitUntil(lambda: len(seen) >= 2, timeout=1_800_000)
    return win.conv_id


def test_send_in_another_chat_while_answering_waits_visibly(qtbot, make_window):
    win = make_window(max_new_tokens=400)
    a = _long_answer(qtbot, win, "Tell me a long story")
    win.new_chat()
    assert win.chat.send_btn.text() == "Send"             # the empty chat is not the one answering
    win.chat.input.setPlainText("a second question")
    qtbot.keyClick(win.chat.input, Qt.Key_Return)
    b = win.conv_id
    assert b is not None and b != a
    assert [(m.role, m.content) for m in win.history.messages(b)] == [("user", "a second question")]
    assert [v.role for v in win.chat.views.values()] == ["user"]
    assert win.queued_note.isVisible()
    assert "Waiting for the answer in “Tell me a long story”" in win.queued_note.text.text()
    assert "Waiting for the answer in “Tell me a long story”" in win.chat.input.placeholderText()
    assert win.chat.send_btn.text() == "Send" and not win.chat.send_btn.isEnabled()
    assert _marks(win) == {a: "generating…", b: "waiting"}
    assert any("generating" in win.sidebar.list.item(i).text() for i in range(win.sidebar.list.count()))
    if SHOTS:
        from PySide6.QtWidgets import QApplication
        from colibri_app.resources import apply_theme
        apply_theme(QApplication.instance())
        qtbot.wait(300)
        win.grab().save(os.path.join(SHOTS, "queued-message.png"))
    # Esc in the waiting chat does not stop the other chat's answer
    qtbot.keyClick(win, Qt.Key_Escape)
    win.stop()
    assert not win.controller.job.cancel.is_set() and win.answer.conv_id == a
    # (under load the first token can take long: wait until the answer has streamed some text
    # while the other chat is on screen)
    qtbot.waitUntil(lambda: bool(win.answer.full_text), timeout=1_800_000)
    # the answering chat has the Stop button; stopping it starts the waiting one
    win.select_conversation(a)
    assert win.chat.send_btn.text() == "Stop" and not win.queued_note.isVisible()
    # the answer streamed on while another chat was on screen: all of it is shown again
    card = win.chat.view(win.answer.asst_id)
    assert card is not None and card.content and card.content == win.answer.full_text
    win.chat.send_btn.click()
    qtbot.waitUntil(lambda: win.answer is not None and win.answer.conv_id == b, timeout=1_800_000)
    assert win.chat.send_btn.text() == "Send" and win.chat.send_btn.isEnabled()   # A is idle now: B answers
    assert _marks(win) == {a: "", b: "generating…"}
    win.select_conversation(b)
    assert win.chat.send_btn.text() == "Stop"
    qtbot.waitUntil(lambda: win.answer is None, timeout=1_800_000)
    assert win.history.messages(a)[-1].status == STOPPED
    assert [(m.role, m.status) for m in win.history.messages(b)] == [("user", COMPLETE), ("assistant", COMPLETE)]
    assert not win.queued_note.isVisible() and win.chat.send_btn.isEnabled()
    assert _marks(win) == {a: "", b: ""}


def test_regenerate_elsewhere_waits_and_a_waiting_message_can_be_taken_back(qtbot, make_window):
    win = make_window(max_new_tokens=3)
    done = []
    win.controller.worker.finished.connect(done.append, Qt.DirectConnection)
    win.send("an old chat")
    qtbot.waitUntil(lambda: bool(done) and win.answer is None, timeout=1_800_000)
    old = win.conv_id
    old_answer = win.history.messages(old)[-1].id
    win.settings = replace(win.settings, sampling=SamplingParams(max_new_tokens=400))
    win.new_chat()
    a = _long_answer(qtbot, win, "Tell me a long story")
    # Regenerate in the old chat: waits (its old answer is replaced once the engine is free)
    win.select_conversation(old)
    qtbot.waitUntil(lambda: win.chat.view(old_answer).regen_btn.isVisibleTo(win), timeout=1_800_000)
    win.regenerate()
    assert win.queued_conversations() == [old] and win.queued_note.isVisible()
    # a new chat's message waits too, and "Don't send" takes it back into the prompt box
    win.new_chat()
    win.send("never mind")
    b = win.conv_id
    assert win.queued_conversations() == [old, b]
    win.queued_note.button.click()
    assert win.queued_conversations() == [old] and win.history.messages(b) == []
    assert win.chat.input.toPlainText() == "never mind" and win.chat.send_btn.isEnabled()
    win.select_conversation(a)
    win.stop()
    qtbot.waitUntil(lambda: win.answer is not None and win.answer.conv_id == old, timeout=1_800_000)
    qtbot.waitUntil(lambda: win.answer is None, timeout=1_800_000)
    msgs = win.history.messages(old)
    assert [(m.role, m.status) for m in msgs] == [("user", COMPLETE), ("assistant", COMPLETE)]
    assert msgs[-1].id != old_answer
