"""Pre-built kernels (engine/kernel_cache.py) and the fixed CPU target they are built for
(engine.kernel_facts.kernel_target): numba's cache built in one install is loaded, without a
compile, by another install of the same sources elsewhere; an archive that does not fit is
skipped and the kernels compile as before."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import kernel_facts as F

ROOT = Path(__file__).resolve().parent.parent
KIND = ("olmoe", "int8", "int8", 32, "row_major", "f16", False)

HASWELL = {f: True for f in F.KERNEL_TARGETS["x86-64-v3"][1]}
SKYLAKE_X = {f: True for f in F.KERNEL_TARGETS["x86-64-v4"][1]}
ZEN4 = {f: True for f in F.KERNEL_TARGETS["x86-64-v4-vnni"][1]}
NEHALEM = {f: True for f in F.KERNEL_TARGETS["x86-64-v2"][1]}


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to be an x86-64 CPU with the given features (a dict), nothing set by the user."""
    for k in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", F.TARGET_ENV, "COLIBRI_INT_KERNEL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")

    def set_features(feats):
        monkeypatch.setattr(F, "_host_features", lambda: dict(feats, **{"avx512er": False}))
    return set_features


@pytest.mark.parametrize("feats, level, flavor", [
    (HASWELL, "x86-64-v3", "avx2"),
    (SKYLAKE_X, "x86-64-v4", "bw"),
    (ZEN4, "x86-64-v4-vnni", "vnni"),
    (NEHALEM, "x86-64-v2", "portable"),
    ({"sse2": True}, "host", "portable"),
])
def test_the_kernels_target_the_highest_x86_64_level_this_cpu_has(cpu, feats, level, flavor):
    cpu(feats)
    t = F.kernel_target()
    assert t.level == level and t.fixed == (level != "host")
    if t.fixed:  # the level's own features, spelled out: numba would add the host's to a bare name
        assert t.cpu_name == F.KERNEL_TARGETS[level][0]
        assert t.features.startswith(",".join("+" + f for f in F.KERNEL_TARGETS[level][1]))
        assert ("-prefer-256-bit" in t.features) == level.startswith("x86-64-v4")  # 512-bit loops
    assert F.int_flavor(t) == flavor


def test_a_target_the_user_chose_wins_and_a_level_this_cpu_lacks_is_refused(cpu, monkeypatch):
    cpu(HASWELL)
    monkeypatch.setenv(F.TARGET_ENV, "host")
    assert F.kernel_target().level == "host"
    monkeypatch.setenv(F.TARGET_ENV, "x86-64-v4")
    with pytest.raises(ValueError, match="lacks avx512f, avx512bw"):
        F.kernel_target()
    monkeypatch.setenv(F.TARGET_ENV, "skylake")
    with pytest.raises(ValueError, match="choose host or one of x86-64-v2"):
        F.kernel_target()
    monkeypatch.setenv(F.TARGET_ENV, "x86-64-v2")
    assert F.kernel_target().level == "x86-64-v2"
    monkeypatch.delenv(F.TARGET_ENV)
    monkeypatch.setenv("NUMBA_CPU_NAME", "haswell")
    t = F.kernel_target()
    assert (t.level, t.cpu_name, t.fixed) == ("user", "haswell", False)
    v3 = F._level_target("x86-64-v3")  # what engine.kernels hands its child processes
    monkeypatch.setenv("NUMBA_CPU_NAME", v3.cpu_name)
    monkeypatch.setenv("NUMBA_CPU_FEATURES", v3.features)
    assert F.kernel_target() == v3


# One kernel, run in an install of the engine package at another path: its numba cache
# statistics say whether it was loaded or compiled.
RUN = """
import json, os, sys
from pathlib import Path
if os.environ.get("FROZEN_EXECUTABLE"):  # as in the bundle: numba stamps its cache with the executable
    sys.frozen, sys.executable = True, os.environ["FROZEN_EXECUTABLE"]
import numpy as np
from engine.kernels import setup, rmsnorm
from engine import kernel_prepare
kind = tuple(json.loads(sys.argv[1]))
x = np.arange(16, dtype=np.float32).reshape(2, 8); w = np.full(8, 2, np.float32); out = np.empty_like(x)
rmsnorm(x, w, 1e-6, out)
if len(sys.argv) > 2:
    from engine.kernel_cache import pack
    pack(setup.CACHE_DIR, Path(sys.argv[2]), setup.TARGET, [kind])
st = rmsnorm.stats
ready = kind in setup.SHIPPED_KINDS
if ready:  # what Engine.open does first: no compile child (none is given) for a pre-built kind
    kernel_prepare.prepare_in_child(None, kind, child=None)
print(json.dumps({"shipped": setup.SHIPPED, "hits": sum(st.cache_hits.values()),
                  "misses": sum(st.cache_misses.values()), "out": out.round(5).tolist(), "ready": ready,
                  "marker": kernel_prepare.marker_path(setup.CACHE_DIR, kind).is_file()}))
"""


def _install(where: Path) -> Path:
    """A copy of the engine package at ``where``: another install path."""
    shutil.copytree(ROOT / "engine", where / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    return where


def _run(install: Path, cache: Path, *args: str, ship: bool = True, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", F.TARGET_ENV, "COLIBRI_INT_KERNEL", "PYTHONPATH",
                        "COLIBRI_COMPILE_IN_PROCESS")}
    env.update(PYTHONPATH=str(install), NUMBA_CACHE_DIR=str(cache), COLIBRI_SHIPPED_KERNELS="1" if ship else "0",
               **extra)
    p = subprocess.run([sys.executable, "-c", RUN, json.dumps(KIND), *args], env=env, cwd=install,
                       capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The archive of one install's cache (rmsnorm compiled for this CPU's level), and that run."""
    t = F.kernel_target()
    if not t.fixed:
        pytest.skip(f"no fixed x86-64 target for this CPU ({t.level})")
    base = tmp_path_factory.mktemp("kernel-cache")
    import numba
    from engine.kernel_cache import archive_name
    arc = base / archive_name(t.level, numba.__version__)
    first = _run(_install(base / "a"), base / "cache-a", str(arc), ship=False)
    return arc, first


def _shipped(install: Path, arc: Path) -> Path:
    (install / "resources" / "kernels").mkdir(parents=True)
    shutil.copy(arc, install / "resources" / "kernels" / arc.name)
    return install


def test_kernels_built_in_one_install_load_without_a_compile_in_another(built, tmp_path):
    arc, first = built
    assert first["misses"] == 1 and first["hits"] == 0  # compiled there
    b = _shipped(_install(tmp_path / "b"), arc)
    got = _run(b, tmp_path / "cache-b")
    assert got["misses"] == 0 and got["hits"] == 1, got  # loaded, not compiled
    assert got["out"] == first["out"]
    assert "kinds of model ready: 1" in got["shipped"] and got["ready"] and got["marker"]  # no compile child
    again = _run(b, tmp_path / "cache-b")  # installed once: the next start only finds its mark
    assert again["hits"] == 1 and again["shipped"] == got["shipped"]
    for d in (tmp_path / "cache-b").glob("kernels_*"):  # a cache emptied by hand is filled again
        shutil.rmtree(d)
    emptied = _run(b, tmp_path / "cache-b")
    assert emptied["hits"] == 1 and emptied["misses"] == 0 and emptied["ready"]


def test_the_frozen_bundle_loads_kernels_built_from_the_same_sources(built, tmp_path):
    """In the bundle numba stamps its cache with the executable's hash, not the source's: the
    kernels are written with that stamp after their sources were checked, so the bundle's first
    run loads them too."""
    arc, first = built
    b = _shipped(_install(tmp_path / "bundle"), arc)
    exe = tmp_path / "bundle" / "colibri"
    exe.write_bytes(b"an executable of this bundle")
    got = _run(b, tmp_path / "cache-b", FROZEN_EXECUTABLE=str(exe))
    assert got["misses"] == 0 and got["hits"] == 1 and got["out"] == first["out"], got
    assert got["ready"]


def test_an_archive_built_from_other_sources_is_skipped_and_the_kernel_compiles(built, tmp_path):
    arc, first = built
    b = _shipped(_install(tmp_path / "b"), arc)
    with open(b / "engine" / "kernels" / "attention.py", "a") as f:
        f.write("\n# an edit after the archive was built\n")
    got = _run(b, tmp_path / "cache-b")
    assert got["misses"] == 1 and got["hits"] == 0 and got["out"] == first["out"]
    assert "built from other sources" in got["shipped"] and not got["ready"]


def test_a_damaged_archive_is_skipped_with_a_reason_and_the_kernel_compiles(built, tmp_path):
    arc, first = built
    b = _install(tmp_path / "b")
    (b / "resources" / "kernels").mkdir(parents=True)
    (b / "resources" / "kernels" / arc.name).write_bytes(arc.read_bytes()[: arc.stat().st_size // 2])
    got = _run(b, tmp_path / "cache-b")
    assert got["misses"] == 1 and got["out"] == first["out"] and not got["ready"]
    assert got["shipped"].startswith("pre-built kernels not used:"), got["shipped"]


def test_doctor_says_what_the_pre_built_kernels_give_without_starting_numba(built, tmp_path, monkeypatch):
    from engine import kernel_cache
    arc, _ = built
    monkeypatch.setattr(kernel_cache, "shipped_dir", lambda: arc.parent)
    t, cache = F.kernel_target(), str(tmp_path / "cache")
    assert kernel_cache.shipped_status(cache, t) == f"{arc.name}: copied into the kernel cache at the next start"
    monkeypatch.setattr(kernel_cache, "stale_sources", lambda a: ["engine/kernels/attention.py"])
    assert kernel_cache.shipped_status(cache, t).startswith(
        f"{arc.name}: built from other versions of engine/kernels/attention.py: their kernels compile")
    monkeypatch.undo()
    monkeypatch.setattr(kernel_cache, "shipped_dir", lambda: arc.parent)
    line, kinds = kernel_cache.install_shipped(cache, t)
    assert kinds == {KIND}
    assert kernel_cache.shipped_status(cache, t) == line and "kinds of model ready: 1" in line
    assert kernel_cache.shipped_status(cache, F._host_target()).startswith("none for the CPU target host")
    monkeypatch.setattr(kernel_cache, "shipped_dir", lambda: tmp_path / "nothing")
    assert kernel_cache.shipped_status(cache, t).startswith(f"none for {arc.name[:-len('.tar.xz')]}")


# the levels archives ship for: AVX2 CPUs (Haswell to today's Intel desktops, Zen 2 / 3) and
# AVX-512 VNNI ones (Ice Lake and later Xeons, Zen 4 / 5)
SHIPPED_LEVELS = ("x86-64-v3", "x86-64-v4-vnni")


@pytest.mark.parametrize("level", SHIPPED_LEVELS)
@pytest.mark.parametrize("py", ["cp311", "cp313"])
def test_the_shipped_archives_were_built_from_these_kernel_sources(py, level):
    """An edit to a kernel source after its archive was built makes every first start compile:
    named here (no compile: the manifest's digests against the files) rather than found by a
    user. Python 3.11 is the bundle's and the dev venv's, 3.13 Debian 13's python3."""
    from engine.kernel_cache import shipped_dir, stale_sources
    archives = sorted(shipped_dir().glob(f"{py}-numba*-{level}.tar.xz"))  # whichever numba they are for
    assert archives, f"no pre-built kernels for {py} and {level} in {shipped_dir()}"
    for arc in archives:
        stale = stale_sources(arc)
        assert not stale, (f"{arc.name} was built from other versions of {stale}: run "
                           f"`python tools/build_kernel_cache.py --levels {level}` with Python "
                           f"{py[2]}.{py[3:]}")


def test_stale_sources_names_an_edited_kernel_file_without_starting_numba(built, tmp_path):
    from engine.kernel_cache import stale_sources
    arc, _ = built
    b = _install(tmp_path / "b")
    assert stale_sources(arc, str(b)) == []
    with open(b / "engine" / "kernels" / "attention.py", "a") as f:
        f.write("\n# an edit after the archive was built\n")
    assert stale_sources(arc, str(b)) == ["engine/kernels/attention.py"]
    code = ("import json, sys; from pathlib import Path; from engine.kernel_cache import stale_sources; "
            "print(json.dumps([stale_sources(Path(sys.argv[1])), 'numba' in sys.modules]))")
    p = subprocess.run([sys.executable, "-c", code, str(arc)], cwd=b, capture_output=True, text=True, timeout=3600,
                       env={**os.environ, "PYTHONPATH": str(b)})
    assert json.loads(p.stdout) == [["engine/kernels/attention.py"], False], p.stderr[-2000:]


# a child's prelude: every function numba compiles in it, listed in `compiled`
_COUNT_COMPILES = r"""
import json, sys
from numba.core import event

compiled = []


class Compiles(event.Listener):
    def on_start(self, ev):
        f = ev.data["dispatcher"].py_func
        compiled.append(f"{f.__module__}.{f.__qualname__}")

    def on_end(self, ev):
        pass


event.register("numba:compile", Compiles())
"""

_WARM = _COUNT_COMPILES + r"""
from engine import Engine, EngineConfig, GenerateRequest, SamplingParams
with Engine.open(EngineConfig(store=sys.argv[1], context_length=64)) as eng:
    assert eng.model.wait_decode_ready(900)
    for _ in eng.generate(GenerateRequest(prompt_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=4))):
        pass
    fused = eng.model._decode_plan() is not None
print(json.dumps({"compiled": compiled, "fused": fused}))
"""


def test_a_start_with_the_kernels_cached_compiles_nothing(tiny_store):
    """Everything an open and an answer run comes from numba's cache once it is there, the
    fused decode step's typed lists included (numba caches none of typed.List's own methods:
    built with them, every start compiled ~10 functions, 3 CPU s)."""
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_COMPILE_IN_PROCESS"}
    runs = []
    for _ in range(2):  # the first fills the cache where the suite has not yet
        p = subprocess.run([sys.executable, "-c", _WARM, str(tiny_store)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=3600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert runs[1]["fused"], "the tiny model no longer takes the one-call decode step: this test checks nothing"
    assert runs[1]["compiled"] == [], runs[1]["compiled"]


_SHIPPED_DEFAULT = _COUNT_COMPILES + r"""
import time
from engine import ChatMessage, Engine, EngineConfig, GenerateRequest, SamplingParams, TokenEvent, compile_needed
from engine import kernel_prepare, kernels
from engine.library import default_store
store = str(default_store())
base = EngineConfig(store=store)
from engine.kernel_facts import int_flavor
out = {"shipped": kernels.SHIPPED, "flavor": int_flavor(), "settings": []}
for cfg in [base] + kernel_prepare.kernel_variants(base):
    needed = compile_needed(store, cfg)
    t0 = time.perf_counter()
    req = GenerateRequest(messages=(ChatMessage("user", "What does json.dumps do?"),),
                          sampling=SamplingParams(max_new_tokens=2))
    with Engine.open(cfg) as eng:
        first = next(ev for ev in eng.generate(req) if isinstance(ev, TokenEvent))
    out["settings"].append({"pilot": cfg.pilot, "kv": cfg.kv_dtype, "needed": needed[0],
                            "open_to_first_token_s": round(time.perf_counter() - t0, 2)})
out["compiled"] = compiled
print(json.dumps(out))
"""


@pytest.mark.parametrize("level", ["", *SHIPPED_LEVELS])
def test_the_shipped_kernels_cover_the_default_model_with_every_kernel_setting(tmp_path, level):
    """A first start on the bundled model, and then each setting that chooses other kernels
    (PILOT on, each KV cache type), loads every kernel from the pre-built archive: no compile
    at all, so a settings change waits only for the reopen. An archive that lacks a kernel
    the default model now calls fails here (the source digests cannot tell). ``level``: this
    CPU's own level (""), or a shipped level below it, taken as a CPU of that level takes it."""
    import numba
    from engine.kernel_cache import archive_name, shipped_dir
    t = F._level_target(level) if level else F.kernel_target()
    if level and not all(F._host_features().get(f) for f in F.KERNEL_TARGETS[level][1]):
        pytest.skip(f"this CPU cannot run the {level} kernels")
    if not (shipped_dir() / archive_name(t.level, numba.__version__)).is_file():
        pytest.skip(f"no pre-built kernels for this Python, numba and CPU target ({t.level})")
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLIBRI_COMPILE_IN_PROCESS", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", F.TARGET_ENV,
                        "COLIBRI_INT_KERNEL")}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"), COLIBRI_SHIPPED_KERNELS="1",
               XDG_DATA_HOME=str(tmp_path / "data"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    if level:
        env[F.TARGET_ENV] = level
    p = subprocess.run([sys.executable, "-c", _SHIPPED_DEFAULT], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=3600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert "kinds of model ready: 4" in got["shipped"] and f"-{t.level}.tar.xz" in got["shipped"], got["shipped"]
    assert got["flavor"] == F.int_flavor(t)  # the level's own integer path (v3: AVX2)
    assert [(s["pilot"] > 0, s["needed"]) for s in got["settings"]][:2] == [(False, False), (True, False)], got
    assert not any(s["needed"] for s in got["settings"]) and len(got["settings"]) == 4, got["settings"]
    assert got["compiled"] == [], got["compiled"]
