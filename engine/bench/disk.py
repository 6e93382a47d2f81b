"""``colibri bench disk``: O_DIRECT read bandwidth of expert slabs (QD1 and QD4)."""

from __future__ import annotations

import json
import random
import threading
import time


def measure_disk(store: str, n: int = 48, qd: int = 4, seed: int = 0) -> dict:
    """O_DIRECT random slab reads: GB/s at queue depth 1 and ``qd`` (threads)."""
    from ..expert_store import ExpertStore
    st = ExpertStore(store, o_direct=True)
    L, E = st.args.num_moe_layers, st.args.num_experts  # expert rows = MoE layers
    rng = random.Random(seed)
    picks = [(rng.randrange(L), rng.randrange(E)) for _ in range(n * 2)]
    out = {"o_direct": st.o_direct, "slab_mb": st.slot_bytes / 1e6}
    for depth, items in ((1, picks[:n]), (qd, picks[n:])):
        bufs = [st.new_buffer() for _ in range(depth)]
        it = iter(items)
        lock = threading.Lock()

        def worker(buf):
            while True:
                with lock:
                    x = next(it, None)
                if x is None:
                    return
                st.read(x[0], x[1], buf)
        t0 = time.perf_counter()
        ths = [threading.Thread(target=worker, args=(b,)) for b in bufs]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        dt = time.perf_counter() - t0
        out[f"qd{depth}_gbps"] = len(items) * st.slot_bytes / dt / 1e9
    st.close()
    return out

def cmd_disk(a) -> int:
    """Print measure_disk's GB/s at QD1 and ``--qd`` as JSON."""
    r = measure_disk(a.store, qd=a.qd)
    print(json.dumps(r, indent=1))
    return 0


def add_parser(bs) -> None:
    """Register `disk` under ``colibri bench``."""
    k = bs.add_parser("disk", help="O_DIRECT slab read bandwidth")
    k.add_argument("--store", default="bench/work/1b-int8")
    k.add_argument("--qd", type=int, default=4)
    k.set_defaults(fn=cmd_disk)
