"""What this process may really use: memory and CPUs after cgroup limits and CPU affinity.

Containers (Docker, Kubernetes, systemd slices) limit a process through its cgroup while
``/proc/meminfo`` and ``os.cpu_count()`` still describe the whole host, so sizing from the
host alone gets a container OOM-killed (a 3 GB container sized a 21 GB budget) and starts
more threads than it may run.

Memory (the rules of the Linux cgroup docs, and the kubelet's "working set"):
    cgroup v2: ``memory.max`` ("max" = unlimited) of the process's cgroup and every ancestor
        (each limit applies), usage ``memory.current``, reclaimable ``inactive_file`` of
        ``memory.stat``;
    cgroup v1: ``memory.limit_in_bytes`` (>= 2**60 = unlimited), ``memory.usage_in_bytes``,
        ``total_inactive_file`` (else ``inactive_file``) of ``memory.stat``.
    headroom of one level = limit - (usage - inactive_file); the process's headroom is the
    smallest over the levels that have a limit.
CPUs: ``len(os.sched_getaffinity(0))``, further capped by the CFS quota
    (v2 ``cpu.max`` "QUOTA PERIOD" or "max PERIOD"; v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``,
    -1 = none), rounded up, at least 1.

The process's cgroup paths come from ``/proc/self/cgroup`` ("0::/path" for v2,
"N:memory:/path" / "N:cpu,cpuacct:/path" for v1). When the path is not found under the
mount (a cgroup namespace shows "/" or a path from outside), the mount root itself is the
process's cgroup. Every path is injectable (``root``, ``proc_cgroup``) so tests can use fake
trees. Linux only; elsewhere everything returns None (no limit known).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
V1_UNLIMITED = 1 << 60  # v1 reports "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest cgroup memory limit on this process, bytes.

    limit: the limit of the level with the least headroom; usage: that level's charged
    memory (RSS + page cache); reclaimable: its inactive file cache; version: 1 or 2;
    path: the limit file read.
    """

    limit: int
    usage: int
    reclaimable: int
    version: int
    path: str

    @property
    def available(self) -> int:
        """Bytes this cgroup can still charge before it reclaims hard or OOM-kills (>= 0)."""
        return max(0, self.limit - max(0, self.usage - self.reclaimable))


def cpu_name() -> str:
    """The CPU's model name ("AMD EPYC 7B13", "Intel(R) Xeon(R) Platinum 8481C"): the first
    "model name" / "Hardware" / "cpu model" line of /proc/cpuinfo, else platform.processor(),
    else the machine type; "unknown" when none says. Recorded with benchmark results, since
    the machines change and a kernel's speed depends on the CPU's instruction sets."""
    import platform
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _read(p: Path) -> str | None:
    try:
        return p.read_text(encoding="ascii", errors="replace").strip()
    except (OSError, ValueError):
        return None


def _int(p: Path) -> int | None:
    s = _read(p)
    if s is None:
        return None
    try:
        return int(s.split()[0])
    except (ValueError, IndexError):
        return None


def _stat_value(p: Path, *keys: str) -> int:
    s = _read(p)
    if not s:
        return 0
    vals = {}
    for line in s.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                vals[parts[0]] = int(parts[1])
            except ValueError:
                pass
    for k in keys:
        if k in vals:
            return vals[k]
    return 0


def own_cgroups(proc_cgroup: str | os.PathLike | None = None) -> dict[str, str]:
    """{controller: path} of this process from /proc/self/cgroup; "" is the v2 unified entry."""
    out: dict[str, str] = {}
    s = _read(Path(proc_cgroup or PROC_SELF_CGROUP))
    if not s:
        return out
    for line in s.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if ctrls == "":
            out[""] = path
        for c in ctrls.split(","):
            if c:
                out[c] = path
    return out


def _levels(mount: Path, rel: str | None) -> list[Path]:
    """The process's cgroup folder under ``mount`` and its ancestors up to the mount."""
    if rel is None:
        return []
    leaf = mount / rel.lstrip("/") if rel.strip("/") else mount
    if not leaf.is_dir():
        leaf = mount  # cgroup namespace: the mount root is our own cgroup
    out = []
    p = leaf
    while True:
        out.append(p)
        if p == mount or mount not in p.parents:
            break
        p = p.parent
    return out


def _v2_mount(root: Path) -> Path | None:
    if (root / "cgroup.controllers").exists():
        return root
    if (root / "unified" / "cgroup.controllers").exists():
        return root / "unified"
    return None


def cgroup_memory(root: str | os.PathLike | None = None,
                  proc_cgroup: str | os.PathLike | None = None) -> CgroupMemory | None:
    """The cgroup memory limit with the least headroom on this process, or None if no level
    of its cgroup (v1 or v2) sets one."""
    root = Path(root or CGROUP_ROOT)
    own = own_cgroups(proc_cgroup)
    best: CgroupMemory | None = None

    def consider(c: CgroupMemory) -> None:
        nonlocal best
        if best is None or c.available < best.available:
            best = c

    v2 = _v2_mount(root)
    if v2 is not None:
        for d in _levels(v2, own.get("")):
            raw = _read(d / "memory.max")
            if raw is None or raw == "max":
                continue
            try:
                limit = int(raw)
            except ValueError:
                continue
            usage = _int(d / "memory.current") or 0
            consider(CgroupMemory(limit, usage, _stat_value(d / "memory.stat", "inactive_file"), 2,
                                  str(d / "memory.max")))
    v1 = root / "memory"
    if (v1 / "memory.limit_in_bytes").exists() or "memory" in own:
        for d in _levels(v1, own.get("memory", "/")):
            limit = _int(d / "memory.limit_in_bytes")
            if limit is None or limit >= V1_UNLIMITED:
                continue
            usage = _int(d / "memory.usage_in_bytes") or 0
            consider(CgroupMemory(limit, usage,
                                  _stat_value(d / "memory.stat", "total_inactive_file", "inactive_file"), 1,
                                  str(d / "memory.limit_in_bytes")))
    return best


def cgroup_cpu_quota(root: str | os.PathLike | None = None,
                     proc_cgroup: str | os.PathLike | None = None) -> float | None:
    """The tightest CFS CPU quota on this process in CPUs (e.g. 1.5), or None if unlimited."""
    root = Path(root or CGROUP_ROOT)
    own = own_cgroups(proc_cgroup)
    quotas: list[float] = []
    v2 = _v2_mount(root)
    if v2 is not None:
        for d in _levels(v2, own.get("")):
            parts = (_read(d / "cpu.max") or "").split()
            if len(parts) == 2 and parts[0] != "max":
                try:
                    q, per = int(parts[0]), int(parts[1])
                except ValueError:
                    continue
                if q > 0 and per > 0:
                    quotas.append(q / per)
    for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
        v1 = root / name
        if v1.is_dir():
            break
    else:
        v1 = None
    if v1 is not None:
        for d in _levels(v1, own.get("cpu", "/")):
            q, per = _int(d / "cpu.cfs_quota_us"), _int(d / "cpu.cfs_period_us")
            if q is not None and per and q > 0:
                quotas.append(q / per)
    return min(quotas) if quotas else None


def affinity_cpus() -> int:
    """CPUs this process may be scheduled on (sched_getaffinity; os.cpu_count elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def usable_cpus(root: str | os.PathLike | None = None,
                proc_cgroup: str | os.PathLike | None = None,
                affinity: int | None = None) -> int:
    """Threads worth starting for compute: min(CPU affinity, ceil(cgroup CPU quota)), >= 1."""
    n = affinity if affinity is not None else affinity_cpus()
    q = cgroup_cpu_quota(root, proc_cgroup)
    if q is not None:
        n = min(n, max(1, math.ceil(q - 1e-9)))
    return max(1, n)


def memory(root: str | os.PathLike | None = None,
           proc_cgroup: str | os.PathLike | None = None) -> tuple[int, int]:
    """(total, available) bytes this process may use: the host's (psutil) cut by the cgroup
    limit and the cgroup's headroom. Raises whatever psutil raises if the host is unknown."""
    import psutil
    vm = psutil.virtual_memory()
    total, avail = int(vm.total), int(vm.available)
    cg = cgroup_memory(root, proc_cgroup)
    if cg is not None:
        total = min(total, cg.limit) if total > 0 else cg.limit
        avail = min(avail, cg.available)
    return total, avail


# --- RAM claimed by other colibri processes -------------------------------------------------
#
# Two processes that each size their automatic budget from the same "available" figure both
# take 88% of it: an engine's expert arena is filled lazily, so the first
# process's budget is not yet visible in the second's probe. Every open engine therefore
# records its budget in a small claim file (one per process and engine, JSON {"pid", "budget"});
# the automatic budget of another process subtracts what each live claim has not yet taken
# (budget - that process's RSS). Files of dead processes are removed when read.

def claims_dir() -> Path:
    """Folder of the budget claims: ``COLIBRI_CLAIMS_DIR`` or the user cache folder's
    ``budgets`` (platformdirs; shared by every colibri process of this user)."""
    env = os.environ.get("COLIBRI_CLAIMS_DIR")
    if env:
        return Path(env)
    import platformdirs
    return Path(platformdirs.user_cache_dir("colibri-desktop", appauthor=False)) / "budgets"


class BudgetClaim:
    """This engine's RAM budget (bytes), visible to other colibri processes until
    :meth:`release` (best effort: an unwritable folder means no claim, never an error)."""

    def __init__(self, budget: int, folder: str | os.PathLike | None = None):
        self.path: Path | None = None
        d = Path(folder) if folder is not None else claims_dir()
        try:
            d.mkdir(parents=True, exist_ok=True)
            p = d / f"{os.getpid()}-{id(self):x}.json"
            tmp = p.with_suffix(".tmp")
            tmp.write_text('{"pid": %d, "budget": %d}' % (os.getpid(), int(budget)), encoding="utf-8")
            os.replace(tmp, p)
            self.path = p
        except OSError:
            self.path = None

    def release(self) -> None:
        """Remove the claim. Idempotent."""
        if self.path is not None:
            try:
                self.path.unlink()
            except OSError:
                pass
            self.path = None


def others_unreserved(folder: str | os.PathLike | None = None) -> int:
    """Bytes other live colibri processes have claimed but not yet taken: the sum over their
    claims of max(0, budget - that process's RSS). Claims of this process are not counted
    (its own RSS is already in the budget's base); files of dead processes are removed."""
    import json

    import psutil
    d = Path(folder) if folder is not None else claims_dir()
    try:
        files = list(d.glob("*.json"))
    except OSError:
        return 0
    per_pid: dict[int, int] = {}
    for f in files:
        try:
            c = json.loads(f.read_text(encoding="utf-8"))
            pid, budget = int(c["pid"]), int(c["budget"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid == os.getpid():
            continue
        if not psutil.pid_exists(pid):
            try:
                f.unlink()
            except OSError:
                pass
            continue
        per_pid[pid] = per_pid.get(pid, 0) + max(0, budget)
    total = 0
    for pid, budget in per_pid.items():
        try:
            rss = psutil.Process(pid).memory_info().rss
        except (psutil.Error, OSError):
            continue
        total += max(0, budget - rss)
    return total


# --- cores other programs keep busy ------------------------------------------------------------
#
# A parallel kernel with a static split waits at its barrier for its slowest thread; when another
# program holds one of the cores, the thread that shares that core runs only part of the time
# and every one of the hundreds of barriers per token waits for it (10.5 tok/s with
# "all cores" and one busy core, 185 tok/s with one thread). The engine therefore runs as many
# threads as there are cores the other programs leave free, measured while it runs:
#
#   others = (busy jiffies of this process's CPUs in /proc/stat over the interval
#             - this process's own CPU time over the interval) / interval      [cores]
#   threads = clamp(round(usable - others), 1, usable)     (round half down: 0.5 busy -> keep)
#
# /proc/stat (proc(5)): per CPU "cpuN user nice system idle iowait irq softirq steal guest
# guest_nice" in USER_HZ ticks; busy = total - idle - iowait (guest is already inside user).
# Steal counts as busy: the hypervisor gave that time to someone else. When this process is not
# niced itself, the "nice" column (programs that lowered their priority: builds, indexers, test
# runs at nice 10) is not counted: the scheduler gives their cores to us first. A first or stale sample
# (no recent interval) uses the instantaneous ``procs_running`` of /proc/stat minus the calling
# thread. Linux only; elsewhere :meth:`FreeCores.others` returns None (the count stays fixed).

PROC_STAT = "/proc/stat"


def _read_proc_stat(path: str | os.PathLike = PROC_STAT,
                    count_nice: bool = True) -> tuple[dict[int, tuple[int, int]], int | None] | None:
    """({cpu: (busy ticks, total ticks)}, procs_running) from /proc/stat, or None if unreadable.
    ``count_nice`` False leaves the "nice" column out of busy."""
    s = _read(Path(path))
    if not s:
        return None
    cpus: dict[int, tuple[int, int]] = {}
    running = None
    for line in s.splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            parts = line.split()
            try:
                vals = [int(x) for x in parts[1:9]]
            except ValueError:
                continue
            vals += [0] * (8 - len(vals))
            total = sum(vals)
            busy = total - vals[3] - vals[4] - (0 if count_nice else vals[1])
            cpus[int(parts[0][3:])] = (busy, total)
        elif line.startswith("procs_running"):
            try:
                running = int(line.split()[1])
            except (ValueError, IndexError):
                pass
    return cpus, running


def _own_cpu_seconds() -> float:
    """User + system CPU seconds of this whole process (every thread)."""
    t = os.times()
    return t.user + t.system


def _affinity_set() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


class FreeCores:
    """How many cores other programs keep busy, measured between calls (see the comment above).

    Args:
        stat_path: /proc/stat (tests pass a fake file).
        cpus: the CPU numbers to look at (default: this process's affinity).
        own_cpu_s: this process's CPU seconds so far (default: os.times()).
        clock: monotonic seconds.
        min_interval_s: a shorter interval returns None (ticks are 10 ms: too coarse).
        count_nice: count niced programs as busy (default: only when this process is niced).
        stale_s: a longer interval (the engine sat idle) restarts from the instantaneous
            run-queue length instead of averaging over the idle time.
    """

    def __init__(self, stat_path: str | os.PathLike = PROC_STAT, cpus: set[int] | None = None,
                 own_cpu_s=_own_cpu_seconds, clock=None, min_interval_s: float = 0.1, stale_s: float = 2.0,
                 count_nice: bool | None = None):
        import time as _time
        if count_nice is None:
            try:
                count_nice = os.getpriority(os.PRIO_PROCESS, 0) > 0
            except (AttributeError, OSError):
                count_nice = True
        self.count_nice = count_nice
        self.stat_path = stat_path
        self.cpus = cpus if cpus is not None else _affinity_set()
        self.own_cpu_s = own_cpu_s
        self.clock = clock or _time.monotonic
        self.min_interval_s, self.stale_s = float(min_interval_s), float(stale_s)
        self.tick_s = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)
        self._last: tuple[float, int, float] | None = None  # (time, busy ticks, own CPU s)

    def _sample(self) -> tuple[float, int, float, int | None] | None:
        st = _read_proc_stat(self.stat_path, self.count_nice)
        if st is None or not st[0]:
            return None
        cpus, running = st
        use = [c for c in cpus if self.cpus is None or c in self.cpus] or list(cpus)
        return self.clock(), sum(cpus[c][0] for c in use), self.own_cpu_s(), running

    def others(self) -> float | None:
        """Cores (a float >= 0) other processes kept busy since the previous call, or None
        when no estimate is possible (no /proc/stat, or the interval is under min_interval_s:
        keep the previous choice)."""
        s = self._sample()
        if s is None:
            return None
        now, busy, own, running = s
        last = self._last
        if last is not None and now - last[0] < self.min_interval_s:
            return None
        self._last = (now, busy, own)
        if last is None or now - last[0] > self.stale_s:
            return None if running is None else float(max(0, running - 1))
        dt = now - last[0]
        return max(0.0, ((busy - last[1]) * self.tick_s - (own - last[2])) / dt)


def threads_for(usable: int, others: float) -> int:
    """Compute threads for ``usable`` cores when other programs keep ``others`` cores busy:
    round(usable - others) with halves rounded down, clamped to 1..usable."""
    return max(1, min(int(usable), math.ceil(usable - others - 0.5)))
