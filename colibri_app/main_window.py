"""MainWindow: conversations | chat, the live panels dock, the status bar, menus.

Owns the history database (GUI thread only) and the EngineController (worker thread).
Engine failures are shown in a banner above the chat, never as assistant text; the window
stays usable and the next prompt works.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import asdict, replace
from pathlib import Path

from PySide6.QtCore import QByteArray, QCoreApplication, QEvent, QSize, Qt, QTimer, Slot
from PySide6.QtGui import QAction, QColor, QIcon, QKeySequence, QPainter, QPixmap, QShortcut
from PySide6.QtWidgets import (QApplication, QDockWidget, QFileDialog, QFrame, QHBoxLayout, QInputDialog, QLabel,
                               QMainWindow, QScrollArea, QSizePolicy,
                               QMessageBox, QProgressBar, QPushButton, QSplitter, QVBoxLayout, QWidget)

from engine import (ABSENT, ChatMessage, EngineConfig, EngineFailure, Finished, Loaded, LoadProgress,
                    ErrorKind, ResidencySnapshot, SamplingParams, StepMetrics, TokenEvent, compile_needed, fresh_seed,
                    library)
from engine import error_text

from .chat_view import ChatView, ConversationList
from .answer import AnswerEnd, AnswerStream
from .engine_bridge import EngineController
from .history import COMPLETE, DEFAULT_TITLE, ERROR, STREAMING, History, HistoryBusy, Message, history_is_free
from .plot_panels import PlotPanels
from .serve import ServeController, ServeDialog
from .workers import shutdown_all
from .settings_store import Settings, save_settings

log = logging.getLogger(__name__)

UI_STATE_FILE = "ui_state.json"
GENERATING, WAITING = "generating…", "waiting"   # sidebar marks
# what an empty chat says while the bundled model is open: what it is, what it gets right and
# wrong, and the way to a real model
BUNDLED_INTRO = (
    "<p><b>This is the bundled model</b>, a small offline model (11 M parameters) that explains "
    "Python's standard library from its documentation.</p>"
    "<p>Good at “What does <code>json.dumps</code> do?” (it looks the entry up and answers from it). "
    "Often wrong on “How do I …?” questions and on follow-up questions in the same chat.</p>"
    "<p>For everyday questions, code and longer chats, get a real model: "
    "<a href=\"recommended\">Recommended for this computer…</a> (File › Add model…).</p>")
BUNDLED_PLACEHOLDERS = ("Ask what a standard-library function does, e.g. What does json.dumps do?  (Enter to send)",
                        "Ask what a function does, e.g. What does json.dumps do?",
                        "e.g. What does json.dumps do?")


def auto_title(first_text: str) -> str:
    """A new chat's title: its first message on one line, at most 48 characters."""
    return " ".join(first_text.split())[:48] or DEFAULT_TITLE


def mark_icon(mark: str) -> QIcon:
    """A dot before a conversation in the sidebar: accent while generating, grey while waiting."""
    from .resources import colors
    pm = QPixmap(12, 12)
    pm.fill(Qt.transparent)
    p = QPainter(pm)
    p.setRenderHint(QPainter.Antialiasing)
    p.setPen(Qt.NoPen)
    p.setBrush(QColor(colors()["mark"] if mark == GENERATING else colors()["faint"]))
    p.drawEllipse(2, 2, 8, 8)
    p.end()
    return QIcon(pm)

HINTS = {
    ErrorKind.STORE: "Open another model (File › Models…) or add one (File › Add model…).",
    ErrorKind.TOKENIZER: "The model's tokenizer files are missing or invalid; add the model again "
                         "(File › Add model…).",
    ErrorKind.BUDGET: "Raise the RAM budget or lower the expert slots per layer in Settings…, then try again.",
    ErrorKind.CONFIG: "Correct the setting in Settings…",
    ErrorKind.CONTEXT: "Start a new chat (Ctrl+N) or shorten the message.",
    ErrorKind.IO: "Check the disk that holds the model, then try again.",
    ErrorKind.GENERATION: "Try again (Regenerate), or start a new chat. If it keeps happening, restart the app.",
    ErrorKind.HISTORY: "Your earlier chats are kept in the file named above.",
    ErrorKind.SETTINGS: "Open Settings… to review them.",
    ErrorKind.MODEL: "The bundled default model is used instead; choose another in File › Models…",
    ErrorKind.UNAVAILABLE: "This part of the app is not installed in this build yet.",
}


# --- ui_state.json --------------------------------------------------------------------------


def ui_state_path() -> Path:
    """Where window geometry, splitter sizes, dock visibility and the last chat are kept."""
    return library.user_config_dir() / UI_STATE_FILE


def load_ui_state() -> dict:
    """The saved UI state, or {} when missing or unreadable."""
    try:
        d = json.loads(ui_state_path().read_text(encoding="utf-8"))
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def save_ui_state(state: dict) -> None:
    """Write the UI state atomically (errors are logged, never raised). Keys of the file this
    build does not write (a newer version's) are kept; a file that exists but cannot be read
    now is left as it is (it holds the server's API key)."""
    p = ui_state_path()
    try:
        old = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        old = {}
    except OSError as e:
        log.warning("the window state %s cannot be read (%s); it is left as it is", p, e)
        return
    except ValueError:  # not JSON: nothing in it can be kept
        old = {}
    try:
        library.atomic_write_text(p, json.dumps({**(old if isinstance(old, dict) else {}), **state}, indent=1))
    except OSError as e:
        log.warning("could not save the window state: %s", e)


# --- widgets --------------------------------------------------------------------------------

DOCK_MIN_PX = 360      # the panels' narrowest width beside the chat
NARROW_PX = 900        # below this width the panels dock moves under the chat (2 x 2 cards)
COMPACT_PX = 700       # below this the status bar keeps only model, speed and cap
STATUS_SPACING_PX = 8  # space QStatusBar keeps around each permanent label (approximate, generous)
IDLE_RESIDENCY_MS = 500  # between answers: how often the residency map looks at the cache (idle fill)


class VerticalScroll(QScrollArea):
    """A scroll area that scrolls its widget vertically only: as wide as the widget's minimum
    (plus the scroll bar), so it is never cut on the right; as short as MIN_SCROLL_PX."""

    MIN_SCROLL_PX = 160

    def minimumSizeHint(self):  # noqa: N802 - Qt's name
        w = self.widget()
        if w is None:
            return super().minimumSizeHint()
        inner = w.minimumSizeHint().expandedTo(w.minimumSize())
        extra = self.verticalScrollBar().sizeHint().width() + 2 * self.frameWidth()
        return QSize(inner.width() + extra, min(inner.height(), self.MIN_SCROLL_PX))

    def sizeHint(self):  # noqa: N802
        w = self.widget()
        if w is None:
            return super().sizeHint()
        return w.sizeHint() + QSize(self.verticalScrollBar().sizeHint().width() + 2 * self.frameWidth(), 0)


class ElidedLabel(QLabel):
    """A one-line label that shrinks with an ellipsis instead of widening its parent (the
    status bar's model name: a long name must not set the window's minimum width)."""

    def __init__(self, text: str = "", parent: QWidget | None = None):
        super().__init__(text, parent)
        self.setMinimumWidth(40)
        self.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Preferred)

    def minimumSizeHint(self):  # noqa: N802 - Qt's name
        h = super().minimumSizeHint()
        h.setWidth(40)
        return h

    def paintEvent(self, e):  # noqa: N802
        p = QPainter(self)
        r = self.contentsRect()
        p.setPen(self.palette().color(self.foregroundRole()))
        p.drawText(r, int(Qt.AlignVCenter | Qt.AlignLeft),
                   self.fontMetrics().elidedText(self.text(), Qt.ElideMiddle, r.width()))
        p.end()


class Banner(QFrame):
    """A dismissable message above the chat: what happened, and what to do."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("banner")
        self.setAccessibleName("Message banner")
        self.kind = ""
        lay = QHBoxLayout(self)
        lay.setContentsMargins(14, 10, 10, 10)
        lay.setSpacing(12)
        col = QVBoxLayout()
        col.setSpacing(2)
        self.title = QLabel()
        self.title.setObjectName("bannerTitle")
        self.text = QLabel()
        self.text.setObjectName("bannerText")
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.text.setAccessibleName("Banner message")
        self.hint = QLabel()
        self.hint.setObjectName("bannerHint")
        self.hint.setWordWrap(True)
        self.hint.setAccessibleName("What to do")
        col.addWidget(self.title)
        col.addWidget(self.text)
        col.addWidget(self.hint)
        lay.addLayout(col, 1)
        self.action = QPushButton()
        self.action.setObjectName("bannerDismiss")
        self.action.setAccessibleName("Banner action")
        self.action.hide()
        self.action.clicked.connect(self._act)
        self._action_fn = None
        lay.addWidget(self.action, 0, Qt.AlignTop)
        self.dismiss = QPushButton("Dismiss")
        self.dismiss.setObjectName("bannerDismiss")
        self.dismiss.setAccessibleName("Dismiss message")
        self.dismiss.clicked.connect(self.hide)
        lay.addWidget(self.dismiss, 0, Qt.AlignTop)
        self.hide()

    def _act(self) -> None:
        fn = self._action_fn
        self.hide()
        if fn is not None:
            fn()

    def show_message(self, kind: str, message: str, hint: str = "", error: bool = True,
                     action: tuple[str, object] | None = None, title: str = "") -> None:
        """Show ``message`` (in the app's words: engine_bridge.app_words) with a hint picked from
        ``kind`` unless given and a title from ``kind`` unless given; ``action`` = (button
        text, callable) adds a button beside Dismiss."""
        from .engine_bridge import app_words
        message = app_words(message)
        self.kind = kind
        self._action_fn = action[1] if action else None
        self.action.setText(action[0] if action else "")
        self.action.setVisible(action is not None)
        self.setProperty("level", "error" if error else "info")
        self.style().unpolish(self)
        self.style().polish(self)
        self.title.setText({ErrorKind.CONTEXT: "The conversation does not fit in the context window",
                            ErrorKind.STORE: "The model could not be opened",
                            ErrorKind.TOKENIZER: "The model's tokenizer could not be loaded",
                            ErrorKind.BUDGET: "The RAM budget is too small for this model",
                            ErrorKind.CONFIG: "A setting is invalid",
                            ErrorKind.IO: "Reading the model from disk failed",
                            ErrorKind.DISK: "The file could not be written",
                            ErrorKind.GENERATION: "The answer stopped because of an engine error",
                            ErrorKind.HISTORY: "The chat history was reset",
                            ErrorKind.SETTINGS: "Your settings could not be used",
                            ErrorKind.MODEL: "The chosen model was not found",
                            ErrorKind.UNAVAILABLE: "Not available"}.get(kind, "Something went wrong")
                           if not title else title)
        self.text.setText(message)
        self.hint.setText(hint or HINTS.get(kind, HINTS[ErrorKind.GENERATION]))
        self.show()


class LoadingPanel(QFrame):
    """Progress of converting / opening a model."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("loadingFrame")
        self.setAccessibleName("Model loading progress")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 10, 14, 12)
        self.label = QLabel("Loading the model…")
        self.label.setObjectName("loadingLabel")
        self.label.setWordWrap(True)  # a first compile's line is longer than a narrow chat column
        self.bar = QProgressBar()
        self.bar.setAccessibleName("Model loading progress bar")
        self.bar.setTextVisible(False)
        self.bar.setFixedHeight(8)
        lay.addWidget(self.label)
        lay.addWidget(self.bar)
        self.hide()

    def show_progress(self, ev: LoadProgress) -> None:
        """Update from a LoadProgress event."""
        pct = int(100 * ev.done / ev.total) if ev.total > 0 else 0
        if ev.stage == "convert":
            text = f"Converting the default model… {pct}%"
        elif ev.stage == "prewarm":
            text = f"Pre-warming pinned experts… {ev.done}/{ev.total}"
        elif ev.stage == "compile":  # the engine's sentence: a first compile, or why every start compiles
            text = (ev.message[:1].upper() + ev.message[1:] + "…") if ev.done < ev.total else "Compute kernels compiled"
        elif ev.stage == "kernels":
            text = "Preparing the compute kernels…" if ev.done < ev.total else "Compute kernels ready"
        else:
            text = f"Opening the model… {ev.message}" if ev.message else "Opening the model…"
        self.label.setText(text)
        self.bar.setRange(0, 100)
        self.bar.setValue(pct)
        self.show()


class Note(QFrame):
    """A one-sentence note above the chat (object name ``name`` styles it), with an optional
    bold title and an optional button (``self.button``)."""

    def __init__(self, name: str, accessible: str, title: str = "", button: str = "",
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName(name)
        self.setAccessibleName(accessible)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(14, 8, 10, 8)
        col = QVBoxLayout()
        if title:
            head = QLabel(title)
            head.setObjectName("bannerTitle")
            col.addWidget(head)
        self.text = QLabel()
        self.text.setObjectName(name + "Text")
        self.text.setWordWrap(True)
        self.text.setAccessibleName(accessible + " text")
        col.addWidget(self.text)
        lay.addLayout(col, 1)
        self.button: QPushButton | None = None
        if button:
            self.button = QPushButton(button)
            self.button.setObjectName("bannerDismiss")
            self.button.setAccessibleName(f"{accessible}: {button}")
            lay.addWidget(self.button, 0, Qt.AlignVCenter)
        self.hide()


# --- the window -----------------------------------------------------------------------------


class MainWindow(QMainWindow):
    """The application window. Call :meth:`start` to open the model chosen in the settings.

    Args:
        settings: the loaded Settings.
        settings_message: a problem found while loading the settings (shown as a banner).
        history: an open History (default: the user's history database).
        read_only: non-empty when another instance owns the data folder (colibri_app.instance):
            the sentence shown in the window; the history is opened read-only, no model is
            opened, and nothing in the data or config folders is written.
    """

    def __init__(self, settings: Settings, settings_message: str | None = None,
                 history: History | None = None, read_only: str = ""):
        super().__init__()
        self.setWindowTitle("colibri")
        self.settings = settings
        self.loaded: Loaded | None = None
        self.answer: AnswerStream | None = None     # the answer being written (one engine: one at a time)
        self.queue: list[tuple[int, int]] = []      # (conversation, question) waiting for the engine
        self._regenerating: set[int] = set()        # questions whose next answer is a Regenerate
        self._not_ready = "Loading the model…"      # why Send is off while no model is open
        self.conv_id: int | None = None
        self._pending_system = ""
        self._editing: int | None = None
        self._dialogs: list = []
        self._closing = False
        self.read_only = read_only
        hist_msg = None
        if history is None:
            history, hist_msg = History.open(read_only=bool(read_only))
        locked_at_start = bool(history.read_only and not read_only)
        if locked_at_start:  # the file is locked by another program
            self.read_only = read_only = history.read_only
            hist_msg = None                      # the read-only note says it
        self.history = history
        # another program locking the history while the window runs: say so, try again
        history.subscribe_busy(self._history_busy)
        self.history_retry = QTimer(self)
        self.history_retry.setInterval(2000)
        self.history_retry.timeout.connect(lambda: self.history.flush(force=True))

        self.controller = EngineController(self)
        w = self.controller.worker
        q = Qt.QueuedConnection   # explicit: these slots must run on the GUI thread
        w.progress.connect(self.on_progress, q)
        w.loaded.connect(self.on_loaded, q)
        w.token.connect(self.on_token, q)
        w.metrics.connect(self.on_metrics, q)
        w.residency.connect(self.on_residency, q)
        w.finished.connect(self.on_finished, q)
        w.failed.connect(self.on_failed, q)
        # "Serve on this computer": the server shares the engine (its requests run on the lane)
        self.serve = ServeController(self.controller, self)
        self.serve.status_changed.connect(self._serve_status)
        # between answers the cache still changes (idle fill, pre-warm, a lowered cap): the
        # residency map follows it (an answer sends its own snapshots)
        self._idle_state: tuple | None = None
        self.idle_timer = QTimer(self)
        self.idle_timer.setInterval(IDLE_RESIDENCY_MS)
        self.idle_timer.timeout.connect(self._poll_idle_residency)
        self.idle_timer.start()
        self._serve_port, self._serve_key, self._serve_origins = 8000, "", ()

        self._build_ui()
        self._build_menus()

        self._restore_ui_state()
        if read_only:
            self.read_only_note.text.setText(read_only)
            self.read_only_note.show()
            self._not_ready = "Read-only: this window does not open a model."
            for act in (self.act_settings, self.act_add, self.act_models, self.act_new, self.act_serve):
                act.setEnabled(False)
            self.sidebar.new_btn.setEnabled(False)
            self.chat.system_edit.setReadOnly(True)
            self._sync_chat()
        # locked by another program, not by another colibri: writable again once it lets go
        self.history_free = QTimer(self)
        self.history_free.setInterval(2000)
        self.history_free.timeout.connect(self._reopen_history)
        if locked_at_start:
            self.history_free.start()
        if hist_msg:
            self.banner.show_message(ErrorKind.HISTORY, hist_msg)
        if settings_message:  # a file used in part (a newer build's, one bad value) is not "not used"
            in_part = "defaults are in effect" not in settings_message
            self.banner.show_message(ErrorKind.SETTINGS, settings_message, error=not in_part,
                                     title="Some settings could not be used" if in_part else "")

    # --- construction -------------------------------------------------------------------------

    def _build_ui(self) -> None:
        self.sidebar = ConversationList()
        self.sidebar.setMinimumWidth(180)
        self.sidebar.new_requested.connect(self.new_chat)
        self.sidebar.selected.connect(self.select_conversation)
        self.sidebar.rename_requested.connect(lambda cid: self.rename_conversation(cid))
        self.sidebar.delete_requested.connect(lambda cid: self.delete_conversation(cid))
        self.sidebar.search_changed.connect(lambda _t: self._refresh_list())
        self.sidebar.message_selected.connect(lambda _cid, mid: self.chat.reveal_message(mid))

        right = QWidget()
        right.setObjectName("rightColumn")
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        rl.setSpacing(0)
        notices = QWidget()
        nl = QVBoxLayout(notices)
        nl.setContentsMargins(16, 0, 16, 0)
        nl.setSpacing(8)
        self.banner = Banner()
        self.loading = LoadingPanel()
        self.queued_note = Note("queuedNote", "Waiting for another chat", button="Don't send")
        self.queued_note.button.setToolTip("Take the waiting message back into the prompt box")
        self.queued_note.button.clicked.connect(self.cancel_queued)
        self.read_only_note = Note("readOnlyNote", "Read-only window", title="Read-only")
        nl.addWidget(self.read_only_note)
        nl.addWidget(self.banner)
        nl.addWidget(self.loading)
        nl.addWidget(self.queued_note)
        self.chat = ChatView()
        self.chat.send_requested.connect(self.send)
        self.chat.stop_requested.connect(self.stop)
        self.chat.regenerate_requested.connect(self.regenerate)
        self.chat.edit_requested.connect(self.edit_message)
        self.chat.system_prompt_edited.connect(self._system_prompt_edited)
        self.chat.recommendations_requested.connect(self.open_wizard)
        rl.addWidget(self.chat, 1)
        # notices sit between the header and the transcript
        self.chat.layout().insertWidget(1, notices)
        self._notices = notices

        self.splitter = QSplitter(Qt.Horizontal)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.setChildrenCollapsible(False)
        self.splitter.setHandleWidth(1)
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(right)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([240, 700])
        self.setCentralWidget(self.splitter)

        self.panels = PlotPanels()
        self.panels.setObjectName("panelsRoot")
        self.dock = QDockWidget("Engine", self)
        self.dock.setObjectName("panelsDock")
        self.dock.setAccessibleName("Engine panels dock")
        self.dock.setFeatures(QDockWidget.DockWidgetClosable | QDockWidget.DockWidgetMovable
                              | QDockWidget.DockWidgetFloatable)
        # the panels scroll when the dock is shorter than their cards need (PlotPanels keeps that
        # minimum), so a short window neither cuts the plots' axis labels nor grows past the screen
        self.panels_scroll = VerticalScroll()
        self.panels_scroll.setObjectName("panelsScroll")
        self.panels_scroll.setWidgetResizable(True)
        self.panels_scroll.setFrameShape(QFrame.NoFrame)
        self.panels_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.panels_scroll.setWidget(self.panels)
        self.dock.setWidget(self.panels_scroll)
        self.dock.setMinimumWidth(DOCK_MIN_PX)
        self.addDockWidget(Qt.RightDockWidgetArea, self.dock)
        self._dock_stacked = False       # moved under the chat because the window is narrow
        self._dock_side_width = 0        # its width beside the chat before it moved
        self.dock.dockLocationChanged.connect(self._dock_moved)

        sb = self.statusBar()
        self.st_model = ElidedLabel("no model")
        self.st_speed = QLabel("– tok/s")
        self.st_ttft = QLabel("TTFT –")
        self.st_cap = QLabel("cap –/layer")
        self.st_pilot = QLabel("PILOT –")
        self.st_threads = QLabel("threads –")
        self.st_threads.setAccessibleName("Compute threads in use")
        self.st_threads.setToolTip("Compute threads the engine uses now (Settings › Compute threads)")
        self.st_server = QLabel()
        self.st_server.setObjectName("serverStatus")
        self.st_server.setAccessibleName("Local server")
        self.st_server.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.st_server.hide()
        sb.addPermanentWidget(self.st_server)
        self.st_cluster = QLabel()  # expert-parallel serving (Settings › Cluster address); hidden when off
        self.st_cluster.setObjectName("clusterStatus")
        self.st_cluster.setAccessibleName("Cluster")
        self.st_cluster.setToolTip("Experts served by other computers' RAM (Settings › Cluster address)")
        self.st_cluster.hide()
        sb.addPermanentWidget(self.st_cluster)
        for lab, name in ((self.st_speed, "Tokens per second"), (self.st_ttft, "Time to first token"),
                          (self.st_cap, "Expert slots per layer"), (self.st_pilot, "PILOT prefetch mode"),
                          (self.st_threads, "Compute threads in use"), (self.st_model, "Model")):
            lab.setAccessibleName(name)
            sb.addPermanentWidget(lab)
        self._status_stepped_aside: list[QLabel] = []
        sb.messageChanged.connect(self._fit_status_message)

        QShortcut(QKeySequence(Qt.Key_Escape), self, activated=self._escape)
        self.resize(1400, 900)

    # --- narrow windows -----------------------------------------------------------------------

    def _dock_moved(self, area) -> None:
        self.panels.set_columns(2 if area in (Qt.BottomDockWidgetArea, Qt.TopDockWidgetArea) else 1)
        self.panels_scroll.updateGeometry()   # its minimum width follows the panels' columns

    def resizeEvent(self, e) -> None:  # noqa: N802
        """Narrow window: the panels move under the chat (and back when it is wide again, unless
        the user moved them); the status bar drops TTFT and PILOT below COMPACT_PX."""
        super().resizeEvent(e)
        w = self.width()
        docked_side = (not self.dock.isFloating()
                       and self.dockWidgetArea(self.dock) in (Qt.RightDockWidgetArea, Qt.LeftDockWidgetArea))
        if w < NARROW_PX and docked_side and not self.dock.isHidden():
            self._dock_stacked = True
            self._dock_side_width = self.dock.width()  # given back when the window is wide again
            self.addDockWidget(Qt.BottomDockWidgetArea, self.dock)
            # as tall as the 2 x 2 cards need when the window can spare it (else they scroll)
            need = self.panels.grid.totalMinimumHeightForWidth(max(1, self.width() - 20)) + 30
            self.resizeDocks([self.dock], [max(200, min(need, int(self.height() * 0.55)))], Qt.Vertical)
        elif w >= NARROW_PX + 80 and self._dock_stacked:
            self._dock_stacked = False
            if self.dockWidgetArea(self.dock) == Qt.BottomDockWidgetArea and not self.dock.isFloating():
                self.addDockWidget(Qt.RightDockWidgetArea, self.dock)
                # back at the width it had beside the chat, not the share Qt splits a re-docked panel to
                QTimer.singleShot(0, self._dock_back_at_side_width)
        for lab in (self.st_ttft, self.st_pilot):
            lab.setVisible(w >= COMPACT_PX)
        self._fit_status_message(self.statusBar().currentMessage())

    def _dock_back_at_side_width(self) -> None:
        """The panels beside the chat again: the width they had there, not the minimum the two
        columns under the chat left on the dock (it stayed at ~530 px, half a wide window)."""
        self.dock.setMinimumWidth(DOCK_MIN_PX)
        self.resizeDocks([self.dock], [max(DOCK_MIN_PX, self._dock_side_width)], Qt.Horizontal)

    def status_message_room(self) -> int:
        """Pixels the status bar leaves a temporary message left of its visible permanent labels."""
        sb = self.statusBar()
        used = 0
        for lab in (self.st_server, self.st_speed, self.st_ttft, self.st_cap, self.st_pilot, self.st_threads,
                    self.st_model):
            if not lab.isHidden():
                used += lab.sizeHint().width() + STATUS_SPACING_PX   # the model name too: it takes its whole width
        return sb.width() - used - STATUS_SPACING_PX * 3

    def _fit_status_message(self, text: str = "") -> None:
        """A temporary status message ("Model ready", "Exported … to …") shows left of the
        permanent labels; in a narrow window the least needed labels (threads, cap, speed) step
        aside while it shows, so it is not cut to its first letter, and come back when it ends.
        The whole message is the status bar's tooltip too."""
        for lab in self._status_stepped_aside:
            lab.show()
        self._status_stepped_aside = []
        self.statusBar().setToolTip(text or "")
        if not text:
            return
        need = self.statusBar().fontMetrics().horizontalAdvance(text)
        for lab in (self.st_threads, self.st_cap, self.st_speed):
            if need <= self.status_message_room():
                break
            if not lab.isHidden():
                lab.hide()
                self._status_stepped_aside.append(lab)

    def _build_menus(self) -> None:
        mb = self.menuBar()
        file = mb.addMenu("&File")
        self.act_new = QAction("&New chat", self, shortcut=QKeySequence.New, triggered=self.new_chat)
        self.act_add = QAction("&Add model…", self, triggered=self.open_wizard)
        self.act_models = QAction("&Models…", self, triggered=self.open_library)
        self.act_export = QAction("&Export chat…", self, shortcut=QKeySequence("Ctrl+Shift+E"),
                                  triggered=lambda: self.export_conversation())
        self.act_export.setEnabled(False)
        self.act_quit = QAction("&Quit", self, shortcut=QKeySequence.Quit, triggered=self.close)
        for a in (self.act_new, self.act_add, self.act_models):
            file.addAction(a)
        file.addSeparator()
        file.addAction(self.act_export)
        file.addSeparator()
        file.addAction(self.act_quit)
        settings = mb.addMenu("&Settings")
        self.act_settings = QAction("&Settings…", self, shortcut=QKeySequence("Ctrl+,"),
                                    triggered=self.open_settings)
        settings.addAction(self.act_settings)
        server = mb.addMenu("Se&rver")
        self.act_serve = QAction("Serve on this computer…", self, checkable=True)
        self.act_serve.setToolTip("Serve the open model on an OpenAI-compatible API at http://127.0.0.1:PORT/v1")
        self.act_serve.triggered.connect(self._serve_toggled)
        server.addAction(self.act_serve)
        view = mb.addMenu("&View")
        self.act_panels = self.dock.toggleViewAction()
        self.act_panels.setText("Engine &panels")
        self.act_panels.setShortcut(QKeySequence("Ctrl+Shift+P"))
        view.addAction(self.act_panels)
        self.act_focus = QAction("&Focus message input", self, triggered=self.focus_input)
        self.act_focus.setShortcut(QKeySequence("Ctrl+L"))
        view.addAction(self.act_focus)

    # --- engine lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Open the current model (or the bundled default) and show the last conversation
        (a read-only window opens none)."""
        if self.read_only:
            return
        cm = self.settings.current_model
        if cm and Path(cm).exists():
            self.open_model(cm)
        else:
            if cm:
                self.banner.show_message(ErrorKind.MODEL, f"The model {cm} was not found.")
            self.open_model(None)

    def open_model(self, store: str | None) -> None:
        """(Re)open a model on the worker thread; None = the bundled default model."""
        self._opening = store or ""
        self.loaded = None
        self._not_ready = "Loading the model…"
        self._sync_chat()
        self.loading.label.setText("Loading the model…")
        self.loading.bar.setRange(0, 0)
        self.loading.show()
        self.st_model.setText("loading…")
        self.serve.model_closed(store)
        self.controller.open(self.settings.engine_config(store or ""))

    @Slot(object)
    def on_progress(self, ev: LoadProgress) -> None:
        """Converting / opening progress (the prompt box says why it waits, e.g. while the
        compute kernels are prepared)."""
        if self.loaded is not None:
            return   # a late progress event of an open that already ended
        self.loading.show_progress(ev)
        self.statusBar().showMessage(self.loading.label.text())
        self._not_ready = ("Preparing the compute kernels…" if ev.stage in ("compile", "kernels") and ev.done < ev.total
                           else self.loading.label.text())
        self._sync_chat()

    @Slot(object)
    def on_loaded(self, ev: Loaded) -> None:
        """The engine is ready (and starts the first waiting message, if any)."""
        self.loaded = ev
        self._idle_state = None  # a new model: its first idle snapshot is drawn
        self.loading.hide()
        if self.banner.kind in (ErrorKind.STORE, ErrorKind.BUDGET, ErrorKind.CONFIG, ErrorKind.TOKENIZER, ErrorKind.IO):
            self.banner.hide()
        self.chat.model_name = ev.model_name
        self.chat.set_chat_template(ev.has_chat_template)
        bundled = ev.model_name == library.DEFAULT_MODEL
        self.chat.set_intro(BUNDLED_INTRO if bundled else "", BUNDLED_PLACEHOLDERS if bundled else ())
        self.panels.on_loaded(ev)
        self.st_speed.setText("– tok/s")  # the last answer's numbers were another model's (or settings')
        self.st_ttft.setText("TTFT –")
        self.st_model.setText(f"{ev.model_name} ({ev.quant})")
        self._show_cap(ev.cap_per_layer, ev.expert_slots)
        self.st_pilot.setText(f"PILOT {ev.pilot}")
        self.setWindowTitle(f"colibri — {ev.model_name}")
        self.st_model.setToolTip(f"{ev.store_path}\n{ev.message}")
        self.st_threads.setText(self._threads_text(ev.threads, ev.auto_threads))
        self.st_cluster.setText(ev.cluster)
        self.st_cluster.setVisible(bool(ev.cluster))
        if ev.docs_problem:  # the model runs; answers are given without documentation lookup
            self.st_model.setToolTip(self.st_model.toolTip() + "\n" + ev.docs_problem)
            self.statusBar().showMessage(f"Model ready, without documentation lookup: {ev.docs_problem}", 20000)
        else:
            self.statusBar().showMessage("Model ready", 4000)
        self.serve.model_loaded()
        self._sync_chat()
        self._start_next()

    @Slot(object)
    def on_failed(self, ev: EngineFailure) -> None:
        """Opening the model or starting a generation failed.

        A model that cannot be opened because it is broken (store or tokenizer errors) stops
        being the current model, so the next start does not reopen it into the same error
        (it opens the bundled default model); the banner offers the model library."""
        if self.answer is not None:
            self._answer_ended(self.answer.fail(ev.message, ev.kind))
            return
        self.loading.hide()
        self.statusBar().clearMessage()   # no stale "Opening the model…"
        self.st_model.setText("no model")
        self._not_ready = "No model is open — see the message above."
        self._sync_chat()
        failed = getattr(self, "_opening", "")
        if failed and ev.kind in (ErrorKind.STORE, ErrorKind.TOKENIZER) and not self.read_only:
            if self.settings.current_model == failed:
                self.settings = replace(self.settings, current_model="")
                try:
                    save_settings(self.settings)
                except OSError as e:
                    log.warning("could not save the settings: %s", e)
            self.banner.show_message(
                ev.kind, ev.message, hint="Choose another model in the library or add one (File › Add model…); "
                "the next start opens the bundled default model instead of this one.",
                action=("Open Models…", self.open_library))
            return
        self.banner.show_message(ev.kind, ev.message)

    # --- conversations ------------------------------------------------------------------------

    def _refresh_list(self) -> None:
        """Fill the sidebar: every conversation, or with a search the ones whose title or
        message text matches (History.search, FTS5), with the matching words; the chat being
        answered gets the "generating" mark, chats waiting for it "waiting"."""
        query = self.sidebar.search.text().strip()
        convs = self.history.conversations(query)
        hits: dict[int, tuple[int, str]] = {}
        n_messages = 0
        if query:
            found = self.history.search(query)
            n_messages = len(found)
            for h in found:
                hits.setdefault(h.conversation_id, (h.message_id, h.snippet))
            have = {c.id for c in convs}
            convs += [c for c in (self.history.conversation(cid) for cid in hits if cid not in have) if c]
        self.sidebar.set_conversations(convs, self.conv_id, hits)
        self.sidebar.show_hits(query, len(convs), n_messages)
        # the chat being answered and the chats waiting for it are marked in the sidebar
        lst = self.sidebar.list
        for row in range(lst.count()):
            it = lst.item(row)
            cid = it.data(Qt.UserRole)
            mark = (GENERATING if self.answer is not None and cid == self.answer.conv_id
                    else WAITING if cid in self.queued_conversations() else "")
            if mark:
                first, _, rest = it.text().partition("\n")
                it.setText(f"{first}  · {mark}" + (f"\n{rest}" if rest else ""))
                it.setToolTip(f"{it.toolTip()}\n{'the model is writing the answer' if mark == GENERATING else 'waits for the answer in another chat'}")
                it.setIcon(mark_icon(mark))
            it.setData(Qt.UserRole + 1, mark)
        if self.read_only:
            self.sidebar.rename_btn.setEnabled(False)
            self.sidebar.delete_btn.setEnabled(False)
        self.act_export.setEnabled(self.conv_id is not None)

    def queued_conversations(self) -> list[int]:
        """Conversations whose message waits for the engine, in order."""
        return [c for c, _u in self.queue]

    def _sync_chat(self) -> None:
        """Send / Stop, the prompt box and the queued note for the conversation on screen:
        Stop only in the chat being answered; a chat whose message waits says for which chat."""
        a = self.answer
        here = a is not None and self.conv_id is not None and a.conv_id == self.conv_id
        waiting = self.conv_id is not None and self.conv_id in self.queued_conversations()
        self.chat.set_generating(here)
        if waiting:
            other = self.history.conversation(a.conv_id) if a is not None else None
            what = (f"the answer in “{other.title if other else 'another chat'}”" if a is not None
                    else "the model to open")
            self.queued_note.text.setText(f"Waiting for {what} — your message is sent to the model right after.")
            self.chat.set_ready(False, f"Waiting for {what}…")
        elif self.loaded is None:
            self.chat.set_ready(False, self._not_ready)
        else:
            self.chat.set_ready(True)
        self.queued_note.setVisible(waiting)

    def new_chat(self) -> None:
        """Start an empty chat (stored on its first message)."""
        self._cancel_edit()
        self.conv_id = None
        self._pending_system = ""
        self.chat.set_conversation(None, [])
        self._sync_chat()
        self._refresh_list()
        self.focus_input()

    def select_conversation(self, conv_id: int) -> None:
        """Show a stored conversation."""
        conv = self.history.conversation(conv_id)
        if conv is None:
            self._refresh_list()
            return
        self._cancel_edit()
        self.conv_id = conv_id
        msgs = self.history.messages(conv_id)
        self.chat.set_conversation(conv, msgs)
        if self.answer is not None and self.answer.conv_id == conv_id:
            self.answer.show()
        self._sync_chat()
        self._refresh_list()

    def _history_busy(self, why: str) -> None:
        """History.subscribe_busy: another program took the lock (``why``) or let it go ("")."""
        if why:
            self.history_retry.start()
            self.banner.show_message(
                ErrorKind.HISTORY, f"{why}. What the window shows is kept and saved once it lets go.",
                title="The chat history is in use by another program", error=False,
                hint="Close that program (or end its transaction); new messages wait until then.")
            return
        self.history_retry.stop()
        if self.banner.kind == ErrorKind.HISTORY:
            self.banner.hide()
        self.statusBar().showMessage("The chat history is free again: everything is saved.", 6000)
        self._start_next()

    def _reopen_history(self) -> None:
        """The history was locked by another program at start: once it lets go, open the history
        for writing, leave read-only and open the model."""
        if self._closing or not self.history.read_only:
            return
        if not history_is_free(self.history.path):
            return
        h, msg = History.open(self.history.path)
        if h.read_only:            # taken again in between: the next tick tries again
            h.close()
            return
        self.history_free.stop()
        old, self.history = self.history, h
        old.close()
        h.subscribe_busy(self._history_busy)
        self.read_only = ""
        self.read_only_note.hide()
        self._not_ready = ""
        for act in (self.act_settings, self.act_add, self.act_models, self.act_new, self.act_serve):
            act.setEnabled(True)
        self.sidebar.new_btn.setEnabled(True)
        self.chat.system_edit.setReadOnly(False)
        if msg:
            self.banner.show_message(ErrorKind.HISTORY, msg)
        self.statusBar().showMessage("The chat history is free again: opening the model.", 8000)
        if self.conv_id is not None:
            self.select_conversation(self.conv_id)
        self._refresh_list()
        self._sync_chat()
        self.start()

    def _refused(self, e: HistoryBusy, what: str) -> None:
        """A write the history refused because another program holds it: say what did not happen."""
        self._history_busy(str(e))
        self.statusBar().showMessage(f"{what}: the chat history is in use by another program.", 8000)

    def rename_conversation(self, conv_id: int, title: str | None = None) -> None:
        """Rename (asks for the title when not given)."""
        conv = self.history.conversation(conv_id)
        if conv is None or self.read_only:
            return
        if title is None:
            title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=conv.title)
            if not ok:
                return
        title = title.strip() or conv.title
        try:
            self.history.rename_conversation(conv_id, title)
        except HistoryBusy as e:
            self._refused(e, "Not renamed")
            return
        if conv_id == self.conv_id:
            self.chat.set_title(title)
        self._refresh_list()

    def delete_conversation(self, conv_id: int, confirm: bool = True) -> None:
        """Delete a conversation after confirmation."""
        conv = self.history.conversation(conv_id)
        if conv is None or self.read_only:
            return
        if confirm:
            r = QMessageBox.question(self, "Delete chat",
                                     f"Delete “{conv.title}” and all its messages? This cannot be undone.",
                                     QMessageBox.Yes | QMessageBox.Cancel, QMessageBox.Cancel)
            if r != QMessageBox.Yes:
                return
        try:
            self.history.delete_conversation(conv_id)
        except HistoryBusy as e:
            self._refused(e, "Not deleted")
            return
        if self.answer is not None and self.answer.conv_id == conv_id:
            self.controller.stop()
        self.queue = [q for q in self.queue if q[0] != conv_id]
        if conv_id == self.conv_id:
            self.new_chat()
        else:
            self._refresh_list()

    def export_conversation(self, path: str | None = None) -> Path | None:
        """Export the chat on screen to Markdown (.md) or JSON (.json), chosen by the file name
        (asked for when ``path`` is None); written atomically. Returns the file, or None."""
        if self.conv_id is None:
            return None
        conv = self.history.conversation(self.conv_id)
        if conv is None:
            return None
        from .export import export_conversation, suggested_name
        if path is None:
            start = str(Path.home() / suggested_name(conv, ".md"))
            path, _flt = QFileDialog.getSaveFileName(self, "Export chat", start,
                                                     "Markdown (*.md);;JSON (*.json)")
            if not path:
                return None
        try:
            out = export_conversation(conv, self.history.messages(conv.id), path,
                                      model=self.loaded.model_name if self.loaded else "")
        except (OSError, ValueError) as e:
            self.banner.show_message(ErrorKind.DISK, f"The chat could not be exported to {path}: {error_text(e)}",
                                     hint="Choose another folder or file name.")
            return None
        self.statusBar().showMessage(f"Exported “{conv.title}” to {out}", 6000)
        return out

    def _system_prompt_edited(self, text: str) -> None:
        if self._closing or self.read_only:
            return
        if self.conv_id is None:
            self._pending_system = text
        else:
            try:
                self.history.set_system_prompt(self.conv_id, text)
            except HistoryBusy as e:  # sent with the next message, which saves it
                self._refused(e, "System prompt not saved yet")
        self.chat.system_toggle.setText("System prompt ●" if text else "System prompt")

    def _ensure_conversation(self, first_text: str) -> int:
        if self.conv_id is None:
            title = auto_title(first_text)
            system = self.chat.system_prompt() or self._pending_system
            conv = self.history.create_conversation(title, system)
            self.conv_id = conv.id
            self.chat.set_title(conv.title)
            self._refresh_list()
        return self.conv_id

    # --- chat ---------------------------------------------------------------------------------

    def _busy_here(self) -> bool:
        """True when the chat on screen is being answered or waits for the engine."""
        if self.conv_id is None:
            return False
        return ((self.answer is not None and self.answer.conv_id == self.conv_id)
                or self.conv_id in self.queued_conversations())

    def send(self, text: str) -> None:
        """Send a user message (or the edited last message) and start the answer; while another
        chat is being answered, the message is stored and waits (with a note) for its turn."""
        if self.loaded is None or not text.strip() or self._busy_here():
            return
        try:
            self._send(text)
        except HistoryBusy as e:  # nothing of it was stored: the text goes back in the box
            if not self.chat.input.toPlainText().strip():
                self.chat.input.setPlainText(text)
            self._refused(e, "Not sent, your message is still in the box")

    def _send(self, text: str) -> None:
        conv_id = self._ensure_conversation(text)
        if self._editing is not None:
            edited = self.history.message(self._editing)
            firsts = [m.id for m in self.history.messages(conv_id) if m.role == "user"][:1]
            self._truncate_from(conv_id, self._editing)
            self._cancel_edit(clear=False)
            conv = self.history.conversation(conv_id)
            # the first message named the chat: its new text names it, unless the user renamed it
            if edited is not None and firsts == [edited.id] and conv is not None \
                    and conv.title == auto_title(edited.content):
                self.rename_conversation(conv_id, auto_title(text))
        sp = self.chat.system_prompt()
        conv = self.history.conversation(conv_id)
        if conv is not None and sp != conv.system_prompt:
            self.history.set_system_prompt(conv_id, sp)
        user_id = self.history.add_message(conv_id, "user", text, COMPLETE)
        self.chat.add_message(Message(user_id, conv_id, "user", text, COMPLETE))
        self._request_answer(conv_id, user_id)

    def regenerate(self, asst_id: int | None = None) -> None:
        """Replace the last answer with a new one (waits its turn like a message)."""
        if self.loaded is None or self.conv_id is None or self._busy_here():
            return
        msgs = self.history.messages(self.conv_id)
        if not msgs:
            return
        if asst_id is None:
            asst_id = msgs[-1].id if msgs[-1].role == "assistant" else None
        users = [m for m in msgs if m.role == "user" and (asst_id is None or m.id < asst_id)]
        if not users:
            return
        if asst_id is not None:
            try:
                self._truncate_from(self.conv_id, asst_id)
            except HistoryBusy as e:
                self._refused(e, "Not regenerated")
                return
        user = users[-1]
        if user.status == ERROR:
            self.history.update_message(user.id, status=COMPLETE)
        self._regenerating.add(user.id)
        self._request_answer(self.conv_id, user.id)

    def _answer_sampling(self, user_id: int) -> SamplingParams:
        """The sampling of the next answer to ``user_id``: the settings', with a fresh seed when
        the Seed setting is auto or the answer is a Regenerate (so Regenerate always gives a new
        draw; a fixed Seed reproduces an answer when the question is sent again).  The seed is
        stored with the answer (history ``seed`` column) and shown under it."""
        sp = self.settings.sampling
        regen = user_id in self._regenerating
        self._regenerating.discard(user_id)
        if sp.seed is None or regen:
            sp = replace(sp, seed=fresh_seed())
        return sp

    def edit_message(self, user_id: int) -> None:
        """Put the last user message in the prompt box; sending replaces it and what followed."""
        if self._busy_here():
            return
        m = self.history.message(user_id)
        if m is None:
            return
        self._editing = user_id
        self.chat.set_edit_mode(m.content)

    def _cancel_edit(self, clear: bool = True) -> None:
        if self._editing is not None:
            self._editing = None
            self.chat.edit_hint.setVisible(False)
            if clear:
                self.chat.input.clear()

    def _truncate_from(self, conv_id: int, msg_id: int) -> None:
        self.history.delete_from(conv_id, msg_id)
        for mid in [i for i in self.chat.views if i >= msg_id]:
            self.chat.remove_message(mid)

    def _context(self, conv_id: int) -> tuple[ChatMessage, ...]:
        """The messages sent to the model: system prompt, then every turn that did not fail."""
        conv = self.history.conversation(conv_id)
        out = []
        if conv is not None and conv.system_prompt:
            out.append(ChatMessage("system", conv.system_prompt))
        for m in self.history.messages(conv_id):
            if m.role not in ("user", "assistant") or m.status in (ERROR, STREAMING):
                continue
            if m.role == "assistant" and not m.content:
                continue
            out.append(ChatMessage(m.role, m.content))
        return tuple(out)

    def _request_answer(self, conv_id: int, user_id: int) -> None:
        """Answer ``user_id`` now, or after the answer being written (one engine, one answer)."""
        self.queue.append((conv_id, user_id))
        if self.answer is None:
            self._start_next()
        else:
            self._sync_chat()
            self._refresh_list()

    def _start_next(self) -> None:
        """Start the first waiting answer when the engine is free and a model is open."""
        if self.answer is not None or self.loaded is None or not self.queue or self._closing:
            return
        conv_id, user_id = self.queue[0]
        messages = self._context(conv_id)
        regen = user_id in self._regenerating
        sampling = self._answer_sampling(user_id)
        try:
            asst_id = self.history.add_message(conv_id, "assistant", "", STREAMING, seed=sampling.seed,
                                               sampling=asdict(sampling))
        except HistoryBusy as e:  # the question waits its turn until the lock goes
            if regen:
                self._regenerating.add(user_id)
            self._refused(e, "The answer waits")
            return
        self.queue.pop(0)
        if conv_id == self.conv_id:
            self.chat.add_message(Message(asst_id, conv_id, "assistant", "", STREAMING))
            self.chat.scroll_to_bottom()
        self.panels.new_generation()
        if self.banner.kind in (ErrorKind.CONTEXT, ErrorKind.GENERATION):
            self.banner.hide()
        job = self.controller.generate(self.chat.build_request(messages, sampling))
        self.answer = AnswerStream(self.history, self.chat, job, conv_id, user_id, asst_id, self)
        self._sync_chat()
        self._refresh_list()

    def cancel_queued(self) -> None:
        """“Don't send”: take the waiting message of the chat on screen back into the prompt box."""
        if self.conv_id is None:
            return
        for conv_id, user_id in [q for q in self.queue if q[0] == self.conv_id]:
            m = self.history.message(user_id)
            if m is not None:   # the question (sent, or to regenerate for) goes back into the prompt box
                try:
                    self._truncate_from(conv_id, user_id)
                except HistoryBusy as e:  # it stays sent and waiting
                    self._refused(e, "Not taken back")
                    continue
                self.chat.input.setPlainText(m.content)
            self.queue.remove((conv_id, user_id))
        self._sync_chat()
        self._refresh_list()

    def stop(self) -> None:
        """Stop the answer being written in the chat on screen (Esc / Stop)."""
        if self.answer is not None and self.answer.conv_id == self.conv_id:
            self.controller.stop()

    @Slot(object)
    def on_token(self, ev: TokenEvent) -> None:
        """Streamed text goes to the answer (its timer shows it)."""
        if self.answer is not None:
            self.answer.on_token(ev)

    @Slot(object)
    def on_metrics(self, m: StepMetrics) -> None:
        """Per-token counters: panels and status bar."""
        if self.answer is not None:
            self.answer.on_metrics(m)
        self.panels.on_metrics(m)
        self.st_speed.setText(f"{m.tok_per_s:.1f} tok/s")
        self.st_ttft.setText(f"TTFT {m.ttft_s:.2f} s")
        self._show_cap(m.cap_per_layer, m.expert_slots)
        if m.cluster:
            self.st_cluster.setText(m.cluster)
        if m.threads:
            self.threads_in_use = m.threads
            self.st_threads.setText(self._threads_text(m.threads, bool(self.loaded and self.loaded.auto_threads)))

    def _show_cap(self, cap: int, slots: int) -> None:
        """Status bar: slots per layer of the expert cache. When the budget's slots are not a
        multiple of the layers (some layers hold one fewer: engine.sizing), the mean per layer,
        with the spread in the tooltip."""
        E = self.loaded.num_experts if self.loaded else "?"
        L = self.loaded.num_layers if self.loaded else 0
        if L and slots and slots != cap * L:
            self.st_cap.setText(f"cap {slots / L:.1f}/{E} per layer")
            self.st_cap.setToolTip(f"{slots} expert slots in RAM: {cap - 1}-{cap} per layer")
        else:
            self.st_cap.setText(f"cap {cap}/{E} per layer")
            self.st_cap.setToolTip(f"{cap * L} expert slots in RAM" if L else "")

    @staticmethod
    def _threads_text(n: int, auto: bool) -> str:
        return f"{n} thread{'s' if n != 1 else ''}" + (" (auto)" if auto else "")
    @Slot(object)
    def on_residency(self, snap: ResidencySnapshot) -> None:
        """Residency map update."""
        self.panels.on_residency(snap)

    def _poll_idle_residency(self) -> None:
        """Timer slot: the residency map between answers, redrawn only when it changed."""
        if self.loaded is None or self._closing:
            return
        snap = self.controller.idle_residency()
        if snap is None or snap.state == self._idle_state:
            return
        if self.panels.snapshot is None and all(s == ABSENT for s in snap.state):
            return  # nothing in RAM yet: the map keeps its hint ("fills in while the model answers")
        self._idle_state = snap.state
        self.panels.on_residency(snap)

    @Slot(object)
    def on_finished(self, ev: Finished) -> None:
        """The answer ended: the answer saves itself; the status bar shows its numbers."""
        if self.answer is None:
            return
        if ev.finish_reason != "error":
            if ev.decode_tok_per_s:
                self.st_speed.setText(f"{ev.decode_tok_per_s:.1f} tok/s")
            self.st_ttft.setText(f"TTFT {ev.ttft_s:.2f} s")
            self.panels.on_finished(ev)   # the panels end on the answer line's own numbers
        if ev.threads:
            self.threads_in_use = ev.threads
        self._answer_ended(self.answer.finish(ev))

    def _answer_ended(self, end: AnswerEnd) -> None:
        if end.kind:
            self.banner.show_message(end.kind, end.message)
        self.answer = None
        self.controller.job_done()
        self._sync_chat()
        self._refresh_list()
        if getattr(self, "_reload_after_answer", False) and not self._closing:
            self._reload_after_answer = False
            self._reopen_current()   # the waiting messages start once it is open (on_loaded)
            return
        self._start_next()

    def _escape(self) -> None:
        if self.answer is not None and self.answer.conv_id == self.conv_id:
            self.stop()
        elif self._editing is not None:
            self._cancel_edit()

    def bring_to_front(self) -> None:
        """Another start of the app on this data folder asked for this window."""
        if self.isMinimized():
            self.showNormal()
        else:
            self.show()
        self.raise_()
        self.activateWindow()
        self.statusBar().showMessage("colibri is already running: this is its window", 6000)

    def focus_input(self) -> None:
        """Ctrl+L: put the cursor in the prompt box."""
        self.chat.input.setFocus()

    # --- serve on this computer ---------------------------------------------------------------

    def _serve_toggled(self, checked: bool) -> None:
        if not checked:
            self.stop_serving()
            return
        dlg = ServeDialog(self._serve_port, self._serve_key, self._serve_origins, self)
        dlg.accepted.connect(lambda: self.start_serving(*dlg.values()))
        dlg.rejected.connect(lambda: self.act_serve.setChecked(self.serve.serving))
        self._show_dialog(dlg)

    def start_serving(self, port: int, api_key: str = "", origins: tuple[str, ...] = ()) -> bool:
        """Serve the open model on 127.0.0.1:``port`` (0 = a free port), web pages of ``origins``
        allowed; the status bar shows the URL and the request count. A failure (port in use,
        short key) shows a banner."""
        import errno
        try:
            url = self.serve.start(port, api_key, self.settings.sampling, origins)
        except (ValueError, OSError) as e:   # ConfigError is a ValueError
            self.act_serve.setChecked(False)
            if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
                text = (f"Port {port} on this computer is already in use by another program (or another "
                        f"colibri window).")
                hint = ("Choose another port, or 0 for any free one (Server › Serve on this computer…), or stop "
                        "the program using it.")
            else:  # the dialog's words, not the command line's flags
                text = str(e).replace("--api-key", "the API key").replace("--port", "the port")
                hint = "Change it in Server › Serve on this computer…."
            self.banner.show_message(ErrorKind.CONFIG, text, hint=hint, title="The server could not start")
            return False
        self._serve_port, self._serve_key, self._serve_origins = (port or self._serve_port), api_key, tuple(origins)
        self.act_serve.setChecked(True)
        self.statusBar().showMessage(f"Serving the model on {url}", 6000)
        return True

    def stop_serving(self) -> None:
        """Stop the local server (its running and waiting requests are cancelled)."""
        self.serve.stop()
        self.act_serve.setChecked(False)

    @Slot(str)
    def _serve_status(self, text: str) -> None:
        self.st_server.setText(text)
        self.st_server.setVisible(bool(text))

    # --- dialogs owned by other modules (lazy, optional) --------------------------------------

    def _not_available(self, what: str) -> None:
        self.banner.show_message(ErrorKind.UNAVAILABLE, f"{what} is not available in this build.", error=False)

    def open_settings(self) -> None:
        """Settings… (SettingsDialog.applied -> save, and reopen the engine when needed)."""
        try:
            from .settings_dialog import SettingsDialog
        except ImportError:
            self._not_available("Settings")
            return
        dlg = SettingsDialog(self.settings, self, auto_values=self.auto_values, save=None,  # saved here, once
                             compile_note=self.compile_note)
        if self.loaded is not None and hasattr(dlg, "show_in_use"):
            dlg.show_in_use(self.values_in_use(), self.loaded.max_context, self.loaded.model_name)
        dlg.applied.connect(self.apply_settings)
        if hasattr(dlg, "reset_history_requested"):
            dlg.reset_history_requested.connect(self.reset_routing_history)
        self._show_dialog(dlg)

    def open_wizard(self) -> None:
        """Add model… (ModelWizard.model_ready -> make it current and open it)."""
        try:
            from .wizard import ModelWizard
        except ImportError:
            self._not_available("Adding a model")
            return
        dlg = ModelWizard(self, recommendations=True)
        dlg.model_ready.connect(self.use_model)
        self._show_dialog(dlg)

    def open_library(self) -> None:
        """Models… (ModelLibraryDialog.current_changed -> open that model)."""
        try:
            from .library import ModelLibraryDialog
        except ImportError:
            self._not_available("The model library")
            return
        current = self.loaded.store_path if self.loaded else self.settings.current_model
        dlg = ModelLibraryDialog(current, self)
        dlg.current_changed.connect(self.use_model)
        self._show_dialog(dlg)

    def _show_dialog(self, dlg) -> None:
        self._dialogs.append(dlg)
        dlg.finished.connect(lambda *_: self._dialogs.remove(dlg) if dlg in self._dialogs else None)
        dlg.open()

    def values_in_use(self) -> dict[str, str]:
        """What the open engine uses for the settings whose 0 means "the engine decides":
        {setting name: text}, shown by the settings dialog beside "auto"."""
        if self.loaded is None:
            return {}
        ev = self.loaded
        n = getattr(self, "threads_in_use", 0) or ev.threads
        pins = ev.pins_per_layer
        return {"threads": f"{n} now" if ev.auto_threads else f"{n}",
                "context_length": f"{ev.context_length} tokens",
                "pin_per_layer": f"{pins} per layer"}

    def auto_values(self, engine: EngineConfig) -> tuple[int, int] | None:
        """(cap per layer, RAM budget bytes) the engine picks for "auto" with ``engine``'s
        settings on the open model: the open engine's own numbers while the sizing settings
        are unchanged, else engine.sizing's plan for the store (None without a model)."""
        if self.loaded is None:
            return None
        opened = self.settings.engine  # sizing settings are reload settings: the open engine has these
        if all(getattr(opened, k) == getattr(engine, k) for k in ("cap", "ram_budget_gb", "context_length")):
            return self.loaded.cap_per_layer, self.loaded.ram_budget_bytes
        plan = library.plan_for_store(self.loaded.store_path, engine)
        return plan.cap, plan.budget

    def compile_note(self, engine: EngineConfig) -> str:
        """The sentence saying that opening the model with ``engine`` first compiles kernels not
        yet compiled on this computer (engine.compile_needed), "" when it does not."""
        if self.loaded is None:
            return ""
        needed, seconds = compile_needed(self.loaded.store_path, engine)
        if not needed:
            return ""
        took = f"about {seconds:.0f} s, as the last one here" if seconds else "a minute or two"
        return (f"They need a one-time compile of the compute kernels for this model ({took}) before the next "
                f"answer.")

    def ask_reload_during_answer(self) -> str:
        """Ask whether settings that reopen the model may stop the answer being written:
        "stop" (stop it and apply now), "wait" (apply when it ends) or "cancel"."""
        box = QMessageBox(QMessageBox.Warning, "Reopen the model?",
                          "These settings reopen the model. The answer being written would stop.",
                          QMessageBox.NoButton, self)
        stop = box.addButton("Stop the answer and apply", QMessageBox.DestructiveRole)
        wait = box.addButton("Apply when the answer ends", QMessageBox.AcceptRole)
        box.addButton(QMessageBox.Cancel)
        box.setDefaultButton(wait)
        box.exec()
        return {id(stop): "stop", id(wait): "wait"}.get(id(box.clickedButton()), "cancel")

    @Slot(object, bool)
    def apply_settings(self, new: Settings, needs_reload: bool) -> None:
        """Save the new settings (the only save of an Apply); reopen the engine if they require
        it (else the sampling settings simply apply to the next message). While an answer is
        being written, a reopen asks first (:meth:`ask_reload_during_answer`)."""
        if needs_reload and self.answer is not None:
            choice = self.ask_reload_during_answer()
            if choice == "cancel":
                self.statusBar().showMessage("Settings not applied: the answer is still being written", 6000)
                return
            if choice == "wait":
                self._reload_after_answer = True
                needs_reload = False
                self.statusBar().showMessage("The settings apply when the answer ends", 6000)
        try:
            save_settings(new)
        except OSError as e:
            self.banner.show_message(ErrorKind.SETTINGS, f"The settings could not be saved: {error_text(e)}",
                                     title="Your settings could not be saved")
        old_theme = self.settings.app.theme
        self.settings = new
        if new.app.theme != old_theme:
            from .resources import apply_theme
            apply_theme(QApplication.instance(), new.app.theme)
        self.serve.set_defaults(new.sampling)   # the server's defaults follow the sampling settings
        if needs_reload:
            self._reload_after_answer = False
            self._reopen_current()

    def _reopen_current(self) -> None:
        cm = self.settings.current_model
        self.open_model(cm if cm and Path(cm).exists() else None)

    def reset_routing_history(self) -> None:
        """Forget the open model's routing heat and pins (on the worker thread)."""
        self.controller.reset_history()
        self.statusBar().showMessage("Routing history reset", 4000)

    @Slot(str)
    def use_model(self, store: str) -> None:
        """Make ``store`` the current model, remember it, and open it."""
        self.settings = replace(self.settings, current_model=store)
        try:
            save_settings(self.settings)
        except OSError as e:
            self.banner.show_message(ErrorKind.SETTINGS, f"The settings could not be saved: {error_text(e)}",
                                     title="Your settings could not be saved")
        self.open_model(store)

    # --- state & shutdown ---------------------------------------------------------------------

    def _restore_ui_state(self) -> None:
        st = load_ui_state()
        try:
            if "geometry" in st:
                self.restoreGeometry(QByteArray(base64.b64decode(st["geometry"])))
            if "window_state" in st:
                self.restoreState(QByteArray(base64.b64decode(st["window_state"])))
            sizes = st.get("splitter")
            if isinstance(sizes, list) and len(sizes) == 2 and all(isinstance(s, int) and s > 0 for s in sizes):
                self.splitter.setSizes(sizes)
            if "panels_visible" in st:
                self.dock.setVisible(bool(st["panels_visible"]))
            serve = st.get("serve")
            if isinstance(serve, dict):
                port, key = serve.get("port"), serve.get("api_key", "")
                if isinstance(port, int) and 1024 <= port <= 65535:
                    self._serve_port = port
                if isinstance(key, str):
                    self._serve_key = key
                origins = serve.get("origins", [])
                if isinstance(origins, list) and all(isinstance(o, str) for o in origins):
                    self._serve_origins = tuple(origins)
        except (ValueError, TypeError) as e:
            log.warning("ignoring the saved window state: %s", e)
        last = st.get("last_conversation")
        if isinstance(last, int) and self.history.conversation(last) is not None:
            self.select_conversation(last)
        else:
            self.new_chat()

    def ui_state(self) -> dict:
        """The state saved to ui_state.json."""
        return {
            "geometry": base64.b64encode(bytes(self.saveGeometry())).decode("ascii"),
            "window_state": base64.b64encode(bytes(self.saveState())).decode("ascii"),
            "splitter": [int(s) for s in self.splitter.sizes()],
            "panels_visible": not self.dock.isHidden(),
            "last_conversation": self.conv_id,
            "serve": {"port": self._serve_port, "api_key": self._serve_key, "origins": list(self._serve_origins)},
        }

    def closeEvent(self, e) -> None:
        """Stop the answer, let the engine finish and close, stop the thread, save state."""
        if self._closing:
            e.accept()
            return
        if self.conv_id is not None and self.chat.system_edit.isVisible():
            self._system_prompt_edited(self.chat.system_prompt())
        self._closing = True
        if not self.read_only:
            save_ui_state(self.ui_state())
        self.serve.stop()   # before the engine lane ends: its requests run there
        self.controller.shutdown()
        # and every other background task (wizard download / conversion, library scan): cancel
        # and join them now, while the objects they report to still exist
        shutdown_all()
        # the worker's last events (its tokens and Finished) are queued for this thread
        QCoreApplication.sendPostedEvents(self, QEvent.MetaCall)
        if self.answer is not None:
            # no Finished arrived (the engine did not end in time): store what we have
            self.answer.abandon()
            self.answer = None
        self.panels.timer.stop()
        self.history.close()
        super().closeEvent(e)
