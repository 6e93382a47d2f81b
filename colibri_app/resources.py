"""Look and feel: the application palette and style sheet (one light theme)."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QColor, QFont, QPalette
from PySide6.QtWidgets import QApplication

ACCENT = "#4f46e5"

STYLESHEET = """
QMainWindow, #rightColumn { background: #f7f7f8; }
QMenuBar { background: #ffffff; border-bottom: 1px solid #e5e7eb; }
QStatusBar { background: #ffffff; border-top: 1px solid #e5e7eb; color: #4b5563; }
QStatusBar QLabel { color: #4b5563; padding: 0 8px; }
QStatusBar::item { border: none; }

#sidebar { background: #eef0f3; border-right: 1px solid #e2e5ea; }
#newChatButton { background: %(accent)s; color: white; border: none; border-radius: 8px;
                 padding: 8px 10px; font-weight: 600; text-align: left; }
#newChatButton:hover { background: #4338ca; }
#searchEdit { background: white; border: 1px solid #d9dce1; border-radius: 8px; padding: 6px 8px; }
#searchEdit:focus { border-color: %(accent)s; }
#conversationList { background: transparent; border: none; outline: none; }
#conversationList::item { padding: 8px 8px; border-radius: 6px; color: #1f2328; }
#conversationList::item:hover { background: #e3e6eb; }
#conversationList::item:selected { background: #dcdffb; color: #1e1b4b; }
#sideButton { background: white; border: 1px solid #d9dce1; border-radius: 6px; padding: 5px 10px; }
#sideButton:hover { background: #f3f4f6; }
#sideButton:disabled { color: #9ca3af; }

#chatHeader { background: #ffffff; border-bottom: 1px solid #e5e7eb; }
#chatTitle { font-size: 15px; font-weight: 600; color: #111827; }
#systemToggle { border: 1px solid #d9dce1; border-radius: 6px; padding: 3px 8px; background: white; color: #374151; }
#systemToggle:checked { background: #eef2ff; border-color: #c7d2fe; }
#systemEdit { background: #fafafa; border: 1px solid #d9dce1; border-radius: 8px; padding: 4px; }

#transcript, #transcriptInner { background: #f7f7f8; }
#emptyLabel { color: #9ca3af; font-size: 14px; padding: 40px; }
#assistantCard { background: #ffffff; border: 1px solid #e5e7eb; border-radius: 10px; }
#userCard { background: #eef2ff; border: 1px solid #dfe3fb; border-radius: 10px; }
#roleLabel { font-weight: 600; color: #374151; font-size: 12px; }
#metaLabel { color: #6b7280; font-size: 11px; }
#statusNote { color: #b45309; font-size: 11px; }
#statusNote[kind="streaming"] { color: #6b7280; font-style: italic; }
#thinkToggle { color: #6b7280; border: none; padding: 0px 2px; font-size: 11px; font-style: italic; }
#thinkText { color: #6b7280; border-left: 2px solid #e5e7eb; font-size: 12px; }
#templateBanner { background: #fffbeb; border-bottom: 1px solid #fde68a; }
#templateBannerText { color: #92400e; }
#rawModeButton { border: 1px solid #fcd34d; background: white; border-radius: 6px; padding: 4px 10px; }
#rawModeButton:checked { background: #fde68a; }
#msgAction { color: #6b7280; border: none; padding: 2px 6px; border-radius: 4px; font-size: 11px; }
#msgAction:hover { background: #f3f4f6; color: #111827; }

#inputBar { background: #f7f7f8; }
#promptEdit { background: white; border: 1px solid #d1d5db; border-radius: 10px; padding: 6px 8px;
              font-size: 13px; }
#promptEdit:focus { border-color: %(accent)s; }
#editHint { color: #6b7280; font-size: 11px; }
#sendButton { background: %(accent)s; color: white; border: none; border-radius: 10px;
              padding: 10px 18px; font-weight: 600; min-width: 64px; }
#sendButton:hover { background: #4338ca; }
#sendButton:disabled { background: #c7c9d1; }
#sendButton[stop="true"] { background: #dc2626; }
#sendButton[stop="true"]:hover { background: #b91c1c; }

#banner { background: #fef2f2; border: 1px solid #fecaca; border-radius: 10px; }
#banner[level="info"] { background: #eff6ff; border-color: #bfdbfe; }
#bannerTitle { font-weight: 600; color: #991b1b; }
#banner[level="info"] #bannerTitle { color: #1e3a8a; }
#bannerText { color: #374151; }
#bannerHint { color: #4b5563; font-style: italic; }
#bannerDismiss { border: 1px solid #e5e7eb; background: white; border-radius: 6px; padding: 4px 10px; }

#queuedNote { background: #eff6ff; border: 1px solid #bfdbfe; border-radius: 10px; }
#queuedNoteText { color: #1e3a8a; }
#readOnlyNote { background: #fffbeb; border: 1px solid #fde68a; border-radius: 10px; }
#readOnlyNoteText { color: #78350f; }

#loadingFrame { background: #ffffff; border: 1px solid #e5e7eb; border-radius: 10px; }
#loadingLabel { color: #374151; }
QProgressBar { border: none; background: #e5e7eb; border-radius: 4px; height: 8px; text-align: center; }
QProgressBar::chunk { background: %(accent)s; border-radius: 4px; }

QDockWidget { font-weight: 600; color: #374151; }
QDockWidget::title { background: #ffffff; padding: 6px 10px; border-bottom: 1px solid #e5e7eb; }
#panelsRoot { background: #f7f7f8; }
#panelCard { background: #ffffff; border: 1px solid #e5e7eb; border-radius: 10px; }
#panelTitle { font-weight: 600; color: #111827; font-size: 12px; }
#panelLegend { color: #4b5563; font-size: 11px; }
QScrollArea { background: transparent; }
QScrollBar:vertical { background: transparent; width: 10px; margin: 2px; }
QScrollBar::handle:vertical { background: #d1d5db; border-radius: 4px; min-height: 24px; }
QScrollBar::add-line:vertical, QScrollBar::sub-line:vertical { height: 0; }
QSplitter::handle { background: #e2e5ea; }
""" % {"accent": ACCENT}


def apply_theme(app: QApplication) -> None:
    """Fusion style, a light palette, the style sheet, and matching pyqtgraph defaults."""
    app.setStyle("Fusion")
    pal = QPalette()
    pal.setColor(QPalette.Window, QColor("#f7f7f8"))
    pal.setColor(QPalette.WindowText, QColor("#1f2328"))
    pal.setColor(QPalette.Base, QColor("#ffffff"))
    pal.setColor(QPalette.AlternateBase, QColor("#f3f4f6"))
    pal.setColor(QPalette.Text, QColor("#1f2328"))
    pal.setColor(QPalette.Button, QColor("#ffffff"))
    pal.setColor(QPalette.ButtonText, QColor("#1f2328"))
    pal.setColor(QPalette.Highlight, QColor(ACCENT))
    pal.setColor(QPalette.HighlightedText, QColor("#ffffff"))
    pal.setColor(QPalette.PlaceholderText, QColor("#9ca3af"))
    pal.setColor(QPalette.ToolTipBase, QColor("#111827"))
    pal.setColor(QPalette.ToolTipText, QColor("#ffffff"))
    app.setPalette(pal)
    f = app.font()
    if f.pointSizeF() < 10:
        f.setPointSizeF(10)
    f.setStyleHint(QFont.SansSerif)
    app.setFont(f)
    app.setStyleSheet(STYLESHEET)
    pg.setConfigOptions(antialias=True, foreground="#5f6368")
