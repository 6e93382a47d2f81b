"""The model wizard: choose a model (hub repo or local folder), check it, download, convert,
self-test. Emits ``model_ready(store_path)`` when the user finishes with a working store.

All long work (hub queries, download, conversion, self-test) runs as tasks of the wizard
lane (colibri_app.workers); the GUI only receives engine dataclasses through queued signals
(LoadProgress, RepoCheck, EngineFailure) and never blocks. The logic is engine.library's.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from PySide6.QtCore import Qt, QUrl, Signal, Slot
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QButtonGroup, QCheckBox, QComboBox, QFileDialog, QGridLayout, QHBoxLayout,
                               QHeaderView, QLabel, QLineEdit, QPlainTextEdit, QProgressBar, QPushButton,
                               QRadioButton, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget, QWizard,
                               QWizardPage)

from engine import EngineFailure, ErrorKind, LoadProgress, describe_model, supported_families
from engine import library as lib
from engine import error_text

from .workers import Lane, Task

PAGE_SOURCE, PAGE_CHECK, PAGE_DOWNLOAD, PAGE_CONVERT, PAGE_DONE, PAGE_RECOMMENDED = range(6)
RED, ORANGE, GREEN = "#c62828", "#e65100", "#2e7d32"


_LANE: Lane | None = None


def wizard_lane() -> Lane:
    """The lane the wizard's checks, downloads, conversions and self-tests run on (shared by
    every wizard window; at most two at once: a re-check may overlap a running download)."""
    global _LANE
    if _LANE is None or _LANE.closed:
        _LANE = Lane("wizard", threads=2)
    return _LANE


def run_task(fn: Callable[[Callable, threading.Event], object], **slots) -> Task:
    """Run ``fn(progress, cancel)`` on the wizard lane; ``slots``: progress / result / error
    receivers, connected before it starts (see :meth:`colibri_app.workers.Lane.submit`)."""
    return wizard_lane().submit(lambda ctx: fn(ctx.progress, ctx.cancel), "wizard", **slots)


def _error_style(label: QLabel, color: str) -> None:
    label.setStyleSheet(f"color: {color};")


# --- pages ----------------------------------------------------------------------------------


def speed_range(lo: float, hi: float) -> str:
    """"7.4–25.8 tok/s"; two decimals below 1 tok/s, where one decimal made
    0.15–0.20 read "0.2–0.2"; one number when both ends read the same."""
    a, b = (f"{x:.1f}" if x >= 1 else f"{x:.2f}" for x in (lo, hi))
    return f"{a} tok/s" if a == b else f"{a}–{b} tok/s"


class RecommendedPage(QWizardPage):
    """"Recommended for this computer": the catalog's MoE models (engine.library.recommend)
    sized for this machine's memory, with the download and store sizes, the RAM budget the
    engine would take, the expert slots per layer it holds, the expected decode speed and what
    to take (a store quantization of the safetensors, or a -GGUF repository's file where that
    is the smaller download). Choosing one fills the hub repository (and that quantization or
    GGUF file) of the source page: from there the usual check, download and conversion follow."""

    COLUMNS = ("Model", "Take", "Download", "Store", "RAM budget", "Experts in RAM", "Speed", "")

    def __init__(self, wiz: "ModelWizard"):
        super().__init__(wiz)
        self.wiz = wiz
        self.setTitle("Recommended for this computer")
        self.machine = QLabel()
        self.machine.setObjectName("machineLine")
        self.machine.setWordWrap(True)
        self.table = QTableWidget(0, len(self.COLUMNS))
        self.table.setObjectName("recommendations")
        self.table.setHorizontalHeaderLabels(self.COLUMNS)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        for i in range(1, len(self.COLUMNS)):
            self.table.horizontalHeader().setSectionResizeMode(i, QHeaderView.ResizeToContents)
        self.table.verticalHeader().hide()
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setSelectionBehavior(QTableWidget.SelectRows)
        self.table.setSelectionMode(QTableWidget.SingleSelection)
        self.table.itemSelectionChanged.connect(self._selected)
        self.table.itemDoubleClicked.connect(lambda *_: self.wiz.next())
        self.detail = QLabel()
        self.detail.setObjectName("recommendationDetail")
        self.detail.setWordWrap(True)
        self.other = QLabel("Or press Next without choosing to name any repository of the hub, or a folder "
                            "on this computer.")
        self.other.setWordWrap(True)
        lay = QVBoxLayout(self)
        lay.addWidget(self.machine)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.detail)
        lay.addWidget(self.other)
        self.rows: list = []
        self.ram = (0, 0)
        self.disk_task: Task | None = None
        self.disk_measured = 0.0  # bytes/s of the models folder's disk, once measured

    def initializePage(self) -> None:
        """Fill the table at once with an assumed disk speed, then again with the speed of the
        disk the models go to, measured in the background (a 32 MB read test, about a second)."""
        self.ram = lib.machine_ram()
        if self.disk_task is None and not self.disk_measured:
            def fn(progress, cancel):
                where = lib.models_dir()
                return lib.disk_read_speed(where, [p for p in where.glob("*/experts/*.bin")][:1])
            self.disk_task = run_task(fn, result=self._disk_measured, error=self._disk_failed)
        self.show_for(*self.ram, self.disk_measured or None)

    @Slot(object)
    def _disk_measured(self, speed) -> None:
        self.disk_task = None
        self.disk_measured = (speed.mb_per_s or 0.0) * 1e6
        self._refill()

    @Slot(object)
    def _disk_failed(self, _f) -> None:
        self.disk_task = None  # the assumed speed stays, and the page says it is assumed
        self._refill()

    def _refill(self) -> None:
        chosen = self.chosen()
        self.show_for(*self.ram, self.disk_measured or None)
        if chosen is not None:  # keep the user's choice
            self.table.selectRow(next(i for i, r in enumerate(self.rows) if r.model is chosen.model))

    def show_for(self, total: int, available: int, disk_bytes_per_s: float | None = None) -> None:
        """Fill the table for a machine with ``total`` / ``available`` bytes of RAM (the tests
        pass other machines' numbers) and a disk of ``disk_bytes_per_s`` (None: assumed)."""
        fb = lib.format_bytes
        self.rows = lib.recommend(total, available, disk_bytes_per_s, self.wiz.context_length)
        disk = self.rows[0].disk_bytes_per_s if self.rows else 0
        self.machine.setText(
            f"This computer: {fb(total)} of RAM, {fb(available)} available now. Sizes and budgets come from the "
            f"engine's own RAM rule; the speed range is an estimate from this project's measurements with a disk "
            f"reading {disk / 1e9:.1f} GB/s ({'measured on the models folder' if self.rows and self.rows[0].disk_measured else 'assumed: a typical NVMe SSD, measuring…' if self.disk_task is not None else 'assumed: a typical NVMe SSD'}) "
            f"and uniform routing (real routing reads less). Recommended models are listed first, in bold.")
        self.table.setRowCount(len(self.rows))
        for i, r in enumerate(self.rows):
            lo, hi = r.tokens_per_s
            speed = speed_range(lo, hi) if r.slots_per_layer else "does not open"
            slots = (f"{r.slots_per_layer} of {r.estimate.num_experts} per layer" if r.slots_per_layer else "none")
            verdict = ("recommended" if r.recommended else {"refuse": "not enough RAM", "warn": "tight on RAM"}.get(
                r.verdict, "slow here"))
            cells = (r.model.name, r.take, fb(r.download_bytes), fb(r.estimate.store_bytes),
                     fb(r.budget_bytes) if r.budget_bytes else "—", slots, speed, verdict)
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(f"{r.repo_id}: {r.model.note}")
                if r.recommended:
                    f = item.font()
                    f.setBold(True)
                    item.setFont(f)
                self.table.setItem(i, j, item)
        self.table.clearSelection()
        self.detail.setText("")
        self._fit_width()

    def _fit_width(self) -> None:
        """Make the wizard wide enough for every column (never past 90% of the screen): at its
        first size the speed and verdict columns were hidden behind a scroll bar."""
        from .library import keep_on_screen, table_content_width
        screen = self.screen().availableGeometry().width() if self.screen() else 0
        need = table_content_width(self.table)
        margins = self.wiz.width() - self.table.width() if self.isVisible() else 0
        self.table.setMinimumWidth(min(need, int(0.9 * screen) - margins) if screen else need)
        if self.wiz.isVisible():  # shown: grow now (the layout would later) and stay on the screen
            grow = self.table.minimumWidth() - self.table.width()
            if grow > 0:
                self.wiz.resize(self.wiz.width() + grow, self.wiz.height())
            keep_on_screen(self.wiz)

    def chosen(self):
        """The selected Recommendation, or None."""
        rows = self.table.selectionModel().selectedRows() if self.table.selectionModel() else []
        return self.rows[rows[0].row()] if rows else None

    @Slot()
    def _selected(self) -> None:
        r = self.chosen()
        if r is None:
            self.detail.setText("")
            return
        fb = lib.format_bytes
        if r.gguf:
            take = (f"Take its GGUF file <b>{r.gguf}</b> from <b>{r.repo_id}</b> ({fb(r.download_bytes)}, against "
                    f"{fb(r.safetensors_bytes)} of safetensors) and import its blocks as published "
                    f"({fb(r.estimate.store_bytes)} store).")
        else:
            take = (f"Take the Hugging Face safetensors ({fb(r.download_bytes)}) and convert them to a "
                    f"<b>{r.quant}</b> store ({fb(r.estimate.store_bytes)}).")
            if 0 < r.gguf_bytes < r.download_bytes:
                lo, hi = r.gguf_tokens_per_s
                take += (f" Its GGUF {r.model.gguf[1]} ({r.model.gguf[0]}) is the smaller download "
                         f"({fb(r.gguf_bytes)}) but its store would run at {speed_range(lo, hi)} here.")
        self.detail.setText(f"<b>{r.model.repo_id}</b> — {r.model.note}. {take} {r.message}")
        self.detail.setTextFormat(Qt.RichText)

    def validatePage(self) -> bool:
        r = self.chosen()
        sp = self.wiz.source_page
        if r is not None:
            sp.hub_radio.setChecked(True)
            sp.repo_edit.setText(r.repo_id)
            self.wiz.preferred_quant = r.quant
            # the check then takes this GGUF file of the repository (None: its safetensors)
            sp.gguf_choice, sp.gguf_key = (r.gguf, sp.key()) if r.gguf else (None, None)
        return True

    def nextId(self) -> int:
        return PAGE_SOURCE


class SourcePage(QWizardPage):
    """Hub repo id + revision, or a local folder. Next runs the check (off the GUI thread);
    an unsupported model_type or a missing repo is refused here, before any download. Below,
    the GGUF models already on this computer (lib.find_gguf_models, in the background):
    choosing one fills the local file."""

    FOUND_COLUMNS = ("Model", "Where", "Size", "Quant", "Architecture", "Runs here")

    def __init__(self, wiz: "ModelWizard"):
        super().__init__(wiz)
        self.wiz = wiz
        self.setTitle("Choose a model")
        self.setSubTitle("Download a model from the Hugging Face hub, or convert one already on this computer.")
        self.hub_radio = QRadioButton("From the Hugging Face hub")
        self.local_radio = QRadioButton("From this computer: a Hugging Face folder or a GGUF file")
        self.hub_radio.setChecked(True)
        grp = QButtonGroup(self)
        grp.addButton(self.hub_radio)
        grp.addButton(self.local_radio)
        self.repo_edit = QLineEdit()
        self.repo_edit.setObjectName("repo")
        self.repo_edit.setPlaceholderText("owner/name, e.g. Qwen/Qwen3-30B-A3B, or a -GGUF repository")
        self.revision_edit = QLineEdit()
        self.revision_edit.setObjectName("revision")
        self.revision_edit.setPlaceholderText("main")
        self.revision_edit.setToolTip("Branch, tag or commit (default: main).")
        self.folder_edit = QLineEdit()
        self.folder_edit.setObjectName("folder")
        self.folder_edit.setPlaceholderText("folder with config.json and *.safetensors, or a .gguf file")
        self.browse = QPushButton("Browse…")
        self.browse.clicked.connect(self._browse)
        self.browse_file = QPushButton("GGUF file…")
        self.browse_file.setObjectName("browseGguf")
        self.browse_file.setToolTip("A .gguf model file (LM Studio, Ollama, a -GGUF repository); its expert "
                                    "blocks are imported as published, the file is only read.")
        self.browse_file.clicked.connect(self._browse_file)
        self.supported = QLabel(
            f"Supported mixture-of-experts families: {supported_families()} (GGUF architectures qwen3moe, "
            f"olmoe, qwen2moe, llama with experts, gpt-oss, deepseek2, glm4moe, qwen3next, dots1, ernie4_5-moe, "
            f"hunyuan-moe, minimax-m2). Other model types are "
            f"refused before anything is downloaded.")
        self.supported.setWordWrap(True)
        self.status = QLabel()
        self.status.setObjectName("sourceStatus")
        self.status.setWordWrap(True)
        self.url_note = QLabel()
        self.url_note.setObjectName("urlNote")
        self.url_note.setWordWrap(True)
        self.url_note.setVisible(False)
        self.next_reason = QLabel()
        self.next_reason.setObjectName("nextReason")
        self.next_reason.setAccessibleName("Why Next is disabled")
        self.next_reason.setWordWrap(True)
        # the GGUF models LM Studio, Ollama and the Hugging Face cache already hold
        self.found_label = QLabel("Looking for GGUF models already on this computer (LM Studio, Ollama, "
                                  "Hugging Face cache)…")
        self.found_label.setObjectName("foundLabel")
        self.found_label.setWordWrap(True)
        self.found_table = QTableWidget(0, len(self.FOUND_COLUMNS))
        self.found_table.setObjectName("foundModels")
        self.found_table.setHorizontalHeaderLabels(self.FOUND_COLUMNS)
        self.found_table.setSelectionBehavior(QTableWidget.SelectRows)
        self.found_table.setSelectionMode(QTableWidget.SingleSelection)
        self.found_table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.found_table.verticalHeader().setVisible(False)
        self.found_table.horizontalHeader().setStretchLastSection(True)
        self.found_table.itemSelectionChanged.connect(self._found_selected)
        self.found: list = []  # lib.FoundGGUF rows of found_table
        self.picked = None  # the FoundGGUF whose path is in folder_edit
        self.gguf_choice: str | None = None  # a -GGUF repository: the model chosen on the check page
        self.gguf_key: tuple | None = None  # ... for this input
        self.find_task: Task | None = None

        g = QGridLayout()
        g.addWidget(self.hub_radio, 0, 0, 1, 3)
        g.addWidget(QLabel("Repository"), 1, 0)
        g.addWidget(self.repo_edit, 1, 1, 1, 2)
        g.addWidget(self.url_note, 2, 1, 1, 2)
        g.addWidget(QLabel("Revision"), 3, 0)
        g.addWidget(self.revision_edit, 3, 1, 1, 2)
        g.addWidget(self.local_radio, 4, 0, 1, 3)
        g.addWidget(QLabel("Folder"), 5, 0)
        g.addWidget(self.folder_edit, 5, 1)
        g.addWidget(self.browse, 5, 2)
        g.addWidget(self.browse_file, 5, 3)
        lay = QVBoxLayout(self)
        lay.addLayout(g)
        lay.addWidget(self.supported)
        lay.addWidget(self.found_label)
        lay.addWidget(self.found_table, 1)
        lay.addWidget(self.status)
        lay.addWidget(self.next_reason)
        self.repo_edit.textChanged.connect(self._repo_edited)
        for w in (self.repo_edit, self.revision_edit, self.folder_edit):
            w.textChanged.connect(self._changed)
        self.hub_radio.toggled.connect(self._changed)
        self.task: Task | None = None
        self._advance = False
        self.refused: tuple | None = None  # the input a check refused (Next stays disabled for it)
        self._changed()

    def initializePage(self) -> None:
        if self.find_task is None and not self.found:
            ctx = self.wiz.context_length

            def fn(progress, cancel):
                return lib.find_gguf_models(context_length=ctx)
            self.find_task = run_task(fn, result=self._found_done, error=self._found_failed)

    @Slot(object)
    def _found_done(self, found) -> None:
        self.find_task = None
        self.found = list(found)
        fb = lib.format_bytes
        self.found_label.setText(
            f"GGUF models already on this computer ({len(found)}): choose one to import it (the file is only read)."
            if found else "No GGUF models found in LM Studio's or Ollama's folders or the Hugging Face cache.")
        self.found_table.setRowCount(len(found))
        for i, f in enumerate(found):
            runs = "yes" if f.runs else "no"
            cells = (f.name, f.where, fb(f.size), f.quant or "?", f.architecture or "?", runs)
            for j, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(f"{f.path}\n{f.message}")
                self.found_table.setItem(i, j, item)
        self.found_table.resizeColumnsToContents()

    @Slot(object)
    def _found_failed(self, f: EngineFailure) -> None:
        self.find_task = None
        self.found_label.setText(f"Could not look for GGUF models on this computer: {f.message}")

    @Slot()
    def _found_selected(self) -> None:
        rows = self.found_table.selectionModel().selectedRows()
        if not rows:
            return
        f = self.found[rows[0].row()]
        self.local_radio.setChecked(True)
        self.folder_edit.setText(f.path)
        self.picked = f
        self.status.setText(f.message if not f.runs else "")
        _error_style(self.status, RED if not f.runs else "")

    def key(self) -> tuple:
        if self.hub_radio.isChecked():
            return ("hub", self.repo_edit.text().strip(), self.revision_edit.text().strip())
        return ("local", self.folder_edit.text().strip())

    def next_blocker(self) -> str:
        """Why Next is disabled for the current input ("" when it is not): shown under the form."""
        if self.task is not None:
            return ""  # the status line says what is being checked
        k = self.key()
        if self.refused == k:
            return "Change the model to try again (the reason is above)."
        if k[0] == "hub":
            try:
                lib.parse_repo_id(k[1])
            except ValueError as e:
                return f"Next is disabled: {str(e)[0].upper()}{str(e)[1:]}."
            return ""
        if not k[1]:
            return "Next is disabled: choose the model's folder (Browse…)."
        p = Path(k[1]).expanduser()
        if not p.exists():
            return f"Next is disabled: the folder {p} does not exist."
        if not p.is_dir() and not lib.is_gguf_path(p):
            return (f"Next is disabled: {p} is a file, not a folder; choose the folder that holds config.json "
                    f"(or a .gguf file).")
        return ""

    @Slot()
    def _repo_edited(self, text: str) -> None:
        """A pasted hub address becomes its repository id (and its revision, when it names one)."""
        t = text.strip()
        self.url_note.setVisible(False)
        if not ("://" in t or t.lower().startswith(tuple(h + "/" for h in lib.HUB_HOSTS))):
            return
        try:
            repo, rev = lib.parse_repo_id(t)
        except ValueError:
            return
        self.repo_edit.blockSignals(True)
        self.repo_edit.setText(repo)
        self.repo_edit.blockSignals(False)
        if rev and not self.revision_edit.text().strip():
            self.revision_edit.setText(rev)
        self.url_note.setText(f"Taken from the address: {repo}" + (f" at revision {rev}" if rev else "") + ".")
        self.url_note.setVisible(True)
        self._changed()

    @Slot()
    def _changed(self, *_a) -> None:
        if self.gguf_key != self.key():  # another repository: its default GGUF again
            self.gguf_choice = self.gguf_key = None
        hub_mode = self.hub_radio.isChecked()
        for w in (self.repo_edit, self.revision_edit):
            w.setEnabled(hub_mode)
        self.folder_edit.setEnabled(not hub_mode)
        self.browse.setEnabled(not hub_mode)
        self.browse_file.setEnabled(not hub_mode)
        if self.task is None and self.refused != self.key():
            self.status.setText("")
            self.refused = None
        self._update_reason()
        self.completeChanged.emit()

    def _update_reason(self) -> None:
        why = self.next_blocker()
        self.next_reason.setText(why)
        _error_style(self.next_reason, ORANGE)
        self.next_reason.setVisible(bool(why))

    @Slot()
    def _browse(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "Model folder", self.folder_edit.text())
        if d:
            self.folder_edit.setText(d)

    @Slot()
    def _browse_file(self) -> None:
        f, _ = QFileDialog.getOpenFileName(self, "GGUF model file", self.folder_edit.text(), "GGUF models (*.gguf)")
        if f:
            self.folder_edit.setText(f)

    def isComplete(self) -> bool:
        if self.task is not None:
            return False
        k = self.key()
        if self.refused == k:  # the reason is shown in the status line; change the input to retry
            return False
        return not self.next_blocker()

    def validatePage(self) -> bool:
        # Next starts a fresh check; when it succeeds, _check_done presses Next again.
        if self._advance:
            self._advance = False
            return True
        if self.task is None:
            self.start_check()
        return False

    def start_check(self, extra_result: tuple = (), extra_error: tuple = ()) -> None:
        """Run lib.check_repo / lib.check_local in the background for the current input
        (``extra_result`` / ``extra_error``: more receivers of its outcome)."""
        key = self.key()
        self.refused = None
        ctx = self.wiz.context_length
        if key[0] == "hub":
            repo, rev = key[1], key[2] or None
            choice = self.gguf_choice if self.gguf_key == key else None

            def fn(progress, cancel):
                return lib.check_repo(repo, rev, "int8", ctx, gguf=choice)
            self.status.setText(f"Checking {repo} on the hub (config.json and the file list only)…")
        else:
            folder = key[1]
            picked = self.picked if self.picked is not None and self.picked.path == folder else None

            def fn(progress, cancel):
                if picked is not None:  # a found GGUF: under the name LM Studio / Ollama show
                    return lib.check_gguf(folder, ctx, name=picked.model_name)
                return lib.check_local(folder, "int8", ctx)
            self.status.setText(f"Checking {folder}…")
        _error_style(self.status, "")
        self.wiz.check = None
        # one receiver per outcome, which calls the others in order: receivers connected one by
        # one each got their own queued event, and the page could be seen (and used) between them
        # with the new check taken but the file table still the old one's
        self._then = (tuple(extra_result), tuple(extra_error))
        self.task = run_task(fn, result=[self._check_result], error=[self._check_error])
        self._update_reason()
        self.completeChanged.emit()

    @Slot(object)
    def _check_result(self, chk) -> None:
        self._check_done(chk)
        for receiver in self._then[0]:
            receiver(chk)

    @Slot(object)
    def _check_error(self, f: EngineFailure) -> None:
        self._check_failed(f)
        for receiver in self._then[1]:
            receiver(f)

    @Slot(object)
    def _check_done(self, chk) -> None:
        self.task = None
        self.wiz.check = chk
        self.status.setText("")
        self._update_reason()
        self.completeChanged.emit()
        if self.wiz.currentId() == PAGE_SOURCE:
            self._advance = True
            self.wiz.next()
            self._advance = False

    @Slot(object)
    def _check_failed(self, f: EngineFailure) -> None:
        self.task = None
        # unsupported model_type, GGUF-only folder, bad config.json; no tokenizer / broken template
        refused = f.kind in (ErrorKind.CONFIG, ErrorKind.TOKENIZER)
        if refused:
            self.refused = self.key()
        self.status.setText(f"Refused: {f.message}" if refused else f.message)
        _error_style(self.status, RED)
        self._update_reason()
        self.completeChanged.emit()

    def nextId(self) -> int:
        return PAGE_CHECK


class CheckPage(QWizardPage):
    """Files and sizes, disk needed for the download and the store vs free space on each
    target, RAM needed vs this machine; refuses (Next disabled) or warns."""

    def __init__(self, wiz: "ModelWizard"):
        super().__init__(wiz)
        self.wiz = wiz
        self.setTitle("Check")
        self.files = QTableWidget(0, 3)
        self.files.setHorizontalHeaderLabels(["File", "Size", "Status"])
        self.files.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.files.verticalHeader().hide()
        self.files.setEditTriggers(QTableWidget.NoEditTriggers)
        self.summary = QLabel()
        self.summary.setObjectName("checkSummary")
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.RichText)
        self.disk = QLabel()
        self.disk.setObjectName("diskVerdict")
        self.disk.setWordWrap(True)
        self.ram = QLabel()
        self.ram.setObjectName("ramVerdict")
        self.ram.setWordWrap(True)
        self.gguf_box = QComboBox()
        self.gguf_box.setObjectName("ggufFile")
        self.gguf_box.setToolTip("The repository's GGUF models by quant; only the chosen one is downloaded, its "
                                 "expert blocks imported as published.")
        self.gguf_box.activated.connect(self._gguf_chosen)
        self.gguf_label = QLabel("GGUF file")
        self.recheck = QPushButton("Check again")
        self.recheck.setToolTip("Measure free disk space and memory again (after freeing some).")
        self.recheck.clicked.connect(self._recheck)
        lay = QVBoxLayout(self)
        g = QHBoxLayout()
        g.addWidget(self.gguf_label)
        g.addWidget(self.gguf_box, 1)
        lay.addLayout(g)
        lay.addWidget(self.files, 1)
        lay.addWidget(self.summary)
        lay.addWidget(self.disk)
        lay.addWidget(self.ram)
        h = QHBoxLayout()
        h.addStretch(1)
        h.addWidget(self.recheck)
        lay.addLayout(h)

    def initializePage(self) -> None:
        self.show_check(self.wiz.check)

    def show_check(self, c: lib.RepoCheck | None) -> None:
        if c is None:
            return
        fb = lib.format_bytes
        a = c.args
        self.setSubTitle(f"{c.repo_id}" + (f" @ {c.commit[:12]}" if c.commit else "") +
                         f" — {describe_model(a)}")
        self.gguf_box.blockSignals(True)
        self.gguf_box.clear()
        self.gguf_box.addItems(list(c.gguf_choices))
        self.gguf_box.setCurrentText(c.gguf_file)
        self.gguf_box.blockSignals(False)
        for w in (self.gguf_box, self.gguf_label):
            w.setVisible(bool(c.gguf_choices))
        self.files.setRowCount(len(c.files))
        for i, f in enumerate(c.files):
            if c.source == "local":
                st = "local"
            elif f.present_bytes >= f.size:
                st = "present"
            elif f.present_bytes:
                st = f"{fb(f.present_bytes)} present"
            else:
                st = "to download"
            for j, v in enumerate((f.name, fb(f.size), st)):
                self.files.setItem(i, j, QTableWidgetItem(v))
        rows = []
        if c.source == "hub":
            rows.append(f"<b>Download</b>: {fb(c.download_missing)} to fetch ({fb(c.download_bytes)} in "
                        f"{len(c.files)} files; {len(c.ignored_files)} files not needed are skipped) into "
                        f"{c.download_dir} — <b>{fb(c.download_free)} free</b> there")
        rows.append(f"<b>Store</b> ({c.quant}): {fb(c.store_bytes)} in {Path(c.store_dir).parent} — "
                    f"<b>{fb(c.store_free)} free</b> there" +
                    (" (same disk as the download)" if c.same_disk else ""))
        rows.append("By quantization: " + "; ".join(
            f"{e.quant} store {fb(e.store_bytes)}, RAM ≥ {fb(e.ram_needed)}" for e in c.estimates))
        rows.append(f"<b>RAM</b>: needs ≥ {fb(c.estimate.ram_needed)} at {c.estimate.context_length} tokens of "
                    f"context; this machine has {fb(c.ram_total)} ({fb(c.ram_available)} available)")
        if c.tokenizer_message:
            rows.append(f"<b>Tokenizer</b>: {c.tokenizer_message}")
        if c.store_exists:
            rows.append(f"A converted store already exists at {c.store_dir}.")
        self.summary.setText("<br>".join(rows))
        self.disk.setText(("Disk: OK — " if c.disk_ok else "") + c.disk_message)
        _error_style(self.disk, GREEN if c.disk_ok else RED)
        verdict = {"ok": ("RAM: OK — ", GREEN), "warn": ("RAM warning — ", ORANGE),
                   "refuse": ("Refused — ", RED)}[c.ram_verdict]
        self.ram.setText(verdict[0] + c.ram_message)
        _error_style(self.ram, verdict[1])
        self.completeChanged.emit()

    def isComplete(self) -> bool:
        c = self.wiz.check
        return c is not None and c.ok and self.wiz.source_page.task is None

    @Slot()
    def _recheck(self) -> None:
        sp = self.wiz.source_page
        if sp.task is not None:
            return
        sp.start_check(extra_result=[self._rechecked], extra_error=[self._recheck_failed])
        self.disk.setText("Checking again…")
        self.completeChanged.emit()

    @Slot(int)
    def _gguf_chosen(self, _i: int) -> None:
        """Another GGUF model of the repository: checked (its header) as the first one was."""
        sp = self.wiz.source_page
        sp.gguf_choice, sp.gguf_key = self.gguf_box.currentText(), sp.key()
        self._recheck()

    @Slot(object)
    def _rechecked(self, c) -> None:
        self.show_check(c)

    @Slot(object)
    def _recheck_failed(self, f) -> None:
        self.disk.setText(f.message)
        _error_style(self.disk, RED)
        self.completeChanged.emit()

    def nextId(self) -> int:
        c = self.wiz.check
        return PAGE_DOWNLOAD if c is not None and c.source == "hub" else PAGE_CONVERT


class DownloadPage(QWizardPage):
    """Progress (bytes, speed, ETA), Cancel and Resume. Resuming continues from the bytes
    already on disk (engine.lib.download)."""

    def __init__(self, wiz: "ModelWizard"):
        super().__init__(wiz)
        self.wiz = wiz
        self.setTitle("Download")
        self.setSubTitle("Only the files the conversion needs are downloaded; each is verified against "
                         "the hub's checksum. An interrupted download resumes where it stopped.")
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bytes_label = QLabel()
        self.bytes_label.setObjectName("downloadBytes")
        self.detail = QLabel()
        self.detail.setObjectName("downloadDetail")
        self.detail.setWordWrap(True)
        self.status = QLabel()
        self.status.setObjectName("downloadStatus")
        self.status.setWordWrap(True)
        self.cancel_button = QPushButton("Cancel download")
        self.cancel_button.clicked.connect(self.cancel)
        self.resume_button = QPushButton("Resume")
        self.resume_button.clicked.connect(self.start)
        h = QHBoxLayout()
        h.addStretch(1)
        h.addWidget(self.cancel_button)
        h.addWidget(self.resume_button)
        lay = QVBoxLayout(self)
        lay.addWidget(self.bar)
        lay.addWidget(self.bytes_label)
        lay.addWidget(self.detail)
        lay.addWidget(self.status)
        lay.addStretch(1)
        lay.addLayout(h)
        self.task: Task | None = None
        self.finished_ok = False
        self._done_for = None

    def initializePage(self) -> None:
        c = self.wiz.check
        if self.finished_ok and self._done_for is c and self.wiz.source_dir and Path(self.wiz.source_dir).is_dir():
            return  # came back to this page: the same download is complete
        self.finished_ok = False
        self.start()

    def cleanupPage(self) -> None:  # Back pressed: stop the download, keep the bytes
        self.cancel()

    @Slot()
    def start(self) -> None:
        """Start (or resume) the download in the background."""
        c = self.wiz.check
        if self.task is not None or c is None:
            return
        repo, rev = c.repo_id, c.commit

        def fn(progress, cancel):
            return str(lib.download(repo, rev, c.download_dir, progress, cancel, check=c))
        self.status.setText("Downloading…")
        _error_style(self.status, "")
        self.task = run_task(fn, progress=self._progress, result=self._done, error=self._failed)
        self.cancel_button.setEnabled(True)
        self.resume_button.setEnabled(False)
        self.completeChanged.emit()

    @Slot()
    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.status.setText("Cancelling…")

    @Slot(object)
    def _progress(self, ev: LoadProgress) -> None:
        if ev.total:
            self.bar.setValue(int(1000 * ev.done / ev.total))
        self.bytes_label.setText(f"{lib.format_bytes(ev.done)} of {lib.format_bytes(ev.total)}")
        self.detail.setText(ev.message)

    @Slot(object)
    def _done(self, dest: str) -> None:
        self.task = None
        self.finished_ok = True
        self._done_for = self.wiz.check
        self.wiz.source_dir = dest
        self.bar.setValue(1000)
        self.status.setText(f"Downloaded and verified {len(self.wiz.check.files)} files into {dest}.")
        _error_style(self.status, GREEN)
        self.cancel_button.setEnabled(False)
        self.resume_button.setEnabled(False)
        self.completeChanged.emit()

    @Slot(object)
    def _failed(self, f: EngineFailure) -> None:
        self.task = None
        if f.kind == ErrorKind.CANCELLED:
            self.status.setText(f"Paused: {f.message.split(';')[0]}. Resume continues from the bytes already "
                                f"downloaded.")
            _error_style(self.status, ORANGE)
        else:
            self.status.setText(f"{f.message}")
            _error_style(self.status, RED)
        self.cancel_button.setEnabled(False)
        self.resume_button.setEnabled(True)
        self.completeChanged.emit()

    def isComplete(self) -> bool:
        return self.finished_ok and self.task is None

    def nextId(self) -> int:
        return PAGE_CONVERT


class ConvertPage(QWizardPage):
    """Quantization (int8 default / int4 / f16), progress by bytes and current tensor, Cancel
    (a cancelled conversion leaves nothing: the store is published atomically)."""

    def __init__(self, wiz: "ModelWizard"):
        super().__init__(wiz)
        self.wiz = wiz
        self.setTitle("Convert")
        self.setSubTitle("The checkpoint is converted into an expert store: one slab per expert, read "
                         "from the SSD on demand.")
        self.quant = QComboBox()
        self.quant.setObjectName("quant")
        self.quant.setToolTip("int8: per-row 8-bit (default, near-exact); int4: group-wise 4-bit (half the "
                              "size, slightly less exact); f16: exact half precision (largest).")
        self.quant.currentIndexChanged.connect(self._quant_changed)
        self.replace = QCheckBox("Replace the existing store (otherwise it is used as is)")
        self.replace.setObjectName("replace")
        self.replace.toggled.connect(self._quant_changed)
        self.delete_download = QCheckBox("Delete the downloaded files after converting")
        self.delete_download.setObjectName("deleteDownload")
        self.convert_button = QPushButton("Convert")
        self.convert_button.setObjectName("convertButton")
        self.convert_button.clicked.connect(self.start)
        self.cancel_button = QPushButton("Cancel conversion")
        self.cancel_button.clicked.connect(self.cancel)
        self.cancel_button.setEnabled(False)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bytes_label = QLabel()
        self.tensor_label = QLabel()
        self.tensor_label.setObjectName("currentTensor")
        self.status = QLabel()
        self.status.setObjectName("convertStatus")
        self.status.setWordWrap(True)
        form = QGridLayout()
        form.addWidget(QLabel("Quantization"), 0, 0)
        form.addWidget(self.quant, 0, 1)
        form.addWidget(self.replace, 1, 0, 1, 2)
        form.addWidget(self.delete_download, 2, 0, 1, 2)
        h = QHBoxLayout()
        h.addStretch(1)
        h.addWidget(self.convert_button)
        h.addWidget(self.cancel_button)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addLayout(h)
        lay.addWidget(self.bar)
        lay.addWidget(self.bytes_label)
        lay.addWidget(self.tensor_label)
        lay.addWidget(self.status)
        lay.addStretch(1)
        self.task: Task | None = None

    def initializePage(self) -> None:
        c = self.wiz.check
        self.quant.blockSignals(True)
        self.quant.clear()
        for e in c.estimates:
            label = "GGUF blocks as published" if e.quant == "gguf" else e.quant
            self.quant.addItem(f"{label} — store {lib.format_bytes(e.store_bytes)}, RAM ≥ "
                               f"{lib.format_bytes(e.ram_needed)}", e.quant)
        preferred = self.quant.findData(self.wiz.preferred_quant) if self.wiz.preferred_quant else -1
        self.quant.setCurrentIndex(max(0, preferred if preferred >= 0 else self.quant.findData("int8")))
        self.quant.blockSignals(False)
        if c.source == "local":
            self.wiz.source_dir = c.download_dir
        self.delete_download.setVisible(c.source == "hub")
        self.delete_download.setChecked(c.source == "hub")
        if c.source == "hub":
            self.delete_download.setText(f"Delete the downloaded files after converting (frees "
                                         f"{lib.format_bytes(c.download_bytes)})")
        self.wiz.store_path = None
        self.bar.setValue(0)
        self.bytes_label.setText("")
        self.tensor_label.setText("")
        self._quant_changed()

    def cleanupPage(self) -> None:
        self.cancel()

    def target(self) -> Path:
        return lib.models_dir() / lib.store_name(self.wiz.check.model_name, self.quant.currentData())

    @Slot()
    def _quant_changed(self, *_a) -> None:
        if self.task is not None or self.wiz.check is None:
            return
        target = self.target()
        exists = lib.looks_like_store(target)
        broken = lib.store_problem(target) if exists else None
        # a broken store is never offered for use: converting replaces it
        self.replace.setVisible(exists and not broken)
        self.convert_button.setText("Convert" if not exists or broken or self.replace.isChecked()
                                    else "Use existing store")
        if broken:
            self.status.setText(f"The store at {target} is broken ({broken}). Converting replaces it.")
        else:
            self.status.setText(f"A store already exists at {target}." if exists else "")
        _error_style(self.status, "")
        self.wiz.store_path = None
        self.completeChanged.emit()

    @Slot()
    def start(self) -> None:
        """Convert in the background (or take the existing store when not replacing it)."""
        if self.task is not None:
            return
        target = self.target()
        exists = lib.looks_like_store(target)
        broken = exists and lib.store_problem(target) is not None
        if exists and not broken and not self.replace.isChecked():
            self.wiz.store_path = str(target)
            self.wiz.converted_now = False
            self.status.setText(f"Using the existing store {target}.")
            _error_style(self.status, GREEN)
            self.completeChanged.emit()
            return
        src, quant = self.wiz.source_dir, self.quant.currentData()
        overwrite = self.replace.isChecked() or broken
        name = self.wiz.check.model_name
        delete_src = self.wiz.check.source == "hub" and self.delete_download.isChecked()
        # a -GGUF repository's download: its model is the (first) file downloaded
        hub_gguf = quant == "gguf" and self.wiz.check.source == "hub"
        model = Path(src) / self.wiz.check.files[0].name if hub_gguf else src

        # the download is deleted once the self-test passed (DonePage): a store that turns out
        # broken is removed, and the download is then what a retry converts again
        self.wiz.delete_after_test = src if delete_src else None

        def fn(progress, cancel):
            return str(lib.convert_downloaded(model, quant, progress, cancel, overwrite=overwrite, name=name))
        self.task = run_task(fn, progress=self._progress, result=self._done, error=self._failed)
        self.status.setText(f"Converting to {quant}…")
        _error_style(self.status, "")
        for w in (self.quant, self.replace, self.delete_download, self.convert_button):
            w.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.completeChanged.emit()

    @Slot()
    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.status.setText("Cancelling…")

    def _idle(self) -> None:
        self.task = None
        for w in (self.quant, self.replace, self.delete_download, self.convert_button):
            w.setEnabled(True)
        self.cancel_button.setEnabled(False)

    @Slot(object)
    def _progress(self, ev: LoadProgress) -> None:
        if ev.total:
            self.bar.setValue(int(1000 * ev.done / ev.total))
        self.bytes_label.setText(f"{lib.format_bytes(ev.done)} of {lib.format_bytes(ev.total)} of weights")
        self.tensor_label.setText(ev.message)

    @Slot(object)
    def _done(self, store: str) -> None:
        self._idle()
        self.wiz.store_path = store
        self.wiz.converted_now = True
        self.bar.setValue(1000)
        self.status.setText(f"Converted into {store}.")
        _error_style(self.status, GREEN)
        self.completeChanged.emit()

    @Slot(object)
    def _failed(self, f: EngineFailure) -> None:
        self._idle()
        self.bar.setValue(0)
        if f.kind == ErrorKind.CANCELLED:
            self.status.setText("Conversion cancelled; nothing was written.")
            _error_style(self.status, ORANGE)
        else:
            self.status.setText(f.message)
            _error_style(self.status, RED)
        self.completeChanged.emit()

    def isComplete(self) -> bool:
        return self.wiz.store_path is not None and self.task is None

    def nextId(self) -> int:
        return PAGE_DONE


class DonePage(QWizardPage):
    """Self-test (8 greedy tokens from the new store); Finish emits model_ready."""

    def __init__(self, wiz: "ModelWizard"):
        super().__init__(wiz)
        self.wiz = wiz
        self.setTitle("Done")
        self.info = QLabel()
        self.info.setObjectName("doneInfo")
        self.info.setWordWrap(True)
        self.output = QPlainTextEdit()
        self.output.setObjectName("selfTestOutput")
        self.output.setReadOnly(True)
        self.open_folder = QPushButton("Open folder")
        self.open_folder.clicked.connect(self._open_folder)
        lay = QVBoxLayout(self)
        lay.addWidget(self.info)
        lay.addWidget(QLabel("Self-test output (8 tokens, greedy):"))
        lay.addWidget(self.output, 1)
        h = QHBoxLayout()
        h.addStretch(1)
        h.addWidget(self.open_folder)
        lay.addLayout(h)
        self.task: Task | None = None
        self.passed = False
        self.tested = False

    def initializePage(self) -> None:
        self.passed = self.tested = False
        store = self.wiz.store_path
        self.info.setText(f"Testing {store}…")
        _error_style(self.info, "")
        self.output.setPlainText("")

        delete_src = self.wiz.delete_after_test if self.wiz.converted_now else None

        def fn(progress, cancel):
            text = lib.self_test(store)
            if delete_src:   # the store works: the downloaded files are no longer needed
                try:
                    lib.delete_download(delete_src)
                except (OSError, ValueError):
                    pass
            return text
        self.task = run_task(fn, result=self._done, error=self._failed)
        self.completeChanged.emit()

    @Slot(object)
    def _done(self, text: str) -> None:
        self.task = None
        self.passed = self.tested = True
        self.output.setPlainText(text)
        self.info.setText(f"The model works. Store: {self.wiz.store_path}. Press Finish to use it.")
        _error_style(self.info, GREEN)
        self.completeChanged.emit()

    @Slot(object)
    def _failed(self, f: EngineFailure) -> None:
        """The store does not run: remove it from disk (and so from the library) when this
        wizard converted it (not for a RAM shortfall: the store may be fine), keep Finish ("Use
        this model") disabled, and say why and what to do."""
        self.task = None
        self.tested = True
        store = self.wiz.store_path
        removed = ""
        if f.kind == ErrorKind.BUDGET:   # the store may be fine; this machine lacks the RAM now
            removed = " The store was kept: free some memory, then open it from File › Models…."
        elif not lib.self_test_says_broken(f.kind):  # a cancel, a disk error, a bug: not the store's fault
            removed = " The store was kept: open it from File › Models… once that is solved."
        elif store and self.wiz.converted_now:
            try:
                lib.delete_model(store)
                removed = " The broken store was removed."
            except (OSError, ValueError) as e:
                removed = f" The store could not be removed ({error_text(e)}); delete it in File › Models…."
        elif store:   # a store made earlier ("Use existing store"): the user decides
            removed = " The store existed before this wizard; delete it in File › Models… if it stays broken."
        self.wiz.store_path = None
        self.output.setPlainText(f.message)
        self.info.setText(f"The self-test failed: {f.message}.{removed} “Use this model” is disabled: "
                          f"Cancel, then add the model again (another quantization or a fresh download).")
        _error_style(self.info, RED)
        self.completeChanged.emit()

    @Slot()
    def _open_folder(self) -> None:
        if self.wiz.store_path:
            QDesktopServices.openUrl(QUrl.fromLocalFile(self.wiz.store_path))

    def isComplete(self) -> bool:
        return self.passed and self.task is None

    def nextId(self) -> int:
        return -1


class ModelWizard(QWizard):
    """Add a model: [Recommended ->] Source -> Check -> Download (hub only) -> Convert -> Done
    (``recommendations``: start on the list of models sized for this computer).

    Signals:
        model_ready(str): the converted store path; emitted on Finish when the self-test passed.
    Attributes (for the pages and tests): check (RepoCheck), source_dir (HF folder),
        store_path (converted store), context_length (tokens the RAM estimate assumes).
    """

    model_ready = Signal(str)

    def __init__(self, parent: QWidget | None = None, context_length: int | None = None,
                 recommendations: bool = False):
        super().__init__(parent)
        self.setWindowTitle("Add a model")
        self.setOption(QWizard.NoBackButtonOnLastPage, True)
        self.setOption(QWizard.IndependentPages, False)
        if context_length is None:
            settings = getattr(parent, "settings", None)
            context_length = getattr(getattr(settings, "engine", None), "context_length", 0) or 0
        self.context_length = int(context_length)
        self.check: lib.RepoCheck | None = None
        self.source_dir: str | None = None
        self.store_path: str | None = None
        self.converted_now = False   # store_path was converted by this wizard (not an existing one)
        self.delete_after_test: str | None = None  # the download to delete once the self-test passed
        self.preferred_quant: str | None = None  # the quantization a recommendation suggests
        self.recommended_page = RecommendedPage(self)
        self.source_page = SourcePage(self)
        self.check_page = CheckPage(self)
        self.download_page = DownloadPage(self)
        self.convert_page = ConvertPage(self)
        self.done_page = DonePage(self)
        for pid, page in ((PAGE_SOURCE, self.source_page), (PAGE_CHECK, self.check_page),
                          (PAGE_DOWNLOAD, self.download_page), (PAGE_CONVERT, self.convert_page),
                          (PAGE_DONE, self.done_page), (PAGE_RECOMMENDED, self.recommended_page)):
            self.setPage(pid, page)
        self.setStartId(PAGE_RECOMMENDED if recommendations else PAGE_SOURCE)
        self.setButtonText(QWizard.FinishButton, "Use this model")
        self.resize(760, 560)

    def tasks(self) -> list[Task]:
        return [t for t in (self.source_page.task, self.source_page.find_task, self.download_page.task,
                            self.convert_page.task,
                            self.done_page.task, self.recommended_page.disk_task) if t is not None]

    def accept(self) -> None:
        if self.done_page.passed and self.store_path:
            self.model_ready.emit(self.store_path)
        super().accept()

    def done(self, result: int) -> None:
        # Closing: cancel background work. A download / conversion stops within one network
        # chunk or tensor; the tasks are waited for briefly, and otherwise end on their own
        # (the lane's threads need nothing from this window; shutdown_all joins them at exit).
        for t in self.tasks():
            t.cancel()
        for t in self.tasks():
            t.wait(2.0)
        super().done(result)
