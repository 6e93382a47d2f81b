"""One streaming arm: a fresh engine with setting overrides decodes a stream and reports hit
rate, MB/token, felt wait, tok/s. ``bench cache``, ``pilot`` and ``matrix`` run each arm in a
fresh process (``colibri bench arm``, hidden) so every arm starts cold."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

from ..observers import Observer
from ..ram_budget import release_compiler_memory
from .common import BENCH_KEYS, add_stream_flags, forced_stream, heldout_stream


class TouchedExperts(Observer):
    """Observer: which (MoE layer, expert) pairs the routing has selected (mask bool [M, E]),
    and a digest of every routing decision in call order (``digest()``: sha256 of each call's
    layer and int64 top-k ids [T, K]), so two cells can be compared call by call, not only by
    how many experts they touched.

    Token-batched (Observer.token_batched): it only records, and grouped routing comes in the
    same layer order, so the digest is the same; without the flag every arm's decode steps
    took the per-layer path instead of the product's one-call step, so the benchmarks would
    not measure the product's decode."""

    token_batched = True

    def __init__(self, num_moe_layers: int, num_experts: int):
        self.mask = np.zeros((num_moe_layers, num_experts), bool)
        self._h = hashlib.sha256()
        self.calls = 0

    def on_route(self, layer: int, idx: np.ndarray, router_logits: np.ndarray) -> None:
        self.mask[layer, np.unique(idx)] = True
        self._h.update(np.int64(layer).tobytes() + np.ascontiguousarray(idx, np.int64).tobytes())
        self.calls += 1

    def digest(self) -> str:
        """First 16 hex digits of the routing digest so far."""
        return self._h.hexdigest()[:16]


def code_version() -> dict:
    """Which engine this process imported: its folder and, when it is a git work tree, the
    commit and whether files were modified (a results row then says what code produced it)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = {"engine": str(root / "engine"), "commit": None, "dirty": None}
    try:
        c = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        d = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "engine"],
                           capture_output=True, text=True, timeout=10)
        if c.returncode == 0:
            out.update(commit=c.stdout.strip(), dirty=bool(d.stdout.strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def run_arm(store: str, cfg_over: dict, prompt_len: int, tokens: int, seed: int,
            forced: bool = True, prompt_text: str | None = None, stream_file: str | None = None) -> dict:
    """Open a fresh engine with the overrides, decode, return the measured row.

    The decoded stream is: ``prompt_text`` (greedy answer to a real question), else the ids of
    ``stream_file`` (real held-out text, teacher forced), else ``forced_stream`` (seeded random
    ids, teacher forced).

    With the setting ``reserve_cache`` the arm waits for the cache's memory to be faulted in
    before the first token (``populate_s``, not counted).

    Bench-only overrides (not engine settings): ``warm_all`` (every expert loaded before the
    first token), ``routing_trace`` (a logits trace: the model's routing and PILOT's
    predictions are replayed from it, ``engine.trace.RecordedRouting``; "realistic routing"),
    ``routing_seed`` (its permutation seed, default 0), ``idle_s`` (seconds the engine sits
    idle after open and the populate wait, before the first token: a user typing; the idle fill
    runs meanwhile). ``resident_at_start``: experts resident at the first token.

    Output identity: ``sha256_ids`` hashes the emitted ids (under teacher forcing those are the
    forced ones), ``sha256_logits`` the float32 logits of every forward: the check that
    placement changed no value. CPU: ``decode_cpu_s`` is this process's user + system CPU time
    over the decode steps (rusage), ``decode_wall_s`` their wall time."""
    from ..config import EngineConfig
    from ..events import PINNED, RESIDENT, Finished, GenerateRequest, SamplingParams, StepMetrics
    from ..generate import Engine
    from .prof import Profile
    over = {k: v for k, v in cfg_over.items() if k not in BENCH_KEYS}
    if forced and prompt_text is None:
        # teacher forced, prompt lookup would draft the known answer and keep every draft: a
        # forward of several tokens, not the one-token decode the arm measures
        over.setdefault("speculation", "off")
    cfg = EngineConfig(store=store, **over).validated()
    t_open = time.perf_counter()
    eng = Engine.open(cfg)
    open_s = time.perf_counter() - t_open
    routing = None
    try:
        if cfg_over.get("routing_trace"):
            from ..trace import RecordedRouting
            routing = RecordedRouting(cfg_over["routing_trace"], eng.args.num_moe_layers, eng.args.num_experts,
                                      seed=int(cfg_over.get("routing_seed", 0))).install(eng.model)
        logit_hash = hashlib.sha256()
        fwd = eng.model.forward

        def hashed_forward(*args, **kw):  # every forward's logits, in order
            out = fwd(*args, **kw)
            logit_hash.update(np.ascontiguousarray(out, np.float32).tobytes())
            return out
        eng.model.forward = hashed_forward
        if cfg_over.get("warm_all"):
            # "All resident": every expert loaded before the first token (not counted).
            # Expert rows are MoE layers (dense MLP layers have none).
            for layer in range(eng.args.num_moe_layers):
                eng.cache.load_experts(layer, np.arange(eng.args.num_experts))
        # reserve_cache: the arm starts once the cache's memory is faulted in, as a user's first
        # question does after some seconds of typing (the wait is reported, not counted)
        t_pop = time.perf_counter()
        populated = eng.cache.wait_populated(timeout=600.0) if cfg.reserve_cache else True
        populate_s = time.perf_counter() - t_pop
        # the one-call decode step compiles in the background after open (from numba's cache:
        # ~0.1 s); the arm's decode starts once it is ready, as a user's first question does
        wait = getattr(eng.model, "wait_decode_ready", None)
        if wait is not None:
            wait(600.0)
        if cfg_over.get("idle_s"):  # a user typing the first question: the idle fill runs meanwhile
            time.sleep(float(cfg_over["idle_s"]))
        resident_at_start = int(np.isin(eng.cache.residency(), (RESIDENT, PINNED)).sum())
        V = eng.args.vocab_size
        if prompt_text is not None:  # a real question, in the model's chat template when it has one
            from ..events import ChatMessage
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
        touched = TouchedExperts(eng.args.num_moe_layers, eng.args.num_experts)
        eng.subscribe(touched)
        prof = Profile(eng)
        fin = None
        ru_start = resource.getrusage(resource.RUSAGE_SELF)
        ru0 = t_dec0 = None
        for ev in eng.generate(req):
            if isinstance(ev, StepMetrics):
                prof.add(ev)
                if ru0 is None:  # after the first step (prefill + first token): decode starts
                    ru0, t_dec0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            elif isinstance(ev, Finished):
                fin = ev
        ru1, t_dec1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        dec_cpu = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) if ru0 is not None else 0.0
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
               "cap": eng.cache.cap, "expert_slots": eng.cache.slots,
               # one-call runs PILOT stopped to read a predicted expert before its layer's router
               "pilot_run_stops": getattr(eng.pilot, "run_stops", 0) if eng.pilot is not None else 0,
               "tokens": fin.generated_tokens, "finish": fin.finish_reason, "error": fin.error,
               "distinct_experts": int(touched.mask.sum()), "total_experts": int(touched.mask.size),
               "sha256_routing": touched.digest(), "route_calls": touched.calls,
               # decode steps of the product's one-call path (MoEModel._decode_step_all); the
               # others ran layer by layer (a model without it, or the step not compiled yet)
               "one_call_steps": getattr(eng.model, "one_call_steps", 0),
               # RSS guard actions (token index or None = a layer-start poll, RSS bytes, old, new cap)
               "guard_fired": eng.guard.fired, "guard_trail": [list(t) for t in eng.guard.trail],
               "o_direct": eng.store.o_direct, "open_s": open_s, "populate_s": populate_s,
               "populated": populated, "resident_at_start": resident_at_start,
               "sha256_ids": hashlib.sha256(json.dumps(list(fin.token_ids)).encode()).hexdigest()[:16],
               "sha256_logits": logit_hash.hexdigest()[:16],
               "routing": "realistic" if routing is not None else "forced",
               "routing_fallbacks": routing.fallbacks if routing is not None else 0,
               "decode_cpu_s": dec_cpu, "decode_wall_s": (t_dec1 - t_dec0) if t_dec0 is not None else 0.0,
               "decode_steps": max(len(steps) - 1, 0),
               "decode_s": (fin.generated_tokens - 1) / fin.decode_tok_per_s if fin.decode_tok_per_s else 0.0,
               "spec": {k: sum(getattr(m, k) for m in steps) for k in (
                   "spec_issued", "spec_completed", "spec_dropped_stale", "spec_dropped_guard",
                   "spec_dropped_full", "spec_used", "spec_wasted_bytes")},
               "pilot_recall": recall, "demand_bytes": sum(m.demand_bytes for m in steps),
               # distinct experts routed to per MoE layer (random weights route degenerately)
               "distinct_per_layer": touched.mask.sum(axis=1).astype(int).tolist(),
               # high-water mark of this (fresh) process, opening included; Linux ru_maxrss is KiB
               "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
               "quant": eng.store.quant, "code": code_version(),
               # CPU seconds (user + system, every thread of this process) spent generating:
               # on a loaded machine this, not wall clock, says what the engine cost
               "gen_cpu_s": (ru1.ru_utime - ru_start.ru_utime) + (ru1.ru_stime - ru_start.ru_stime),
               "gen_wall_s": fin.ttft_s + ((fin.generated_tokens - 1) / fin.decode_tok_per_s
                                           if fin.decode_tok_per_s else 0.0)}
        # Decode only (steps after the first: the first covers the prompt's prefill and the
        # first token, where PILOT does not run); these are what tok/s and the ceiling compare.
        dec = steps[1:]
        # the tokens those steps produced: a forward that keeps a draft gives several
        n = max(dec[-1].token_index - steps[0].token_index, 1) if dec else 1
        look = sum(m.hits + m.misses for m in dec)
        row.update(
            decode_tokens=n if dec else 0,
            decode_hit_rate=sum(m.hits for m in dec) / look if look else 1.0,
            decode_mb_per_token=sum(m.demand_bytes + m.speculative_bytes for m in dec) / 1e6 / n,
            decode_demand_mb_per_token=sum(m.demand_bytes for m in dec) / 1e6 / n,
            decode_spec_mb_per_token=sum(m.speculative_bytes for m in dec) / 1e6 / n,
            decode_felt_wait_s=sum(m.felt_wait_s for m in dec),
            decode_read_service_s=sum(m.read_service_s for m in dec))
        return row
    finally:
        if routing is not None:
            routing.uninstall()
        eng.close()

def cmd_arm(a) -> int:
    """Internal: one arm in this (fresh) process; prints a JSON row."""
    try:  # on a shared machine, an arm near the RAM limit is the first the OOM killer takes
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    row = run_arm(a.store, json.loads(a.config), a.prompt_len, a.tokens, a.seed,
                  prompt_text=a.prompt_text, stream_file=a.stream_file)
    print("ARM " + json.dumps(row))
    return 0

def arm_subprocess(store, over, prompt_len, tokens, seed, prompt_text=None, stream_file=None,
                   cgroup_gb: float | None = None) -> dict:
    """Run one arm (run_arm) in a fresh ``colibri bench arm`` process; returns its JSON row.
    ``cgroup_gb``: run it inside a cgroup v1 memory group with that limit (GB = 1e9 bytes;
    ``peers.MemCgroup``); the row then has ``cgroup_max_usage_gb`` and ``cgroup_oom_kills``.

    Raises:
        RuntimeError: the arm process printed no row (its output tail is in the message).
        OSError: the memory cgroup cannot be created.
    """
    cmd = [sys.executable, "-m", "engine.cli", "bench", "arm", "--store", store, "--config", json.dumps(over),
           "--prompt-len", str(prompt_len), "--tokens", str(tokens), "--seed", str(seed)]
    if prompt_text is not None:
        cmd += ["--prompt-text", prompt_text]
    if stream_file is not None:
        cmd += ["--stream-file", str(stream_file)]
    # LLVM's pages this process maps are shared with the arm's, and MADV_PAGEOUT leaves shared
    # pages: given back here, the arm's own release_compiler_memory can drop them from its RSS
    release_compiler_memory()
    load_before = os.getloadavg()[0]
    grp = extra = None
    if cgroup_gb is not None:
        from .peers import MemCgroup
        grp = MemCgroup(int(cgroup_gb * 1e9))
        cmd = grp.wrap(cmd)
    try:
        ch0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        p = subprocess.run(cmd, capture_output=True, text=True)
        ch1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if grp is not None:
            g = grp.stats()
            extra = {"cgroup_gb": cgroup_gb, "cgroup_max_usage_gb": g["cgroup_max_usage_bytes"] / 1e9,
                     "cgroup_oom_kills": g["cgroup_oom_kills"]}
    finally:
        if grp is not None:
            grp.remove()
    for line in p.stdout.splitlines():
        if line.startswith("ARM "):
            # 1-minute load averages before and after the arm: this machine is shared
            return {**json.loads(line[4:]), **(extra or {}), "load_avg_before": load_before,
                    "load_avg": os.getloadavg()[0],
                    "process_cpu_s": ch1.ru_utime + ch1.ru_stime - ch0.ru_utime - ch0.ru_stime}
    raise RuntimeError(f"arm {over} failed{' (OOM-killed?)' if extra and extra['cgroup_oom_kills'] else ''}:\n"
                       f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def add_parser(bs) -> None:
    """Register `arm` under ``colibri bench``."""
    r = bs.add_parser("arm")  # internal: one arm in a fresh process (hidden from the verb list)
    r.add_argument("--store", required=True)
    r.add_argument("--config", required=True)
    add_stream_flags(r, prompt_len=16, tokens=48)
    r.add_argument("--prompt-text", default=None)
    r.add_argument("--stream-file", default=None)
    r.set_defaults(fn=cmd_arm)
