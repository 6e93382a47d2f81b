"""Import layering: the engine never imports Qt, pyqtgraph or the app; the app only uses the
engine's public API (``from engine import ...``), never its submodules."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_FOR_ENGINE = ("PySide6", "shiboken6", "pyqtgraph", "colibri_app")

BLOCKER = r"""
import importlib, importlib.abc, pkgutil, sys
FORBIDDEN = %r
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError(f"engine must not import {name}")
        return None
sys.meta_path.insert(0, Block())
import engine
names = ["engine"] + [f"engine.{m.name}" for m in pkgutil.iter_modules(engine.__path__)]
for n in names:
    importlib.import_module(n)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
assert not leaked, leaked
print(len(names))
"""


def test_engine_imports_without_qt_or_app():
    code = BLOCKER % (FORBIDDEN_FOR_ENGINE,)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    n = int(r.stdout.strip().splitlines()[-1])
    assert n == 1 + len(list(pkgutil.iter_modules([str(ROOT / "engine")])))


def _engine_imports(path: Path) -> list[str]:
    """Every way ``path`` reaches into the engine other than ``from engine import name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "engine" or a.name.startswith("engine."):
                    if a.name != "engine":
                        bad.append(f"{path.name}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("engine."):
                bad.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
            elif node.module == "engine":
                exported = set(_engine_all())
                for a in node.names:
                    if a.name not in exported:
                        bad.append(f"{path.name}:{node.lineno}: engine.{a.name} is not in engine.__all__")
    return bad


def _engine_all() -> list[str]:
    tree = ast.parse((ROOT / "engine" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("engine/__init__.py has no __all__")


def _app_files() -> list[Path]:
    files = sorted((ROOT / "colibri_app").rglob("*.py"))
    assert files
    return files


def test_app_never_imports_engine_submodules():
    """No ``import engine.x`` and no ``from engine.x import ...`` anywhere in colibri_app."""
    bad = [b for f in _app_files() for b in _engine_imports(f) if "__all__" not in b]
    assert bad == []


def test_app_imports_only_names_in_engine_all():
    """``from engine import name`` only for names engine/__init__.py exports in __all__
    (``from engine import some_submodule`` would reach around the public API)."""
    bad = [b for f in _app_files() for b in _engine_imports(f) if "__all__" in b]
    assert bad == [], ("colibri_app imports names engine/__init__.py does not export; export them "
                       "there (public API) or stop using them: " + "; ".join(bad))


def test_the_checker_catches_violations(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("import engine.model\nfrom engine.generate import Engine\nfrom engine import Engine, _secret\n"
                 "import engine\n")
    bad = _engine_imports(p)
    assert len(bad) == 3 and "_secret" in bad[2]
