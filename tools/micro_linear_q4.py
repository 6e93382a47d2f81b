"""Microbenchmark of the int4 matrix kernel (K.linear_q4i, the interleaved layout the expert
stores use) at a few token counts and thread counts: best of ``--reps`` passes over 16 random
matrices of each shape, reported as microseconds per matrix, G multiply-adds per second and GB/s
of packed weights.

    python tools/micro_linear_q4.py [--shapes 1024x2048 2048x1024] [--tokens 1 16 128]
                                    [--threads 1 2] [--reps 5]

The matrices (16 x 1-2 MB by default) fit this machine's L3 cache, so T = 1 measures the
kernel rather than DRAM; T > 1 measures the register tiles (compute-bound). Used to compare
kernel changes in one session (run the old and the new tree one after the other, twice).
"""
import argparse
import time

import numba
import numpy as np

from engine import kernels as K
from engine.quant import interleave_q4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["1024x2048", "2048x1024"],
                    help="OxN: output rows x input columns (N a multiple of 64, O of 4)")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    for th in a.threads:
        numba.set_num_threads(th)
        for shape in a.shapes:
            O, N = (int(v) for v in shape.lower().split("x"))
            mats = []
            for _ in range(16):
                w = rng.integers(0, 256, (O, N // 2), dtype=np.uint8)
                s = (rng.random((O, N // 32), dtype=np.float32) * 0.01 + 0.001).astype(np.float16).view(np.uint16)
                mats.append((interleave_q4(w), s))
            for T in a.tokens:
                x = rng.standard_normal((T, N), dtype=np.float32)
                out = np.empty((T, O), np.float32)
                K.linear_q4i(x, *mats[0], 32, out)  # compile / warm
                best = float("inf")
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    for w, s in mats:
                        K.linear_q4i(x, w, s, 32, out)
                    best = min(best, (time.perf_counter() - t0) / len(mats))
                print(f"threads {th}  [{O}, {N}]  T={T:<4d} {best * 1e6:8.0f} us  "
                      f"{T * O * N / best / 1e9:6.1f} GMAC/s  {O * N / 2 / best / 1e9:5.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
