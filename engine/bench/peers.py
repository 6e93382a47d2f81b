"""``colibri bench peers``: decodes the same forced token stream with our engine, llama.cpp (a
Q8_0 GGUF from ``bench gguf``) and transformers, each in a fresh process, all weights resident
and inside cgroup v1 memory limits, every arm after a page-cache drop; reports tok/s, peak RSS
and the bytes each decoded token read from the block device."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .gguf import require_modules
from .common import add_stream_flags, forced_stream, machine_info, md_table, write_results

GB = 1_000_000_000
SYSTEMS = ("ours", "llama", "transformers")
CGROUP_ROOT = "/sys/fs/cgroup/memory"

def proc_read_bytes() -> int:
    """Bytes this process (all threads) caused to be read from a block device so far
    (``read_bytes`` of /proc/self/io: page-cache misses, mmap faults and O_DIRECT reads)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise OSError("/proc/self/io has no read_bytes line")

def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def _ctx_len(prompt_len: int, tokens: int) -> int:
    return -(-(prompt_len + tokens + 1) // 256) * 256

def _arm_llama(gguf_path: str, prompt: list, forced: list, threads: int, ctx: int) -> dict:
    import llama_cpp
    io0, t0 = proc_read_bytes(), time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=ctx, n_batch=max(len(prompt), 1),
                          n_ubatch=max(len(prompt), 1), n_threads=threads, n_threads_batch=threads,
                          logits_all=False, verbose=False)
    load_s, io1 = time.perf_counter() - t0, proc_read_bytes()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill_s, io2 = time.perf_counter() - t0, proc_read_bytes()
    t0 = time.perf_counter()
    for t in forced[:-1]:
        llm.eval([t])
    decode_s, io3 = time.perf_counter() - t0, proc_read_bytes()
    return {"precision": "Q8_0 GGUF (mmap)", "load_s": load_s, "load_read_bytes": io1 - io0,
            "prefill_s": prefill_s, "prefill_read_bytes": io2 - io1, "decode_s": decode_s,
            "decode_read_bytes": io3 - io2}

def _arm_transformers(checkpoint: str, prompt: list, forced: list, threads: int) -> dict:
    import torch
    from transformers import OlmoeForCausalLM
    torch.set_num_threads(threads)
    io0, t0 = proc_read_bytes(), time.perf_counter()
    m = OlmoeForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    load_s, io1 = time.perf_counter() - t0, proc_read_bytes()
    with torch.no_grad():
        t0 = time.perf_counter()
        out = m(torch.tensor([prompt]), use_cache=True)
        past = out.past_key_values
        prefill_s, io2 = time.perf_counter() - t0, proc_read_bytes()
        t0 = time.perf_counter()
        for t in forced[:-1]:
            out = m(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
        decode_s, io3 = time.perf_counter() - t0, proc_read_bytes()
    return {"precision": "bf16", "load_s": load_s, "load_read_bytes": io1 - io0, "prefill_s": prefill_s,
            "prefill_read_bytes": io2 - io1, "decode_s": decode_s, "decode_read_bytes": io3 - io2}

def _arm_ours(store: str, prompt: list, forced: list, threads: int, ctx: int, limit_gb: float | None,
              over: dict) -> dict:
    """Like bench.run_arm, plus /proc/self/io around the decode loop. All resident (limit None):
    cap = num_experts; under a limit: ram_budget_gb = the limit and the automatic cap."""
    from ..config import EngineConfig, ModelArgs
    from ..events import Finished, GenerateRequest, SamplingParams, StepMetrics, TokenEvent
    from ..generate import Engine
    from .prof import Profile
    E = ModelArgs.from_hf_config(Path(store) / "config.json").num_experts
    cfg = dict(o_direct=True, history=False, threads=threads, context_length=ctx)
    if limit_gb is None:
        cfg["cap"] = E
    else:
        cfg["ram_budget_gb"] = limit_gb
    cfg.setdefault("speculation", "off")  # forced ids: one forward a token, as llama.cpp decodes
    cfg.update(over)
    io0, t0 = proc_read_bytes(), time.perf_counter()
    eng = Engine.open(EngineConfig(store=store, **cfg))
    if limit_gb is None:
        # all resident, like llama.cpp's populated mmap: every expert is read during the load
        for layer in range(eng.args.num_moe_layers):  # expert rows = MoE layers
            eng.cache.load_experts(layer, np.arange(E))
    load_s, io1 = time.perf_counter() - t0, proc_read_bytes()
    try:
        req = GenerateRequest(prompt_ids=tuple(prompt), forced_ids=tuple(forced),
                              sampling=SamplingParams(max_new_tokens=len(forced)))
        prof = Profile(eng)
        fin, io2, t_first = None, None, None
        t0 = time.perf_counter()
        for ev in eng.generate(req):
            if isinstance(ev, TokenEvent) and ev.index == 0:
                io2, t_first = proc_read_bytes(), time.perf_counter()  # prefill done, decode next
            elif isinstance(ev, StepMetrics):
                prof.add(ev)
            elif isinstance(ev, Finished):
                fin = ev
                io3, t_end = proc_read_bytes(), time.perf_counter()
        if fin is None or fin.error:
            raise RuntimeError(f"our engine failed: {fin.error if fin else 'no Finished event'}")
        s = prof.summary(fin)
        return {"precision": f"{eng.store.quant} store (O_DIRECT)", "load_s": load_s,
                "load_read_bytes": io1 - io0, "prefill_s": t_first - t0, "prefill_read_bytes": io2 - io1,
                "decode_s": t_end - t_first, "decode_read_bytes": io3 - io2, "hit_rate": s["hit_rate"],
                "felt_wait_s": s["felt_wait_s"], "mb_per_token_engine": s["mb_per_token"],
                "cap": eng.cache.cap, "ram_budget_gb": eng.plan.budget / GB, "o_direct": eng.store.o_direct,
                "engine_decode_tok_per_s": fin.decode_tok_per_s}
    finally:
        eng.close()

def cmd_peer_arm(a) -> int:
    """Internal: one (system, memory setting) of ``bench peers`` in this fresh process; prints
    ``ARM {json}``. Decode = len(tokens) - 1 single-token steps after the prompt batch (the
    first forced token follows the prefill), as in ``bench decode``."""
    from ..config import ModelArgs
    src = a.store if a.system == "ours" else a.checkpoint
    args = ModelArgs.from_hf_config(Path(src) / "config.json")
    stream = forced_stream(args.vocab_size, a.prompt_len + a.tokens, a.seed)
    prompt, forced = stream[:a.prompt_len], stream[a.prompt_len:]
    ctx = _ctx_len(a.prompt_len, a.tokens)
    limit = None if a.limit_gb in (None, "none") else float(a.limit_gb)
    if a.system == "llama":
        r = _arm_llama(a.gguf, prompt, forced, a.threads, ctx)
    elif a.system == "transformers":
        r = _arm_transformers(a.checkpoint, prompt, forced, a.threads)
    else:
        r = _arm_ours(a.store, prompt, forced, a.threads, ctx, limit, json.loads(a.ours_config))
    steps = len(forced) - 1
    r.update(prompt_tokens=len(prompt), decode_steps=steps, prefill_tok_per_s=len(prompt) / r["prefill_s"],
             decode_tok_per_s=steps / r["decode_s"] if r["decode_s"] > 0 else None,
             read_bytes_per_token=r["decode_read_bytes"] / steps if steps else None,
             peak_rss_bytes=_maxrss(), threads=a.threads, context=ctx)
    print("ARM " + json.dumps(r), flush=True)
    return 0

def model_files(*paths) -> list[Path]:
    """Every regular file under the given files/folders (missing paths are skipped)."""
    out = []
    for p in paths:
        if not p:
            continue
        p = Path(p)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file())
    return out

def drop_page_cache(files: list[Path]) -> str:
    """Make the next reads of ``files`` cold. Tries ``sync; echo 3 > /proc/sys/vm/drop_caches``
    (whole page cache); when that is not permitted, ``posix_fadvise(DONTNEED)`` on every file.
    Returns the method used: "drop_caches", "fadvise" or "none (...reason...)"."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError as e:
        why = f"{type(e).__name__}: {e.strerror or e}"
    if not hasattr(os, "posix_fadvise"):
        return f"none (drop_caches: {why}; no posix_fadvise)"
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"

class MemCgroup:
    """A cgroup v1 memory group ``<root>/colibri_bench_<pid>_<n>``; ``limit_bytes`` None = no
    limit (still accounted: max_usage_in_bytes gives the arm's peak, page cache included).

    Raises OSError from the constructor when the group cannot be created or configured.
    """

    _n = 0

    def __init__(self, limit_bytes: int | None, root: str = CGROUP_ROOT):
        MemCgroup._n += 1
        self.path = Path(root) / f"colibri_bench_{os.getpid()}_{MemCgroup._n}"
        self.path.mkdir()
        try:
            if limit_bytes is not None:
                (self.path / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
            try:
                (self.path / "memory.swappiness").write_text("0")
            except OSError:
                pass
        except BaseException:
            self.remove()
            raise

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` started through sh, which joins the group before exec'ing it (so the child
        is accounted from its first allocation)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *cmd]

    def stats(self) -> dict:
        """max_usage_in_bytes, failcnt and the oom_kill count (bytes / counts)."""
        def read(name):
            try:
                return (self.path / name).read_text()
            except OSError:
                return ""
        oom = dict(line.split() for line in read("memory.oom_control").splitlines() if len(line.split()) == 2)
        return {"cgroup_max_usage_bytes": int(read("memory.max_usage_in_bytes") or 0),
                "cgroup_failcnt": int(read("memory.failcnt") or 0),
                "cgroup_oom_kills": int(oom.get("oom_kill", 0))}

    def remove(self) -> None:
        from .blockdev import remove_group
        remove_group(self.path)

def cgroup_available(root: str = CGROUP_ROOT) -> tuple[bool, str]:
    """(True, "") when a memory cgroup can be created under ``root``, else (False, reason)."""
    if not (Path(root) / "memory.limit_in_bytes").exists():
        return False, f"{root} is not a cgroup v1 memory hierarchy"
    try:
        g = MemCgroup(None, root)
    except OSError as e:
        return False, f"cannot create a memory cgroup under {root} ({e})"
    g.remove()
    return True, ""

def _run_arm(system: str, setting, a, use_cgroup: bool) -> dict:
    """One arm in a fresh subprocess (inside a memory cgroup when ``use_cgroup``)."""
    cmd = [sys.executable, "-m", "engine.cli", "bench", "peer-arm", "--system", system,
           "--checkpoint", a.checkpoint, "--store", a.store, "--gguf", a.gguf,
           "--limit-gb", str(setting), "--prompt-len", str(a.prompt_len), "--tokens", str(a.tokens),
           "--seed", str(a.seed), "--threads", str(a.threads), "--ours-config", a.ours_config]
    row = {"system": system, "limit": setting}
    grp = None
    if use_cgroup:
        try:
            grp = MemCgroup(None if setting == "none" else int(float(setting) * GB), a.cgroup_root)
        except OSError as e:
            row["status"] = f"skipped (cgroup: {e})"
            return row
        cmd = grp.wrap(cmd)
    try:
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            rc, stdout, stderr = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = None, e.stdout or "", e.stderr or ""
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
            stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
        row["wall_s"] = time.perf_counter() - t0
        if grp is not None:
            row.update(grp.stats())
    finally:
        if grp is not None:
            grp.remove()
    line = next((x for x in stdout.splitlines() if x.startswith("ARM ")), None)
    if line is not None and rc == 0:
        row.update(json.loads(line[4:]), status="ok")
    elif rc is None:
        row["status"] = f"timeout ({a.timeout:.0f} s)"
    elif rc == -signal.SIGKILL or row.get("cgroup_oom_kills"):
        row["status"] = "killed (OOM)"
    else:
        row["status"] = f"failed (exit {rc})"
        row["error"] = stderr.strip().splitlines()[-1][:300] if stderr.strip() else ""
        print(f"{system} @ {setting}: failed:\n{stderr[-3000:]}", file=sys.stderr)
    return row

PRECISION = {"ours": "int8 store", "llama": "Q8_0 GGUF", "transformers": "bf16"}

def cmd_peers(a) -> int:
    """``colibri bench peers``: every (system, memory setting) arm in a fresh process, arms
    interleaved, page cache dropped before each, reps reversed on odd rounds."""
    for s in a.systems:
        if s not in SYSTEMS:
            raise ConfigError(f"--systems: unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if "llama" in a.systems:
        require_modules(("llama_cpp",), "--systems llama")
    if "transformers" in a.systems:
        require_modules(("torch", "transformers"), "--systems transformers")
    if "llama" in a.systems and not Path(a.gguf).is_file():
        raise ConfigError(f"--gguf {a.gguf}: no such file; write it first with "
                          f"`colibri bench gguf --checkpoint {a.checkpoint} --out {a.gguf}`")
    if {"llama", "transformers"} & set(a.systems) and not (Path(a.checkpoint) / "config.json").is_file():
        raise ConfigError(f"--checkpoint {a.checkpoint}: no config.json; give a Hugging Face OLMoE folder")
    if "ours" in a.systems and not (Path(a.store) / "manifest.json").is_file():
        raise ConfigError(f"--store {a.store}: no manifest.json; not a converted store (colibri convert)")
    for lim in a.limits:
        if not 0.1 <= lim <= 1 << 16:
            raise ConfigError(f"--limits: {lim} GB is out of range (0.1-65536)")
    ok, why = cgroup_available(a.cgroup_root)
    notes = []
    if not ok:
        notes.append(f"memory cgroups unavailable: {why}; limited rows skipped")
        print(f"note: {notes[-1]}", file=sys.stderr)
    settings = ["none"] + ([f"{x:g}" for x in a.limits] if ok else [])
    arms = [(sysname, s) for s in settings for sysname in a.systems]
    files = model_files(a.checkpoint if {"llama", "transformers"} & set(a.systems) else None,
                        a.store if "ours" in a.systems else None,
                        a.gguf if "llama" in a.systems else None)
    rows, methods = [], set()
    for rep in range(a.reps):
        for sysname, setting in (arms if rep % 2 == 0 else list(reversed(arms))):
            method = drop_page_cache(files)
            methods.add(method)
            r = _run_arm(sysname, setting, a, ok)
            r.update(rep=rep, cache_drop=method)
            r.setdefault("precision", PRECISION[sysname])
            r["limit_label"] = "all resident" if setting == "none" else f"{setting} GB"
            for k in ("peak_rss_bytes", "cgroup_max_usage_bytes"):
                if r.get(k) is not None:
                    r[k.replace("_bytes", "_gb")] = r[k] / GB
            if r.get("read_bytes_per_token") is not None:
                r["read_mb_per_token"] = r["read_bytes_per_token"] / 1e6
            if r.get("load_read_bytes") is not None:
                r["load_read_gb"] = r["load_read_bytes"] / GB
            rows.append(r)
            if r["status"] == "ok":
                extra = (f", hit {100 * r['hit_rate']:.1f}%, felt wait {r['felt_wait_s']:.2f} s"
                         if "hit_rate" in r else "")
                print(f"rep {rep} {sysname:12s} {r['limit_label']:>12s}: prefill {r['prefill_tok_per_s']:.1f} "
                      f"tok/s, decode {r['decode_tok_per_s']:.2f} tok/s, peak RSS {r['peak_rss_gb']:.2f} GB, "
                      f"{r['read_mb_per_token']:.2f} MB read/token{extra}", flush=True)
            else:
                print(f"rep {rep} {sysname:12s} {r['limit_label']:>12s}: {r['status']}", flush=True)
    table = md_table(rows, [
        ("system", "system", ""), ("precision", "precision", ""), ("memory", "limit_label", ""),
        ("rep", "rep", "d"), ("status", "status", ""), ("load s", "load_s", ".1f"),
        ("load GB read", "load_read_gb", ".2f"), ("prefill tok/s", "prefill_tok_per_s", ".1f"),
        ("decode tok/s", "decode_tok_per_s", ".2f"), ("peak RSS GB", "peak_rss_gb", ".2f"),
        ("cgroup peak GB", "cgroup_max_usage_gb", ".2f"), ("disk MB read / token", "read_mb_per_token", ".2f"),
        ("hit %", "hit_rate", ".1%"), ("felt wait s", "felt_wait_s", ".2f")])
    table += (f"\n\nForced stream: {a.prompt_len} prompt tokens (one batch) + {a.tokens - 1} single-token "
              f"decode steps, seed {a.seed}, {a.threads} threads; one cold pass per arm (page cache dropped "
              f"by {', '.join(sorted(methods))}). Disk MB read / token: /proc/self/io read_bytes over the "
              f"decode loop / decode steps. Load GB read: the same counter while opening the model "
              f"(llama.cpp maps the GGUF with MAP_POPULATE and reads all of it at load; our engine, all resident, "
              f"reads every expert at load too; under a limit it reads them on demand). Limits: cgroup v1 memory.limit_in_bytes "
              f"(1 GB = 1e9 bytes); cgroup peak = memory.max_usage_in_bytes (page cache included).")
    if notes:
        table += "\n\n" + "\n".join(f"Note: {n}" for n in notes)
    write_results(a.name, {"machine": machine_info(), "checkpoint": a.checkpoint, "store": a.store,
                           "gguf": a.gguf, "prompt_len": a.prompt_len, "tokens": a.tokens, "seed": a.seed,
                           "threads": a.threads, "limits_gb": a.limits, "cgroups": ok, "cgroup_note": why,
                           "cache_drop": sorted(methods), "rows": rows}, table)
    return 0


def add_parser(bs) -> None:
    """Register `peers`, `peer-arm` under ``colibri bench``."""
    p = bs.add_parser("peers", help="ours vs llama.cpp vs transformers, all resident and in cgroup memory limits")
    p.add_argument("--checkpoint", default="bench/work/1b-hf")
    p.add_argument("--store", default="bench/work/1b-int8")
    p.add_argument("--gguf", default="bench/work/1b-q8_0.gguf")
    p.add_argument("--limits", type=float, nargs="*", default=[], help="memory limits in GB (1e9 bytes)")
    add_stream_flags(p, prompt_len=32, tokens=64)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), help="ours llama transformers")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per arm")
    p.add_argument("--ours-config", default="{}", help="JSON EngineConfig overrides for our arms")
    p.add_argument("--cgroup-root", default=CGROUP_ROOT)
    p.add_argument("--name", default="peers_1b")
    p.set_defaults(fn=cmd_peers)

    r = bs.add_parser("peer-arm")  # internal (hidden from the verb list)
    r.add_argument("--system", choices=SYSTEMS, required=True)
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--store", required=True)
    r.add_argument("--gguf", required=True)
    r.add_argument("--limit-gb", default="none")
    add_stream_flags(r, prompt_len=32, tokens=64)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--ours-config", default="{}")
    r.set_defaults(fn=cmd_peer_arm)
