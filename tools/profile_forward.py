"""Where a forward pass spends its time: per kernel and per block, wall and process CPU.

Opens a store with every expert resident (cap = num_experts, all loaded before timing), runs
a prefill of ``--prompt`` tokens and ``--tokens`` single-token decode steps through
``model.forward`` (no sampler), and reports per token: wall ms and CPU ms (time.process_time,
all threads) of each kernel family (attention linears, lm_head, router, experts, attention
core, norms/rope, embeddings) and of the Python around them (block totals minus the kernels
inside). CPU time is the robust column on a shared machine.

    python tools/profile_forward.py --store /work/bigmodels/olmoe-1b-7b/olmoe-1b-7b-int4 --threads 1
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import kernels as KM  # noqa: E402
from engine.config import EngineConfig, ModelArgs  # noqa: E402
from engine.generate import Engine  # noqa: E402
from engine.models import base  # noqa: E402

STATS: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
_DEPTH = [0]


def _role(name: str, args, a: ModelArgs) -> str:
    if name.startswith("linears"):  # a LinearGroup (q / k / v in one call)
        return "attn_linear" if _DEPTH[0] else "other_linear"
    if name.startswith("linear"):
        O = args[2].shape[0] if args[1].ndim == 3 else args[1].shape[0]  # interleaved: the scales' rows
        if O == a.vocab_size:
            return "lm_head"
        if O == a.num_experts:
            return "router"
        return "attn_linear" if _DEPTH[0] else "other_linear"
    if name.startswith("expert"):
        return "experts"
    return name


def _timed(name, fn, a):
    @functools.wraps(fn)
    def run(*args):
        w0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args)
        finally:
            s = STATS["k:" + _role(name, args, a)]
            s[0] += time.perf_counter() - w0
            s[1] += time.process_time() - c0
            s[2] += 1
    return run


def _timed_method(obj, meth, key, depth=False):
    fn = getattr(obj, meth)

    @functools.wraps(fn)
    def run(*args, **kw):
        w0, c0 = time.perf_counter(), time.process_time()
        if depth:
            _DEPTH[0] += 1
        try:
            return fn(*args, **kw)
        finally:
            if depth:
                _DEPTH[0] -= 1
            s = STATS["b:" + key]
            s[0] += time.perf_counter() - w0
            s[1] += time.process_time() - c0
            s[2] += 1
    setattr(obj, meth, run)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    a_ = p.parse_args()
    args = ModelArgs.from_hf_config(Path(a_.store) / "config.json")
    E = args.num_experts
    store_gb = sum(f.stat().st_size for f in Path(a_.store).rglob("*") if f.is_file()) / 1e9
    eng = Engine.open(EngineConfig(store=a_.store, cap=E, pilot=0, pinning=False, history=False,
                                   o_direct=False, threads=a_.threads, ram_budget_gb=store_gb + 1.0,
                                   context_length=-(-(a_.prompt + a_.tokens + 40) // 256) * 256))
    try:
        for layer in range(args.num_moe_layers):
            eng.cache.load_experts(layer, np.arange(E))
        m = eng.model
        rng = np.random.default_rng(0)
        m.forward(rng.integers(0, args.vocab_size, 32), 0)  # JIT warm-up (T = 32, T = 1)
        m.forward(rng.integers(0, args.vocab_size, 1), 32)
        for name in ("linear_f32", "linear_f16", "linear_q8", "linear_q4", "linear_q4i", "linears_q8", "linears_q4",
                     "linears_q4i", "expert_f32", "expert_f16", "expert_q8", "expert_q4", "expert_q4i", "experts_q4_t1", "experts_q8_t1", "experts_q4_sorted", "combine_sorted", "combine_ranked", "attention", "rmsnorm", "rope", "embed_q8", "embed_q4"):
            setattr(base.K, name, _timed(name, getattr(KM, name), args))
        _timed_method(m, "attention", "attention", depth=True)
        _timed_method(m, "moe", "moe")
        _timed_method(m, "logits", "logits")
        for phase, T, n in (("prefill", a_.prompt, 1), ("decode", 1, a_.tokens)):
            STATS.clear()
            pos = 0 if phase == "prefill" else a_.prompt
            w0, c0 = time.perf_counter(), time.process_time()
            for s in range(n):
                m.forward(rng.integers(0, args.vocab_size, T), pos + s)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            ntok = T * n
            print(f"== {phase}: {ntok} tokens, {a_.threads} threads, store {Path(a_.store).name} "
                  f"({eng.store.quant}, dense {eng.store.dense_quant})")
            print(f"   total {1e3 * wall / ntok:.2f} ms wall, {1e3 * cpu / ntok:.2f} ms CPU per token "
                  f"-> {ntok / wall:.1f} tok/s, {ntok / cpu:.1f} tok/CPU-s")
            k = {kk[2:]: v for kk, v in STATS.items() if kk.startswith("k:")}
            b = {kk[2:]: v for kk, v in STATS.items() if kk.startswith("b:")}
            inner_att = sum(k.get(x, [0, 0])[1] for x in ("attn_linear", "attention", "rope"))
            inner_att_w = sum(k.get(x, [0, 0])[0] for x in ("attn_linear", "attention", "rope"))
            rows = sorted(k.items(), key=lambda kv: -kv[1][1])
            for name, (w, c, cnt) in rows:
                print(f"   {name:14s} {1e3 * w / ntok:7.2f} ms wall {1e3 * c / ntok:7.2f} ms CPU "
                      f"{100 * c / cpu:5.1f}%  calls/token {cnt / ntok:.1f}")
            if "attention" in b:
                w, c, _ = b["attention"]
                print(f"   {'py:attention':14s} {1e3 * (w - inner_att_w) / ntok:7.2f} ms wall "
                      f"{1e3 * (c - inner_att) / ntok:7.2f} ms CPU (attention block minus its kernels; "
                      f"includes its rmsnorm)")
            if "moe" in b:
                w, c, _ = b["moe"]
                kin = sum(k.get(x, [0, 0])[1] for x in ("experts", "router"))
                kin_w = sum(k.get(x, [0, 0])[0] for x in ("experts", "router"))
                print(f"   {'py:moe':14s} {1e3 * (w - kin_w) / ntok:7.2f} ms wall "
                      f"{1e3 * (c - kin) / ntok:7.2f} ms CPU (moe block minus experts/router; includes its rmsnorm)")
            tot_b = sum(b.get(x, [0, 0])[1] for x in ("attention", "moe", "logits"))
            print(f"   {'py:forward':14s} {1e3 * (cpu - tot_b) / ntok:7.2f} ms CPU (forward outside the blocks)")
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
