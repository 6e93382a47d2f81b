"""``colibri bench matrix``: RAM budget x PILOT mode x workers on one store, every cell a fresh
process, cold, O_DIRECT, with the I/O-bound ceiling of each cell."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .common import add_stream_flags, check_arm_inputs, machine_info, md_table, write_results
from .arm import arm_subprocess
from .disk import measure_disk


def _budget_arg(v: str) -> str:
    if v == "all":
        return v
    try:
        if float(v) > 0:
            return v
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{v!r}: a RAM budget in GB (> 0) or 'all'")

def cmd_matrix(a) -> int:
    """RAM budget x PILOT mode x workers on one store, every cell a fresh process, cold, O_DIRECT.

    The I/O-bound ceiling of a cell is 1 / max(compute s/token, demand bytes/token / disk B/s):
    compute s/token is the all-resident pilot-0 cell's decode time per token (no I/O at all),
    disk B/s the O_DIRECT slab bandwidth measured at queue depth ``--qd`` before the cells.
    Without an all-resident cell (a store larger than RAM) compute s/token is each cell's own
    (decode time - felt wait) per token. ``--append`` adds the cells to an existing
    results file (stores that cannot sit on the disk together).
    """
    budgets = [None if b in ("all", "0") else float(b) for b in a.budgets]
    check_arm_inputs(a.store, [dict(pilot=p, pilot_workers=w, context_length=a.context)
                                for p in a.modes for w in a.workers], None, 0)
    from ..config import ModelArgs
    n_experts = ModelArgs.from_hf_config(Path(a.store) / "config.json").num_experts
    disk = measure_disk(a.store, qd=a.qd)
    bw = disk[f"qd{a.qd}_gbps"] * 1e9
    cells = []
    for b in budgets:
        for p in a.modes:
            for w in (a.workers if p > 0 else [1]):
                over = dict(pilot=p, pilot_workers=w, o_direct=True, pinning=False, history=False,
                            context_length=a.context)
                if b is None:
                    over.update(cap=n_experts, warm_all=True)  # every expert of a layer fits
                else:
                    over.update(ram_budget_gb=b)
                cells.append((b, over))
    # all-resident first: its pilot-0 cell gives the compute time per token
    cells.sort(key=lambda c: (c[0] is not None, c[0] or 0))
    rows = []
    for rep in range(a.reps):
        seq = cells if rep % 2 == 0 else [cells[0]] + list(reversed(cells[1:]))
        for b, over in seq:
            try:
                r = arm_subprocess(a.store, over, a.prompt_len, a.tokens, a.seed)
            except RuntimeError as e:  # e.g. a budget below what the dense weights need
                r = {**over, "error": str(e).splitlines()[-1][:300], "hit_rate": None}
            r["budget_gb"] = b if b is not None else "all"
            r["rep"] = rep
            rows.append(r)
            print(f"budget {r['budget_gb']} pilot {over['pilot']} w{over['pilot_workers']}: "
                  + (f"cap {r['cap']} decode: hit {100 * r['decode_hit_rate']:.1f}% "
                     f"{r['decode_mb_per_token']:.0f} MB/t felt {r['decode_felt_wait_s']:.2f}s "
                     f"{r['tok_per_s']:.2f} tok/s RSS {r['max_rss_gb']:.2f} GB load {r['load_avg']:.1f}"
                     if r.get("hit_rate") is not None else f"error {r['error']}"), flush=True)
    base = [r for r in rows if r["budget_gb"] == "all" and r["pilot"] == 0 and r.get("tokens")]
    if base:
        compute_s = float(np.median([r["decode_s"] / max(r["tokens"] - 1, 1) for r in base]))
        compute_source = "all-resident pilot-0 cell's decode time per token"
    else:  # no all-resident cell (a store larger than RAM): each cell's own decode time not spent
        # waiting for reads (on a shared machine the load then cancels out of the ceiling share)
        compute_s = None
        compute_source = "each cell's (decode time - felt wait) per token; median shown"
    for r in rows:
        if r.get("hit_rate") is None or r.get("tokens", 0) < 2:
            continue
        cs = compute_s if base else max(r["decode_s"] - r["decode_felt_wait_s"], 0.0) / (r["tokens"] - 1)
        if cs is None:
            continue
        io_s = r["decode_demand_mb_per_token"] * 1e6 / bw
        r["compute_s_per_token"] = cs
        r["io_s_per_token"] = io_s
        r["ceiling_tok_per_s"] = 1.0 / max(cs, io_s)
        r["of_ceiling"] = r["tok_per_s"] / r["ceiling_tok_per_s"]
    if not any(r.get("hit_rate") is not None for r in rows):
        print("every cell failed (see the errors above); nothing written", file=sys.stderr)
        return 1
    if compute_s is None:
        cells = [r["compute_s_per_token"] for r in rows if r.get("compute_s_per_token") is not None]
        compute_s = float(np.median(cells)) if cells else None
    run = {"store": a.store, "quant": rows[0].get("quant") or _store_quant(a.store), "disk": disk,
           "compute_s_per_token": compute_s, "compute_source": compute_source, "prompt_len": a.prompt_len,
           "tokens": a.tokens, "seed": a.seed, "context": a.context}
    for r in rows:
        r.setdefault("quant", run["quant"])
        r["store"] = a.store
    runs, all_rows = [run], rows
    prev = Path("bench/results") / f"{a.name}.json"
    if a.append and prev.is_file():
        old = json.loads(prev.read_text(encoding="utf-8"))
        runs = old.get("runs", []) + runs
        all_rows = old.get("rows", []) + rows
    write_results(a.name, {"machine": machine_info(), "runs": runs, "rows": all_rows,
                           "summary": [summary_row(r) for r in all_rows], "notes": a.note or None},
                  matrix_markdown(runs, all_rows, a.note))
    return 0


def _store_quant(store: str) -> str | None:
    try:
        return json.loads((Path(store) / "manifest.json").read_text(encoding="utf-8")).get("quant")
    except (OSError, ValueError):
        return None


def summary_row(r: dict) -> dict:
    """One cell's headline figures (decode only): counters first, then wall clock and load."""
    ok = r.get("hit_rate") is not None
    per = r.get("distinct_per_layer") or []
    n = max(r.get("tokens", 0) - 1, 1)
    return {"quant": r.get("quant"), "budget_gb": r.get("budget_gb"), "pilot": r.get("pilot"),
            "workers": r.get("pilot_workers"), "rep": r.get("rep"), "cap": r.get("cap"),
            "hit_pct": 100 * r["decode_hit_rate"] if ok else None,
            "mb_per_token": r.get("decode_mb_per_token"), "felt_wait_s": r.get("decode_felt_wait_s"),
            "felt_wait_s_per_token": r["decode_felt_wait_s"] / n if ok else None,
            "peak_rss_gb": max(r.get("peak_rss_gb") or 0, r.get("max_rss_gb") or 0) if ok else None,
            "ceiling_tok_s": r.get("ceiling_tok_per_s"), "decode_tok_s": r.get("tok_per_s"),
            "ceiling_share": r.get("of_ceiling"), "load_avg": r.get("load_avg"),
            "distinct_experts": r.get("distinct_experts"),
            "distinct_per_layer_min_median_max": [int(min(per)), float(np.median(per)), int(max(per))] if per else None,
            "sha256_ids": r.get("sha256_ids"), "sha256_routing": r.get("sha256_routing"),
            "guard_fired": r.get("guard_fired"), "gen_cpu_s": r.get("gen_cpu_s"),
            # cores the arm actually got while generating (CPU s / wall s): low = a loaded machine
            "cpu_per_wall": (r["gen_cpu_s"] / r["gen_wall_s"]) if ok and r.get("gen_wall_s") else None,
            "error": None if ok else r.get("error")}


def matrix_markdown(runs: list[dict], rows: list[dict], note: str | None = None) -> str:
    """The results page: one line per run (disk bandwidth, compute per token), then the table."""
    head = ["Decode-only columns (the prompt's prefill is excluded from hit %, MB/token, felt wait). "
            "Peak RSS: the arm process's high-water mark (opening included). Load: 1-minute load "
            "average after the arm (this machine is shared; wall-clock tok/s depends on it)."]
    for u in runs:
        d, qd = u["disk"], [k for k in u["disk"] if k.startswith("qd") and k != "qd1_gbps"]
        cs = u["compute_s_per_token"]
        head.append(f"- `{u['store']}` ({u['quant']}): O_DIRECT slab reads {d['qd1_gbps']:.2f} GB/s QD1"
                    + "".join(f", {d[k]:.2f} GB/s {k[:-5].upper()}" for k in qd)
                    + f" ({d['slab_mb']:.2f} MB slabs); compute per token "
                    + (f"{cs:.3f} s" if cs is not None else "n/a") + f" ({u['compute_source']}); forced stream "
                    f"of {u['prompt_len']} prompt + {u['tokens']} generated tokens ({u['tokens'] - 1} decode "
                    f"steps), seed {u['seed']}")
    summ = [summary_row(r) for r in rows]
    table = md_table([x for x in summ if x["error"] is None], [
        ("quant", "quant", ""), ("budget GB", "budget_gb", ""), ("pilot", "pilot", "d"), ("workers", "workers", "d"),
        ("rep", "rep", "d"), ("cap", "cap", "d"), ("hit %", "hit_pct", ".1f"), ("MB/token", "mb_per_token", ".0f"),
        ("felt wait s", "felt_wait_s", ".2f"), ("felt wait s/token", "felt_wait_s_per_token", ".3f"),
        ("peak RSS GB", "peak_rss_gb", ".2f"), ("ceiling tok/s", "ceiling_tok_s", ".2f"),
        ("tok/s", "decode_tok_s", ".2f"), ("of ceiling", "ceiling_share", ".0%"), ("load", "load_avg", ".1f"),
        ("distinct experts", "distinct_experts", "d"), ("per layer min/med/max", "distinct_per_layer_min_median_max", ""),
        ("guard fired", "guard_fired", "d"), ("CPU s", "gen_cpu_s", ".0f"), ("CPU/wall", "cpu_per_wall", ".2f"),
        ("sha256(ids)", "sha256_ids", ""), ("sha256(routing)", "sha256_routing", "")])
    errs = [x for x in summ if x["error"] is not None]
    if errs:
        table += "\n\nFailed cells: " + "; ".join(f"{x['quant']} budget {x['budget_gb']} pilot {x['pilot']}: "
                                                  f"{x['error']}" for x in errs)
    for q in sorted({x["quant"] for x in summ if x["quant"]}):
        shas = {x["sha256_ids"] for x in summ if x["quant"] == q and x["sha256_ids"]}
        table += f"\n\n{q}: distinct generated-id hashes across its cells: {len(shas)} (1 = byte-identical)."
        routes = {x["sha256_routing"] for x in summ if x["quant"] == q and x.get("sha256_routing")}
        if routes:
            table += (f" Distinct routing digests (every call's top-k ids, in order): {len(routes)} "
                      f"(1 = the cells routed identically).")
    if note:
        table += "\n\n" + note
    return "\n".join(head) + "\n\n" + table


def add_parser(bs) -> None:
    """Register `matrix` under ``colibri bench``."""
    mx = bs.add_parser("matrix", help="RAM budget x PILOT x workers, cold, O_DIRECT, with the I/O-bound ceiling")
    mx.add_argument("--store", default="bench/work/olmoe-1b-7b-int8")
    mx.add_argument("--budgets", nargs="+", type=_budget_arg, default=["2", "4", "8", "all"],
                    help="GB, or 'all' (all resident)")
    mx.add_argument("--modes", type=int, nargs="+", default=[0, 1, 2, 3])
    mx.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    mx.add_argument("--reps", type=int, default=1)
    add_stream_flags(mx, prompt_len=16, tokens=32)
    mx.add_argument("--qd", type=int, default=4)
    mx.add_argument("--context", type=int, default=512, help="KV cache length (tokens) of every cell")
    mx.add_argument("--name", default="matrix_olmoe_1b_7b")
    mx.add_argument("--append", action="store_true",
                    help="add these cells to bench/results/NAME.json (e.g. a second store that cannot "
                         "sit on the disk beside the first)")
    mx.add_argument("--note", default="", help="a line added under the table (and to the JSON)")
    mx.set_defaults(fn=cmd_matrix)
