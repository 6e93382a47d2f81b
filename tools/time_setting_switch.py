"""Time what a PILOT change costs the next answer, the way the app does it: open the model
(PILOT off) and answer, let the background compile of the other settings' kernels finish
(engine.prepare_kernel_variants, as the app starts it once a model is open), then reopen with
PILOT on and answer; each step's seconds are printed and, with --json, appended as one line.

    python tools/time_setting_switch.py [--store PATH] [--no-variants] [--json OUT]

--no-variants skips the background compile: the reopen then compiles PILOT's kernels itself
(today's wait without it). Use a fresh NUMBA_CACHE_DIR to time a first start as well.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QUESTION = "What does json.dumps do?"


def cpu_s() -> float:
    """User + system CPU seconds of this process and of the children it waited for (the
    compile's child processes): on a busy machine the wall time says more about the others."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def first_token(eng) -> tuple[float, str]:
    """Seconds from the request to the first streamed token, and the answer's start."""
    from engine import ChatMessage, GenerateRequest, SamplingParams, TokenEvent
    req = GenerateRequest(messages=(ChatMessage("user", QUESTION),), sampling=SamplingParams(max_new_tokens=8))
    t0 = time.perf_counter()
    first, text = None, ""
    for ev in eng.generate(req):
        if isinstance(ev, TokenEvent):
            first = first if first is not None else time.perf_counter() - t0
            text += ev.text
    return first, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", help="a converted store (default: the bundled default model)")
    ap.add_argument("--no-variants", action="store_true", help="do not compile the other kernels in the background")
    ap.add_argument("--json", help="append the numbers as one JSON line to this file")
    a = ap.parse_args()
    from engine import Engine, EngineConfig, prepare_kernel_variants
    from engine.library import default_store
    store = a.store or str(default_store())
    out = {"store": store, "numba_cache": os.environ.get("NUMBA_CACHE_DIR", ""), "variants": not a.no_variants}
    t0, c0 = time.perf_counter(), cpu_s()
    off = EngineConfig(store=store, pilot=0)
    with Engine.open(off) as eng:
        out["open_s"] = round(time.perf_counter() - t0, 1)
        ft, text = first_token(eng)
        out["first_answer_s"] = round(time.perf_counter() - t0, 1)
        out["first_token_after_open_s"] = round(ft, 2)
        out["first_answer_cpu_s"] = round(cpu_s() - c0, 1)
        if not a.no_variants:
            t1, c1 = time.perf_counter(), cpu_s()
            v = prepare_kernel_variants(eng.config)
            v.finished.wait()
            out["variants_s"] = round(time.perf_counter() - t1, 1)
            out["variants_cpu_s"] = round(cpu_s() - c1, 1)
            out["variants_done"] = len(v.done)
    t2, c2 = time.perf_counter(), cpu_s()
    with Engine.open(EngineConfig(store=store, pilot=1)) as eng:
        out["pilot_open_s"] = round(time.perf_counter() - t2, 1)
        ft, text2 = first_token(eng)
        # the wait a PILOT change adds to the next answer: the reopen, then its first token
        out["pilot_first_token_s"] = round(out["pilot_open_s"] + ft, 2)
        out["pilot_first_token_cpu_s"] = round(cpu_s() - c2, 2)
        out["same_answer"] = text == text2
    out["load1"] = round(os.getloadavg()[0], 1)
    print(json.dumps(out))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
