"""`pip install .` carries the bundled model: the wheel holds resources/models as the
data-only package ``colibri_resources``; installed into a fresh venv, ``colibri run`` answers
from outside the repository with the bundled model."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL = "colibri-stdlib-moe"


def test_every_package_is_listed_in_pyproject():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for top in ("engine", "colibri_app")
             for p in (REPO / top).rglob("__init__.py") if "__pycache__" not in p.parts}
    assert found | {"colibri_resources"} == listed, ("pyproject.toml [tool.setuptools] packages must list every "
                                                     f"package: missing {sorted(found - listed)}")
    assert cfg["package-dir"]["colibri_resources"] == "resources"


def _copy_source(dst: Path) -> Path:
    """The files a build needs (no .git, caches, build/ or egg-info left in the repo)."""
    src = dst / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for d in ("engine", "colibri_app", "resources"):
        shutil.copytree(REPO / d, src / d, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / f, src / f)
    return src


@pytest.mark.slow  # builds the wheel and installs it into a fresh venv
def test_wheel_carries_the_model_and_colibri_run_answers(tmp_path):
    if not (REPO / "resources" / "models" / MODEL / "model.safetensors").exists():
        pytest.skip("default model not trained yet")
    src = _copy_source(tmp_path)
    dist = tmp_path / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)]
    if importlib.util.find_spec("setuptools") is not None:
        build.insert(5, "--no-build-isolation")   # offline: the setuptools already here
    subprocess.run(build, check=True, cwd=tmp_path, timeout=600)
    wheel = next(dist.glob("colibri_desktop-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert f"colibri_resources/models/{MODEL}/{f}" in names, f
    assert not any(n.startswith(("resources/", "tests/", "tools/")) for n in names)

    # a fresh venv: our package from the wheel only; its dependencies (numpy, numba, ...) are
    # this interpreter's, reached through a .pth of plain paths (the .pth files inside them,
    # e.g. an editable install of this repo, are not run)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "_colibri_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                    "-q", str(wheel)], check=True, timeout=600)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "COLIBRI_", "VIRTUAL_ENV"))}
    env.update(COLIBRI_DATA_DIR=str(tmp_path / "data"), COLIBRI_CONFIG_DIR=str(tmp_path / "config"),
               PYTHONNOUSERSITE="1", QT_QPA_PLATFORM="offscreen")
    where = subprocess.run([str(py), "-c", "import engine, engine.library as l; print(engine.__file__); "
                            "print(l.default_model_dir())"], cwd=outside, env=env, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    assert where[0].startswith(str(purelib)), where            # the installed copy, not the repo
    assert where[1] == str(purelib / "colibri_resources" / "models" / MODEL), where
    r = subprocess.run([str(venv / "bin" / "colibri"), "run", "--prompt", "What does `json.dumps` do?",
                        "--max-new-tokens", "24", "--ram-budget-gb", "2"],   # auto follows the RAM free now
                       cwd=outside, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), r.stderr[-3000:]
    assert (tmp_path / "data" / "models" / f"{MODEL}-int8" / "manifest.json").exists()
