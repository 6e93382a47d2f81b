"""An answer's text as Markdown, also while it streams, at a cost that stays flat on long answers.

The text is cut into blocks (:func:`split_blocks`): prose, rendered by Qt's Markdown
(``QTextDocument.setMarkdown``), and fenced code blocks, highlighted with Pygments and shown in a
card with the language and a Copy button. Prose is also cut at a blank line once a chunk holds
:data:`PROSE_CHUNK` characters. A block is *closed* when a later block has begun; closed blocks
never change, so each streaming update parses only the text after the last closed block and
re-renders only the last block (Markdown of at most about PROSE_CHUNK characters; for code, only
the lines completed since the last update are highlighted and appended; the whole block is
highlighted once more when the answer ends, so a construct spanning two updates, such as a long
string, ends correctly coloured). ``tools/bench_markdown_stream.py`` measures it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import (QColor, QFont, QFontDatabase, QGuiApplication, QTextBlockFormat, QTextCharFormat,
                           QTextCursor, QTextFormat)
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QSizePolicy, QTextBrowser, QToolButton, QVBoxLayout,
                               QWidget)

from .resources import colors

PROSE_CHUNK = 1500          # characters of prose after which a chunk ends at the next blank line
PROSE_HARD = 6000           # ... or at the next line end, when no blank line comes
_FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^`\s]*)[^`]*$")


@dataclass(frozen=True)
class Block:
    """A piece of an answer. kind: "prose" or "code"; text: the Markdown (prose) or the code
    without its fences; lang: the fence's info word ("" when none); closed: it will not change
    (a later block began, or the answer ended)."""

    kind: str
    text: str
    lang: str = ""
    closed: bool = False


def split_blocks(text: str, final: bool = False) -> tuple[list[Block], int, int]:
    """Cut Markdown ``text`` into blocks -> (blocks, start, fixed): ``fixed`` blocks were ended
    by a later boundary (a fence, a chunk end) and never change; ``start`` is the offset after
    them, where a re-parse of a longer text may begin.

    Fenced code (CommonMark: three or more backticks or tildes, up to three spaces of indent,
    closed by a fence of the same character at least as long) becomes a "code" block; the rest
    is prose, cut at a blank line after PROSE_CHUNK characters (at a line end after PROSE_HARD).
    A line is complete only when a newline follows it, unless ``final`` (the answer ended): an
    unterminated code block is then closed by the end of the text.
    """
    blocks: list[Block] = []
    lines = text.split("\n")
    complete = len(lines) - 1 if not final else len(lines)   # the last piece has no newline yet
    pos = 0            # offset of lines[i]
    start = 0          # offset where the current block starts
    buf: list[str] = []
    size = 0
    fence = None       # (char, length) while inside code
    lang = ""
    for i, line in enumerate(lines):
        is_complete = i < complete
        nxt = pos + len(line) + 1
        if fence is None:
            m = _FENCE.match(line) if is_complete else None
            if m and (m.group(2)[0] == "~" or "`" not in m.group(3)):
                if "\n".join(buf).strip():
                    blocks.append(Block("prose", "\n".join(buf).rstrip("\n"), closed=True))
                # a re-parse starts at the fence line itself, so that it opens the code again
                fence, lang, buf, size, start = (m.group(2)[0], len(m.group(2))), m.group(3), [], 0, pos
            elif is_complete and ((not line.strip() and size >= PROSE_CHUNK) or size >= PROSE_HARD):
                buf.append(line)
                blocks.append(Block("prose", "\n".join(buf).rstrip("\n"), closed=True))
                buf, size, start = [], 0, nxt
            else:
                buf.append(line)
                size += len(line) + 1
        else:
            s = line.strip()
            if is_complete and len(s) >= fence[1] and set(s) == {fence[0]} and len(line) - len(line.lstrip()) <= 3:
                blocks.append(Block("code", "\n".join(buf), lang, closed=True))
                fence, buf, size, start = None, [], 0, nxt
            else:
                buf.append(line)
        pos = nxt
    fixed = len(blocks)
    if fence is not None:
        blocks.append(Block("code", "\n".join(buf), lang, closed=final))
    elif buf and "\n".join(buf).strip():
        blocks.append(Block("prose", "\n".join(buf), closed=final))
    return blocks, min(start, len(text)), fixed


# --- widgets --------------------------------------------------------------------------------


class MessageText(QTextBrowser):
    """Read-only rich text that grows to fit its document (no vertical scroll bar)."""

    def __init__(self, parent: QWidget | None = None, wrap: bool = True):
        super().__init__(parent)
        self.setFrameShape(QFrame.NoFrame)
        self.setOpenExternalLinks(True)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAsNeeded)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.setMinimumWidth(0)
        if not wrap:
            self.setLineWrapMode(QTextBrowser.NoWrap)
        self.setTextInteractionFlags(Qt.TextSelectableByMouse | Qt.TextSelectableByKeyboard
                                     | Qt.LinksAccessibleByMouse)
        self.viewport().setAutoFillBackground(False)
        self.setStyleSheet("QTextBrowser { background: transparent; }")
        self.document().setDocumentMargin(2)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self._fit()

    def append_plain(self, text: str) -> None:
        """Append plain text at the end (streaming)."""
        cur = QTextCursor(self.document())
        cur.movePosition(QTextCursor.End)
        cur.insertText(text)

    def set_markdown(self, text: str) -> None:
        """Render Markdown (Qt's) and shade indented code blocks and inline code."""
        self.setMarkdown(text)
        doc = self.document()
        bg = QColor(colors()["code_bg"])
        b = doc.begin()
        while b.isValid():
            f = b.blockFormat()
            frag = b.begin()
            mono = False
            if not frag.atEnd():
                fams = frag.fragment().charFormat().fontFamilies() or []
                mono = "monospace" in fams and frag.fragment().length() == b.length() - 1
            if f.hasProperty(QTextFormat.BlockCodeFence) or f.nonBreakableLines() or mono:
                bf = QTextBlockFormat()
                bf.setBackground(bg)
                bf.setLeftMargin(6)
                QTextCursor(b).mergeBlockFormat(bf)
            b = b.next()

    def wheelEvent(self, e):  # the transcript scrolls, not the message
        e.ignore()

    def _fit(self, *_):
        doc_h = self.document().size().height()
        h = int(math.ceil(doc_h)) + 2 * self.frameWidth() + 2
        sb = self.horizontalScrollBar()
        if sb.maximum() > 0:
            h += sb.sizeHint().height()
        if h != self.height():
            self.setFixedHeight(h)

    def resizeEvent(self, e):
        super().resizeEvent(e)
        self._fit()


def _lexer(lang: str):
    from pygments.lexers import get_lexer_by_name
    from pygments.lexers.special import TextLexer
    from pygments.util import ClassNotFound
    if lang:
        try:
            return get_lexer_by_name(lang, stripnl=False, ensurenl=False)
        except ClassNotFound:
            pass
    return TextLexer(stripnl=False, ensurenl=False)


_FORMATS: dict = {}


def _char_format(style_name: str, ttype) -> QTextCharFormat:
    """The QTextCharFormat of a Pygments token type in a Pygments style (cached)."""
    key = (style_name, ttype)
    f = _FORMATS.get(key)
    if f is None:
        from pygments.styles import get_style_by_name
        st = get_style_by_name(style_name).style_for_token(ttype)
        f = QTextCharFormat()
        if st.get("color"):
            f.setForeground(QColor("#" + st["color"]))
        if st.get("bold"):
            f.setFontWeight(QFont.Bold)
        if st.get("italic"):
            f.setFontItalic(True)
        _FORMATS[key] = f
    return f


class CodeBlock(QFrame):
    """A fenced code block: language, Copy button, highlighted code (Pygments), no wrapping.

    Signals: copied(str) - the code was put on the clipboard."""

    copied = Signal(str)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("codeBlock")
        self.setAccessibleName("Code block")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 4, 6, 6)
        lay.setSpacing(2)
        head = QHBoxLayout()
        head.setContentsMargins(0, 0, 0, 0)
        self.lang_label = QLabel()
        self.lang_label.setObjectName("codeLang")
        head.addWidget(self.lang_label)
        head.addStretch(1)
        self.copy_btn = QToolButton()
        self.copy_btn.setObjectName("codeCopy")
        self.copy_btn.setText("Copy code")
        self.copy_btn.setAccessibleName("Copy this code")
        self.copy_btn.setToolTip("Copy this code to the clipboard")
        self.copy_btn.setAutoRaise(True)
        self.copy_btn.setCursor(Qt.PointingHandCursor)
        self.copy_btn.clicked.connect(self.copy)
        head.addWidget(self.copy_btn)
        lay.addLayout(head)
        self.view = MessageText(wrap=False)
        self.view.setObjectName("codeText")
        self.view.setAccessibleName("Code")
        self.view.setFont(QFontDatabase.systemFont(QFontDatabase.FixedFont))
        lay.addWidget(self.view)
        self.code = ""
        self.lang = ""
        self.final = False
        self._done = ""          # code highlighted so far (complete lines)
        self._done_pos = 0       # document position after it
        self._style = ""
        self.highlighted_chars = 0   # characters run through the lexer (the cost measure)


    def set_code(self, code: str, lang: str = "", final: bool = True) -> None:
        """Show ``code``; while streaming (``final`` False) only lines completed since the last
        call are highlighted and appended; ``final`` highlights the whole block once."""
        style = colors()["pygments"]
        if (code, lang, final, style) == (self.code, self.lang, self.final, self._style):
            return
        self.lang_label.setText(lang or "code")
        restart = (lang != self.lang or style != self._style or not code.startswith(self._done)
                   or (final and not self.final))
        self.code, self.lang, self.final, self._style = code, lang, final, style
        doc = self.view.document()
        cur = QTextCursor(doc)
        if restart:
            doc.clear()
            self._done, self._done_pos = "", 0
        else:  # drop the plain tail shown after the highlighted lines
            cur.setPosition(self._done_pos)
            cur.movePosition(QTextCursor.End, QTextCursor.KeepAnchor)
            cur.removeSelectedText()
        new = code[len(self._done):]
        upto = len(new) if final else new.rfind("\n") + 1
        cur.setPosition(self._done_pos)
        cur.movePosition(QTextCursor.End)
        if upto > 0:
            self._insert_highlighted(cur, new[:upto], style)
            self._done += new[:upto]
            self._done_pos = cur.position()
        if upto < len(new):
            cur.insertText(new[upto:], QTextCharFormat())

    def _insert_highlighted(self, cur: QTextCursor, text: str, style: str) -> None:
        self.highlighted_chars += len(text)
        for ttype, value in _lexer(self.lang).get_tokens(text):
            cur.insertText(value, _char_format(style, ttype))

    def toPlainText(self) -> str:  # noqa: N802 - Qt's name, for symmetry with MessageText
        return self.code

    def copy(self) -> None:
        """Put the code (without its fences) on the clipboard."""
        QGuiApplication.clipboard().setText(self.code)
        self.copy_btn.setText("Copied")
        btn = self.copy_btn   # the timer dies with the button (context object)
        QTimer.singleShot(1500, btn, lambda: btn.setText("Copy code"))
        self.copied.emit(self.code)


class MarkdownBody(QWidget):
    """An answer's text as a column of prose and code widgets (see the module docstring).

    :meth:`set_text` shows a text (streaming or final); :meth:`set_plain` shows plain text
    (the user's messages). Attributes: ``blocks`` (the Block shown by each widget),
    ``widgets``; ``rendered_chars``: characters handed to Qt's Markdown so far (the cost)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Preferred)
        self.lay = QVBoxLayout(self)
        self.lay.setContentsMargins(0, 0, 0, 0)
        self.lay.setSpacing(4)
        self.blocks: list[Block] = []
        self.widgets: list[QWidget] = []
        self._text = ""
        self._stable = 0            # offset where the first block that may still change starts
        self._n_stable = 0          # blocks before it (closed: never parsed or rendered again)
        self._final = False
        self._plain = False
        self._style = ""
        self.rendered_chars = 0

    # the part of the QTextEdit API the rest of the app and the tests use
    def toPlainText(self) -> str:  # noqa: N802
        return "\n".join(w.toPlainText() for w in self.widgets)

    def code_blocks(self) -> list[CodeBlock]:
        return [w for w in self.widgets if isinstance(w, CodeBlock)]

    def set_plain(self, text: str) -> None:
        """One plain-text paragraph (no Markdown)."""
        self._reset()
        self._plain = True
        w = MessageText()
        w.setPlainText(text)
        self._add(Block("prose", text, closed=True), w)
        self._text = text

    def set_text(self, text: str, final: bool) -> None:
        """Show Markdown ``text``; ``final`` False while it streams. Only the text after the
        last closed block is parsed again, and only blocks that changed are re-rendered."""
        style = colors()["pygments"]
        if (self._plain or style != self._style or not text.startswith(self._text[:self._stable])
                or (self._final and not final)):
            self._reset()
            self._style = style
        tail, start, fixed = split_blocks(text[self._stable:], final)
        new_blocks = self.blocks[:self._n_stable] + tail
        for i in range(self._n_stable, len(new_blocks)):
            b = new_blocks[i]
            if i < len(self.blocks) and self.blocks[i] == b:
                continue
            if i < len(self.widgets) and self.blocks[i].kind == b.kind:
                self._render(self.widgets[i], b)
                self.blocks[i] = b
            else:
                while len(self.widgets) > i:
                    self._pop()
                self._add(b, self._make(b))
        while len(self.widgets) > len(new_blocks):
            self._pop()
        self._n_stable += fixed
        self._stable += start
        self._text, self._final = text, final

    # --- helpers ------------------------------------------------------------------------------

    def _make(self, b: Block) -> QWidget:
        w = CodeBlock() if b.kind == "code" else MessageText()
        self._render(w, b)
        return w

    def _render(self, w: QWidget, b: Block) -> None:
        if b.kind == "code":
            w.set_code(b.text, b.lang, final=b.closed)
        else:
            self.rendered_chars += len(b.text)
            w.set_markdown(b.text)

    def _add(self, b: Block, w: QWidget) -> None:
        self.lay.addWidget(w)
        self.blocks.append(b)
        self.widgets.append(w)

    def _pop(self) -> None:
        w = self.widgets.pop()
        self.blocks.pop()
        w.setParent(None)
        w.deleteLater()

    def _reset(self) -> None:
        while self.widgets:
            self._pop()
        self._text, self._stable, self._n_stable, self._final, self._plain = "", 0, 0, False, False
