"""``colibri bench ...``: reproducible measurements, results as JSON plus a markdown table.

Protocol (the seeds' and colibri's benchmarking.md): compare arms in one run, interleaved;
every streaming arm is cold (a fresh engine; O_DIRECT so the page cache cannot serve experts);
random-weight models decode a fixed seeded token stream by teacher forcing and report the
distinct (layer, expert) pairs touched; hit rate, MB/token and felt wait come before wall
clock. Subcommands:

  make-synthetic  write a seeded random OLMoE checkpoint (presets: 1b, olmoe-1b-7b) + convert it
  decode          our decode tok/s vs transformers (bf16 and f32), all experts resident
  cache           streaming at several caps: hit rate, MB/token, felt wait, read service, tok/s
  pilot           PILOT A/B: each arm a fresh process, frozen heat restored, reps reversed
  disk            O_DIRECT read bandwidth of expert slabs (QD1 and QD4)
  gguf, peers     llama.cpp (Q8_0 GGUF) and transformers beside our engine, in cgroup memory
                  limits (engine/bench_peers.py)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

PRESETS = {
    # >= 1B parameters, OLMoE-shaped (issue 2/3 benchmarks): 1.14B params, 8 x 64 experts.
    "1b": dict(hidden_size=1024, intermediate_size=640, num_hidden_layers=8, num_attention_heads=16,
               num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
               max_position_embeddings=4096),
    # allenai/OLMoE-1B-7B's exact shape: 6.9B params, ~13.8 GB bf16.
    "olmoe-1b-7b": dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                        num_experts_per_tok=8, vocab_size=50304, max_position_embeddings=4096),
}


def machine_info() -> dict:
    import psutil
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "ram_gb": round(psutil.virtual_memory().total / 1e9, 1), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_results(name: str, data: dict, table: str, out_dir: str = "bench/results") -> Path:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    from .paths import atomic_write_text
    atomic_write_text(d / f"{name}.json", json.dumps(data, indent=1))
    atomic_write_text(d / f"{name}.md", table + "\n")
    print(table)
    return d / f"{name}.json"


def md_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """cols: (header, key, format)."""
    head = "| " + " | ".join(h for h, _, _ in cols) + " |"
    sep = "|" + "|".join("---" for _ in cols) + "|"
    lines = [head, sep]
    for r in rows:
        lines.append("| " + " | ".join(format(r[k], f) if r.get(k) is not None else "" for _, k, f in cols) + " |")
    return "\n".join(lines)


def forced_stream(vocab: int, n: int, seed: int) -> list[int]:
    """A fixed seeded random token stream (teacher forcing for random-weight models)."""
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab, n).tolist()


# --- make-synthetic ---------------------------------------------------------------------------

class PeakRss:
    """Samples this process's RSS every 50 ms in a thread; ``peak`` in bytes."""

    def __init__(self):
        import psutil
        self.p = psutil.Process()
        self.peak = self.p.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.p.memory_info().rss)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def cmd_make_synthetic(a) -> int:
    from .synthetic import olmoe_config, write_checkpoint
    from .config import ModelArgs
    cfg = olmoe_config(**PRESETS[a.preset])
    args = ModelArgs.from_dict(cfg)
    n_params = (args.dense_param_count() + args.num_hidden_layers * args.num_experts * 3
                * args.hidden_size * args.intermediate_size)
    need = n_params * 2 + n_params * 1.1  # bf16 checkpoint + int8 store
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if free < need * 1.05:
        print(f"not enough disk: need {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free at {out}", file=sys.stderr)
        return 2
    ck, st = out / f"{a.preset}-hf", out / f"{a.preset}-int8"
    res = {"preset": a.preset, "params": n_params, "machine": machine_info()}
    if not (ck / "config.json").exists() or a.force:
        t0 = time.perf_counter()
        with PeakRss() as pr:
            write_checkpoint(ck, cfg, seed=a.seed, dtype="bf16", shard_bytes=1 << 30)
        res["write_s"] = time.perf_counter() - t0
        res["write_peak_rss_gb"] = pr.peak / 1e9
        print(f"wrote {ck} ({n_params / 1e9:.2f} B params) in {res['write_s']:.0f} s, peak RSS {pr.peak / 1e9:.2f} GB")
    if not (st / "manifest.json").exists() or a.force:
        src_bytes = sum(f.stat().st_size for f in ck.glob("*.safetensors"))
        t0 = time.perf_counter()
        # A subprocess, so its peak RSS (ru_maxrss) is the converter's alone.
        subprocess.run([sys.executable, "-m", "engine.cli", "convert", str(ck), str(st), "--quant", a.quant,
                        "--overwrite"], check=True)
        dt = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        res.update(convert_s=dt, convert_mb_per_s=src_bytes / 1e6 / dt, convert_peak_rss_gb=peak / 1e9,
                   source_gb=src_bytes / 1e9)
        print(f"converted {src_bytes / 1e9:.2f} GB in {dt:.0f} s ({src_bytes / 1e6 / dt:.0f} MB/s), "
              f"converter peak RSS {peak / 1e9:.2f} GB")
        write_results(f"make_synthetic_{a.preset}", res, md_table([res], [
            ("preset", "preset", ""), ("params (B)", "params", ".3g"), ("convert s", "convert_s", ".0f"),
            ("MB/s", "convert_mb_per_s", ".0f"), ("converter peak RSS GB", "convert_peak_rss_gb", ".2f")]))
    return 0


# --- disk -------------------------------------------------------------------------------------

def measure_disk(store: str, n: int = 48, qd: int = 4, seed: int = 0) -> dict:
    """O_DIRECT random slab reads: GB/s at queue depth 1 and ``qd`` (threads)."""
    from .expert_store import ExpertStore
    st = ExpertStore(store, o_direct=True)
    L, E = st.args.num_hidden_layers, st.args.num_experts
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
    r = measure_disk(a.store, qd=a.qd)
    print(json.dumps(r, indent=1))
    return 0


# --- one streaming arm (also run as a fresh process by `bench pilot`) ---------------------------

def heldout_stream(path: str | Path) -> list[int]:
    """Token ids of a held-out file (JSON lines with an "ids" list each), concatenated: real
    text, so a trained model routes as it does on real input (teacher forced, never sampled)."""
    out: list[int] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.extend(json.loads(line)["ids"])
    return out


def run_arm(store: str, cfg_over: dict, prompt_len: int, tokens: int, seed: int,
            forced: bool = True, prompt_text: str | None = None, stream_file: str | None = None) -> dict:
    """Open a fresh engine with the overrides, decode, return the measured row.

    The decoded stream is: ``prompt_text`` (greedy answer to a real question), else the ids of
    ``stream_file`` (real held-out text, teacher forced), else ``forced_stream`` (seeded random
    ids, teacher forced)."""
    from .config import EngineConfig
    from .events import Finished, GenerateRequest, SamplingParams, StepMetrics
    from .generate import Engine
    from .prof import Profile
    over = {k: v for k, v in cfg_over.items() if k != "warm_all"}
    cfg = EngineConfig(store=store, **over).validated()
    t_open = time.perf_counter()
    eng = Engine.open(cfg)
    open_s = time.perf_counter() - t_open
    try:
        if cfg_over.get("warm_all"):
            # "All resident": every expert loaded before the first token (not counted).
            for layer in range(eng.args.num_hidden_layers):
                eng.cache.load_experts(layer, np.arange(eng.args.num_experts))
        V = eng.args.vocab_size
        if prompt_text is not None:  # a real question, in the model's chat template when it has one
            from .events import ChatMessage
            sp = SamplingParams(max_new_tokens=tokens)
            req = (GenerateRequest(messages=(ChatMessage("user", prompt_text),), sampling=sp)
                   if eng.has_chat_template else GenerateRequest(prompt=prompt_text, sampling=sp))
        else:
            stream = (heldout_stream(stream_file)[:prompt_len + tokens] if stream_file
                      else forced_stream(V, prompt_len + tokens, seed))
            if len(stream) < prompt_len + tokens:
                raise ValueError(f"{stream_file}: {len(stream)} tokens, need {prompt_len + tokens}")
            req = GenerateRequest(prompt_ids=tuple(stream[:prompt_len]),
                                  forced_ids=tuple(stream[prompt_len:]) if forced else None,
                                  sampling=SamplingParams(max_new_tokens=tokens))
        touched = np.zeros((eng.args.num_hidden_layers, eng.args.num_experts), bool)
        orig = eng.model.on_route

        def spy(layer, idx, logits):
            touched[layer, np.unique(idx)] = True
            orig(layer, idx, logits)
        eng.model.on_route = spy
        prof = Profile(eng)
        fin = None
        for ev in eng.generate(req):
            if isinstance(ev, StepMetrics):
                prof.add(ev)
            elif isinstance(ev, Finished):
                fin = ev
        steps = prof.steps
        recall = list(steps[-1].pilot_recall) if steps and steps[-1].pilot_recall else []
        # all-steps figures (prefill included; the decode-only ones follow below)
        n_all = max(len(steps), 1)
        look_all = sum(m.hits + m.misses for m in steps)
        dem_all = sum(m.demand_bytes for m in steps)
        spec_all = sum(m.speculative_bytes for m in steps)
        row = {**cfg_over, "hit_rate": sum(m.hits for m in steps) / look_all if look_all else 1.0,
               "pinned_hit_rate": sum(m.pinned_hits for m in steps) / look_all if look_all else 0.0,
               "mb_per_token": (dem_all + spec_all) / 1e6 / n_all, "demand_mb_per_token": dem_all / 1e6 / n_all,
               "spec_mb_per_token": spec_all / 1e6 / n_all, "felt_wait_s": sum(m.felt_wait_s for m in steps),
               "read_service_s": sum(m.read_service_s for m in steps), "tok_per_s": fin.decode_tok_per_s,
               "ttft_s": fin.ttft_s, "peak_rss_gb": max((m.rss_bytes for m in steps), default=0) / 1e9,
               "cap": eng.cache.cap,
               "tokens": fin.generated_tokens, "finish": fin.finish_reason, "error": fin.error,
               "distinct_experts": int(touched.sum()), "total_experts": int(touched.size),
               "o_direct": eng.store.o_direct, "open_s": open_s,
               "sha256_ids": hashlib.sha256(json.dumps(list(fin.token_ids)).encode()).hexdigest()[:16],
               "decode_s": (fin.generated_tokens - 1) / fin.decode_tok_per_s if fin.decode_tok_per_s else 0.0,
               "spec": {k: sum(getattr(m, k) for m in steps) for k in (
                   "spec_issued", "spec_completed", "spec_dropped_stale", "spec_dropped_guard",
                   "spec_dropped_full", "spec_used", "spec_wasted_bytes")},
               "pilot_recall": recall, "demand_bytes": sum(m.demand_bytes for m in steps)}
        # Decode only (steps after the first: the first covers the prompt's prefill and the
        # first token, where PILOT does not run); these are what tok/s and the ceiling compare.
        dec = steps[1:]
        n = max(len(dec), 1)
        look = sum(m.hits + m.misses for m in dec)
        row.update(
            decode_hit_rate=sum(m.hits for m in dec) / look if look else 1.0,
            decode_mb_per_token=sum(m.demand_bytes + m.speculative_bytes for m in dec) / 1e6 / n,
            decode_demand_mb_per_token=sum(m.demand_bytes for m in dec) / 1e6 / n,
            decode_spec_mb_per_token=sum(m.speculative_bytes for m in dec) / 1e6 / n,
            decode_felt_wait_s=sum(m.felt_wait_s for m in dec),
            decode_read_service_s=sum(m.read_service_s for m in dec))
        return row
    finally:
        eng.close()


def cmd_arm(a) -> int:
    """Internal: one arm in this (fresh) process; prints a JSON row."""
    row = run_arm(a.store, json.loads(a.config), a.prompt_len, a.tokens, a.seed,
                  prompt_text=a.prompt_text, stream_file=a.stream_file)
    print("ARM " + json.dumps(row))
    return 0


def _arm_subprocess(store, over, prompt_len, tokens, seed, prompt_text=None, stream_file=None) -> dict:
    cmd = [sys.executable, "-m", "engine.cli", "bench", "arm", "--store", store, "--config", json.dumps(over),
           "--prompt-len", str(prompt_len), "--tokens", str(tokens), "--seed", str(seed)]
    if prompt_text is not None:
        cmd += ["--prompt-text", prompt_text]
    if stream_file is not None:
        cmd += ["--stream-file", str(stream_file)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("ARM "):
            return json.loads(line[4:])
    raise RuntimeError(f"arm {over} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


# --- cache ------------------------------------------------------------------------------------

def cmd_cache(a) -> int:
    disk = measure_disk(a.store)
    bw = disk["qd4_gbps"] * 1e9
    rows = []
    for cap in a.caps:
        over = dict(cap=cap, pilot=0, pinning=False, history=False, o_direct=True)
        r = _arm_subprocess(a.store, over, a.prompt_len, a.tokens, a.seed)
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


# --- pilot A/B ----------------------------------------------------------------------------------

def cmd_pilot(a) -> int:
    """Arms: pilot 0-3 (x workers, x guard); each a fresh process with the same frozen heat."""
    from .heat import FILENAME
    heat = Path(a.store) / FILENAME
    arms = []
    for p in a.modes:
        for w in (a.workers if p > 0 else [1]):
            for g in ((True, False) if (p > 0 and a.guard_both) else (True,)):
                for sp in (a.spec_precision if p > 0 else [None]):
                    arm = dict(cap=a.cap, pilot=p, pilot_workers=w, evict_guard=g, o_direct=True,
                               pinning=bool(a.warm_heat), history=bool(a.warm_heat),
                               **({"policy": a.policy} if a.policy else {}))
                    if sp is not None:  # the gate only exists with PILOT on
                        arm["spec_precision"] = sp
                    arms.append(arm)
    _check_arm_inputs(a.store, arms, a.stream_file, a.prompt_len + a.tokens)
    frozen = None
    if a.warm_heat:
        # Build the frozen heat once: one run with history on, pinning off.
        heat.unlink(missing_ok=True)
        _arm_subprocess(a.store, dict(cap=a.cap, pilot=0, pinning=True, history=True), a.prompt_len,
                        a.tokens, a.seed + 1, a.prompt_text, a.stream_file)
        frozen = heat.read_bytes()

    rows = []
    order = []
    for rep in range(a.reps):
        seq = arms if rep % 2 == 0 else list(reversed(arms))
        for over in seq:
            if frozen is not None:
                from .paths import atomic_write_bytes
                atomic_write_bytes(heat, frozen)
            elif heat.exists():
                heat.unlink()
            r = _arm_subprocess(a.store, over, a.prompt_len, a.tokens, a.seed, a.prompt_text, a.stream_file)
            r["rep"] = rep
            rows.append(r)
            order.append(over)
            print(f"rep {rep} pilot {over['pilot']} w{over['pilot_workers']} guard {over['evict_guard']} "
                  f"gate {over.get('spec_precision', '-')}: decode "
                  f"hit {100 * r['decode_hit_rate']:.1f}% {r['decode_mb_per_token']:.2f} MB/t "
                  f"felt {r['decode_felt_wait_s']:.3f}s "
                  f"{r['tok_per_s']:.2f} tok/s sha {r['sha256_ids']}", flush=True)
    if frozen is not None:
        heat.unlink(missing_ok=True)
    table = md_table(rows, [("rep", "rep", "d"), ("pilot", "pilot", "d"), ("workers", "pilot_workers", "d"),
                            ("guard", "evict_guard", ""), ("gate", "spec_precision", ".2f"),
                            ("hit %", "decode_hit_rate", ".1%"),
                            ("MB/token", "decode_mb_per_token", ".2f"), ("spec MB/t", "decode_spec_mb_per_token", ".2f"),
                            ("felt wait s", "decode_felt_wait_s", ".3f"), ("tok/s", "tok_per_s", ".2f"),
                            ("all-steps hit %", "hit_rate", ".1%"), ("all-steps felt s", "felt_wait_s", ".3f"),
                            ("sha256(ids)", "sha256_ids", "")])
    # Per arm (pilot, workers, guard): medians over the repetitions, and the ratios to pilot 0.
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["pilot"], r["pilot_workers"], r["evict_guard"], r.get("spec_precision")), []).append(r)
    summ = []
    for (p_, w_, g_, sp_), rs in groups.items():
        summ.append({"pilot": p_, "pilot_workers": w_, "evict_guard": g_, "spec_precision": sp_,
                     **{k: float(np.median([x[k] for x in rs])) for k in (
                         "decode_hit_rate", "decode_mb_per_token", "decode_felt_wait_s", "tok_per_s")},
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
        ("felt wait s", "decode_felt_wait_s", ".3f"), ("tok/s", "tok_per_s", ".2f"),
        ("felt vs p0", "felt_vs_p0", "+.0%"), ("MB/t vs p0", "mb_vs_p0", "+.0%"), ("tok/s vs p0", "tps_vs_p0", "+.0%"),
        ("recall per layer (1..L-1)", "recall", "")])
    table = ("Decode-only columns: the first step (the prompt's prefill and first token, where PILOT does not "
             "run) is excluded; all-steps columns include it.\n\n" + table)
    shas = {r["sha256_ids"] for r in rows}
    table += f"\n\nDistinct generated-id hashes across all arms: {len(shas)} (1 = byte-identical)."
    write_results(a.name, {"machine": machine_info(), "store": a.store, "rows": rows, "summary": summ,
                           "cap": a.cap, "prompt_len": a.prompt_len, "tokens": a.tokens,
                           "prompt_text": a.prompt_text, "stream_file": a.stream_file}, table)
    return 0


# --- decode matrix (issue: benchmarks at real scale) -----------------------------------------------

def cmd_matrix(a) -> int:
    """RAM budget x PILOT mode x workers on one store, every cell a fresh process, cold, O_DIRECT.

    The I/O-bound ceiling of a cell is 1 / max(compute s/token, demand bytes/token / disk B/s):
    compute s/token is the all-resident pilot-0 cell's decode time per token (no I/O at all),
    disk B/s the O_DIRECT slab bandwidth measured at queue depth ``--qd`` before the cells.
    """
    budgets = [None if b in ("all", "0") else float(b) for b in a.budgets]
    _check_arm_inputs(a.store, [dict(pilot=p, pilot_workers=w, context_length=a.context)
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
                r = _arm_subprocess(a.store, over, a.prompt_len, a.tokens, a.seed)
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


# --- decode vs transformers ----------------------------------------------------------------------

def _decode_ours(store: str, prompt: list, forced: list, tokens: int) -> dict:
    """Our engine, all experts resident: decode/prefill tok/s, bytes/token, time outside numba."""
    from .config import EngineConfig
    from .events import Finished, GenerateRequest, SamplingParams
    from .generate import Engine
    from . import model as model_mod
    eng = Engine.open(EngineConfig(store=store, pilot=0, pinning=False, history=False, o_direct=False))
    args = eng.args
    try:
        def once():
            eng._kv_ids = []  # no prefix reuse: measure the whole prefill
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
            for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
                lin = ly[k]
                per_layer += lin.w.nbytes + (lin.s.nbytes if lin.s is not None else 0)
            per_layer += ly["router"].nbytes
        lm = eng.model.lm_head
        bytes_per_token = (per_layer + lm.w.nbytes + (lm.s.nbytes if lm.s is not None else 0)
                           + args.num_hidden_layers * args.num_experts_per_tok * eng.store.layout["data_bytes"])
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
    from .config import ModelArgs
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


def cmd_replay(a) -> int:
    """Replay a trace (``colibri run --trace``) through LRU, LFRU, our policy and Belady."""
    from .trace import load_trace, replay_all
    head, recs = load_trace(a.trace)
    caps = a.caps or list(range(1, head["num_experts"] + 1))
    rows = replay_all(a.trace, caps)
    ours = f"ours ({head.get('policy', 'lru')} + pinning)"
    table = md_table(rows, [("cap", "cap", "d"), ("LRU", "lru", ".1%"), ("LFRU", "lfru", ".1%"),
                            ("EMA", "ema", ".1%"), (ours, "ours", ".1%"), ("Belady", "belady", ".1%")])
    write_results(a.name, {"trace": str(a.trace), "rows": rows, "num_experts": head["num_experts"],
                           "top_k": head["top_k"], "policy": head.get("policy", "lru"),
                           "records": sum(1 for r in recs if "l" in r)}, table)
    return 0


def cmd_trace_heldout(a) -> int:
    """Record a routing trace of the trained default model over its held-out text.

    Each held-out sequence (``heldout_sample.jsonl`` next to the checkpoint) is a real chat or
    source excerpt: the part up to the first assistant marker (or its first 16 tokens) is the
    prompt, the rest is teacher forced, so the routing is the model's real routing on text it
    never trained on. All sequences run in one engine session, like a user's chats; pinning on,
    history off, PILOT 1 (its predictions go into the trace).
    """
    from .config import EngineConfig
    from .default_model import default_model_dir, default_store
    from .events import Finished, GenerateRequest, SamplingParams
    from .generate import Engine
    from .trace import TraceRecorder
    src = Path(a.model_dir) if a.model_dir else default_model_dir()
    store = a.store or str(default_store())
    seqs = [json.loads(x)["ids"] for x in (src / "heldout_sample.jsonl").read_text().splitlines() if x.strip()]
    seqs = seqs[:a.sequences]
    cfg = EngineConfig(store=store, cap=a.cap or None, pilot=1, pinning=True, history=False).validated()
    with Engine.open(cfg) as eng:
        rec = TraceRecorder(eng)
        marker = eng.tokenizer.token_to_id("<|assistant|>")
        n_tok = 0
        for ids in seqs:
            ids = ids[:eng.args.max_position_embeddings - 1]
            cut = ids.index(marker) + 2 if marker is not None and marker in ids[:-3] else min(16, len(ids) - 1)
            req = GenerateRequest(prompt_ids=tuple(ids[:cut]), forced_ids=tuple(ids[cut:]),
                                  sampling=SamplingParams(max_new_tokens=len(ids) - cut))
            for ev in eng.generate(req):
                if isinstance(ev, Finished):
                    if ev.finish_reason == "error":
                        raise RuntimeError(ev.error)
                    n_tok += ev.generated_tokens
        rec.save(a.out)
        recall = eng.pilot.recall() if eng.pilot is not None else []
    print(f"trace of {len(seqs)} held-out sequences ({n_tok} decoded tokens) -> {a.out}; "
          f"PILOT=1 recall per layer: {' '.join(f'{r:.2f}' for r in recall)}")
    return 0


def _budget_arg(v: str) -> str:
    if v == "all":
        return v
    try:
        if float(v) > 0:
            return v
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{v!r}: a RAM budget in GB (> 0) or 'all'")


def _check_arm_inputs(store: str, arms: list[dict], stream_file: str | None, need_tokens: int) -> None:
    """Refuse bad bench inputs in the parent, before any arm process starts.

    Raises:
        ValueError / ConfigError: naming the store, the stream file or the setting.
    """
    from .config import EngineConfig
    if not (Path(store) / "manifest.json").is_file():
        raise ValueError(f"--store {store}: not a converted store (no manifest.json); "
                         f"make one with `colibri convert HF_FOLDER STORE`")
    for over in arms:
        EngineConfig(store=store, **{k: v for k, v in over.items() if k != "warm_all"}).validated()
    if stream_file is not None:
        try:
            n = len(heldout_stream(stream_file))
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--stream-file {stream_file}: cannot read it ({e.__class__.__name__})") from None
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--stream-file {stream_file}: expected JSON lines with an 'ids' list of "
                             f"token ids each (like a model's heldout_sample.jsonl)") from None
        if n < need_tokens:
            raise ValueError(f"--stream-file {stream_file}: {n} tokens, the run needs {need_tokens} "
                             f"(prompt + tokens)")


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks (JSON + markdown in bench/results/)")
    # every bench command shows its defaults in --help
    bs = b.add_subparsers(dest="bench_cmd", required=True, parser_class=functools.partial(
        argparse.ArgumentParser, formatter_class=argparse.ArgumentDefaultsHelpFormatter))

    m = bs.add_parser("make-synthetic", help="write + convert a seeded random OLMoE-shaped model")
    m.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    m.add_argument("--out", default="bench/work")
    m.add_argument("--quant", default="int8")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--force", action="store_true")
    m.set_defaults(fn=cmd_make_synthetic)

    d = bs.add_parser("decode", help="decode tok/s vs transformers, all experts resident")
    d.add_argument("--store", default="bench/work/1b-int8")
    d.add_argument("--checkpoint", default="bench/work/1b-hf")
    d.add_argument("--prompt-len", type=int, default=32)
    d.add_argument("--tokens", type=int, default=64)
    d.add_argument("--reps", type=int, default=3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-transformers", action="store_true")
    d.add_argument("--name", default="decode_1b")
    d.set_defaults(fn=cmd_decode)

    da = bs.add_parser("decode-arm", help=argparse.SUPPRESS)
    da.add_argument("--system", required=True)
    da.add_argument("--store", required=True)
    da.add_argument("--checkpoint", required=True)
    da.add_argument("--prompt-len", type=int, default=32)
    da.add_argument("--tokens", type=int, default=64)
    da.add_argument("--seed", type=int, default=0)
    da.set_defaults(fn=cmd_decode_arm)

    c = bs.add_parser("cache", help="streaming at several caps, cold, O_DIRECT")
    c.add_argument("--store", default="bench/work/1b-int8")
    c.add_argument("--caps", type=int, nargs="+", default=[8, 16, 32, 64])
    c.add_argument("--prompt-len", type=int, default=16)
    c.add_argument("--tokens", type=int, default=48)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--name", default="cache_1b")
    c.set_defaults(fn=cmd_cache)

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
    p.add_argument("--policy", default=None, help="cache policy of every arm (default: the engine default)")
    p.add_argument("--warm-heat", action="store_true", help="freeze a heat file from one warm-up run, restore per arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="pilot_1b")
    p.set_defaults(fn=cmd_pilot)

    k = bs.add_parser("disk", help="O_DIRECT slab read bandwidth")
    k.add_argument("--store", default="bench/work/1b-int8")
    k.add_argument("--qd", type=int, default=4)
    k.set_defaults(fn=cmd_disk)

    q = bs.add_parser("replay", help="replay a routing trace: LRU, LFRU, EMA, ours, Belady per cap")
    q.add_argument("trace")
    q.add_argument("--cap", dest="caps", type=int, nargs="*", default=None, help="caps (default 1..num_experts)")
    q.add_argument("--name", default="replay")
    q.set_defaults(fn=cmd_replay)

    mx = bs.add_parser("matrix", help="RAM budget x PILOT x workers, cold, O_DIRECT, with the I/O-bound ceiling")
    mx.add_argument("--store", default="bench/work/olmoe-1b-7b-int8")
    mx.add_argument("--budgets", nargs="+", type=_budget_arg, default=["2", "4", "8", "all"],
                    help="GB, or 'all' (all resident)")
    mx.add_argument("--modes", type=int, nargs="+", default=[0, 1, 2, 3])
    mx.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    mx.add_argument("--reps", type=int, default=1)
    mx.add_argument("--prompt-len", type=int, default=16)
    mx.add_argument("--tokens", type=int, default=32)
    mx.add_argument("--qd", type=int, default=4)
    mx.add_argument("--context", type=int, default=512, help="KV cache length (tokens) of every cell")
    mx.add_argument("--seed", type=int, default=0)
    mx.add_argument("--name", default="matrix_olmoe_1b_7b")
    mx.set_defaults(fn=cmd_matrix)

    th = bs.add_parser("trace-heldout", help="routing trace of the default model over its held-out text")
    th.add_argument("--model-dir", default=None, help="checkpoint folder with heldout_sample.jsonl (default: bundled)")
    th.add_argument("--store", default=None, help="converted store of it (default: the bundled model's)")
    th.add_argument("--sequences", type=int, default=64)
    th.add_argument("--cap", type=int, default=0, help="cap while recording (0 = auto)")
    th.add_argument("--out", default="bench/work/trace_default.jsonl")
    th.set_defaults(fn=cmd_trace_heldout)

    r = bs.add_parser("arm", help=argparse.SUPPRESS)
    r.add_argument("--store", required=True)
    r.add_argument("--config", required=True)
    r.add_argument("--prompt-len", type=int, default=16)
    r.add_argument("--tokens", type=int, default=48)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--prompt-text", default=None)
    r.add_argument("--stream-file", default=None)
    r.set_defaults(fn=cmd_arm)

    from .bench_peers import add_peers_parsers
    add_peers_parsers(bs)
    __import__(__package__ + ".bench_kernels", fromlist=["add_parser"]).add_parser(bs)
