"""Microbenchmark of a decode step's cache lookup: ExpertCache.take_split + release_slots of
num_experts_per_tok resident experts (the all-resident path), best of 7 x 4096 calls, in us.

    python tools/micro_take.py STORE

STORE: any converted store (every expert is loaded first, so keep it small: e.g. a 16-layer x
64-expert int4 store of hidden 256 made with engine.bench.synthetic.olmoe_config + write_checkpoint
and engine.convert_checkpoint). Run two versions of the engine alternately to compare.
"""
import sys
import time

import numpy as np

from engine.config import EngineConfig, ModelArgs
from engine.generate import Engine


def main(store: str) -> None:
    args = ModelArgs.from_hf_config(store + "/config.json")
    E, L, k = args.num_experts, args.num_moe_layers, args.num_experts_per_tok
    eng = Engine.open(EngineConfig(store=store, cap=E, pilot=0, pinning=False, history=False, o_direct=False,
                                   threads=1, context_length=256))
    try:
        c = eng.cache
        for layer in range(L):
            c.load_experts(layer, np.arange(E))
        rng = np.random.default_rng(0)
        sets = [np.sort(rng.choice(E, k, replace=False)).astype(np.int64) for _ in range(256)]
        best = float("inf")
        for _ in range(7):
            t = time.perf_counter()
            for i in range(4096):
                _, slots, _ = c.take_split(i % L, sets[i % 256])
                c.release_slots(i % L, slots)
            best = min(best, (time.perf_counter() - t) / 4096)
        print(f"take_split + release_slots of {k} resident experts: {best * 1e6:.2f} us (best of 7 x 4096)")
    finally:
        eng.close()


if __name__ == "__main__":
    main(sys.argv[1])
