"""Import layering, checked on the source (AST: every import statement anywhere, function bodies
included, relative imports resolved, ``importlib.import_module("literal")`` too) and by
importing every engine module with Qt and the app blocked.

Floors (docs/architecture.md), lowest first; a module may import its own floor and the ones
below, never one above:

    0 core      engine/*.py and any engine subpackage other than the four below
    1 library   engine/library/
    2 server    engine/server/
    3 bench     engine/bench/
    4 cli       engine/cli/
    5 app       colibri_app/

The engine never imports Qt (PySide6, shiboken6), pyqtgraph or colibri_app. colibri_app uses
only the public API: names in ``engine.__all__``, ``engine.library.__all__`` and
``engine.server.__all__``, and the CLI's
``main`` (in the launcher only).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("core", "library", "server", "bench", "cli", "app")
APP = len(FLOORS) - 1
QT = ("PySide6", "shiboken6", "pyqtgraph")
APP_MAY_IMPORT = {"engine": "engine/__init__.py", "engine.library": "engine/library/__init__.py",
                  "engine.server": "engine/server/__init__.py"}
CLI_ENTRY = ("engine.cli", "main")  # the launcher's one reach into the CLI


def floor_of(module: str) -> int | None:
    """The floor of a dotted module name, or None for modules outside the project."""
    top = module.split(".")
    if top[0] == "colibri_app":
        return APP
    if top[0] != "engine":
        return None
    if len(top) > 1 and top[1] in FLOORS[1:APP]:
        return FLOORS.index(top[1])
    return 0


def module_name(root: Path, path: Path) -> str:
    """Dotted name of ``path`` under ``root`` (package __init__ -> the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(root: Path, dotted: str) -> bool:
    p = root.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports_of(root: Path, path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """Every import in ``path`` as (line, module, imported names); relative imports resolved
    against the module's package; ``from P import x`` gives P.x when that is a module."""
    mod = module_name(root, path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = tuple(a.name for a in node.names)
            subs = [f"{target}.{n}" for n in names if _is_module(root, f"{target}.{n}")]
            out += [(node.lineno, s, ()) for s in subs]
            rest = tuple(n for n in names if f"{target}.{n}" not in subs)
            if rest or not subs:
                out.append((node.lineno, target, rest))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__"):
                target = node.args[0].value
                if target.startswith("."):  # import_module(".x", __package__)
                    target = pkg + target if target != "." else pkg
                out.append((node.lineno, target, ()))
    return out


def _exported(root: Path, rel: str) -> set[str]:
    tree = ast.parse((root / rel).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{rel} has no __all__")


def check_tree(root: Path) -> list[str]:
    """Every layering violation under ``root`` (its engine/ and colibri_app/), one line each."""
    bad = []
    files = sorted((root / "engine").rglob("*.py")) + sorted((root / "colibri_app").rglob("*.py"))
    exported = {m: _exported(root, rel) for m, rel in APP_MAY_IMPORT.items() if (root / rel).is_file()}
    for path in files:
        mod = module_name(root, path)
        me = floor_of(mod)
        where = f"{path.relative_to(root)}"
        for line, target, names in imports_of(root, path):
            top = target.split(".")[0]
            f = floor_of(target)
            if me < APP and (top in QT or top == "colibri_app"):
                bad.append(f"{where}:{line}: the engine imports {target}")
            elif f is not None and f > me:
                bad.append(f"{where}:{line}: {FLOORS[me]} imports {target} ({FLOORS[f]}, a floor above)")
            elif me == APP and f is not None and f < APP:
                if target in exported:
                    missing = [n for n in names if n not in exported[target]]
                    if missing:
                        bad.append(f"{where}:{line}: {', '.join(missing)} not in {target}.__all__")
                elif path.name != "launcher.py" or (target, names) not in (
                        (CLI_ENTRY[0], (CLI_ENTRY[1],)), (".".join(CLI_ENTRY), ())):
                    bad.append(f"{where}:{line}: the app imports {target} (only engine, engine.library, "
                               f"engine.server and, in launcher.py, engine.cli.main)")
    return bad


def test_tree_respects_the_floors():
    assert check_tree(ROOT) == []


def core_circles(root: Path, every_floor: bool = False) -> list[list[str]]:
    """Every import circle among the core's modules (floor 0; every engine module when
    ``every_floor``) under ``root``: the modules of each strongly connected component of more
    than one module of the import graph (every import statement, function bodies included, as
    imports_of reads them), each sorted."""
    mods = {module_name(root, p): p for p in sorted((root / "engine").rglob("*.py"))}
    core = {m for m in mods if every_floor or floor_of(m) == 0}
    graph = {m: sorted({t for _line, t, _names in imports_of(root, mods[m]) if t in core and t != m}) for m in core}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []
    for start in sorted(graph):  # Tarjan's algorithm, iterative (no recursion limit on deep chains)
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
            if i < len(graph[v]):
                work.append((v, i + 1))
                w = graph[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
    return sorted(out)


def test_core_has_no_import_circle():
    """A circle ties its modules together: none can be read, tested or imported alone."""
    assert core_circles(ROOT) == []


def test_engine_has_no_import_circle_on_any_floor():
    """Above the core as well (the server's two APIs, the library's checks, the benches, the CLI)."""
    assert core_circles(ROOT, every_floor=True) == []


def _mini_tree(tmp_path: Path) -> Path:
    for d in ("engine/library", "engine/server", "engine/bench", "engine/cli", "colibri_app"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / d / "__init__.py").write_text("__all__ = ['ok']\nok = 1\n")
    (tmp_path / "engine" / "core_mod.py").write_text("import numpy\nfrom . import errors\n")
    (tmp_path / "engine" / "errors.py").write_text("")
    (tmp_path / "engine" / "library" / "lib_mod.py").write_text("from ..errors import x\n")
    (tmp_path / "engine" / "cli" / "main.py").write_text("from ..bench import y\nfrom ..library import z\n")
    (tmp_path / "engine" / "bench" / "srv.py").write_text("from ..server import ok\n")
    (tmp_path / "engine" / "server" / "api.py").write_text("from ..library import ok\nfrom .. import errors\n")
    (tmp_path / "colibri_app" / "launcher.py").write_text("def main():\n    from engine.cli import main\n")
    return tmp_path


def test_checker_passes_a_clean_tree(tmp_path):
    assert check_tree(_mini_tree(tmp_path)) == []


def test_checker_catches_an_upward_import_in_a_function_body(tmp_path):
    root = _mini_tree(tmp_path)
    (root / "engine" / "core_mod.py").write_text(
        "import numpy\n\n\ndef helper():\n    if True:\n        from .library import lib_mod\n    return lib_mod\n")
    bad = check_tree(root)
    assert len(bad) == 1 and "core_mod.py:6" in bad[0] and "engine.library.lib_mod" in bad[0], bad


def test_circle_check_finds_a_planted_circle(tmp_path):
    """Two core modules that import each other (one inside a function) and a third that joins
    them through a subpackage are one circle; a one-way import is none."""
    root = _mini_tree(tmp_path)
    assert core_circles(root) == []
    (root / "engine" / "models").mkdir()
    (root / "engine" / "models" / "__init__.py").write_text("from . import base\n")
    (root / "engine" / "models" / "base.py").write_text("def f():\n    from ..core_mod import x\n")
    (root / "engine" / "core_mod.py").write_text("import numpy\nfrom .tok import y\n")
    (root / "engine" / "tok.py").write_text("from .models.base import f\n")
    assert core_circles(root) == [["engine.core_mod", "engine.models.base", "engine.tok"]]
    (root / "engine" / "models" / "base.py").write_text("def f():\n    from ..errors import x\n")
    assert core_circles(root) == []


def test_circle_check_on_every_floor_finds_a_circle_in_a_package(tmp_path):
    """Two server modules that import each other (one inside a function) are a circle the core
    check does not see and the check on every floor does."""
    root = _mini_tree(tmp_path)
    assert core_circles(root, every_floor=True) == []
    (root / "engine" / "server" / "other.py").write_text("def f():\n    from .api import ok\n")
    (root / "engine" / "server" / "api.py").write_text("from ..library import ok\nfrom .other import f\n")
    assert core_circles(root) == []
    assert core_circles(root, every_floor=True) == [["engine.server.api", "engine.server.other"]]


def test_checker_catches_every_kind(tmp_path):
    root = _mini_tree(tmp_path)
    (root / "engine" / "library" / "lib_mod.py").write_text(
        "import importlib\n\n\ndef f():\n    importlib.import_module('engine.bench')\n\n\n"
        "def g():\n    from .. import cli\n")
    (root / "engine" / "bench" / "b.py").write_text("def f():\n    import engine.cli.main\n")
    (root / "engine" / "server" / "s.py").write_text("from ..bench import y\n")
    (root / "engine" / "errors.py").write_text("def f():\n    from PySide6 import QtCore\n    import colibri_app\n")
    (root / "colibri_app" / "w.py").write_text("from engine.library import ok, secret\nimport engine.model\n"
                                               "from engine.cli import main\n")
    bad = "\n".join(check_tree(root))
    for needle in ("lib_mod.py:5: library imports engine.bench", "lib_mod.py:9: library imports engine.cli",
                   "b.py:2: bench imports engine.cli.main", "s.py:1: server imports engine.bench",
                   "errors.py:2: the engine imports PySide6",
                   "errors.py:3: the engine imports colibri_app", "w.py:1: secret not in engine.library.__all__",
                   "w.py:2: the app imports engine.model", "w.py:3: the app imports engine.cli"):
        assert needle in bad, (needle, bad)


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
names = ["engine"] + [m.name for m in pkgutil.walk_packages(engine.__path__, "engine.")
                      if not m.name.endswith("__main__")]
for n in names:
    importlib.import_module(n)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
assert not leaked, leaked
print(len(names))
"""


def test_engine_imports_without_qt_or_app():
    r = subprocess.run([sys.executable, "-c", BLOCKER % (QT + ("colibri_app",),)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    n = int(r.stdout.strip().splitlines()[-1])
    assert n == 1 + sum(1 for p in (ROOT / "engine").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")) \
        + sum(1 for p in (ROOT / "engine").rglob("__init__.py") if p.parent != ROOT / "engine")


def test_core_import_does_not_load_the_upper_floors():
    """``import engine`` (what the app and every test do first) loads only the core."""
    code = "import sys, engine; print(sorted(m for m in sys.modules if m.startswith(('engine.library', " \
           "'engine.server', 'engine.bench', 'engine.cli'))))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


MAX_MODULE_LINES = 900  # a module a newcomer can read in one sitting
MAX_CLASS_LINES = 500
SIZE_EXCEPTIONS: set[str] = set()  # modules still to be split (none)


def oversized(root: Path) -> list[str]:
    """Engine modules over MAX_MODULE_LINES lines and classes over MAX_CLASS_LINES (from the
    class line to its last statement), as "path: what, n lines"."""
    out = []
    for p in sorted((root / "engine").rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel in SIZE_EXCEPTIONS:
            continue
        src = p.read_text(encoding="utf-8")
        n = len(src.splitlines())
        if n > MAX_MODULE_LINES:
            out.append(f"{rel}: module, {n} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                out.append(f"{rel}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    return out


def test_no_engine_module_or_class_is_too_long_to_read():
    """Split a long module by concern (a class by the parts it composes), as models/base.py and
    generate.py are."""
    assert oversized(ROOT) == []


def test_size_check_finds_a_long_module_and_a_long_class(tmp_path):
    root = _mini_tree(tmp_path)
    assert oversized(root) == []
    (root / "engine" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (root / "engine" / "wide.py").write_text("class C:\n" + "    x = 1\n" * MAX_CLASS_LINES)
    assert oversized(root) == [f"engine/long.py: module, {MAX_MODULE_LINES + 1} lines",
                               f"engine/wide.py: class C, {MAX_CLASS_LINES + 1} lines"]
