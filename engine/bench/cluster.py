"""``colibri bench cluster``: expert-parallel serving over Ray (engine/cluster.py) against
streaming from this computer's SSD, on a local cluster (head + N workers on this machine).

Arms: 1 machine streaming (the desktop's cache at ``--cap`` slots per layer, the rest read
from the SSD) vs the same desktop with 2 and 3 local workers holding every other expert
resident, each with an injected per-call delay of 0, 0.2 and 1 ms (``ClusterOptions.delay_s``:
every batched layer call to a worker sleeps that long on the worker before computing, i.e. one
simulated LAN round trip per worker per layer; tc netem needs root on the loopback device and
is not used). Reported: decode tok/s, mean per-layer round trip (sending every worker's call
to having every answer), bytes sent + received per token, and the model of when
expert-parallel beats streaming (a table by disk speed, LAN round trip and cache hit rate).

Also home of :class:`LocalCluster` (the tests' local cluster): ``colibri cluster head`` +
N ``colibri cluster join`` processes on this machine, each worker in its own memory cgroup
(v1) when /sys/fs/cgroup/memory is writable. Processes are stopped by their ids (SIGTERM to
the ``colibri cluster`` process, which stops its ``ray start --block``), never by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cgroups_writable() -> bool:
    if not (CGROUP_V1 / "cgroup.procs").exists():
        return False
    probe = CGROUP_V1 / f"colibri_probe_{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


class LocalCluster:
    """Head + ``workers`` joined processes; ``ram_gb`` per worker; ``cgroup_bytes``: each
    worker's memory limit when cgroups are writable (0 = no cgroups)."""

    def __init__(self, workers: int = 2, ram_gb: float = 0.05, cgroup_bytes: int = 3 << 30):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.tmp = tempfile.mkdtemp(prefix="cray", dir="/tmp")
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0",
                    "OMP_WAIT_POLICY": "PASSIVE"}
        self.procs: list[subprocess.Popen] = []
        self.cgroups: list[Path] = []
        self.use_cgroups = bool(cgroup_bytes) and cgroups_writable()
        try:
            self._start_all(workers, ram_gb, cgroup_bytes)
        except BaseException:
            self.close()
            raise

    def _start_all(self, workers: int, ram_gb: float, cgroup_bytes: int) -> None:
        cli = [sys.executable, "-m", "engine.cli", "cluster"]
        for attempt in range(3):
            self._start(cli + ["head", "--port", str(self.port), "--node-ip", "127.0.0.1", "--temp-dir", self.tmp])
            if self._wait_head():
                break
            self.stop(self.procs.pop())
        else:
            raise RuntimeError("the cluster head did not start: " + self.log(0))
        for i in range(workers):
            cg = None
            if self.use_cgroups:
                cg = CGROUP_V1 / f"colibri_test_{os.getpid()}_{self.port}_{i}"
                cg.mkdir()
                (cg / "memory.limit_in_bytes").write_text(str(cgroup_bytes))
                self.cgroups.append(cg)
            join = cli + ["join", self.address, "--ram-gb", str(ram_gb), "--threads", "1", "--node-ip", "127.0.0.1"]
            for attempt in range(3):  # one at a time; Ray gives a node 30 s to register (hard-coded)
                self._start(join, cg)
                if self.wait_workers(i + 1, proc=self.procs[-1]):
                    break
                self.stop(self.procs.pop())
            else:
                raise RuntimeError(f"worker {i} did not join: {self.log(len(self.procs))}")

    def _start(self, cmd, cgroup: Path | None = None) -> None:
        def enter():  # the child (and the Ray processes it starts) live in the cgroup
            os.setsid()
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text(str(os.getpid()))
        log = open(Path(self.tmp) / f"p{len(self.procs)}.log", "ab")
        self.procs.append(subprocess.Popen(cmd, env=self.env, cwd=str(ROOT), stdout=log,
                                           stderr=subprocess.STDOUT, preexec_fn=enter))

    def _wait_head(self, timeout: float = 600.0) -> None:
        """True once the head's port answers and its node is registered; False if it exits."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.procs[-1].poll() is not None:
                return False
            if "Ray runtime started" in self.log(len(self.procs) - 1, 1 << 20):
                return True
            time.sleep(0.3)
        return False

    def wait_workers(self, n: int, timeout: float = 600.0, proc: subprocess.Popen | None = None) -> bool:
        """True once ``n`` workers are alive; False if ``proc`` exits first or after ``timeout``."""
        from engine.cluster import cluster_nodes
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                if sum(x["alive"] for x in cluster_nodes(self.address)) >= n:
                    return True
            except Exception:  # noqa: BLE001 - the head is still coming up
                pass
            if proc is not None and proc.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def log(self, i: int, tail: int = 2000) -> str:
        try:
            return (Path(self.tmp) / f"p{i}.log").read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def stop(self, p: subprocess.Popen) -> None:
        """SIGTERM one `colibri cluster` process (it stops its `ray start --block`, which stops
        its Ray processes); after 60 s, SIGKILL its process group (its own session)."""
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        t0 = time.monotonic()  # its Ray processes share its process group: wait until they are gone
        while time.monotonic() - t0 < 30:
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """SIGTERM every process this object started (by id; workers first), wait, clean up."""
        for p in reversed(self.procs):
            self.stop(p)
        for cg in self.cgroups:
            for _ in range(100):
                try:
                    cg.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        shutil.rmtree(self.tmp, ignore_errors=True)


# --- the benchmark -------------------------------------------------------------------------------

DISK_GBPS = (0.5, 2.0, 7.0)   # SATA SSD, NVMe gen3, NVMe gen4 (sequential reads of whole slabs)
HIT_RATES = (0.5, 0.8, 0.95)
LAN_RTT_MS = (0.2, 1.0)       # one switch hop on gigabit / a busy Wi-Fi-to-wired path


def break_even_rows(slab_bytes: int, k: int) -> list[dict]:
    """The model of when expert-parallel beats streaming, per MoE layer of one decode token.

    Streaming reads the (1 - hit) * K misses, one slab each, at the disk's rate:
    t_read = (1 - h) K slab / bw. Expert-parallel replaces that with one round trip to the
    workers (the calls to different workers overlap): t_net = RTT + (D floats out, K_w D
    back: kilobytes, negligible at LAN rates). Both compute the same K experts (the workers'
    in parallel), so expert-parallel wins while RTT < t_read; the table gives t_read (the
    break-even RTT) and the per-layer gain at each LAN RTT (positive: expert-parallel is
    faster by that much per layer)."""
    rows = []
    for bw in DISK_GBPS:
        for h in HIT_RATES:
            t_read = (1 - h) * k * slab_bytes / (bw * 1e9) * 1e3  # ms
            r = {"disk_gbps": bw, "hit_rate": h, "break_even_rtt_ms": t_read}
            for rtt in LAN_RTT_MS:
                r[f"gain_ms_at_{rtt:g}"] = t_read - rtt
            rows.append(r)
    return rows


def _arm(store: str, workers: int, delay_ms: float, address: str, tokens: int, cap: int, prompt: list[int]) -> dict:
    from ..cluster import ClusterOptions
    from ..events import GenerateRequest, SamplingParams
    from ..generate import Engine
    from ..settings import EngineConfig
    cfg = EngineConfig(store=store, cap=cap, pilot=0, history=False, cluster=address if workers else "",
                       cluster_timeout_ms=30000)
    opts = ClusterOptions(delay_s=delay_ms / 1e3, max_workers=workers) if workers else None
    req = GenerateRequest(prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=tokens))
    with Engine.open(cfg, cluster_options=opts) as eng:
        fin = list(eng.generate(req))[-1]
        st = eng.cluster_status()
    if fin.error:
        raise RuntimeError(f"arm workers={workers} delay={delay_ms} ms: {fin.error}")
    n_tok = fin.prompt_tokens + fin.generated_tokens
    r = {"workers": workers, "delay_ms": delay_ms, "tok_per_s": fin.decode_tok_per_s, "ttft_s": fin.ttft_s,
         "hit_rate": fin.hit_rate, "ssd_mb_per_token": fin.mb_per_token, "ids": list(fin.token_ids)}
    if st is not None:
        sent = sum(w.bytes_sent + w.bytes_received for w in st.workers)
        r.update(layer_rtt_ms=st.mean_layer_rtt_s * 1e3, net_kb_per_token=sent / n_tok / 1e3,
                 failures=sum(w.failures for w in st.workers), remote_experts=int((st.placement >= 0).sum()))
    return r


def cmd_cluster(a) -> int:
    from ..cluster import ray_available
    from ..expert_store import ExpertStore
    from .common import machine_info, md_table, write_results
    if not ray_available():
        print("colibri bench cluster needs Ray: pip install 'colibri-desktop[cluster]'", file=sys.stderr)
        return 2
    with ExpertStore(a.store, o_direct=False) as st:
        args, slab = st.args, st.slot_bytes
    M, E = args.num_moe_layers, args.num_experts
    n_max = max(a.workers)
    # each worker can hold half the experts (the 2-worker arm puts everything remote)
    ram_gb = max(M * E * slab / 2 * 1.05 / 1e9, 2 * (1 << 20) / 1e9)  # --ram-gb is GB (1e9); at least 2 MiB
    prompt = list(range(3, 3 + a.prompt_tokens))
    rows = []
    cl = LocalCluster(workers=n_max, ram_gb=ram_gb, cgroup_bytes=0) if n_max else None
    try:
        for w in a.workers:
            for d in (a.delays_ms if w else [0.0]):
                r = _arm(a.store, w, d, cl.address if cl else "", a.tokens, a.cap, prompt)
                print(f"workers {w} delay {d} ms: {r['tok_per_s']:.2f} tok/s", flush=True)
                rows.append(r)
    finally:
        if cl is not None:
            cl.close()
    same = all(r["ids"] == rows[0]["ids"] for r in rows)
    for r in rows:
        r.pop("ids")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    data = {"store": a.store, "model_type": args.model_type, "num_moe_layers": M, "num_experts": E,
            "num_experts_per_tok": args.num_experts_per_tok, "slab_bytes": slab, "cap": a.cap,
            "tokens": a.tokens, "prompt_tokens": a.prompt_tokens, "ids_identical": same, "arms": rows,
            "load_avg_1m": load, "machine": machine_info(),
            "delay_note": "injected: every worker call sleeps delay_ms on the worker before computing"}
    be = break_even_rows(slab, args.num_experts_per_tok)
    data["break_even"] = be
    ray_ms = min((r["layer_rtt_ms"] for r in rows if r["workers"] and r["delay_ms"] == 0), default=None)
    data["ray_overhead_ms"] = ray_ms
    table = (f"# colibri bench cluster: {Path(a.store).name} ({args.model_type}, {M} MoE layers x {E} experts, "
             f"top-{args.num_experts_per_tok}, slab {slab / 1e6:.2f} MB), desktop cache {a.cap}/layer\n\n"
             f"Greedy ids identical across every arm: {'yes' if same else 'NO'}. Load average at the end: "
             f"{load:.1f} on {os.cpu_count()} cores (workers share this machine's cores).\n\n"
             + md_table(rows, [("workers", "workers", "d"), ("injected delay ms", "delay_ms", "g"),
                               ("decode tok/s", "tok_per_s", ".2f"), ("layer round trip ms", "layer_rtt_ms", ".2f"),
                               ("net kB/token", "net_kb_per_token", ".1f"), ("SSD MB/token", "ssd_mb_per_token", ".1f"),
                               ("desktop hit rate", "hit_rate", ".2f"), ("fallbacks", "failures", "d")])
             + "\n\n## When expert-parallel beats streaming (model)\n\n"
             + "Per MoE layer of a decode token, streaming reads (1 - hit) x K missed slabs at the disk's "
               "rate; expert-parallel pays one LAN round trip instead (calls to the workers overlap; the "
               "kilobytes of hidden states are negligible). Break-even RTT = (1 - hit) K slab / disk rate; "
               f"below with this store's slab ({slab / 1e6:.2f} MB) and K = {args.num_experts_per_tok}. "
               + (f"Ray's own cost per layer, measured here as the layer round trip of the fastest "
                  f"0-delay arm, was {ray_ms:.2f} ms: it adds to the LAN RTT on this side of the "
                  f"comparison (it includes the workers' compute, which streaming does here too)."
                  if ray_ms is not None else "")
               + "\n\n"
             + md_table(be, [("disk GB/s", "disk_gbps", "g"), ("hit rate", "hit_rate", "g"),
                             ("break-even RTT ms", "break_even_rtt_ms", ".2f")]
                        + [(f"gain/layer at {r:g} ms RTT (ms)", f"gain_ms_at_{r:g}", "+.2f") for r in LAN_RTT_MS]))
    write_results(f"cluster_{a.name or Path(a.store).name}", data, table, a.out)
    return 0 if same else 1


def add_parser(bs) -> None:
    """Register `cluster` under ``colibri bench``."""
    c = bs.add_parser("cluster", help="expert-parallel serving over Ray vs streaming, on local workers")
    c.add_argument("--store", required=True, help="a converted store (e.g. from `colibri bench make-synthetic`)")
    c.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2, 3],
                   help="arms: local workers (0 = this computer streaming alone)")
    c.add_argument("--delays-ms", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.2, 1.0],
                   help="injected per-call delay of the worker arms, ms")
    c.add_argument("--cap", type=int, default=4, help="the desktop's cache slots per layer (too small to hold the experts)")
    c.add_argument("--tokens", type=int, default=32, help="tokens to generate per arm")
    c.add_argument("--prompt-tokens", type=int, default=8)
    c.add_argument("--name", default="", help="results name (default: the store's folder name)")
    c.add_argument("--out", default="bench/results")
    c.set_defaults(fn=cmd_cluster)
