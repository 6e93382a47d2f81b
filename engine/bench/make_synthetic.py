"""``colibri bench make-synthetic``: write a seeded random OLMoE-shaped checkpoint (presets: 1b,
olmoe-1b-7b) and convert it, measuring the converter's speed and peak RSS."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import PRESETS, PeakRss, machine_info, md_table, write_results


def cmd_make_synthetic(a) -> int:
    """Write the preset's seeded bf16 checkpoint and convert it in a subprocess (so its peak RSS
    is the converter's alone); refuses when the disk cannot hold both."""
    from ..synthetic import olmoe_config, write_checkpoint
    from ..config import ModelArgs
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


def add_parser(bs) -> None:
    """Register `make-synthetic` under ``colibri bench``."""
    m = bs.add_parser("make-synthetic", help="write + convert a seeded random OLMoE-shaped model")
    m.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    m.add_argument("--out", default="bench/work")
    m.add_argument("--quant", default="int8")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--force", action="store_true")
    m.set_defaults(fn=cmd_make_synthetic)
