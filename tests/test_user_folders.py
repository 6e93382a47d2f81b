"""A user folder that is a file: COLIBRI_DATA_DIR, COLIBRI_CONFIG_DIR,
the models folder inside the data folder and NUMBA_CACHE_DIR pointing at a regular file (or
under one) are reported as "a file, not a folder" with what to do, by `colibri doctor`,
`colibri models`, `colibri run`, the library and the app start; never "not created yet",
never an errno line or a traceback."""

from __future__ import annotations

import json

import pytest

from engine import library as lib
from engine.cli import main



@pytest.fixture
def afile(tmp_path):
    f = tmp_path / "colibri-data"
    f.write_text("not a folder")
    return f


def test_doctor_says_the_data_folder_is_a_file(afile, capsys, monkeypatch):
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(afile))
    assert main(["doctor", "--disk-test-mb", "1"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("data folder"))
    assert "not created yet" not in line and "NOT A FOLDER" in line, line
    assert f"COLIBRI_DATA_DIR={afile}: {afile} is a file, not a folder" in line
    assert "Point COLIBRI_DATA_DIR at a folder" in line and "unset it" in line
    assert "MB/s" in out and afile.read_text() == "not a folder"   # measured beside it, file untouched
    f = json.loads((capsys.readouterr(), main(["doctor", "--no-disk-test", "--json"]), capsys.readouterr().out)[2])
    assert f["data_folder"]["not_a_folder"] and not f["data_folder"]["writable"]


def test_doctor_says_the_config_folder_is_a_file(afile, capsys, monkeypatch):
    monkeypatch.setenv("COLIBRI_CONFIG_DIR", str(afile))
    assert main(["doctor", "--no-disk-test"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("config"))
    assert f"COLIBRI_CONFIG_DIR={afile}: {afile} is a file, not a folder" in line, line


@pytest.mark.parametrize("argv", [["models"], ["run", "--prompt", "hi", "--max-new-tokens", "1", "--no-history"]])
def test_cli_commands_say_the_data_folder_is_a_file(afile, capsys, monkeypatch, argv):
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(afile))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"colibri: error: COLIBRI_DATA_DIR={afile}: {afile} is a file, not a folder"), err
    assert "Errno" not in err and "Traceback" not in err


def test_a_file_where_the_models_folder_goes(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (data / "models").write_text("")
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(data))
    assert main(["models"]) == 2
    err = capsys.readouterr().err
    assert f"{data / 'models'} is a file, not a folder. Move or rename that file" in err, err
    assert main(["doctor", "--no-disk-test"]) == 0
    assert f"{data / 'models'} is a file, not a folder" in capsys.readouterr().out


def test_library_folders_raise_folder_error(afile, tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_CONFIG_DIR", str(afile / "sub"))
    with pytest.raises(lib.FolderError, match=r"cannot be created: .*colibri-data is a file, not a folder"):
        lib.user_config_dir()
    assert isinstance(lib.FolderError("x"), OSError)       # callers catching OSError keep working
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(tmp_path / "fine"))
    (tmp_path / "fine").mkdir()
    (tmp_path / "fine" / "downloads").write_text("")
    with pytest.raises(lib.FolderError, match="downloads is a file, not a folder"):
        lib.downloads_dir()
    monkeypatch.delenv("COLIBRI_DATA_DIR")                  # a platform default: no variable to blame
    why = lib.folder_problem(afile, "COLIBRI_DATA_DIR", "models")
    assert why == f"{afile} is a file, not a folder. Move or rename that file: colibri keeps its models in {afile}."


def test_numba_cache_dir_that_is_a_file_is_explained(afile, monkeypatch):
    import engine.kernels as K
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(afile))
    cache, problem = K.numba_cache_dir()   # what the module computes at import (CACHE_DIR, CACHE_PROBLEM)
    assert cache is None
    assert problem.startswith(f"{afile} is a file, not a folder; point NUMBA_CACHE_DIR at a folder"), problem
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(afile / "numba"))
    assert K.numba_cache_dir()[1].startswith(f"{afile / 'numba'} cannot be created: {afile} is a file")
    assert afile.read_text() == "not a folder"
