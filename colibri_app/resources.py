"""Look and feel: a light and a dark colour scheme (palette, style sheet, pyqtgraph defaults).

The scheme follows the desktop (``QStyleHints.colorScheme()``, Qt 6.5+) unless the user picks
Light or Dark in Settings (the ``theme`` setting, engine.settings APP_SETTINGS). Both palettes
set the *Disabled* colour group, and the style sheet has ``:disabled`` rules for every widget
it styles, so a disabled control is drawn greyed out (before, ``QPalette.setColor``
without a group gave disabled widgets the enabled colours, pixel for pixel).

:data:`THEME` is the one :class:`ThemeController`; widgets that paint with scheme colours of
their own (the plots, the heat map, code blocks) read :func:`colors` and listen to
``THEME.changed``.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QColor, QFont, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

ACCENT = "#4f46e5"
LIGHT, DARK, SYSTEM = "light", "dark", "system"

# Named colours of each scheme: the style sheet, the palette, the plots and code blocks use them.
SCHEMES: dict[str, dict[str, str]] = {
    LIGHT: dict(
        accent=ACCENT, accent_hover="#4338ca", on_accent="#ffffff",
        bg="#f7f7f8", surface="#ffffff", input="#ffffff", input_soft="#fafafa",
        border="#e5e7eb", border_input="#d9dce1", border_prompt="#d1d5db",
        sidebar="#eef0f3", sidebar_border="#e2e5ea", item_hover="#e3e6eb",
        selected="#dcdffb", selected_text="#1e1b4b",
        text="#1f2328", strong="#111827", mid="#374151", soft="#4b5563", muted="#6b7280", faint="#9ca3af",
        hover="#f3f4f6", user_card="#eef2ff", user_border="#dfe3fb",
        toggle_on="#eef2ff", toggle_on_border="#c7d2fe",
        warn_bg="#fffbeb", warn_border="#fde68a", warn_text="#92400e", warn_text2="#78350f",
        warn_button="#fcd34d", warn_on="#fde68a", status_note="#b45309",
        error_bg="#fef2f2", error_border="#fecaca", error_title="#991b1b",
        info_bg="#eff6ff", info_border="#bfdbfe", info_title="#1e3a8a",
        disabled_bg="#f1f2f4", disabled_text="#a8adb6", disabled_border="#e2e4e8",
        disabled_accent="#c7c9d1", stop="#dc2626", stop_hover="#b91c1c",
        trough="#e5e7eb", scroll="#d1d5db", code_bg="#f3f4f6", code_border="#e5e7eb",
        tooltip_bg="#111827", tooltip_text="#ffffff",
        plot_bg="#ffffff", plot_axis="#9aa0a6", plot_text="#5f6368", plot_mean="#1e2430",
        heat_bg="#f3f4f6", heat_gap="#ffffff", heat_routed="#111827",
        pygments="default", mark="#4f46e5"),
    DARK: dict(
        accent="#6366f1", accent_hover="#818cf8", on_accent="#ffffff",
        bg="#1b1d22", surface="#23262d", input="#1f2227", input_soft="#202329",
        border="#343842", border_input="#3d424d", border_prompt="#454b57",
        sidebar="#202329", sidebar_border="#30343c", item_hover="#2c3038",
        selected="#33366b", selected_text="#e0e7ff",
        text="#e6e8eb", strong="#f3f4f6", mid="#d1d5db", soft="#b6bcc6", muted="#9aa1ad", faint="#6b7280",
        hover="#2c3038", user_card="#272b4a", user_border="#363b66",
        toggle_on="#2e3160", toggle_on_border="#4a4f8f",
        warn_bg="#33290f", warn_border="#6b5514", warn_text="#fcd34d", warn_text2="#fde68a",
        warn_button="#8a6d1a", warn_on="#6b5514", status_note="#f59e0b",
        error_bg="#3a1f22", error_border="#6b2c31", error_title="#fca5a5",
        info_bg="#1b2a44", info_border="#2c4a7a", info_title="#bfdbfe",
        disabled_bg="#25272c", disabled_text="#5d626c", disabled_border="#2e3138",
        disabled_accent="#3d414b", stop="#dc2626", stop_hover="#ef4444",
        trough="#343842", scroll="#4b5060", code_bg="#2a2d35", code_border="#3a3e48",
        tooltip_bg="#f3f4f6", tooltip_text="#111827",
        plot_bg="#23262d", plot_axis="#6b7280", plot_text="#b6bcc6", plot_mean="#e6e8eb",
        heat_bg="#181b21", heat_gap="#181b21", heat_routed="#ffffff",
        pygments="monokai", mark="#818cf8"),
}

STYLESHEET = """
QMainWindow, #rightColumn { background: %(bg)s; }
QMenuBar { background: %(surface)s; border-bottom: 1px solid %(border)s; color: %(text)s; }
QStatusBar { background: %(surface)s; border-top: 1px solid %(border)s; color: %(soft)s; }
QStatusBar QLabel { color: %(soft)s; padding: 0 8px; }
QStatusBar::item { border: none; }

#sidebar { background: %(sidebar)s; border-right: 1px solid %(sidebar_border)s; }
#newChatButton { background: %(accent)s; color: %(on_accent)s; border: none; border-radius: 8px;
                 padding: 8px 10px; font-weight: 600; text-align: left; }
#newChatButton:hover { background: %(accent_hover)s; }
#newChatButton:disabled { background: %(disabled_accent)s; color: %(disabled_text)s; }
#searchEdit { background: %(input)s; color: %(text)s; border: 1px solid %(border_input)s; border-radius: 8px;
              padding: 6px 8px; }
#searchEdit:focus { border-color: %(accent)s; }
#searchEdit:disabled { background: %(disabled_bg)s; color: %(disabled_text)s; border-color: %(disabled_border)s; }
#searchHits { color: %(muted)s; font-size: 11px; }
#conversationList { background: transparent; border: none; outline: none; color: %(text)s; }
#conversationList::item { padding: 8px 8px; border-radius: 6px; color: %(text)s; }
#conversationList::item:hover { background: %(item_hover)s; }
#conversationList::item:selected { background: %(selected)s; color: %(selected_text)s; }
#sideButton { background: %(input)s; color: %(text)s; border: 1px solid %(border_input)s; border-radius: 6px;
              padding: 5px 10px; }
#sideButton:hover { background: %(hover)s; }
#sideButton:disabled { background: %(disabled_bg)s; color: %(disabled_text)s; border-color: %(disabled_border)s; }

#chatHeader { background: %(surface)s; border-bottom: 1px solid %(border)s; }
#chatTitle { font-size: 15px; font-weight: 600; color: %(strong)s; }
#systemToggle, #headerButton { border: 1px solid %(border_input)s; border-radius: 6px; padding: 3px 8px;
                               background: %(input)s; color: %(mid)s; }
#systemToggle:checked { background: %(toggle_on)s; border-color: %(toggle_on_border)s; }
#systemToggle:disabled, #headerButton:disabled { background: %(disabled_bg)s; color: %(disabled_text)s;
                                                 border-color: %(disabled_border)s; }
#headerButton::menu-indicator { image: none; width: 0; }
#systemEdit { background: %(input_soft)s; color: %(text)s; border: 1px solid %(border_input)s; border-radius: 8px;
              padding: 4px; }
#systemEdit:disabled, #systemEdit:read-only { color: %(muted)s; }

#transcript, #transcriptInner { background: %(bg)s; }
#emptyLabel { color: %(faint)s; font-size: 14px; padding: 40px; }
#assistantCard { background: %(surface)s; border: 1px solid %(border)s; border-radius: 10px; }
#userCard { background: %(user_card)s; border: 1px solid %(user_border)s; border-radius: 10px; }
#assistantCard[found="true"], #userCard[found="true"] { border: 2px solid %(accent)s; }
#roleLabel { font-weight: 600; color: %(mid)s; font-size: 12px; }
#metaLabel { color: %(muted)s; font-size: 11px; }
#statusNote { color: %(status_note)s; font-size: 11px; }
#statusNote[kind="streaming"] { color: %(muted)s; font-style: italic; }
#thinkToggle { color: %(muted)s; border: none; padding: 0px 2px; font-size: 11px; font-style: italic; }
#thinkText { color: %(muted)s; border-left: 2px solid %(border)s; font-size: 12px; }
#codeBlock { background: %(code_bg)s; border: 1px solid %(code_border)s; border-radius: 6px; }
#codeLang { color: %(muted)s; font-size: 11px; }
#codeCopy { color: %(muted)s; border: none; padding: 1px 6px; border-radius: 4px; font-size: 11px; }
#codeCopy:hover { background: %(hover)s; color: %(strong)s; }
#templateBanner { background: %(warn_bg)s; border-bottom: 1px solid %(warn_border)s; }
#templateBannerText { color: %(warn_text)s; }
#rawModeButton { border: 1px solid %(warn_button)s; background: %(input)s; color: %(text)s; border-radius: 6px;
                 padding: 4px 10px; }
#rawModeButton:checked { background: %(warn_on)s; }
#rawModeButton:disabled { background: %(disabled_bg)s; color: %(disabled_text)s; border-color: %(disabled_border)s; }
#msgAction { color: %(muted)s; border: none; padding: 2px 6px; border-radius: 4px; font-size: 11px; }
#msgAction:hover { background: %(hover)s; color: %(strong)s; }
#msgAction:disabled { color: %(disabled_text)s; }

#inputBar { background: %(bg)s; }
#promptEdit { background: %(input)s; color: %(text)s; border: 1px solid %(border_prompt)s; border-radius: 10px;
              padding: 6px 8px; font-size: 13px; }
#promptEdit:focus { border-color: %(accent)s; }
#promptEdit:disabled { background: %(disabled_bg)s; color: %(disabled_text)s; border-color: %(disabled_border)s; }
#editHint { color: %(muted)s; font-size: 11px; }
#sendButton { background: %(accent)s; color: %(on_accent)s; border: none; border-radius: 10px;
              padding: 10px 18px; font-weight: 600; min-width: 64px; }
#sendButton:hover { background: %(accent_hover)s; }
#sendButton:disabled { background: %(disabled_accent)s; color: %(disabled_text)s; }
#sendButton[stop="true"] { background: %(stop)s; }
#sendButton[stop="true"]:hover { background: %(stop_hover)s; }

#banner { background: %(error_bg)s; border: 1px solid %(error_border)s; border-radius: 10px; }
#banner[level="info"] { background: %(info_bg)s; border-color: %(info_border)s; }
#bannerTitle { font-weight: 600; color: %(error_title)s; }
#banner[level="info"] #bannerTitle { color: %(info_title)s; }
#bannerText { color: %(mid)s; }
#bannerHint { color: %(soft)s; font-style: italic; }
#bannerDismiss { border: 1px solid %(border)s; background: %(input)s; color: %(text)s; border-radius: 6px;
                 padding: 4px 10px; }
#bannerDismiss:disabled { background: %(disabled_bg)s; color: %(disabled_text)s; }

#queuedNote { background: %(info_bg)s; border: 1px solid %(info_border)s; border-radius: 10px; }
#queuedNoteText { color: %(info_title)s; }
#readOnlyNote { background: %(warn_bg)s; border: 1px solid %(warn_border)s; border-radius: 10px; }
#readOnlyNoteText { color: %(warn_text2)s; }

#loadingFrame { background: %(surface)s; border: 1px solid %(border)s; border-radius: 10px; }
#loadingLabel { color: %(mid)s; }
QProgressBar { border: none; background: %(trough)s; border-radius: 4px; height: 8px; text-align: center; }
QProgressBar::chunk { background: %(accent)s; border-radius: 4px; }

QDockWidget { font-weight: 600; color: %(mid)s; }
QDockWidget::title { background: %(surface)s; padding: 6px 10px; border-bottom: 1px solid %(border)s; }
#panelsRoot { background: %(bg)s; }
#panelCard { background: %(surface)s; border: 1px solid %(border)s; border-radius: 10px; }
#panelTitle { font-weight: 600; color: %(strong)s; font-size: 12px; }
#panelLegend { color: %(soft)s; font-size: 11px; }
QScrollArea { background: transparent; }
QScrollBar:vertical { background: transparent; width: 10px; margin: 2px; }
QScrollBar::handle:vertical { background: %(scroll)s; border-radius: 4px; min-height: 24px; }
QScrollBar::add-line:vertical, QScrollBar::sub-line:vertical { height: 0; }
QSplitter::handle { background: %(sidebar_border)s; }
QRadioButton::indicator, QCheckBox::indicator { width: 13px; height: 13px; border: 1px solid %(muted)s;
    background: %(input)s; }
QRadioButton::indicator { border-radius: 7px; }
QCheckBox::indicator { border-radius: 3px; }
QRadioButton::indicator:checked { border-color: %(accent)s; background: qradialgradient(cx:0.5, cy:0.5,
    radius:0.5, fx:0.5, fy:0.5, stop:0 %(accent)s, stop:0.48 %(accent)s, stop:0.58 %(input)s, stop:1 %(input)s); }
QCheckBox::indicator:checked { border-color: %(accent)s; background: %(accent)s; image: url(%(check_icon)s); }
QRadioButton::indicator:disabled, QCheckBox::indicator:disabled { border-color: %(disabled_border)s;
    background: %(disabled_bg)s; }
QCheckBox::indicator:checked:disabled { background: %(disabled_accent)s; border-color: %(disabled_accent)s; }
QRadioButton::indicator:checked:disabled { background: qradialgradient(cx:0.5, cy:0.5, radius:0.5, fx:0.5,
    fy:0.5, stop:0 %(disabled_accent)s, stop:0.48 %(disabled_accent)s, stop:0.58 %(disabled_bg)s,
    stop:1 %(disabled_bg)s); }
"""


def system_scheme() -> str:
    """The desktop's colour scheme: DARK when ``QStyleHints.colorScheme()`` says Dark, else
    LIGHT (Light, Unknown, or a Qt older than 6.5)."""
    app = QGuiApplication.instance()
    hints = app.styleHints() if app is not None else None
    try:
        return DARK if hints is not None and hints.colorScheme() == Qt.ColorScheme.Dark else LIGHT
    except AttributeError:  # Qt < 6.5
        return LIGHT


def resolve(choice: str) -> str:
    """The scheme a ``theme`` setting means: LIGHT or DARK (SYSTEM follows the desktop)."""
    return choice if choice in (LIGHT, DARK) else system_scheme()


def stylesheet(scheme: str) -> str:
    """The application style sheet of ``scheme`` (LIGHT or DARK). Radio buttons and check boxes
    get their own indicator: the platform style draws its ring in a shade of the window colour,
    nearly invisible on the dark scheme."""
    from engine.library import resources_dir
    check = (resources_dir() / "icons" / "check.svg").as_posix()
    return STYLESHEET % dict(SCHEMES[scheme], check_icon=check)


def palette(scheme: str) -> QPalette:
    """The QPalette of ``scheme``; the Disabled group is greyed (text, buttons, bases)."""
    c = {k: QColor(v) for k, v in SCHEMES[scheme].items() if v.startswith("#")}
    pal = QPalette()
    for role, key in ((QPalette.Window, "bg"), (QPalette.WindowText, "text"), (QPalette.Base, "input"),
                      (QPalette.AlternateBase, "hover"), (QPalette.Text, "text"), (QPalette.Button, "surface"),
                      (QPalette.ButtonText, "text"), (QPalette.Highlight, "accent"),
                      (QPalette.HighlightedText, "on_accent"), (QPalette.PlaceholderText, "faint"),
                      (QPalette.ToolTipBase, "tooltip_bg"), (QPalette.ToolTipText, "tooltip_text"),
                      (QPalette.Link, "accent"), (QPalette.Mid, "border_input"), (QPalette.Midlight, "border"),
                      (QPalette.Light, "surface"), (QPalette.Dark, "border_prompt"), (QPalette.Shadow, "faint")):
        pal.setColor(role, c[key])
    D = QPalette.Disabled
    for role, key in ((QPalette.WindowText, "disabled_text"), (QPalette.Text, "disabled_text"),
                      (QPalette.ButtonText, "disabled_text"), (QPalette.Button, "disabled_bg"),
                      (QPalette.Base, "disabled_bg"), (QPalette.Highlight, "disabled_accent"),
                      (QPalette.HighlightedText, "disabled_text"), (QPalette.PlaceholderText, "disabled_text"),
                      (QPalette.Light, "disabled_bg"), (QPalette.Midlight, "disabled_border"),
                      (QPalette.Mid, "disabled_border")):
        pal.setColor(D, role, c[key])
    return pal


class ThemeController(QObject):
    """Applies the chosen colour scheme to the application and follows the desktop's scheme
    while the choice is SYSTEM. ``changed(scheme)`` is emitted after a new scheme is applied
    (LIGHT or DARK); ``scheme`` is the one in effect."""

    changed = Signal(str)

    def __init__(self):
        super().__init__()
        self.choice = SYSTEM
        self.scheme = LIGHT
        self._hooked = False

    def apply(self, app: QApplication, choice: str = SYSTEM) -> str:
        """Fusion style, the palette, the style sheet and pyqtgraph defaults of ``choice``
        (SYSTEM, LIGHT or DARK). Returns the scheme applied."""
        self.choice = choice if choice in (SYSTEM, LIGHT, DARK) else SYSTEM
        if not self._hooked:
            try:
                app.styleHints().colorSchemeChanged.connect(self.system_changed)
            except AttributeError:  # Qt < 6.5: no change notification
                pass
            self._hooked = True
        scheme = resolve(self.choice)
        app.setStyle("Fusion")
        app.setPalette(palette(scheme))
        f = app.font()
        if f.pointSizeF() < 10:
            f.setPointSizeF(10)
        f.setStyleHint(QFont.SansSerif)
        app.setFont(f)
        app.setStyleSheet(stylesheet(scheme))
        col = SCHEMES[scheme]
        pg.setConfigOptions(antialias=True, foreground=col["plot_text"], background=col["plot_bg"])
        self.scheme = scheme
        self.changed.emit(scheme)
        return scheme

    def system_changed(self, *_args) -> None:
        """The desktop switched light <-> dark: follow it when the choice is SYSTEM."""
        app = QApplication.instance()
        if app is not None and self.choice == SYSTEM and resolve(SYSTEM) != self.scheme:
            self.apply(app, SYSTEM)


THEME = ThemeController()


def colors() -> dict[str, str]:
    """The named colours of the scheme in effect."""
    return SCHEMES[THEME.scheme]


def apply_theme(app: QApplication, choice: str = SYSTEM) -> str:
    """Apply the ``theme`` setting (SYSTEM / LIGHT / DARK) to ``app``; see ThemeController."""
    return THEME.apply(app, choice)
