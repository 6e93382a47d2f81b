"""The ``colibri`` console script (colibri_app.launcher): subcommands go to engine.cli, no
arguments start the app; every subcommand and bench verb answers --help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_app.launcher import main as colibri
from engine.bench import VERBS
from engine.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        colibri(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_of_every_command_and_bench_verb(capsys):
    top = _help(["--help"], capsys)
    for cmd in ("run", "convert", "info", "download", "models", "bench"):
        assert cmd in top
        assert "usage: colibri " + cmd in _help([cmd, "--help"], capsys)
    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    verbs = bench._subparsers._group_actions[0].choices
    assert len(verbs) >= len(VERBS)
    for verb in verbs:
        assert f"colibri bench {verb}" in _help(["bench", verb, "--help"], capsys)


def test_run_and_info_through_the_launcher(tiny_store, capsys):
    assert colibri(["info", str(tiny_store)]) == 0
    assert "experts     8 per MoE layer" in capsys.readouterr().out
    assert colibri(["run", "--model", str(tiny_store), "--prompt", "hello", "--raw", "--max-new-tokens", "3",
                    "--no-history", "--threads", "1"]) == 0
    assert capsys.readouterr().out.strip() != ""


def test_info_names_family_dense_layers_shared_expert_and_ram(tmp_path, capsys):
    from engine.synthetic import qwen2_moe_config, write_store_from_seed
    from engine import ModelArgs, sizing
    cfg = qwen2_moe_config(num_hidden_layers=3, mlp_only_layers=[1])
    store = write_store_from_seed(tmp_path / "q2", cfg, quant="int4")
    assert colibri(["info", str(store), "--context-length", "512"]) == 0
    out = capsys.readouterr().out
    est = sizing.estimate(ModelArgs.from_dict(cfg), "int4", 512)
    assert "Qwen2-MoE (qwen2_moe)" in out and "2 MoE (routed experts), 1 dense MLP (layers 1" in out
    assert "top-2" in out and "shared expert per MoE layer, width 64" in out
    assert f"at least {sizing.format_bytes(est.ram_needed)} at 512 tokens" in out
    assert f"{sizing.format_bytes(est.slot_bytes)} each" in out


def test_no_arguments_start_the_app(tmp_path):
    """``colibri`` with no arguments builds the main window (start() replaced by a close, so
    no model is opened) and returns the app's exit code."""
    code = (
        "import sys\n"
        "from colibri_app import main_window\n"
        "def start(self):\n"
        "    print('WINDOW', type(self).__name__, flush=True)\n"
        "    from PySide6.QtCore import QTimer\n"
        "    QTimer.singleShot(0, self.close)\n"
        "main_window.MainWindow.start = start\n"
        "from colibri_app.launcher import main\n"
        "sys.exit(main([]))\n")
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "COLIBRI_DATA_DIR": str(tmp_path / "d"),
           "COLIBRI_CONFIG_DIR": str(tmp_path / "c")}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "WINDOW MainWindow" in r.stdout, r.stderr[-3000:]
