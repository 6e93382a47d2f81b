"""The model library: converted models (name, source, quantization, size on disk, date,
status) with Set as current, Delete (confirmed) and Open folder. A broken store (the engine's
one store validation, engine.library.list_models) is listed as "Broken" with the reason and
what to do; it cannot be set as current, only deleted (or re-converted).

Scanning (which sums every store's files) and deleting run as tasks of the library lane
(colibri_app.workers), so a large store never freezes the window."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Signal, Slot
from PySide6.QtGui import QDesktopServices, QFont, QPalette
from PySide6.QtWidgets import (QAbstractItemView, QDialog, QDialogButtonBox, QHBoxLayout, QHeaderView, QLabel,
                               QMessageBox, QPushButton, QStyle, QTableWidget, QTableWidgetItem, QVBoxLayout,
                               QWidget)

from engine import EngineFailure
from engine import library as lib

from .workers import Lane, Task

COLUMNS = ("Name", "Source", "Quantization", "Family", "Size on disk", "Converted", "Status")
STATUS_COLUMN = COLUMNS.index("Status")
SCANNING = "Scanning the models folder…"
_LANE: Lane | None = None


def library_lane() -> Lane:
    """The lane that scans and deletes stores (one thread: a scan never races a delete)."""
    global _LANE
    if _LANE is None or _LANE.closed:
        _LANE = Lane("library", threads=1)
    return _LANE


def _same(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return a == b


def table_content_width(t: QTableWidget) -> int:
    """Pixels ``t`` needs to show every column whole (contents and headers)."""
    cols = sum(max(t.sizeHintForColumn(j), t.horizontalHeader().sectionSizeHint(j)) for j in range(t.columnCount()))
    return cols + 2 * t.frameWidth() + t.verticalScrollBar().sizeHint().width()


def keep_on_screen(w: QWidget) -> None:
    """Move a shown window that grew past its screen's right or bottom edge back onto it: a
    dialog is placed for its first size, and widening it for its table pushed its buttons off."""
    if not w.isVisible() or w.screen() is None:
        return
    screen, g = w.screen().availableGeometry(), w.frameGeometry()
    x = max(screen.left(), min(g.left(), screen.right() + 1 - g.width()))
    y = max(screen.top(), min(g.top(), screen.bottom() + 1 - g.height()))
    if (x, y) != (g.left(), g.top()):
        w.move(x, y)


class ModelLibraryDialog(QDialog):
    """Converted models in the user data folder.

    Args:
        current: store path of the model in use (marked, and it cannot be deleted).
    Signals:
        current_changed(str): the store path the user set as current.
    """

    current_changed = Signal(str)

    def __init__(self, current: str | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.current = current
        self.entries: list[lib.ModelEntry] = []
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.horizontalHeader().setSectionResizeMode(1, QHeaderView.Stretch)
        self.table.verticalHeader().hide()
        self.table.setWordWrap(False)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.table.itemDoubleClicked.connect(lambda *_: self.set_current())
        self.empty = QLabel(f"No converted models yet in {lib.models_dir()}. Add one with “Add model…”.")
        self.empty.setWordWrap(True)
        self.task: Task | None = None   # the scan or delete in progress
        self.status = QLabel()
        self.status.setObjectName("libraryStatus")
        self.status.setWordWrap(True)

        self.set_button = QPushButton("Set as current")
        self.set_button.clicked.connect(self.set_current)
        self.delete_button = QPushButton("Delete…")
        self.delete_button.clicked.connect(self.delete_selected)
        self.open_button = QPushButton("Open folder")
        self.open_button.clicked.connect(self.open_folder)
        close = QDialogButtonBox(QDialogButtonBox.Close)
        close.rejected.connect(self.reject)
        h = QHBoxLayout()
        for b in (self.set_button, self.delete_button, self.open_button):
            h.addWidget(b)
        h.addStretch(1)
        h.addWidget(close)
        lay = QVBoxLayout(self)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.empty)
        lay.addWidget(self.status)
        lay.addLayout(h)
        self.resize(820, 360)
        self.refresh()

    @property
    def busy(self) -> bool:
        """True while a scan or a delete runs."""
        return self.task is not None

    def _run(self, fn, on_result) -> None:
        """Run ``fn()`` on the library lane; ``on_result(value)`` on success, the error in the
        status line otherwise; then a fresh scan unless this was the scan."""
        self.task = library_lane().submit(lambda ctx: fn(), "library", result=on_result, error=self._failed,
                                          finished=self._task_ended)
        self._selection_changed()

    @Slot()
    def _task_ended(self) -> None:
        self.task = None
        self._selection_changed()

    @Slot(object)
    def _failed(self, f: EngineFailure) -> None:
        self.status.setText(f.message)

    @Slot()
    def refresh(self) -> None:
        """Re-scan the models folder (in the background; the table fills when done)."""
        if self.task is None:
            if not self.entries:
                self.status.setText(SCANNING)
            self._run(lib.list_models, self._show)

    @Slot(object)
    def _show(self, entries: list) -> None:
        if self.status.text() == SCANNING:
            self.status.setText("")
        self.entries = entries
        self.table.setRowCount(len(self.entries))
        bold = QFont()
        bold.setBold(True)
        for i, e in enumerate(self.entries):
            is_cur = _same(e.path, self.current)
            src = e.source
            if src.startswith("hf://") and "@" in src:
                repo, _, commit = src.rpartition("@")
                src = f"{repo}@{commit[:12]}"
            vals = (e.name + ("  (current)" if is_cur else ""), src, e.quantization, e.family_label,
                    lib.format_bytes(e.size_bytes), e.created.replace("T", " ").rstrip("Z"),
                    "OK" if e.ok else "Broken")
            tip = f"{e.path}\nsource: {e.source}" + ("" if e.ok else f"\n\nBroken: {e.problem}\n{e.advice}")
            for j, v in enumerate(vals):
                it = QTableWidgetItem(v)
                it.setToolTip(tip)
                if is_cur:
                    it.setFont(bold)
                if j == 4:
                    it.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
                if not e.ok:
                    it.setForeground(self.palette().color(QPalette.PlaceholderText))
                    if j == STATUS_COLUMN:
                        it.setIcon(self.style().standardIcon(QStyle.SP_MessageBoxWarning))
                        it.setForeground(self.palette().color(QPalette.Text))
                self.table.setItem(i, j, it)
        self.table.resizeColumnsToContents()
        self._fit_width()
        self.empty.setVisible(not self.entries)
        if self.entries and not self.table.selectedItems():
            self.table.selectRow(0)
        self._selection_changed()

    def table_content_width(self) -> int:
        """Pixels the table needs to show every column whole (contents and headers)."""
        return table_content_width(self.table)

    def _fit_width(self) -> None:
        """Widen the dialog (never past the screen) so that names, sources and paths are not cut:
        a hub source with its commit alone is wider than the first size."""
        lay = self.layout()
        m = lay.contentsMargins()
        need = self.table_content_width() + m.left() + m.right()
        screen = self.screen().availableGeometry().width() if self.screen() else need
        if self.width() < need:
            self.resize(min(need, int(0.95 * screen)), self.height())
            keep_on_screen(self)

    def selected(self) -> lib.ModelEntry | None:
        rows = {i.row() for i in self.table.selectedItems()}
        return self.entries[rows.pop()] if len(rows) == 1 else None

    def select_path(self, path: str) -> None:
        for i, e in enumerate(self.entries):
            if _same(e.path, path):
                self.table.selectRow(i)

    @Slot()
    def _selection_changed(self) -> None:
        e = self.selected()
        for b in (self.set_button, self.delete_button, self.open_button):
            b.setEnabled(e is not None)
        if self.busy:
            self.delete_button.setEnabled(False)
        if e is not None and (_same(e.path, self.current) or not e.ok):
            self.set_button.setEnabled(False)
        if e is not None and not e.ok:
            self.status.setText(self.broken_text(e))
        elif self.status.text().startswith("Broken: "):
            self.status.setText("")

    @staticmethod
    def broken_text(e: lib.ModelEntry) -> str:
        """The status line of a broken store: why, naming the file, and what to do."""
        return f"Broken: {e.problem}\n{e.advice}"

    @Slot()
    def set_current(self) -> None:
        """Make the selected model current (emits current_changed)."""
        e = self.selected()
        if e is None or _same(e.path, self.current):
            return
        if not e.ok:
            self.status.setText(self.broken_text(e))
            return
        self.current = e.path
        self.current_changed.emit(e.path)
        self.status.setText(f"{e.name} ({e.quantization}) is now the current model.")
        self._show(self.entries)

    @Slot()
    def delete_selected(self) -> None:
        """Delete the selected store after confirmation (never the current model)."""
        e = self.selected()
        if e is None or self.busy:
            return
        if _same(e.path, self.current):
            self.status.setText(f"{e.name} is the current model; set another model as current before "
                                f"deleting it.")
            return
        ans = QMessageBox.question(
            self, "Delete model",
            f"Delete {e.name} ({e.quantization}, {lib.format_bytes(e.size_bytes)})?\n\n{e.path}\n\n"
            f"The converted store is removed from disk. You can convert it again later.",
            QMessageBox.Yes | QMessageBox.No, QMessageBox.No)
        if ans != QMessageBox.Yes:
            return
        self.status.setText(f"Deleting {e.name} ({e.quantization})…")

        def deleted(_none) -> None:
            self.status.setText(f"Deleted {e.name} ({e.quantization}).")
            self.entries = [x for x in self.entries if x is not e]
            self._show(self.entries)

        def delete() -> None:
            try:
                lib.delete_model(e.path)
            except (OSError, ValueError) as err:
                raise OSError(f"Could not delete {e.path}: {err}") from err
        self._run(delete, deleted)

    def done(self, result: int) -> None:
        """Closing: a scan is dropped; a delete in progress finishes on its own."""
        if self.task is not None:
            self.task.cancel()
        super().done(result)

    @Slot()
    def open_folder(self) -> None:
        """Show the selected store's folder in the file manager."""
        e = self.selected()
        if e is not None:
            QDesktopServices.openUrl(QUrl.fromLocalFile(e.path))
