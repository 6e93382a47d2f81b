"""``colibri cluster``: expert-parallel serving over Ray (engine/cluster.py).

    colibri cluster head [--port 6380]            on the computer that runs the model
    colibri cluster join ADDRESS --ram-gb N       on each computer that lends N GB of RAM
    colibri cluster status ADDRESS                the workers and their RAM

``head`` and ``join`` run Ray (``ray start --block``) in the foreground until Ctrl+C (or
SIGTERM): nothing keeps running behind the user's back. The engine uses the cluster when the
``cluster`` setting (``--cluster ADDRESS``, the app's Cluster address) names the head.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from ..cluster import ENGINE_ROOT, RESOURCE, check_address, cluster_nodes, ray_available
from ..errors import ConfigError
from ..units import format_bytes

DEFAULT_PORT = 6380
OBJECT_STORE_MB = 256  # Ray's shared-memory object store per node: expert calls move kilobytes


def _ray_start(args: list[str]) -> list[str]:
    """The ``ray start`` command line (the Ray CLI of this Python)."""
    if not ray_available():
        raise ConfigError("`colibri cluster` needs the Ray package: `pip install 'colibri-desktop[cluster]'` "
                          "(or `pip install ray`)")
    return [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
            "--object-store-memory", str(OBJECT_STORE_MB << 20), *args]


def _run_foreground(cmd: list[str], banner: str) -> int:
    """Run ``cmd`` until it ends or Ctrl+C / SIGTERM (forwarded to it); its exit code."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           # the workers' actors import this engine (the same code as the driver's)
           "PYTHONPATH": ENGINE_ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    p = subprocess.Popen(cmd, env=env)
    print(banner, file=sys.stderr, flush=True)

    def stop(signum, frame):
        p.send_signal(signal.SIGTERM)
    old = signal.signal(signal.SIGTERM, stop)
    try:
        return p.wait()
    except KeyboardInterrupt:
        p.send_signal(signal.SIGTERM)
        print("\ncolibri: leaving the cluster", file=sys.stderr)
        return p.wait()
    finally:
        signal.signal(signal.SIGTERM, old)


def cmd_head(a) -> int:
    """Start the head (no experts of its own: this computer runs the model)."""
    ip = a.node_ip or "this computer's address"
    args = ["--head", "--port", str(a.port), "--num-cpus", "0", "--include-dashboard=false"]
    if a.node_ip:
        args += ["--node-ip-address", a.node_ip]
    if a.temp_dir:
        args += ["--temp-dir", a.temp_dir]
    banner = (f"colibri: starting the cluster head on port {a.port} (Ctrl+C stops it).\n"
              f"  on each computer that lends its RAM: colibri cluster join {a.node_ip or 'ADDRESS'}:{a.port} --ram-gb N\n"
              f"  then set the Cluster address setting (or --cluster) to {a.node_ip or '<' + ip + '>'}:{a.port}")
    return _run_foreground(_ray_start(args), banner)


def cmd_join(a) -> int:
    """Join the cluster at ADDRESS as a worker lending ``--ram-gb`` of RAM to experts."""
    # GB as everywhere else (1e9 bytes, format_bytes), held as whole MiB (Ray's resource: RESOURCE)
    mb = int(a.ram_gb * 1e9) >> 20 if a.ram_gb == a.ram_gb and 0 < a.ram_gb < 1e9 else 0  # NaN, inf: 0
    if mb < 1:
        raise ConfigError(f"--ram-gb {a.ram_gb}: give the RAM (GB) this computer lends to experts, at least "
                          f"0.001, e.g. --ram-gb 8")
    args = ["--address", a.address, "--resources", json.dumps({RESOURCE: mb})]
    if a.threads:
        args += ["--num-cpus", str(a.threads)]
    if a.node_ip:
        args += ["--node-ip-address", a.node_ip]
    banner = (f"colibri: joining the cluster at {a.address} with {format_bytes(mb << 20)} for experts "
              f"(Ctrl+C leaves it)")
    cmd = _ray_start(args)
    check_address(a.address, name="ADDRESS")  # Ray retries a wrong address for minutes, printing its logs
    return _run_foreground(cmd, banner)


def cmd_status(a) -> int:
    """Print the workers of the cluster at ADDRESS."""
    nodes = cluster_nodes(a.address, name="ADDRESS")
    if not nodes:
        print(f"colibri: the cluster at {a.address} has no worker; join one with "
              f"`colibri cluster join {a.address} --ram-gb N`")
        return 0
    print(f"{'worker':<18} {'state':<6} {'expert RAM':>11} {'in use':>11} {'CPUs':>5}")
    for n in nodes:
        used = n["ram_bytes"] - n["free_bytes"]
        print(f"{n['address']:<18} {'up' if n['alive'] else 'down':<6} {format_bytes(n['ram_bytes']):>11} "
              f"{format_bytes(used):>11} {n['cpus']:>5}")
    return 0


def add_parsers(sub) -> None:
    """Add ``cluster head|join|status`` to the ``colibri`` argparse subparsers ``sub``."""
    c = sub.add_parser("cluster", help="serve experts from other computers' RAM (Ray)",
                       description="Expert-parallel serving over Ray: `head` on the computer that runs the model, "
                                   "`join` on each computer that lends RAM; the engine uses it when the cluster "
                                   "setting names the head's address.")
    cs = c.add_subparsers(dest="cluster_cmd", required=True)
    h = cs.add_parser("head", help="start the cluster head here (foreground; Ctrl+C stops it)")
    h.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port of the head (default {DEFAULT_PORT})")
    h.add_argument("--node-ip", default="", help="the address other computers reach this one at (default: Ray picks)")
    h.add_argument("--temp-dir", default="", help="Ray's session folder (default: Ray's, /tmp/ray)")
    h.set_defaults(fn=cmd_head)
    j = cs.add_parser("join", help="join a cluster as a worker lending RAM (foreground; Ctrl+C leaves)")
    j.add_argument("address", help="the head's host:port (as `colibri cluster head` prints)")
    j.add_argument("--ram-gb", type=float, required=True,
                   help="RAM this computer lends to experts, GB (its Ray worker needs ~0.5 GB more)")
    j.add_argument("--threads", type=int, default=0, help="compute threads for experts (default: all cores)")
    j.add_argument("--node-ip", default="", help="the address the head reaches this computer at (default: Ray picks)")
    j.set_defaults(fn=cmd_join)
    s = cs.add_parser("status", help="list the cluster's workers and their RAM")
    s.add_argument("address", help="the head's host:port")
    s.set_defaults(fn=cmd_status)
