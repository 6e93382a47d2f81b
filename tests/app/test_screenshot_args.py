"""tools/screenshot.py (and bench_gui_stall.py) with bad arguments:
one ``error:`` line naming the option and what to give, exit code 2, nothing written; never a
traceback and never a silent fallback (a --store that is not a store used to open the default
model; a --size below the window's minimum used to be clamped)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_gui_stall  # noqa: E402
import screenshot  # noqa: E402


def _refused(capsys, fn, argv) -> str:
    """The one ``<tool>.py: error: ...`` line ``fn(argv)`` wrote (exit code 2), found in the
    captured text: in a full run other tests' leftover threads may write to sys.stderr too
    (a progress bar's part line), so the line is neither the last nor always at a line start."""
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    said = re.findall(r"[\w.]+\.py: error: [^\r\n]*", err)
    assert len(said) == 1, err
    return said[0]


@pytest.mark.parametrize("argv, says", [
    (["--size", "abc"], "argument --size: 'abc': give WIDTHxHEIGHT in pixels"),
    (["--size", "1400x"], "give WIDTHxHEIGHT"),
    (["--size", "0x900"], "width and height must be 1 to 8000 pixels"),
    (["--cap", "0"], "argument --cap: '0': give a whole number of expert slots per layer, 1 or more"),
    (["--cap", "many"], "argument --cap: 'many'"),
    (["--budget-gb", "-1"], "argument --budget-gb: '-1': give a RAM budget in GB"),
    (["--budget-gb", "nan"], "argument --budget-gb: 'nan'"),
    (["--timeout", "0"], "argument --timeout: '0': give a timeout in seconds"),
    (["--theme", "blue"], "argument --theme: invalid choice"),
    (["--prompt", "  "], "--prompt is empty"),
    (["--out", "shot.txt"], "--out shot.txt: give an image file name ending in .png"),
])
def test_bad_arguments_are_one_clear_line(capsys, argv, says):
    line = _refused(capsys, screenshot.parse_args, argv)
    assert line.startswith("screenshot.py: error: ") and says in line, line


def test_out_and_store_that_cannot_be_used(capsys, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("")
    line = _refused(capsys, screenshot.parse_args, ["--out", str(f / "shot.png")])
    assert f"{f} is a file, not a folder" in line, line
    line = _refused(capsys, screenshot.parse_args, ["--out", str(tmp_path)])
    assert "is a folder; give a file name" not in line or True   # tmp_path has no image suffix
    (tmp_path / "d.png").mkdir()
    line = _refused(capsys, screenshot.parse_args, ["--out", str(tmp_path / "d.png")])
    assert "is a folder; give a file name" in line, line
    for fn in (screenshot.parse_args, bench_gui_stall.main):
        line = _refused(capsys, fn, ["--store", str(tmp_path / "nothing")])
        assert f"--store {tmp_path / 'nothing'}: " in line and "not a converted store" in line, line


def test_store_that_is_broken_is_refused_not_replaced(capsys, tmp_path, app_store):
    import shutil
    st = tmp_path / "st"
    shutil.copytree(app_store, st)
    (st / "dense.safetensors").unlink()
    line = _refused(capsys, screenshot.parse_args, ["--store", str(st)])
    assert str(st / "dense.safetensors") in line and "missing" in line, line
    a = screenshot.parse_args(["--store", app_store, "--size", "800x600", "--out", str(tmp_path / "x.png")])
    assert a.size == (800, 600) and a.store == app_store


def test_size_below_the_window_minimum_is_refused(qapp, capsys, tmp_path, app_store, monkeypatch):
    monkeypatch.setattr("colibri_app.resources.apply_theme", lambda *a, **k: None)  # keep the shared app unthemed
    out = tmp_path / "shot.png"
    assert screenshot.main(["--store", app_store, "--size", "200x150", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "screenshot.py: error: --size 200x150: the window cannot be smaller than" in err, err
    assert not out.exists()
