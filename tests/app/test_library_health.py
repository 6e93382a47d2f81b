"""The app's model library shows broken stores: a store with a
half-written manifest or a truncated expert file is a "Broken" row whose status line names the
file and says to re-convert or delete; it cannot be set as current, and it can be deleted."""

from __future__ import annotations

import json
import os
import shutil

from PySide6.QtWidgets import QMessageBox

from engine import library as lib
from colibri_app.library import STATUS_COLUMN, ModelLibraryDialog

T = 300_000  # ms: only a hang trips it


def test_library_lists_broken_stores_with_reason_and_remedy(qtbot, app_dirs, app_store, monkeypatch):
    models = lib.models_dir()
    good = models / "good-int8"
    shutil.copytree(app_store, good)
    half = models / "half-int8"
    shutil.copytree(app_store, half)
    text = (half / "manifest.json").read_text()
    (half / "manifest.json").write_text(text[: len(text) // 2])
    short = models / "short-int8"
    shutil.copytree(app_store, short)
    f = short / "experts" / "layer_000.bin"
    os.truncate(f, f.stat().st_size // 2)

    d = ModelLibraryDialog(None, None)
    qtbot.addWidget(d)
    d.show()
    qtbot.waitUntil(lambda: not d.busy and d.table.rowCount() == 3, timeout=T)
    rows = {d.entries[i].path: i for i in range(3)}
    assert d.table.item(rows[str(good)], STATUS_COLUMN).text() == "OK"
    for st, bad in ((half, half / "manifest.json"), (short, f)):
        i = rows[str(st)]
        assert d.table.item(i, STATUS_COLUMN).text() == "Broken"
        assert str(bad) in d.table.item(i, 0).toolTip()
        d.table.selectRow(i)
        assert d.status.text().startswith("Broken: ") and str(bad) in d.status.text()
        assert "Re-convert" in d.status.text() and "delete" in d.status.text()
        assert not d.set_button.isEnabled() and d.delete_button.isEnabled()
        d.set_current()                       # a double-click does not make it current either
        assert d.current is None
    if os.environ.get("COLIBRI_SHOTS_DIR"):
        qtbot.wait(100)   # the status line's new height is laid out
        d.grab().save(os.path.join(os.environ["COLIBRI_SHOTS_DIR"], "library-broken.png"))
    d.table.selectRow(rows[str(good)])
    assert not d.status.text().startswith("Broken") and d.set_button.isEnabled()
    d.table.selectRow(rows[str(half)])
    monkeypatch.setattr(QMessageBox, "question", staticmethod(lambda *x, **k: QMessageBox.Yes))
    d.delete_button.click()
    qtbot.waitUntil(lambda: not d.busy and d.table.rowCount() == 2, timeout=T)
    assert not half.exists() and good.exists() and short.exists()
    assert json.loads((good / "manifest.json").read_text())["quant"] == "int8"


def test_wizard_never_offers_a_broken_store_as_existing(qtbot, app_dirs, tmp_path_factory, wizard_dialog):
    """Before: a store folder at the target with a truncated expert file was "Use existing
    store" and became the current model. Now the page says it is broken and converting
    replaces it with a healthy store."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import hubserver
    from colibri_app import wizard as wz
    from engine.expert_store import store_problem
    tiny = hubserver.tiny_checkpoint(tmp_path_factory.mktemp("ckpt-broken"))
    target = lib.models_dir() / lib.store_name(tiny.name, "int8")
    lib.convert_downloaded(tiny, "int8")
    f = target / "experts" / "layer_000.bin"
    os.truncate(f, f.stat().st_size // 2)
    w = wizard_dialog
    w.source_page.local_radio.setChecked(True)
    w.source_page.folder_edit.setText(str(tiny))
    w.next()
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
    w.next()
    cp = w.convert_page
    assert w.currentId() == wz.PAGE_CONVERT
    assert "is broken" in cp.status.text() and str(f) in cp.status.text(), cp.status.text()
    assert cp.convert_button.text() == "Convert" and not cp.replace.isVisibleTo(cp)
    cp.convert_button.click()
    qtbot.waitUntil(cp.isComplete, timeout=T)
    assert w.store_path == str(target) and store_problem(target) is None
