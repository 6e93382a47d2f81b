"""Disabled controls look disabled; the window follows the desktop's light or
dark scheme, with a choice in Settings (System / Light / Dark) kept in the settings file; the
plots and the residency map follow the scheme."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtGui import QColor, QImage, QPalette  # noqa: E402
from PySide6.QtWidgets import (QApplication, QCheckBox, QComboBox, QLineEdit, QPushButton,  # noqa: E402
                               QSpinBox, QWidget, QHBoxLayout)

from colibri_app import resources  # noqa: E402


@pytest.fixture
def themed(qapp):
    """Restore the application's look after the test."""
    pal, sheet, style = QApplication.palette(), qapp.styleSheet(), qapp.style().name()
    yield qapp
    if hasattr(resources, "THEME"):
        resources.THEME.choice = "system"
    qapp.setStyle(style)
    qapp.setPalette(pal)
    qapp.setStyleSheet(sheet)


def _img(w: QWidget):
    w.repaint()
    im = w.grab().toImage().convertToFormat(QImage.Format_RGB32)
    return np.frombuffer(im.constBits(), np.uint32, im.width() * im.height()).reshape(im.height(), im.width()).copy()


def _pair(qtbot, make):
    box = QWidget()
    lay = QHBoxLayout(box)
    a, b = make(), make()
    b.setEnabled(False)
    lay.addWidget(a)
    lay.addWidget(b)
    qtbot.addWidget(box)
    box.resize(400, 60)
    box.show()
    qtbot.waitExposed(box)
    return box, a, b


def _spin():
    w = QSpinBox()
    w.setRange(0, 100)
    w.setValue(42)
    w.setSuffix(" experts")
    return w


def _combo():
    w = QComboBox()
    w.addItems(["ema", "lru"])
    return w


MAKERS = {
    "spin box": _spin,
    "line edit": lambda: QLineEdit("some text"),
    "push button": lambda: QPushButton("Reset routing history"),
    "check box": lambda: QCheckBox("auto"),
    "combo box": _combo,
}


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("kind", list(MAKERS))
def test_disabled_controls_look_disabled(qtbot, themed, scheme, kind):
    if scheme == "light" and resources.apply_theme.__code__.co_argcount == 1:
        resources.apply_theme(themed)          # the one light theme of before (to show the fault)
    else:
        resources.apply_theme(themed, scheme)
    _box, a, b = _pair(qtbot, MAKERS[kind])
    ia, ib = _img(a), _img(b)
    assert ia.shape == ib.shape
    differ = (ia != ib).mean()
    assert differ > 0.01, f"disabled {kind} is drawn like an enabled one ({differ:.1%} pixels differ)"
    pal = themed.palette()
    for role in (QPalette.Text, QPalette.ButtonText, QPalette.WindowText):
        assert pal.color(QPalette.Disabled, role) != pal.color(QPalette.Active, role)


def test_follows_the_desktop_scheme_unless_chosen(qtbot, themed, monkeypatch):
    desktop = ["dark"]
    monkeypatch.setattr(resources, "system_scheme", lambda: desktop[0])
    assert resources.apply_theme(themed, "system") == "dark"
    assert themed.palette().color(QPalette.Window).lightness() < 80
    assert "#1b1d22" in themed.styleSheet()
    assert resources.apply_theme(themed, "light") == "light"       # an explicit choice wins
    assert themed.palette().color(QPalette.Window).lightness() > 200
    resources.apply_theme(themed, "system")
    assert resources.THEME.scheme == "dark"
    desktop[0] = "light"                                          # the desktop switches at run time
    resources.THEME.system_changed()
    assert resources.THEME.scheme == "light" and themed.palette().color(QPalette.Window).lightness() > 200
    resources.apply_theme(themed, "dark")
    desktop[0] = "light"
    resources.THEME.system_changed()                              # ignored: the user chose Dark
    assert resources.THEME.scheme == "dark"


def test_system_scheme_reads_qt_style_hints(themed, monkeypatch):
    from PySide6.QtCore import Qt

    class Hints:
        def __init__(self, s):
            self.s = s

        def colorScheme(self):
            return self.s
    monkeypatch.setattr(type(themed), "styleHints", lambda self: Hints(Qt.ColorScheme.Dark))
    assert resources.system_scheme() == "dark"
    monkeypatch.setattr(type(themed), "styleHints", lambda self: Hints(Qt.ColorScheme.Light))
    assert resources.system_scheme() == "light"


def _snapshot():
    from engine import ResidencySnapshot
    L, E = 2, 4
    return ResidencySnapshot(token_index=0, num_layers=L, num_experts=E, state=np.ones(L * E, np.int8),
                             heat=np.arange(L * E, dtype=np.float32), routed=np.zeros(L * E, bool))


def test_plots_and_heat_map_follow_the_scheme(qtbot, themed):
    from colibri_app.plot_panels import PlotPanels
    resources.apply_theme(themed, "light")
    p = PlotPanels()
    qtbot.addWidget(p)
    p.resize(400, 700)
    p.show()
    assert p.scheme == "light"
    assert p.hit_plot.backgroundBrush().color().lightness() > 200
    p.on_residency(_snapshot())
    p.redraw()
    light = p.heat_image.copy()
    resources.apply_theme(themed, "dark")
    assert p.scheme == "dark"
    assert p.hit_plot.backgroundBrush().color().lightness() < 80
    assert p.heat_plot.backgroundBrush().color().lightness() < 80
    p.redraw()
    dark = p.heat_image
    assert light.shape == dark.shape and not np.array_equal(light, dark)
    # the least used expert fades to the map's background: light on a light map, dark on a dark one
    assert light[2, 2].mean() > dark[2, 2].mean()


def test_theme_choice_in_settings_is_saved_and_applied(qtbot, themed, app_dirs, make_window, monkeypatch):
    from colibri_app.settings_dialog import SettingsDialog
    from colibri_app.settings_store import load_settings, settings_path
    monkeypatch.setattr(resources, "system_scheme", lambda: "light")
    win = make_window(wait_loaded=False)
    resources.apply_theme(themed, win.settings.app.theme)
    assert win.settings.app.theme == "system" and resources.THEME.scheme == "light"
    dlg = SettingsDialog(win.settings, win, save=None)
    qtbot.addWidget(dlg)
    dlg.applied.connect(win.apply_settings)
    combo = dlg.fields["theme"]
    assert [combo.itemText(i) for i in range(combo.count())] == ["System", "Light", "Dark"]
    combo.setCurrentIndex(2)
    assert dlg.apply()
    assert win.settings.app.theme == "dark" and resources.THEME.scheme == "dark"
    assert themed.palette().color(QPalette.Window).lightness() < 80
    saved = json.loads(settings_path().read_text())
    assert saved["app"] == {"theme": "dark"}
    assert load_settings()[0].app.theme == "dark"
    assert win.panels.scheme == "dark"


def _luminance(rgb: int) -> float:
    def ch(v):
        c = v / 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    return 0.2126 * ch((rgb >> 16) & 255) + 0.7152 * ch((rgb >> 8) & 255) + 0.0722 * ch(rgb & 255)


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("kind", ["radio", "check"])
def test_unchecked_radio_buttons_and_check_boxes_stand_out(qtbot, themed, scheme, kind):
    """The indicator's ring has at least 3:1 contrast with the window (WCAG's rule for the parts
    of a control); in the dark scheme the style's own ring was nearly invisible."""
    from PySide6.QtWidgets import QRadioButton, QStyle, QStyleOptionButton
    resources.apply_theme(themed, scheme)
    w = QRadioButton("From a folder") if kind == "radio" else QCheckBox("auto")
    qtbot.addWidget(w)
    w.show()
    qtbot.waitExposed(w)
    opt = QStyleOptionButton()
    w.initStyleOption(opt)
    r = w.style().subElementRect(QStyle.SE_RadioButtonIndicator if kind == "radio" else QStyle.SE_CheckBoxIndicator,
                                 opt, w)
    px = _img(w)
    area = px[max(0, r.top()):r.bottom() + 1, max(0, r.left()):r.right() + 1] & 0xFFFFFF
    bg = _luminance(int(QColor(resources.SCHEMES[scheme]["bg"]).rgb()) & 0xFFFFFF)
    best = max((max(_luminance(int(v)), bg) + 0.05) / (min(_luminance(int(v)), bg) + 0.05) for v in set(area.ravel()))
    assert best >= 3.0, (scheme, kind, best)


def test_a_scheme_change_keeps_the_legends_values(qtbot, themed):
    from colibri_app.plot_panels import PlotPanels
    from engine import StepMetrics
    resources.apply_theme(themed, "light")
    p = PlotPanels()
    qtbot.addWidget(p)
    p.timer.stop()
    p.on_metrics(StepMetrics(token_index=0, hits=3, misses=1, pinned_hits=1, hit_rate=0.75, pinned_hit_rate=0.25,
                             lru_hit_rate=0.5, loads=1, demand_bytes=2_000_000, speculative_bytes=0,
                             mb_per_token=2.0, felt_wait_s=0.0, read_service_s=0.0, rss_bytes=3_000_000_000,
                             budget_bytes=8_000_000_000, cache_bytes=1_000_000_000, cap_per_layer=4,
                             tok_per_s=10.0, ttft_s=0.2))
    p._legend_t = float("-inf")
    p.redraw()
    before = p.hit_legend.text()
    assert "pinned 25%" in before and "cached 50%" in before
    resources.apply_theme(themed, "dark")
    assert "pinned 25%" in p.hit_legend.text() and "cached 50%" in p.hit_legend.text()
    assert "rolling mean 75%" in p.hit_legend.text()
