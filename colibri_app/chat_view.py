"""Chat widgets: the conversation list, the transcript of message cards, and the prompt box.

These widgets only display and emit user intents; MainWindow owns the history database and
the engine. An answer is rendered as Markdown while it streams and when it completes
(colibri_app.markdown_view: Qt's Markdown for prose, Pygments-highlighted code blocks with a
Copy button; each update re-renders only the block being written). A leading
``<think>...</think>`` reasoning block (engine.split_reasoning) is shown in a collapsed
"Thinking" section above the answer, also while it streams; the saved text keeps it whole.
A model without a chat template gets a banner and an explicit raw mode.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QKeySequence, QTextCursor
from PySide6.QtWidgets import (QAbstractItemView, QFrame, QHBoxLayout, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QPlainTextEdit, QPushButton, QScrollArea, QSizePolicy,
                               QToolButton, QVBoxLayout, QWidget)

from engine import ChatMessage, GenerateRequest, SamplingParams, reasoning_open, split_reasoning

from .history import COMPLETE, ERROR, INTERRUPTED, STOPPED, STREAMING, Conversation, Message
from .markdown_view import MarkdownBody, MessageText
from .resources import THEME

NO_TEMPLATE_TEXT = ("This model has no chat template, so it cannot hold a conversation: the system prompt "
                    "and earlier turns cannot be sent. Raw mode sends only your latest message, as plain "
                    "text for the model to continue.")

# A user message longer than this shows its start and a "Show all" toggle: laying out a 200 KB
# paste takes Qt ~100 ms on the GUI thread, at every send, status change and resize.
LONG_MESSAGE_CHARS = 6000

STATUS_NOTE = {
    STOPPED: "stopped",
    INTERRUPTED: "interrupted — the app closed while this answer was being written",
    ERROR: "not answered — see the message above",
    STREAMING: "writing…",
    COMPLETE: "",
}


def rates_text(hit_rate: float, mb_per_token: float) -> tuple[str, str]:
    """("hit rate N%", "X.XX MB/token"): how the answer line and the engine panels both show
    an answer's whole hit rate and MB/token (engine.metrics.answer_rates, the same numbers)."""
    return f"hit rate {100 * round(hit_rate, 4):.0f}%", f"{round(mb_per_token, 3):.2f} MB/token"


def draft_text(tokens_per_forward: float, acceptance: float) -> str:
    """"N.NN tokens/forward, drafts P% kept": speculative decoding's yield, as the answer line
    and the SSD panel both show it (Finished / StepMetrics tokens_per_forward, draft_acceptance)."""
    return f"{tokens_per_forward:.2f} tokens/forward, drafts {100 * acceptance:.0f}% kept"


def format_meta(meta: dict) -> str:
    """The line under an answer: tokens, tok/s, TTFT, hit rate, MB/token, tokens per forward
    (when speculation drafted), finish reason, the documentation entries looked up for it."""
    if not meta:
        return ""
    parts = []
    if "tokens" in meta:
        parts.append(f"{meta['tokens']} tokens")
    if meta.get("tok_per_s"):
        parts.append(f"{meta['tok_per_s']:.1f} tok/s")
    if "ttft_s" in meta:
        parts.append(f"TTFT {meta['ttft_s']:.2f} s")
    if "hit_rate" in meta:
        parts.append(rates_text(meta["hit_rate"], 0.0)[0])
    if "mb_per_token" in meta:
        parts.append(rates_text(1.0, meta["mb_per_token"])[1])
    if meta.get("tokens_per_forward"):
        parts.append(draft_text(meta["tokens_per_forward"], meta.get("draft_acceptance", 0.0)))
    if meta.get("finish_reason"):
        parts.append(f"finish: {meta['finish_reason']}" + (" (the context is full)" if meta.get("context_full") else ""))
    if meta.get("dropped_messages"):
        n = meta["dropped_messages"]
        parts.append(f"{n} earliest message{'s' if n != 1 else ''} left out: the chat no longer fits the context")
    if meta.get("seed") is not None:
        parts.append(f"seed {meta['seed']}")
    if meta.get("sources"):
        parts.append("looked up: " + ", ".join(str(x) for x in meta["sources"]))
    return "  ·  ".join(parts)


# --- message cards --------------------------------------------------------------------------


class MessageView(QFrame):
    """One message card: role, text, status note, answer metrics, and actions."""

    copy_clicked = Signal(int)         #: message id
    regenerate_clicked = Signal(int)   #: message id (assistant)
    edit_clicked = Signal(int)         #: message id (user)

    def __init__(self, msg: Message, model_name: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.msg_id = msg.id
        self.role = msg.role
        self.status = msg.status
        self._text = msg.content
        self.setObjectName("userCard" if msg.role == "user" else "assistantCard")
        self.setAccessibleName(f"{'Your' if msg.role == 'user' else 'Assistant'} message")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 10, 14, 8)
        lay.setSpacing(4)
        who = "You" if msg.role == "user" else (model_name or "Assistant")
        self.role_label = QLabel(who)
        self.role_label.setObjectName("roleLabel")
        lay.addWidget(self.role_label)
        # reasoning (<think>...</think>): a collapsed section, expandable
        self.think_btn = self._disclosure("Show the model's reasoning", self._toggle_thinking)
        lay.addWidget(self.think_btn)
        self.think_text = MessageText()
        self.think_text.setObjectName("thinkText")
        self.think_text.setAccessibleName("Model reasoning")
        self.think_text.setVisible(False)
        lay.addWidget(self.think_text)
        self._shown = ("", "", False)  # (reasoning, answer, still thinking) shown in the widgets
        self.text = MarkdownBody()
        self.text.setAccessibleName("Message text")
        lay.addWidget(self.text)
        self.more_btn = self._disclosure("Show the whole message", lambda _on: self._show_user_text())
        lay.addWidget(self.more_btn)
        self.note = QLabel()
        self.note.setObjectName("statusNote")
        self.note.setWordWrap(True)
        lay.addWidget(self.note)
        # the documentation entries the answer was given (documentation lookup): collapsed
        self.docs_btn = self._disclosure("Show the documentation this answer was given", self._toggle_docs)
        lay.addWidget(self.docs_btn)
        self.docs_text = QLabel()
        self.docs_text.setObjectName("thinkText")
        self.docs_text.setAccessibleName("Documentation looked up")
        self.docs_text.setTextFormat(Qt.PlainText)
        self.docs_text.setWordWrap(True)
        self.docs_text.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.docs_text.setVisible(False)
        lay.addWidget(self.docs_text)
        self.meta_label = QLabel()
        self.meta_label.setObjectName("metaLabel")
        self.meta_label.setAccessibleName("Answer statistics")
        self.meta_label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.meta_label.setWordWrap(True)
        lay.addWidget(self.meta_label)
        row = QHBoxLayout()
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(4)
        self.copy_btn = self._action("Copy", "Copy this message", self.copy_clicked)
        self.regen_btn = self._action("Regenerate", "Regenerate this answer", self.regenerate_clicked)
        self.edit_btn = self._action("Edit", "Edit and resend this message", self.edit_clicked)
        for b in (self.copy_btn, self.regen_btn, self.edit_btn):
            row.addWidget(b)
        row.addStretch(1)
        lay.addLayout(row)
        self.regen_btn.setVisible(False)
        self.edit_btn.setVisible(False)
        self.set_content(msg.content, msg.status, msg.meta)

    @staticmethod
    def _disclosure(accessible: str, toggled) -> QToolButton:
        """A collapsed section's toggle (arrow and text; hidden until it has something to show)."""
        b = QToolButton()
        b.setObjectName("thinkToggle")
        b.setCheckable(True)
        b.setAutoRaise(True)
        b.setToolButtonStyle(Qt.ToolButtonTextBesideIcon)
        b.setArrowType(Qt.RightArrow)
        b.setCursor(Qt.PointingHandCursor)
        b.setAccessibleName(accessible)
        b.toggled.connect(toggled)
        b.setVisible(False)
        return b

    @staticmethod
    def _set_open(btn: QToolButton, body: QWidget, on: bool, what: str) -> None:
        btn.setArrowType(Qt.DownArrow if on else Qt.RightArrow)
        btn.setAccessibleName(f"{'Hide' if on else 'Show'} {what}")
        body.setVisible(on)

    def _action(self, text: str, accessible: str, signal) -> QToolButton:
        b = QToolButton()
        b.setText(text)
        b.setObjectName("msgAction")
        b.setAccessibleName(accessible)
        b.setToolTip(accessible)
        b.setAutoRaise(True)
        b.setCursor(Qt.PointingHandCursor)
        b.clicked.connect(lambda: signal.emit(self.msg_id))
        return b

    @property
    def code_blocks(self):
        """The fenced code blocks of the answer (markdown_view.CodeBlock: .code, .copy())."""
        return self.text.code_blocks()

    @property
    def content(self) -> str:
        """The message text as far as it is known (with its reasoning block, as saved)."""
        return self._text

    @property
    def answer(self) -> str:
        """The answer without its reasoning block (what Copy copies)."""
        return split_reasoning(self._text)[1] if self.role == "assistant" else self._text

    @property
    def reasoning(self) -> str:
        """The reasoning block's text ("" when there is none)."""
        return split_reasoning(self._text)[0] if self.role == "assistant" else ""

    def set_content(self, text: str, status: str, meta: dict | None = None) -> None:
        """Show a complete (or final) message: Markdown for answers, plain for the user."""
        self._text, self.status, self._meta = text, status, meta
        if self.role != "assistant":
            self._show_user_text()
        else:
            reasoning, answer = split_reasoning(text)
            thinking = reasoning_open(text) and status == STREAMING
            self._show_thinking(reasoning, thinking)
            self.text.set_text(answer, final=status != STREAMING)  # Markdown while streaming too
            self._shown = (reasoning, answer, thinking)
        self.note.setText(STATUS_NOTE.get(status, status))
        self.note.setProperty("kind", status)
        self.note.style().unpolish(self.note)
        self.note.style().polish(self.note)
        self.note.setVisible(bool(self.note.text()))
        line = format_meta(meta or {})
        self.meta_label.setText(line)
        self.meta_label.setVisible(bool(line))
        self._show_docs(meta or {})

    def _show_docs(self, meta: dict) -> None:
        names = [str(x) for x in meta.get("sources") or []]
        sums = [str(x) for x in meta.get("source_summaries") or []]
        self.docs_btn.setVisible(bool(names))
        if not names:
            self.docs_text.setVisible(False)
            return
        self.docs_btn.setText(f"Documentation looked up ({len(names)})")
        self.docs_text.setText("\n\n".join(f"{n}: {s}" if s else n for n, s in
                                            zip(names, sums + [""] * (len(names) - len(sums)))))
        self.docs_text.setVisible(self.docs_btn.isChecked())

    def _show_user_text(self) -> None:
        """A user's (or system) message: whole, or its start and the "Show all" toggle."""
        text = self._text
        long = len(text) > LONG_MESSAGE_CHARS
        self.more_btn.setVisible(long)
        if long and not self.more_btn.isChecked():
            self.more_btn.setText(f"Show all ({len(text):,} characters)")
            self.more_btn.setArrowType(Qt.RightArrow)
            shown = text[:LONG_MESSAGE_CHARS] + " …"
        else:
            if long:
                self.more_btn.setText("Show less")
                self.more_btn.setArrowType(Qt.DownArrow)
            shown = text
        if not (self.text._plain and self.text._text == shown):  # a status change: no new layout
            self.text.set_plain(shown)

    def _toggle_docs(self, on: bool) -> None:
        self._set_open(self.docs_btn, self.docs_text, on, "the documentation this answer was given")

    def append_stream(self, piece: str) -> None:
        """Append streamed text (plain while streaming); reasoning goes to the Thinking section."""
        self.status = STREAMING
        self._text += piece
        if self.role != "assistant":
            self._show_user_text()
            return
        reasoning, answer = split_reasoning(self._text)
        thinking = reasoning_open(self._text)
        old_reasoning, old_answer, old_thinking = self._shown
        if reasoning != old_reasoning or thinking != old_thinking:
            self._show_thinking(reasoning, thinking)
        if answer != old_answer:
            self.text.set_text(answer, final=False)   # re-renders only the block being written
        self._shown = (reasoning, answer, thinking)

    def restyle(self) -> None:
        """The colour scheme changed: render the text again (code colours, shading)."""
        self.set_content(self._text, self.status, getattr(self, "_meta", None))

    def _show_thinking(self, reasoning: str, thinking_now: bool) -> None:
        has = bool(reasoning) or thinking_now
        self.think_btn.setVisible(has)
        if not has:
            self.think_text.setVisible(False)
            return
        if thinking_now:
            self.think_btn.setText("Thinking…")
        else:
            words = len(reasoning.split())
            self.think_btn.setText(f"Thought ({words} word{'s' if words != 1 else ''})")
        if self.think_text.toPlainText() != reasoning:
            old = self.think_text.toPlainText()
            if reasoning.startswith(old) and old:
                self.think_text.append_plain(reasoning[len(old):])
            else:
                self.think_text.setPlainText(reasoning)
        self.think_text.setVisible(self.think_btn.isChecked())

    def _toggle_thinking(self, on: bool) -> None:
        self._set_open(self.think_btn, self.think_text, on, "the model's reasoning")

    def set_actions(self, regenerate: bool, edit: bool, copy: bool = True) -> None:
        """Which actions this card shows (only the last answer / last user message get them)."""
        self.regen_btn.setVisible(regenerate)
        self.edit_btn.setVisible(edit)
        self.copy_btn.setVisible(copy)


# --- transcript -----------------------------------------------------------------------------


class PromptEdit(QPlainTextEdit):
    """The prompt box: Enter sends, Shift+Enter inserts a newline; grows up to ~8 lines."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setTabChangesFocus(True)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self._placeholders: tuple[str, ...] = ()
        self._fit()

    def set_placeholders(self, *texts: str) -> None:
        """The placeholder, longest first: the first variant that fits on the box's one line
        is shown (the last one elided when none does), again at every resize; a placeholder
        never wraps onto a second line the one-line box cannot show (the full text is the
        tooltip when a shorter one is shown)."""
        self._placeholders = tuple(t for t in texts if t)
        self._fit_placeholder()

    def placeholder_room(self) -> int:
        """Pixels one line of placeholder text may take (the viewport minus the document margins)."""
        return max(0, self.viewport().width() - 2 * int(self.document().documentMargin()) - 2)

    def _fit_placeholder(self) -> None:
        if not self._placeholders:
            return
        fm, room = self.fontMetrics(), self.placeholder_room()
        text = next((t for t in self._placeholders if fm.horizontalAdvance(t) <= room), None)
        if text is None:
            text = fm.elidedText(self._placeholders[-1], Qt.ElideRight, room)
        if text != self.placeholderText():
            self.setPlaceholderText(text)
            # Qt repaints only when the placeholder appears or disappears: a new text over a
            # shown one ("Loading the model…" -> "Message the model…") stayed on screen
            self.viewport().update()
        self.setToolTip("" if text == self._placeholders[0] else self._placeholders[0])

    def resizeEvent(self, e):  # noqa: N802 - Qt's name
        super().resizeEvent(e)
        self._fit_placeholder()

    def keyPressEvent(self, e):
        if e.key() in (Qt.Key_Return, Qt.Key_Enter) and not (e.modifiers() & Qt.ShiftModifier):
            self.submitted.emit()
            return
        super().keyPressEvent(e)

    def _fit(self, *_):
        lines = max(1, min(8, int(self.document().size().height())))
        fm = self.fontMetrics()
        h = lines * fm.lineSpacing() + 2 * int(self.document().documentMargin()) + 2 * self.frameWidth() + 8
        self.setFixedHeight(max(h, 44))


class ChatView(QWidget):
    """Transcript + system prompt + prompt box of one conversation."""

    send_requested = Signal(str)            #: prompt text
    stop_requested = Signal()
    regenerate_requested = Signal(int)      #: assistant message id
    edit_requested = Signal(int)            #: user message id
    system_prompt_edited = Signal(str)
    recommendations_requested = Signal()    #: the intro's link to "Recommended for this computer"

    EMPTY_TEXT = "Ask anything. Enter sends, Shift+Enter adds a line."
    READY_TEXTS = ("Message the model…  (Enter to send, Shift+Enter for a new line)",
                   "Message the model…  (Enter to send)", "Message the model…")

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("chatView")
        self.ready_texts = self.READY_TEXTS
        self.model_name = ""
        self.views: dict[int, MessageView] = {}
        self.generating = False
        self.ready = False
        self.has_chat_template = True

        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)

        # header: conversation title + system prompt toggle
        head = QFrame()
        head.setObjectName("chatHeader")
        hl = QVBoxLayout(head)
        hl.setContentsMargins(20, 10, 20, 8)
        hl.setSpacing(6)
        top = QHBoxLayout()
        self.title_label = QLabel("New chat")
        self.title_label.setObjectName("chatTitle")
        self.title_label.setAccessibleName("Conversation title")
        top.addWidget(self.title_label, 1)
        self.system_toggle = QToolButton()
        self.system_toggle.setText("System prompt")
        self.system_toggle.setCheckable(True)
        self.system_toggle.setObjectName("systemToggle")
        self.system_toggle.setAccessibleName("Show system prompt")
        self.system_toggle.toggled.connect(self._toggle_system)
        top.addWidget(self.system_toggle)
        hl.addLayout(top)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setObjectName("systemEdit")
        self.system_edit.setAccessibleName("System prompt")
        self.system_edit.setPlaceholderText("System prompt for this conversation (optional), "
                                            "e.g. “You are a concise Python expert.”")
        self.system_edit.setFixedHeight(64)
        self.system_edit.setVisible(False)
        self.system_edit.installEventFilter(self)
        hl.addWidget(self.system_edit)
        lay.addWidget(head)

        # no chat template: say so, and let the user choose raw mode knowingly
        self.template_banner = QFrame()
        self.template_banner.setObjectName("templateBanner")
        self.template_banner.setAccessibleName("This model has no chat template")
        tb = QHBoxLayout(self.template_banner)
        tb.setContentsMargins(20, 8, 20, 8)
        self.template_label = QLabel(NO_TEMPLATE_TEXT)
        self.template_label.setObjectName("templateBannerText")
        self.template_label.setWordWrap(True)
        tb.addWidget(self.template_label, 1)
        self.raw_btn = QPushButton("Use raw mode")
        self.raw_btn.setObjectName("rawModeButton")
        self.raw_btn.setCheckable(True)
        self.raw_btn.setAccessibleName("Use raw mode: send each message as plain text")
        self.raw_btn.toggled.connect(self._toggle_raw)
        tb.addWidget(self.raw_btn, 0, Qt.AlignVCenter)
        self.template_banner.setVisible(False)
        lay.addWidget(self.template_banner)

        # transcript
        self.scroll = QScrollArea()
        self.scroll.setObjectName("transcript")
        self.scroll.setAccessibleName("Transcript")
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.inner = QWidget()
        self.inner.setObjectName("transcriptInner")
        self.msg_layout = QVBoxLayout(self.inner)
        self.msg_layout.setContentsMargins(20, 16, 20, 16)
        self.msg_layout.setSpacing(12)
        self.empty_label = QLabel(self.EMPTY_TEXT)
        self.empty_label.setObjectName("emptyLabel")
        self.empty_label.linkActivated.connect(lambda _link: self.recommendations_requested.emit())
        self.empty_label.setAlignment(Qt.AlignCenter)
        self.empty_label.setWordWrap(True)   # a narrow window wraps it instead of widening the page
        self.msg_layout.addWidget(self.empty_label)
        self.msg_layout.addStretch(1)
        self.scroll.setWidget(self.inner)
        self.scroll.verticalScrollBar().rangeChanged.connect(self._on_range)
        self._stick = True
        self.scroll.verticalScrollBar().valueChanged.connect(self._on_scroll)
        lay.addWidget(self.scroll, 1)

        # input row
        box = QFrame()
        box.setObjectName("inputBar")
        bl = QVBoxLayout(box)
        bl.setContentsMargins(20, 8, 20, 14)
        bl.setSpacing(4)
        self.edit_hint = QLabel("Editing your last message: Enter resends it, Esc cancels.")
        self.edit_hint.setObjectName("editHint")
        self.edit_hint.setVisible(False)
        bl.addWidget(self.edit_hint)
        il = QHBoxLayout()
        il.setSpacing(8)
        bl.addLayout(il)
        self.input = PromptEdit()
        self.input.setObjectName("promptEdit")
        self.input.setAccessibleName("Message input")
        self.input.set_placeholders("Loading the model…")
        self.input.submitted.connect(self._submit)
        il.addWidget(self.input, 1)
        self.send_btn = QPushButton("Send")
        self.send_btn.setObjectName("sendButton")
        self.send_btn.setAccessibleName("Send message")
        self.send_btn.setToolTip("Send (Enter)")
        self.send_btn.setCursor(Qt.PointingHandCursor)
        self.send_btn.clicked.connect(self._send_or_stop)
        il.addWidget(self.send_btn, 0, Qt.AlignBottom)
        lay.addWidget(box)
        self._update_send()
        THEME.changed.connect(self._restyle)

    def _restyle(self, _scheme: str = "") -> None:
        for v in self.views.values():
            v.restyle()

    # --- conversation -------------------------------------------------------------------------

    def set_conversation(self, conv: Conversation | None, messages: list[Message]) -> None:
        """Show a conversation (or an empty view)."""
        self.title_label.setText(conv.title if conv else "New chat")
        self.system_edit.blockSignals(True)
        self.system_edit.setPlainText(conv.system_prompt if conv else "")
        self.system_edit.blockSignals(False)
        self.system_toggle.setText("System prompt ●" if conv and conv.system_prompt else "System prompt")
        for v in list(self.views.values()):
            v.setParent(None)
            v.deleteLater()
        self.views.clear()
        for m in messages:
            self.add_message(m)
        self.empty_label.setVisible(not self.views)   # "Ask anything" again in an empty chat
        self._stick = True
        self.update_actions()
        self.scroll_to_bottom()

    def set_title(self, title: str) -> None:
        """Update the header title."""
        self.title_label.setText(title)

    def add_message(self, msg: Message) -> MessageView:
        """Append a message card."""
        v = MessageView(msg, self.model_name)
        v.copy_clicked.connect(self._copy)
        v.regenerate_clicked.connect(self.regenerate_requested)
        v.edit_clicked.connect(self.edit_requested)
        if msg.role == "user":
            wrap = QWidget()
            wl = QHBoxLayout(wrap)
            wl.setContentsMargins(60, 0, 0, 0)
            wl.addWidget(v)
            self.msg_layout.insertWidget(self.msg_layout.count() - 1, wrap)
            v._wrap = wrap
        else:
            self.msg_layout.insertWidget(self.msg_layout.count() - 1, v)
            v._wrap = v
        self.views[msg.id] = v
        self.empty_label.setVisible(False)
        self.update_actions()
        return v

    def remove_message(self, msg_id: int) -> None:
        """Remove a message card."""
        v = self.views.pop(msg_id, None)
        if v is not None:
            w = v._wrap
            w.setParent(None)
            w.deleteLater()
        self.empty_label.setVisible(not self.views)
        self.update_actions()

    def view(self, msg_id: int) -> MessageView | None:
        """The card of a message, if shown."""
        return self.views.get(msg_id)

    def reveal_message(self, msg_id: int) -> bool:
        """Scroll a message into view and mark it as the found one (a search hit)."""
        v = self.views.get(msg_id)
        if v is None:
            return False
        for other in self.views.values():
            if other.property("found"):
                other.setProperty("found", False)
                other.style().unpolish(other)
                other.style().polish(other)
        v.setProperty("found", True)
        v.style().unpolish(v)
        v.style().polish(v)
        self._stick = False
        QTimer.singleShot(0, lambda: self.scroll.ensureWidgetVisible(v._wrap, 0, 40))
        return True

    def update_actions(self) -> None:
        """Regenerate on the last answer, Edit on the last user message, nothing while busy."""
        ids = list(self.views)
        last_user = next((i for i in reversed(ids) if self.views[i].role == "user"), None)
        last_asst = ids[-1] if ids and self.views[ids[-1]].role == "assistant" else None
        idle = not self.generating and self.ready
        for i, v in self.views.items():
            v.set_actions(regenerate=idle and i == last_asst, edit=idle and i == last_user,
                          copy=v.status != STREAMING)

    def set_edit_mode(self, text: str | None) -> None:
        """Put ``text`` in the prompt box for editing (None leaves edit mode)."""
        self.edit_hint.setVisible(text is not None)
        if text is not None:
            self.input.setPlainText(text)
            self.input.moveCursor(QTextCursor.End)
            self.input.setFocus()
        else:
            self.input.clear()

    # --- state --------------------------------------------------------------------------------

    def set_generating(self, on: bool) -> None:
        """Switch Send <-> Stop."""
        self.generating = on
        self._update_send()
        self.update_actions()

    def set_ready(self, ready: bool, placeholder: str = "") -> None:
        """Enable sending (a model is loaded) or show why not."""
        self.ready = ready
        self._placeholder = placeholder
        self._update_placeholder()
        self._update_send()
        self.update_actions()

    def _update_placeholder(self) -> None:
        """The prompt box's placeholder for the current state, with shorter variants for a
        narrow window (PromptEdit.set_placeholders picks the one that fits)."""
        if getattr(self, "_placeholder", ""):
            texts = (self._placeholder,)
        elif not self.ready:
            texts = ("Loading the model…",)
        elif not self.can_send_chat:
            texts = ("This model has no chat template: choose “Use raw mode” above to send plain text",
                     "No chat template: choose “Use raw mode” above", "Choose “Use raw mode” above",
                     "“Use raw mode” above")
        elif self.raw_mode:
            texts = ("Raw mode: your text is sent as is for the model to continue  (Enter to send)",
                     "Raw mode: text for the model to continue  (Enter to send)", "Raw mode  (Enter to send)",
                     "Raw mode")
        else:
            texts = self.ready_texts
        self.input.set_placeholders(*texts)

    def set_intro(self, html: str = "", placeholders: tuple[str, ...] = ()) -> None:
        """What an empty chat says about the open model (rich text; a link asks for the
        recommendations) and the prompt box's placeholders once it is ready, longest first;
        empty: the general ones."""
        self.empty_label.setTextFormat(Qt.RichText if html else Qt.AutoText)
        self.empty_label.setText(html or self.EMPTY_TEXT)
        self.ready_texts = tuple(placeholders) or self.READY_TEXTS
        self._update_placeholder()

    # --- chat template / raw mode ---------------------------------------------------------

    @property
    def raw_mode(self) -> bool:
        """True when the user chose raw mode for a model without a chat template."""
        return not self.has_chat_template and self.raw_btn.isChecked()

    @property
    def can_send_chat(self) -> bool:
        """A message can be sent: the model has a chat template, or raw mode was chosen."""
        return self.has_chat_template or self.raw_btn.isChecked()

    def set_chat_template(self, has_template: bool) -> None:
        """Tell the view whether the loaded model has a chat template (Loaded.has_chat_template).

        Without one the banner explains it and sending waits until the user picks raw mode."""
        self.has_chat_template = bool(has_template)
        self.raw_btn.blockSignals(True)
        self.raw_btn.setChecked(False)
        self.raw_btn.blockSignals(False)
        self.raw_btn.setText("Use raw mode")
        self.template_banner.setVisible(not has_template)
        self._update_placeholder()
        self._update_send()

    def _toggle_raw(self, on: bool) -> None:
        self.raw_btn.setText("Raw mode on" if on else "Use raw mode")
        self._update_placeholder()
        self._update_send()

    def build_request(self, messages: tuple[ChatMessage, ...], sampling: SamplingParams) -> GenerateRequest:
        """The request for this conversation: chat messages, or in raw mode the last user message
        alone as plain text (raw mode has no roles, so the system prompt and earlier turns are
        not sent; the banner says so)."""
        if self.raw_mode:
            last = next((m.content for m in reversed(messages) if m.role == "user"), "")
            return GenerateRequest(prompt=last, sampling=sampling)
        return GenerateRequest(messages=messages, sampling=sampling)

    def _update_send(self) -> None:
        if self.generating:
            self.send_btn.setText("Stop")
            self.send_btn.setProperty("stop", True)
            self.send_btn.setAccessibleName("Stop generating")
            self.send_btn.setToolTip("Stop (Esc)")
            self.send_btn.setEnabled(True)
        else:
            self.send_btn.setText("Send")
            self.send_btn.setProperty("stop", False)
            self.send_btn.setAccessibleName("Send message")
            self.send_btn.setToolTip("Send (Enter)")
            self.send_btn.setEnabled(self.ready and self.can_send_chat)
        self.send_btn.style().unpolish(self.send_btn)
        self.send_btn.style().polish(self.send_btn)

    # --- intents ------------------------------------------------------------------------------

    def _send_or_stop(self) -> None:
        if self.generating:
            self.stop_requested.emit()
        else:
            self._submit()

    def _submit(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self.generating or not self.ready or not self.can_send_chat:
            return
        self.input.clear()
        self.send_requested.emit(text)

    def _copy(self, msg_id: int) -> None:
        v = self.views.get(msg_id)
        if v is not None:
            QGuiApplication.clipboard().setText(v.answer)

    def _toggle_system(self, on: bool) -> None:
        self.system_edit.setVisible(on)
        if on:
            self.system_edit.setFocus()

    def eventFilter(self, obj, ev):
        if obj is self.system_edit and ev.type() == QEvent.FocusOut:
            self.system_prompt_edited.emit(self.system_edit.toPlainText().strip())
        return super().eventFilter(obj, ev)

    def system_prompt(self) -> str:
        """The system prompt as currently typed."""
        return self.system_edit.toPlainText().strip()

    # --- scrolling ----------------------------------------------------------------------------

    def _on_scroll(self, value: int) -> None:
        sb = self.scroll.verticalScrollBar()
        self._stick = value >= sb.maximum() - 24

    def _on_range(self, _lo: int, hi: int) -> None:
        if self._stick:
            self.scroll.verticalScrollBar().setValue(hi)

    def scroll_to_bottom(self) -> None:
        """Scroll to the newest message (after layout)."""
        self._stick = True
        QTimer.singleShot(0, lambda: self.scroll.verticalScrollBar().setValue(
            self.scroll.verticalScrollBar().maximum()))


# --- conversation list ----------------------------------------------------------------------


def _elide(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


QUOTE_CHARS = 60  # of a search query quoted under the search box


class ConversationList(QFrame):
    """Sidebar: New chat, search (titles and message text), the conversations, rename and
    delete. A conversation found by its messages shows the best matching words under its title;
    choosing it also emits ``message_selected`` for that message."""

    new_requested = Signal()
    selected = Signal(int)            #: conversation id
    message_selected = Signal(int, int)   #: conversation id, message id (a search hit)
    rename_requested = Signal(int)    #: conversation id
    delete_requested = Signal(int)    #: conversation id
    search_changed = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("sidebar")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(12, 12, 12, 12)
        lay.setSpacing(8)
        self.new_btn = QPushButton("+  New chat")
        self.new_btn.setObjectName("newChatButton")
        self.new_btn.setAccessibleName("New chat")
        self.new_btn.setToolTip(f"New chat ({QKeySequence(QKeySequence.New).toString(QKeySequence.NativeText)})")
        self.new_btn.setCursor(Qt.PointingHandCursor)
        self.new_btn.clicked.connect(self.new_requested)
        lay.addWidget(self.new_btn)
        self.search = QLineEdit()
        self.search.setObjectName("searchEdit")
        self.search.setPlaceholderText("Search chats and messages")
        self.search.setAccessibleName("Search conversations and message text")
        self.search.setClearButtonEnabled(True)
        for b in self.search.findChildren(QToolButton):   # Qt's clear button
            b.setAccessibleName("Clear search")
        self.search.textChanged.connect(self.search_changed)
        lay.addWidget(self.search)
        self.hits_label = QLabel()
        self.hits_label.setObjectName("searchHits")
        self.hits_label.setAccessibleName("Search results")
        self.hits_label.setWordWrap(True)
        self.hits_label.setVisible(False)
        lay.addWidget(self.hits_label)
        self.list = QListWidget()
        self.list.setObjectName("conversationList")
        self.list.setAccessibleName("Conversations")
        self.list.setSelectionMode(QAbstractItemView.SingleSelection)
        self.list.setContextMenuPolicy(Qt.ActionsContextMenu)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.ElideRight)
        self.list.setWordWrap(False)
        self.list.itemSelectionChanged.connect(self._on_select)
        self.list.itemDoubleClicked.connect(lambda it: self.rename_requested.emit(it.data(Qt.UserRole)))
        lay.addWidget(self.list, 1)
        row = QHBoxLayout()
        row.setSpacing(6)
        self.rename_btn = QPushButton("Rename")
        self.rename_btn.setObjectName("sideButton")
        self.rename_btn.setAccessibleName("Rename conversation")
        self.rename_btn.clicked.connect(lambda: self._emit_current(self.rename_requested))
        self.delete_btn = QPushButton("Delete")
        self.delete_btn.setObjectName("sideButton")
        self.delete_btn.setAccessibleName("Delete conversation")
        self.delete_btn.clicked.connect(lambda: self._emit_current(self.delete_requested))
        row.addWidget(self.rename_btn)
        row.addWidget(self.delete_btn)
        lay.addLayout(row)
        self._block = False

    def set_conversations(self, convs: list[Conversation], current: int | None,
                          hits: dict[int, tuple[int, str]] | None = None) -> None:
        """Fill the list (keeping ``current`` selected, without emitting ``selected``).
        ``hits``: {conversation id: (message id, snippet)} for conversations found by the text
        of a message; the snippet is shown under the title."""
        self._block = True
        self.list.clear()
        hits = hits or {}
        for c in convs:
            title = c.title or "Untitled"
            hit = hits.get(c.id)
            it = QListWidgetItem(f"{title}\n   {_elide(hit[1], 60)}" if hit else title)
            it.setData(Qt.UserRole, c.id)
            it.setData(Qt.UserRole + 2, hit[0] if hit else None)
            tip = f"{c.title}\nlast activity {time.strftime('%Y-%m-%d %H:%M', time.localtime(c.updated))}"
            if hit:
                tip += f"\nfound: {hit[1]}"
            it.setToolTip(tip)
            self.list.addItem(it)
            if c.id == current:
                it.setSelected(True)
                self.list.setCurrentItem(it)
        self._block = False
        has = self.current_id() is not None
        self.rename_btn.setEnabled(has)
        self.delete_btn.setEnabled(has)

    def current_id(self) -> int | None:
        """Id of the selected conversation."""
        items = self.list.selectedItems()
        return items[0].data(Qt.UserRole) if items else None

    def show_hits(self, query: str, n_conversations: int, n_messages: int) -> None:
        """The line under the search box: what the search found ('' query hides it)."""
        if not query:
            self.hits_label.setVisible(False)
            return
        query = " ".join(query.split())  # one short line: a pasted file would make it pages tall
        if len(query) > QUOTE_CHARS:
            query = query[:QUOTE_CHARS].rstrip() + "…"
        if n_conversations == 0:
            text = f"Nothing found for “{query}”."
        else:
            text = (f"{n_conversations} chat{'s' if n_conversations != 1 else ''}"
                    + (f", {n_messages} message{'s' if n_messages != 1 else ''}" if n_messages else "")
                    + f" match “{query}”")
        self.hits_label.setText(text)
        self.hits_label.setVisible(True)

    def _on_select(self) -> None:
        cid = self.current_id()
        self.rename_btn.setEnabled(cid is not None)
        self.delete_btn.setEnabled(cid is not None)
        if not self._block and cid is not None:
            self.selected.emit(cid)
            mid = self.list.selectedItems()[0].data(Qt.UserRole + 2)
            if mid is not None:
                self.message_selected.emit(cid, int(mid))

    def _emit_current(self, signal) -> None:
        cid = self.current_id()
        if cid is not None:
            signal.emit(cid)
