"""Decode speed of the kernels built for a fixed x86-64 level against the kernels built for this
exact CPU (COLIBRI_KERNEL_TARGET=host), on one store: alternating fresh processes, each opening
the store with one compute thread, warming up, then decoding forced tokens; CPU seconds per
token (what a busy shared machine changes least) and wall tokens per second, medians.

    python tools/kernel_target_speed.py [--store PATH] [--targets host,x86-64-v4-vnni] [--reps 5]
        [--cache TARGET=NUMBA_CACHE_DIR ...] [--tokens 64]

Each target compiles its kernels in its own numba cache on first use (or give a prepared one
with --cache). The greedy tokens of every run are compared: runs of one target agree; two
targets may add floats in another order (other vector widths), like two CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ARM = """
import json, resource, sys, time
from engine import Engine, EngineConfig, GenerateRequest, SamplingParams, TokenEvent
from engine.kernels import TARGET
store, tokens = sys.argv[1], int(sys.argv[2])
eng = Engine.open(EngineConfig(store=store, threads=1, pilot=0, history=False, speculation="off"))
req = GenerateRequest(prompt_ids=tuple(range(1, 17)), sampling=SamplingParams(max_new_tokens=tokens, temperature=0.0))
def run():
    eng.forget_prefix()
    c0, t0 = time.process_time(), time.perf_counter()
    ids, first = [], None
    for ev in eng.generate(req):
        if isinstance(ev, TokenEvent):
            ids.append(ev.token_id)
            if first is None:
                first = (time.process_time(), time.perf_counter())
    c1, t1 = time.process_time(), time.perf_counter()
    n = max(1, len(ids) - 1)
    return ids, (c1 - first[0]) / n, n / (t1 - first[1])
run()
ids, cpu, tps = run()
eng.close()
print("ARM " + json.dumps({"target": TARGET.level, "cpu_s_per_token": cpu, "tok_per_s": tps, "ids": ids}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="a converted store (default: the bundled default model)")
    ap.add_argument("--targets", default="host,x86-64-v4-vnni")
    ap.add_argument("--cache", nargs="*", default=[], help="TARGET=NUMBA_CACHE_DIR: a prepared cache per target")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    if a.store is None:
        from engine.library import default_store
        a.store = str(default_store())
    targets = [t for t in a.targets.split(",") if t]
    caches = dict(c.split("=", 1) for c in a.cache)
    tmp = tempfile.mkdtemp(prefix="target-speed-")
    out: dict = {t: [] for t in targets}
    for rep in range(a.reps):
        for t in targets:
            env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
            env.update(COLIBRI_KERNEL_TARGET=t, NUMBA_CACHE_DIR=caches.get(t, os.path.join(tmp, t)),
                       PYTHONPATH=str(ROOT))
            p = subprocess.run([sys.executable, "-c", ARM, a.store, str(a.tokens)], env=env,
                               capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("ARM ")]
            if p.returncode != 0 or not line:
                print(f"{t} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                return 1
            r = json.loads(line[0][4:])
            out[t].append(r)
            print(f"rep {rep} {t}: {1000 * r['cpu_s_per_token']:.2f} CPU ms/token, {r['tok_per_s']:.1f} tok/s",
                  flush=True)
    ids = {t: {tuple(r["ids"]) for r in rs} for t, rs in out.items()}
    summary = {t: {"cpu_ms_per_token_median": round(1000 * statistics.median(r["cpu_s_per_token"] for r in rs), 3),
                   "tok_per_s_median": round(statistics.median(r["tok_per_s"] for r in rs), 2),
                   "reps": len(rs), "token_streams": len(ids[t])} for t, rs in out.items()}
    streams = set().union(*ids.values())
    summary["same_tokens"] = len(streams) == 1
    if len(streams) > 1:  # where two targets' greedy tokens part (float sums in another order)
        a, b = sorted(streams)[:2]
        summary["first_difference_at"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    summary["load1"] = round(os.getloadavg()[0], 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
