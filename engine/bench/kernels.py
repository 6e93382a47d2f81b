"""`colibri bench kernels`: our int4 / int8 stores, all experts resident, against native
llama.cpp (`llama-bench`) on Q4_0 / Q8_0 GGUFs of the same model, same thread count.

Arms (each a fresh process, interleaved, the order reversed every other repetition):
- ours-<label>: a store opened with every expert resident (cap = num_experts, all loaded before
  timing) and ``threads = threads``; one warm-up generation (JIT, first touches) not
  counted. Prefill tok/s at each prompt length = the engine's ``prefill_tok_per_s``, each
  on a fresh seeded random prompt (no KV prefix reuse); decode tok/s = teacher-forced random
  stream (``forced_stream``) of ``tokens`` tokens after a 16-token prompt, the engine's own
  ``decode_tok_per_s``.
- llama-<label>: ``llama-bench -m GGUF -t threads -p P1,P2,.. -n tokens -r 1 -o json``
  (its own warm-up run; pp = prompt processing of P tokens, tg = generation of ``tokens``).
- ``--ours-engine LABEL=CHECKOUT``: the ours arm LABEL runs the engine of another checkout (its
  fresh process imports ``engine`` from CHECKOUT: ``python -P`` with ``PYTHONPATH=CHECKOUT``),
  so ``--ours after=STORE before=STORE --ours-engine before=OLD --pair after/before`` measures a
  change's speed on one store, the two engines interleaved; a ``--pair`` whose second label is
  an ours arm gives the ratios of the two ours arms.
- ``--inner-reps N``: both kinds of arm run each test N times in their process (llama-bench
  ``-r N``) and keep the median; every run's tok/s is in the row as ``<key>_runs``.

``--cgroup-gb G`` adds, per arm, the same model inside a cgroup v1 memory limit of G GB
(engine.bench.peers.MemCgroup): ours streamed at a RAM budget of G GB (automatic cap, O_DIRECT,
nothing pre-loaded; decode tok/s, hit rate, MB read per token of the first generation after
open, cold, as a user's first answer; a second generation of another stream is in the row as
``tg<N>_warm``; ``decode_mb_per_token`` and ``compute_s_per_token`` (the decode's wall time
less its felt wait, per token) of the first give its overlap ceiling 1 / max(compute, decode
bytes / read rate), the rate the blkio throttle or, unthrottled, the fastest O_DIRECT slab
read rate measured before the arms: ``ceiling_tok_s``, ``ceiling_share``) and ``llama-bench
-p 0 -n tokens`` on its mmap'd GGUF in the same limit (the kernel evicts and re-reads its pages). Before
every cgroup arm the arm's files are evicted from the page cache (posix_fadvise DONTNEED on
them only): pages cached by an earlier arm stay charged to that arm's group, so a later
llama.cpp arm would otherwise map them for free, past its limit. The llama.cpp cgroup arms run
with ``-lm mmap --repack 0`` (``--llama-cgroup-flags``): repacked Q4_0 weights live in anonymous
memory and a limit below the model's size OOM-kills llama-bench; the `-best` arms add those
flags to llama.cpp's defaults. llama.cpp's MB read per token
is taken by difference from the block reads of two runs (``-n tokens`` and ``-n 16``, each
cold in a fresh group; rusage ru_inblock of the child, mmap faults included), so loading and
the first fill of the cache cancel as in ours' decode-only figure. ``--cgroup-only`` skips the
unconstrained arms (a store or GGUF larger than RAM: Qwen3-30B-A3B at an 8 GB limit).

``--cpu-time`` adds tokens per CPU-second for decode and for a prefill of <= 128 tokens, from
rusage by difference (two runs of different length, so loading and warm-up cancel): on a
machine shared with other jobs, wall-clock tok/s measures the scheduler (with 2 threads every
parallel region waits for a descheduled partner); CPU time measures the kernels.

Medians over repetitions and the ratios ours / llama.cpp are written to
bench/results/<name>.{json,md}, with the machine's load average before every arm (the machine
may be shared: read the ratios of interleaved arms, not absolute numbers).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..observers import Observer
from .overlap import ceiling

DECODE_PROMPT = 16


def _cpu_s(who: int) -> float:
    import resource
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _rates(**by_key: tuple[float, float]) -> dict:
    """{key: tokens / CPU seconds} for each (tokens, CPU-second difference); a key whose
    difference is not positive (the shorter run cost as much CPU as the longer, i.e. noise
    larger than the signal) is left out (a blank cell) instead of dividing by ~0: a
    llama-bench tg arm once read 4.8e10 tok/CPU-s that way."""
    return {k: n / d for k, (n, d) in by_key.items() if d > 0}


def _ours_cpu_rates(run, vocab: int, tokens: int, prompts: list[int], seed: int) -> dict:
    """Tokens per CPU-second of this process (all its threads), by difference so fixed costs
    cancel: decode = (tokens - 16) / (cpu(16 + tokens) - cpu(16 + 16)); prefill = (P - 16) /
    (cpu(prompt P) - cpu(prompt 16)) for the largest P <= 128."""
    import resource
    from .common import forced_stream
    who = resource.RUSAGE_SELF
    s = forced_stream(vocab, DECODE_PROMPT + tokens, seed)
    c0 = _cpu_s(who)
    run(s[:DECODE_PROMPT], s[DECODE_PROMPT:DECODE_PROMPT + 16])
    c1 = _cpu_s(who)
    run(s[:DECODE_PROMPT], s[DECODE_PROMPT:])
    c2 = _cpu_s(who)
    out = _rates(tg_per_cpu_s=(tokens - 16, (c2 - c1) - (c1 - c0)))
    big = max([p for p in prompts if 16 < p <= 128], default=None)
    if big:
        a = forced_stream(vocab, big + 1, seed + 77)
        b = forced_stream(vocab, 17, seed + 78)
        c0 = _cpu_s(who)
        run(b[:16], b[16:])
        c1 = _cpu_s(who)
        run(a[:big], a[big:])
        c2 = _cpu_s(who)
        out.update(_rates(**{f"pp{big}_per_cpu_s": (big - 16, (c2 - c1) - (c1 - c0))}))
    return out


def _llama_cpu_rates(llama_bench: str, gguf: str, prompts: list[int], tokens: int, threads: int) -> dict:
    """Tokens per CPU-second of llama-bench (child rusage), by difference: decode from -n tokens
    vs -n 16 (its warm-up generates 1 token in both); prefill from -p P vs -p 16, where its
    warm-up runs the whole prompt once more (so 2 (P - 16) tokens)."""
    import resource
    who = resource.RUSAGE_CHILDREN

    def cpu(p: int, n: int) -> float:
        c0 = _cpu_s(who)
        _llama_arm(llama_bench, gguf, [p] if p else [], n, threads)
        return _cpu_s(who) - c0
    out = _rates(tg_per_cpu_s=(tokens - 16, cpu(0, tokens) - cpu(0, 16)))
    big = max([p for p in prompts if 16 < p <= 128], default=None)
    if big:
        out.update(_rates(**{f"pp{big}_per_cpu_s": (2 * (big - 16), cpu(big, 0) - cpu(16, 0))}))
    return out


class _DecodeMark(Observer):
    """A model observer (engine.observers' hook ``on_forward_start``) that marks the cache's
    counters and the clock at each one-token forward after the prefill, for the decode-only
    figures of a generation: :meth:`decode`."""

    def __init__(self, cache):
        self.cache = cache
        self.first = None  # (clock, counters) at the first decode forward
        self.steps = 0

    def on_forward_start(self, pos0: int, num_tokens: int) -> None:
        if num_tokens == 1:
            if self.first is None:
                self.first = (time.perf_counter(), self.cache.stats.snapshot())
            self.steps += 1

    def decode(self) -> dict:
        """``decode_mb_per_token`` (demand + speculative + pre-read bytes read from the first decode
        forward on, per decode forward), ``decode_felt_wait_s_per_token`` and
        ``compute_s_per_token`` (wall time per decode forward less its felt wait); {} when no
        decode forward ran. Call right after the generation."""
        if self.first is None or self.steps == 0:
            return {}
        t0, c0 = self.first
        c1 = self.cache.stats.snapshot()
        n = self.steps
        wall = time.perf_counter() - t0
        felt = c1["felt_wait_s"] - c0["felt_wait_s"]
        nbytes = c1["demand_bytes"] + c1["spec_bytes"] - c0["demand_bytes"] - c0["spec_bytes"]
        return {"decode_mb_per_token": nbytes / 1e6 / n, "decode_felt_wait_s_per_token": felt / n,
                "compute_s_per_token": max(wall - felt, 0.0) / n}


def _ours_arm(store: str, prompts: list[int], tokens: int, threads: int, seed: int,
              cpu_time: bool = False, budget_gb: float | None = None, inner_reps: int = 1,
              first: bool = False, long_prompt: int = 0) -> dict:
    """One process: open ``store`` all resident, return prefill tok/s per prompt length and
    decode tok/s (see the module docstring). With ``budget_gb``, or ``first`` (the user's
    default RAM budget): the store opened as ``colibri run`` opens it (default context length,
    automatic cap, O_DIRECT, nothing pre-loaded) and timed cold, on the first generation after
    open: decode tok/s, hit rate and MB read per token of that generation (its 16-token
    prompt's prefill included), ``open_s`` and ``ttft_s``; a second generation of another
    stream right after is reported as ``*_warm``.
    ``inner_reps`` (all resident only): each prefill and the decode run that many times in this
    process, each on its own seeded stream; the median is the value, every run's tok/s is in
    ``<key>_runs``."""
    from .common import forced_stream, run_forced
    from ..config import EngineConfig, ModelArgs
    from ..events import Finished
    from ..generate import Engine
    args = ModelArgs.from_hf_config(Path(store) / "config.json")
    E = args.num_experts
    if long_prompt:
        return _ours_long_prompt(store, long_prompt, threads, seed, budget_gb)
    if budget_gb is not None or first:
        t0 = time.perf_counter()
        cfg = EngineConfig(store=store, pilot=0, pinning=False, history=False, threads=threads)
        if budget_gb is not None:
            cfg = EngineConfig(store=store, ram_budget_gb=budget_gb, pilot=0, pinning=False, history=False,
                               threads=threads)
        eng = Engine.open(cfg)
        open_s = time.perf_counter() - t0
        try:
            def stream(s: list[int]) -> Finished:
                return run_forced(eng, s[:DECODE_PROMPT], s[DECODE_PROMPT:])
            # cold: the first generation after open, as a user's first answer
            mark = _DecodeMark(eng.cache)
            eng.model.subscribe(mark)
            cold = stream(forced_stream(args.vocab_size, DECODE_PROMPT + tokens, seed))
            dec = mark.decode()
            eng.model.unsubscribe(mark)
            warm = stream(forced_stream(args.vocab_size, DECODE_PROMPT + tokens, seed + 999))
            return {**dec, "quant": eng.store.quant, "dense_quant": eng.store.dense_quant, "budget_gb": budget_gb,
                    "cap": eng.cache.cap, "context_length": eng.context_length, "open_s": open_s,
                    "ttft_s": cold.ttft_s, f"tg{tokens}": cold.decode_tok_per_s, "hit_rate": cold.hit_rate,
                    "mb_per_token": cold.mb_per_token, "felt_wait_s": cold.felt_wait_s,
                    f"tg{tokens}_warm": warm.decode_tok_per_s, "hit_rate_warm": warm.hit_rate,
                    "mb_per_token_warm": warm.mb_per_token}
        finally:
            eng.close()
    eng = Engine.open(EngineConfig(store=store, cap=E, pilot=0, pinning=False, history=False, o_direct=False,
                                   threads=threads))
    try:
        for layer in range(args.num_moe_layers):
            eng.cache.load_experts(layer, np.arange(E))
        eng.cache.collapse_full()  # as the pre-read does once it has filled the arena
        wait = getattr(eng.model, "wait_decode_ready", None)
        if wait is not None:  # the one-call decode step compiles in the background after open
            wait(900)

        def run(prompt: list[int], forced: list[int]) -> Finished:
            return run_forced(eng, prompt, forced)
        warm = forced_stream(args.vocab_size, 40, seed + 999)
        run(warm[:32], warm[32:])  # JIT for T = 32 and T = 1; not counted
        out = {"quant": eng.store.quant, "dense_quant": eng.store.dense_quant,
               "expert_layout": eng.store.expert_layout, "context_length": eng.context_length}

        def median_of(key: str, prompt_len: int, n: int, seed0: int, rate: str) -> None:
            """out[key] = the median of inner_reps runs (each on its own seeded stream)."""
            runs = []
            for j in range(inner_reps):
                s = forced_stream(args.vocab_size, prompt_len + n, seed0 + 1000 * j)
                runs.append(getattr(run(s[:prompt_len], s[prompt_len:]), rate))
            out[key] = float(np.median(runs))
            if inner_reps > 1:
                out[f"{key}_runs"] = runs
        for i, p in enumerate(prompts):
            median_of(f"pp{p}", p, 1, seed + 1 + i, "prefill_tok_per_s")
        median_of(f"tg{tokens}", DECODE_PROMPT, tokens, seed, "decode_tok_per_s")
        if cpu_time:
            out.update(_ours_cpu_rates(run, args.vocab_size, tokens, prompts, seed))
        return out
    finally:
        eng.close()


def _read_bytes() -> int:
    """Bytes this process has read from storage (/proc/self/io read_bytes: O_DIRECT reads and
    page-cache misses, not page-cache hits); 0 where /proc does not tell."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _ours_long_prompt(store: str, n: int, threads: int, seed: int, budget_gb: float | None) -> dict:
    """A user's long first prompt: the store opened as ``colibri run`` opens it at ``budget_gb``
    (the default settings otherwise), then at once an ``n``-token seeded random prompt and one
    token. ``pp<n>``: n / TTFT (tok/s, what the user waits for: the prompt's reads included);
    ``prefill_read_gb``: bytes read from storage from the prompt to its first token (the
    pre-read's included); ``open_to_token_read_gb``: from before the open to the first token
    (the dense weights, the pre-read and the prompt's reads); ``expert_gb`` and ``dense_gb``: the
    store's expert bytes (the least a prompt that touches every expert reads) and the rest of
    its weight files."""
    from .common import forced_stream, run_forced
    from ..config import EngineConfig, ModelArgs
    from ..generate import Engine
    args = ModelArgs.from_hf_config(Path(store) / "config.json")
    t0 = time.perf_counter()
    r_open = _read_bytes()
    eng = Engine.open(EngineConfig(store=store, ram_budget_gb=budget_gb, pilot=0, pinning=False, history=False,
                                   threads=threads))
    open_s = time.perf_counter() - t0
    try:
        s = forced_stream(args.vocab_size, n + 1, seed)
        r0 = _read_bytes()
        fin = run_forced(eng, s[:n], s[n:])
        read = _read_bytes() - r0
        expert = args.num_moe_layers * args.num_experts * eng.store.slot_bytes
        dense = (Path(store) / eng.store.manifest["dense_file"]).stat().st_size
        return {f"pp{n}": n / fin.ttft_s if fin.ttft_s > 0 else 0.0, "ttft_s": fin.ttft_s, "open_s": open_s,
                "prefill_read_gb": read / 1e9, "expert_gb": expert / 1e9, "cap": eng.cache.cap,
                "open_to_token_read_gb": (r0 + read - r_open) / 1e9, "dense_gb": dense / 1e9,
                "hit_rate": fin.hit_rate, "budget_gb": budget_gb}
    finally:
        eng.close()


def _llama_arm(llama_bench: str, gguf: str, prompts: list[int], tokens: int, threads: int,
               wrap=None, extra: list[str] = (), inner_reps: int = 1) -> dict:
    """One llama-bench process: tok/s per test (``pp<P>``, ``tg<N>``). With ``inner_reps`` > 1
    (``-r inner_reps``) the median of its samples (``samples_ts``), every sample in
    ``<key>_runs``; else its average of the one run."""
    cmd = [llama_bench, "-m", gguf, "-t", str(threads), "-p", ",".join(map(str, prompts)) or "0",
           "-n", str(tokens), "-r", str(inner_reps), "-o", "json", *extra]
    if wrap is not None:
        cmd = wrap(cmd)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    out = {}
    for t in json.loads(p.stdout):
        if t["n_prompt"] == 0 and t["n_gen"] == 0:
            continue
        key = f"pp{t['n_prompt']}" if t["n_gen"] == 0 else f"tg{t['n_gen']}"
        samples = [float(v) for v in t.get("samples_ts") or []]
        if inner_reps > 1 and samples:
            out[key] = float(np.median(samples))
            out[f"{key}_runs"] = samples
        else:
            out[key] = float(t["avg_ts"])
    return out


def _evict(paths) -> None:
    """Drop ``paths``' pages (files, or every file under a folder) from the page cache."""
    from .peers import model_files
    os.sync()
    for f in model_files(*paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _children_read_bytes() -> int:
    """Bytes the waited-for children read from storage (ru_inblock, 512-byte units)."""
    import resource
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock * 512


# llama.cpp's "best flags" arm in a memory limit: the file stays mapped and Q4_0 is not repacked
# into anonymous memory (--repack 1, the default, which a limit smaller than the model pages
# out or OOM-kills); the headline arm runs llama-bench with its default flags, as users do.
LLAMA_BEST_CGROUP_FLAGS = "-lm mmap --repack 0"


def _llama_in_group(llama_bench: str, gguf: str, prompts: list[int], tokens: int, threads: int, group,
                    flags: str, wrap) -> tuple[dict, int, dict]:
    """One ``llama-bench -p PROMPTS -n tokens FLAGS`` cold (the GGUF's pages evicted) in a fresh
    memory group (``group()`` makes one, with ``wrap``, ``stats``, ``remove``; ``wrap``, e.g. a
    blkio group's, wraps the command inside the memory group's). Returns (its results, the
    bytes it read from storage, the group's stats). RuntimeError (e.g. OOM-killed in the
    limit) names the group's peak and OOM kills."""
    import shlex
    _evict([gguf])
    grp = group()
    try:
        r0 = _children_read_bytes()
        w = grp.wrap if wrap is None else (lambda c: grp.wrap(wrap(c)))
        try:
            r = _llama_arm(llama_bench, gguf, prompts, tokens, threads, wrap=w, extra=shlex.split(flags))
        except RuntimeError as e:  # the row says so
            st = grp.stats()
            raise RuntimeError(f"{e}\nmemory group: peak {st['cgroup_max_usage_bytes'] / 1e9:.2f} GB, "
                               f"OOM kills {st['cgroup_oom_kills']}") from None
        return r, _children_read_bytes() - r0, grp.stats()
    finally:
        grp.remove()


def _llama_cgroup_arm(llama_bench: str, gguf: str, tokens: int, threads: int, group,
                      flags: str = "", wrap=None) -> dict:
    """``llama-bench -p 0 -n tokens FLAGS`` cold in a fresh memory group (_llama_in_group), then
    ``-n 16`` likewise: tg from the first, MB read per token = (read(tokens) - read(16)) /
    (tokens - 16), and the group's stats of the first."""
    out, read = {}, {}
    for n in (tokens, 16) if tokens > 16 else (tokens,):
        r, read[n], st = _llama_in_group(llama_bench, gguf, [], n, threads, group, flags, wrap)
        if n == tokens:
            out.update(r)
            out.update(st)
    out["read_gb"] = read[tokens] / 1e9
    if len(read) == 2:
        out["mb_per_token"] = max(read[tokens] - read[16], 0) / 1e6 / (tokens - 16)
    return out


def _llama_cgroup_long(llama_bench: str, gguf: str, n: int, threads: int, group, flags: str = "",
                       wrap=None) -> dict:
    """``llama-bench -p n -n 0 FLAGS`` cold in a fresh memory group (_llama_in_group): ``pp<n>``
    tok/s (its own warm-up run included in the process, not in the figure) and the bytes the
    process read from storage (``prefill_read_gb``: its load and both runs, rusage ru_inblock)."""
    r, read, st = _llama_in_group(llama_bench, gguf, [n], 0, threads, group, flags, wrap)
    return {**r, "prefill_read_gb": read / 1e9, **st}


def _spawn_ours(label: str, store: str, a, budget_gb: float | None = None, wrap=None,
                first: bool = False, long_prompt: int = 0) -> dict:
    cmd = [sys.executable, "-m", "engine.bench.kernels", "--store", store, "--threads", str(a.threads),
           "--tokens", str(a.tokens), "--seed", str(a.seed), "--prompts", *map(str, a.prompts)]
    resident = budget_gb is None and not first
    if a.cpu_time and resident:
        cmd.append("--cpu-time")
    if resident and a.inner_reps > 1:
        cmd += ["--inner-reps", str(a.inner_reps)]
    if budget_gb is not None:
        cmd += ["--budget-gb", str(budget_gb)]
    if first:
        cmd.append("--first")
    if long_prompt:
        cmd += ["--long-prompt", str(long_prompt)]
    env = None
    checkout = dict(getattr(a, "ours_engine", None) or ()).get(label)
    if checkout:  # that checkout's engine, not the one on the path (-P: not the working directory's)
        cmd[1:1] = ["-P"]
        env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
    if wrap is not None:
        cmd = wrap(cmd)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in p.stdout.splitlines() if x.startswith("ARM ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"ours-{label} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[4:])


def _parse_arm(spec: str) -> tuple[str, str]:
    if "=" not in spec:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected LABEL=PATH")
    label, path = spec.split("=", 1)
    return label, path


def _paired_ratios(rows: list[dict], ours_arm: str, llama_arm: str, keys: list[str]) -> dict:
    """Median over repetitions of ours / llama.cpp for each key in ``keys``, using only the
    repetitions where both arms have the key (a repetition's two arms ran one after the other).
    Returns {key: ratio} (empty if no repetition has both)."""
    by_rep: dict[int, dict] = {}
    for r in rows:
        if r["arm"] in (ours_arm, llama_arm):
            by_rep.setdefault(r["rep"], {})[r["arm"]] = r
    out = {}
    for k in keys:
        v = [p[ours_arm][k] / p[llama_arm][k] for p in by_rep.values()
             if ours_arm in p and llama_arm in p and k in p[ours_arm] and p[llama_arm].get(k)]
        if v:
            out[k] = float(np.median(v))
    return out


def _arm_name(arm: dict) -> str:
    """``ours-int4``, ``ours-int4-first``, ``llama-q4_0-best@8GB@2GB/s``..."""
    from .blockdev import bps_label
    name = f"{arm['system']}-{arm['label']}" + (f"-{arm['variant']}" if arm["variant"] else "")
    if arm["limit"] is not None:
        name += f"@{arm['limit']:g}GB"
    if arm["bps"]:
        name += "@" + bps_label(arm["bps"])
    return name


def _ratio_pairs(a, arms: list[dict]) -> list[tuple[str, str, str]]:
    """(pair name, ours arm, llama arm) for every comparison the run holds: all resident, the
    first answer against llama-bench's tg, and each memory limit / read bandwidth against
    llama.cpp's default flags and, where run, its best flags."""
    names = {_arm_name(x) for x in arms}
    ours = dict(a.ours)
    out = []
    for ol, ll in a.pair:
        if ll in ours:  # two ours arms (two engines, or two stores) side by side
            cand = [(f"{ol}/{ll}", f"ours-{ol}", f"ours-{ll}")]
            out += [c for c in cand if c[1] in names and c[2] in names]
            continue
        cand = [(f"{ol}/{ll}", f"ours-{ol}", f"llama-{ll}"),
                (f"{ol}-first/{ll}", f"ours-{ol}-first", f"llama-{ll}")]
        for x in arms:
            if x["system"] == "ours" and x["label"] == ol and x["limit"] is not None:
                o = _arm_name(x)
                sfx = o[len(f"ours-{ol}"):]
                cand.append((f"{ol}/{ll}{sfx}", o, f"llama-{ll}{sfx}"))
                best = sfx.replace("-long", "-best-long") if sfx.startswith("-long") else "-best" + sfx
                cand.append((f"{ol}/{ll}{best}", o, f"llama-{ll}{best}"))
        out += [c for c in cand if c[1] in names and c[2] in names]
    return out


def _write(a, arms, rows, quiet: bool = False) -> None:
    """Medians, ratios and every run -> bench/results/<name>.{json,md}."""
    from .common import machine_info, md_table, write_results
    tg = f"tg{a.tokens}"
    keys = [tg] + ([] if a.cgroup_only else [f"pp{p}" for p in a.prompts])
    if a.long_prompt and f"pp{a.long_prompt}" not in keys:
        keys.append(f"pp{a.long_prompt}")
    if a.cpu_time:
        big = max([p for p in a.prompts if 16 < p <= 128], default=None)
        keys += ["tg_per_cpu_s"] + ([f"pp{big}_per_cpu_s"] if big else [])
    for r in rows:  # the overlap ceiling of ours' memory-limited arms (see the module docstring)
        bw = r.get("read_bps") or getattr(a, "disk_gbps", 0.0) * 1e9
        if r.get("compute_s_per_token") is not None and r.get(tg) and bw:
            r["ceiling_tok_s"] = ceiling(r["compute_s_per_token"], r["decode_mb_per_token"], bw / 1e9)[0]
            r["ceiling_share"] = r[tg] / r["ceiling_tok_s"]
    extra = ["hit_rate", "mb_per_token", "decode_mb_per_token", "prefill_read_gb", "open_to_token_read_gb",
             "expert_gb", "dense_gb", "felt_wait_s",
             "ttft_s", "open_s", "cap",
             f"{tg}_warm", "ceiling_tok_s", "ceiling_share", "read_ahead_kb", "read_bps"]
    med = {}
    for arm in arms:
        name = _arm_name(arm)
        ok = [r for r in rows if r["arm"] == name and "failed" not in r]
        med[name] = {k: float(np.median([r[k] for r in ok if r.get(k) is not None]))
                     for k in keys + extra if any(r.get(k) is not None for r in ok)}
        failed = [r["failed"] for r in rows if r["arm"] == name and "failed" in r]
        if failed:
            med[name]["failed"] = f"{len(failed)} of {len(failed) + len(ok)} runs: {failed[-1][-160:]}"
    ratios, paired = {}, {}
    for pair, oa, la in _ratio_pairs(a, arms):
        o, ll = med.get(oa, {}), med.get(la, {})
        r = {k: o[k] / ll[k] for k in keys if k in o and ll.get(k)}
        if r:
            ratios[pair] = r
        pr = _paired_ratios(rows, oa, la, keys)
        if pr:
            paired[pair] = pr
    ours_labels = [lb for lb, _ in a.ours]
    for l4 in [lb for lb in ours_labels if lb.startswith("int4")]:
        if "int8" in ours_labels:
            o4, o8 = med.get(f"ours-{l4}", {}), med.get("ours-int8", {})
            ratios[f"{l4}/int8"] = {k: o4[k] / o8[k] for k in keys if k in o4 and o8.get(k)}
    cols = [("arm", "arm", "")] + [(k.replace("_per_cpu_s", " tok/CPU-s") if "cpu" in k else k + " tok/s", k, ".1f")
                                   for k in keys]
    cols += [("hit rate", "hit_rate", ".3f"), ("MB read / token", "mb_per_token", ".1f"),
             ("decode MB / token", "decode_mb_per_token", ".1f"),
             ("prompt read GB", "prefill_read_gb", ".2f"), ("open to token read GB", "open_to_token_read_gb", ".2f"),
             ("expert GB", "expert_gb", ".2f"), ("dense GB", "dense_gb", ".2f"),
             ("felt wait s", "felt_wait_s", ".2f"), ("TTFT s", "ttft_s", ".2f"), ("open s", "open_s", ".1f"),
             ("cap", "cap", ".0f"), (f"{tg} warm tok/s", f"{tg}_warm", ".1f"),
             ("ceiling tok/s", "ceiling_tok_s", ".1f"), ("of ceiling", "ceiling_share", ".2f"),
             ("read-ahead KB", "read_ahead_kb", ".0f"), ("read B/s (0 = unthrottled)", "read_bps", ".2g"),
             ("failed", "failed", "")]
    done = len({r["rep"] for r in rows})
    table = ("Medians over %d interleaved repetitions (of %d asked), %d threads. Ours: `-first` and the "
             "memory-limited arms are the first generation after open in a fresh process, cold, at the "
             "default context length; the unmarked arm has every expert pre-loaded. llama.cpp: llama-bench "
             "with its default flags (`-best`: %r), the read-ahead of the device holding the file as "
             "listed.") % (done, a.reps, a.threads, a.llama_best_flags)
    if a.long_prompt:
        table += (" `-long` arms: a fresh process (group) given one %d-token prompt at once: pp%d is the "
                  "prompt over its TTFT (ours: open excluded, the pre-read running; llama-bench: its "
                  "timed run after its warm-up); prompt read GB: ours from the prompt to its first token, "
                  "llama.cpp's whole process (load, warm-up and run); expert GB: the store's expert bytes."
                  ) % (a.long_prompt, a.long_prompt)
    if any(r.get("ceiling_tok_s") for r in rows):
        table += (" MB read / token: every byte read during the generation (the pre-read's included) over "
                  "its tokens; decode MB / token: from the first decode step on. Ceiling: 1 / max(compute, "
                  "decode bytes / read rate), the rate the throttle's or, unthrottled, %.2f GB/s (O_DIRECT "
                  "slab reads measured before the arms).") % getattr(a, "disk_gbps", 0.0)
    table += "\n\n"
    table += md_table([{"arm": arm, **m} for arm, m in med.items()], cols)
    table += "\n\nRatios ours / llama.cpp, or of the two ours arms of a pair (median / median)\n\n" + md_table(
        [{"arm": name, **r} for name, r in ratios.items()], [("pair", "arm", "")] + [(k, k, ".2f") for k in keys])
    if paired:
        table += ("\n\nRatios (median over repetitions of each repetition's ratio of the pair: the two arms "
                  "of a repetition ran side by side)\n\n") + md_table(
            [{"arm": name, **r} for name, r in paired.items()], [("pair", "arm", "")] + [(k, k, ".2f") for k in keys])
    table += "\n\nEvery run\n\n" + md_table(rows, [("arm", "arm", ""), ("rep", "rep", "d"),
                                                  ("load 1 min", "load_avg_1m", ".1f")] + cols[1:])
    cmd = "colibri bench kernels " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "colibri bench kernels"
    table += f"\n\nCommand: `{cmd}`\n"
    data = {"machine": machine_info(), "command": cmd, "threads": a.threads, "tokens": a.tokens,
            "prompts": a.prompts, "reps": a.reps, "ours": dict(a.ours), "llama": dict(a.llama),
            "ours_engine": getattr(a, "ours_engine_commits", {}),
            "llama_bench": a.llama_bench, "llama_best_flags": a.llama_best_flags, "cgroup_gb": a.cgroup_gb,
            "read_ahead_kb": a.read_ahead_kb, "read_bps": a.read_bps, "disk_gbps": getattr(a, "disk_gbps", None),
            "rows": rows, "medians": med,
            "ratios": ratios, "paired_ratios": paired, "load_avg_1m": [r["load_avg_1m"] for r in rows]}
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        write_results(a.name, data, table, a.out_dir)


def _plan_arms(a, cg_ok: bool) -> list[dict]:
    """The arms in run order: each pair side by side (ours, then its llama.cpp peer, then ours'
    first answer), so an interrupted run still holds complete pairs; the memory-limited arms
    (per read bandwidth) after them."""
    ours, llama = dict(a.ours), dict(a.llama)
    arms, seen = [], set()

    def add(system, label, limit=None, bps=0, variant=""):
        src = ours if system == "ours" else llama
        key = (system, label, limit, bps, variant)
        if label in src and key not in seen:
            seen.add(key)
            arms.append({"system": system, "label": label, "path": src[label], "limit": limit, "bps": bps,
                         "variant": variant})
    free = not a.cgroup_only
    for ol, ll in a.pair:
        if free:
            add("ours", ol)
            add("llama", ll)
            if a.first_answer:
                add("ours", ol, variant="first")
    for lb in ours if free else ():
        add("ours", lb)
    for lb in llama if free else ():
        add("llama", lb)
    if cg_ok:
        for bps in a.read_bps:
            for system, src in (("ours", ours), ("llama", llama)):
                for lb in src:
                    if lb in (a.cgroup_arms or [lb]):
                        add(system, lb, a.cgroup_gb, bps)
                        if system == "llama" and a.llama_best_flags:
                            add(system, lb, a.cgroup_gb, bps, "best")
        for bps in a.read_bps if a.long_prompt else ():
            for system, src in (("ours", ours), ("llama", llama)):
                for lb in src:
                    if lb in (a.cgroup_arms or [lb]):
                        add(system, lb, a.cgroup_gb, bps, "long")
                        if system == "llama" and a.llama_best_flags:
                            add(system, lb, a.cgroup_gb, bps, "best-long")
    return arms


def _run_arm(a, arm: dict, dev_of: dict) -> dict:
    """One arm (a fresh process; cgroup arms inside a fresh memory group, and a blkio group
    when throttled). Returns its row's values."""
    from .blockdev import BlkioCgroup, read_ahead_kb
    from .peers import MemCgroup
    system, label, path, limit, bps = arm["system"], arm["label"], arm["path"], arm["limit"], arm["bps"]
    blk = BlkioCgroup(dev_of[path], bps, a.blkio_root) if bps else None
    grp = None
    try:
        if system == "ours" and (limit is not None or arm["variant"] == "first"):
            _evict([path])
        if system == "ours" and limit is not None:
            grp = MemCgroup(int(limit * 1e9), a.cgroup_root)
        if system == "ours":
            wrap = grp.wrap if grp else None
            if blk is not None:
                wrap = (lambda c: grp.wrap(blk.wrap(c))) if grp else blk.wrap
            r = _spawn_ours(label, path, a, budget_gb=limit, wrap=wrap, first=arm["variant"] == "first",
                            long_prompt=a.long_prompt if arm["variant"] == "long" else 0)
        elif limit is not None and arm["variant"] in ("long", "best-long"):  # a long prompt in the limit
            flags = a.llama_best_flags if arm["variant"] == "best-long" else a.llama_cgroup_flags
            r = _llama_cgroup_long(a.llama_bench, path, a.long_prompt, a.threads,
                                   lambda: MemCgroup(int(limit * 1e9), a.cgroup_root), flags,
                                   wrap=blk.wrap if blk else None)
        elif limit is not None:  # llama.cpp's mmap in the same memory limit: decode only
            flags = a.llama_best_flags if arm["variant"] == "best" else a.llama_cgroup_flags
            r = _llama_cgroup_arm(a.llama_bench, path, a.tokens, a.threads,
                                  lambda: MemCgroup(int(limit * 1e9), a.cgroup_root), flags,
                                  wrap=blk.wrap if blk else None)
        else:
            r = _llama_arm(a.llama_bench, path, a.prompts, a.tokens, a.threads, inner_reps=a.inner_reps)
            if a.cpu_time:
                r.update(_llama_cpu_rates(a.llama_bench, path, a.prompts, a.tokens, a.threads))
        if grp is not None:
            r.update(grp.stats())
    finally:
        if grp is not None:
            grp.remove()
        if blk is not None:
            blk.remove()
    return {**r, "read_ahead_kb": read_ahead_kb(path), "read_bps": bps}


def main(a) -> int:
    """Run the interleaved arms; write bench/results/<name>.{json,md}. Returns 0, or 2 on bad input."""
    from .blockdev import blkio_available, device_of, read_ahead
    if a.reps < 1 or a.inner_reps < 1:
        print(f"--reps {a.reps} / --inner-reps {a.inner_reps}: both must be at least 1", file=sys.stderr)
        return 2
    for label, path in a.ours:
        if not (Path(path) / "manifest.json").exists():
            print(f"--ours {label}={path}: no store there (manifest.json missing); make one with "
                  f"`colibri convert`", file=sys.stderr)
            return 2
    a.ours_engine_commits = {}
    for label, checkout in a.ours_engine:
        if label not in dict(a.ours) or not (Path(checkout) / "engine" / "__init__.py").is_file():
            print(f"--ours-engine {label}={checkout}: expected the label of an --ours arm and a checkout "
                  f"holding engine/__init__.py", file=sys.stderr)
            return 2
        head = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True)
        a.ours_engine_commits[label] = {"checkout": str(Path(checkout).resolve()),
                                        "commit": head.stdout.strip() or None}
    for label, path in a.llama:
        if not Path(path).is_file():
            print(f"--llama {label}={path}: no GGUF file there; see bench/README.md (`colibri bench gguf`)",
                  file=sys.stderr)
            return 2
    if a.llama and not (Path(a.llama_bench).is_file() and os.access(a.llama_bench, os.X_OK)):
        print(f"--llama-bench {a.llama_bench}: not an executable; build llama.cpp natively "
              f"(bench/README.md)", file=sys.stderr)
        return 2
    paths = [p for _, p in a.ours] + [p for _, p in a.llama]
    try:
        dev_of = {p: device_of(p)[0] for p in paths}
    except OSError as e:
        print(f"{e}; put the stores and GGUFs on a block device (bench/README.md: the loop device)",
              file=sys.stderr)
        return 2
    cg_ok = False
    if a.cgroup_gb:
        from .peers import cgroup_available
        cg_ok, why = cgroup_available(a.cgroup_root)
        if not cg_ok:
            print(f"--cgroup-gb: {why}; the cgroup arms are skipped", file=sys.stderr)
    if a.cgroup_only and not cg_ok:
        print("--cgroup-only: no cgroup arm can run; nothing to do", file=sys.stderr)
        return 2
    if any(a.read_bps):
        ok, why = blkio_available(a.blkio_root)
        if not ok:
            print(f"--read-bps: {why}", file=sys.stderr)
            return 2
    arms = _plan_arms(a, cg_ok)
    a.disk_gbps = 0.0
    if any(arm["system"] == "ours" and arm["limit"] is not None for arm in arms):
        from .disk import measure_disk
        d = measure_disk(a.ours[0][1])
        a.disk_gbps = max(d["qd1_gbps"], d["qd4_gbps"])
        print(f"O_DIRECT slab reads: {d['qd1_gbps']:.2f} GB/s at queue depth 1, {d['qd4_gbps']:.2f} at 4",
              flush=True)
    rows = []
    try:
        with read_ahead(paths, a.read_ahead_kb):
            for rep in range(a.reps):
                for arm in (arms if rep % 2 == 0 else arms[::-1]):
                    load = os.getloadavg()[0]
                    t0 = time.perf_counter()
                    try:
                        r = _run_arm(a, arm, dev_of)
                    except (RuntimeError, OSError) as e:  # kept as a failed run: an arm that
                        print(str(e), file=sys.stderr)     # cannot run is a result too
                        lines = [x for x in str(e).splitlines() if x.strip()]
                        r = {"failed": " / ".join(lines[-2:])[-300:].replace("|", "/")}
                    row = {"arm": _arm_name(arm), "rep": rep, "load_avg_1m": load,
                           "wall_s": time.perf_counter() - t0, **r}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    _write(a, arms, rows, quiet=True)  # partial results survive an interrupted run
    except OSError as e:
        print(f"--read-ahead-kb {a.read_ahead_kb}: {e} (run as root, or pass --read-ahead-kb -1 to leave "
              f"the devices as they are and record their read-ahead)", file=sys.stderr)
        return 2
    _write(a, arms, rows)
    return 0


def add_parser(subparsers) -> None:
    """Register `bench kernels` on the bench verb's subparsers."""
    k = subparsers.add_parser("kernels", help="int4/int8 all resident vs native llama-bench Q4_0/Q8_0")
    k.add_argument("--ours", type=_parse_arm, nargs="+", default=[], metavar="LABEL=STORE",
                   help="our stores, e.g. int4=bench/work/olmoe-1b-7b-int4 int8=bench/work/olmoe-1b-7b-int8")
    k.add_argument("--ours-engine", type=_parse_arm, nargs="*", default=[], metavar="LABEL=CHECKOUT",
                   help="run the ours arm LABEL with the engine of another checkout (a before / after "
                        "comparison: --ours after=STORE before=STORE --ours-engine before=OLD --pair after/before)")
    k.add_argument("--llama", type=_parse_arm, nargs="*", default=[], metavar="LABEL=GGUF",
                   help="GGUFs for llama-bench, e.g. q4_0=...q4_0.gguf q8_0=...q8_0.gguf")
    k.add_argument("--pair", type=lambda s: tuple(s.split("/", 1)), nargs="*",
                   default=[("int4", "q4_0"), ("int8", "q8_0")], metavar="OURS/LLAMA",
                   help="ratios to report")
    k.add_argument("--llama-bench", default="llama-bench", help="path of the native llama-bench binary")
    k.add_argument("--prompts", type=int, nargs="+", default=[16, 128, 512], help="prefill lengths (tokens)")
    k.add_argument("--tokens", type=int, default=64, help="decoded tokens (tg)")
    k.add_argument("--threads", type=int, default=2)
    k.add_argument("--cpu-time", action="store_true",
                   help="also tokens per CPU-second (rusage, by difference): robust on a shared machine")
    k.add_argument("--cgroup-gb", type=float, default=None,
                   help="also run each pair in a cgroup v1 memory limit of this many GB: ours streamed at "
                        "that RAM budget, llama-bench tg on its mmap in the same limit")
    k.add_argument("--cgroup-only", action="store_true",
                   help="with --cgroup-gb: only the cgroup arms (for a model larger than RAM)")
    k.add_argument("--llama-cgroup-flags", default="",
                   help="llama-bench flags of the cgroup arms (default: none, llama.cpp's defaults, as its "
                        "users run it)")
    k.add_argument("--llama-best-flags", default=LLAMA_BEST_CGROUP_FLAGS,
                   help="a second llama.cpp cgroup arm (`-best`) with these flags (default %(default)r: "
                        "the file stays mapped, no Q4_0 repacking into anonymous memory); '' for none")
    k.add_argument("--first-answer", action="store_true",
                   help="also ours' first answer: a fresh process, the user's default settings (RAM budget, "
                        "context length, cap), timed cold on the first generation after open")
    k.add_argument("--long-prompt", type=int, default=0, metavar="N",
                   help="with --cgroup-gb: also a long first prompt of N tokens in each memory limit (ours "
                        "cold at that budget, llama-bench -p N -n 0): its prefill tok/s and the bytes read")
    k.add_argument("--read-ahead-kb", type=int, default=128,
                   help="set the read-ahead of the devices holding the stores and GGUFs for the run (KB; "
                        "distributions use 128, the default), restored after; -1 leaves them as they are. "
                        "Each row records its device's read-ahead")
    k.add_argument("--read-bps", type=float, nargs="+", default=[0],
                   help="cgroup arms: read bandwidths (bytes/s) to throttle to with a blkio cgroup, e.g. "
                        "0 2e9 5e8 (0 = unthrottled; default %(default)s)")
    k.add_argument("--blkio-root", default="/sys/fs/cgroup/blkio")
    k.add_argument("--cgroup-arms", nargs="*", default=None, metavar="LABEL",
                   help="labels that get a cgroup arm (default: every arm)")
    k.add_argument("--cgroup-root", default="/sys/fs/cgroup/memory")
    k.add_argument("--reps", type=int, default=3)
    k.add_argument("--inner-reps", type=int, default=1,
                   help="unconstrained arms: run each test this many times inside the arm's process "
                        "(llama-bench -r N; ours likewise) and keep the median")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--name", default="kernels_olmoe_1b_7b")
    k.add_argument("--out-dir", default="bench/results")
    k.set_defaults(fn=_checked_main)


def _checked_main(a) -> int:
    a.read_bps = [int(b) for b in a.read_bps]
    if any(b < 0 for b in a.read_bps):
        print(f"--read-bps {a.read_bps}: bandwidths must be 0 (unthrottled) or positive", file=sys.stderr)
        return 2
    if a.read_ahead_kb < 0:
        a.read_ahead_kb = None
    if a.long_prompt < 0 or (a.long_prompt and not a.cgroup_gb):
        print(f"--long-prompt {a.long_prompt}: a positive token count, with --cgroup-gb (it runs in the "
              f"memory limit)", file=sys.stderr)
        return 2
    return main(a)


def _arm_main(argv: list[str]) -> int:
    """Internal: one "ours" arm in this fresh process; prints ``ARM {json}``."""
    p = argparse.ArgumentParser(prog="python -m engine.bench.kernels")
    p.add_argument("--store", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, nargs="+", default=[16, 128, 512])
    p.add_argument("--cpu-time", action="store_true")
    p.add_argument("--budget-gb", type=float, default=None)
    p.add_argument("--inner-reps", type=int, default=1)
    p.add_argument("--first", action="store_true")
    p.add_argument("--long-prompt", type=int, default=0)
    a = p.parse_args(argv)
    r = _ours_arm(a.store, a.prompts, a.tokens, a.threads, a.seed, a.cpu_time, a.budget_gb, a.inner_reps, a.first,
                  a.long_prompt)
    print("ARM " + json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_arm_main(sys.argv[1:]))
