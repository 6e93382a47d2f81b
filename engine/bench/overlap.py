"""``colibri bench overlap``: how much of the SSD hides behind compute. Forced (random-weight)
and realistic (a trained model's recorded routing) streams at several RAM budgets, each arm a
fresh process inside a real memory cgroup, against an I/O-bound ceiling measured in the same
run."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np

from .arm import arm_subprocess
from .common import add_stream_flags, check_arm_inputs, machine_info, md_table, write_results
from .disk import measure_disk


def ceiling(compute_s: float, mb_per_token: float, disk_gbps: float) -> tuple[float, float]:
    """The I/O-bound ceiling: (tok/s, io s/token) for compute ``compute_s`` s/token (all
    resident), ``mb_per_token`` MB read per token (demand + speculative) and the disk's
    ``disk_gbps`` GB/s: 1 / max(compute, I/O) - what perfect overlap of reads and compute gives
    (`bench matrix`'s definition, with every byte read counted)."""
    io_s = mb_per_token * 1e6 / (disk_gbps * 1e9)
    return 1.0 / max(compute_s, io_s), io_s


def measure_first_touch(gb: float = 1.0) -> float | None:
    """GB/s of a first touch of fresh anonymous memory (``gb`` GB faulted in by
    MADV_POPULATE_WRITE, then unmapped): what a read into never-touched cache slots pays on top
    of the disk. None where the populate call is missing (off Linux, kernel < 5.14). In a VM
    whose host takes freed guest memory back this is far below memory bandwidth."""
    import mmap
    import time
    from ..cache.arena import MADV_POPULATE_WRITE, _anonymous_map, _populate_call
    call = _populate_call()
    if call is None:
        return None
    n = int(gb * 1e9) // mmap.PAGESIZE * mmap.PAGESIZE
    mm = _anonymous_map(n)
    try:
        base = np.frombuffer(mm, np.uint8).ctypes.data
        t = time.perf_counter()
        ok = call(base, n, MADV_POPULATE_WRITE) == 0
        dt = time.perf_counter() - t
    finally:
        mm.close()
    return n / dt / 1e9 if ok else None


def cmd_overlap(a) -> int:
    """Arms: routing (forced / realistic) x budget (GB) x PILOT mode, plus one all-resident
    pilot-0 arm per routing (the compute time per token), interleaved, repetitions reversed.
    Disk bandwidth (O_DIRECT slab reads, QD1 and ``--qd``) is measured before and after the
    arms; the ceiling uses the fastest of the four (the strictest ceiling)."""
    from ..config import ModelArgs
    from .peers import cgroup_available
    args = ModelArgs.from_hf_config(Path(a.store) / "config.json")
    E = args.num_experts
    if "realistic" in a.routings and not a.routing_trace:
        raise ValueError("--routings realistic needs --routing-trace (record one with "
                         "`colibri bench trace-heldout --logits`)")
    ok, why = cgroup_available()
    if not ok and not a.no_cgroup:
        raise ValueError(f"memory cgroups unavailable ({why}); pass --no-cgroup to run the budgets "
                         f"as engine RAM budgets only")
    base = dict(o_direct=True, pinning=False, history=False, context_length=a.context, checksum=a.checksum)
    resident = a.compute == "resident"
    if a.compute == "auto":  # every expert resident needs the whole store in RAM beside the other jobs
        import psutil
        need = sum(f.stat().st_size for f in Path(a.store).rglob("*") if f.is_file()) + 2e9
        resident = psutil.virtual_memory().available > need
        print(f"compute time per token: {'all-resident arms' if resident else 'each arm (wall - felt wait)'} "
              f"({psutil.virtual_memory().available / 1e9:.1f} GB available, {need / 1e9:.1f} GB needed)", flush=True)
    arms = []
    for routing in a.routings:
        rt = {"routing_trace": str(a.routing_trace)} if routing == "realistic" else {}
        if resident:
            # the compute reference: every expert loaded, its arena faulted in the same way as
            # the budget arms' (--reserve on: reserved; an int8 run measured 21.7 tok/s without
            # against 30.2 for an 8 GB arm whose reserved cache held every expert)
            arms.append(("all", routing, dict(base, pilot=0, cap=E, warm_all=True, reserve_cache=a.reserve != "off",
                                              **({"idle_s": a.idle_s} if a.idle_s else {}), **rt)))
        def values(choice):  # --reserve / --fill / --draft off|on|both
            return (False, True) if choice == "both" else (choice == "on",)
        for b, p, rv, fv in itertools.product(a.budgets, a.modes, values(a.reserve), values(a.fill)):
            for dv in values(a.draft) if p > 0 else (False,):
                arms.append((b, routing, dict(base, pilot=p, ram_budget_gb=b, reserve_cache=rv, idle_fill=fv,
                                              pilot_draft=dv, **({"idle_s": a.idle_s} if a.idle_s else {}), **rt)))
    check_arm_inputs(a.store, [o for _, _, o in arms], None, 0)
    disk = [measure_disk(a.store, qd=a.qd)]
    touch = [measure_first_touch()]
    rows = []
    for rep in range(a.reps):
        seq = arms if rep % 2 == 0 else list(reversed(arms))
        for b, routing, over in seq:
            try:
                r = arm_subprocess(a.store, over, a.prompt_len, a.tokens, a.seed,
                                   cgroup_gb=None if (b == "all" or a.no_cgroup) else b)
            except (RuntimeError, OSError) as e:
                r = {**over, "error": str(e).strip().splitlines()[-1][:300], "hit_rate": None}
            r.update(budget_gb=b, routing=routing, rep=rep)
            r.pop("routing_trace", None)
            rows.append(r)
            print(f"rep {rep} {routing} budget {b} pilot {over['pilot']} draft {int(over.get('pilot_draft', 0))} "
                  f"reserve {int(over.get('reserve_cache', 0))} fill {int(over.get('idle_fill', 0))}: "
                  + (f"cap {r['cap']} hit {100 * r['decode_hit_rate']:.1f}% {r['decode_mb_per_token']:.1f} MB/t "
                     f"felt {r['decode_felt_wait_s']:.2f}s {r['tok_per_s']:.2f} tok/s one-call steps {r.get('one_call_steps', 0)} cpu/t "
                     f"{r['decode_cpu_s'] / max(r['decode_tokens'], 1):.3f}s load {r['load_avg']:.1f} "
                     f"logits {r['sha256_logits']}" if r.get("hit_rate") is not None else f"error {r['error']}"),
                  flush=True)
    disk.append(measure_disk(a.store, qd=a.qd))
    touch.append(measure_first_touch())
    bw = max(d[k] for d in disk for k in d if k.endswith("_gbps"))
    compute = {}
    for routing in a.routings:
        res = [r for r in rows if r["routing"] == routing and r["budget_gb"] == "all" and r.get("hit_rate") is not None]
        if res:
            compute[routing] = {
                "compute_s_per_token": float(np.median([r["decode_wall_s"] / max(r["decode_tokens"], 1) for r in res])),
                "compute_cpu_s_per_token": float(np.median([r["decode_cpu_s"] / max(r["decode_tokens"], 1) for r in res]))}
    for r in rows:
        if r.get("hit_rate") is None:
            continue
        n = max(r["decode_tokens"], 1)  # decoded tokens (a forward may keep several)
        r["decode_tok_s"] = r["tok_per_s"]
        r["felt_wait_s_per_token"] = r["decode_felt_wait_s"] / n
        r["cpu_s_per_token"] = r["decode_cpu_s"] / n
        rec = [x for x in r.get("pilot_recall") or [] if x > 0]
        # PILOT's mean recall over the layers whose recall is above 0 (the arm's row gives 0 for a
        # layer never predicted as for one never predicted right; the first is the common case)
        r["recall"] = float(np.mean(rec)) if rec else None
        c = compute.get(r["routing"])
        if c is None and r["budget_gb"] != "all":
            # no all-resident arm: this arm's own time not spent waiting for reads (the load of
            # the machine then cancels out of the share; bench matrix does the same)
            c = {"compute_s_per_token": max(r["decode_wall_s"] - r["decode_felt_wait_s"], 0.0) / n,
                 "compute_cpu_s_per_token": None, "own": True}
        if c is not None:
            r["ceiling_tok_s"], r["io_s_per_token"] = ceiling(c["compute_s_per_token"], r["decode_mb_per_token"], bw)
            r["compute_s_per_token"] = c["compute_s_per_token"]
            r["ceiling_share"] = r["decode_tok_s"] / r["ceiling_tok_s"]
            # CPU view: this arm's CPU per token against the all-resident arm's (what streaming
            # costs in CPU: reads, checksums, PILOT), independent of the other jobs' load
            if c.get("compute_cpu_s_per_token"):
                r["cpu_vs_resident"] = r["cpu_s_per_token"] / c["compute_cpu_s_per_token"]
            r["compute_source"] = "own (wall - felt wait)" if c.get("own") else "all-resident arm"
    if not any(r.get("hit_rate") is not None for r in rows):
        print("every arm failed (see the errors above); nothing written", file=sys.stderr)
        return 1
    groups: dict = {}
    for r in rows:
        if r.get("hit_rate") is not None:
            groups.setdefault((r["routing"], str(r["budget_gb"]), r["pilot"], bool(r.get("pilot_draft")),
                               bool(r.get("reserve_cache")), bool(r.get("idle_fill"))), []).append(r)
    summ = []
    for (routing, b, p, dv, rv, fv), rs in groups.items():
        med = {k: float(np.median([x[k] for x in rs if x.get(k) is not None]))
               for k in ("decode_hit_rate", "decode_mb_per_token", "decode_spec_mb_per_token", "felt_wait_s_per_token",
                         "decode_tok_s", "ceiling_tok_s", "ceiling_share", "cpu_s_per_token", "cpu_vs_resident",
                         "load_avg", "recall") if any(x.get(k) is not None for x in rs)}
        summ.append({"routing": routing, "budget_gb": rs[0]["budget_gb"], "pilot": p, "pilot_draft": int(dv),
                     "reserve_cache": int(rv),
                     "idle_fill": int(fv), "resident_at_start": float(np.median([x.get("resident_at_start", 0) for x in rs])),
                     "cap": rs[0]["cap"], "n": len(rs),
                     **med, "sha256_logits": " ".join(sorted({x["sha256_logits"] for x in rs}))})
    for r in rows:
        r["pilot_draft"] = int(bool(r.get("pilot_draft")))
        r["reserve_cache"] = int(bool(r.get("reserve_cache")))
        r["idle_fill"] = int(bool(r.get("idle_fill")))
    cols = [("routing", "routing", ""), ("budget GB", "budget_gb", ""), ("pilot", "pilot", "d"),
            ("draft", "pilot_draft", "d"), ("recall", "recall", ".2f"),
            ("reserve", "reserve_cache", "d"), ("fill", "idle_fill", "d"), ("cap", "cap", "d"),
            ("resident at start", "resident_at_start", ".0f"),
            ("hit", "decode_hit_rate", ".1%"), ("MB/token", "decode_mb_per_token", ".1f"),
            ("spec MB/t", "decode_spec_mb_per_token", ".1f"), ("felt wait s/t", "felt_wait_s_per_token", ".3f"),
            ("tok/s", "decode_tok_s", ".2f"), ("ceiling tok/s", "ceiling_tok_s", ".2f"),
            ("of ceiling", "ceiling_share", ".0%"), ("CPU s/t", "cpu_s_per_token", ".3f"),
            ("CPU vs resident", "cpu_vs_resident", ".2f"), ("load", "load_avg", ".1f")]
    head = [f"Store `{a.store}`; {a.prompt_len}-token prompt + {a.tokens} decoded tokens (teacher forced, seed "
            f"{a.seed}), context {a.context}, checksum {a.checksum}. Decode-only columns (the first step, prefill + "
            f"first token, excluded). Each arm a fresh process, cold, O_DIRECT"
            + ("" if a.no_cgroup else ", inside a cgroup v1 memory limit = its budget") + ".",
            "Ceiling = 1 / max(compute s/token, I/O s/token): compute = "
            + ("the all-resident pilot-0 arm of the same routing (median decode wall time per token, same run)"
               if compute else "each arm's own decode wall time not spent waiting for expert reads, per token "
               "(no all-resident arm: the 7 GB of experts did not fit beside the other jobs' memory)")
            + ", I/O = MB read per token (demand + "
            f"speculative) / {bw:.2f} GB/s (the fastest O_DIRECT slab rate measured before/after the arms: "
            + "; ".join(f"QD1 {d['qd1_gbps']:.2f}, QD{a.qd} {d[f'qd{a.qd}_gbps']:.2f}" for d in disk) + " GB/s).",
            "Reserve: the setting reserve_cache (the cache's memory faulted in after open, the arm starting once "
            "it is; median wait " + (f"{np.median([r['populate_s'] for r in rows if r.get('reserve_cache') and r.get('populate_s') is not None] or [0]):.1f} s"
            ) + "). First touch of fresh memory (1 GB, MADV_POPULATE_WRITE) before/after the arms: "
            + ", ".join("n/a" if t is None else f"{t:.2f} GB/s" for t in touch) + ". Fill: the setting idle_fill "
            "(free slots filled from the SSD while no demand read is in flight, never evicting); resident at start: "
            f"experts in RAM at the first token; idle before the first token: {a.idle_s:g} s.",
            "CPU s/t: the arm process's user+system CPU per decoded token (rusage); CPU vs resident: that over the "
            "all-resident arm's. Load: 1-minute load average after the arm (2 cores shared with other jobs).",
            "Routing: forced = random-weight router on a seeded random token stream (worst case); realistic = the "
            f"router choices and PILOT predictions replayed from `{a.routing_trace}` (`engine.trace.RecordedRouting`)."]
    for routing, c in compute.items():
        head.append(f"- {routing}: compute {c['compute_s_per_token'] * 1e3:.1f} ms/token wall, "
                    f"{c['compute_cpu_s_per_token'] * 1e3:.1f} ms/token CPU (all resident)")
    table = md_table(summ, cols + [("sha256(logits)", "sha256_logits", "")])
    table += "\n\nEvery arm:\n\n" + md_table([r for r in rows if r.get("hit_rate") is not None],
                                              [("rep", "rep", "d")] + cols + [("sha256(logits)", "sha256_logits", "")])
    for routing in a.routings:
        hs = {r["sha256_logits"] for r in rows if r["routing"] == routing and r.get("sha256_logits")}
        table += f"\n\n{routing}: distinct logit hashes across its arms: {len(hs)} (1 = byte-identical)."
    errs = [r for r in rows if r.get("hit_rate") is None]
    if errs:
        table += "\n\nFailed arms: " + "; ".join(f"{r['routing']} {r['budget_gb']} pilot {r['pilot']}: {r['error']}"
                                                 for r in errs)
    if a.note:
        table += "\n\n" + a.note
    write_results(a.name, {"machine": machine_info(), "store": a.store, "routing_trace": str(a.routing_trace),
                           "disk": disk, "disk_gbps_for_ceiling": bw, "first_touch_gbps": touch, "compute": compute, "rows": rows,
                           "summary": summ, "prompt_len": a.prompt_len, "tokens": a.tokens, "seed": a.seed,
                           "context": a.context, "notes": a.note or None},
                  "\n\n".join(head[:5]) + "\n\n" + "\n".join(head[5:]) + "\n\n" + table)
    return 0


def add_parser(bs) -> None:
    """Register `overlap` under ``colibri bench``."""
    p = bs.add_parser("overlap", help="forced vs realistic routing streams in memory cgroups, against the I/O ceiling")
    p.add_argument("--store", default="/work/bigmodels/olmoe-1b-7b/olmoe-1b-7b-int8")
    p.add_argument("--routing-trace", default="bench/work/trace_default_logits.jsonl",
                   help="a logits trace of a trained model (colibri bench trace-heldout --logits)")
    p.add_argument("--routings", nargs="+", choices=("forced", "realistic"), default=["forced", "realistic"])
    p.add_argument("--budgets", nargs="+", type=float, default=[4.0, 8.0], help="GB (cgroup limit = engine budget)")
    p.add_argument("--modes", type=int, nargs="+", default=[0, 1], help="PILOT modes")
    p.add_argument("--reps", type=int, default=1)
    add_stream_flags(p, prompt_len=16, tokens=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--checksum", default="first", choices=("off", "first", "always"))
    p.add_argument("--qd", type=int, default=4)
    p.add_argument("--compute", choices=("auto", "resident", "own"), default="auto",
                   help="compute time per token: all-resident arms, each arm's (wall - felt wait), or "
                        "resident when the store fits in the available memory")
    p.add_argument("--no-cgroup", action="store_true", help="budgets as engine RAM budgets only")
    p.add_argument("--reserve", choices=("off", "on", "both"), default="off",
                   help="the budget arms with the setting reserve_cache off, on, or each twice")
    p.add_argument("--draft", choices=("off", "on", "both"), default="on",
                   help="the PILOT arms (pilot > 0) with the setting pilot_draft off, on, or each twice "
                        "(the draft lookahead: the next layer predicted while a read is waited for)")
    p.add_argument("--fill", choices=("off", "on", "both"), default="off",
                   help="the budget arms with the setting idle_fill off, on, or each twice")
    p.add_argument("--idle-s", type=float, default=0.0,
                   help="seconds each arm sits idle after open before the first token (a user typing)")
    p.add_argument("--name", default="overlap_olmoe_1b_7b")
    p.add_argument("--note", default="")
    p.set_defaults(fn=cmd_overlap)
