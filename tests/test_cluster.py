"""Expert-parallel serving over Ray (engine/cluster.py) on a local cluster: a head
and two workers started with `colibri cluster head` / `colibri cluster join` on this machine
(each worker in its own memory cgroup when /sys/fs/cgroup/memory is writable).

Greedy ids must be byte-identical to the single-machine run for every placement, when a
worker is killed in the middle of an answer and when a worker times out; nothing may be left
running after close."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from engine.cluster import LOCAL, RESOURCE, plan_placement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M, E, K_TOP = 3, 16, 4


# --- placement (no Ray needed) ------------------------------------------------------------------

def test_plan_placement_by_budget_and_heat():
    heat = np.zeros((2, 8), np.int64)
    heat[0] = [9, 0, 5, 0, 7, 1, 0, 0]
    heat[1] = [0, 0, 0, 0, 0, 0, 0, 3]
    pl = plan_placement(heat, [2 * 4, 2 * 2], local_keep=1)  # per layer: 4 and 2 slabs
    assert pl.dtype == np.int16 and pl.shape == (2, 8)
    assert pl[0, 0] == LOCAL and pl[1, 7] == LOCAL  # the hottest stay here
    for j in range(2):
        assert (pl[j] == 0).sum() == 4 and (pl[j] == 1).sum() == 2 and (pl[j] == LOCAL).sum() == 2
    # hottest remote first, spread by fill: 4 (heat 7) -> worker 0, 2 (heat 5) -> worker 1
    assert pl[0, 4] == 0 and pl[0, 2] == 1
    assert (plan_placement(heat, [0, 0]) == LOCAL).all()
    assert (plan_placement(heat, [100], local_keep=0) == 0).all()
    with pytest.raises(ValueError):
        plan_placement(heat, [-1])


# --- a local cluster ---------------------------------------------------------------------------

ray = pytest.importorskip("ray")
# A local cluster (head + 2 workers, ~100 s to start at nice 19 on the loaded 2-core machine)
# and its tests took 5.5 min there: slow. The placement and address tests are not.
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from engine.bench.synthetic import olmoe_config, write_store_from_seed
    cfg = olmoe_config(num_hidden_layers=M, num_experts=E, num_experts_per_tok=K_TOP, num_key_value_heads=2)
    return str(write_store_from_seed(tmp_path_factory.mktemp("cl") / "st", cfg, seed=7))


@pytest.fixture(scope="module")
def cluster():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from cluster_helpers import LocalCluster
    c = LocalCluster(workers=2, ram_gb=0.05)
    yield c
    c.close()


REQ_IDS = [5, 17, 3, 99, 42, 7, 250, 11, 64, 8, 1, 2]


def _run(store, max_new=10, cluster="", options=None, on_engine=None, **kw):
    from engine import Engine, EngineConfig, GenerateRequest, SamplingParams
    cfg = EngineConfig(store=store, history=False, pilot=0, cluster=cluster,
                       cluster_timeout_ms=kw.pop("cluster_timeout_ms", 120000), **kw)
    req = GenerateRequest(prompt_ids=REQ_IDS, sampling=SamplingParams(max_new_tokens=max_new))
    with Engine.open(cfg, cluster_options=options) as eng:
        if on_engine is not None:
            on_engine(eng)
        fin = list(eng.generate(req))[-1]
        assert fin.error == "", fin.error
        status = eng.cluster_status()
    return fin.token_ids, status


@pytest.fixture(scope="module")
def reference(store):
    ids, status = _run(store)
    assert status is None and len(ids) == 10
    return ids


def _placements():
    alt = np.full((M, E), LOCAL, np.int16)
    alt[:, 0::2] = 0  # even experts on worker 0, odd on worker 1, layer 1 all here
    alt[:, 1::2] = 1
    alt[1] = LOCAL
    one = np.full((M, E), LOCAL, np.int16)
    one[:, :5] = 1  # a few experts on worker 1 only; the rest streamed through a 2-slot cache
    return {"by-budget": (None, {}), "alternating": (alt, {}), "one-worker-small-cache": (one, {"cap": 2})}


@slow
@pytest.mark.parametrize("name", list(_placements()))
def test_ids_identical_to_one_machine(store, cluster, reference, name):
    from engine.cluster import ClusterOptions
    pl, kw = _placements()[name]
    ids, st = _run(store, cluster=cluster.address, options=ClusterOptions(placement=pl), **kw)
    assert ids == reference, name
    assert len(st.workers) == 2 and all(w.state == "up" for w in st.workers)
    want = st.placement if pl is None else pl
    assert (st.placement == want).all()
    for w in st.workers:  # every worker holding experts answered calls; none fell back
        assert w.experts == int((st.placement == w.index).sum())
        assert (w.calls > 0) == (w.experts > 0) and w.failures == 0, w
        # decode sends one row per worker per layer: bytes out are hidden states, kilobytes
        assert w.bytes_sent < 64 * 1024 * 11 * M
    if pl is None:  # by budget: everything fits on the two workers, half each
        assert (st.placement >= 0).all() and abs(st.workers[0].experts - st.workers[1].experts) <= M
    assert st.layer_calls > 0 and "workers up" in st.summary()


@slow
@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_ids_identical_for_other_families(tmp_path, cluster, family):
    """A shared expert (Qwen2-MoE) and another expert MLP with biases and a clamped SwiGLU
    (gpt-oss, Model.expert_forward) compute the same on the workers."""
    from engine.bench import synthetic
    from engine.cluster import ClusterOptions
    cfg = getattr(synthetic, f"{family}_config")()
    st = str(synthetic.write_store_from_seed(tmp_path / family, cfg, seed=11))
    ref, _ = _run(st, max_new=6)
    from engine.expert_store import ExpertStore
    with ExpertStore(st) as s:
        pl = np.zeros((s.args.num_moe_layers, s.args.num_experts), np.int16)
    pl[:, 1::2] = 1
    pl[:, 0] = LOCAL
    ids, status = _run(st, max_new=6, cluster=cluster.address, options=ClusterOptions(placement=pl))
    assert ids == ref and all(w.calls > 0 and w.failures == 0 for w in status.workers), status.workers


@slow
def test_worker_killed_mid_answer_completes_identically(store, cluster, reference):
    """SIGKILL worker 0's actor at token 3: the rest of the answer uses the SSD for its
    experts, same ids; the monitor re-creates the actor and the next answer uses it again."""
    from engine import Engine, EngineConfig, GenerateRequest, SamplingParams
    from engine.observers import Observer
    cfg = EngineConfig(store=store, history=False, pilot=0, cluster=cluster.address, cluster_timeout_ms=120000)
    req = GenerateRequest(prompt_ids=REQ_IDS, sampling=SamplingParams(max_new_tokens=10))
    with Engine.open(cfg) as eng:
        victim = eng.cluster_status().workers[0]
        assert victim.experts > 0 and victim.pid > 0

        class Killer(Observer):
            forwards = 0

            def on_forward_start(self, pos0, T):
                self.forwards += 1

            def on_layer_start(self, layer):
                if self.forwards == 4 and layer == 1 and not getattr(self, "done", False):
                    self.done = True
                    os.kill(victim.pid, signal.SIGKILL)
                    time.sleep(0.5)  # let Ray notice: the very next call to it fails
        eng.subscribe(Killer())
        fin = list(eng.generate(req))[-1]
        assert fin.error == "" and fin.token_ids == reference
        st = eng.cluster_status()
        w0 = st.workers[0]
        assert w0.failures >= 1, w0
        # back: the monitor re-creates the actor on the (alive) node and reloads its experts
        t0 = time.monotonic()
        while eng.cluster_status().workers[0].state != "up" and time.monotonic() - t0 < 300:
            time.sleep(0.2)
        back = eng.cluster_status().workers[0]
        assert back.state == "up" and back.pid != victim.pid
        calls = back.calls
        fin2 = list(eng.generate(req))[-1]
        assert fin2.token_ids == reference
        assert eng.cluster_status().workers[0].calls > calls


@slow
def test_timeout_falls_back_identically(store, cluster, reference):
    """Every worker call sleeps 300 ms against a 50 ms timeout: each layer falls back to the
    SSD, the ids do not change."""
    from engine.cluster import ClusterOptions
    ids, st = _run(store, max_new=4, cluster=cluster.address, options=ClusterOptions(delay_s=0.3),
                   cluster_timeout_ms=50)
    assert ids == reference[:4]
    assert sum(w.failures for w in st.workers) >= 1


@slow
def test_cli_status_lists_the_workers(cluster):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "cluster", "status", cluster.address],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    from engine.units import format_bytes
    rows = r.stdout.splitlines()[1:]
    want = format_bytes((int(0.05e9) >> 20) << 20)  # --ram-gb 0.05: GB, held in whole MiB
    assert len(rows) == 2 and all(" up " in ln and want in ln for ln in rows), r.stdout


@slow
def test_nothing_left_after_close(store, cluster, reference):
    """After close: no engine thread, no ExpertShard actor process, Ray disconnected."""
    import psutil
    from engine.generate import engine_threads_alive
    ids, _ = _run(store, max_new=3, cluster=cluster.address)
    assert ids == reference[:3]
    assert engine_threads_alive() == []
    assert not ray.is_initialized()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        shards = [p.pid for p in psutil.process_iter(["cmdline"])
                  if any("ExpertShard" in c for c in (p.info["cmdline"] or []))]
        if not shards:
            break
        time.sleep(0.5)
    assert shards == []
    assert not [t for t in threading.enumerate() if t.name.startswith("colibri-cluster")]


def test_join_counts_gb_as_every_other_size(monkeypatch, capsys):
    """`cluster join --ram-gb 2` said "2.15 GB" (it took GiB); GB is 1e9 bytes everywhere."""
    from engine.cli import cluster as C
    from engine.cli import main
    seen = {}
    monkeypatch.setattr(C, "_ray_start", lambda args: args)
    monkeypatch.setattr(C, "_run_foreground", lambda cmd, banner: seen.update(cmd=cmd, banner=banner) or 0)
    import socket
    with socket.socket() as head:  # a head that answers
        head.bind(("127.0.0.1", 0))
        head.listen(1)
        assert main(["cluster", "join", f"127.0.0.1:{head.getsockname()[1]}", "--ram-gb", "2"]) == 0
    assert "with 2.00 GB for experts" in seen["banner"], seen["banner"]
    mib = json.loads(seen["cmd"][seen["cmd"].index("--resources") + 1])[RESOURCE]
    assert mib == int(2e9) >> 20


def test_cluster_cli_refuses_bad_input(capsys):
    from engine.cli import main
    assert main(["cluster", "join", "127.0.0.1:1", "--ram-gb", "0"]) == 2
    err = capsys.readouterr().err
    assert "--ram-gb 0" in err and "Traceback" not in err
    assert main(["cluster", "status", "no-port-here"]) == 2
    assert "host:port" in capsys.readouterr().err


def test_join_and_status_check_their_address_before_ray(monkeypatch, capsys):
    """`cluster join` handed a dead or malformed ADDRESS to Ray, which printed its retry logs
    for minutes (or a ValueError traceback); `cluster status` named the app's setting."""
    import socket
    from engine.cli import cluster as C
    from engine.cli import main
    started = []
    monkeypatch.setattr(C, "_run_foreground", lambda cmd, banner: started.append(cmd) or 0)
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    for argv in (["cluster", "join", dead, "--ram-gb", "2"], ["cluster", "status", dead]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"ADDRESS = '{dead}': no cluster head answers there" in err, err
        assert "setting" not in err and "[Errno" not in err
    assert main(["cluster", "join", "nonsense", "--ram-gb", "2"]) == 2
    err = capsys.readouterr().err
    assert "ADDRESS = 'nonsense': give the head's address as host:port" in err and "Traceback" not in err
    assert not started


def test_bad_address_is_a_clear_error(store):
    from engine import ConfigError, Engine, EngineConfig
    import socket
    with socket.socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="setting 'cluster'"):
        Engine.open(EngineConfig(store=store, history=False, cluster=f"127.0.0.1:{port}"))
    assert time.monotonic() - t0 < 120


def test_remote_mask_is_the_experts_of_workers_that_are_up():
    """The residency panel's REMOTE state: experts placed on a worker that is up; a down
    worker's experts are served here (SSD fallback) and are not remote."""
    import threading
    from types import SimpleNamespace
    from engine.cluster import ClusterExperts
    pl = np.array([[-1, 0, 1, 1], [0, -1, -1, 1]], np.int16)
    fake = SimpleNamespace(_lock=threading.Lock(), placement=pl,
                           workers=[SimpleNamespace(state="up"), SimpleNamespace(state="down")])
    assert ClusterExperts.remote_mask(fake).tolist() == [[False, True, False, False], [True, False, False, False]]
    fake.workers[1].state = "up"
    assert (ClusterExperts.remote_mask(fake) == (pl >= 0)).all()


def test_a_worker_of_another_engine_or_store_format_is_refused_before_it_gets_slabs():
    """ClusterExperts checks a worker's kernels, engine version and store format (info()) before
    sending it any slab: a worker of an older store format (no "store_format", before 4) would
    read interleaved int4 slabs as row-major. No Ray needed."""
    from engine import __version__
    from engine.cluster import ClusterExperts, ExpertShard
    from engine.errors import EngineError
    from engine.models.base import K
    from engine.store_format import FORMAT_VERSION

    class W:
        address = "10.0.0.2:6379"
    same = {"kernels": K.__name__, "version": __version__, "store_format": FORMAT_VERSION}
    ClusterExperts._check_same_engine(W(), same)
    for bad in ({"store_format": None}, {"store_format": FORMAT_VERSION - 1}, {"version": "0.0.1"},
                {"kernels": "engine.kernels_ref" if K.__name__ != "engine.kernels_ref" else "engine.kernels"}):
        info = {k: v for k, v in {**same, **bad}.items() if v is not None}
        with pytest.raises(EngineError, match=r"worker 10\.0\.0\.2:6379 runs .*install the same colibri on both"):
            ClusterExperts._check_same_engine(W(), info)
    assert ExpertShard.info.__doc__ and "store format" in ExpertShard.info.__doc__
