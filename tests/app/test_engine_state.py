"""The window tells the truth about the engine: stale status
cleared on failure, a warning before Apply stops an answer, human words, a broken current model
not reopened at every start, a "preparing kernels" state, "auto" showing the value in use, one
source for hit rate and MB/token, the context limit in the dialog, dropped turns said in the chat."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

from PySide6.QtCore import Qt

from engine import EngineConfig, EngineFailure, LoadProgress
from colibri_app.main_window import HINTS
from colibri_app.settings_store import load_settings
from answer_helpers import send as _send, wait_finished as _wait_finished


def test_failed_open_clears_the_opening_status(qtbot, make_window, tmp_path):
    win = make_window(wait_loaded=False)
    win.open_model(str(tmp_path / "missing-store"))
    qtbot.waitUntil(lambda: bool(win.banner.isVisible()), timeout=1_800_000)
    # the same sequence again, without the lane's timing: progress, then the failure
    win.open_model(str(tmp_path / "missing-store"))
    win.on_progress(LoadProgress("open", 0, 3, "", "opening the model"))
    assert "Opening the model" in win.statusBar().currentMessage()
    win.on_failed(EngineFailure(kind="store", message="the store is missing"))
    assert "Opening" not in win.statusBar().currentMessage()
    assert not win.loading.isVisible()


def test_apply_that_reopens_during_an_answer_asks_first(qtbot, make_window):
    win = make_window(max_new_tokens=400, wait_loaded=False)
    win.start()   # the first open of a process also prepares the kernels: slow on a loaded machine
    qtbot.waitUntil(lambda: bool(win.loaded is not None), timeout=600000)
    asked = []
    win.ask_reload_during_answer = lambda: (asked.append(1), "cancel")[1]
    win.send("tell me everything")
    assert win.answer is not None
    job = win.answer.job
    new = replace(win.settings, engine=replace(win.settings.engine, cap=2))
    win.apply_settings(new, True)
    assert asked and not job.cancel.is_set() and win.loaded is not None   # cancel: nothing stopped
    assert win.settings.engine.cap != 2
    # "apply when the answer ends": the answer finishes, then the model reopens with the change
    win.ask_reload_during_answer = lambda: "wait"
    win.apply_settings(new, True)
    assert not job.cancel.is_set() and win.settings.engine.cap == 2
    win.stop()
    qtbot.waitUntil(lambda: bool(win.answer is None), timeout=1_800_000)
    qtbot.waitUntil(lambda: bool(win.loaded is not None and win.loaded.cap_per_layer == 2), timeout=1_800_000)


def test_engine_messages_use_the_apps_words(qtbot, make_window, tmp_path, app_store):
    bad = tmp_path / "old-store"
    shutil.copytree(app_store, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["version"] = 99
    (bad / "manifest.json").write_text(json.dumps(m))
    win = make_window(wait_loaded=False)
    win.open_model(str(bad))
    qtbot.waitUntil(lambda: bool(win.banner.isVisible()), timeout=1_800_000)
    text = win.banner.text.text() + win.banner.hint.text()
    assert "version" in text
    for cli in ("colibri convert", "--overwrite", "ram_budget_gb", "`"):
        assert cli not in text
    from colibri_app.engine_bridge import app_words
    assert "ram_budget_gb" not in app_words("Raise ram_budget_gb, lower the context length")
    assert "RAM budget" in app_words("setting 'ram_budget_gb' = -1: is out of range")


def test_broken_current_model_is_not_reopened_at_every_start(qtbot, make_window, tmp_path, app_store):
    bad = tmp_path / "broken-store"
    shutil.copytree(app_store, bad)
    (bad / "manifest.json").write_text("{ not json")
    from colibri_app.settings_store import save_settings
    win = make_window(store=str(bad), wait_loaded=False)
    save_settings(win.settings)
    win.start()
    qtbot.waitUntil(lambda: bool(win.banner.isVisible()), timeout=1_800_000)
    assert win.banner.kind == "store"
    assert win.banner.action.isVisibleTo(win) and "Models" in win.banner.action.text()
    settings, _msg = load_settings()
    assert settings.current_model != str(bad)   # the next start opens the default model instead


def test_preparing_kernels_is_shown_until_ready(qtbot, make_window):
    win = make_window(wait_loaded=False)
    win.open_model(None)
    win.on_progress(LoadProgress("kernels", 0, 1, "", "preparing the compute kernels"))
    assert "Preparing the compute kernels" in win.loading.label.text()
    assert "Preparing the compute kernels" in win.chat.input.placeholderText() or \
        not win.chat.send_btn.isEnabled()
    assert "ready" not in win.statusBar().currentMessage().lower()


def test_a_first_compile_says_how_long_it_takes(qtbot, make_window):
    """Engine.open's first compile of a kind of model (a child process, a minute or two:
    engine.kernel_prepare) is named as such, and the chat waits for it like for the kernels."""
    win = make_window(wait_loaded=False)
    win.open_model(None)
    from engine.kernel_prepare import FIRST_COMPILE
    win.on_progress(LoadProgress("compile", 0, 1, "", FIRST_COMPILE))
    assert "Compiling the compute kernels" in win.loading.label.text()
    assert "minute" in win.loading.label.text()
    assert "Preparing the compute kernels" in win.chat.input.placeholderText() or \
        not win.chat.send_btn.isEnabled()
    win.on_progress(LoadProgress("compile", 1, 1, "", "compute kernels compiled in 95 s"))
    assert "compiled" in win.loading.label.text()


def test_auto_fields_show_the_values_in_use(qtbot, make_window):
    win = make_window(engine=EngineConfig(cap=4, pinning=False, threads=0))
    from colibri_app.settings_dialog import SettingsDialog
    win.open_settings()
    dlg = next(d for d in win._dialogs if isinstance(d, SettingsDialog))
    t = dlg.fields["threads"]
    assert t.value() == 0 and f"{win.loaded.threads}" in t.specialValueText()
    c = dlg.fields["context_length"]
    assert str(win.loaded.context_length) in c.specialValueText()
    assert c.maximum() == win.loaded.max_context == 2048 and "2048" in c.toolTip()
    dlg.reject()


def test_panels_and_answer_line_agree_on_hit_rate_and_mb(qtbot, make_window):
    win = make_window(max_new_tokens=16, engine=EngineConfig(cap=2, pinning=False))
    _send(qtbot, win, "What does json.dumps do?")
    msgs = win.history.messages(win.conv_id)
    line = win.chat.view(msgs[-1].id).meta_label.text()
    win.panels.redraw()
    hit = next(p for p in line.split("  ·  ") if p.startswith("hit rate"))
    mb = next(p for p in line.split("  ·  ") if p.endswith("MB/token"))
    assert f"answer: {hit}" in win.panels.hit_legend.text()
    assert f"answer: {mb}" in win.panels.ssd_legend.text()


def test_context_hint_never_says_raise_it():
    assert "raise" not in HINTS["context"].lower()


def test_dropped_turns_are_said_in_the_chat(qtbot, make_window):
    win = make_window(max_new_tokens=64, engine=EngineConfig(context_length=160, pinning=False))
    conv = win.history.create_conversation("long chat", "Be brief.")
    for i in range(5):
        win.history.add_message(conv.id, "user", f"question {i} " + "abc " * 30, "complete")
        win.history.add_message(conv.id, "assistant", f"answer {i} " + "xyz " * 30, "complete")
    win.select_conversation(conv.id)
    fin = _send(qtbot, win, "and now?")
    assert fin.finish_reason != "error" and fin.dropped_messages > 0
    line = win.chat.view(win.history.messages(conv.id)[-1].id).meta_label.text()
    assert f"{fin.dropped_messages} earliest messages left out" in line
    assert not win.banner.isVisible()
