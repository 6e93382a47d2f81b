"""``colibri bench decode``: our decode tok/s vs transformers (bf16 and f32), all experts
resident; each system in its own fresh process (``bench decode-arm``, hidden)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .common import add_stream_flags, forced_stream, machine_info, md_table, write_results


def _decode_ours(store: str, prompt: list, forced: list, tokens: int) -> dict:
    """Our engine, all experts resident: decode/prefill tok/s, bytes/token, time outside numba."""
    from ..config import EngineConfig
    from ..events import Finished, GenerateRequest, SamplingParams
    from ..generate import Engine
    from ..models import base as model_mod
    eng = Engine.open(EngineConfig(store=store, pilot=0, pinning=False, history=False, o_direct=False,
                                   speculation="off"))  # forced ids: one forward a token
    args = eng.args
    try:
        def once():
            eng.forget_prefix()  # no prefix reuse: measure the whole prefill
            req = GenerateRequest(prompt_ids=tuple(prompt), forced_ids=tuple(forced),
                                  sampling=SamplingParams(max_new_tokens=tokens))
            return [e for e in eng.generate(req) if isinstance(e, Finished)][0]
        once()  # JIT warm-up; loads every routed expert (the cache holds all of them)
        fin = once()
        # share of decode time spent outside numba kernels: wrap every kernel with a timer
        K = model_mod.K
        names = [n for n in dir(K) if hasattr(getattr(K, n), "py_func")]
        saved = {n: getattr(K, n) for n in names}
        inside = [0.0]

        def wrap(f):
            def g(*a):
                t0 = time.perf_counter()
                r = f(*a)
                inside[0] += time.perf_counter() - t0
                return r
            return g
        for n in names:
            setattr(K, n, wrap(saved[n]))
        fin2 = once()
        for n in names:
            setattr(K, n, saved[n])
        total = fin2.ttft_s + (fin2.generated_tokens - 1) / max(fin2.decode_tok_per_s, 1e-9)
        per_layer = 0
        for ly in eng.model.layers:
            # the token mixer's matrices: attention, or a linear-attention layer's (Qwen3-Next)
            for k in ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                      "in_proj_a", "out_proj"):
                lin = ly.get(k)
                if lin is not None:
                    per_layer += lin.w.nbytes + (lin.s.nbytes if lin.s is not None else 0)
            # MoE layers read their router; dense MLP layers and shared experts their whole MLP
            per_layer += ly["router"].nbytes if "router" in ly else 0
            for k in ("mlp", "shared_expert"):
                per_layer += sum(v.nbytes for v in (ly.get(k) or {}).values())
        lm = eng.model.lm_head
        bytes_per_token = (per_layer + lm.w.nbytes + (lm.s.nbytes if lm.s is not None else 0)
                           + args.num_moe_layers * args.num_experts_per_tok * eng.store.layout["data_bytes"])
        return {"decode_tok_per_s": fin.decode_tok_per_s, "prefill_tok_per_s": fin.prefill_tok_per_s,
                "weight_bytes_per_token": bytes_per_token, "outside_numba_share": 1 - inside[0] / total,
                "resident_experts": int((eng.cache.residency() > 0).sum())}
    finally:
        eng.close()

def _decode_hf(checkpoint: str, dtype: str, prompt: list, forced: list) -> dict:
    import torch
    from transformers import OlmoeForCausalLM
    torch.set_num_threads(os.cpu_count() or 2)
    m = OlmoeForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()

    def once():
        with torch.no_grad():
            t0 = time.perf_counter()
            out = m(torch.tensor([prompt]), use_cache=True)
            t_pre = time.perf_counter() - t0
            past = out.past_key_values
            t0 = time.perf_counter()
            for t in forced[:-1]:
                out = m(torch.tensor([[t]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            return (len(forced) - 1) / (time.perf_counter() - t0), len(prompt) / t_pre
    once()
    d, p = once()
    return {"decode_tok_per_s": d, "prefill_tok_per_s": p}

def cmd_decode_arm(a) -> int:
    """Internal: one system of `bench decode` in this (fresh) process."""
    from ..config import ModelArgs
    args = ModelArgs.from_hf_config(Path(a.store) / "config.json")
    stream = forced_stream(args.vocab_size, a.prompt_len + a.tokens, a.seed)
    prompt, forced = stream[:a.prompt_len], stream[a.prompt_len:]
    if a.system == "ours":
        r = _decode_ours(a.store, prompt, forced, a.tokens)
    else:
        r = _decode_hf(a.checkpoint, a.system.split("-")[1], prompt, forced)
    print("ARM " + json.dumps(r))
    return 0

def _numpy_bandwidth() -> float:
    a = np.ones(256 << 20, dtype=np.uint8)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        a.max()  # reads every byte once
        best = max(best, a.nbytes / (time.perf_counter() - t0))
    return best

def cmd_decode(a) -> int:
    """Each system in its own fresh process (two OpenMP runtimes in one process fight for the
    cores), interleaved, ``reps`` rounds; medians reported."""
    systems = ["ours"] + ([] if a.no_transformers else ["hf-bfloat16", "hf-float32"])
    rows = []
    for rep in range(a.reps):
        for sysname in (systems if rep % 2 == 0 else list(reversed(systems))):
            cmd = [sys.executable, "-m", "engine.cli", "bench", "decode-arm", "--system", sysname,
                   "--store", a.store, "--checkpoint", a.checkpoint, "--prompt-len", str(a.prompt_len),
                   "--tokens", str(a.tokens), "--seed", str(a.seed)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = next((x for x in p.stdout.splitlines() if x.startswith("ARM ")), None)
            if line is None:
                print(f"{sysname} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                continue
            r = {"system": sysname, "rep": rep, **json.loads(line[4:])}
            rows.append(r)
            print(f"rep {rep} {sysname}: decode {r['decode_tok_per_s']:.2f} tok/s, prefill "
                  f"{r['prefill_tok_per_s']:.1f} tok/s", flush=True)

    def med(name, key):
        v = [r[key] for r in rows if r["system"] == name and key in r]
        return float(np.median(v)) if v else None
    bw = _numpy_bandwidth()
    ours = med("ours", "decode_tok_per_s")
    bpt = med("ours", "weight_bytes_per_token")
    summary = {
        "ours_decode_tok_per_s": ours, "ours_prefill_tok_per_s": med("ours", "prefill_tok_per_s"),
        "hf_bf16_decode_tok_per_s": med("hf-bfloat16", "decode_tok_per_s"),
        "hf_f32_decode_tok_per_s": med("hf-float32", "decode_tok_per_s"),
        "hf_bf16_prefill_tok_per_s": med("hf-bfloat16", "prefill_tok_per_s"),
        "weight_bytes_per_token": bpt, "numpy_read_gbps": bw / 1e9,
        "achieved_gbps": bpt * ours / 1e9 if ours and bpt else None,
        "bandwidth_fraction": bpt * ours / bw if ours and bpt else None,
        "outside_numba_share": med("ours", "outside_numba_share"),
    }
    if summary["hf_bf16_decode_tok_per_s"] and ours:
        summary["speedup_vs_hf_bf16"] = ours / summary["hf_bf16_decode_tok_per_s"]
    if summary["hf_f32_decode_tok_per_s"] and ours:
        summary["speedup_vs_hf_f32"] = ours / summary["hf_f32_decode_tok_per_s"]
    table = md_table(rows, [("system", "system", ""), ("rep", "rep", "d"), ("decode tok/s", "decode_tok_per_s", ".2f"),
                            ("prefill tok/s", "prefill_tok_per_s", ".1f")])
    table += "\n\n" + "\n".join(f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}"
                                 for k, v in summary.items() if v is not None)
    write_results(a.name, {"machine": machine_info(), "store": a.store, "checkpoint": a.checkpoint, "rows": rows,
                           "summary": summary, "prompt_len": a.prompt_len, "tokens": a.tokens}, table)
    return 0


def add_parser(bs) -> None:
    """Register `decode`, `decode-arm` under ``colibri bench``."""
    d = bs.add_parser("decode", help="decode tok/s vs transformers, all experts resident")
    d.add_argument("--store", default="bench/work/1b-int8")
    d.add_argument("--checkpoint", default="bench/work/1b-hf")
    add_stream_flags(d, prompt_len=32, tokens=64)
    d.add_argument("--reps", type=int, default=3)
    d.add_argument("--no-transformers", action="store_true")
    d.add_argument("--name", default="decode_1b")
    d.set_defaults(fn=cmd_decode)

    da = bs.add_parser("decode-arm")  # internal (hidden from the verb list)
    da.add_argument("--system", required=True)
    da.add_argument("--store", required=True)
    da.add_argument("--checkpoint", required=True)
    add_stream_flags(da, prompt_len=32, tokens=64)
    da.set_defaults(fn=cmd_decode_arm)
