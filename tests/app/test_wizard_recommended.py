"""The wizard's "Recommended for this computer" page: the catalog sized for this machine's
memory (here 16 GB, given), recommended models first and in bold, and a chosen one leads into
the usual hub check with its repository and quantization filled in."""

from __future__ import annotations

import os
import threading

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtWidgets import QWizard  # noqa: E402

import engine.library as lib  # noqa: E402
from colibri_app import wizard as wz  # noqa: E402

GB = 10 ** 9
DISK_SPEED = {"bytes": 0}  # bytes the stand-in disk test reads in one second (0: not measured)


@pytest.fixture
def rec_wizard(qtbot, monkeypatch, app_dirs):
    from colibri_app import workers
    monkeypatch.setattr(lib, "machine_ram", lambda: (16 * GB, 12 * GB))
    measured = threading.Event()  # the disk test waits for the test to let it finish

    def disk(folder, files=()):
        measured.wait(600)
        return lib.DiskSpeed(DISK_SPEED["bytes"], 1.0 if DISK_SPEED["bytes"] else 0.0, "O_DIRECT", str(folder))
    monkeypatch.setattr(lib, "disk_read_speed", disk)
    w = wz.ModelWizard(None, context_length=0, recommendations=True)
    qtbot.addWidget(w)
    w.resize(1000, 640)
    w.show()
    w.measured = measured
    yield w
    measured.set()
    w.reject()
    assert workers.shutdown_all(30)


def test_the_page_lists_the_catalog_sized_for_this_machine(rec_wizard):
    w = rec_wizard
    assert w.currentId() == wz.PAGE_RECOMMENDED
    p = w.recommended_page
    expected = lib.recommend(16 * GB, 12 * GB)
    assert p.table.rowCount() == len(lib.CATALOG) == len(expected)
    assert "16.00 GB of RAM" in p.machine.text() and "assumed" in p.machine.text()
    for i, r in enumerate(expected):
        cells = [p.table.item(i, j).text() for j in range(p.table.columnCount())]
        assert cells[0] == r.model.name and cells[1] == r.take
        assert cells[2] == lib.format_bytes(r.download_bytes) and cells[3] == lib.format_bytes(r.estimate.store_bytes)
        assert cells[4] == lib.format_bytes(r.budget_bytes)
        assert p.table.item(i, 0).font().bold() == r.recommended
        assert (cells[7] == "recommended") == r.recommended
    assert p.table.item(0, 7).text() == "recommended"


def test_choosing_a_model_fills_the_hub_source_and_its_quantization(qtbot, rec_wizard):
    w = rec_wizard
    p = w.recommended_page
    row = next(i for i, r in enumerate(p.rows) if r.model.repo_id == "openai/gpt-oss-20b")
    p.table.selectRow(row)
    assert "openai/gpt-oss-20b" in p.detail.text() and p.rows[row].quant in p.detail.text()
    w.next()
    assert w.currentId() == wz.PAGE_SOURCE
    assert w.source_page.hub_radio.isChecked() and w.source_page.repo_edit.text() == "openai/gpt-oss-20b"
    assert w.preferred_quant == p.rows[row].quant == "int4" and w.source_page.gguf_choice is None
    w.back()
    # where the GGUF is the smaller download: its -GGUF repository, and that file for the check
    row = next(i for i, r in enumerate(p.rows) if r.model.repo_id == "Qwen/Qwen3-30B-A3B")
    p.table.selectRow(row)
    assert "Qwen/Qwen3-30B-A3B-GGUF" in p.detail.text() and "Q4_K_M" in p.detail.text()
    assert p.table.item(row, 1).text() == "GGUF Q4_K_M"
    w.next()
    sp = w.source_page
    assert sp.repo_edit.text() == "Qwen/Qwen3-30B-A3B-GGUF" and w.preferred_quant == "gguf"
    assert sp.gguf_choice == "Q4_K_M" and sp.gguf_key == sp.key()
    w.back()
    # a slow disk and RAM for the int4 store only: the safetensors, and the page says why not the GGUF
    p.show_for(24 * GB, 22 * GB, 0.2e9)
    row = next(i for i, r in enumerate(p.rows) if r.model.repo_id == "Qwen/Qwen3-30B-A3B")
    p.table.selectRow(row)
    assert p.table.item(row, 1).text() == "int4"
    assert "Its GGUF Q4_K_M (Qwen/Qwen3-30B-A3B-GGUF) is the smaller download" in p.detail.text()
    w.next()
    assert w.source_page.repo_edit.text() == "Qwen/Qwen3-30B-A3B" and w.source_page.gguf_choice is None
    w.back()
    p.table.clearSelection()
    w.source_page.repo_edit.setText("")
    w.next()  # no choice: the source page, empty, for any repository or folder
    assert w.currentId() == wz.PAGE_SOURCE and w.source_page.repo_edit.text() == ""
    assert w.button(QWizard.BackButton).isEnabled()


def test_the_wizard_opened_from_the_window_starts_on_the_recommendations(monkeypatch, make_window, qtbot):
    win = make_window(wait_loaded=False)
    shown = []
    monkeypatch.setattr(win, "_show_dialog", lambda dlg: shown.append(dlg))
    win.open_wizard()
    assert shown and shown[0].startId() == wz.PAGE_RECOMMENDED
    shown[0].deleteLater()


def test_the_disk_speed_is_measured_and_said(qtbot, rec_wizard, monkeypatch):
    monkeypatch.setitem(DISK_SPEED, "bytes", 400_000_000)
    p = rec_wizard.recommended_page
    assert "measuring" in p.machine.text()
    row = next(i for i, r in enumerate(p.rows) if r.model.repo_id == "Qwen/Qwen3-30B-A3B")
    p.table.selectRow(row)
    rec_wizard.measured.set()
    qtbot.waitUntil(lambda: "0.4 GB/s (measured on the models folder)" in p.machine.text(), timeout=1_800_000)
    assert p.rows == lib.recommend(16 * GB, 12 * GB, 400_000_000)
    assert all(r.disk_measured and r.disk_bytes_per_s == 400_000_000 for r in p.rows)
    assert p.chosen().model.repo_id == "Qwen/Qwen3-30B-A3B"  # the choice survives the refill


@pytest.mark.parametrize("ram_gb", [8, 16, 32, 64])
def test_each_machine_size_gets_the_sizing_modules_numbers(qtbot, monkeypatch, app_dirs, ram_gb):
    """The page on an 8, 16, 32 and 64 GB machine (memory given, 80% of it available): each
    row's download, store, RAM budget, experts in RAM and verdict are the sizing module's own
    numbers for that model and quantization, recommended rows first."""
    from engine import sizing
    from colibri_app import workers
    total, available = ram_gb * GB, int(ram_gb * GB * 0.8)
    monkeypatch.setattr(lib, "machine_ram", lambda: (total, available))
    measured = threading.Event()
    monkeypatch.setattr(lib, "disk_read_speed", lambda folder, files=(): measured.wait(600) and lib.DiskSpeed(
        0, 0.0, "O_DIRECT", str(folder)))  # not measured: the assumed disk
    w = wz.ModelWizard(None, context_length=0, recommendations=True)
    qtbot.addWidget(w)
    w.show()  # the page fills its table when shown
    try:
        p = w.recommended_page
        assert f"{lib.format_bytes(total)} of RAM" in p.machine.text()
        assert p.table.rowCount() == len(lib.CATALOG)
        flags = []
        for i in range(p.table.rowCount()):
            cells = [p.table.item(i, j).text() for j in range(p.table.columnCount())]
            m = next(c for c in lib.CATALOG if c.name == cells[0])
            a, take = m.args(), cells[1]
            if take.startswith("GGUF "):  # the -GGUF repository's file: sizing.estimate_gguf's numbers
                assert m.gguf and take == f"GGUF {m.gguf[1]}"
                g = sizing.estimate_gguf(a, m.gguf[1], 0)
                est, download = g.estimate, g.download_bytes
                assert download < sizing.estimate(a, m.published, 0).store_bytes
            else:
                est, download = sizing.estimate(a, take, 0), sizing.estimate(a, m.published, 0).store_bytes
            assert cells[2] == lib.format_bytes(download)
            assert cells[3] == lib.format_bytes(est.store_bytes)
            verdict = sizing.ram_verdict(est, a.num_experts_per_tok, total, available)[0]
            try:
                plan = sizing.plan_before_open(est, available)
            except sizing.BudgetError:
                assert cells[4] == "—" and cells[5] == "none" and cells[7] != "recommended", cells
                flags.append(False)
                continue
            assert cells[4] == lib.format_bytes(min(plan.budget, est.all_in_ram_bytes))
            assert cells[5] == f"{plan.slots // plan.layers} of {a.num_experts} per layer"
            if verdict == "refuse":
                assert cells[7] == "not enough RAM"
            flags.append(cells[7] == "recommended")
        assert any(flags) and flags == sorted(flags, reverse=True), flags  # recommended rows first
        assert any(p.table.item(i, 1).text().startswith("GGUF ") for i in range(p.table.rowCount()))
    finally:
        measured.set()
        w.reject()
        assert workers.shutdown_all(30)


def test_every_column_shows_whole_at_the_first_size(qtbot, monkeypatch, app_dirs):
    """Opened at its first size on a 1400 × 900 desktop, the page shows every column whole
    (the speed and the verdict were behind a scroll bar), and the wizard stays on the screen."""
    from PySide6.QtCore import QRect
    from colibri_app import workers

    class Screen:
        def availableGeometry(self):  # noqa: N802 - Qt's name
            return QRect(0, 0, 1400, 900)
    monkeypatch.setattr(wz.RecommendedPage, "screen", lambda self: Screen())
    monkeypatch.setattr(wz.ModelWizard, "screen", lambda self: Screen())
    monkeypatch.setattr(lib, "machine_ram", lambda: (16 * GB, 12 * GB))
    measured = threading.Event()
    monkeypatch.setattr(lib, "disk_read_speed", lambda folder, files=(): measured.wait(600) and lib.DiskSpeed(
        0, 0.0, "O_DIRECT", str(folder)))
    w = wz.ModelWizard(None, context_length=0, recommendations=True)
    qtbot.addWidget(w)
    w.show()
    t = w.recommended_page.table
    qtbot.waitExposed(w)
    widths = [(t.columnWidth(j), t.sizeHintForColumn(j)) for j in range(t.columnCount())]
    assert all(shown >= need - 1 for shown, need in widths), widths
    assert w.frameGeometry().right() < 1400
    for i, r in enumerate(w.recommended_page.rows):  # the speed column reads as the page's own format
        assert t.item(i, 6).text() == wz.speed_range(*r.tokens_per_s)
    measured.set()
    w.reject()
    assert workers.shutdown_all(30)


def test_a_speed_range_keeps_its_digits_below_one_token_per_second():
    assert wz.speed_range(7.4475, 25.818) == "7.4–25.8 tok/s"
    assert wz.speed_range(0.1508, 0.2007) == "0.15–0.20 tok/s"   # not "0.2–0.2"
    assert wz.speed_range(0.8172, 1.1352) == "0.82–1.1 tok/s"
    assert wz.speed_range(0.0501, 0.0499) == "0.05 tok/s"
