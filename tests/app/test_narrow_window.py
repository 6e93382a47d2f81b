"""The main window at its minimum size, checked on the widgets and
grabbed to PNG (set COLIBRI_SHOTS_DIR to keep the images): no text is cut or wraps where it
cannot show. The prompt box's placeholder fits on its one line (a shorter variant, else
elided, for every state); the "Ask anything" hint wraps; the residency map's hint stays inside
the map; every plot's axis labels lie inside the plot (the panels keep the height their cards
need, so a small window no longer cut "expert" off); the first x label ("0") is shown; a
temporary status message is not cut to its first letter."""

from __future__ import annotations

import os

from PySide6.QtCore import QRectF
from PySide6.QtGui import QImage, QPainter
from PySide6.QtWidgets import QApplication

LONG = "Waiting for the engine to finish the conversion of the model you chose in the wizard…"


def _to_min_size(qtbot, win) -> None:
    def at_min() -> bool:              # the panels move under the chat, then the minimum drops
        low = win.minimumSizeHint().expandedTo(win.minimumSize())
        if (win.width(), win.height()) == (low.width(), low.height()):
            return True
        win.resize(low)
        return False
    qtbot.waitUntil(at_min, timeout=1_800_000)
    qtbot.wait(50)
    low = win.minimumSizeHint().expandedTo(win.minimumSize())
    assert (win.width(), win.height()) == (low.width(), low.height())
    assert win.width() < 700, win.width()       # really narrow: the dock is under the chat


def _glyphs(item) -> QRectF:
    """Scene rect of a QGraphicsTextItem's text, without its document margin."""
    m = item.document().documentMargin()
    return item.mapRectToScene(item.boundingRect().adjusted(m, m, -m, -m))


def _fits(edit) -> bool:
    return edit.fontMetrics().horizontalAdvance(edit.placeholderText()) <= edit.placeholder_room()


def test_minimum_size_window_cuts_no_text(qtbot, make_window):
    win = make_window()
    _to_min_size(qtbot, win)
    chat, p = win.chat, win.panels
    edit = chat.input

    # the prompt box placeholder: one line in every state; the whole sentence when wide enough
    assert _fits(edit) and edit.placeholderText().startswith("Message the model"), edit.placeholderText()
    chat.set_chat_template(False)
    assert _fits(edit) and "raw mode" in edit.placeholderText().lower(), edit.placeholderText()
    chat.raw_btn.setChecked(True)
    assert _fits(edit) and edit.placeholderText().startswith("Raw mode"), edit.placeholderText()
    chat.set_chat_template(True)
    chat.set_ready(False, LONG)
    assert _fits(edit) and edit.placeholderText().endswith("…") and edit.toolTip() == LONG
    chat.set_ready(True)

    # the empty chat's hint wraps inside the page instead of running off its right edge
    win.new_chat()
    qtbot.wait(50)
    lab = chat.empty_label
    assert lab.isVisibleTo(win) and chat.inner.width() <= chat.scroll.viewport().width()
    assert lab.heightForWidth(lab.width()) <= lab.height() + 1

    # the residency hint is inside the map (before the first answer)
    vb = p.heat_plot.getPlotItem().getViewBox()
    assert p.heat_hint.isVisible()
    p.heat_plot.grab()                 # pyqtgraph places a TextItem when it paints
    assert vb.sceneBoundingRect().adjusted(-1, -1, 1, 1).contains(_glyphs(p.heat_hint.textItem))

    def check_axes():
        assert p.height() >= p.grid.totalMinimumHeightForWidth(p.width())   # cards not squeezed
        for w in (p.hit_plot, p.ssd_plot, p.ram_plot, p.heat_plot):
            view = QRectF(0, 0, w.width(), w.height())
            for ax in ("left", "bottom"):
                r = _glyphs(w.getPlotItem().getAxis(ax).label)
                assert view.contains(r), (w, ax, r, view)
            assert w.mapTo(p, w.rect().bottomLeft()).y() < p.height()        # the plot is not cut
    check_axes()

    # the first x label of the line plots is drawn (pyqtgraph hid it in a narrow panel)
    for w in (p.hit_plot, p.ram_plot, p.heat_plot):
        axis = w.getPlotItem().getAxis("bottom")
        img = QImage(8, 8, QImage.Format_ARGB32)
        painter = QPainter(img)
        specs = axis.generateDrawSpecs(painter)[2]
        painter.end()
        assert any(text == "0" for _rect, _flags, text in specs), (w, [t for *_x, t in specs])

    # a temporary status message gets its room
    win.statusBar().showMessage("Model ready", 4000)
    QApplication.processEvents()
    assert win.statusBar().fontMetrics().horizontalAdvance("Model ready") <= win.status_message_room()
    win.statusBar().clearMessage()
    QApplication.processEvents()
    assert not win.st_threads.isHidden() and not win.st_cap.isHidden()

    # after an answer too (the map drawn, the tick labels set)
    from answer_helpers import send
    send(qtbot, win, "hi")
    p.redraw()
    qtbot.wait(50)
    check_axes()
    steps = p.tick_steps(*p._heat_shape)
    assert steps[1] * vb.width() / p._heat_shape[1] >= edit.fontMetrics().horizontalAdvance("7")
    shots = os.environ.get("COLIBRI_SHOTS_DIR")
    if shots:
        win.grab().save(os.path.join(shots, "narrow-window.png"))
    # wide again: the whole placeholder sentence
    full = "Message the model…  (Enter to send, Shift+Enter for a new line)"
    win.resize(2000, 900)
    qtbot.waitUntil(lambda: edit.placeholder_room() >= edit.fontMetrics().horizontalAdvance(full), timeout=1_800_000)
    qtbot.waitUntil(lambda: edit.placeholderText() == full, timeout=1_800_000)
    assert edit.toolTip() == ""


def test_widening_gives_the_panels_their_width_back(qtbot, make_window):
    """780 px puts the panels under the chat; back at 1400 px they were left ~530 px wide (the
    minimum their two columns had set) instead of the width they had beside the chat."""
    from PySide6.QtCore import Qt
    win = make_window(wait_loaded=False)
    win.resize(1400, 900)
    qtbot.waitUntil(lambda: win.width() == 1400 and win.dockWidgetArea(win.dock) == Qt.RightDockWidgetArea)
    qtbot.wait(50)
    before = win.dock.width()
    win.resize(780, 700)
    qtbot.waitUntil(lambda: win.dockWidgetArea(win.dock) == Qt.BottomDockWidgetArea, timeout=1_800_000)
    win.resize(1400, 900)
    qtbot.waitUntil(lambda: win.dockWidgetArea(win.dock) == Qt.RightDockWidgetArea, timeout=1_800_000)
    qtbot.waitUntil(lambda: abs(win.dock.width() - before) <= 8, timeout=1_800_000)
