"""ChatView: the collapsed Thinking section and the no-chat-template banner with raw mode."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from PySide6.QtGui import QGuiApplication

from colibri_app.chat_view import ChatView, MessageView
from colibri_app.history import COMPLETE, STREAMING, Message
from engine import ChatMessage, SamplingParams


def _assistant(qtbot, text="", status=STREAMING) -> MessageView:
    v = MessageView(Message(1, 1, "assistant", text, status))
    qtbot.addWidget(v)
    v.show()
    return v


def test_thinking_streams_collapsed_then_answer(qtbot):
    v = _assistant(qtbot)
    for piece in ["<thi", "nk>\nLet me", " think.", "\n</think>\n\n", "The answer", " is 4."]:
        v.append_stream(piece)
        if piece == " think.":  # while reasoning streams: a collapsed "Thinking…" header only
            assert v.think_btn.isVisible() and v.think_btn.text() == "Thinking…"
            assert not v.think_text.isVisible()
            assert v.text.toPlainText() == ""
    assert v.text.toPlainText() == "The answer is 4."
    assert v.think_btn.text().startswith("Thought")
    assert v.think_text.toPlainText() == "Let me think."
    assert not v.think_text.isVisible()
    v.think_btn.click()  # expand
    assert v.think_text.isVisible()
    v.think_btn.click()
    assert not v.think_text.isVisible()
    # the saved text keeps the reasoning; the final render shows only the answer
    assert v.content == "<think>\nLet me think.\n</think>\n\nThe answer is 4."
    v.set_content(v.content, COMPLETE)
    assert v.text.toPlainText().strip() == "The answer is 4."
    assert v.think_btn.isVisible() and v.think_text.toPlainText() == "Let me think."


def test_no_reasoning_no_section_and_copy_copies_answer(qtbot):
    v = _assistant(qtbot, "plain answer", COMPLETE)
    assert not v.think_btn.isVisible()
    cv = ChatView()
    qtbot.addWidget(cv)
    m = cv.add_message(Message(7, 1, "assistant", "<think>r</think>\n\nhello", COMPLETE))
    assert not m.think_btn.isHidden() and m.answer == "hello" and m.reasoning == "r"
    cv._copy(7)
    assert QGuiApplication.clipboard().text() == "hello"


def test_a_long_pasted_message_shows_its_start_and_show_all(qtbot):
    from colibri_app.chat_view import LONG_MESSAGE_CHARS
    from colibri_app.history import ERROR
    text = "line of a long log\n" * 20000
    cv = ChatView()
    qtbot.addWidget(cv)
    cv.show()
    v = cv.add_message(Message(3, 1, "user", text, COMPLETE))
    shown = v.text.toPlainText()
    assert len(shown) < LONG_MESSAGE_CHARS + 10 and text.startswith(shown[:-2])
    assert not v.more_btn.isHidden() and f"{len(text):,} characters" in v.more_btn.text()
    v.set_content(text, ERROR)                       # a status change keeps the short form
    assert v.text.toPlainText() == shown
    v.more_btn.click()
    assert v.text.toPlainText() == text and v.more_btn.text() == "Show less"
    cv._copy(3)
    assert QGuiApplication.clipboard().text() == text and v.content == text
    short = cv.add_message(Message(4, 1, "user", "short", COMPLETE))
    assert short.more_btn.isHidden() and short.text.toPlainText() == "short"


def test_no_template_banner_and_raw_mode(qtbot):
    cv = ChatView()
    qtbot.addWidget(cv)
    cv.show()
    cv.set_chat_template(True)
    cv.set_ready(True)
    assert not cv.template_banner.isVisible() and cv.send_btn.isEnabled()
    msgs = (ChatMessage("system", "be brief"), ChatMessage("user", "a"), ChatMessage("assistant", "b"),
            ChatMessage("user", "c"))
    sp = SamplingParams(max_new_tokens=3)
    assert cv.build_request(msgs, sp).messages == msgs

    cv.set_chat_template(False)
    assert cv.template_banner.isVisible() and "no chat template" in cv.template_label.text()
    assert not cv.send_btn.isEnabled()  # nothing runs raw until the user chooses it
    sent = []
    cv.send_requested.connect(sent.append)
    cv.input.setPlainText("hello")
    cv._submit()
    assert sent == [] and "raw mode" in cv.input.placeholderText()
    cv.raw_btn.click()
    assert cv.raw_mode and cv.send_btn.isEnabled() and cv.template_banner.isVisible()
    cv._submit()
    assert sent == ["hello"]
    req = cv.build_request(msgs, sp)
    assert req.prompt == "c" and not req.messages and req.sampling == sp
    # a model with a template again: chat mode
    cv.set_chat_template(True)
    assert not cv.raw_mode and not cv.template_banner.isVisible()


@pytest.fixture(scope="module")
def bare_app_store(app_store, tmp_path_factory):
    dst = tmp_path_factory.mktemp("bare-app") / "store"
    shutil.copytree(app_store, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_window_on_model_without_template_runs_raw_when_chosen(qtbot, make_window, bare_app_store):
    win = make_window(store=bare_app_store, max_new_tokens=3)
    assert win.chat.template_banner.isVisible()
    assert not win.chat.send_btn.isEnabled()
    win.chat.raw_btn.click()
    win.chat.input.setPlainText("Once upon a time")
    win.chat._submit()
    qtbot.waitUntil(lambda: win.answer is None and any(
        v.role == "assistant" and v.status != STREAMING for v in win.chat.views.values()), timeout=1_800_000)
    assert win.banner.kind not in ("tokenizer", "error") or not win.banner.isVisible()


def test_gemma4_thought_channel_streams_collapsed_then_answer(qtbot, tmp_path):
    """A Gemma 4 store's answer with a thought channel (tests/test_thought_channel.py): the chat
    view gets the engine's streamed text, the thought as the collapsed reasoning."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from test_thought_channel import ANSWER, REASONING, THOUGHT, gemma_folder
    from engine import Engine, EngineConfig, GenerateRequest, TokenEvent, convert_checkpoint
    from engine.bench.synthetic import gemma4_text_config, write_checkpoint
    ck = write_checkpoint(tmp_path / "ck", gemma4_text_config(num_hidden_layers=2, vocab_size=300), seed=5,
                          tokenizer=False)
    gemma_store = convert_checkpoint(gemma_folder(ck), tmp_path / "st", quant="int8")
    with Engine.open(EngineConfig(store=str(gemma_store), history=False, o_direct=False, cap=2, pilot=0)) as eng:
        forced = tuple(eng.tokenizer.encode(THOUGHT))
        req = GenerateRequest(messages=(ChatMessage("user", "Is 7 prime?"),), forced_ids=forced,
                              sampling=SamplingParams(max_new_tokens=len(forced)))
        pieces = [e.text for e in eng.generate(req) if isinstance(e, TokenEvent)]
    v = _assistant(qtbot)
    for p in pieces:
        v.append_stream(p)
    assert v.text.toPlainText() == ANSWER and v.think_text.toPlainText() == REASONING
    assert v.think_btn.text().startswith("Thought") and not v.think_text.isVisible()
