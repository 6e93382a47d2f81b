"""Broken stores: a corrupt or half-written manifest, a truncated or
missing expert file, a missing or damaged dense file, a missing config.json are listed as
BROKEN with the reason naming the file and what to do, by the one validation
(engine.expert_store.store_problem) that `colibri models`, `colibri doctor` and the app's model
library use; never skipped, never "healthy", never a traceback. The same stores refuse to open
(`colibri run`), can be deleted from the library, and a broken default model is rebuilt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import library as lib
from engine.cli import main
from engine.errors import EngineError
from engine.expert_store import ExpertStore, store_problem


def _truncate(p: Path, keep: int | None = None) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2 if keep is None else keep])


def _old_store(st: Path) -> None:
    """A store written before the manifest recorded file sizes (no "files" table)."""
    m = json.loads((st / "manifest.json").read_text())
    del m["files"]
    (st / "manifest.json").write_text(json.dumps(m))


# (case, how to break a copy of the store, the file the reason must name)
BREAKS = {
    "manifest-garbage": (lambda st: (st / "manifest.json").write_bytes(b"\x00\xff garbage"), "manifest.json"),
    "manifest-half-written": (lambda st: _truncate(st / "manifest.json"), "manifest.json"),
    "manifest-empty": (lambda st: (st / "manifest.json").write_text(""), "manifest.json"),
    "manifest-not-an-object": (lambda st: (st / "manifest.json").write_text("[1, 2]"), "manifest.json"),
    "manifest-missing": (lambda st: (st / "manifest.json").unlink(), "manifest.json"),
    "manifest-expert-table-damaged": (
        lambda st: (st / "manifest.json").write_text(
            json.dumps({**json.loads((st / "manifest.json").read_text()), "slot_bytes": "x"})), "manifest.json"),
    "expert-truncated": (lambda st: _truncate(st / "experts" / "layer_001.bin"), "experts/layer_001.bin"),
    "expert-missing": (lambda st: (st / "experts" / "layer_000.bin").unlink(), "experts/layer_000.bin"),
    "dense-missing": (lambda st: (st / "dense.safetensors").unlink(), "dense.safetensors"),
    "dense-truncated": (lambda st: _truncate(st / "dense.safetensors"), "dense.safetensors"),
    # no "files" table: only the safetensors header can tell the dense file is short
    "old-store-dense-truncated": (lambda st: (_old_store(st), _truncate(st / "dense.safetensors")),
                                  "dense.safetensors"),
    "old-store-dense-header-garbage": (
        lambda st: (_old_store(st), (st / "dense.safetensors").write_bytes(
            b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)), "dense.safetensors"),
    "config-missing": (lambda st: (st / "config.json").unlink(), "config.json"),
}


@pytest.fixture
def models(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(tmp_path / "data"))
    return lib.models_dir()


def _broken_copy(tiny_store, models: Path, case: str) -> Path:
    st = models / f"tiny-{case}"
    shutil.copytree(tiny_store, st)
    BREAKS[case][0](st)
    return st


@pytest.mark.parametrize("case", sorted(BREAKS))
def test_every_broken_store_is_listed_broken_with_the_file_and_a_remedy(tiny_store, models, case):
    st = _broken_copy(tiny_store, models, case)
    shutil.copytree(tiny_store, models / "tiny-good")
    why = store_problem(st)
    assert why and str(st / BREAKS[case][1]) in why, why
    by_path = {e.path: e for e in lib.list_models()}
    assert set(by_path) == {str(st), str(models / "tiny-good")}, "a broken store was skipped"
    e, good = by_path[str(st)], by_path[str(models / "tiny-good")]
    assert good.ok and not good.problem and not good.advice
    assert not e.ok and e.problem == why
    assert "Re-convert" in e.advice and "delete" in e.advice and str(st) in e.advice
    with pytest.raises(EngineError) as err:     # `colibri run` / the app refuse it the same way
        ExpertStore(st, o_direct=False).close()
    assert str(st / BREAKS[case][1]) in str(err.value)
    lib.delete_model(st)                        # and the library can remove it
    assert not st.exists()


def test_colibri_models_and_doctor_show_broken_stores(tiny_store, models, capsys):
    broken = {c: _broken_copy(tiny_store, models, c) for c in ("manifest-half-written", "expert-truncated",
                                                                "dense-missing")}
    shutil.copytree(tiny_store, models / "tiny-good")
    assert main(["models"]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "3 of 4 stores are broken" in err
    for c, st in broken.items():
        block = out[out.index(str(st)):]
        assert block.split("\n")[1].lstrip().startswith("BROKEN: ") and str(st / BREAKS[c][1]) in block
        assert "Re-convert it" in block.split("\n")[2]
    assert out.count("BROKEN") == 3 and str(models / "tiny-good") in out

    assert main(["doctor", "--no-disk-test"]) == 0
    out = capsys.readouterr().out
    assert out.count("BROKEN") == 3 and "Traceback" not in out
    for c, st in broken.items():
        assert str(st / BREAKS[c][1]) in out
    assert main(["doctor", "--no-disk-test", "--json"]) == 0
    conv = {m["path"]: m for m in json.loads(capsys.readouterr().out)["models"]["converted"]}
    assert conv[str(models / "tiny-good")]["ok"] and not conv[str(models / "tiny-good")]["problem"]
    assert all(not conv[str(st)]["ok"] and "Re-convert" in conv[str(st)]["advice"] for st in broken.values())


def test_colibri_run_on_a_broken_store_is_one_clear_line(tiny_store, models, capsys):
    st = _broken_copy(tiny_store, models, "old-store-dense-truncated")
    assert main(["run", "--model", str(st), "--prompt", "hi", "--max-new-tokens", "1", "--no-history"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("colibri: error: ") and str(st / "dense.safetensors") in err and "Traceback" not in err


def test_folders_that_are_not_stores_are_not_listed(tiny_store, models):
    (models / "holiday-photos").mkdir()
    (models / "notes.txt").write_text("x")
    (models / ".tiny-int8.123.abc.partial").mkdir()
    assert lib.list_models() == []
    with pytest.raises(ValueError, match="not a converted store"):
        lib.delete_model(models / "holiday-photos")


def test_a_broken_default_model_is_converted_again(models, tiny_checkpoint, monkeypatch):
    import engine.library.default_model as dm
    monkeypatch.setattr(dm, "default_model_dir", lambda: tiny_checkpoint)   # a tiny "bundled" model: fast
    st = lib.default_store()
    assert store_problem(st) is None
    _truncate(st / "experts" / "layer_000.bin")
    assert store_problem(st)
    assert lib.default_store() == st and store_problem(st) is None


@pytest.mark.parametrize("damage", ["manifest half-written", "experts truncated"])
def test_a_default_model_converted_again_keeps_its_routing_history(models, tiny_checkpoint, monkeypatch, damage):
    """The routing history next to the default model (which experts this user's questions
    use: the pins and pre-warm) outlives the store being converted again from the same
    bundled checkpoint."""
    import engine.library.default_model as dm
    from engine.heat import FILENAME
    monkeypatch.setattr(dm, "default_model_dir", lambda: tiny_checkpoint)
    st = lib.default_store()
    heat = b'{"format": "colibri-routing-heat", "version": 1, "tokens": 12345}'
    (st / FILENAME).write_bytes(heat)
    if damage == "manifest half-written":
        _truncate(st / "manifest.json", 40)
    else:
        _truncate(st / "experts" / "layer_000.bin")
    assert lib.default_store() == st and store_problem(st) is None
    assert (st / FILENAME).read_bytes() == heat


def test_the_remedy_names_the_command_that_made_the_store(tiny_store, models):
    """A hub download is re-made with `colibri download REPO`, never `colibri convert hf://...`."""
    st = models / "hubbed-int8"
    shutil.copytree(tiny_store, st)
    m = json.loads((st / "manifest.json").read_text())
    m.update(source="hf://allenai/tiny-olmoe@0123abcd", hub_repo="allenai/tiny-olmoe")
    (st / "manifest.json").write_text(json.dumps(m))
    _truncate(st / "experts" / "layer_000.bin")
    [e] = lib.list_models()
    for text in (e.problem, e.advice):
        assert "`colibri download allenai/tiny-olmoe --quant int8 --overwrite`" in text, text
        assert "convert --overwrite hf://" not in text


def test_overwrite_replaces_a_store_whose_manifest_is_gone(tiny_checkpoint, tiny_store, models, capsys):
    """The advice works for every broken store: `colibri convert --overwrite` replaces one
    without a manifest (it used to be 'not a colibri store'); without --overwrite it is refused."""
    st = _broken_copy(tiny_store, models, "manifest-missing")
    assert main(["convert", str(tiny_checkpoint), str(st)]) == 2
    assert "a store already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["convert", "--overwrite", str(tiny_checkpoint), str(st)]) == 0
    assert store_problem(st) is None


def test_a_damaged_index_of_the_default_model_is_converted_again(models, tiny_checkpoint, tmp_path, monkeypatch):
    """The bundled model's documentation index (engine.docs_lookup): a damaged copy in the
    converted store is rebuilt from the bundled one, not run without lookup."""
    import shutil

    import engine.library.default_model as dm
    from engine.docs_lookup import INDEX_FILE, DocsIndex
    src = tmp_path / "bundled"
    shutil.copytree(tiny_checkpoint, src)
    (src / INDEX_FILE).write_text('{"name": "json.dumps", "summary": "Serialize obj."}\n')
    monkeypatch.setattr(dm, "default_model_dir", lambda: src)
    st = lib.default_store()
    (st / INDEX_FILE).write_text('{"name": "json.dumps", "summ')
    assert lib.default_store() == st and len(DocsIndex.open(st / INDEX_FILE)) == 1
    (st / INDEX_FILE).unlink()                                  # a missing copy, too
    assert lib.default_store() == st and (st / INDEX_FILE).exists()
