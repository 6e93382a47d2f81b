"""Build the pre-built compute kernels that ship with colibri (engine/kernel_cache.py): for each
fixed CPU target, compile in a fresh numba cache every kernel the default model needs with each
setting that chooses kernels (PILOT off / on, each KV cache type), answer one question with the
default settings in the same process (so kernels only a real answer calls are in too), and pack
the cache into resources/kernels/<python>-numba<version>-<level>.tar.xz.

    python tools/build_kernel_cache.py [--levels x86-64-v3,x86-64-v4,x86-64-v4-vnni] [--out DIR] [--store PATH]

Run it with each Python the release supports (the archive is per Python and numba version),
on a CPU that has every level's features (the answers run the code), and again whenever a
file of engine/kernels/ changes: an archive built from other sources is skipped kernel file by
kernel file (those compile at first use). A rebuild reuses the kernels of the archive it
replaces whose source files did not change (``--fresh`` compiles everything).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTION = "What does json.dumps do?"
DEFAULT_LEVELS = "x86-64-v3,x86-64-v4,x86-64-v4-vnni"


def build_one(level: str, cache: str, out: str, store: str | None, fresh: bool = False) -> dict:
    """In a process whose environment pins ``level`` and points numba at ``cache``: compile, answer,
    pack. Unless ``fresh``, the kernels of the archive already at the output path whose source
    files did not change are loaded from it, not compiled again."""
    from engine import ChatMessage, Engine, EngineConfig, GenerateRequest, SamplingParams, TokenEvent
    from engine import kernel_prepare as kp
    from engine.expert_store import ExpertStore
    from engine.kernel_cache import _merge, archive_name, pack
    from engine.kernels import setup
    from engine.library import default_store
    import numba
    assert setup.TARGET.level == level and setup.CACHE_DIR == cache, (setup.TARGET, setup.CACHE_DIR)
    path = Path(out) / archive_name(level, numba.__version__)
    reused = _merge(path, cache, setup.TARGET)[0] if path.is_file() and not fresh else "a fresh build"
    store = store or str(default_store())
    base = EngineConfig(store=store)
    cfgs = [base] + kp.kernel_variants(base)
    with ExpertStore(store, o_direct=False) as st:
        kinds = [kp.kernel_kind(st.args, st, c) for c in cfgs]
    t0 = time.perf_counter()
    for cfg in cfgs:  # what the compile child runs (engine.generate.compile_child), here and with no time limit
        eng = Engine.open(EngineConfig.from_dict(kp.child_config(cfg)), prepare_kernels=False)
        try:
            eng.model.wait_decode_ready(None)
            for _ in eng.generate(GenerateRequest(prompt_ids=(1, 2, 3), sampling=SamplingParams(max_new_tokens=2))):
                pass
        finally:
            eng.close()
    req = GenerateRequest(messages=(ChatMessage("user", QUESTION),), sampling=SamplingParams(max_new_tokens=8))
    with Engine.open(base) as eng:
        answer = "".join(ev.text for ev in eng.generate(req) if isinstance(ev, TokenEvent))
    man = pack(cache, path, setup.TARGET, kinds)
    return {"level": level, "archive": str(path), "bytes": path.stat().st_size, "kinds": len(kinds),
            "folders": man["folders"], "seconds": round(time.perf_counter() - t0, 1), "answer": answer,
            "reused": reused}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default=DEFAULT_LEVELS, help=f"comma-separated targets (default {DEFAULT_LEVELS})")
    ap.add_argument("--out", default=str(ROOT / "resources" / "kernels"), help="where the archives go")
    ap.add_argument("--store", help="a converted store (default: the bundled default model, converted)")
    ap.add_argument("--fresh", action="store_true",
                    help="compile everything (default: reuse the kernels of the archive being replaced "
                         "whose source files did not change)")
    ap.add_argument("--work", help="keep each level's numba cache in DIR/<level> (a build that was "
                                   "stopped then goes on where it was; default: a temporary folder)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the per-level child process
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(build_one(a.one, a.cache, a.out, a.store, a.fresh)), flush=True)
        return 0
    rc = 0
    for level in [x.strip() for x in a.levels.split(",") if x.strip()]:
        with tempfile.TemporaryDirectory(prefix="kernel-cache-") as tmp:
            cache = os.path.join(a.work, level) if a.work else tmp
            env = {k: v for k, v in os.environ.items()
                   if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "COLIBRI_INT_KERNEL")}
            # every compile in the one process (no compile child, whose time limit a busy machine can reach)
            env.update(COLIBRI_KERNEL_TARGET=level, NUMBA_CACHE_DIR=cache, COLIBRI_SHIPPED_KERNELS="0",
                       COLIBRI_COMPILE_IN_PROCESS="1")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", level, "--cache", cache, "--out", a.out]
            if a.store:
                cmd += ["--store", a.store]
            if a.fresh:
                cmd += ["--fresh"]
            p = subprocess.run(cmd, env=env, cwd=str(ROOT))
            if p.returncode != 0:
                print(f"{level}: the build failed (exit code {p.returncode})", file=sys.stderr)
                rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
