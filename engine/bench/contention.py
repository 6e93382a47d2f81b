"""``colibri bench contention``: decode speed of each candidate thread default when other
programs keep cores busy.

Arms (candidate defaults of "Compute threads" and the OpenMP wait policy), each one persistent
process (``bench contention-arm``, hidden) started with its own environment, since libgomp reads
``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once, when numba starts its thread pool:

  today        threads = all usable cores, libgomp's default wait (GOMP_SPINCOUNT=300000,
               what an unset OMP_WAIT_POLICY means): the default before auto
  one          threads = 1
  all-passive  all cores, OMP_WAIT_POLICY=PASSIVE (waiting threads sleep at once)
  all-spin10k  all cores, GOMP_SPINCOUNT=10000 (spin ~30x shorter, then sleep)
  workqueue    all cores, numba's own workqueue threading layer (no OpenMP)
  auto         threads = 0: the cores other programs leave free, re-counted while
               generating (sysinfo.FreeCores), libgomp's default wait
  auto-passive the same with OMP_WAIT_POLICY=PASSIVE
  auto-spin30k threads = 0 with GOMP_SPINCOUNT=30000 (~0.5 ms of spinning here, then sleep):
               the engine's default (a worker spinning ~5-8 ms after each
               parallel region held a core while a streaming decode waited for the disk)

Loads: 0, 1 and 2 busy background processes (``python -c "while True: pass"``, nice 0, started
and stopped by this command). Order: for each rep, for each load, every arm once (the arm order
rotates each time), so slow drifts of the shared machine hit every arm alike. Each measurement
decodes a fixed seeded token stream by teacher forcing (``--tokens`` tokens after a
``--prompt-len`` prompt, the whole prefill redone) with every expert the stream touches already
resident after a warm-up pass. Reported per measurement: decode tok/s, first-token time, the
process's CPU seconds (rusage, every thread) per token, the thread count the engine ended with,
the load average and the cores other programs (neither the arm nor the busy processes) kept
busy during it (/proc/stat). Summary per arm: median tok/s per load, and the medians of the
per-rep ratios "loaded / quiet" (same arm, same rep) and "quiet / today quiet".

On a machine other jobs keep busy, ``--rt-all`` runs every measurement with the arm and the busy
processes at real-time priority (SCHED_RR 1): a clean machine with exactly the busy processes
asked for (round-robin slices between equals stand in for CFS); ``--quiet-rt`` does that for the
quiet runs only, ``--nice`` sets one niceness for arms and busy processes. bench/README.md has
the commands and the results that chose the default (threads = 0, auto).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from .common import add_stream_flags, forced_stream, machine_info, md_table, write_results

ARMS: dict[str, tuple[str, dict]] = {
    # name: (threads: "all" | "auto" | a number, environment)
    "today": ("all", {"GOMP_SPINCOUNT": "300000"}),
    "one": ("1", {"GOMP_SPINCOUNT": "300000"}),
    "all-passive": ("all", {"OMP_WAIT_POLICY": "PASSIVE"}),
    "all-spin10k": ("all", {"GOMP_SPINCOUNT": "10000"}),
    "workqueue": ("all", {"NUMBA_THREADING_LAYER": "workqueue"}),
    "auto": ("auto", {"GOMP_SPINCOUNT": "300000"}),
    "auto-passive": ("auto", {"OMP_WAIT_POLICY": "PASSIVE"}),
    "auto-spin30k": ("auto", {"GOMP_SPINCOUNT": "30000"}),
}
#: the environment variables an arm sets itself (removed from the inherited environment first)
ARM_ENV_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY",
                "KMP_BLOCKTIME", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS")
BUSY_CODE = "while True: pass"


# --- one arm (its own process) ----------------------------------------------------------------


def cmd_contention_arm(a) -> int:
    """Internal: one arm of `bench contention`. Opens the store, warms up, then answers each
    "run" line on stdin with one "RES {json}" line on stdout; ends on EOF."""
    from ..config import EngineConfig
    from ..events import Finished, GenerateRequest, SamplingParams
    from ..generate import Engine
    from ..sysinfo import usable_cpus
    threads = 0 if a.threads == "auto" else usable_cpus() if a.threads == "all" else int(a.threads)
    eng = Engine.open(EngineConfig(store=a.store, pilot=0, pinning=False, history=False, o_direct=False,
                                   threads=threads, ram_budget_gb=a.ram_budget_gb,
                                   context_length=a.prompt_len + a.tokens + 8,   # small KV cache
                                   speculation="off"))   # forced ids: one forward a token
    stream = forced_stream(eng.args.vocab_size, a.prompt_len + a.tokens, a.seed)
    if a.stream == "repeat":   # few distinct experts: several big-model arms fit in RAM at once
        stream = stream[:a.prompt_len] + [stream[a.prompt_len]] * a.tokens
    prompt, forced = stream[:a.prompt_len], stream[a.prompt_len:]
    req = GenerateRequest(prompt_ids=tuple(prompt), forced_ids=tuple(forced),
                          sampling=SamplingParams(max_new_tokens=a.tokens))

    def once() -> dict:
        eng.forget_prefix()
        stop = threading.Event()
        timer = threading.Timer(a.max_seconds, stop.set)   # a collapsed arm ends early (tok/s stays exact)
        c0, t0 = os.times(), time.perf_counter()
        timer.start()
        fin = [e for e in eng.generate(req, stop) if isinstance(e, Finished)][-1]
        timer.cancel()
        c1, wall = os.times(), time.perf_counter() - t0
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        return {"decode_tok_per_s": fin.decode_tok_per_s, "ttft_s": fin.ttft_s, "wall_s": wall,
                "cpu_s_per_token": cpu / max(1, fin.generated_tokens), "threads_end": eng.threads,
                "hit_rate": fin.hit_rate, "mb_per_token": fin.mb_per_token, "error": fin.error,
                "tokens": fin.generated_tokens}
    try:
        for _ in range(2):   # JIT load + every expert of the stream made resident
            once()
        print("READY " + json.dumps({"usable": eng.usable_threads, "cap": eng.cache.cap}), flush=True)
        for line in sys.stdin:
            if line.strip() == "run":
                # the free-core count looks at the last interval: start it now, so that it sees
                # the load of this measurement, not the arm that ran before (every arm waits alike)
                if eng.free_cores is not None:
                    eng.free_cores.others()
                time.sleep(0.15)
                print("RES " + json.dumps(once()), flush=True)
    finally:
        eng.close()
    return 0


# --- the driver -------------------------------------------------------------------------------


def _busy_ticks() -> int | None:
    from ..sysinfo import _read_proc_stat
    st = _read_proc_stat()
    return None if st is None else sum(b for b, _ in st[0].values())


def _proc_cpu_s(pids: list[int]) -> float:
    import psutil
    tot = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            tot += t.user + t.system
        except psutil.Error:
            pass
    return tot


class _Arm:
    def __init__(self, name: str, store: str, a, cpus: str | None, nice: int):
        threads, env_add = ARMS[name]
        env = {k: v for k, v in os.environ.items() if k not in ARM_ENV_KEYS}
        env.update(env_add)
        cmd = [sys.executable, "-m", "engine.cli", "bench", "contention-arm", "--store", store,
               "--threads", threads, "--prompt-len", str(a.prompt_len), "--tokens", str(a.tokens),
               "--seed", str(a.seed), "--max-seconds", str(a.max_seconds), "--stream", a.stream]
        if a.ram_budget_gb:
            cmd += ["--ram-budget-gb", str(a.ram_budget_gb)]
        if cpus:
            cmd = ["taskset", "-c", cpus] + cmd
        if nice:
            cmd = ["nice", "-n", str(nice)] + cmd
        self.name = name
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = json.loads(self._expect("READY "))

    def _expect(self, prefix: str) -> str:
        for line in self.p.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
        raise RuntimeError(f"arm {self.name} ended (exit {self.p.wait()}); run it alone to see why")

    def set_realtime(self, on: bool) -> bool:
        """Every thread of the arm to SCHED_RR priority 1 (on) or back to SCHED_OTHER: a quiet
        measurement on a machine other programs keep busy (they wait while it runs, up to the
        kernel's real-time throttle of 95%). True if it worked (needs root or CAP_SYS_NICE)."""
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{self.p.pid}/task")]
            pol, prio = (os.SCHED_RR, 1) if on else (os.SCHED_OTHER, 0)
            for tid in tids:
                os.sched_setscheduler(tid, pol, os.sched_param(prio))
            return True
        except (OSError, AttributeError):
            return False

    def run(self, realtime: bool = False) -> dict:
        rt = realtime and self.set_realtime(True)
        try:
            self.p.stdin.write("run\n")
            self.p.stdin.flush()
            r = json.loads(self._expect("RES "))
        finally:
            if rt:
                self.set_realtime(False)
        r["realtime"] = bool(rt)
        return r

    def close(self) -> None:
        try:
            self.p.stdin.close()
            self.p.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()


def _start_busy(n: int, cpus: str | None, nice: int, rt: bool = False) -> list[subprocess.Popen]:
    procs = []
    for _ in range(n):
        cmd = [sys.executable, "-c", BUSY_CODE]
        if rt:
            cmd = ["chrt", "-r", "1"] + cmd
        if cpus:
            cmd = ["taskset", "-c", cpus] + cmd
        if nice:
            cmd = ["nice", "-n", str(nice)] + cmd
        procs.append(subprocess.Popen(cmd))
    time.sleep(0.3)   # let them reach the run queue
    return procs


def _stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _med(v: list[float]) -> float | None:
    v = [x for x in v if x is not None]
    return float(statistics.median(v)) if v else None


def summarize(rows: list[dict], arms: list[str], loads: list[int]) -> list[dict]:
    """Per arm: median tok/s per load, median per-rep ratio loaded/quiet and quiet/today."""
    by = {(r["arm"], r["load"], r["rep"]): r for r in rows}
    reps = sorted({r["rep"] for r in rows})
    out = []
    for arm in arms:
        s: dict = {"arm": arm, "threads": ARMS[arm][0], "env": " ".join(f"{k}={v}" for k, v in ARMS[arm][1].items())}
        for ld in loads:
            s[f"tok_s_{ld}"] = _med([by[(arm, ld, rp)]["decode_tok_per_s"] for rp in reps if (arm, ld, rp) in by])
            s[f"ttft_{ld}"] = _med([by[(arm, ld, rp)]["ttft_s"] for rp in reps if (arm, ld, rp) in by])
            s[f"cpu_ms_{ld}"] = _med([1e3 * by[(arm, ld, rp)]["cpu_s_per_token"] for rp in reps
                                      if (arm, ld, rp) in by])
            s[f"threads_{ld}"] = _med([by[(arm, ld, rp)]["threads_end"] for rp in reps if (arm, ld, rp) in by])
            if ld != 0:
                s[f"keep_{ld}"] = _med([by[(arm, ld, rp)]["decode_tok_per_s"] / by[(arm, 0, rp)]["decode_tok_per_s"]
                                        for rp in reps if (arm, ld, rp) in by and (arm, 0, rp) in by
                                        and by[(arm, 0, rp)]["decode_tok_per_s"] > 0])
        if "today" in arms:
            s["quiet_vs_today"] = _med([by[(arm, 0, rp)]["decode_tok_per_s"] / by[("today", 0, rp)]["decode_tok_per_s"]
                                        for rp in reps if (arm, 0, rp) in by and ("today", 0, rp) in by
                                        and by[("today", 0, rp)]["decode_tok_per_s"] > 0])
        out.append(s)
    return out


def cmd_contention(a) -> int:
    """Interleaved arms x loads x reps; results in bench/results/<name>.{json,md}."""
    from ..errors import ConfigError
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in arms if x not in ARMS]
    if bad:
        raise ConfigError(f"--arms: unknown arm {bad[0]!r}; choose from {', '.join(ARMS)}")
    loads = sorted({int(x) for x in a.loads.split(",")})
    store = a.store
    if store == "default":
        from ..library import default_store
        store = str(default_store())
    if not (Path(store) / "manifest.json").exists():
        raise ConfigError(f"--store {store}: not a converted store (no manifest.json); "
                          f"give a `colibri convert` output or 'default'")
    started = [_Arm(n, store, a, a.cpus, a.nice) for n in arms]   # opened one after the other (quiet warm-up)
    rows: list[dict] = []
    try:
        for rep in range(a.reps):
            for li, ld in enumerate(loads):
                busy = _start_busy(ld, a.busy_cpus, a.nice, a.rt_all)
                try:
                    k = (rep * len(loads) + li) % len(started)
                    for arm in started[k:] + started[:k]:
                        b0, t0 = _busy_ticks(), time.monotonic()
                        own0 = _proc_cpu_s([arm.p.pid] + [p.pid for p in busy])
                        r = arm.run(realtime=a.rt_all or (a.quiet_rt and ld == 0))
                        dt = time.monotonic() - t0
                        own1 = _proc_cpu_s([arm.p.pid] + [p.pid for p in busy])
                        b1 = _busy_ticks()
                        tick = 1.0 / os.sysconf("SC_CLK_TCK")
                        others = (max(0.0, ((b1 - b0) * tick - (own1 - own0)) / dt)
                                  if b0 is not None and b1 is not None and dt > 0 else None)
                        r.update(arm=arm.name, load=ld, rep=rep, loadavg_1m=os.getloadavg()[0],
                                 other_cores_busy=others)
                        rows.append(r)
                        print(f"rep {rep} load {ld} {arm.name:13s} {r['decode_tok_per_s']:9.1f} tok/s  "
                              f"ttft {r['ttft_s']:.3f} s  cpu {1e3 * r['cpu_s_per_token']:.2f} ms/tok  "
                              f"threads {r['threads_end']}  others {others if others is None else round(others, 2)}"
                              f"  load1 {r['loadavg_1m']:.2f}", flush=True)
                finally:
                    _stop_busy(busy)
    finally:
        for arm in started:
            arm.close()
    summary = summarize(rows, arms, loads)
    cols = [("arm", "arm", ""), ("threads", "threads", ""), ("env", "env", "")]
    for ld in loads:
        cols.append((f"tok/s {ld} busy", f"tok_s_{ld}", ".1f"))
    for ld in loads:
        if ld:
            cols.append((f"keep {ld} busy", f"keep_{ld}", ".0%"))
    cols += [("quiet vs today", "quiet_vs_today", ".0%")]
    for ld in loads:
        cols.append((f"TTFT s {ld}", f"ttft_{ld}", ".3f"))
    for ld in loads:
        cols.append((f"CPU ms/tok {ld}", f"cpu_ms_{ld}", ".2f"))
    for ld in loads:
        cols.append((f"threads {ld}", f"threads_{ld}", ".0f"))
    others = [r["other_cores_busy"] for r in rows if r.get("other_cores_busy") is not None]
    la = [r["loadavg_1m"] for r in rows]
    table = (f"Store: `{store}`; {a.tokens} tokens ({a.stream} stream) after a {a.prompt_len}-token prompt"
             + (f", RAM budget {a.ram_budget_gb} GB per arm" if a.ram_budget_gb else "") + f", {a.reps} reps, arms "
             f"interleaved (order rotated per load and rep); busy processes `python -c \"{BUSY_CODE}\"`"
             + (f" pinned to CPUs {a.busy_cpus}" if a.busy_cpus else "")
             + (f"; arms pinned to CPUs {a.cpus}" if a.cpus else "")
             + (f"; arms and busy processes at nice {a.nice}" if a.nice else "")
             + ("; quiet runs (0 busy) at real-time priority SCHED_RR 1 (the other programs of the "
                "shared machine wait meanwhile)" if a.quiet_rt and not a.rt_all else "")
             + ("; every run with the arm and the busy processes at real-time priority SCHED_RR 1 (the "
                "other programs of the shared machine wait meanwhile)" if a.rt_all else "") + ".\n"
             f"Background load from other programs during the measurements (not ours, not the busy processes): "
             f"median {_med(others) or 0:.2f} cores (min {min(others, default=0):.2f}, max {max(others, default=0):.2f}); "
             f"1-minute load average {min(la, default=0):.1f}–{max(la, default=0):.1f}.\n\n"
             + md_table(summary, cols)
             + "\n\n" + md_table(rows, [("rep", "rep", "d"), ("load", "load", "d"), ("arm", "arm", ""),
                                         ("tok/s", "decode_tok_per_s", ".1f"), ("TTFT s", "ttft_s", ".3f"),
                                         ("CPU s/tok", "cpu_s_per_token", ".5f"), ("threads", "threads_end", "d"),
                                         ("other cores busy", "other_cores_busy", ".2f"),
                                         ("load avg", "loadavg_1m", ".2f")]))
    write_results(a.name, {"machine": machine_info(), "store": store, "tokens": a.tokens, "prompt_len": a.prompt_len,
                           "reps": a.reps, "loads": loads, "arms": {n: ARMS[n] for n in arms},
                           "busy_cpus": a.busy_cpus, "cpus": a.cpus, "nice": a.nice, "quiet_rt": a.quiet_rt, "rt_all": a.rt_all, "stream": a.stream, "ram_budget_gb": a.ram_budget_gb, "rows": rows, "summary": summary}, table)
    return 0


def add_parser(bs) -> None:
    """Register `contention` and the internal `contention-arm` under ``colibri bench``."""
    c = bs.add_parser("contention", help="decode tok/s of the thread defaults with 0, 1, 2 busy background "
                                         "processes (interleaved arms)")
    c.add_argument("--store", default="default", help="a converted store, or 'default' (the bundled model)")
    add_stream_flags(c, prompt_len=16, tokens=256)
    c.add_argument("--reps", type=int, default=3)
    c.add_argument("--max-seconds", type=float, default=10.0,
                   help="a measurement stops after this long (a collapsed arm decodes fewer tokens)")
    c.add_argument("--loads", default="0,1,2", help="numbers of busy background processes")
    c.add_argument("--arms", default=",".join(ARMS), help="comma-separated arm names: " + ", ".join(ARMS))
    c.add_argument("--cpus", default=None, help="pin the arms to these CPUs (taskset list, e.g. 0,1)")
    c.add_argument("--busy-cpus", default=None, help="pin the busy processes to these CPUs (e.g. 1)")
    c.add_argument("--stream", choices=("random", "repeat"), default="random",
                   help="forced decode stream: seeded random tokens, or the first one repeated (touches few "
                        "experts, so several arms of a big model fit in RAM together)")
    c.add_argument("--ram-budget-gb", type=float, default=None, help="each arm's RAM budget (default auto)")
    c.add_argument("--nice", type=int, default=0,
                   help="run the arms and the busy processes at this niceness (same for both; negative "
                        "values need root and shield the measurement from other programs on a shared machine)")
    c.add_argument("--quiet-rt", action="store_true",
                   help="measure the quiet runs (0 busy) with the arm at real-time priority SCHED_RR 1, so "
                        "other programs on a shared machine cannot slow it (needs root)")
    c.add_argument("--rt-all", action="store_true",
                   help="every measurement with the arm and the busy processes at real-time priority SCHED_RR 1: "
                        "a clean machine with exactly the busy processes asked for (round-robin time slices "
                        "between equals instead of CFS; needs root)")
    c.add_argument("--name", default="contention_default")
    c.set_defaults(fn=cmd_contention)

    ca = bs.add_parser("contention-arm")  # internal (hidden from the verb list)
    ca.add_argument("--store", required=True)
    ca.add_argument("--threads", required=True, help="all, auto or a number")
    ca.add_argument("--max-seconds", type=float, default=10.0)
    ca.add_argument("--stream", choices=("random", "repeat"), default="random")
    ca.add_argument("--ram-budget-gb", type=float, default=None)
    add_stream_flags(ca, prompt_len=16, tokens=256)
    ca.set_defaults(fn=cmd_contention_arm)
