"""The wizard checks the tokenizer and chat template before converting,
accepts a pasted hub address, says why Next is disabled, and removes a store whose self-test
fails (with "Use this model" disabled and the reason shown)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import hubserver  # noqa: E402

from PySide6.QtWidgets import QWizard  # noqa: E402

from engine import library as lib  # noqa: E402
from colibri_app import wizard as wz  # noqa: E402

REPO = hubserver.TINY_REPO
T = 300_000  # ms: only a hang trips it


@pytest.fixture
def no_tok(tmp_path, tiny) -> Path:
    """The tiny checkpoint without its tokenizer files."""
    d = tmp_path / "no-tokenizer"
    shutil.copytree(tiny, d)
    for p in d.glob("tokenizer*"):
        p.unlink()
    return d


def _shown(label) -> str:
    return label.text() if label.isVisibleTo(label.window()) else ""


def test_local_folder_without_tokenizer_is_refused_before_converting(qtbot, wizard, no_tok):
    w, sp = wizard, wizard.source_page
    sp.local_radio.setChecked(True)
    sp.folder_edit.setText(str(no_tok))
    assert sp.isComplete()
    w.next()
    qtbot.waitUntil(lambda: "Refused" in sp.status.text(), timeout=T)
    text = sp.status.text()
    assert "tokenizer.json" in text and "Traceback" not in text
    assert w.currentId() == wz.PAGE_SOURCE and w.check is None
    assert not sp.isComplete()
    assert "Change the model" in _shown(sp.next_reason)
    assert lib.list_models() == []
    # the library refuses it too (the CLI and a hub download go through convert_downloaded)
    with pytest.raises(Exception, match="tokenizer.json"):
        lib.convert_downloaded(no_tok, "int8")
    assert lib.list_models() == []


def test_hub_repo_without_tokenizer_is_refused_before_download(qtbot, wizard, fake, no_tok):
    fake.add_folder("someone/no-tokenizer", no_tok)
    w, sp = wizard, wizard.source_page
    sp.repo_edit.setText("someone/no-tokenizer")
    w.next()
    qtbot.waitUntil(lambda: "Refused" in sp.status.text(), timeout=T)
    assert "tokenizer.json" in sp.status.text() and "Nothing was downloaded" in sp.status.text()
    assert not sp.isComplete() and fake.weight_requests() == []


def test_check_page_reports_tokenizer_and_template(qtbot, wizard, fake):
    w = wizard
    w.source_page.repo_edit.setText(REPO)
    w.next()
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
    assert w.check.tokenizer_message
    assert "Tokenizer" in w.check_page.summary.text()
    assert fake.weight_requests() == []


@pytest.mark.parametrize("pasted,revision", [
    (f"https://huggingface.co/{REPO}", ""),
    (f"https://huggingface.co/{REPO}/tree/main", "main"),
    (f"huggingface.co/{REPO}/blob/main/config.json", "main"),
])
def test_pasted_hub_address_becomes_repo_id(qtbot, wizard, fake, pasted, revision):
    w, sp = wizard, wizard.source_page
    sp.repo_edit.setText(pasted)
    assert sp.repo_edit.text() == REPO
    assert sp.revision_edit.text() == revision
    assert REPO in sp.url_note.text() and sp.url_note.isVisibleTo(wizard)
    assert sp.isComplete() and not _shown(sp.next_reason)
    w.next()
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
    assert w.check.repo_id == REPO


def test_next_disabled_says_why(qtbot, wizard, tmp_path):
    sp = wizard.source_page
    sp.repo_edit.setText("")
    assert not sp.isComplete() and "owner/name" in _shown(sp.next_reason)
    sp.repo_edit.setText("not a repo id")
    assert not sp.isComplete() and "not a hub repository id" in _shown(sp.next_reason)
    sp.repo_edit.setText("https://example.com/a/b")
    assert not sp.isComplete() and "not a Hugging Face hub address" in _shown(sp.next_reason)
    sp.repo_edit.setText("owner/name")
    assert sp.isComplete() and not _shown(sp.next_reason)
    sp.local_radio.setChecked(True)
    assert not sp.isComplete() and "choose the model's folder" in _shown(sp.next_reason)
    missing = tmp_path / "nowhere"
    sp.folder_edit.setText(str(missing))
    assert not sp.isComplete() and "does not exist" in _shown(sp.next_reason) and str(missing) in sp.next_reason.text()
    f = tmp_path / "file.txt"
    f.write_text("x")
    sp.folder_edit.setText(str(f))
    assert not sp.isComplete() and "not a folder" in _shown(sp.next_reason)
    sp.folder_edit.setText(str(tmp_path))
    assert sp.isComplete() and not _shown(sp.next_reason)


def test_failed_self_test_removes_the_store(qtbot, wizard, tiny):
    w = wizard
    w.source_page.local_radio.setChecked(True)
    w.source_page.folder_edit.setText(str(tiny))
    w.next()
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
    w.next()
    w.convert_page.convert_button.click()
    qtbot.waitUntil(w.convert_page.isComplete, timeout=T)
    store = Path(w.store_path)
    assert [m.path for m in lib.list_models()] == [str(store)] or len(lib.list_models()) == 1
    # the store breaks (a damaged tokenizer file): its self-test fails for real
    (store / "tokenizer.json").write_text("{ not json", encoding="utf-8")
    w.next()
    assert w.currentId() == wz.PAGE_DONE
    dp = w.done_page
    qtbot.waitUntil(lambda: dp.tested, timeout=T)
    assert not dp.passed
    assert not store.exists() and lib.list_models() == []
    assert "self-test failed" in dp.info.text() and "removed" in dp.info.text()
    assert "disabled" in dp.info.text()
    assert "Traceback" not in dp.output.toPlainText()
    assert not dp.isComplete()
    assert not w.button(QWizard.FinishButton).isEnabled()
    fired = []
    w.model_ready.connect(fired.append)
    w.button(QWizard.FinishButton).click()
    assert fired == []


@pytest.mark.parametrize("short_of", ["ram", "permission"])
def test_self_test_short_of_ram_keeps_the_store(qtbot, wizard, tiny, monkeypatch, short_of):
    """A self-test that fails for lack of RAM (or of a permission: a disk error) says so and
    keeps the store (it may be fine); "Use this model" stays disabled."""
    from engine import BudgetError
    w = wizard
    w.source_page.local_radio.setChecked(True)
    w.source_page.folder_edit.setText(str(tiny))
    w.next()
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
    w.next()
    w.convert_page.convert_button.click()
    qtbot.waitUntil(w.convert_page.isComplete, timeout=T)
    store = Path(w.store_path)

    def short(store, max_new_tokens=8):
        if short_of == "permission":
            raise PermissionError(13, "Permission denied", str(Path(store) / "dense.safetensors"))
        raise BudgetError("the RAM budget 0.1 GB cannot hold the dense weights (0.2 GB)")
    monkeypatch.setattr(lib, "self_test", short)
    w.next()
    dp = w.done_page
    qtbot.waitUntil(lambda: dp.tested, timeout=T)
    assert store.exists() and len(lib.list_models()) == 1
    assert "kept" in dp.info.text() and not w.button(QWizard.FinishButton).isEnabled()
