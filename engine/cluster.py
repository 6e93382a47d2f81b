"""Expert-parallel serving over Ray: other computers hold shares of the routed experts in RAM
and compute them for the hidden states this computer sends.

This computer keeps the dense weights, attention, the KV cache and its own expert cache (the
hottest experts by routing heat, and every expert no worker holds, streamed from the SSD as
usual). Each worker joined with ``colibri cluster join ADDRESS --ram-gb N`` advertises the Ray
custom resource :data:`RESOURCE` (its expert RAM in MiB); one :class:`ExpertShard` actor per
worker node loads its share of the slabs (from the same store format: its own copy of the
store at the same path, else the slabs are sent from this computer once) and keeps them
resident.

Per MoE layer and worker: one batched actor call for all the experts routed there (the
hidden-state rows each expert sees, float32; the expert outputs come back, float32), all
workers' calls in flight at once while this computer computes its local experts. The outputs
land in the same rows of the same buffer the single-machine loop fills, computed by the same
expert MLP (the family's ``Model.expert_forward``, :func:`expert_function`) on the same rows, and :meth:`MoEModel.moe` then
sums them in rank order exactly as it always does: the generated ids are byte-identical to
one machine's (tests/test_cluster.py), provided the workers run the same kernels (same
engine version, same numba or reference kernels, same CPU instruction set: a worker whose
differs is reported in :class:`WorkerStatus`).

Faults: a call that raises (the actor or its node died) or does not answer within the
timeout marks the worker down; the experts of that call, and every later call until the
worker is back, are computed here from the local cache (read from the SSD). A monitor thread
re-creates a dead worker's actor when its node is alive (and re-pings a timed-out one); once
its experts are loaded again it serves again. The answer never stops and its ids do not
change.

Sources: Ray's actor API (``ray.remote``, ``NodeAffinitySchedulingStrategy``, custom
resources, ``ray.wait``/``ray.get`` with timeouts; docs.ray.io "Actors", "Fault tolerance");
the expert-parallel split itself is the usual one of MoE serving (DeepSpeed-MoE, Rajbhandari
et al. 2022): tokens go to the device holding their expert, outputs come back and are
combined by the router weights.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ConfigError, EngineError

log = logging.getLogger(__name__)

RESOURCE = "colibri_expert_mb"  # Ray custom resource of a joined worker: its expert RAM, MiB
LOCAL = -1  # placement value: served by this computer (its cache, streamed from the SSD)
LOAD_TIMEOUT_S = 600.0  # a worker that has not loaded its share by then is left down
MONITOR_INTERVAL_S = 0.5
INCOMPATIBLE = "incompatible: "  # a worker's reason when it runs other kernels / another engine (never retried)
ENGINE_ROOT = str(Path(__file__).resolve().parent.parent)  # the folder holding the engine package


def ray_available() -> bool:
    """True when the ``ray`` package can be imported (``pip install 'colibri-desktop[cluster]'``)."""
    try:
        import ray  # noqa: F401
        return True
    except ImportError:
        return False


def check_address(address: str, timeout_s: float = 5.0, name: str = "setting 'cluster'") -> tuple[str, int]:
    """(host, port) of a Ray head address "host:port" after a TCP connect to it succeeded
    (Ray itself retries a dead address for minutes). ``name``: what the address is, for the
    message (the setting, or a command's ADDRESS argument).

    Raises:
        ConfigError: naming ``name``, when the address is malformed or nothing listens.
    """
    import socket
    setting = name == "setting 'cluster'"
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name} = {address!r}: give the head's address as host:port, e.g. "
                          f"192.168.1.20:6380 (as `colibri cluster head` prints)" + (", or clear it" if setting else ""))
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(f"{name} = {address!r}: no cluster head answers there ({e.strerror or e}); start one "
                          f"with `colibri cluster head` on that computer"
                          + (", or clear the setting" if setting else ", and check the address")) from None
    return host, int(port)


def _ray():
    try:
        import ray
        return ray
    except ImportError:
        raise ConfigError("setting 'cluster': the Ray package is not installed; install it with "
                          "`pip install 'colibri-desktop[cluster]'` (or `pip install ray`), or clear the "
                          "cluster setting to run on this computer only") from None


def expert_function(args, expert_quant: str, group_size: int):
    """The family's routed-expert MLP, ``Model.expert_forward(views, x, h, out)`` (SwiGLU via
    run_expert, or a family's own: gpt-oss), bound to a bare model object that holds only what
    that method reads (args, expert_quant, gs): the workers and the SSD fallback compute
    exactly what MoEModel.moe computes, without the dense weights."""
    from .models import family_for
    obj = object.__new__(family_for(args.model_type).Model)
    obj.args, obj.expert_quant, obj.gs = args, expert_quant, group_size
    return obj.expert_forward


# --- the worker side ---------------------------------------------------------------------------


class ExpertShard:
    """A worker's share of the experts, resident in one arena (runs inside a Ray actor).

    Args:
        store_path: the store folder (the same path on the worker when it has a copy).
        items: [(MoE layer j, expert e)] this shard holds, in arena order.
        store_created: the manifest's "created" stamp: a local copy must match it.
        threads: compute threads of the kernels (numba) on the worker.
        delay_s: seconds added to every call (benchmarks: a documented stand-in for LAN latency).

    If the worker has no matching copy of the store, :meth:`needs_slabs` is True and the
    driver sends them with :meth:`put_slabs` (each slab as bytes, once).
    """

    def __init__(self, store_path: str, items: list, store_created: str, threads: int = 1,
                 delay_s: float = 0.0, meta: dict | None = None):
        from .models.base import K
        from .quant import aligned_empty, slab_views
        self._K = K
        self.items = [(int(j), int(e)) for j, e in items]
        self.delay_s = float(delay_s)
        self.threads = max(1, int(threads))
        K.set_threads(self.threads)
        self.store = None
        try:
            from .expert_store import ExpertStore
            st = ExpertStore(store_path, o_direct=False)
            if st.manifest.get("created", "") == store_created:
                self.store = st
            else:
                st.close()
        except Exception:  # noqa: BLE001 - no usable copy here: the driver sends the slabs
            self.store = None
        if self.store is not None:
            self.layout, self.slot_bytes = self.store.layout, self.store.slot_bytes
            self.quant, self.gs, args = self.store.quant, self.store.group_size, self.store.args
        else:
            m = meta or {}
            self.layout, self.slot_bytes = m["layout"], int(m["slot_bytes"])
            self.quant, self.gs, args = m["quant"], int(m["group_size"]), m["args"]
        self.D, self.I = args.hidden_size, args.moe_intermediate_size
        self.forward = expert_function(args, self.quant, self.gs)
        self.arena = aligned_empty(max(1, len(self.items)) * self.slot_bytes)
        self.views: dict[tuple[int, int], dict] = {}
        self._slab_views = slab_views
        self.loaded = 0
        if self.store is not None:
            for n, (j, e) in enumerate(self.items):
                buf = self.arena[n * self.slot_bytes:(n + 1) * self.slot_bytes]
                self.store.read(j, e, buf, verify=True)
                self.views[(j, e)] = slab_views(buf, self.layout)
            self.loaded = len(self.items)
            self.store.close()
            self._warm()

    def _warm(self) -> None:
        """Run the kernel once (numba compiles or loads it now, not in the first layer call,
        which would otherwise outlast the driver's timeout)."""
        if self.items and self.loaded == len(self.items):
            self.run(self.items[0][0], [self.items[0][1]], [1], np.zeros((1, self.D), np.float32), True)

    def needs_slabs(self) -> bool:
        return self.loaded < len(self.items)

    def put_slabs(self, start: int, data: bytes) -> int:
        """Copy slabs ``start``.. (whole slabs, arena order) from ``data``; returns slabs held."""
        n = len(data) // self.slot_bytes
        raw = np.frombuffer(data, np.uint8)
        for k in range(n):
            i = start + k
            buf = self.arena[i * self.slot_bytes:(i + 1) * self.slot_bytes]
            buf[:] = raw[k * self.slot_bytes:(k + 1) * self.slot_bytes]
            self.views[self.items[i]] = self._slab_views(buf, self.layout)
        self.loaded = max(self.loaded, start + n)
        self._warm()
        return self.loaded

    def info(self) -> dict:
        """pid, host, kernels module, engine version, store format it writes, CPU features,
        experts held."""
        import socket
        from . import __version__
        from .store_format import FORMAT_VERSION
        feats = {}
        if hasattr(self._K, "cpu_features"):
            try:
                feats = self._K.cpu_features()
            except Exception:  # noqa: BLE001
                feats = {}
        return {"pid": os.getpid(), "host": socket.gethostname(), "kernels": self._K.__name__,
                "version": __version__, "store_format": FORMAT_VERSION,
                "cpu": sorted(k for k, v in feats.items() if v),
                "experts": self.loaded, "bytes": self.loaded * self.slot_bytes}

    def ping(self) -> int:
        return os.getpid()

    def run(self, layer: int, experts: list, counts: list, xs: np.ndarray, single: bool) -> np.ndarray:
        """Expert outputs float32 [sum(counts), D]: expert ``experts[i]`` of ``layer`` on its
        ``counts[i]`` rows of ``xs`` (float32 [sum(counts), D], the experts' rows one after the
        other), or, ``single``, every expert on the one row xs [1, D] (counts all 1).

        Raises:
            KeyError: an expert this shard does not hold (a placement bug).
        """
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        self._K.set_threads(self.threads)
        if not xs.flags.writeable or not xs.flags.c_contiguous:
            # Ray hands numpy arguments over read-only: numba would compile (minutes on a busy
            # machine) and cache another specialisation for them; a copy of kilobytes is free
            xs = np.array(xs, np.float32, order="C")
        N = int(sum(counts))
        out = np.empty((N, self.D), np.float32)
        scratch = np.empty((max(counts) if counts else 1, self.I), np.float32)
        off = 0
        for e, n in zip(experts, counts):
            v = self.views[(int(layer), int(e))]
            x = xs if single else xs[off:off + n]
            self.forward(v, x, scratch[:n], out[off:off + n])
            off += n
        return out


_SHARD = None


def _remote_shard(ray):
    """The Ray actor class of ExpertShard (made once; no CPU reserved: the worker's CPUs are
    its kernels' threads, the RAM is reserved through RESOURCE)."""
    global _SHARD
    if _SHARD is None:
        _SHARD = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1)(ExpertShard)
    return _SHARD


# --- placement -----------------------------------------------------------------------------------


def plan_placement(heat: np.ndarray, capacities: list[int], local_keep: int = 0) -> np.ndarray:
    """Which computer serves each expert: int16 [M, E], worker index or LOCAL (-1).

    Per MoE layer, the ``local_keep`` hottest experts by ``heat`` (int [M, E] routing counts;
    ties: lower id; never one with a zero count, as hot pinning) stay local; the others, hottest
    first, go one at a time to the worker with the lowest fill (held / per-layer quota; ties:
    the lower index) that still has room, so each worker gets a similar mix of hot and cold
    experts. Worker w's per-layer quota is ``capacities[w] // M`` slabs (``capacities``: slabs
    each worker's RAM holds); what no worker has room for stays local (streamed).

    Raises:
        ValueError: a negative capacity or local_keep.
    """
    from .heat import choose_pins
    heat = np.asarray(heat)
    M, E = heat.shape
    if local_keep < 0 or any(c < 0 for c in capacities):
        raise ValueError("capacities and local_keep must be >= 0")
    out = np.full((M, E), LOCAL, np.int16)
    keep = choose_pins(heat, local_keep)
    quota = [int(c) // max(1, M) for c in capacities]
    for j in range(M):
        held = [0] * len(capacities)
        for e in np.argsort(-heat[j], kind="stable").tolist():
            if keep[j, e]:
                continue
            room = [w for w in range(len(quota)) if held[w] < quota[w]]
            if not room:
                break
            w = min(room, key=lambda w: (held[w] / quota[w], w))
            out[j, e] = w
            held[w] += 1
    return out


# --- the driver side -----------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerStatus:
    """One worker as the engine sees it.

    Attributes: index (placement value), node_id (Ray node), address (its IP), ram_bytes (the
    expert RAM it advertised), experts (slabs placed on it), state ("up", "loading", "down"),
    reason (why down), calls (batched layer calls answered), failures (calls that fell back to
    the SSD), mean_rtt_s (mean round trip of its calls, seconds), bytes_sent / bytes_received
    (hidden states out, expert outputs back), pid (its actor process), same_cpu (its CPU has
    the instruction set this computer compiled for: False may change the last bits).
    """

    index: int
    node_id: str
    address: str
    ram_bytes: int
    experts: int
    state: str
    reason: str = ""
    calls: int = 0
    failures: int = 0
    mean_rtt_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    pid: int = 0
    same_cpu: bool = True


@dataclass(frozen=True)
class ClusterStatus:
    """The cluster as the engine sees it (``Engine.cluster_status()``).

    Attributes: address (the Ray head), workers (WorkerStatus, by index), placement (int16
    [M, E]: worker index or -1 = this computer), local_experts (experts served here by
    placement), fallback_experts (placed on a worker that is down, served here now),
    layer_calls (MoE layer calls that went to at least one worker), mean_layer_rtt_s (mean
    time from sending a layer's calls to having every answer, seconds).
    """

    address: str
    workers: tuple[WorkerStatus, ...]
    placement: np.ndarray = field(repr=False)
    local_experts: int = 0
    fallback_experts: int = 0
    layer_calls: int = 0
    mean_layer_rtt_s: float = 0.0

    def summary(self) -> str:
        """One line for the status bar: "cluster: 2/2 workers up, 96 experts remote, 32 here"."""
        up = sum(w.state == "up" for w in self.workers)
        remote = int((self.placement >= 0).sum())
        s = f"cluster: {up}/{len(self.workers)} workers up, {remote} experts remote, {self.local_experts} here"
        if self.fallback_experts:
            s += f", {self.fallback_experts} from the SSD while a worker is down"
        if self.layer_calls:
            s += f", {self.mean_layer_rtt_s * 1e3:.2f} ms/layer"
        return s


@dataclass
class ClusterOptions:
    """How the engine uses a cluster, beyond the settings (tests, benchmarks).

    Attributes: placement (int [M, E] worker index or -1, None = :func:`plan_placement` by
    RAM budget and heat), delay_s (seconds each worker call sleeps, a documented stand-in for
    LAN latency; 0 in use), worker_threads (kernel threads per worker; 0 = its Ray CPUs),
    max_workers (use at most this many of the joined workers; 0 = all).
    """

    placement: np.ndarray | None = None
    delay_s: float = 0.0
    worker_threads: int = 0
    max_workers: int = 0


class _Worker:
    __slots__ = ("index", "node_id", "address", "ram_bytes", "cpus", "items", "actor", "state", "reason",
                 "calls", "failures", "rtt_s", "sent", "received", "pid", "same_cpu", "pending", "mb", "retry_at",
                 "backoff")

    def __init__(self, index, node_id, address, ram_bytes, cpus):
        self.index, self.node_id, self.address, self.ram_bytes, self.cpus = index, node_id, address, ram_bytes, cpus
        self.items: list[tuple[int, int]] = []
        self.actor = None
        self.state, self.reason = "loading", ""
        self.calls = self.failures = self.sent = self.received = self.pid = 0
        self.rtt_s = 0.0
        self.same_cpu = True
        self.pending = None  # ObjectRef of a load/ping the monitor waits for
        self.mb = 0
        self.retry_at = 0.0  # monotonic time of the monitor's next attempt at a failed worker
        self.backoff = MONITOR_INTERVAL_S


class _LayerCall:
    """The calls of one MoE layer in flight (returned by :meth:`ClusterExperts.dispatch`)."""

    def __init__(self, owner, layer, calls, bounds, single, t0):
        self.owner, self.layer, self.calls, self.bounds, self.single, self.t0 = owner, layer, calls, bounds, single, t0

    def collect(self, outs: np.ndarray, xs: np.ndarray, scratch: np.ndarray) -> None:
        """Fill ``outs`` rows of every remote expert of this call (see ClusterExperts.dispatch)."""
        self.owner.collect(self, outs, xs, scratch)


class ClusterExperts:
    """The ExpertProvider of expert-parallel serving: the experts placed on workers are
    computed there, the others by the local ExpertCache (engine/models/base.py's protocol,
    plus :meth:`dispatch`, which MoEModel.moe calls when a provider has it).

    Args:
        store: the ExpertStore. cache: the local ExpertCache (its prepare/acquire/release
            serve the local experts and every fallback). heat: int [M, E] routing counts.
        address: the Ray head ("host:port", as ``colibri cluster head`` prints).
        local_keep: hottest experts per layer that stay local (the engine's pins per layer).
        timeout_s: a worker call not answered by then falls back to the SSD.
        kind, group_size: the store's expert quantization (for run_expert).
        options: :class:`ClusterOptions`.

    Raises:
        ConfigError: Ray is not installed, the address does not answer, or no worker joined.
    """

    def __init__(self, store, cache, heat: np.ndarray, address: str, *, local_keep: int = 0,
                 timeout_s: float = 1.0, options: ClusterOptions | None = None):
        ray = self.ray = _ray()
        self.store, self.cache, self.address = store, cache, address
        self.options = options or ClusterOptions()
        self.timeout_s = float(timeout_s)
        self.M, self.E = cache.L, cache.E
        self.D = store.args.hidden_size
        self.expert_forward = expert_function(store.args, store.quant, store.group_size)
        self._lock = threading.Lock()
        self._closed = False
        self._owns_ray = False
        self._split: dict[int, dict[int, list[int]]] = {}
        self.layer_calls, self.layer_rtt_s = 0, 0.0
        self.local_keep = max(0, int(local_keep))
        env = {"PYTHONPATH": ENGINE_ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
        if os.environ.get("COLIBRI_NO_NUMBA"):
            env["COLIBRI_NO_NUMBA"] = os.environ["COLIBRI_NO_NUMBA"]
        if not ray.is_initialized():
            check_address(address)
            try:
                ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False,
                         runtime_env={"env_vars": env})
            except Exception as e:  # noqa: BLE001 - ConnectionError, ValueError, RuntimeError, ...
                raise ConfigError(f"setting 'cluster' = {address!r}: no Ray cluster answers there ({e}); "
                                  f"start one with `colibri cluster head` and give the address it prints, "
                                  f"or clear the setting") from None
            self._owns_ray = True
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # --- start ------------------------------------------------------------------------------------

    def _start(self) -> None:
        ray = self.ray
        nodes = sorted((n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(RESOURCE, 0) > 0),
                       key=lambda n: n["NodeID"])
        if self.options.max_workers:
            nodes = nodes[:self.options.max_workers]
        if not nodes:
            raise ConfigError(f"setting 'cluster' = {self.address!r}: the cluster has no colibri worker; join one "
                              f"with `colibri cluster join {self.address} --ram-gb N` on each computer that "
                              f"lends its RAM")
        slot = self.store.slot_bytes
        self.workers = [_Worker(i, n["NodeID"], n.get("NodeManagerAddress", ""),
                                int(n["Resources"][RESOURCE]) << 20, int(n["Resources"].get("CPU", 1)))
                        for i, n in enumerate(nodes)]
        if self.options.placement is not None:
            pl = np.asarray(self.options.placement, np.int16)
            if pl.shape != (self.M, self.E) or pl.min() < LOCAL or pl.max() >= len(self.workers):
                raise ValueError(f"cluster placement must be int [{self.M}, {self.E}] of -1..{len(self.workers) - 1}")
        else:
            pl = plan_placement(self.cache.heat, [w.ram_bytes // slot for w in self.workers], self.local_keep)
        self.placement = pl
        for j in range(self.M):
            for e in range(self.E):
                if pl[j, e] >= 0:
                    self.workers[pl[j, e]].items.append((j, e))
        self._local_cpu = self._cpu()
        refs = {}
        for w in self.workers:
            if w.items:
                refs[w.index] = self._launch(w)
            else:
                w.state = "up"
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        for i, ref in refs.items():
            w = self.workers[i]
            try:
                self._finish_load(w, ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
            except Exception as e:  # noqa: BLE001 - that worker stays down: its experts stream from the SSD
                self._down(w, (INCOMPATIBLE + str(e)) if isinstance(e, EngineError) else
                           f"could not load its experts ({type(e).__name__}: {e})")
                w.pending = None
        self._monitor = threading.Thread(target=self._watch, name="colibri-cluster-monitor", daemon=True)
        self._monitor.start()

    def _cpu(self) -> list[str]:
        from .models.base import K
        try:
            return sorted(k for k, v in K.cpu_features().items() if v) if hasattr(K, "cpu_features") else []
        except Exception:  # noqa: BLE001
            return []

    def _launch(self, w: _Worker):
        """Create w's actor on its node and start loading its share; returns the ref of its info."""
        ray = self.ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        st = self.store
        meta = {"layout": st.layout, "slot_bytes": st.slot_bytes, "quant": st.quant, "group_size": st.group_size,
                "args": st.args}
        threads = self.options.worker_threads or w.cpus or 1
        w.mb = max(1, -(-len(w.items) * st.slot_bytes // (1 << 20)))
        w.actor = _remote_shard(ray).options(
            resources={RESOURCE: min(w.mb, w.ram_bytes >> 20)},
            scheduling_strategy=NodeAffinitySchedulingStrategy(w.node_id, soft=False),
            name=None).remote(str(st.path), w.items, st.manifest.get("created", ""), threads,
                              self.options.delay_s, meta)
        w.state, w.reason = "loading", ""
        w.pending = w.actor.needs_slabs.remote()
        return w.pending

    @staticmethod
    def _check_same_engine(w: _Worker, info: dict) -> None:
        """Raises EngineError when the worker's kernels, engine version or store format differ
        from this computer's (install the same colibri on both)."""
        from . import __version__
        from .models.base import K
        from .store_format import FORMAT_VERSION
        if (info["kernels"] != K.__name__ or info["version"] != __version__
                or info.get("store_format") != FORMAT_VERSION):
            raise EngineError(f"worker {w.address} runs {info['kernels']} of engine {info['version']} "
                              f"(store format {info.get('store_format', 'before 4')}), this computer "
                              f"{K.__name__} of {__version__} (store format {FORMAT_VERSION}): install the "
                              f"same colibri on both")

    def _finish_load(self, w: _Worker, needs: bool) -> None:
        """w's actor is up; check it runs this engine (before any slab reaches it: a worker of
        an older store format would misread interleaved slabs), send it its slabs if it had no
        copy of the store, then mark it up."""
        ray = self.ray
        self._check_same_engine(w, ray.get(w.actor.info.remote(), timeout=LOAD_TIMEOUT_S))
        if needs:
            buf = self.store.new_buffer(1)
            per = max(1, (64 << 20) // self.store.slot_bytes)
            for s in range(0, len(w.items), per):
                chunk = bytearray()
                for j, e in w.items[s:s + per]:
                    n = self.store.read(j, e, buf, verify=True)
                    chunk += buf[:n].tobytes()
                ray.get(w.actor.put_slabs.remote(s, bytes(chunk)), timeout=LOAD_TIMEOUT_S)
        info = ray.get(w.actor.info.remote(), timeout=LOAD_TIMEOUT_S)
        w.pid = int(info["pid"])
        w.same_cpu = not self._local_cpu or info["cpu"] == self._local_cpu
        if not w.same_cpu:
            log.warning("cluster worker %s has another CPU instruction set than this computer: its expert "
                        "outputs may differ in the last bits", w.address)
        with self._lock:
            w.state, w.reason, w.pending = "up", "", None

    def _down(self, w: _Worker, reason: str) -> None:
        with self._lock:
            if w.state != "down":
                log.warning("cluster worker %s is down (%s); its %d experts come from the SSD until it is back",
                            w.address, reason, len(w.items))
            w.state, w.reason = "down", reason

    # --- the monitor -----------------------------------------------------------------------------

    def _watch(self) -> None:
        """Bring down workers back: re-ping a timed-out actor, re-create a dead one."""
        ray = self.ray
        while not self._closed:
            time.sleep(MONITOR_INTERVAL_S)
            for w in self.workers:
                if self._closed:
                    return
                if w.state != "down" or not w.items or w.reason.startswith(INCOMPATIBLE) \
                        or time.monotonic() < w.retry_at:
                    continue
                try:
                    if w.pending is None:
                        if w.reason.startswith("timed out") and w.actor is not None:
                            w.pending = w.actor.ping.remote()
                        else:
                            nodes = [n for n in ray.nodes() if n.get("Alive")]
                            if not any(n["NodeID"] == w.node_id for n in nodes):
                                # its computer left: one that joined since (a new Ray node)
                                # with room for the share and no share of its own takes over
                                taken = {x.node_id for x in self.workers if x is not w}
                                new = [n for n in nodes if n["NodeID"] not in taken
                                       and n["Resources"].get(RESOURCE, 0) >= w.mb]
                                if not new:
                                    continue
                                w.node_id = new[0]["NodeID"]
                                w.address = new[0].get("NodeManagerAddress", w.address)
                                w.ram_bytes = int(new[0]["Resources"][RESOURCE]) << 20
                            self._kill(w)
                            self._launch(w)
                            w.state = "down"  # stays down (served from the SSD) until loaded
                            w.reason = "restarting"
                        continue
                    done, _ = ray.wait([w.pending], timeout=0)
                    if not done:
                        continue
                    ref, w.pending = w.pending, None
                    res = ray.get(ref)
                    if w.reason == "restarting":
                        self._finish_load(w, bool(res))
                    else:
                        with self._lock:
                            w.state, w.reason = "up", ""
                    log.info("cluster worker %s is back", w.address)
                    w.backoff = MONITOR_INTERVAL_S
                except Exception as e:  # noqa: BLE001 - try again later, less and less often
                    w.pending = None
                    w.reason = (INCOMPATIBLE + str(e)) if isinstance(e, EngineError) else \
                        f"actor lost ({type(e).__name__})"
                    w.retry_at = time.monotonic() + w.backoff
                    w.backoff = min(60.0, w.backoff * 2)

    def _kill(self, w: _Worker) -> None:
        if w.actor is not None:
            try:
                self.ray.kill(w.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            w.actor = None

    # --- the ExpertProvider protocol ---------------------------------------------------------------

    def prepare(self, layer: int, experts) -> list[int]:
        """Split ``experts`` of ``layer`` into remote ones (remembered for :meth:`dispatch`) and
        local ones (placed here, or on a worker that is down); returns the local ones in the
        cache's compute order (the cache starts reading its misses now)."""
        remote: dict[int, list[int]] = {}
        local: list[int] = []
        pl = self.placement[layer]
        for e in experts:
            e = int(e)
            w = int(pl[e])
            if w >= 0 and self.workers[w].state == "up":
                remote.setdefault(w, []).append(e)
            else:
                local.append(e)
        self._split[layer] = remote
        return self.cache.prepare(layer, local) if local else []

    def acquire(self, layer: int, expert: int) -> dict:
        return self.cache.acquire(layer, expert)

    def release(self, layer: int, expert: int) -> None:
        self.cache.release(layer, expert)

    def dispatch(self, layer: int, xs: np.ndarray, bounds: dict, single: bool) -> _LayerCall | None:
        """Send one call per worker for the remote experts :meth:`prepare` set aside: expert e
        gets rows ``xs[lo:hi]`` (``bounds[e] = (lo, hi)``; ``single``: xs is the one row [1, D]
        every expert sees). Returns the calls in flight (None when none), whose ``collect``
        fills the rows ``lo:hi`` of MoEModel's output buffer."""
        remote = self._split.pop(layer, None)
        if not remote:
            return None
        calls = []
        t0 = time.perf_counter()
        for w, es in remote.items():
            counts = [bounds[e][1] - bounds[e][0] for e in es]
            rows = xs if single else np.concatenate([xs[bounds[e][0]:bounds[e][1]] for e in es])
            wk = self.workers[w]
            try:
                ref = wk.actor.run.remote(layer, es, counts, rows, single)
            except Exception as e:  # noqa: BLE001 - the actor handle is unusable: fall back now
                self._down(wk, f"call failed ({type(e).__name__})")
                ref = None
            wk.sent += rows.nbytes
            calls.append((wk, es, ref))
        return _LayerCall(self, layer, calls, bounds, single, t0)

    def collect(self, call: "_LayerCall", outs: np.ndarray, xs: np.ndarray, scratch: np.ndarray) -> None:
        """Wait for ``call``'s answers (until the timeout) and fill their rows of ``outs``; the
        experts of a worker that failed or timed out are computed here from the local cache."""
        ray = self.ray
        deadline = call.t0 + self.timeout_s
        fallback: list[int] = []
        for wk, es, ref in call.calls:
            res = None
            if ref is not None:
                try:
                    res = ray.get(ref, timeout=max(0.0, deadline - time.perf_counter()))
                except ray.exceptions.GetTimeoutError:
                    self._down(wk, f"timed out after {self.timeout_s * 1e3:.0f} ms")
                except Exception as e:  # noqa: BLE001 - RayActorError, node died, ...
                    self._down(wk, f"died ({type(e).__name__})")
            if res is None:
                wk.failures += 1
                fallback += es
                continue
            wk.calls += 1
            wk.rtt_s += time.perf_counter() - call.t0
            wk.received += res.nbytes
            off = 0
            for e in es:
                lo, hi = call.bounds[e]
                outs[lo:hi] = res[off:off + hi - lo]
                off += hi - lo
        self.layer_calls += 1
        self.layer_rtt_s += time.perf_counter() - call.t0
        if fallback:  # the same kernel on the same rows, from the local cache (read from the SSD)
            layer = call.layer
            for e in self.cache.prepare(layer, sorted(fallback)):
                lo, hi = call.bounds[e]
                v = self.cache.acquire(layer, e)
                try:
                    self.expert_forward(v, xs if call.single else xs[lo:hi], scratch[:hi - lo], outs[lo:hi])
                finally:
                    self.cache.release(layer, e)

    def forget(self) -> None:
        """Zero the call counters (the engine's kernel warm-up at open uses it)."""
        with self._lock:
            self.layer_calls, self.layer_rtt_s = 0, 0.0
            for w in self.workers:
                w.calls = w.failures = w.sent = w.received = 0
                w.rtt_s = 0.0

    # --- status ---------------------------------------------------------------------------------------

    def remote_mask(self) -> np.ndarray:
        """bool [M, E]: the experts held by a worker that is up now (the residency panel's
        REMOTE state); a down worker's experts are served here and show as this computer's."""
        with self._lock:
            up = np.array([w.state == "up" for w in self.workers] + [False], bool)
            pl = self.placement
        return up[np.where(pl >= 0, pl, len(up) - 1)] & (pl >= 0)

    def status(self) -> ClusterStatus:
        """The workers, the placement and the counters now."""
        with self._lock:
            ws = tuple(WorkerStatus(
                index=w.index, node_id=w.node_id, address=w.address, ram_bytes=w.ram_bytes, experts=len(w.items),
                state=w.state, reason=w.reason, calls=w.calls, failures=w.failures,
                mean_rtt_s=w.rtt_s / w.calls if w.calls else 0.0, bytes_sent=w.sent, bytes_received=w.received,
                pid=w.pid, same_cpu=w.same_cpu) for w in self.workers)
            down = sum(len(w.items) for w in self.workers if w.state != "up")
        return ClusterStatus(address=self.address, workers=ws, placement=self.placement.copy(),
                             local_experts=int((self.placement == LOCAL).sum()), fallback_experts=down,
                             layer_calls=self.layer_calls,
                             mean_layer_rtt_s=self.layer_rtt_s / self.layer_calls if self.layer_calls else 0.0)

    def close(self) -> None:
        """Stop the monitor, kill every actor this engine created, disconnect from Ray if this
        engine connected. Idempotent."""
        if self._closed:
            return
        self._closed = True
        mon = getattr(self, "_monitor", None)
        if mon is not None:
            mon.join()
        for w in getattr(self, "workers", []):
            self._kill(w)
        if self._owns_ray:
            try:
                self.ray.shutdown()
            except Exception:  # noqa: BLE001
                pass


def cluster_nodes(address: str, name: str = "setting 'cluster'") -> list[dict]:
    """The colibri workers of the Ray cluster at ``address`` (for ``colibri cluster status``):
    [{"node_id", "address", "alive", "ram_bytes", "free_bytes", "cpus"}], connecting for the call.

    Raises:
        ConfigError: Ray missing or nothing answers at ``address``.
    """
    ray = _ray()
    owns = not ray.is_initialized()
    if owns:
        check_address(address, name=name)
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"no Ray cluster answers at {address!r} ({e}); start one with `colibri cluster head`") from None
    try:
        avail = {}
        try:
            from ray._private.state import available_resources_per_node
            avail = available_resources_per_node()
        except Exception:  # noqa: BLE001 - older/newer Ray: no free figure
            avail = {}
        out = []
        for n in ray.nodes():
            mb = n["Resources"].get(RESOURCE, 0)
            if not mb:
                continue
            free = avail.get(n["NodeID"], {}).get(RESOURCE, mb if n.get("Alive") else 0)
            out.append({"node_id": n["NodeID"], "address": n.get("NodeManagerAddress", ""), "alive": bool(n.get("Alive")),
                        "ram_bytes": int(mb) << 20, "free_bytes": int(free) << 20,
                        "cpus": int(n["Resources"].get("CPU", 0))})
        return out
    finally:
        if owns:
            ray.shutdown()
