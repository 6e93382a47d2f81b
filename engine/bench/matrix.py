"""``colibri bench matrix``: RAM budget x PILOT mode x workers on one store, every cell a fresh
process, cold, O_DIRECT, with the I/O-bound ceiling of each cell."""

from __future__ import annotations

import argparse
import sys

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
    """
    budgets = [None if b in ("all", "0") else float(b) for b in a.budgets]
    check_arm_inputs(a.store, [dict(pilot=p, pilot_workers=w, context_length=a.context)
                                for p in a.modes for w in a.workers], None, 0)
    disk = measure_disk(a.store, qd=a.qd)
    bw = disk[f"qd{a.qd}_gbps"] * 1e9
    cells = []
    for b in budgets:
        for p in a.modes:
            for w in (a.workers if p > 0 else [1]):
                over = dict(pilot=p, pilot_workers=w, o_direct=True, pinning=False, history=False,
                            context_length=a.context)
                if b is None:
                    over.update(cap=10 ** 6, warm_all=True)  # the planner clips it to num_experts
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
                     f"{r['tok_per_s']:.2f} tok/s RSS {r['peak_rss_gb']:.2f} GB"
                     if r.get("hit_rate") is not None else f"error {r['error']}"), flush=True)
    base = [r for r in rows if r["budget_gb"] == "all" and r["pilot"] == 0 and r.get("tokens")]
    compute_s = float(np.median([r["decode_s"] / max(r["tokens"] - 1, 1) for r in base])) if base else None
    for r in rows:
        if r.get("hit_rate") is None or compute_s is None:
            continue
        io_s = r["decode_demand_mb_per_token"] * 1e6 / bw
        r["compute_s_per_token"] = compute_s
        r["io_s_per_token"] = io_s
        r["ceiling_tok_per_s"] = 1.0 / max(compute_s, io_s)
        r["of_ceiling"] = r["tok_per_s"] / r["ceiling_tok_per_s"]
    table = md_table([r for r in rows if r.get("hit_rate") is not None], [
        ("rep", "rep", "d"), ("budget GB", "budget_gb", ""), ("pilot", "pilot", "d"), ("workers", "pilot_workers", "d"),
        ("cap", "cap", "d"), ("hit %", "decode_hit_rate", ".1%"), ("MB/token", "decode_mb_per_token", ".0f"),
        ("felt wait s", "decode_felt_wait_s", ".2f"), ("read service s", "decode_read_service_s", ".2f"),
        ("tok/s", "tok_per_s", ".2f"), ("ceiling tok/s", "ceiling_tok_per_s", ".2f"),
        ("of ceiling", "of_ceiling", ".0%"), ("peak RSS GB", "peak_rss_gb", ".2f"),
        ("distinct experts", "distinct_experts", "d"), ("sha256(ids)", "sha256_ids", "")])
    errs = [r for r in rows if r.get("hit_rate") is None]
    head = ("Decode-only columns (the prompt's prefill is excluded from hit %, MB/token, felt wait).\n"
            f"O_DIRECT slab reads: {disk['qd1_gbps']:.2f} GB/s QD1, {disk[f'qd{a.qd}_gbps']:.2f} GB/s QD{a.qd} "
            f"({disk['slab_mb']:.2f} MB slabs); compute per token (all resident, pilot 0): "
            f"{compute_s if compute_s is not None else float('nan'):.3f} s; forced stream of {a.prompt_len} + "
            f"{a.tokens} tokens, seed {a.seed}\n\n")
    if errs:
        table += "\n\nFailed cells: " + "; ".join(f"budget {r['budget_gb']} pilot {r['pilot']}: {r['error']}" for r in errs)
    shas = {r["sha256_ids"] for r in rows if r.get("sha256_ids")}
    table += f"\n\nDistinct generated-id hashes across all cells: {len(shas)} (1 = byte-identical)."
    if not any(r.get("hit_rate") is not None for r in rows):
        print("every cell failed (see the errors above); nothing written", file=sys.stderr)
        return 1
    write_results(a.name, {"machine": machine_info(), "store": a.store, "disk": disk, "rows": rows,
                           "compute_s_per_token": compute_s, "prompt_len": a.prompt_len, "tokens": a.tokens,
                           "seed": a.seed}, head + table)
    return 0


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
    mx.set_defaults(fn=cmd_matrix)
