"""Regression tests of reliability faults: the RSS guard with pins, unreadable or non-finite
stores, cgroup limits, concurrent starts and budgets, out-of-vocabulary ids.

Each test states the fault it pins down; every one failed on the code before the fix.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine import convert_checkpoint
from engine.cache import lookups as ec
from engine.config import EngineConfig
from engine.errors import CheckpointError, EngineError, StoreError
from engine.events import Finished, GenerateRequest, SamplingParams, StepMetrics
from engine.expert_cache import ExpertCache
from engine.expert_store import ExpertStore
from engine.generate import Engine
from engine.ram_budget import GB, probe_available
from engine.sizing import plan_cap

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534


def _finished(eng, req):
    return [e for e in eng.generate(req) if isinstance(e, Finished)][0]


# --- fault 1: the RSS guard must never deadlock the cache ------------------------------------------

def test_cap_lowered_below_pins_leaves_a_slot(medium_store, monkeypatch):
    """Pin 3 experts at cap 4, lower the cap to 2: a miss must still get a slot at once (it
    used to wait STALL_TIMEOUT_S for a slot held by pins, then fail)."""
    monkeypatch.setattr(ec, "STALL_TIMEOUT_S", 2.0)
    with ExpertStore(medium_store, o_direct=False) as st:
        cache = ExpertCache(st, st.args.num_hidden_layers, st.args.num_experts, cap=4, policy="lru")
        try:
            pins = np.zeros((cache.L, cache.E), bool)
            pins[:, :3] = True
            cache.set_pinned(pins)
            for layer in range(cache.L):
                cache.load_experts(layer, [0, 1, 2])
            cache.set_cap(2)
            for layer in range(cache.L):
                assert cache.pinned[layer].sum() <= 1
                t0 = time.perf_counter()
                cache.acquire(layer, 9)
                cache.release(layer, 9)
                assert time.perf_counter() - t0 < 1.0
                assert cache.live_slots(layer) <= 2
            # pinning more than cap - 1 keeps the hottest cap - 1
            cache.set_pinned(np.ones((cache.L, cache.E), bool))
            assert (cache.pinned.sum(axis=1) <= cache.cap - 1).all()
            for layer in range(cache.L):
                cache.acquire(layer, 11)
                cache.release(layer, 11)
        finally:
            cache.close()


def test_guard_with_pinning_never_stalls_and_keeps_ids(medium_store, monkeypatch):
    """Fault 1 end to end: hot pinning on, RSS over the budget from token 20 so the guard takes
    the cap to its floor; generation finishes with the ids of an undisturbed run."""
    monkeypatch.setattr(ec, "STALL_TIMEOUT_S", 3.0)
    budget_gb = 2.0
    base = dict(store=str(medium_store), ram_budget_gb=budget_gb, cap=16, pilot=0, pinning=True,
                history=False, context_length=400)
    stream = np.random.default_rng(7).integers(10, 500, 80).tolist()
    req = GenerateRequest(prompt_ids=tuple(stream[:40]), forced_ids=tuple(stream[40:]),
                          sampling=SamplingParams(max_new_tokens=40))
    # the undisturbed run's RSS modelled too: the suite's own process is past 2 GB late in a
    # run, and its real RSS made the guard cut the cap (no pins) before the case began
    with Engine.open(EngineConfig(**base), read_rss=lambda: int(0.5 * budget_gb * GB)) as eng:
        ref = _finished(eng, req).token_ids
        assert eng.cache.pinned.any()  # the case needs pins
    step = {"n": 0}

    def fake_rss():
        return int(1.10 * budget_gb * GB) if step["n"] >= 20 else int(0.5 * budget_gb * GB)

    with Engine.open(EngineConfig(**base), read_rss=fake_rss) as eng:
        fin = None
        for ev in eng.generate(req):
            if isinstance(ev, StepMetrics):
                step["n"] = ev.token_index
            if isinstance(ev, Finished):
                fin = ev
        assert fin.finish_reason == "length", fin.error
        assert eng.guard.fired >= 1 and eng.cache.cap == 1
        assert (eng.cache.pinned.sum(axis=1) <= eng.cache.cap - 1).all()
        assert fin.token_ids == ref


def test_guard_looks_during_prefill(medium_store):
    """RSS modelled as base + cache bytes: the guard acts during the prefill (at layer starts
    after loads) and after every token, so no token's RSS exceeds the budget by more than
    one layer of slots (it used to look only every 16 tokens)."""
    probe = EngineConfig(store=str(medium_store), cap=16, pinning=False, history=False, context_length=256)
    with Engine.open(probe) as eng:
        slot, L = eng.cache.slot_bytes, eng.cache.L
        floor = eng.plan.dense + eng.plan.kv + eng.plan.reserve
    budget = floor + 4 * L * slot  # room for cap 4 of 16
    holder = {}

    def fake_rss():
        c = holder.get("cache")
        return floor + (c.resident_bytes() if c is not None else 0)

    cfg = probe.with_(ram_budget_gb=budget / GB, pinning=True)
    req = GenerateRequest(prompt_ids=tuple(range(10, 70)), sampling=SamplingParams(max_new_tokens=24))
    with Engine.open(cfg, read_rss=fake_rss) as eng:
        holder["cache"] = eng.cache
        steps = [ev for ev in eng.generate(req) if isinstance(ev, StepMetrics)]
        worst = max(s.rss_bytes for s in steps)
        assert worst <= budget, (worst, budget)
        assert eng.cache.cap <= 4
        assert eng.guard.trail[0][0] is None  # first action inside the prefill, not at a token


# --- fault 2: permissions ---------------------------------------------------------------------------

def _world_copy(store: Path) -> Path:
    """A copy of ``store`` in a folder every user can enter (pytest's tmp is 0700)."""
    base = Path(tempfile.mkdtemp(prefix="colibri-perm-"))
    os.chmod(base, 0o755)
    dst = base / "store"
    shutil.copytree(store, dst)
    for p in [dst, *dst.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return dst


def _cli_as_nobody(args: list[str]) -> tuple[int, str]:
    """Run ``colibri ARGS`` in a forked child that dropped to user ``nobody`` (when root;
    the interpreter itself is not reachable for nobody here, so no exec). Returns (exit
    code, stdout+stderr); an exception escaping the CLI shows up as a Traceback."""
    import traceback

    from engine import cli
    from engine.cli.main import build_parser
    build_parser()  # import every command's modules now: the stdlib is not readable for nobody
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 98
        try:
            os.close(r)
            out = os.fdopen(w, "w")
            sys.stdout = sys.stderr = out
            if os.getuid() == 0:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            try:
                code = cli.main(args)
            except BaseException:  # noqa: BLE001 - what a user would see
                traceback.print_exc(file=out)
                code = 99
            out.flush()
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), text


@pytest.mark.parametrize("victim", ["experts/layer_001.bin", "dense.safetensors"])
def test_unreadable_store_file_is_a_clear_error(tiny_store, victim):
    """Fault 2: as a user who may not read one store file, `colibri run` ends with one
    'permission denied' line naming the file, never a traceback or 'No such file'."""
    dst = _world_copy(tiny_store)
    try:
        os.chmod(dst / victim, 0o000)
        code, err = _cli_as_nobody(["run", "--model", str(dst), "--prompt", "hi", "--max-new-tokens", "2",
                                    "--no-history", "--raw"])
        assert code not in (0, 98, 99), err
        assert "Traceback" not in err, err
        assert "permission denied" in err.lower(), err
        assert str(dst / victim) in err
        assert "No such file" not in err
    finally:
        shutil.rmtree(dst.parent, ignore_errors=True)


def test_unreadable_checkpoint_is_a_clear_error(tiny_checkpoint):
    """Fault 2's sibling on the converter side: an unreadable weight file is 'permission
    denied' naming it (safetensors said 'No such file or directory')."""
    src = _world_copy(tiny_checkpoint)
    os.chmod(src.parent, 0o777)
    try:
        os.chmod(src / "model.safetensors", 0o000)
        code, err = _cli_as_nobody(["convert", str(src), str(src.parent / "out")])
        assert code not in (0, 98, 99), err
        assert "Traceback" not in err and "No such file" not in err, err
        assert "permission denied" in err.lower() and str(src / "model.safetensors") in err, err
        assert not (src.parent / "out").exists()
    finally:
        shutil.rmtree(src.parent, ignore_errors=True)


def test_store_files_get_ordinary_modes(tiny_checkpoint, tmp_path):
    """Fault 2: every file a conversion and a run write gets the umask's ordinary mode
    (dense.safetensors was 0600, the routing history too: other users could not run the store)."""
    old = os.umask(0o022)
    try:
        dst = convert_checkpoint(tiny_checkpoint, tmp_path / "st", quant="int8")
        with Engine.open(EngineConfig(store=str(dst), history=True)) as eng:
            _finished(eng, GenerateRequest(prompt_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=2)))
        assert (dst / "routing_heat.json").exists()
        for p in [dst, *dst.rglob("*")]:
            want = 0o755 if p.is_dir() else 0o644
            assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    finally:
        os.umask(old)


# --- fault 3: non-finite weights ---------------------------------------------------------------------

def _patched_checkpoint(src: Path, dst: Path, name: str, index: tuple, value: float) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    ts = load_file(str(f))
    w = ts[name].astype(np.float32)
    w[index] = value
    ts[name] = w  # float32, so the value is exact
    save_file(ts, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name,index,value,quant", [
    ("model.layers.1.mlp.gate.weight", (3, 17), float("nan"), "int8"),
    ("model.layers.0.mlp.experts.5.down_proj.weight", (2, 9), float("inf"), "int4"),
    ("model.layers.0.self_attn.q_proj.weight", (0, 1), float("-inf"), "f32"),
    ("model.embed_tokens.weight", (7, 3), 1.0e5, "f16"),
])
def test_non_finite_weights_are_refused(tiny_checkpoint, tmp_path, name, index, value, quant):
    """Fault 3: NaN/inf anywhere, or beyond the f16 range in an f16 store, is refused at
    conversion naming the tensor, the index and the value; nothing is published."""
    ck = _patched_checkpoint(tiny_checkpoint, tmp_path / "ck", name, index, value)
    dst = tmp_path / "st"
    with pytest.raises(CheckpointError) as ei:
        convert_checkpoint(ck, dst, quant=quant)
    msg = str(ei.value)
    assert name in msg and str(list(index)) in msg and repr(value) in msg, msg
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_large_weight_is_fine_in_int8(tiny_checkpoint, tmp_path):
    ck = _patched_checkpoint(tiny_checkpoint, tmp_path / "ck", "model.embed_tokens.weight", (7, 3), 1.0e5)
    convert_checkpoint(ck, tmp_path / "st", quant="int8")


def test_nan_store_from_an_old_converter_ends_with_an_error(tiny_store, tmp_path):
    """Fault 3 at run time: a store that already holds a NaN router weight ends with an error
    event, not <|pad|> up to the token limit with exit 0."""
    dst = tmp_path / "st"
    shutil.copytree(tiny_store, dst)
    ts = load_file(str(dst / "dense.safetensors"))
    ts["layers.1.router"] = ts["layers.1.router"].copy()
    ts["layers.1.router"][3, 17] = np.nan
    save_file(ts, str(dst / "dense.safetensors"), metadata={"format": "colibri-expert-store", "dense_quant": "int8"})
    m = json.loads((dst / "manifest.json").read_text())
    if "files" in m:
        m["files"]["dense.safetensors"] = (dst / "dense.safetensors").stat().st_size
        (dst / "manifest.json").write_text(json.dumps(m))
    with Engine.open(EngineConfig(store=str(dst), history=False)) as eng:
        fin = _finished(eng, GenerateRequest(prompt_ids=(5, 6, 7), sampling=SamplingParams(max_new_tokens=8)))
    assert fin.finish_reason == "error" and "non-finite" in fin.error and str(dst) in fin.error


# --- fault 9: containers -------------------------------------------------------------------------------

def _fake_tree(tmp: Path, files: dict[str, str], cgroup: str) -> tuple[Path, Path]:
    root = tmp / "sys"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    proc = tmp / "proc_self_cgroup"
    proc.write_text(cgroup)
    return root, proc


def test_cgroup_v2_memory_limit_caps_the_budget(tmp_path, monkeypatch):
    """Fault 9: inside a 3 GB cgroup v2 container the automatic budget stays under 3 GB
    (it read the host's ~21 GB)."""
    from engine import sysinfo  # imported here: on code without it only these tests fail
    root, proc = _fake_tree(tmp_path, {
        "cgroup.controllers": "cpu memory",
        "kubepods/pod1/memory.max": str(3 * 2**30),
        "kubepods/pod1/memory.current": str(1 * 2**30),
        "kubepods/pod1/memory.stat": "anon 500000000\ninactive_file 200000000\n",
        "kubepods/memory.max": "max",
        "kubepods/pod1/cpu.max": "150000 100000",
    }, "0::/kubepods/pod1\n")
    cg = sysinfo.cgroup_memory(root, proc)
    assert cg.version == 2 and cg.limit == 3 * 2**30
    assert cg.available == 3 * 2**30 - (2**30 - 200000000)
    monkeypatch.setattr(sysinfo, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(sysinfo, "PROC_SELF_CGROUP", str(proc))
    avail, trusted = probe_available()
    assert trusted and avail <= cg.available
    plan = plan_cap(64, [10**6] * 8, 10**8, 10**7, None, None, rss_now=2 * 10**8)
    assert plan.budget < 3 * 2**30
    assert sysinfo.usable_cpus(root, proc, affinity=8) == 2
    total, avail = sysinfo.memory(root, proc)  # what the download wizard's RAM check reads
    assert total <= 3 * 2**30 and avail <= cg.available


def test_cgroup_v1_limits_and_namespaced_root(tmp_path):
    from engine import sysinfo  # imported here: on code without it only these tests fail
    root, proc = _fake_tree(tmp_path, {
        "memory/memory.limit_in_bytes": "9223372036854771712",
        "memory/docker/abc/memory.limit_in_bytes": str(2 * 10**9),
        "memory/docker/abc/memory.usage_in_bytes": str(5 * 10**8),
        "memory/docker/abc/memory.stat": "cache 1000\ntotal_inactive_file 100000000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
    }, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    cg = sysinfo.cgroup_memory(root, proc)
    assert cg.version == 1 and cg.limit == 2 * 10**9 and cg.available == 2 * 10**9 - 4 * 10**8
    assert sysinfo.usable_cpus(root, proc, affinity=4) == 1
    # a cgroup namespace shows "/" (or a path not under the mount): the mount root is ours
    root2, proc2 = _fake_tree(tmp_path / "ns", {
        "memory.max": str(10**9), "memory.current": str(10**8), "cgroup.controllers": "memory",
        "cpu.max": "max 100000"}, "0::/\n")
    assert sysinfo.cgroup_memory(root2, proc2).limit == 10**9
    assert sysinfo.usable_cpus(root2, proc2, affinity=3) == 3
    # nothing known: no limit
    assert sysinfo.cgroup_memory(tmp_path / "none", tmp_path / "none.txt") is None


def test_cpu_quota_sets_the_default_thread_count(tiny_store, tmp_path, monkeypatch):
    """Fault 9: numba_threads 0 (auto) follows the cgroup CPU quota."""
    from engine import sysinfo  # imported here: on code without it only these tests fail
    import numba
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 CPUs")
    root, proc = _fake_tree(tmp_path, {"cgroup.controllers": "cpu", "cpu.max": "100000 100000"}, "0::/\n")
    monkeypatch.setattr(sysinfo, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(sysinfo, "PROC_SELF_CGROUP", str(proc))
    before = numba.get_num_threads()
    try:
        with Engine.open(EngineConfig(store=str(tiny_store), history=False)):
            assert numba.get_num_threads() == 1
    finally:
        numba.set_num_threads(before)


def test_real_cgroup_v1_memory_limit(tmp_path):
    """Fault 9 for real: a child process moved into a 3 GB cgroup v1 memory group sizes its
    automatic budget under 3 GB."""
    base = Path("/sys/fs/cgroup/memory")
    if not (base / "memory.limit_in_bytes").exists() or not os.access(base, os.W_OK):
        pytest.skip("no writable cgroup v1 memory hierarchy here")
    grp = base / f"colibri-test-{os.getpid()}"
    try:
        grp.mkdir()
        (grp / "memory.limit_in_bytes").write_text(str(3 * 2**30))
    except OSError as e:
        pytest.skip(f"cannot create a cgroup here ({e})")
    try:
        code = (f"import os; open({str(grp / 'cgroup.procs')!r}, 'w').write(str(os.getpid()));"
                "from engine.ram_budget import probe_available; print(probe_available()[0])")
        r = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True,
                           timeout=3600, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, r.stderr
        assert int(r.stdout.split()[-1]) <= 3 * 2**30
    finally:
        for _ in range(50):
            try:
                grp.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# --- fault 11 (store half): concurrent conversions, verified stores -------------------------------------

def _convert_child(src, dst, barrier, q):
    try:
        barrier.wait(600)  # only a hang trips it
        convert_checkpoint(src, dst, quant="int8", overwrite=True, extra_manifest={"source_mtime": 1})
        ExpertStore(dst, o_direct=False).close()
        q.put("ok")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put(f"{type(e).__name__}: {e}")


def test_concurrent_first_starts_publish_one_complete_store(tiny_checkpoint, tmp_path):
    """Fault 11: two processes convert to the same destination at once (as two first starts
    do), 12 times: both succeed, the published store is complete, no temp folder is left."""
    ctx = mp.get_context("fork")
    for i in range(12):
        dst = tmp_path / f"round{i}" / "model-int8"
        barrier, q = ctx.Barrier(2), ctx.Queue()
        ps = [ctx.Process(target=_convert_child, args=(tiny_checkpoint, dst, barrier, q)) for _ in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(600)
        res = [q.get(timeout=3600) for _ in ps]   # timeouts only a hang trips
        assert res == ["ok", "ok"], res
        with ExpertStore(dst, o_direct=False) as st:
            assert st.open_files == st.args.num_hidden_layers
        assert [p.name for p in dst.parent.iterdir()] == ["model-int8"]  # no temp folder, no .lock file


def test_short_or_missing_expert_file_is_refused_at_open(tiny_store, tmp_path):
    """Fault 11: a store whose files do not match its manifest is refused at open, naming the
    file and saying to re-convert (a short file used to open and fail mid-generation)."""
    dst = tmp_path / "st"
    shutil.copytree(tiny_store, dst)
    f = dst / "experts" / "layer_001.bin"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 4096)
    with pytest.raises(StoreError, match="layer_001.bin.*re-convert"):
        ExpertStore(dst)
    f.unlink()
    with pytest.raises(StoreError, match="layer_001.bin.*missing"):
        ExpertStore(dst)


# --- fault 12: one error, one line ---------------------------------------------------------------------

def test_corrupt_expert_error_printed_once(tiny_store, tmp_path):
    """Fault 12: a corrupt expert's error appears once on stderr (a log record and the CLI
    both printed it)."""
    dst = tmp_path / "st"
    shutil.copytree(tiny_store, dst)
    m = json.loads((dst / "manifest.json").read_text())
    with open(dst / "experts" / "layer_000.bin", "r+b") as fh:
        for e in m["experts"][0]:
            fh.seek(e["offset"] + 5)
            b = fh.read(1)
            fh.seek(e["offset"] + 5)
            fh.write(bytes([b[0] ^ 0xFF]))
    r = subprocess.run([sys.executable, "-m", "engine.cli", "run", "--model", str(dst), "--prompt", "hello",
                        "--raw", "--max-new-tokens", "3", "--no-history"], cwd=str(ROOT), capture_output=True,
                       text=True, timeout=3600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0
    assert r.stderr.count("fails its") == 1, r.stderr
    assert "Traceback" not in r.stderr


# --- fault 11 (last part): two instances must not each take 88% of RAM -------------------------

def test_second_process_budgets_around_the_first(tmp_path, monkeypatch, tiny_store):
    """Fault 11: an open engine claims its budget; another process's automatic budget leaves
    out what that claim has not yet taken (budget - the claimant's RSS), so two processes no
    longer each take 88% of available RAM. Dead claimants are forgotten."""
    import psutil

    from engine import sizing, sysinfo
    monkeypatch.setenv("COLIBRI_CLAIMS_DIR", str(tmp_path / "claims"))
    monkeypatch.setattr(sizing, "probe_available", lambda: (10 * GB, True))
    # 8192 experts of 1 MB per layer: more than 8.8 GB, so the automatic budget is not capped
    # at "the whole model" and the claims decide it
    plan = lambda: sizing.plan_cap(8192, [1_000_000] * 2, 50_000_000, 1_000_000, None, None,  # noqa: E731
                                   rss_now=100_000_000)
    alone = plan().budget
    other = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "ready"  # started: its RSS is steady now
        claim = sysinfo.BudgetClaim(6 * GB)
        data = json.loads(claim.path.read_text())
        claim.path.write_text(json.dumps({"pid": other.pid, "budget": data["budget"]}))  # as if `other` claimed it
        taken = psutil.Process(other.pid).memory_info().rss
        assert sysinfo.others_unreserved() == pytest.approx(6 * GB - taken, abs=20e6)  # RSS moves a little
        second = plan().budget
        assert alone - second == pytest.approx(0.88 * (6 * GB - taken), abs=20e6)
        assert second < 0.88 * 10 * GB  # on main: both processes got 100 MB + 8.8 GB
    finally:
        other.kill()
        other.wait()
    assert sysinfo.others_unreserved() == 0 and not list((tmp_path / "claims").glob("*.json"))
    assert plan().budget == alone


def test_open_engine_claims_its_budget_until_closed(tmp_path, monkeypatch, tiny_store):
    """Engine.open records its budget for other processes; close removes it."""
    from engine import sysinfo
    monkeypatch.setenv("COLIBRI_CLAIMS_DIR", str(tmp_path / "claims"))
    with Engine.open(EngineConfig(store=str(tiny_store), ram_budget_gb=2.0, history=False)) as eng:
        files = list((tmp_path / "claims").glob("*.json"))
        assert len(files) == 1 and json.loads(files[0].read_text()) == {"pid": os.getpid(), "budget": eng.plan.budget}
        assert sysinfo.others_unreserved() == 0  # this process's own claims are not subtracted
    assert not list((tmp_path / "claims").glob("*.json"))


@pytest.mark.parametrize("field", ["prompt_ids", "forced_ids"])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_compute(tiny_store, field):
    """prompt_ids and forced_ids (teacher forcing) are both checked against the vocabulary by
    generate() itself, before any compute: the numba embedding has no bounds checks."""
    from engine.config import EngineConfig
    from engine.events import GenerateRequest, SamplingParams
    from engine.generate import Engine
    with Engine.open(EngineConfig(store=str(tiny_store), history=False, o_direct=False, pilot=0)) as eng:
        V = eng.args.vocab_size
        kw = {"prompt_ids": (1, 2, V)} if field == "prompt_ids" else {"prompt_ids": (1, 2), "forced_ids": (3, V + 5)}
        req = GenerateRequest(sampling=SamplingParams(max_new_tokens=2), **kw)
        with pytest.raises(ValueError, match=f"{field}: token id {V if field == 'prompt_ids' else V + 5} is outside"):
            eng.generate(req)
        # the engine still runs a valid request afterwards
        ok = [e for e in eng.generate(GenerateRequest(prompt_ids=(1, 2), sampling=SamplingParams(max_new_tokens=2)))]
        assert ok
