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
    from engine.bench.synthetic import qwen2_moe_config, write_store_from_seed
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


def test_make_synthetic_presets_and_direct_store(tmp_path, monkeypatch, capsys):
    """The published-shape presets are offered; --direct-store writes the quantized store from
    the seed (a tiny preset stands in for the big shapes) and records the run."""
    import json
    from engine import Engine, EngineConfig
    from engine.bench import synthetic
    from engine.bench.make_synthetic import preset_config, preset_names
    assert {"1b", "olmoe-1b-7b", "qwen3-30b-a3b", "mixtral-8x7b"} <= set(preset_names())
    assert preset_config("qwen3-30b-a3b") == synthetic.PRESETS["qwen3-30b-a3b"]
    assert preset_config("1b")["model_type"] == "olmoe"
    monkeypatch.setitem(synthetic.PRESETS, "tiny-qwen3", synthetic.qwen3_moe_config(mlp_only_layers=[0],
                                                                                    num_hidden_layers=3))
    monkeypatch.chdir(tmp_path)
    assert colibri(["bench", "make-synthetic", "--preset", "tiny-qwen3", "--direct-store", "--quant", "f16"]) == 2
    assert "--direct-store writes --quant int8 or int4" in capsys.readouterr().err
    assert colibri(["bench", "make-synthetic", "--preset", "tiny-qwen3", "--direct-store", "--quant", "int4",
                    "--out", "work"]) == 0
    store = tmp_path / "work" / "tiny-qwen3-int4"
    assert not (tmp_path / "work" / "tiny-qwen3-hf").exists()
    m = json.loads((store / "manifest.json").read_text())
    assert m["model_type"] == "qwen3_moe" and m["quant"] == "int4" and m["num_layers"] == 2
    res = json.loads((tmp_path / "bench/results/make_synthetic_tiny-qwen3_int4_direct.json").read_text())
    assert res["mode"] == "direct-store" and res["store_gb"] > 0
    with Engine.open(EngineConfig(store=str(store), context_length=64, history=False)) as eng:
        assert eng.args.num_moe_layers == 2


def test_make_synthetic_reduced_layers(tmp_path, monkeypatch, capsys):
    """--layers / --dense-layers cut a preset down (for DeepSeek-V3-shaped stores that would not
    fit the disk): the store has that many layers, the folder and the results say so, and a
    layer count the preset cannot have is refused with the reason."""
    import json
    from engine.bench import synthetic
    monkeypatch.setitem(synthetic.PRESETS, "tiny-v3", synthetic.deepseek_v3_config(num_hidden_layers=4,
                                                                                   first_k_dense_replace=2))
    monkeypatch.chdir(tmp_path)
    for bad, why in ((["--layers", "9"], "give 1..4"), (["--layers", "2"], "more than its 2 dense first layers"),
                     (["--layers", "3", "--dense-layers", "3"], "fewer than the layers kept")):
        assert colibri(["bench", "make-synthetic", "--preset", "tiny-v3", "--direct-store", "--quant", "int4",
                        "--out", "work", *bad]) == 2
        assert why in capsys.readouterr().err
    assert colibri(["bench", "make-synthetic", "--preset", "tiny-v3", "--direct-store", "--quant", "int4",
                    "--out", "work", "--layers", "3", "--dense-layers", "1"]) == 0
    m = json.loads((tmp_path / "work" / "tiny-v3-3l-1d-int4" / "manifest.json").read_text())
    assert m["model_type"] == "deepseek_v3" and m["num_layers"] == 2  # MoE layers: 3 kept, 1 dense
    res = json.loads((tmp_path / "bench/results/make_synthetic_tiny-v3-3l-1d_int4_direct.json").read_text())
    assert res["num_hidden_layers"] == 3


@pytest.mark.parametrize("ctx,said", [("-5", "setting 'context_length' = -5"),
                                      ("4096", "more than .* was trained for \\(2048 tokens\\)")])
def test_info_refuses_a_context_length_run_would_refuse(tmp_path, capsys, ctx, said):
    """`colibri info --context-length` takes the values `colibri run` takes: a negative one or
    one past the model's max_position_embeddings is one error line, not a RAM estimate "at -5
    tokens" (before the fix)."""
    import re

    from engine.bench.synthetic import qwen3_next_config, write_store_from_seed
    store = write_store_from_seed(tmp_path / "qn", qwen3_next_config(num_hidden_layers=2), quant="int8")
    assert colibri(["info", str(store), "--context-length", ctx]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("colibri: error:") and len(err.splitlines()) == 1 and re.search(said, err), err


def test_ctrl_c_that_a_ctypes_callback_swallows_still_stops_run(tiny_store, monkeypatch, capsys):
    """A Ctrl+C that lands while the main thread runs a ctypes callback (llvmlite's, as numba
    loads a cached kernel) raises a KeyboardInterrupt that ctypes prints and drops: ``colibri
    run`` ran its answer to the end (a new user's report, 1 of ~13 tries). The SIGINT handler
    of ``run`` also sets the generation's cancel flag, so the engine stops at its next layer.
    Here the signal is raised after the first token inside a handler that drops the
    KeyboardInterrupt, as ctypes does. Python's own SIGINT handler is put in place first, as in
    a terminal: a pytest started as a background job of a script inherits SIGINT ignored,
    where ``run`` rightly installs nothing (no Ctrl+C can come) and the signal is lost."""
    import dataclasses
    import signal
    from engine.events import TokenEvent
    from engine.generate import Engine
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    real = Engine.generate
    seen = []

    def generate(self, req, cancel=None):
        req = dataclasses.replace(req, forced_ids=tuple(range(5, 205)))  # no end-of-text stops it early
        for ev in real(self, req, cancel):
            if isinstance(ev, TokenEvent):
                seen.append(ev.token_id)
                if len(seen) == 1:
                    try:
                        signal.raise_signal(signal.SIGINT)
                    except KeyboardInterrupt:
                        pass  # what ctypes does with an exception raised in a callback
            yield ev
    monkeypatch.setattr(Engine, "generate", generate)
    try:
        assert colibri(["run", "--model", str(tiny_store), "--prompt", "hello", "--raw", "--max-new-tokens", "200",
                        "--no-history", "--threads", "1"]) == 0
        assert 1 <= len(seen) < 10, len(seen)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
    finally:
        signal.signal(signal.SIGINT, outside)


def test_a_busy_port_and_a_disk_error_read_as_one_plain_line(tiny_store, tmp_path, capsys):
    import socket
    from engine.cli import main as cli
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert cli(["serve", "--model", str(tiny_store), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "choose another port" in err
    assert "[Errno" not in err
    from engine import error_text
    gone = tmp_path / "gone.json"
    try:
        gone.read_text()
    except OSError as e:
        assert error_text(e) == f"No such file or directory: '{gone}'"


def test_serve_refuses_a_busy_port_before_it_converts_the_default_model(monkeypatch, capsys):
    """Without --model, the first `colibri serve` converts the bundled model (a minute): a busy
    port must be said before that work, not after it."""
    import socket
    import engine.cli.serve as serve_cli
    from engine.cli import main as cli
    resolved = []
    monkeypatch.setattr(serve_cli, "resolve_store", lambda model: resolved.append(model))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert cli(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert resolved == []


def test_the_answer_ends_its_line_before_the_notes_when_both_go_to_one_file(tiny_store, tmp_path, monkeypatch):
    """`colibri run ... 2>&1 | tee log`: stdout is block-buffered there, stderr is not; the
    answer's closing newline came after the notes ("...answer.seed 7 (--seed 7 ...)")."""
    log_path = tmp_path / "both.log"
    out = open(log_path, "a", encoding="utf-8")              # a pipe's buffering: by blocks
    err = open(log_path, "a", encoding="utf-8", buffering=1)  # stderr: by lines
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    try:
        assert colibri(["run", "--model", str(tiny_store), "--prompt", "hello", "--raw", "--max-new-tokens", "3",
                        "--temperature", "0.7", "--no-history", "--threads", "1"]) == 0
    finally:
        out.close()
        err.close()
    text = log_path.read_text(encoding="utf-8")
    assert "\nseed " in text and text.endswith("reproduces this answer)\n"), text
