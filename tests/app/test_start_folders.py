"""The app start with a data or config folder that is a file: one
message box (and one stderr line) saying which path is a file and what to do, exit code 2,
no window and no traceback."""

from __future__ import annotations

import pytest

import colibri_app.__main__ as start


@pytest.mark.parametrize("var", ["COLIBRI_DATA_DIR", "COLIBRI_CONFIG_DIR"])
def test_app_start_with_a_folder_that_is_a_file(qapp, tmp_path, monkeypatch, var):
    # stderr is this test's own buffer, not pytest's capture: in a full run other tests'
    # leftover threads share sys.stderr (a progress bar writes a part line that ends in "\r");
    # the message is looked for in the text written, not at the start of a line
    import io
    import sys
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    f = tmp_path / "x"
    f.write_text("")
    monkeypatch.setenv("COLIBRI_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("COLIBRI_CONFIG_DIR", str(tmp_path / "cfg"))
    monkeypatch.setenv(var, str(f))
    shown = []
    monkeypatch.setattr(start, "show_fatal", shown.append)
    assert start.main([]) == 2
    assert len(shown) == 1 and shown[0].startswith(f"{var}={f}: {f} is a file, not a folder. Point {var}")
    said = err.getvalue()
    assert said.count("colibri: error:") == 1 and f"colibri: error: {var}={f}: {f} is a file" in said, said
    assert f.read_text() == ""
