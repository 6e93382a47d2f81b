"""A local Ray cluster for the tests: ``colibri cluster head`` + N ``colibri cluster join``
processes on this machine, each worker in its own memory cgroup (v1) when
/sys/fs/cgroup/memory is writable. Processes are stopped by their ids (SIGTERM to the
``colibri cluster`` process, which stops its ``ray start --block``), never by name."""

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

ROOT = Path(__file__).resolve().parent.parent
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
        self.procs.append(subprocess.Popen(["nice", "-n", "19"] + cmd, env=self.env, cwd=str(ROOT), stdout=log,
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
