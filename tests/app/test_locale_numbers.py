"""Number fields in a comma-decimal locale (German): ``0,6`` and ``0.6`` both read as six
tenths in a decimal field; a whole-number field refuses either with a sentence saying why;
numbers are shown the German way. One test per field kind."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QLocale  # noqa: E402
from PySide6.QtWidgets import QDialogButtonBox  # noqa: E402

from colibri_app.settings_dialog import SettingsDialog  # noqa: E402
from colibri_app.settings_store import Settings, load_settings, settings_path  # noqa: E402


@pytest.fixture
def german(monkeypatch, tmp_path):
    monkeypatch.setenv("LANG", "de_DE.UTF-8")
    monkeypatch.setenv("COLIBRI_CONFIG_DIR", str(tmp_path / "config"))
    before = QLocale()
    QLocale.setDefault(QLocale(QLocale.German, QLocale.Germany))
    yield
    QLocale.setDefault(before)


@pytest.fixture
def dialog(qtbot, german):
    d = SettingsDialog(Settings(current_model="/m"), None)
    qtbot.addWidget(d)
    d.show()
    return d


def _type(qtbot, box, text):
    box.lineEdit().selectAll()
    qtbot.keyClicks(box.lineEdit(), text)


def _ok(d):
    return d.buttons.button(QDialogButtonBox.Ok)


@pytest.mark.parametrize("typed", ["0,6", "0.6"])
def test_a_decimal_field_reads_either_mark(dialog, qtbot, typed):
    """Temperature (a decimal with a special value: 0 = greedy)."""
    box = dialog.fields["temperature"]
    _type(qtbot, box, typed)
    assert dialog.current_settings().sampling.temperature == pytest.approx(0.6)
    assert dialog.is_valid and _ok(dialog).isEnabled()
    box.interpretText()
    assert box.text() == "0,60"                       # shown the German way
    with qtbot.waitSignal(dialog.applied):
        dialog.apply()
    assert json.loads(settings_path().read_text())["sampling"]["temperature"] == pytest.approx(0.6)
    assert load_settings()[0].sampling.temperature == pytest.approx(0.6)


@pytest.mark.parametrize("typed", ["2,5", "2.5"])
def test_a_decimal_field_with_a_unit_and_auto(dialog, qtbot, typed):
    """The RAM budget (GB suffix, an "auto" box): 2.5 is not read as 25."""
    dialog.auto_boxes["ram_budget_gb"].setChecked(False)
    box = dialog.fields["ram_budget_gb"]
    _type(qtbot, box, typed)
    assert dialog.current_settings().engine.ram_budget_gb == pytest.approx(2.5)
    box.interpretText()
    assert box.text() == "2,5 GB"


def test_a_decimal_field_refuses_two_separators(dialog, qtbot):
    _type(qtbot, dialog.fields["top_p"], "1.000,5")
    assert not dialog.is_valid and not _ok(dialog).isEnabled()
    assert "Top-p" in dialog.error_label.text() and "separators" in dialog.error_label.text()
    _type(qtbot, dialog.fields["top_p"], "0,9")
    assert dialog.is_valid and dialog.current_settings().sampling.top_p == pytest.approx(0.9)


def test_a_decimal_field_refuses_what_could_be_thousands(dialog, qtbot):
    """German "2.500" is 2500 (thousands separator) as much as 2,5: refused, not guessed."""
    dialog.auto_boxes["ram_budget_gb"].setChecked(False)
    _type(qtbot, dialog.fields["ram_budget_gb"], "2.500")
    assert not dialog.is_valid and "could be 2500 or 2,500" in dialog.error_label.text()
    _type(qtbot, dialog.fields["ram_budget_gb"], "2.5")
    assert dialog.is_valid and dialog.current_settings().engine.ram_budget_gb == pytest.approx(2.5)


@pytest.mark.parametrize("typed", ["0,6", "0.6", "8.000"])
def test_a_whole_number_field_refuses_a_separator(dialog, qtbot, typed):
    """Max new tokens: neither 0,6 nor 0.6 is a token count; 8.000 is not silently 8 or 8000."""
    box = dialog.fields["max_new_tokens"]
    _type(qtbot, box, typed)
    assert not dialog.is_valid and not _ok(dialog).isEnabled()
    assert "whole number" in dialog.error_label.text() and dialog.error_label.isVisible()
    _type(qtbot, box, "800")
    assert dialog.is_valid and dialog.current_settings().sampling.max_new_tokens == 800


def test_the_seed_field_refuses_a_separator(dialog, qtbot):
    dialog.auto_boxes["seed"].setChecked(False)
    f = dialog.fields["seed"]
    f.clear()
    qtbot.keyClicks(f, "1.000")
    assert not dialog.is_valid and "whole number" in dialog.error_label.text()
    f.setText("1000")
    assert dialog.is_valid and dialog.current_settings().sampling.seed == 1000


def test_the_serve_port_refuses_a_separator(qtbot, german):
    from colibri_app.serve import ServeDialog
    d = ServeDialog(8000)
    qtbot.addWidget(d)
    d.show()
    ok = d.findChild(QDialogButtonBox).button(QDialogButtonBox.Ok)
    _type(qtbot, d.port, "8.080")
    assert not ok.isEnabled() and d.error.isVisible() and "whole number" in d.error.text()
    _type(qtbot, d.port, "8080")
    assert ok.isEnabled() and not d.error.isVisible() and d.values()[0] == 8080


def _numeric_settings():
    from engine import APP, ENGINE, SAMPLING, settings_table
    return [(g, s) for g in (ENGINE, SAMPLING, APP) for s in settings_table(g)
            if s.type in (int, float) and not s.choices]


@pytest.mark.parametrize("group,name", [(g, s.name) for g, s in _numeric_settings()])
def test_every_number_setting_saves_what_was_meant_or_says_why_not(qtbot, german, group, name):
    """Every number field of the Settings dialog, in German, typed as 0,6 and as 0.6: a decimal
    one saves six tenths, a whole-number one refuses the text with a sentence naming the
    setting (OK disabled)."""
    s = dict((x.name, x) for _, x in _numeric_settings())[name]
    for typed in ("0,6", "0.6"):
        dialog = SettingsDialog(Settings(current_model="/m"), None)
        qtbot.addWidget(dialog)
        dialog.show()
        if s.needs_pilot:
            dialog.fields["pilot"].setCurrentIndex(1)
        if name in dialog.auto_boxes:
            dialog.auto_boxes[name].setChecked(False)
        w = dialog.fields[name]
        assert w.isEnabled()
        edit = w if not hasattr(w, "lineEdit") else w.lineEdit()
        edit.selectAll()
        qtbot.keyClicks(edit, typed)
        if s.type is int:
            assert not dialog.is_valid and not _ok(dialog).isEnabled(), typed
            assert s.label in dialog.error_label.text() and "whole number" in dialog.error_label.text()
            continue
        assert dialog.is_valid and _ok(dialog).isEnabled(), (typed, dialog.error_label.text())
        with qtbot.waitSignal(dialog.applied):
            dialog.apply()
        assert json.loads(settings_path().read_text())[group][name] == pytest.approx(0.6), typed


@pytest.mark.parametrize("name,typed", [("max_new_tokens", "2,5"), ("context_length", "0,6"),
                                        ("temperature", "2.500"), ("top_p", "1.000,5")])
def test_leaving_a_refused_number_keeps_the_value_before_it(dialog, qtbot, name, typed):
    """Leaving a field whose text was refused goes back to the value it had before the typing,
    not to the last prefix that could be read ("2" of "2,5", "2,5" of "2.500"): nothing the
    user did not mean is saved."""
    box = dialog.fields[name]
    before = box.value()
    _type(qtbot, box, typed)
    assert not dialog.is_valid
    box.interpretText()                                # what leaving the field (Tab, a click) does
    assert box.value() == before and box.problem == ""
    assert dialog.is_valid
    with qtbot.waitSignal(dialog.applied):
        dialog.apply()
    group = "engine" if name == "context_length" else "sampling"
    assert json.loads(settings_path().read_text())[group][name] == pytest.approx(before)


def test_enter_on_a_refused_number_keeps_the_text_and_the_reason(dialog, qtbot):
    """Enter in a field whose text is refused neither saves nor closes the dialog: the text and
    the sentence saying why stay until the user fixes them."""
    from PySide6.QtCore import Qt
    box = dialog.fields["temperature"]
    _type(qtbot, box, "2.500")
    qtbot.keyClick(box.lineEdit(), Qt.Key_Return)
    assert box.lineEdit().text() == "2.500" and "could be 2500" in dialog.error_label.text()
    assert dialog.isVisible() and not settings_path().exists()
