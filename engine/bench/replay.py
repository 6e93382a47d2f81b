"""``colibri bench replay``: replay a routing trace (``colibri run --trace``) through every
registered cache policy (LRU, LFRU, EMA...), our policy and Belady, per cap."""

from __future__ import annotations

from .common import md_table, write_results


def cmd_replay(a) -> int:
    """Replay a trace (``colibri run --trace``) through LRU, LFRU, our policy and Belady."""
    from ..trace import load_trace, replay_all
    head, recs = load_trace(a.trace)
    caps = a.caps or list(range(1, head["num_experts"] + 1))
    rows = replay_all(a.trace, caps)
    ours = f"ours ({head.get('policy', 'lru')} + pinning)"
    from ..cache.registry import POLICY_CLASSES
    table = md_table(rows, [("cap", "cap", "d")] + [(n.upper(), n, ".1%") for n in POLICY_CLASSES]
                     + [(ours, "ours", ".1%"), ("Belady", "belady", ".1%")])
    write_results(a.name, {"trace": str(a.trace), "rows": rows, "num_experts": head["num_experts"],
                           "top_k": head["top_k"], "policy": head.get("policy", "lru"),
                           "records": sum(1 for r in recs if "l" in r)}, table)
    return 0


def add_parser(bs) -> None:
    """Register `replay` under ``colibri bench``."""
    q = bs.add_parser("replay", help="replay a routing trace: LRU, LFRU, EMA, ours, Belady per cap")
    q.add_argument("trace")
    q.add_argument("--cap", dest="caps", type=int, nargs="*", default=None, help="caps (default 1..num_experts)")
    q.add_argument("--name", default="replay")
    q.set_defaults(fn=cmd_replay)
