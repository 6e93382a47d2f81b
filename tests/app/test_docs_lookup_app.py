"""The app shows which documentation entries an answer was given (the documentation
lookup); Settings > Documentation lookup off gives the plain chat."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from engine import SamplingParams
from engine.docs_lookup import INDEX_FILE, DocEntry, write_index
from answer_helpers import wait_finished as _wait_finished


@pytest.fixture
def docs_store(app_store, tmp_path):
    st = tmp_path / "docs-store"
    shutil.copytree(app_store, st)
    write_index([DocEntry("json.dumps", "function", "(obj)", "Serialize obj to a JSON formatted str."),
                 DocEntry("json.loads", "function", "(s)", "Deserialize s to a Python object.")], st / INDEX_FILE)
    return str(st)


def _answer(win):
    return [m for m in win.history.messages(win.conv_id) if m.role == "assistant"][-1]


def test_the_answer_line_names_what_was_looked_up(qtbot, make_window, docs_store):
    win = make_window(store=docs_store, max_new_tokens=4)
    if not win.loaded.has_chat_template:
        pytest.skip("the tiny model has no chat template: raw prompts are never looked up")
    assert win.loaded.docs_entries == 2
    fin = _wait_finished(qtbot, win, lambda: win.send("What does `json.dumps` do?"))
    m = _answer(win)
    assert fin.sources[0] == "json.dumps" and m.meta["sources"] == list(fin.sources)
    v = win.chat.view(m.id)
    assert "looked up: json.dumps" in v.meta_label.text()
    # the entries themselves, collapsed under the answer; opened, their summaries show
    assert v.docs_btn.isVisible() and v.docs_btn.text() == f"Documentation looked up ({len(fin.sources)})"
    assert not v.docs_text.isVisible()
    v.docs_btn.click()
    assert v.docs_text.isVisible() and "json.dumps: Serialize obj to a JSON formatted str." in v.docs_text.text()
    assert m.meta["source_summaries"] == list(fin.source_summaries)
    # Settings > Documentation lookup off (applies to the next message): nothing looked up
    win.settings = replace(win.settings, sampling=replace(win.settings.sampling, docs_lookup=False))
    fin = _wait_finished(qtbot, win, lambda: win.send("What does `json.loads` do?"))
    m = _answer(win)
    assert fin.sources == () and "sources" not in m.meta
    assert "looked up" not in win.chat.view(m.id).meta_label.text() and not win.chat.view(m.id).docs_btn.isVisible()


def test_settings_dialog_has_the_documentation_lookup_checkbox(qtbot):
    from PySide6.QtWidgets import QCheckBox

    from colibri_app.settings_dialog import SettingsDialog
    from colibri_app.settings_store import Settings
    dlg = SettingsDialog(Settings())
    qtbot.addWidget(dlg)
    boxes = [b for b in dlg.findChildren(QCheckBox) if "documentation" in b.text().lower()]
    assert len(boxes) == 1 and boxes[0].isChecked()
    boxes[0].setChecked(False)
    assert dlg.current_settings().sampling.docs_lookup is False


def test_a_broken_index_does_not_block_the_model(qtbot, make_window, app_store, tmp_path):
    st = tmp_path / "broken-docs"
    shutil.copytree(app_store, st)
    (st / INDEX_FILE).write_text('{"name": "json.dumps", "summary": "x"}\n{"name": 3}\n')
    win = make_window(store=str(st), max_new_tokens=2)
    assert win.loaded.docs_entries == 0 and "line 2" in win.loaded.docs_problem
    msg = win.statusBar().currentMessage()
    assert "without documentation lookup" in msg and INDEX_FILE in msg
    assert not win.banner.isVisible()                      # the model is usable: no error banner
