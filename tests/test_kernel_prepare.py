"""engine/kernel_prepare.py: a first open compiles the kernels in a child process; its marker,
its settings, and what happens when the child fails. The real child (a fresh numba cache, two
cold compiles) runs in tests/test_sizing.py::test_first_open_compiles_in_a_child_process (slow)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from engine import EngineConfig, kernel_prepare, kernels
from engine.generate import compile_child

KIND = ("olmoe", "int8", "int8", 32, "row_major", "f16", False)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "CACHE_DIR", str(tmp_path / "numba"))
    monkeypatch.setattr(kernels, "SHIPPED_KINDS", frozenset())  # no pre-built kernels in this cache
    monkeypatch.delenv(kernel_prepare.IN_PROCESS_ENV, raising=False)
    monkeypatch.setattr(kernel_prepare, "_FAILED", set())
    return tmp_path / "numba"


def test_a_child_that_succeeds_leaves_a_marker_and_the_next_open_starts_none(cache_dir, monkeypatch):
    runs = []
    monkeypatch.setattr(kernel_prepare, "_run_child", lambda cfg, *_: runs.append(cfg) or 0)
    said = []
    report = lambda done, msg: said.append((done, msg))  # noqa: E731
    cfg = EngineConfig(store="/models/x", ram_budget_gb=3.0, context_length=4096, cap=40, threads=2,
                       reserve_cache=True, idle_fill=True, pinning=True, history=True, cluster="ray://h:1")
    (cache_dir / "kernels_4f2a").mkdir(parents=True)  # what the child's compile leaves in numba's cache
    (cache_dir / "kernels_4f2a" / "attention.rmsnorm-10.py311.nbi").write_bytes(b"index")
    assert kernel_prepare.prepare_in_child(cfg, KIND, report, child=compile_child) >= 0.0
    assert len(runs) == 1 and [d for d, _m in said] == [0, 1] and "compute kernels" in said[0][1]
    child = runs[0]  # as small as the store allows, nothing of the user's touched
    assert (child["store"], child["cap"], child["ram_budget_gb"], child["context_length"], child["threads"]) == \
        ("/models/x", 1, None, 64, 1)
    assert not (child["reserve_cache"] or child["idle_fill"] or child["pinning"] or child["history"] or child["cluster"])
    assert EngineConfig.from_dict(child).store == "/models/x"  # what the child process builds
    import json
    marker = json.loads(kernel_prepare.marker_path(str(cache_dir), KIND).read_text())
    assert marker["index_files"] == ["kernels_4f2a/attention.rmsnorm-10.py311.nbi"]
    assert kernel_prepare.prepare_in_child(cfg, KIND, child=compile_child) == 0.0 and len(runs) == 1
    other = KIND[:-1] + (True,)  # PILOT's kernels: another kind
    kernel_prepare.prepare_in_child(cfg, other, child=compile_child)
    assert len(runs) == 2


@pytest.mark.parametrize("outcome", [1, None, RuntimeError("no fork here")])
def test_a_child_that_fails_is_logged_not_retried_and_leaves_no_marker(cache_dir, monkeypatch, caplog, outcome):
    """Exit code 1, a timeout (None) or a process that cannot start: the engine compiles in
    process (prepare_in_child returns, never raises), says why once, and does not start a
    child for that kind again in this process."""
    runs = []

    def run(cfg, *_):
        runs.append(cfg)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    monkeypatch.setattr(kernel_prepare, "_run_child", run)
    cfg = EngineConfig(store="/models/x")
    with caplog.at_level(logging.WARNING, logger="engine.kernel_prepare"):
        kernel_prepare.prepare_in_child(cfg, KIND, child=compile_child)
    assert "compiling them here" in caplog.text
    assert not kernel_prepare.marker_path(str(cache_dir), KIND).exists()
    kernel_prepare.prepare_in_child(cfg, KIND, child=compile_child)
    assert len(runs) == 1


def test_no_child_without_a_cache_to_fill_or_when_asked_to_compile_in_process(cache_dir, monkeypatch):
    """No writable numba cache: no child (nothing would persist), and the reason every start
    compiles is said (kernels.CACHE_PROBLEM, naming the folder and what to do)."""
    monkeypatch.setattr(kernel_prepare, "_run_child", lambda cfg, *_: pytest.fail("no child expected"))
    cfg = EngineConfig(store="/models/x")
    said = []
    monkeypatch.setenv(kernel_prepare.IN_PROCESS_ENV, "1")
    assert kernel_prepare.prepare_in_child(cfg, KIND, lambda d, m: said.append(m), child=compile_child) == 0.0 and not said
    monkeypatch.delenv(kernel_prepare.IN_PROCESS_ENV)
    monkeypatch.setattr(kernels, "CACHE_DIR", None)
    monkeypatch.setattr(kernels, "CACHE_PROBLEM", "/x/afile/cache cannot be created: /x/afile is a file, not a folder")
    assert kernel_prepare.prepare_in_child(cfg, KIND, lambda d, m: said.append(m), child=compile_child) == 0.0
    assert said == ["compiling the compute kernels in this process, at every start: "
                    "/x/afile/cache cannot be created: /x/afile is a file, not a folder"]


def test_a_marker_whose_cache_files_are_gone_runs_the_child_again(cache_dir, monkeypatch):
    """The user emptied numba's cache but the marker stayed: the child runs again (before, the
    engine trusted the marker and compiled in process, its ~500 MB back, without a word)."""
    import json
    runs = []
    monkeypatch.setattr(kernel_prepare, "_run_child", lambda cfg, *_: runs.append(cfg) or 0)
    cfg = EngineConfig(store="/models/x")
    marker = kernel_prepare.marker_path(str(cache_dir), KIND)
    marker.parent.mkdir(parents=True)
    (cache_dir / "engine_abc").mkdir()
    (cache_dir / "engine_abc" / "kernels.rmsnorm-1.py311.nbi").write_bytes(b"x")
    marker.write_text(json.dumps({"kind": repr(KIND), "index_files": ["engine_abc/kernels.rmsnorm-1.py311.nbi"]}))
    assert kernel_prepare.prepare_in_child(cfg, KIND, child=compile_child) == 0.0 and not runs  # the files are there
    (cache_dir / "engine_abc" / "kernels.rmsnorm-1.py311.nbi").unlink()
    kernel_prepare.prepare_in_child(cfg, KIND, child=compile_child)
    assert len(runs) == 1
    marker.write_text("('olmoe',)\n")  # not a marker this version wrote
    kernel_prepare.prepare_in_child(cfg, KIND, child=compile_child)
    assert len(runs) == 2


def test_the_marker_changes_with_the_kernel_source(cache_dir, monkeypatch, tmp_path):
    """numba invalidates its cache when a module of engine/kernels/ changes (size, mtime): so
    does the marker."""
    a = kernel_prepare.marker_path(str(cache_dir), KIND)
    assert a == kernel_prepare.marker_path(str(cache_dir), KIND)
    assert a != kernel_prepare.marker_path(str(cache_dir), KIND[:-2] + ("f32", False))
    copy = tmp_path / "kernels"
    shutil.copytree(Path(kernels.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(kernels, "__file__", str(copy / "__init__.py"))
    assert kernel_prepare.marker_path(str(cache_dir), KIND) != a  # another path
    b = kernel_prepare.marker_path(str(cache_dir), KIND)
    (copy / "routing.py").write_text((copy / "routing.py").read_text() + "\n# changed\n")
    assert kernel_prepare.marker_path(str(cache_dir), KIND) != b  # one module changed


def test_the_command_line_names_only_the_first_compile(capsys):
    """`colibri run` / `serve` print the long first compile (stage "compile") as a line on
    stderr, and nothing for the other open stages."""
    from engine import LoadProgress
    from engine.cli.models import open_notices
    open_notices(LoadProgress("open", 0, 3, "", "opening /models/x"))
    open_notices(LoadProgress("kernels", 0, 1, "", "preparing the compute kernels"))
    assert capsys.readouterr().err == ""
    open_notices(LoadProgress("compile", 0, 1, "", "compiling the compute kernels for this kind of model"))
    assert capsys.readouterr().err == "colibri: compiling the compute kernels for this kind of model\n"


@pytest.mark.skipif(__import__("sys").platform == "win32", reason="the lock is fcntl.flock")
def test_two_first_starts_at_once_compile_once(cache_dir, monkeypatch):
    """The app and `colibri serve` started together on a fresh cache: the second waits for the
    first's child (a lock beside the marker) and finds the marker, instead of compiling it all
    again (a helper measured two full compiles of ~4 min each before)."""
    import threading
    import time
    runs = []

    def child(cfg, *_):
        runs.append(cfg)
        time.sleep(0.5)
        (cache_dir / "kernels_4f2a").mkdir(parents=True, exist_ok=True)
        (cache_dir / "kernels_4f2a" / "attention.rmsnorm-10.py311.nbi").write_bytes(b"index")
        return 0
    monkeypatch.setattr(kernel_prepare, "_run_child", child)
    said = []
    cfg = EngineConfig(store="/models/x")
    ts = [threading.Thread(target=kernel_prepare.prepare_in_child, args=(cfg, KIND, lambda d, m: said.append((d, m))),
                          kwargs={"child": compile_child})
          for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(600)
    assert len(runs) == 1
    assert sorted(m.split(" in ")[0].split(" (")[0] for d, m in said if d == 1) == [
        "compute kernels compiled", "compute kernels compiled by another colibri process"]


def test_compile_needed_says_when_a_setting_needs_new_kernels(cache_dir, monkeypatch, tiny_store):
    """PILOT on (or another KV type) is another kind of kernels: without its marker the open
    compiles first; the estimate is the longest compile a marker on this machine recorded."""
    off, on = EngineConfig(store=str(tiny_store)), EngineConfig(store=str(tiny_store), pilot=1)
    assert kernel_prepare.compile_needed(str(tiny_store), off) == (True, None)  # nothing compiled yet
    monkeypatch.setattr(kernel_prepare, "_run_child", lambda cfg, *_: 0)
    (cache_dir / "kernels_4f2a").mkdir(parents=True)
    (cache_dir / "kernels_4f2a" / "attention.rmsnorm-10.py311.nbi").write_bytes(b"index")
    from engine.expert_store import ExpertStore
    with ExpertStore(str(tiny_store), o_direct=False) as st:
        kind_off = kernel_prepare.kernel_kind(st.args, st, off)
    kernel_prepare.prepare_in_child(off, kind_off, child=compile_child)
    import json
    marker = kernel_prepare.marker_path(str(cache_dir), kind_off)
    data = json.loads(marker.read_text())
    assert data["seconds"] >= 0.0
    data["seconds"] = 95.0  # as a real compile here took
    marker.write_text(json.dumps(data))
    assert kernel_prepare.compile_needed(str(tiny_store), off) == (False, None)
    assert kernel_prepare.compile_needed(str(tiny_store), on) == (True, 95.0)


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs a FIFO")
def test_a_killed_parent_leaves_no_compile_child_running(tmp_path):
    """The app is killed (SIGKILL) while its first compile runs in the child: the child ends
    too. The child's store is a folder whose manifest is a FIFO nobody writes: opening it
    blocks, standing for a compile of minutes, so without the parent link it never ends."""
    import os
    import signal
    import subprocess
    import sys

    import time

    import psutil
    store = tmp_path / "store"
    store.mkdir()
    os.mkfifo(store / "manifest.json")
    code = ("import sys; from engine import kernel_prepare as k; "
            f"from engine.generate import compile_child; k._run_child({{'store': {str(store)!r}}}, compile_child)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    child = None
    try:
        p = psutil.Process(parent.pid)
        deadline = time.monotonic() + 600   # only a hang trips this: the child starts at once
        while not p.children() and time.monotonic() < deadline:
            assert parent.poll() is None, "the parent ended before starting its child"
            time.sleep(0.05)
        child = p.children()[0]
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(600)
        gone, alive = psutil.wait_procs([child], timeout=60)
        assert child in gone and not alive, "the compile child outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child is not None and child.is_running():
            child.kill()


def test_the_variants_are_every_other_choice_of_the_kernel_settings():
    """PILOT switched comes first (the change users make), then the other KV type with PILOT
    off and on: with the open settings, every kind a setting can select."""
    from engine.settings import KV_DTYPES
    for pilot, kv in ((0, "f16"), (2, "f32")):
        cfg = EngineConfig(store="/models/x", pilot=pilot, kv_dtype=kv)
        vs = kernel_prepare.kernel_variants(cfg)
        assert (vs[0].pilot > 0, vs[0].kv_dtype) == (pilot == 0, kv)
        kinds = {(c.pilot > 0, c.kv_dtype) for c in vs + [cfg]}
        assert len(vs) == 3 and kinds == {(p, k) for p in (False, True) for k in KV_DTYPES}


def test_the_variants_compile_in_the_background_and_a_pilot_change_then_needs_none(cache_dir, monkeypatch,
                                                                                   tiny_store):
    """After the model opens, the other settings' kernels are compiled one after the other in
    children at a lower priority; then switching PILOT on needs no compile (the settings
    dialog says none, the reopen starts no child)."""
    runs = []

    def child(cfg, entry, niceness=0, stop=None):
        runs.append((cfg["pilot"], cfg["kv_dtype"], niceness))
        (cache_dir / "kernels_4f2a").mkdir(parents=True, exist_ok=True)
        (cache_dir / "kernels_4f2a" / "attention.rmsnorm-10.py311.nbi").write_bytes(b"index")
        return 0
    monkeypatch.setattr(kernel_prepare, "_run_child", child)
    off = EngineConfig(store=str(tiny_store))
    on = EngineConfig(store=str(tiny_store), pilot=1)
    assert kernel_prepare.compile_needed(str(tiny_store), on)[0]
    v = kernel_prepare.prepare_kernel_variants(off, compile_child)
    assert v.finished.wait(600)  # only a hang trips this
    n = kernel_prepare.BACKGROUND_NICENESS
    assert runs == [(1, "f16", n), (0, "f32", n), (1, "f32", n)] and len(v.done) == 3
    assert kernel_prepare.compile_needed(str(tiny_store), on) == (False, None)
    monkeypatch.setattr(kernel_prepare, "_run_child", lambda cfg, *_: pytest.fail("no child expected"))
    from engine.expert_store import ExpertStore
    with ExpertStore(str(tiny_store), o_direct=False) as st:
        assert kernel_prepare.prepare_in_child(on, kernel_prepare.kernel_kind(st.args, st, on), child=compile_child) == 0.0


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs a FIFO")
def test_a_background_compile_runs_lower_and_stop_ends_its_child(tmp_path, cache_dir):
    """The background child runs BACKGROUND_NICENESS lower than the app, and stop() kills it
    (an app that closes, or opens another model, leaves no compile running) without marking
    the kind as failed. The child's store has a FIFO manifest nobody writes: it blocks as a
    long compile would."""
    import os
    import threading
    import time

    import psutil
    store = tmp_path / "store"
    store.mkdir()
    os.mkfifo(store / "manifest.json")
    stop = threading.Event()
    out = []
    t = threading.Thread(target=lambda: out.append(kernel_prepare._run_child({"store": str(store)}, compile_child,
                                                                             kernel_prepare.BACKGROUND_NICENESS, stop)))
    t.start()
    me = psutil.Process()
    deadline = time.monotonic() + 600  # only a hang trips this: the child starts at once
    child = None
    while time.monotonic() < deadline:
        kids = [c for c in me.children() if "compile_child" in " ".join(c.cmdline())]
        if kids and kids[0].nice() != me.nice():  # it lowers itself first thing after it starts
            child = kids[0]
            break
        time.sleep(0.05)
    assert child is not None and child.nice() == min(19, me.nice() + kernel_prepare.BACKGROUND_NICENESS)
    stop.set()
    t.join(600)
    assert out == [None] and not child.is_running()
