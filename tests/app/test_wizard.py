"""The model wizard driven from a repo id to a converted, working model on a local fake hub;
refusals (unsupported model, disk), cancel + resume, cancelled conversion; the library."""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections import namedtuple
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hubserver  # noqa: E402

from PySide6.QtWidgets import QMessageBox, QWizard  # noqa: E402

from engine import Engine, EngineConfig, Finished, GenerateRequest, SamplingParams  # noqa: E402
from engine import library as hub  # noqa: E402
from engine import library as paths  # noqa: E402
from colibri_app import wizard as wz  # noqa: E402
from colibri_app.library import ModelLibraryDialog  # noqa: E402

REPO = hubserver.TINY_REPO
WEIGHTS = "model.safetensors"
T = 300_000  # ms: only a hang trips it


def _enter_repo(qtbot, w, repo=REPO):
    w.source_page.repo_edit.setText(repo)
    assert w.source_page.isComplete()
    w.next()


def _to_check(qtbot, w, repo=REPO):
    _enter_repo(qtbot, w, repo)
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)


def test_wizard_repo_to_working_model(qtbot, wizard, fake):
    w = wizard
    _to_check(qtbot, w)
    c = w.check
    assert c.ok and c.repo_id == REPO
    assert w.check_page.files.rowCount() == len(c.files)
    assert "free" in w.check_page.summary.text() and "RAM" in w.check_page.summary.text()
    assert w.check_page.isComplete()
    w.next()
    assert w.currentId() == wz.PAGE_DOWNLOAD
    qtbot.waitUntil(w.download_page.isComplete, timeout=T)
    assert w.download_page.bar.value() == 1000 and "of" in w.download_page.bytes_label.text()
    w.next()
    assert w.currentId() == wz.PAGE_CONVERT
    cp = w.convert_page
    assert cp.quant.currentData() == "int8" and [cp.quant.itemData(i) for i in range(cp.quant.count())] == \
        ["int8", "int4", "f16"]
    cp.convert_button.click()
    qtbot.waitUntil(cp.isComplete, timeout=T)
    assert "Converted" in cp.status.text() and cp.tensor_label.text()
    assert (hub.download_dir_for(REPO) / WEIGHTS).exists()  # kept until the store passed its self-test
    w.next()
    assert w.currentId() == wz.PAGE_DONE
    qtbot.waitUntil(w.done_page.isComplete, timeout=T)
    assert not hub.download_dir_for(REPO).exists()  # "delete the downloaded files" is on by default
    assert w.done_page.passed, w.done_page.info.text()
    with qtbot.waitSignal(w.model_ready, timeout=T) as sig:
        w.button(QWizard.FinishButton).click()
    store = sig.args[0]
    assert store == str(paths.models_dir() / "tiny-olmoe-int8")
    with Engine.open(EngineConfig(store=store, context_length=128, history=False)) as eng:
        evs = list(eng.generate(GenerateRequest(prompt="Hello", sampling=SamplingParams(max_new_tokens=4))))
    fin = evs[-1]
    assert isinstance(fin, Finished) and fin.finish_reason in ("length", "stop") and fin.generated_tokens >= 1


def test_a_store_that_fails_its_self_test_leaves_the_download_for_a_retry(qtbot, wizard, fake):
    """"Delete the downloaded files" waits for the self-test: the broken store is removed, the
    download (hours of it, for a large model) is not."""
    w = wizard
    _to_check(qtbot, w)
    w.next()
    qtbot.waitUntil(w.download_page.isComplete, timeout=T)
    w.next()
    cp = w.convert_page
    assert cp.delete_download.isChecked()
    cp.convert_button.click()
    qtbot.waitUntil(cp.isComplete, timeout=T)
    store = Path(w.store_path)
    (store / "tokenizer.json").write_text("{ not json", encoding="utf-8")  # it breaks: the test fails for real
    w.next()
    qtbot.waitUntil(lambda: w.done_page.tested, timeout=T)
    assert not w.done_page.passed and not store.exists()
    assert (hub.download_dir_for(REPO) / WEIGHTS).exists()


def test_unsupported_model_refused_on_source_page(qtbot, wizard, fake, tmp_path, tiny):
    import json
    other = tmp_path / "llama"
    shutil.copytree(tiny, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = "llama"
    (other / "config.json").write_text(json.dumps(cfg))
    fake.add_folder("meta/tiny", other)
    w = wizard
    _enter_repo(qtbot, w, "meta/tiny")
    qtbot.waitUntil(lambda: "Refused" in w.source_page.status.text(), timeout=T)
    text = w.source_page.status.text()
    assert "'llama'" in text and all(f in text for f in ("olmoe", "qwen3_moe", "mixtral", "qwen2_moe"))
    assert not w.source_page.isComplete()
    assert w.currentId() == wz.PAGE_SOURCE and w.check is None
    assert fake.weight_requests() == []


def test_disk_shortfall_blocks_check_page(qtbot, wizard, fake, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    free = [100_000]
    monkeypatch.setattr("engine.library.paths.shutil.disk_usage", lambda p: Usage(10**12, 10**12 - free[0], free[0]))
    w = wizard
    _to_check(qtbot, w)
    assert not w.check_page.isComplete()
    assert "Not enough disk space" in w.check_page.disk.text() and "100.0 kB free" in w.check_page.disk.text()
    free[0] = 10**11  # space freed: "Check again" unblocks
    w.check_page.recheck.click()
    qtbot.waitUntil(w.check_page.isComplete, timeout=T)


def test_download_cancel_and_resume(qtbot, wizard, fake):
    size = len(fake.repos[REPO].files[WEIGHTS])
    fake.slow[WEIGHTS] = (100_000, 0.02)
    w = wizard
    _to_check(qtbot, w)
    w.next()
    dp = w.download_page
    others = w.check.download_bytes - size
    qtbot.waitUntil(lambda: dp.bar.value() >= int(1000 * (others + 100_000) / w.check.download_bytes),
                    timeout=T)
    assert "ETA" in dp.detail.text() or "starting" in dp.detail.text()
    dp.cancel_button.click()
    qtbot.waitUntil(lambda: dp.resume_button.isEnabled(), timeout=T)
    assert "Paused" in dp.status.text() and not dp.isComplete()
    part = next((hub.download_dir_for(REPO) / hub.PARTIAL_DIR).glob("*.part"))
    on_disk = part.stat().st_size
    assert 0 < on_disk < size
    fake.slow.clear()
    dp.resume_button.click()
    qtbot.waitUntil(dp.isComplete, timeout=T)
    assert fake.gets(WEIGHTS)[-1] == on_disk
    assert (hub.download_dir_for(REPO) / WEIGHTS).read_bytes() == fake.repos[REPO].files[WEIGHTS]


def test_convert_cancel_leaves_nothing(qtbot, wizard, fake, monkeypatch):
    w = wizard
    _to_check(qtbot, w)
    w.next()
    qtbot.waitUntil(w.download_page.isComplete, timeout=T)
    w.next()
    cp = w.convert_page
    # make the conversion slow enough to cancel: pause in the progress callback
    real = hub.convert_downloaded
    started = threading.Event()

    def slow_convert(src, quant, progress, cancel, **kw):
        def p(ev):
            started.set()
            cancel.wait(600)   # until the Cancel button: only a hang waits it out
            progress(ev)
        return real(src, quant, p, cancel, **kw)
    monkeypatch.setattr(hub, "convert_downloaded", slow_convert)
    cp.quant.setCurrentIndex(cp.quant.findData("int4"))
    cp.convert_button.click()
    assert started.wait(600)
    cp.cancel_button.click()
    qtbot.waitUntil(lambda: "cancelled" in cp.status.text(), timeout=T)
    assert not cp.isComplete()
    assert hub.list_models() == [] and list(paths.models_dir().iterdir()) == []
    assert (hub.download_dir_for(REPO) / WEIGHTS).exists()  # the download is kept for a retry
    monkeypatch.setattr(hub, "convert_downloaded", real)
    cp.convert_button.click()
    qtbot.waitUntil(cp.isComplete, timeout=T)
    assert Path(w.store_path).name == "tiny-olmoe-int4"


def test_local_folder_source_skips_download(qtbot, wizard, tiny, tmp_path):
    w = wizard
    w.source_page.local_radio.setChecked(True)
    w.source_page.folder_edit.setText(str(tiny))
    w.next()
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
    assert w.check.source == "local" and w.check_page.nextId() == wz.PAGE_CONVERT
    w.next()
    assert w.currentId() == wz.PAGE_CONVERT
    assert not w.convert_page.delete_download.isVisibleTo(w.convert_page)
    w.convert_page.convert_button.click()
    qtbot.waitUntil(w.convert_page.isComplete, timeout=T)
    assert tiny.exists() and (tiny / WEIGHTS).exists()  # a local source is never deleted


def test_library_set_current_delete_open(qtbot, fake, monkeypatch, tiny):
    a = hub.convert_downloaded(tiny, "int8")
    b = hub.convert_downloaded(tiny, "int4")
    d = ModelLibraryDialog(str(a), None)
    qtbot.addWidget(d)
    qtbot.waitUntil(lambda: not d.busy and d.table.rowCount() == 2, timeout=T)   # scanned off the GUI thread
    names = {d.table.item(i, 2).text() for i in range(2)}
    assert names == {"int8", "int4"}
    assert any("(current)" in d.table.item(i, 0).text() for i in range(2))
    d.select_path(str(b))
    with qtbot.waitSignal(d.current_changed) as sig:
        d.set_button.click()
    assert sig.args == [str(b)]
    opened = []
    monkeypatch.setattr("colibri_app.library.QDesktopServices.openUrl", lambda url: opened.append(url))
    d.open_button.click()
    assert opened and opened[0].toLocalFile() == str(b)
    # the current model cannot be deleted
    d.delete_button.click()
    assert b.exists() and "current model" in d.status.text()
    # deleting another one asks first
    d.select_path(str(a))
    monkeypatch.setattr(QMessageBox, "question", staticmethod(lambda *x, **k: QMessageBox.No))
    d.delete_button.click()
    assert a.exists()
    monkeypatch.setattr(QMessageBox, "question", staticmethod(lambda *x, **k: QMessageBox.Yes))
    d.delete_button.click()
    qtbot.waitUntil(lambda: not d.busy, timeout=T)
    assert not a.exists() and d.table.rowCount() == 1 and "Deleted" in d.status.text()
