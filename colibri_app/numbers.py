"""Number fields that read what the user meant in any locale.

Qt's spin boxes read typed text with the user's locale only: in German ``0.6`` is read as 6
(the dot is the thousands separator there) and ``2.5`` as 25, silently. :class:`DecimalBox`
reads ``0,6`` and ``0.6`` alike as six tenths (and refuses ``2.500``, which could be either
2500 or 2,5) and :class:`WholeBox` refuses ``0,6`` or ``8.000`` instead of reading 6 or 8000; both show numbers in the user's locale (``0,6`` in German) and,
while the text cannot be read, hold a sentence saying why (:attr:`problem`, signal
``problem_changed``), which the dialogs show next to their OK button (disabled meanwhile).
"""

from __future__ import annotations

import math

from PySide6.QtCore import QEvent, QLocale, Qt, Signal
from PySide6.QtGui import QValidator
from PySide6.QtWidgets import QDoubleSpinBox, QSpinBox

_DECIMAL_MARKS = (".", ",", "\u066b")  # full stop, comma, Arabic decimal separator


def read_number(text: str, locale: QLocale, whole: bool) -> tuple[float | None, str]:
    """(value, "") for ``text`` typed by a user of ``locale``, or (None, why) when it cannot
    be read as one number. A decimal number takes either a comma or a full stop (or the
    locale's own mark) as its decimal mark, once, and no grouping; a whole number takes
    digits only. An empty text or a lone sign gives (None, "")."""
    t = text.strip().replace("\u2212", "-")
    if t in ("", "-", "+"):
        return None, ""
    marks = set(_DECIMAL_MARKS) | {locale.decimalPoint()}
    found = [c for c in t if c in marks]
    if whole and found:
        return None, f"“{text.strip()}” is not a whole number: type digits only, without separators"
    if len(found) > 1:
        return None, (f"“{text.strip()}” has {len(found)} separators: type the number with one decimal "
                      f"mark and no thousands separator (0{locale.decimalPoint()}6 or 0.6)")
    if found and found[0] == locale.groupSeparator() != locale.decimalPoint():
        # "2.500" in German, "1,000" in English: a thousands separator as much as a decimal
        # mark; refused rather than guessed
        whole_part, _, frac = t.partition(found[0])
        if len(frac) == 3 and frac.isdigit() and whole_part.lstrip("+-") not in ("", "0"):
            return None, (f"“{text.strip()}” could be {whole_part}{frac} or {whole_part}"
                          f"{locale.decimalPoint()}{frac}: type it without a thousands separator, "
                          f"or with fewer decimals")
    for m in found:
        t = t.replace(m, ".")
    try:
        v = float(t) if not whole else int(t, 10)
    except ValueError:
        return None, f"“{text.strip()}” is not a number"
    if not math.isfinite(v):
        return None, f"“{text.strip()}” is not a number"
    return v, ""


class _Reading:
    """What DecimalBox and WholeBox share: read the text between prefix and suffix."""

    def _body(self, text: str) -> str:
        if self.prefix() and text.startswith(self.prefix()):
            text = text[len(self.prefix()):]
        sfx = self.suffix()
        for s in {sfx, sfx.rstrip("s")} if sfx.endswith("s") else {sfx}:  # "1 thread" / "2 threads"
            if s and text.endswith(s):
                text = text[:-len(s)]
                break
        return text.strip()

    def _read(self, text: str) -> tuple[float | None, str]:
        if self.specialValueText() and text.strip() == self.specialValueText().strip():
            return self.minimum(), ""
        v, why = read_number(self._body(text), self.locale(), self._whole)
        if v is not None and not self.minimum() <= v <= self.maximum():
            lo, hi = self.textFromValue(self.minimum()), self.textFromValue(self.maximum())
            why = f"{self.textFromValue(v) if not self._whole else int(v)} is outside {lo}–{hi}"
        return v, why

    def _set_problem(self, why: str) -> None:
        if why != self.problem:
            self.problem = why
            self.problem_changed.emit(why)

    def validate(self, text: str, pos: int):  # noqa: D401 - Qt's override
        v, why = self._read(text)
        self._set_problem(why)
        if v is None or why:
            # Intermediate, never Invalid: the text stays as typed and the problem is shown
            return QValidator.Intermediate, text, pos
        return QValidator.Acceptable, text, pos

    def valueFromText(self, text: str):  # noqa: N802 - Qt's name
        v, why = self._read(text)
        return self.value() if v is None or why else (int(v) if self._whole else float(v))

    def fixup(self, text: str) -> str:
        """Leaving the field with unreadable text: back to the value it had before the typing
        (typing moves the value along each readable prefix, the "2" of "2,5")."""
        self._set_problem("")
        v = self.value() if self._before is None else self._before
        return self.textFromValue(v) if not self.specialValueText() or \
            v != self.minimum() else self.specialValueText()

    # The value before the current typing: set when the field is entered, set or stepped, and
    # when an edit is finished (Enter, leaving it).
    def _keep(self, *_args) -> None:
        self._before = self.value()

    def setValue(self, v) -> None:  # noqa: N802 - Qt's name
        super().setValue(v)
        self._keep()

    def stepBy(self, steps: int) -> None:  # noqa: N802 - Qt's name
        super().stepBy(steps)
        self._keep()

    def focusInEvent(self, event) -> None:  # noqa: N802 - Qt's name
        if not self.problem:
            self._keep()
        super().focusInEvent(event)

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt's name
        # Enter on refused text would put the old value back and press the dialog's OK: the
        # text and its reason stay instead, until the user fixes them (the line edit sees the
        # key first)
        if (obj is self.lineEdit() and event.type() == QEvent.KeyPress and self.problem
                and event.key() in (Qt.Key_Return, Qt.Key_Enter)):
            return True
        return super().eventFilter(obj, event)


class DecimalBox(_Reading, QDoubleSpinBox):
    """A QDoubleSpinBox that reads ``0,6`` and ``0.6`` alike (see the module docstring)."""

    problem_changed = Signal(str)
    _whole = False

    def __init__(self, parent=None):
        self.problem = ""
        self._before = None
        super().__init__(parent)
        self.setGroupSeparatorShown(False)
        self.editingFinished.connect(self._keep)
        self.lineEdit().installEventFilter(self)


class WholeBox(_Reading, QSpinBox):
    """A QSpinBox that refuses ``0,6`` and ``8.000`` with a reason instead of reading 6 / 8000."""

    problem_changed = Signal(str)
    _whole = True

    def __init__(self, parent=None):
        self.problem = ""
        self._before = None
        super().__init__(parent)
        self.setGroupSeparatorShown(False)
        self.editingFinished.connect(self._keep)
        self.lineEdit().installEventFilter(self)
