"""The wizard takes a -GGUF repository of the hub (tests/hubserver.py): the check page lists its
models by quant with the default chosen, another choice is checked from its header, and only the
chosen file is downloaded, imported with its blocks as published, self-tested and chatted with."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
pytest.importorskip("gguf")
import hubserver  # noqa: E402

from PySide6.QtWidgets import QWizard  # noqa: E402

from engine import ChatMessage, Engine, EngineConfig, Finished, GenerateRequest, SamplingParams  # noqa: E402
from engine import library as lib  # noqa: E402
from engine.bench.gguf import write_gguf  # noqa: E402
from colibri_app import wizard as wz  # noqa: E402

REPO = "colibri/tiny-olmoe-GGUF"
T = 600_000  # ms: only a hang trips it (the machine may be loaded)


@pytest.fixture
def gguf_hub(tmp_path, monkeypatch):
    root = tmp_path / "src"
    ck = hubserver.tiny_checkpoint(root / "ck")
    repo = tmp_path / "repo"
    repo.mkdir()
    for q in ("Q8_0", "Q4_0"):
        write_gguf(ck, repo / f"tiny-olmoe-{q}.gguf", matrix_type=q.lower(), log=lambda *_: None)
    (repo / "README.md").write_text("GGUF quants of tiny-olmoe")
    h = hubserver.FakeHub()
    url = h.start()
    hubserver.hub_env(monkeypatch, tmp_path, url)
    h.add_folder(REPO, repo)
    yield h
    h.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_gguf_repository_to_working_model(qtbot, gguf_hub, wizard_dialog):
    w = wizard_dialog
    w.source_page.repo_edit.setText(REPO)
    w.next()
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
    cp = w.check_page
    assert w.check.quant == "gguf" and w.check.gguf_file == "Q4_0"  # no Q4_K_M in it: the next preferred
    assert cp.gguf_box.isVisible() and [cp.gguf_box.itemText(i) for i in range(cp.gguf_box.count())] == \
        ["Q4_0", "Q8_0"] and cp.gguf_box.currentText() == "Q4_0"
    cp.gguf_box.setCurrentIndex(1)
    cp.gguf_box.activated.emit(1)
    qtbot.waitUntil(lambda: w.check is not None and w.check.gguf_file == "Q8_0" and cp.isComplete(), timeout=T)
    assert cp.files.rowCount() == 1 and cp.files.item(0, 0).text() == "tiny-olmoe-Q8_0.gguf"
    assert cp.files.item(0, 2).text() == "to download"
    w.next()
    assert w.currentId() == wz.PAGE_DOWNLOAD
    qtbot.waitUntil(w.download_page.isComplete, timeout=T)
    w.next()
    conv = w.convert_page
    assert conv.quant.count() == 1 and conv.quant.currentData() == "gguf"
    conv.convert_button.click()
    qtbot.waitUntil(conv.isComplete, timeout=T)
    assert lib.download_dir_for(REPO).exists()  # kept until the store passed its self-test
    w.next()
    qtbot.waitUntil(w.done_page.isComplete, timeout=T)
    assert w.done_page.passed, w.done_page.info.text()
    assert not lib.download_dir_for(REPO).exists()  # "delete the downloaded files" is on by default
    with qtbot.waitSignal(w.model_ready, timeout=T) as sig:
        w.button(QWizard.FinishButton).click()
    store = Path(sig.args[0])
    assert store == lib.models_dir() / "tiny-olmoe-Q8_0-gguf"
    m = json.loads((store / "manifest.json").read_text())
    assert m["gguf"]["expert_types"][0] == ["Q8_0", "Q8_0", "Q8_0"]
    full = [n for meth, n, r in gguf_hub.requests if meth == "GET" and r is None and not n.startswith("/api")]
    assert full == ["tiny-olmoe-Q8_0.gguf"]  # the Q4_0 file's header only, never its data
    req = GenerateRequest(messages=(ChatMessage("user", "Hello"),), sampling=SamplingParams(max_new_tokens=4))
    with Engine.open(EngineConfig(store=str(store), context_length=128, history=False)) as eng:
        evs = list(eng.generate(req))
    assert isinstance(evs[-1], Finished) and evs[-1].generated_tokens >= 1


def test_a_gguf_recommendation_leads_to_its_download_and_import(qtbot, gguf_hub, tmp_path, monkeypatch):
    """"Recommended for this computer" names a -GGUF repository and file type where that is the
    smaller download: choosing it checks that file (not the repository's default), downloads it
    alone and imports it into a working store."""
    from colibri_app import workers
    from engine.library.catalog import CatalogModel
    cfg = json.loads((hubserver.tiny_checkpoint(tmp_path / "src" / "ck") / "config.json").read_text())
    tiny = CatalogModel("colibri/tiny-olmoe", "tiny OLMoE", "a test model", cfg, gguf=(REPO, "Q8_0"))
    real = lib.recommend
    monkeypatch.setattr(lib, "recommend", lambda *a, **k: real(*a, **dict(k, catalog=(tiny,))))
    monkeypatch.setattr(lib, "machine_ram", lambda: (16 * 10 ** 9, 12 * 10 ** 9))
    monkeypatch.setattr(lib, "disk_read_speed", lambda folder, files=(): lib.DiskSpeed(0, 0.0, "O_DIRECT", str(folder)))
    w = wz.ModelWizard(None, context_length=256, recommendations=True)
    qtbot.addWidget(w)
    w.show()
    try:
        p = w.recommended_page
        r = p.rows[0]
        assert r.gguf == "Q8_0" and r.repo_id == REPO and r.download_bytes < r.safetensors_bytes
        assert p.table.item(0, 1).text() == "GGUF Q8_0"
        p.table.selectRow(0)
        assert REPO in p.detail.text() and "Q8_0" in p.detail.text()
        w.next()
        assert w.currentId() == wz.PAGE_SOURCE and w.source_page.repo_edit.text() == REPO
        w.next()
        qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK and w.check is not None, timeout=T)
        assert w.check.quant == "gguf" and w.check.gguf_file == "Q8_0"  # the repository's default is Q4_0
        assert w.check.estimate.slot_bytes == r.estimate.slot_bytes  # the recommendation's sizes
        w.next()
        qtbot.waitUntil(w.download_page.isComplete, timeout=T)
        w.next()
        conv = w.convert_page
        assert conv.quant.currentData() == "gguf"
        conv.convert_button.click()
        qtbot.waitUntil(conv.isComplete, timeout=T)
        w.next()
        qtbot.waitUntil(w.done_page.isComplete, timeout=T)
        assert w.done_page.passed, w.done_page.info.text()
        with qtbot.waitSignal(w.model_ready, timeout=T) as sig:
            w.button(QWizard.FinishButton).click()
        store = Path(sig.args[0])
        assert json.loads((store / "manifest.json").read_text())["gguf"]["expert_types"][0] == ["Q8_0"] * 3
        full = [n for meth, n, rng in gguf_hub.requests if meth == "GET" and rng is None and not n.startswith("/api")]
        assert full == ["tiny-olmoe-Q8_0.gguf"]
    finally:
        w.reject()
        assert workers.shutdown_all(30)
