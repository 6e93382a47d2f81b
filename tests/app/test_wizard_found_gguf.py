"""The wizard's source page lists the GGUF models already on this computer — a fake LM Studio
models folder, a fake Ollama store (manifest + blob) and a fake Hugging Face cache — with name,
size, quant, architecture and whether they run; choosing one imports it (the original only read)
and the model chats. Bad files (an unsupported architecture, a truncated header, short tensor
data, a non-GGUF file named .gguf) are one line on the page and leave nothing behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
gguf = pytest.importorskip("gguf")
import hubserver  # noqa: E402
from gguf_helpers import bert_gguf  # noqa: E402

from PySide6.QtWidgets import QWizard  # noqa: E402

from engine import ChatMessage, Engine, EngineConfig, Finished, GenerateRequest, SamplingParams  # noqa: E402
from engine import library as lib  # noqa: E402
from engine.bench.gguf import write_gguf  # noqa: E402
from colibri_app import wizard as wz  # noqa: E402

T = 600_000  # ms: only a hang trips it (the machine may be loaded)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory) -> Path:
    """A Q8_0 GGUF of the tiny OLMoE, with its tokenizer and chat template."""
    root = tmp_path_factory.mktemp("found")
    ck = hubserver.tiny_checkpoint(root / "ck")
    out = root / "tiny-olmoe-Q8_0.gguf"
    write_gguf(ck, out, matrix_type="q8_0", log=lambda *_: None)
    return out


@pytest.fixture
def fake_home(tmp_path, monkeypatch, q8_file):
    """$HOME with an LM Studio models folder (the tiny OLMoE, a split's second part, a projector
    and a bert GGUF), an Ollama store (manifest + blob of the tiny OLMoE, and a manifest of a
    non-model layer), and $HF_HUB_CACHE with one -GGUF repository snapshot; temp files go to a
    private folder."""
    home = tmp_path / "home"
    lms = home / ".lmstudio" / "models" / "colibri" / "tiny-olmoe-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(q8_file, lms / "tiny-olmoe-Q8_0.gguf")
    (lms / "mmproj-tiny-olmoe-f16.gguf").write_bytes(b"GGUF")
    old = home / ".cache" / "lm-studio" / "models" / "someone" / "bert-GGUF"
    old.mkdir(parents=True)
    bert_gguf(old / "bert-F32.gguf")
    (old / "big-00002-of-00002.gguf").write_bytes(b"GGUF")  # not a first part: listed by its first only
    om = home / ".ollama" / "models"
    digest = _sha(q8_file)
    (om / "blobs").mkdir(parents=True)
    shutil.copy(q8_file, om / "blobs" / f"sha256-{digest}")
    man = om / "manifests" / "registry.ollama.ai" / "library" / "tiny-olmoe" / "q8_0"
    man.parent.mkdir(parents=True)
    man.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}", "size": 1},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 1}]}))
    other = om / "manifests" / "registry.ollama.ai" / "library" / "license-only" / "latest"
    other.parent.mkdir(parents=True)
    other.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.license",
                                             "digest": "sha256:" + "1" * 64}]}))
    hf = tmp_path / "hf"
    repo = hf / "models--colibri--tiny-olmoe-GGUF"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    shutil.copy(q8_file, repo / "blobs" / digest)
    (snap / "tiny-olmoe-Q8_0.gguf").symlink_to(Path("../../blobs") / digest)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hf))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return home, om / "blobs" / f"sha256-{digest}", snap / "tiny-olmoe-Q8_0.gguf", tmp


def test_find_gguf_models_lists_lm_studio_ollama_and_the_hub_cache(fake_home):
    home, blob, cached, _tmp = fake_home
    found = lib.find_gguf_models()
    rows = [(f.where, f.name, f.quant, f.architecture, f.runs) for f in found]
    assert rows == [("LM Studio", "tiny-olmoe-Q8_0", "Q8_0", "olmoe", True),
                    ("LM Studio", "bert-F32", "", "bert", False),
                    ("Ollama", "tiny-olmoe:q8_0", "Q8_0", "olmoe", True),
                    ("Hugging Face cache", "tiny-olmoe-Q8_0", "Q8_0", "olmoe", True)]
    assert found[2].path == str(blob) and found[2].size == blob.stat().st_size
    assert found[3].path == str(cached)
    assert "GGUF architecture 'bert' is not supported" in found[1].message
    assert found[2].model_name == "tiny-olmoe-q8_0"
    assert lib.is_gguf_path(blob)  # a blob without the .gguf suffix is read by its magic


def test_a_file_that_fails_oddly_does_not_hide_the_others(fake_home, monkeypatch):
    """A fault of one file other than the import's own errors lists it as not running, the others
    as before."""
    from engine import gguf_import
    real = gguf_import.GGUFSource

    def odd(g):
        if g.arch == "bert":
            raise RuntimeError("odd")
        return real(g)
    monkeypatch.setattr(gguf_import, "GGUFSource", odd)
    found = lib.find_gguf_models()
    assert [(f.architecture, f.runs) for f in found] == [("olmoe", True), ("bert", False), ("olmoe", True),
                                                         ("olmoe", True)]
    assert "cannot be read as a GGUF model (RuntimeError)" in found[1].message


def test_cli_models_found_lists_them(fake_home, capsys):
    from engine.cli.main import main
    _home, blob, _cached, _tmp = fake_home
    assert main(["models", "--found"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["name", "where", "size"]
    row = next(x for x in out if x.startswith("tiny-olmoe:q8_0"))
    assert "Ollama" in row and "Q8_0" in row and "olmoe" in row and " yes " in row and str(blob) in row
    bert = out.index(next(x for x in out if x.startswith("bert-F32")))
    assert " no " in out[bert] and "GGUF architecture 'bert' is not supported" in out[bert + 1]


@pytest.mark.parametrize("where", ["LM Studio", "Ollama"])
def test_found_model_imports_and_chats(where, app_dirs, fake_home, qtbot, wizard_dialog):
    _home, blob, _cached, tmp = fake_home
    w = wizard_dialog
    sp = w.source_page
    qtbot.waitUntil(lambda: sp.find_task is None and sp.found_table.rowCount() == 4, timeout=T)
    cells = [[sp.found_table.item(i, j).text() for j in range(6)] for i in range(4)]
    assert cells[2][:2] == ["tiny-olmoe:q8_0", "Ollama"] and cells[2][3:] == ["Q8_0", "olmoe", "yes"]
    assert cells[1][1:] == ["LM Studio", cells[1][2], "?", "bert", "no"]
    row = next(i for i, c in enumerate(cells) if c[1] == where)
    src = Path(sp.found[row].path)
    before = _sha(src)
    sp.found_table.selectRow(row)
    assert sp.local_radio.isChecked() and sp.folder_edit.text() == str(src) and sp.isComplete()
    w.next()
    qtbot.waitUntil(lambda: w.currentId() == wz.PAGE_CHECK, timeout=T)
    name = "tiny-olmoe-Q8_0" if where == "LM Studio" else "tiny-olmoe-q8_0"
    assert w.check.quant == "gguf" and w.check.model_name == name
    w.next()
    w.convert_page.convert_button.click()
    qtbot.waitUntil(w.convert_page.isComplete, timeout=T)
    w.next()
    qtbot.waitUntil(w.done_page.isComplete, timeout=T)
    assert w.done_page.passed, w.done_page.info.text()
    with qtbot.waitSignal(w.model_ready, timeout=T) as sig:
        w.button(QWizard.FinishButton).click()
    store = Path(sig.args[0])
    assert store == lib.models_dir() / f"{name}-gguf"
    assert _sha(src) == before and src.exists()  # only read, never moved
    req = GenerateRequest(messages=(ChatMessage("user", "Hello"),), sampling=SamplingParams(max_new_tokens=4))
    with Engine.open(EngineConfig(store=str(store), context_length=128, history=False)) as eng:
        evs = list(eng.generate(req))
    assert isinstance(evs[-1], Finished) and evs[-1].generated_tokens >= 1
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("case", ["architecture", "truncated", "short_data", "not_gguf"])
def test_bad_gguf_is_one_line_and_leaves_nothing(case, app_dirs, fake_home, q8_file, qtbot, wizard_dialog,
                                                 tmp_path):
    _home, _blob, _cached, tmp = fake_home
    bad = tmp_path / "in" / "model-Q4_K_M.gguf"
    bad.parent.mkdir()
    data = q8_file.read_bytes()
    if case == "architecture":
        bert_gguf(bad)
        want = "GGUF architecture 'bert' is not supported"
    elif case == "truncated":
        bad.write_bytes(data[:300])
        want = "truncated GGUF file: it ends at 300 bytes, inside its header"
    elif case == "short_data":
        bad.write_bytes(data[:-1000])
        end = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(q8_file).tensors)
        want = f"truncated GGUF file: {len(data) - 1000} bytes, but its tensor data ends at {end} bytes"
    else:
        bad.write_text("<html>Not Found</html>")
        want = "not a GGUF file"
    w = wizard_dialog
    sp = w.source_page
    qtbot.waitUntil(lambda: sp.find_task is None, timeout=T)
    sp.local_radio.setChecked(True)
    sp.folder_edit.setText(str(bad))
    w.next()
    qtbot.waitUntil(lambda: want in sp.status.text(), timeout=T)
    assert w.currentId() == wz.PAGE_SOURCE and w.check is None
    assert "\n" not in sp.status.text() and "Traceback" not in sp.status.text()
    if case == "architecture":
        assert not sp.isComplete()  # refused until the input changes (a damaged file may be fetched again)
    models = lib.models_dir()
    assert not models.exists() or list(models.iterdir()) == []
    assert sorted(p.name for p in bad.parent.iterdir()) == [bad.name]
    assert list(tmp.iterdir()) == []
