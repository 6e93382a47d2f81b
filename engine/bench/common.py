"""Helpers shared by the benchmark verbs: results as JSON + markdown, machine facts, token
streams, peak RSS, input checks before any arm starts."""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from pathlib import Path

import numpy as np


PRESETS = {
    # >= 1B parameters, OLMoE-shaped: 1.14B params, 8 x 64 experts.
    "1b": dict(hidden_size=1024, intermediate_size=640, num_hidden_layers=8, num_attention_heads=16,
               num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
               max_position_embeddings=4096),
    # allenai/OLMoE-1B-7B's exact shape: 6.9B params, ~13.8 GB bf16.
    "olmoe-1b-7b": dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                        num_experts_per_tok=8, vocab_size=50304, max_position_embeddings=4096),
}

BENCH_KEYS = ("warm_all", "routing_trace", "routing_seed", "idle_s")  # arm overrides that are not engine settings


def machine_info() -> dict:
    """CPU, its model name and integer-kernel path (kernels.INT_FLAVOR: "vnni", "bw", "avx2" or
    "portable"), cores, RAM (GB), Python version, the OpenMP wait settings the kernels' threads
    run with (GOMP_SPINCOUNT / OMP_WAIT_POLICY, None = unset) and the time, recorded with every
    result."""
    import psutil

    from .. import kernels
    from ..sysinfo import cpu_name
    return {"cpu": platform.processor() or platform.machine(), "cpu_model": cpu_name(),
            "int_kernels": kernels.INT_FLAVOR, "cores": os.cpu_count(),
            "ram_gb": round(psutil.virtual_memory().total / 1e9, 1), "python": platform.python_version(),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}

def check_results_target(out_dir: str, name: str | None) -> None:
    """Refuse, before a benchmark runs, result files :func:`write_results` could not write:
    ``out_dir`` (or a folder above it) an existing file, ``out_dir`` a folder this user cannot
    write, or ``name`` not a plain file name (it names ``<out_dir>/<name>.json`` and ``.md``;
    empty lets the command choose).

    Raises:
        ValueError: naming the setting and what to give instead.
    """
    d = Path(out_dir)
    for p in (d, *d.parents):
        if p.exists():
            if not p.is_dir():
                raise ValueError(f"--out-dir {out_dir}: {p} is a file, not a folder; give a folder for the "
                                 f"result files (it is created if missing)")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ValueError(f"--out-dir {out_dir}: {p} is not writable; give a folder you can write")
            break
    if name and (Path(name).name != name or name in (".", "..") or "\\" in name):
        raise ValueError(f"--name {name!r}: give a plain file name, without folders (the results go to "
                         f"{out_dir}/<name>.json and .md)")


def write_results(name: str, data: dict, table: str, out_dir: str = "bench/results") -> Path:
    """Write ``<out_dir>/<name>.json`` and ``.md`` atomically, print the table; returns the JSON path."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    from ..fsutil import atomic_write_text
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

def run_forced(eng, prompt, forced):
    """One teacher-forced generation on the open Engine ``eng``: prompt ids, then ``forced``
    ids fed as the output (len(forced) tokens); returns its Finished event.

    Raises:
        RuntimeError: the generation ended with an error (named with the store's path).
    """
    from ..events import Finished, GenerateRequest, SamplingParams
    req = GenerateRequest(prompt_ids=tuple(prompt), forced_ids=tuple(forced),
                          sampling=SamplingParams(max_new_tokens=len(forced)))
    fin = [e for e in eng.generate(req) if isinstance(e, Finished)][0]
    if fin.error:
        raise RuntimeError(f"{eng.store.path}: {fin.error}")
    return fin


def heldout_stream(path: str | Path) -> list[int]:
    """Token ids of a held-out file (JSON lines with an "ids" list each), concatenated: real
    text, so a trained model routes as it does on real input (teacher forced, never sampled)."""
    out: list[int] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.extend(json.loads(line)["ids"])
    return out

def check_arm_inputs(store: str, arms: list[dict], stream_file: str | None, need_tokens: int) -> None:
    """Refuse bad bench inputs in the parent, before any arm process starts.

    Raises:
        ValueError / ConfigError: naming the store, the stream file or the setting.
    """
    from ..config import EngineConfig
    if not (Path(store) / "manifest.json").is_file():
        raise ValueError(f"--store {store}: not a converted store (no manifest.json); "
                         f"make one with `colibri convert HF_FOLDER STORE`")
    for over in arms:
        EngineConfig(store=store, **{k: v for k, v in over.items() if k not in BENCH_KEYS}).validated()
        if over.get("routing_trace"):
            from ..config import ModelArgs
            from ..trace import RecordedRouting
            a = ModelArgs.from_hf_config(Path(store) / "config.json")
            RecordedRouting(over["routing_trace"], a.num_moe_layers, a.num_experts)  # refuses a bad trace
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


def add_stream_flags(p, prompt_len: int, tokens: int) -> None:
    """The token-stream flags of a decoding bench: --prompt-len and --tokens (with these
    defaults) and --seed (of the forced stream, default 0)."""
    p.add_argument("--prompt-len", type=int, default=prompt_len)
    p.add_argument("--tokens", type=int, default=tokens)
    p.add_argument("--seed", type=int, default=0)
