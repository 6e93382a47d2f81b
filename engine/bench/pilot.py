"""``colibri bench pilot``: PILOT A/B; each arm a fresh process with the same frozen heat,
interleaved, repetitions reversed; medians per arm against pilot 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .common import check_arm_inputs, machine_info, md_table, write_results
from .arm import arm_subprocess


def cmd_pilot(a) -> int:
    """Arms: pilot 0-3 (x workers, x guard); each a fresh process with the same frozen heat."""
    from ..heat import FILENAME
    heat = Path(a.store) / FILENAME
    arms = []
    for p in a.modes:
        for w in (a.workers if p > 0 else [1]):
            for g in ((True, False) if (p > 0 and a.guard_both) else (True,)):
                for sp in (a.spec_precision if p > 0 else [None]):
                    arm = dict(cap=a.cap, pilot=p, pilot_workers=w, evict_guard=g, o_direct=True,
                               pinning=bool(a.warm_heat), history=bool(a.warm_heat),
                               **({"policy": a.policy} if a.policy else {}),
                               **({"routing_trace": a.routing_trace} if a.routing_trace else {}))
                    if sp is not None:  # the gate only exists with PILOT on
                        arm["spec_precision"] = sp
                    arms.append(arm)
    check_arm_inputs(a.store, arms, a.stream_file, a.prompt_len + a.tokens)
    frozen = None
    if a.warm_heat:
        # Build the frozen heat once: one run with history on, pinning off.
        heat.unlink(missing_ok=True)
        arm_subprocess(a.store, dict(cap=a.cap, pilot=0, pinning=True, history=True,
                                     **({"routing_trace": a.routing_trace} if a.routing_trace else {})), a.prompt_len,
                        a.tokens, a.seed + 1, a.prompt_text, a.stream_file)
        frozen = heat.read_bytes()

    rows = []
    order = []
    for rep in range(a.reps):
        seq = arms if rep % 2 == 0 else list(reversed(arms))
        for over in seq:
            if frozen is not None:
                from ..fsutil import atomic_write_bytes
                atomic_write_bytes(heat, frozen)
            elif heat.exists():
                heat.unlink()
            r = arm_subprocess(a.store, over, a.prompt_len, a.tokens, a.seed, a.prompt_text, a.stream_file)
            r["rep"] = rep
            rows.append(r)
            order.append(over)
            print(f"rep {rep} pilot {over['pilot']} w{over['pilot_workers']} guard {over['evict_guard']} "
                  f"gate {over.get('spec_precision', '-')}: decode "
                  f"hit {100 * r['decode_hit_rate']:.1f}% {r['decode_mb_per_token']:.2f} MB/t "
                  f"felt {r['decode_felt_wait_s']:.3f}s "
                  f"{r['tok_per_s']:.2f} tok/s logits {r['sha256_logits']} load {r['load_avg']:.1f}", flush=True)
    if frozen is not None:
        heat.unlink(missing_ok=True)
    table = md_table(rows, [("rep", "rep", "d"), ("pilot", "pilot", "d"), ("workers", "pilot_workers", "d"),
                            ("guard", "evict_guard", ""), ("gate", "spec_precision", ".2f"),
                            ("hit %", "decode_hit_rate", ".1%"),
                            ("MB/token", "decode_mb_per_token", ".2f"), ("spec MB/t", "decode_spec_mb_per_token", ".2f"),
                            ("felt wait s", "decode_felt_wait_s", ".3f"), ("tok/s", "tok_per_s", ".2f"),
                            ("all-steps hit %", "hit_rate", ".1%"), ("all-steps felt s", "felt_wait_s", ".3f"),
                            ("load", "load_avg", ".1f"), ("sha256(logits)", "sha256_logits", "")])
    # Per arm (pilot, workers, guard): medians over the repetitions, and the ratios to pilot 0.
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["pilot"], r["pilot_workers"], r["evict_guard"], r.get("spec_precision")), []).append(r)
    summ = []
    for (p_, w_, g_, sp_), rs in groups.items():
        summ.append({"pilot": p_, "pilot_workers": w_, "evict_guard": g_, "spec_precision": sp_,
                     **{k: float(np.median([x[k] for x in rs])) for k in (
                         "decode_hit_rate", "decode_mb_per_token", "decode_felt_wait_s", "tok_per_s",
                         "decode_cpu_s")},
                     "recall": " ".join(f"{v:.2f}" for v in rs[0]["pilot_recall"][1:]) if rs[0]["pilot_recall"] else ""})
    base = next((x for x in summ if x["pilot"] == 0), None)
    for x in summ:
        if base:
            x["felt_vs_p0"] = x["decode_felt_wait_s"] / base["decode_felt_wait_s"] - 1 if base["decode_felt_wait_s"] else 0.0
            x["mb_vs_p0"] = x["decode_mb_per_token"] / base["decode_mb_per_token"] - 1 if base["decode_mb_per_token"] else 0.0
            x["tps_vs_p0"] = x["tok_per_s"] / base["tok_per_s"] - 1 if base["tok_per_s"] else 0.0
    table += "\n\nMedians per arm (decode only), change against pilot 0:\n\n" + md_table(summ, [
        ("pilot", "pilot", "d"), ("workers", "pilot_workers", "d"), ("guard", "evict_guard", ""),
        ("gate", "spec_precision", ".2f"), ("hit %", "decode_hit_rate", ".1%"), ("MB/token", "decode_mb_per_token", ".2f"),
        ("felt wait s", "decode_felt_wait_s", ".3f"), ("tok/s", "tok_per_s", ".2f"), ("decode CPU s", "decode_cpu_s", ".2f"),
        ("felt vs p0", "felt_vs_p0", "+.0%"), ("MB/t vs p0", "mb_vs_p0", "+.0%"), ("tok/s vs p0", "tps_vs_p0", "+.0%"),
        ("recall per layer (1..L-1)", "recall", "")])
    table = ("Decode-only columns: the first step (the prompt's prefill and first token, where PILOT does not "
             "run) is excluded; all-steps columns include it.\n\n" + table)
    shas = {r["sha256_ids"] for r in rows}
    table += f"\n\nDistinct generated-id hashes across all arms: {len(shas)} (1 = byte-identical)."
    lgs = {r["sha256_logits"] for r in rows}
    table += f" Distinct logit hashes (every forward's float32 logits): {len(lgs)}."
    if a.routing_trace:
        table += (f"\n\nRouting: realistic, replayed from `{a.routing_trace}` (router choices and PILOT's "
                  f"predictor logits; engine.trace.RecordedRouting).")
    write_results(a.name, {"machine": machine_info(), "store": a.store, "rows": rows, "summary": summ,
                           "cap": a.cap, "prompt_len": a.prompt_len, "tokens": a.tokens,
                           "prompt_text": a.prompt_text, "stream_file": a.stream_file,
                           "routing_trace": a.routing_trace}, table)
    return 0


def add_parser(bs) -> None:
    """Register `pilot` under ``colibri bench``."""
    p = bs.add_parser("pilot", help="PILOT A/B, arms in fresh processes, interleaved, reps reversed")
    p.add_argument("--store", default="bench/work/1b-int8")
    p.add_argument("--cap", type=int, default=32)
    p.add_argument("--modes", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    p.add_argument("--guard-both", action="store_true", help="also run every arm with the guard off")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompt-text", default=None, help="real prompt (trained models) instead of a forced stream")
    p.add_argument("--stream-file", default=None,
                   help="JSON lines with 'ids' (e.g. a model's heldout_sample.jsonl): teacher force real text")
    p.add_argument("--spec-precision", type=float, nargs="+", default=[0.7],
                   help="PILOT precision gate value(s) to compare (0 = load every prediction)")
    p.add_argument("--routing-trace", default=None,
                   help="replay this logits trace's routing and PILOT predictions (realistic routing at the store's scale)")
    p.add_argument("--policy", default=None, help="cache policy of every arm (default: the engine default)")
    p.add_argument("--warm-heat", action="store_true", help="freeze a heat file from one warm-up run, restore per arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="pilot_1b")
    p.set_defaults(fn=cmd_pilot)
