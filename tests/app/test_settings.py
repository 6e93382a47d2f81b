"""The settings dialog: valid, invalid (refused in place) and reload-needing changes;
settings survive a restart; a corrupt settings file falls back to defaults."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtWidgets import QDialogButtonBox  # noqa: E402

from colibri_app.settings_dialog import RELOAD_MARK, SettingsDialog  # noqa: E402
from colibri_app.settings_store import Settings, load_settings, settings_path  # noqa: E402


@pytest.fixture
def cfgdirs(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLIBRI_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


@pytest.fixture
def dialog(qtbot, cfgdirs):
    def make(settings: Settings | None = None) -> SettingsDialog:
        d = SettingsDialog(settings or Settings(current_model="/models/x"), None)
        qtbot.addWidget(d)
        d.show()
        return d
    return make


def _apply_button(d):
    return d.buttons.button(QDialogButtonBox.Apply)


def test_units_ranges_and_reload_marks(dialog):
    d = dialog()
    F = d.fields
    assert F["pilot_workers"].minimum() == 1 and F["pilot_workers"].maximum() == 8
    assert F["wide"].maximum() == 4 and F["smooth"].maximum() == pytest.approx(0.95)
    assert F["ram_budget_gb"].suffix() == " GB" and F["max_new_tokens"].suffix() == " tokens"
    assert "Valid range: 1–8" in F["pilot_workers"].toolTip()
    assert "Valid range" in F["seed"].toolTip()
    assert RELOAD_MARK in d.findChild(type(d.status_label), "reloadNote").text()
    labels = {lay.labelForField(w).text() for name, w in F.items()
              for lay in [w.parentWidget().layout()] if hasattr(lay, "labelForField") and lay.labelForField(w)}
    assert f"PILOT prefetch {RELOAD_MARK}" in labels and "Temperature" in labels  # sampling: no reload
    assert not F["cap"].isEnabled() and d.cap_auto.isChecked()  # auto by default
    d.cap_auto.setChecked(False)
    assert F["cap"].isEnabled()


def test_valid_change_applies_saves_and_survives_restart(dialog, qtbot):
    d = dialog()
    F = d.fields
    F["temperature"].setValue(0.7)
    F["top_k"].setValue(40)
    assert d.auto_boxes["seed"].isChecked() and not F["seed"].isEnabled()   # default: a new seed per answer
    d.auto_boxes["seed"].setChecked(False)
    F["seed"].setText("1234")
    assert "next message" in d.status_label.text()
    with qtbot.waitSignal(d.applied) as sig:
        qtbot.mouseClick(_apply_button(d), Qt.LeftButton)
    new, reload_needed = sig.args
    assert reload_needed is False
    assert (new.sampling.temperature, new.sampling.top_k, new.sampling.seed) == (0.7, 40, 1234)
    assert new.current_model == "/models/x"
    loaded, msg = load_settings()
    assert msg is None and loaded == new
    # "restart": a new dialog from the file shows the saved values
    d2 = dialog(loaded)
    assert d2.fields["temperature"].value() == pytest.approx(0.7) and d2.fields["seed"].text() == "1234"
    assert d2.current_settings() == loaded  # no phantom changes


def test_reload_needing_change(dialog, qtbot):
    d = dialog()
    F = d.fields
    F["pilot"].setCurrentIndex(2)
    d.cap_auto.setChecked(False)
    F["cap"].setValue(6)
    d.budget_auto.setChecked(False)
    F["ram_budget_gb"].setValue(3.5)
    F["policy"].setCurrentText("lfru")
    assert RELOAD_MARK in d.status_label.text() and "reopen" in d.status_label.text()
    with qtbot.waitSignal(d.applied) as sig:
        qtbot.mouseClick(d.buttons.button(QDialogButtonBox.Ok), Qt.LeftButton)
    new, reload_needed = sig.args
    assert reload_needed is True
    assert (new.engine.pilot, new.engine.cap, new.engine.ram_budget_gb, new.engine.policy) == (2, 6, 3.5, "lfru")
    assert load_settings()[0].engine == new.engine
    assert not d.isVisible()  # OK closes


def test_invalid_input_refused_in_place(dialog, qtbot):
    d = dialog()
    F = d.fields
    # typed out-of-range values never enter a spin box
    F["wide"].lineEdit().selectAll()
    qtbot.keyClicks(F["wide"].lineEdit(), "9")
    assert F["wide"].value() <= 4
    F["smooth"].setValue(3.0)
    assert F["smooth"].value() == pytest.approx(0.95)
    # letters cannot be typed into the seed
    d.auto_boxes["seed"].setChecked(False)
    F["seed"].clear()
    qtbot.keyClicks(F["seed"], "12ab")
    assert F["seed"].text() == "12"
    # a seed above 2**63 - 1 is refused with an inline error; OK / Apply disabled, nothing emitted
    F["seed"].setText("9999999999999999999")
    assert d.error_label.isVisible() and "seed" in d.error_label.text().lower()
    assert not _apply_button(d).isEnabled() and not d.is_valid
    emitted = []
    d.applied.connect(lambda *a: emitted.append(a))
    assert d.apply() is False and emitted == []
    assert not settings_path().exists()
    F["seed"].setText("")
    assert "seed" in d.error_label.text().lower()
    F["seed"].setText("7")
    assert not d.error_label.isVisible() and _apply_button(d).isEnabled()


def test_restore_defaults_and_reset_history(dialog, qtbot):
    from dataclasses import replace
    s = Settings(current_model="/m")
    s = replace(s, engine=replace(s.engine, pilot=3, wide=2))
    d = dialog(s)
    assert d.fields["pilot"].currentIndex() == 3
    d.restore_defaults()
    assert d.fields["pilot"].currentIndex() == Settings().engine.pilot
    assert d.current_settings().current_model == "/m"
    with qtbot.waitSignal(d.reset_history_requested):
        qtbot.mouseClick(d.reset_history_button, Qt.LeftButton)


def test_corrupt_settings_file(dialog, qtbot, cfgdirs):
    p = settings_path()
    p.write_text("{ this is not json")
    s, msg = load_settings()
    assert s == Settings() and msg and "defaults" in msg
    aside = [x for x in p.parent.iterdir() if x.name.startswith("settings.json.bad-")]
    assert len(aside) == 1 and aside[0].read_text() == "{ this is not json" and not p.exists()
    # an out-of-range value gets its default and a note naming it; the file stays where it is
    p.write_text(json.dumps({**json.loads(Settings().to_json()), "engine": {"wide": 9, "cap": 3}}))
    s, msg = load_settings()
    assert s == Settings(engine=Settings().engine.with_(cap=3)) and "wide" in msg and p.exists()
    assert not [x for x in p.parent.iterdir() if x.name.startswith("settings.json.bad-")][1:]
    s = Settings()
    # the dialog opened on the defaults saves a good file again
    d = dialog(s)
    with qtbot.waitSignal(d.applied):
        d.apply()
    assert load_settings() == (s, None)


def test_auto_shows_what_the_engine_picks(qtbot, make_window):
    """"auto" shows the open engine's cap and budget; a changed context is sized with
    engine.sizing for the open store (the rule Engine.open applies)."""
    from dataclasses import replace

    from engine import EngineConfig
    from engine.library import plan_for_store
    win = make_window(engine=EngineConfig(pinning=False))  # cap and budget auto
    ld = win.loaded
    assert win.auto_values(win.settings.engine) == (ld.cap_per_layer, ld.ram_budget_bytes)
    other = replace(win.settings.engine, context_length=64, ram_budget_gb=0.3)
    plan = plan_for_store(ld.store_path, other)
    assert win.auto_values(other) == (plan.cap, plan.budget)
    d = SettingsDialog(win.settings, win, auto_values=win.auto_values)
    qtbot.addWidget(d)
    assert d.cap_auto.text() == f"auto ({ld.cap_per_layer} experts / {ld.ram_budget_bytes / 1e9:.1f} GB)"
    assert d.fields["cap"].value() == ld.cap_per_layer  # unticking auto starts from the engine's pick
    d.fields["context_length"].setValue(64)
    d.budget_auto.setChecked(False)
    d.fields["ram_budget_gb"].setValue(0.3)
    assert d.cap_auto.text().startswith(f"auto ({plan.cap} experts")


def test_one_save_per_apply(qtbot, make_window, monkeypatch):
    import colibri_app.main_window as mw
    import colibri_app.settings_dialog as sd
    saves = []
    monkeypatch.setattr(mw, "save_settings", lambda s, path=None: saves.append(("window", s)))
    monkeypatch.setattr(sd, "save_settings", lambda s, path=None: saves.append(("dialog", s)))
    win = make_window()
    win.act_settings.trigger()
    d = win._dialogs[-1]
    d.fields["temperature"].setValue(0.5)
    with qtbot.waitSignal(d.applied):
        qtbot.mouseClick(_apply_button(d), Qt.LeftButton)
    assert len(saves) == 1 and saves[0][1].sampling.temperature == 0.5
    d.reject()


def test_cluster_address_is_a_text_field(dialog):
    """The cluster setting (engine/cluster.py) is free text; a change reopens the model."""
    from PySide6.QtWidgets import QLineEdit
    d = dialog()
    w = d.fields["cluster"]
    assert isinstance(w, QLineEdit) and w.text() == "" and "colibri cluster head" in w.toolTip()
    w.setText(" 192.168.1.20:6380 ")
    new = d.current_settings()
    assert new.engine.cluster == "192.168.1.20:6380" and Settings().needs_reload(new)
    assert RELOAD_MARK in d.status_label.text() or "reopen" in d.status_label.text()
    assert isinstance(d.fields["cluster_timeout_ms"].value(), int)


def test_the_app_and_the_command_line_share_every_default():
    """One declaration per setting: the app's defaults are the table's, as `colibri run`'s
    flags are (the app's max new tokens was 512 while the command line's was 256)."""
    from engine import ENGINE, SAMPLING, settings_table
    from engine.cli import build_parser
    from colibri_app.settings_store import Settings
    a = build_parser("run").parse_args(["run", "--prompt", "x"])
    s = Settings()
    for group, values in ((SAMPLING, s.sampling), (ENGINE, s.engine)):
        for st in settings_table(group):
            assert getattr(values, st.name) == getattr(a, st.name) == st.default, st.name


def test_a_change_that_needs_new_kernels_says_so_before_it_is_applied(qtbot, make_window, monkeypatch):
    """PILOT on needs kernels of another kind: the pending-changes line says a one-time
    compile comes (with the time the last one took here), before Apply."""
    import colibri_app.main_window as mw
    win = make_window()
    asked = []

    def needed(store, engine):
        asked.append((store, engine.pilot))
        return (engine.pilot > 0, 95.0)
    monkeypatch.setattr(mw, "compile_needed", needed)
    shown = []
    monkeypatch.setattr(win, "_show_dialog", lambda dlg: shown.append(dlg))
    win.open_settings()
    dlg = shown[0]
    qtbot.addWidget(dlg)
    dlg.fields["cap"].setValue(3)  # a reload, same kernels: no note
    assert "compile" not in dlg.status_label.text() and asked == []
    dlg.fields["pilot"].setCurrentIndex(1)
    text = dlg.status_label.text()
    assert "one-time compile of the compute kernels" in text and "about 95 s" in text, text
    assert asked == [(win.loaded.store_path, 1)]
    dlg.fields["pilot"].setCurrentIndex(0)
    assert "compile" not in dlg.status_label.text()


def test_a_newer_settings_file_is_read_and_kept(cfgdirs):
    """Version 3 (a newer build): the known settings are used, with one note; the file is not
    renamed; unknown keys, the version and a value this build refuses are written back."""
    from dataclasses import replace
    from colibri_app.settings_store import save_settings
    p = settings_path()
    d = json.loads(Settings().to_json())
    d["version"] = 3
    d["engine"].update(pilot=2, wide=9, turbo_mode="max")   # wide 9: allowed by the newer build
    d["sampling"].update(temperature=0.3, min_p_schedule=[0.1, 0.2])
    d["app"]["font_size"] = 13
    d["sync"] = {"account": "me"}
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(d))
    s, msg = load_settings()
    assert s.engine.pilot == 2 and s.sampling.temperature == 0.3 and s.engine.wide == Settings().engine.wide
    assert msg.count("newer colibri") == 1 and "version 3" in msg and "wide" in msg
    assert p.exists() and not list(p.parent.glob("settings.json.bad-*"))
    save_settings(replace(s, sampling=replace(s.sampling, temperature=0.6)))
    back = json.loads(p.read_text())
    assert back["version"] == 3 and back["sync"] == {"account": "me"} and back["app"]["font_size"] == 13
    assert back["engine"]["turbo_mode"] == "max" and back["engine"]["wide"] == 9 and back["engine"]["pilot"] == 2
    assert back["sampling"]["min_p_schedule"] == [0.1, 0.2] and back["sampling"]["temperature"] == 0.6


def test_unknown_keys_are_kept_on_save(cfgdirs):
    """Same version, keys this build does not know: no note, nothing lost on save."""
    from dataclasses import replace
    from colibri_app.settings_store import save_settings
    p = settings_path()
    d = json.loads(Settings().to_json())
    d["engine"]["future_knob"] = 1
    d["window"] = {"x": 5}
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(d))
    s, msg = load_settings()
    assert msg is None and s == Settings()
    save_settings(replace(s, current_model="/m"))
    back = json.loads(p.read_text())
    assert back["engine"]["future_knob"] == 1 and back["window"] == {"x": 5} and back["current_model"] == "/m"
    assert back["version"] == 2 and load_settings()[0].current_model == "/m"


def test_an_unreadable_settings_file_is_left_in_place(cfgdirs):
    p = settings_path()
    p.mkdir(parents=True)           # a folder where the file should be: read fails
    s, msg = load_settings()
    assert s == Settings() and "could not be read" in msg and "left as it is" in msg
    assert p.is_dir() and not list(p.parent.glob("settings.json.bad-*"))


def test_a_settings_file_that_cannot_be_read_is_never_saved_over(cfgdirs, monkeypatch):
    """Read refused now (permissions, an I/O error): defaults are in effect at start, and a
    later save (choosing a model, Apply) must not replace the user's file it never read."""
    import errno
    import pathlib
    from colibri_app.settings_store import save_settings
    p = settings_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    mine = json.loads(Settings(current_model="/my/model").to_json())
    p.write_text(json.dumps(mine))
    real_open = pathlib.Path.open

    def refused(self, *a, **k):
        if self == p:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_open(self, *a, **k)
    monkeypatch.setattr(pathlib.Path, "open", refused)
    s, msg = load_settings()
    assert s == Settings() and "could not be read" in msg and "left as it is" in msg
    with pytest.raises(OSError, match="left as it is"):
        save_settings(Settings(current_model="/other"))
    monkeypatch.undo()
    assert json.loads(p.read_text()) == mine


@pytest.mark.parametrize("case", ["newer", "not json"])
def test_the_window_says_a_newer_file_was_used_not_that_it_could_not_be(qtbot, cfgdirs, case):
    """A newer build's file is used for what this build knows: its banner is a note, not the
    error "Your settings could not be used" that a file which does not parse gets."""
    from colibri_app.main_window import MainWindow
    p = settings_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    d = json.loads(Settings().to_json())
    d["version"] = 3
    p.write_text(json.dumps(d) if case == "newer" else "{not json")
    s, msg = load_settings()
    win = MainWindow(s, settings_message=msg)
    qtbot.addWidget(win)
    title, level = win.banner.title.text(), win.banner.property("level")
    if case == "newer":
        assert title == "Some settings could not be used" and level == "info"
    else:
        assert title == "Your settings could not be used" and level == "error"
    win.close()
