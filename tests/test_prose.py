"""The project's prose stays documentation: no work-log numbering in code, docs or results,
every file the docs name exists, and setting help texts (which reach `colibri run --help` and
the app's tooltips) speak to users, not of the repository's files."""

import ast
import functools
import glob
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("engine", "colibri_app", "tools", "tests", "bench", "docs", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".json", ".txt", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".spec", ".desktop", ".sh"}
SKIP_DIRS = {"__pycache__", "work", ".pytest_cache"}
# "session" followed by a number, as words or inside a file name; the pattern is split so that
# this file does not match itself
WORK_LOG = re.compile(r"(?i)\bsess" r"ions?[ _-]?\d|_sess" r"ion\d")
# the project speaks of itself, not of its tracker
ISSUE_NUMBER = re.compile(r"(?i)\biss" r"ues? #?\d")
ISSUE_SCANNED = ("engine", "colibri_app", "tools", "tests", "docs", "bench/README.md")
DOCS = ["README.md", "bench/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
TOP_DIRS = "engine|colibri_app|tests|tools|docs|bench|packaging|resources"
REPO_PATH = re.compile(r"(?<![\w/.$-])((?:" + TOP_DIRS + r")/[\w./*{},-]*[\w*}])")
BARE_PY = re.compile(r"(?<![\w/.$-])(\w+\.py)\b")
RESULT_PREFIXES = ("cache|cluster|contention|decode|gui|kernels|layouts|make_synthetic|markdown|matrix|overlap|"
                   "peers|pilot|refactor|replay|serve|stream")
RESULT_NAME = re.compile(r"`((?:" + RESULT_PREFIXES + r")_[\w*-]+)(?:\.(?:json|md|png))?`")


def _files(top: str):
    path = ROOT / top
    if path.is_file():
        yield path
        return
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            yield Path(dirpath) / name


def _expand(path: str) -> list[str]:
    """Brace alternatives ("x.{json,md}") expanded; globs kept for glob()."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


@functools.lru_cache(maxsize=1)
def _engine_identifiers() -> frozenset:
    """The names the engine's code defines or uses (functions, attributes, arguments), not its
    strings, so a result's default file name does not count as code; in the server, also the
    request fields it reads (`cache_control`, `stream_options`: strings there, names of the APIs)."""
    words = set()
    server = ROOT / "engine" / "server"
    for f in _files("engine"):
        if f.suffix == ".py":
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                for field in ("id", "attr", "name", "arg"):
                    value = getattr(node, field, None)
                    if isinstance(value, str):
                        words.add(value)
                if (server in f.parents and isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and node.value.isidentifier()):
                    words.add(node.value)
    return frozenset(words)


def _exists(path: str) -> bool:
    return bool(glob.glob(str(ROOT / path))) if "*" in path else (ROOT / path).exists()


def test_no_work_log_numbering_in_code_docs_or_result_names():
    found = []
    for top in SCANNED:
        for f in _files(top):
            rel = f.relative_to(ROOT)
            if WORK_LOG.search(f.name) or "review" in f.name or re.search(r"(?i)issue[\W_]?\d", f.name):
                found.append(f"{rel} (file name)")
            if f.suffix not in TEXT_SUFFIXES and f.name != "README.md":
                continue
            for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if WORK_LOG.search(line):
                    found.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not found, "say what the code does and why, not when it was measured:\n" + "\n".join(found)


def test_no_issue_numbers_in_code_or_docs():
    found = []
    for top in ISSUE_SCANNED:
        for f in _files(top):
            if f.suffix not in TEXT_SUFFIXES:
                continue
            for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if ISSUE_NUMBER.search(line):
                    found.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "say what the code does and why, not which issue asked for it:\n" + "\n".join(found)


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_a_doc_names_exists(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = []
    for raw in REPO_PATH.findall(text):
        if raw.startswith("bench/work"):  # benchmark scratch output, made by the commands
            continue
        for path in _expand(raw.split("::")[0]):
            if not _exists(path):
                missing.append(path)
    names = {p.name for top in ("engine", "colibri_app", "tools", "tests", "packaging") for p in _files(top)}
    missing += [name for name in BARE_PY.findall(text) if name not in names]
    identifiers = _engine_identifiers()  # `cache_take_resident`, `pilot_draft` are code, not results
    results = ROOT / "bench" / "results"
    missing += [f"bench/results/{name}" for name in RESULT_NAME.findall(text) if name not in identifiers
                if not glob.glob(str(results / (name.rstrip("*") + "*")))]
    assert not missing, f"{doc} names files that do not exist: {sorted(set(missing))}"


def test_setting_help_texts_name_no_files():
    from engine.settings import APP_SETTINGS, ENGINE_SETTINGS, SAMPLING_SETTINGS

    file_like = re.compile(r"[\w-]+\.(?:md|py|json|jsonl|toml|txt|png|csv)\b|\b(?:bench|tools|tests|docs)/")
    bad = [f"{s.name}: {s.help}" for s in (*ENGINE_SETTINGS, *SAMPLING_SETTINGS, *APP_SETTINGS)
           if file_like.search(s.help) or WORK_LOG.search(s.help)]
    assert not bad, "help texts are for users (no file names, no measurement logs):\n" + "\n".join(bad)


def _cli_help_texts():
    """(command, option, text) of every help text `colibri ... --help` prints: every
    subcommand's options, their descriptions and epilogs, built in full."""
    import argparse

    from engine.cli.main import build_parser

    def walk(p, path):
        yield path, "(description)", p.description
        yield path, "(epilog)", p.epilog
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    yield from walk(sp, f"{path} {name}")
                for c in a._choices_actions:
                    yield path, c.dest, c.help
            else:
                yield path, "/".join(a.option_strings) or a.dest, a.help
    return [(c, o, h) for c, o, h in walk(build_parser(""), "colibri") if h and h != argparse.SUPPRESS]


def test_cli_help_texts_point_to_no_source_doc_or_measurement_log():
    """`colibri --help` speaks to users: an option may name the file it writes, not a page of
    the repository (docs, READMEs, sources, tests) or a measurement's log."""
    repo_page = re.compile(r"[\w-]+\.(?:md|py)\b|\b(?:docs|tests|tools)/|(?i:readme)")
    texts = _cli_help_texts()
    assert len(texts) > 200  # every subcommand was built, not only the verbs' names
    bad = [f"{c} {o}: {h}" for c, o, h in texts if repo_page.search(h) or WORK_LOG.search(h)]
    assert not bad, "help texts are for users (no repository pages, no measurement logs):\n" + "\n".join(bad)


ENGINE_PACKAGE_PATH = re.compile(r"(?<![\w/.$-])((?:models|cache|kernels|bench|cli|server|library)/[\w./]*\.py)\b")
MODULE_ROW = re.compile(r"^\|\s*(`[^|]*`)\s*\|", re.M)


@functools.lru_cache(maxsize=1)
def _engine_definitions() -> frozenset:
    """Every name the engine defines (modules, classes, functions, arguments, assigned names and
    attributes) and every identifier-like string constant (settings, tensor names)."""
    words = set()
    for f in _files("engine"):
        if f.suffix != ".py":
            continue
        words.add(f.stem)
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                words.add(node.name)
            elif isinstance(node, ast.arg):
                words.add(node.arg)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                words.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                words.add(node.value)
    return frozenset(words)


def test_architecture_names_only_what_the_code_has():
    """docs/architecture.md matches the code: a path inside the engine's packages
    (`models/ops.py`) exists there; every module of a section's `| module | what |` table
    exists in the package the section is about; every code name it quotes (`MoEModel._decode_plan`,
    `kv_zeros`, `POLICY_CLASSES`) is defined in the engine."""
    import builtins

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [p for p in ENGINE_PACKAGE_PATH.findall(text) if not (ROOT / "engine" / p).exists()]
    for section in re.split(r"\n(?=## )", text):
        pkg = re.search(r"`engine/(\w+)/`", section)
        if pkg is None or "| module | what |" not in section:
            continue
        for cell in MODULE_ROW.findall(section):
            for name in re.findall(r"`([\w.<>]+\.py)`", cell):
                if "<" not in name and not (ROOT / "engine" / pkg.group(1) / name).exists():
                    missing.append(f"engine/{pkg.group(1)}/{name}")
    defined = _engine_definitions() | set(dir(builtins)) | {"engine", "colibri_app"}
    for quoted in re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", text):
        if quoted.split(".")[0] in sys.stdlib_module_names or quoted.endswith(".py"):
            continue
        if ("." in quoted or "_" in quoted or quoted[:1].isupper()) and quoted.split(".")[-1] not in defined:
            missing.append(quoted)
    assert not missing, f"docs/architecture.md names what the code does not have: {sorted(set(missing))}"
