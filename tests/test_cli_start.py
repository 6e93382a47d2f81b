"""The command line starts fast: `--help`, `--version`, `models`, `info` and `doctor` import no
numba, no compute kernels and no converter (ml_dtypes): the engine's and the library's names
load at first use, the kernels at their first call, and only the verb being run has its
parser built. Checked on the imports (sys.modules after the real entry point), not on time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import engine
import engine.library
from engine.cli import build_parser
from engine.cli.main import VERBS

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("numba", "engine.kernels", "ml_dtypes", "engine.convert", "engine.generate", "starlette")

SCRIPT = """
import json, sys
from colibri_app.launcher import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:  # argparse's --help / --version
    rc = e.code
loaded = sorted(m for m in sys.modules if m in {heavy!r})
# a LazyLoader module that never ran is not loaded: only count modules that executed
loaded = [m for m in loaded if type(sys.modules[m]).__name__ != "_LazyModule"]
print("LOADED " + json.dumps(loaded))
sys.exit(rc)
"""


def _start(*argv: str, env_extra: dict | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = dict(os.environ, **(env_extra or {}))
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(heavy=set(HEAVY)), *argv], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("LOADED ")]
    assert line, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    return p, json.loads(line[-1][len("LOADED "):])


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["models"], ["doctor", "--no-disk-test"],
                                  ["doctor", "--json", "--disk-test-mb", "1"], ["run", "--help"]])
def test_light_commands_import_no_kernels(argv, tmp_path):
    p, loaded = _start(*argv, env_extra={"COLIBRI_DATA_DIR": str(tmp_path / "data")})
    assert p.returncode == 0, p.stderr[-2000:]
    assert loaded == [], f"colibri {' '.join(argv)} imported {loaded}"


def test_info_imports_no_kernels(tiny_store):
    p, loaded = _start("info", str(tiny_store))
    assert p.returncode == 0 and "experts" in p.stdout, p.stderr[-2000:]
    assert loaded == [], loaded


def test_the_kernels_load_at_their_first_use():
    code = ("import sys, engine.models.base as b\n"
            "print(type(sys.modules['engine.kernels']).__name__)\n"
            "b.K.INT_FLAVOR\n"
            "import engine.kernels as k\n"
            "print(type(k).__name__, k is b.K, 'numba' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ)).stdout.split()
    assert out == ["_LazyModule", "module", "True", "True"], out


def test_every_public_name_resolves():
    for mod in (engine, engine.library):
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert missing == [], (mod.__name__, missing)
    assert callable(engine.library.download)  # the function, not its module of the same name
    import importlib
    importlib.import_module("engine.library.download")  # binding the submodule must not replace it
    assert callable(engine.library.download)


def test_the_verb_table_matches_the_parsers():
    full = build_parser()
    sub = next(a for a in full._actions if a.dest == "cmd")
    helps = {c.dest: c.help for c in sub._choices_actions}
    assert helps == {v: h for v, (_mod, h) in VERBS.items()}
    for verb in VERBS:  # a parser built for one verb parses it as the full one does
        assert set(next(a for a in build_parser(verb)._actions if a.dest == "cmd").choices) == set(VERBS)


@pytest.mark.parametrize("argv", [["run", "--prompt", "x", "--prof", "-v"], ["-v", "run", "--prompt", "x"],
                                  ["run", "--verbose", "--prompt", "x"], ["models", "-v"],
                                  ["bench", "disk", "-v"]])
def test_verbose_is_accepted_before_and_after_the_verb(argv):
    assert build_parser().parse_args(argv).verbose is True
    assert build_parser(argv[0] if argv[0] != "-v" else argv[1]).parse_args(argv).verbose is True


def test_without_verbose_it_is_off():
    assert build_parser().parse_args(["run", "--prompt", "x"]).verbose is False


@pytest.mark.parametrize("name,says", [("model.safetensors", "manifest.json"), ("m.gguf", "GGUF")])
def test_a_file_given_as_the_model_is_not_a_folder(tmp_path, capsys, name, says):
    """`--model FILE` said "unreadable or half-written ... re-run convert --overwrite"."""
    from engine.cli import main
    f = tmp_path / name
    f.write_bytes(b"\0" * 64)
    for argv in (["run", "--model", str(f), "--prompt", "hi"], ["info", str(f)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{f}: is a file, not a folder" in err and says in err, err
        assert "half-written" not in err and "Traceback" not in err
