"""The settings table (engine/settings.py) is the one declaration of every setting: the CLI
flags, the validation, the settings file and the settings dialog all follow from it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import ENGINE, SAMPLING, ConfigError, EngineConfig, SamplingParams, settings_table, validate
from engine.cli import build_parser
from engine.cli.flags import engine_config, sampling_params
from engine.sampling import Sampler

ROOT = Path(__file__).resolve().parent.parent

DUMMY = ('    _S("dummy_knob", int, 3, "a knob only this test turns", "Dummy knob", lo=0, hi=9, '
         'unit="knobs"),\n')

PROBE = r"""
import contextlib, io, json, os, sys
from dataclasses import replace
import pytest
from engine import ConfigError, EngineConfig
from engine.cli import build_parser
from engine.cli.flags import engine_config

# CLI help and flag
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    build_parser().parse_args(["run", "--help"])
assert "--dummy-knob" in help_text.getvalue() and "a knob only this test turns" in help_text.getvalue()
a = build_parser().parse_args(["run", "--prompt", "x", "--dummy-knob", "7"])
assert engine_config(a, "store").dummy_knob == 7
# the one validation
assert EngineConfig().dummy_knob == 3
with pytest.raises(ConfigError, match="dummy_knob"):
    EngineConfig(dummy_knob=10).validated()
with pytest.raises(ConfigError, match="dummy_knob"):
    engine_config(build_parser().parse_args(["run", "--prompt", "x", "--dummy-knob", "12"]), "store")
# the settings file
from colibri_app.settings_store import RELOAD_FIELDS, Settings, load_settings, save_settings, settings_path
assert "dummy_knob" in RELOAD_FIELDS
s = Settings(engine=EngineConfig(dummy_knob=5))
save_settings(s)
assert json.loads(settings_path().read_text())["engine"]["dummy_knob"] == 5
assert load_settings() == (s, None)
# the dialog
from PySide6.QtWidgets import QApplication, QSpinBox
app = QApplication.instance() or QApplication([])
from colibri_app.settings_dialog import SettingsDialog
d = SettingsDialog(s)
w = d.fields["dummy_knob"]
assert isinstance(w, QSpinBox) and (w.minimum(), w.maximum()) == (0, 9) and w.suffix() == " knobs"
assert "knob only this test turns" in w.toolTip() and "0–9 knobs" in w.toolTip()
assert w.value() == 5
w.setValue(8)
assert d.current_settings().engine.dummy_knob == 8
print("DUMMY OK")
"""


def _copy_tree(dst: Path) -> None:
    for pkg in ("engine", "colibri_app"):
        shutil.copytree(ROOT / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))


def test_a_new_setting_is_one_declaration(tmp_path):
    """Add one Setting line to the table in a copy of the tree: it shows up in `colibri run
    --help` and as a flag, is validated, saved in the settings file, and gets a dialog widget."""
    tree = tmp_path / "tree"
    _copy_tree(tree)
    p = tree / "engine" / "settings.py"
    text = p.read_text(encoding="utf-8")
    anchor = "ENGINE_SETTINGS: tuple[Setting, ...] = (\n"
    assert text.count(anchor) == 1
    p.write_text(text.replace(anchor, anchor + DUMMY), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(tree), "QT_QPA_PLATFORM": "offscreen",
           "COLIBRI_DATA_DIR": str(tmp_path / "data"), "COLIBRI_CONFIG_DIR": str(tmp_path / "config")}
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "DUMMY OK" in r.stdout, r.stderr[-4000:]


def test_flag_names_are_the_file_keys():
    p = build_parser()
    run = p._subparsers._group_actions[0].choices["run"]
    dests = {a.dest: a.option_strings for a in run._actions}
    for s in settings_table(ENGINE) + settings_table(SAMPLING):  # APP settings are the app's alone
        assert s.flag == "--" + s.name.replace("_", "-")
        assert s.flag in dests[s.name], s.name
    names = [s.name for s in settings_table(ENGINE)]
    assert names == [f for f in EngineConfig.__dataclass_fields__ if f != "store"]
    assert [s.name for s in settings_table(SAMPLING)] == list(SamplingParams.__dataclass_fields__)
    assert "pin_per_layer" in names and "threads" in names and "numba_threads" not in names


def test_cli_flags_and_old_names():
    a = build_parser().parse_args(["run", "--prompt", "x", "--cap", "auto", "--ram-budget-gb", "3.5",
                                   "--no-pinning", "--pin-per-layer", "2", "--numba-threads", "2", "--top-p", "0.5"])
    cfg = engine_config(a, "st")
    assert (cfg.cap, cfg.ram_budget_gb, cfg.pinning, cfg.pin_per_layer, cfg.threads) == (None, 3.5, False, 2, 2)
    assert sampling_params(a).top_p == 0.5
    assert EngineConfig.from_dict({"numba_threads": 3}).threads == 3  # an old settings file


def test_cli_refuses_bad_values_without_traceback(capsys):
    from engine.cli import main
    assert main(["run", "--prompt", "x", "--model", "nowhere", "--wide", "9"]) == 2
    err = capsys.readouterr().err
    assert "setting 'wide' = 9" in err and "1–4" in err and "Traceback" not in err


@pytest.mark.parametrize("name,value", [("top_p", 0.0), ("temperature", 6.0), ("repetition_penalty", 0.1),
                                        ("seed", -1), ("max_new_tokens", 0), ("top_k", 1.5)])
def test_one_sampling_validation(name, value, tmp_path):
    """The Sampler and the settings file refuse the same values with the same message."""
    bad = SamplingParams(**{name: value})
    with pytest.raises(ConfigError) as e1:
        Sampler(bad)
    with pytest.raises(ConfigError) as e2:
        validate(bad, SAMPLING)
    assert str(e1.value) == str(e2.value) and name in str(e1.value)
    from colibri_app.settings_store import Settings
    text = json.loads(Settings().to_json())
    text["sampling"][name] = value
    with pytest.raises(ConfigError, match=name):
        Settings.from_json(json.dumps(text))


def test_engine_config_range_checks():
    with pytest.raises(ConfigError, match="cap"):
        EngineConfig(cap=0).validated()
    with pytest.raises(ConfigError, match="cap"):
        EngineConfig(cap=70000).validated()  # the dialog's range is the validation's range
    with pytest.raises(ConfigError, match="policy"):
        EngineConfig(policy="fifo").validated()
    with pytest.raises(ConfigError, match="pinning"):
        EngineConfig(pinning=1).validated()
    assert EngineConfig(cap=None, ram_budget_gb=None).validated().cap is None


def test_old_settings_file_key_is_read():
    from colibri_app.settings_store import Settings
    d = json.loads(Settings().to_json())
    d["engine"].pop("threads")
    d["engine"]["numba_threads"] = 2
    s = Settings.from_json(json.dumps(d))
    assert s.engine.threads == 2 and '"threads": 2' in s.to_json() and "numba_threads" not in s.to_json()
