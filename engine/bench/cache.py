"""``colibri bench cache``: streaming at several caps, cold, O_DIRECT: hit rate, MB/token, felt
wait against the disk's bandwidth, tok/s."""

from __future__ import annotations

from .common import add_stream_flags, machine_info, md_table, write_results
from .arm import arm_subprocess
from .disk import measure_disk


def cmd_cache(a) -> int:
    """Each cap of ``--caps`` as a cold arm in a fresh process (pilot 0, no pinning); the felt wait
    is compared with demand bytes / the disk's QD4 bandwidth."""
    disk = measure_disk(a.store)
    bw = disk["qd4_gbps"] * 1e9
    rows = []
    for cap in a.caps:
        over = dict(cap=cap, pilot=0, pinning=False, history=False, o_direct=True)
        r = arm_subprocess(a.store, over, a.prompt_len, a.tokens, a.seed)
        r["ideal_wait_s"] = r["demand_bytes"] / bw
        r["wait_ratio"] = r["felt_wait_s"] / r["ideal_wait_s"] if r["ideal_wait_s"] > 0 else None
        rows.append(r)
        print(f"cap {cap}: hit {100 * r['hit_rate']:.1f}% {r['mb_per_token']:.1f} MB/token "
              f"felt {r['felt_wait_s']:.2f}s (ideal {r['ideal_wait_s']:.2f}s) {r['tok_per_s']:.2f} tok/s", flush=True)
    table = md_table(rows, [("cap", "cap", "d"), ("hit %", "hit_rate", ".1%"), ("MB/token", "mb_per_token", ".1f"),
                            ("felt wait s", "felt_wait_s", ".2f"), ("read service s", "read_service_s", ".2f"),
                            ("demand bytes / disk bw s", "ideal_wait_s", ".2f"), ("felt / ideal", "wait_ratio", ".2f"),
                            ("tok/s", "tok_per_s", ".2f"), ("distinct experts", "distinct_experts", "d")])
    table = (f"O_DIRECT random slab reads: {disk['qd1_gbps']:.2f} GB/s at QD1, {disk['qd4_gbps']:.2f} GB/s at QD4 "
             f"({disk['slab_mb']:.2f} MB slabs)\n\n" + table)
    write_results(a.name, {"machine": machine_info(), "store": a.store, "disk": disk, "rows": rows,
                           "prompt_len": a.prompt_len, "tokens": a.tokens, "seed": a.seed}, table)
    return 0


def add_parser(bs) -> None:
    """Register `cache` under ``colibri bench``."""
    c = bs.add_parser("cache", help="streaming at several caps, cold, O_DIRECT")
    c.add_argument("--store", default="bench/work/1b-int8")
    c.add_argument("--caps", type=int, nargs="+", default=[8, 16, 32, 64])
    add_stream_flags(c, prompt_len=16, tokens=48)
    c.add_argument("--name", default="cache_1b")
    c.set_defaults(fn=cmd_cache)
