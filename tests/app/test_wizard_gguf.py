"""The wizard's "from this computer" page takes a GGUF file: checked, imported with its blocks as
published, self-tested, listed in the model library, `colibri info` and the sizing see it; the
file itself is never changed. A bad .gguf is one line on the source page and leaves nothing."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
pytest.importorskip("gguf")
import hubserver  # noqa: E402

from PySide6.QtWidgets import QWizard  # noqa: E402

from engine import Engine, EngineConfig, Finished, GenerateRequest, SamplingParams  # noqa: E402
from engine import library as lib  # noqa: E402
from engine.bench.gguf import write_gguf  # noqa: E402
from colibri_app import wizard as wz  # noqa: E402

T = 300_000  # ms: only a hang trips it (a loaded machine converts slowly)


@pytest.fixture(scope="module")
def lmstudio_file(tmp_path_factory) -> Path:
    """A Q8_0 GGUF of the tiny OLMoE (with its tokenizer and chat template) where LM Studio keeps
    models: <models>/<publisher>/<repo>/<file>.gguf."""
    root = tmp_path_factory.mktemp("lms")
    ck = hubserver.tiny_checkpoint(root / "ck")
    out = root / "models" / "colibri" / "tiny-olmoe-GGUF" / "tiny-olmoe-Q8_0.gguf"
    write_gguf(ck, out, matrix_type="q8_0", log=lambda *_: None)
    return out


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_gguf_file_to_working_model(qtbot, wizard_dialog, lmstudio_file, capsys):
    before = _digest(lmstudio_file)
    w = wizard_dialog
    w.source_page.local_radio.setChecked(True)
    w.source_page.folder_edit.setText(str(lmstudio_file))
    assert w.source_page.isComplete()
    w.next()
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
    c = w.check
    assert c.quant == "gguf" and c.model_name == "tiny-olmoe-Q8_0" and c.has_chat_template
    assert [e.quant for e in c.estimates] == ["gguf"] and c.ram_verdict == "ok"
    w.next()
    cp = w.convert_page
    assert cp.quant.count() == 1 and cp.quant.itemText(0).startswith("GGUF blocks as published")
    cp.convert_button.click()
    qtbot.waitUntil(cp.isComplete, timeout=T)
    w.next()
    qtbot.waitUntil(w.done_page.isComplete, timeout=T)
    assert w.done_page.passed, w.done_page.info.text()
    with qtbot.waitSignal(w.model_ready, timeout=T) as sig:
        w.button(QWizard.FinishButton).click()
    store = Path(sig.args[0])
    assert store == lib.models_dir() / "tiny-olmoe-Q8_0-gguf"
    assert _digest(lmstudio_file) == before  # the published file is only read
    m = json.loads((store / "manifest.json").read_text())
    assert m["quant"] == "gguf" and m["gguf"]["expert_types"][0] == ["Q8_0", "Q8_0", "Q8_0"]
    # the library lists it; sizing and `colibri info` read it like any store
    entry = next(e for e in lib.list_models() if e.path == str(store))
    assert entry.quantization == "gguf" and entry.family == "olmoe" and not entry.problem
    est = c.estimate
    assert est.slot_bytes == m["slot_bytes"][0] and est.dense_bytes == m["dense_bytes"]
    from engine.cli.main import main
    assert main(["info", str(store)]) == 0
    out = capsys.readouterr().out
    assert "OLMoE" in out and "experts gguf (Q8_0 blocks as published)" in out
    with Engine.open(EngineConfig(store=str(store), context_length=128, history=False)) as eng:
        evs = list(eng.generate(GenerateRequest(prompt="Hello", sampling=SamplingParams(max_new_tokens=4))))
    assert isinstance(evs[-1], Finished) and evs[-1].generated_tokens >= 1


def test_bad_gguf_file_is_one_line_on_the_source_page(qtbot, wizard_dialog, tmp_path):
    bad = tmp_path / "model-Q4_K_M.gguf"
    bad.write_text("<html>Not Found</html>")
    w = wizard_dialog
    w.source_page.local_radio.setChecked(True)
    w.source_page.folder_edit.setText(str(bad))
    w.next()
    qtbot.waitUntil(lambda: "not a GGUF file" in w.source_page.status.text(), timeout=T)
    assert w.currentId() == wz.PAGE_SOURCE and w.check is None
    assert "\n" not in w.source_page.status.text()
    assert not any(lib.models_dir().glob("model-Q4_K_M*")) if lib.models_dir().exists() else True
