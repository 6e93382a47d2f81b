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


def _store_from_seed(a) -> int:
    """Presets too large for a bf16 checkpoint on this disk: the quantized store straight from
    the seed (synthetic.write_store_from_seed), timing the writer and its peak RSS."""
    from ..synthetic import PRESETS as SHAPES, write_store_from_seed
    from ..config import ModelArgs
    from ..quant import slab_layout
    cfg = SHAPES[a.preset]
    args = ModelArgs.from_dict(cfg)
    slot = slab_layout(a.quant, args.hidden_size, args.moe_intermediate_size)["slot_bytes"]
    need = slot * args.num_moe_layers * args.num_experts + args.dense_param_count() * 1.1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if free < need + a.keep_free_gb * 1e9:
        print(f"not enough disk for the {a.preset} {a.quant} store: need {need / 1e9:.1f} GB + "
              f"{a.keep_free_gb:g} GB kept free, {free / 1e9:.1f} GB free at {out}", file=sys.stderr)
        return 2
    st = out / f"{a.preset}-{a.quant}"
    t0, last = time.perf_counter(), [0.0]

    def progress(p):
        now = time.perf_counter()
        if now - last[0] > 30:
            last[0] = now
            print(f"{now - t0:.0f} s: {p.done / 1e9:.1f} / {p.total / 1e9:.1f} GB of source ({p.message})", flush=True)
    with PeakRss() as pr:
        write_store_from_seed(st, cfg, quant=a.quant, seed=a.seed, overwrite=True, progress=progress,
                              expert_draw=a.expert_draw)
    dt = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in st.rglob("*") if f.is_file())
    res = {"preset": a.preset, "quant": a.quant, "expert_draw": a.expert_draw, "store": str(st),
           "store_gb": size / 1e9, "write_s": dt, "write_peak_rss_gb": pr.peak / 1e9, "machine": machine_info()}
    print(f"wrote {st} ({size / 1e9:.2f} GB) in {dt:.0f} s, peak RSS {pr.peak / 1e9:.2f} GB")
    write_results(f"make_synthetic_{a.preset}_{a.quant}", res, md_table([res], [
        ("preset", "preset", ""), ("quant", "quant", ""), ("expert draw", "expert_draw", ""),
        ("store GB", "store_gb", ".2f"), ("write s", "write_s", ".0f"),
        ("peak RSS GB", "write_peak_rss_gb", ".2f")]))
    return 0


def cmd_make_synthetic(a) -> int:
    from ..synthetic import PRESETS as SHAPES
    if a.preset in SHAPES:
        return _store_from_seed(a)
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
    from ..synthetic import EXPERT_DRAWS, PRESETS as SHAPES
    m.add_argument("--preset", choices=sorted(PRESETS) + sorted(SHAPES), default="1b",
                   help=f"{', '.join(sorted(SHAPES))}: the quantized store is written straight from the seed")
    m.add_argument("--out", default="bench/work")
    m.add_argument("--quant", default="int8")
    m.add_argument("--expert-draw", choices=EXPERT_DRAWS, default="exact",
                   help="store-from-seed presets: 'codes' draws the experts' quantized codes directly (fast)")
    m.add_argument("--keep-free-gb", type=float, default=3.0,
                   help="store-from-seed presets: refuse unless this much disk stays free afterwards")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--force", action="store_true")
    m.set_defaults(fn=cmd_make_synthetic)
