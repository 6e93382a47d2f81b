"""``colibri bench make-synthetic``: a seeded random model of a preset's shape, measuring the
writer's and the converter's speed and peak RSS.

Presets: ``1b`` and ``olmoe-1b-7b`` (OLMoE-shaped, bench.common.PRESETS) and the exact shapes of
Qwen3-30B-A3B (``qwen3-30b-a3b``) and Mixtral-8x7B (``mixtral-8x7b``) from
engine.bench.synthetic.PRESETS.

Default mode: write a bf16 Hugging Face checkpoint (``OUT/<preset>-hf``), then convert it in a
subprocess (``OUT/<preset>-<quant>``). ``--direct-store`` writes the quantized store straight
from the seed (engine.bench.synthetic.write_store_from_seed) for shapes too large to write as a bf16
checkpoint first (Qwen3-30B-A3B: 61 GB of bf16); the weights equal those of the default mode.
What it skips: no checkpoint exists, so nothing can be compared with transformers (no `bench
decode` / `peers` on it; llama.cpp gets the same weights from `bench gguf --preset P --from-seed`
with the same --seed / --layers / --expert-draw), the converter's reading of safetensors is not
measured, and the tokenizer is the small synthetic BPE (benchmarks force token ids).
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .common import PRESETS as OLMOE_PRESETS
from .common import PeakRss, machine_info, md_table, write_results

DIRECT_QUANTS = ("int8", "int4", "mxfp4")


def preset_names() -> list[str]:
    """Every preset: the OLMoE-shaped ones and engine.bench.synthetic.PRESETS."""
    from .synthetic import PRESETS
    return sorted({*OLMOE_PRESETS, *PRESETS})


def preset_config(name: str) -> dict:
    """The config.json dict of preset ``name``. Raises KeyError for an unknown name."""
    from .synthetic import PRESETS, olmoe_config
    if name in PRESETS:
        return dict(PRESETS[name])
    return olmoe_config(**OLMOE_PRESETS[name])


def cut_layers(cfg: dict, preset: str, layers: int = 0, dense_layers: int | None = None) -> tuple[dict, str]:
    """``cfg`` (preset ``preset``'s config dict, changed in place) with only its first ``layers``
    layers (0 = all; per-layer lists cut too) and ``dense_layers`` dense first layers, and the
    folder name stem (``<preset>[-<N>l][-<D>d]``). Raises ValueError (the message names the
    option) when the numbers do not fit the preset."""
    name = preset
    if dense_layers is not None:
        if "first_k_dense_replace" not in cfg or not 0 <= dense_layers < (layers or cfg["num_hidden_layers"]):
            raise ValueError(f"--dense-layers {dense_layers}: only for presets with dense first layers "
                             "(first_k_dense_replace), and fewer than the layers kept")
        cfg["first_k_dense_replace"] = dense_layers
        name = f"{name}-{dense_layers}d"
    if layers:
        dense_first = int(cfg.get("first_k_dense_replace", 0) or 0)
        if not 1 <= layers <= int(cfg["num_hidden_layers"]) or layers <= dense_first:
            raise ValueError(f"--layers {layers}: give 1..{cfg['num_hidden_layers']} (the preset's layer count)"
                             + (f", more than its {dense_first} dense first layers" if dense_first else ""))
        L0 = int(cfg["num_hidden_layers"])
        cfg["num_hidden_layers"] = layers
        for key in ("max_window_layers",):
            if key in cfg:
                cfg[key] = min(int(cfg[key]), layers)
        for key, v in list(cfg.items()):  # per-layer lists (layer_types, mlp_layer_types, ...)
            if isinstance(v, list) and len(v) == L0 and key not in ("architectures", "eos_token_id"):
                cfg[key] = v[:layers]
        name = f"{preset}-{layers}l" + name[len(preset):]
    return cfg, name


def _progress_printer(label: str):
    """A LoadProgress callback printing every ~5% of bytes (stdout, one line each)."""
    last = [-1]

    def show(ev) -> None:
        if not ev.total:
            return
        pct = int(100 * ev.done / ev.total)
        if pct // 5 != last[0] // 5 or ev.done >= ev.total:
            last[0] = pct
            print(f"{label}: {pct:3d}% ({ev.done / 1e9:.2f} of {ev.total / 1e9:.2f} GB)", flush=True)
    return show


def cmd_make_synthetic(a) -> int:
    from ..config import ModelArgs
    from ..sizing import estimate
    if a.direct_store and a.quant not in DIRECT_QUANTS:
        print(f"--direct-store writes --quant {' or '.join(DIRECT_QUANTS)} (got {a.quant!r})", file=sys.stderr)
        return 2
    if a.dense_quant and not a.direct_store:
        print("--dense-quant applies to --direct-store; for a checkpoint, convert it with "
              "`colibri convert CKPT DST --quant Q --dense-quant D`", file=sys.stderr)
        return 2
    try:
        cfg, name = cut_layers(preset_config(a.preset), a.preset, a.layers, a.dense_layers)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    args = ModelArgs.from_dict(cfg)
    n_params = (args.dense_param_count() + args.num_moe_layers * args.num_experts * 3
                * args.hidden_size * args.moe_intermediate_size)
    store_bytes = estimate(args, a.quant, 0).store_bytes
    ck = Path(a.out) / f"{name}-hf"
    st = Path(a.out) / (f"{name}-{a.quant}" + (f"-dense{a.dense_quant.removeprefix('int')}" if a.dense_quant else ""))
    have_ck = (ck / "config.json").exists() and not a.force
    need = store_bytes + (0 if a.direct_store or have_ck else n_params * 2)  # + bf16 checkpoint
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if free < need * 1.05 + a.keep_free_gb * 1e9:
        print(f"not enough disk: need {need / 1e9:.1f} GB ({'store' if a.direct_store else 'bf16 checkpoint + store'}),"
              f" {free / 1e9:.1f} GB free at {out}"
              + ("" if a.direct_store or a.quant not in DIRECT_QUANTS else "; --direct-store skips the checkpoint"),
              file=sys.stderr)
        return 2
    res = {"preset": a.preset, "num_hidden_layers": args.num_hidden_layers, "model_type": args.model_type, "params": n_params, "quant": a.quant,
           "expert_draw": a.expert_draw if a.direct_store else "exact",
           "mode": "direct-store" if a.direct_store else "checkpoint+convert", "machine": machine_info()}
    if a.direct_store:
        from .synthetic import write_store_from_seed
        if (st / "manifest.json").exists() and not a.force:
            print(f"{st} exists (use --force to write it again)")
            return 0
        t0 = time.perf_counter()
        with PeakRss() as pr:
            write_store_from_seed(st, cfg, quant=a.quant, seed=a.seed, overwrite=True,
                                  progress=_progress_printer(f"writing {st.name}"), expert_draw=a.expert_draw,
                                  dense_quant=a.dense_quant)
        dt = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in st.rglob("*") if f.is_file())
        res.update(store_write_s=dt, store_gb=size / 1e9, store_mb_per_s=size / 1e6 / dt,
                   store_peak_rss_gb=pr.peak / 1e9)
        print(f"wrote {st} ({n_params / 1e9:.2f} B params, {size / 1e9:.2f} GB) in {dt:.0f} s, "
              f"peak RSS {pr.peak / 1e9:.2f} GB")
        write_results(f"make_synthetic_{name}_{st.name.removeprefix(name + '-')}_direct", res, md_table([res], [
            ("preset", "preset", ""), ("quant", "quant", ""), ("params (B)", "params", ".3g"),
            ("store GB", "store_gb", ".2f"), ("write s", "store_write_s", ".0f"),
            ("MB/s", "store_mb_per_s", ".0f"), ("peak RSS GB", "store_peak_rss_gb", ".2f")]))
        return 0
    from .synthetic import write_checkpoint
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
        write_results(f"make_synthetic_{name}", res, md_table([res], [
            ("preset", "preset", ""), ("params (B)", "params", ".3g"), ("convert s", "convert_s", ".0f"),
            ("MB/s", "convert_mb_per_s", ".0f"), ("converter peak RSS GB", "convert_peak_rss_gb", ".2f")]))
    return 0


def add_parser(bs) -> None:
    """Register `make-synthetic` under ``colibri bench``."""
    m = bs.add_parser("make-synthetic", help="write a seeded random model of a preset's shape (OLMoE 1b / 1b-7b, "
                      "Qwen3-30B-A3B, Mixtral-8x7B) and convert it, or write the store directly")
    m.add_argument("--preset", choices=preset_names(), default="1b")
    m.add_argument("--out", default="bench/work")
    m.add_argument("--quant", default="int8", choices=("int8", "int4", "f16", "f32", "mxfp4"))
    m.add_argument("--dense-quant", default=None, choices=("int8", "int4", "f16", "f32"),
                   help="--direct-store: quantization of the resident dense matrices (default: the "
                        "converter's default for --quant); the store is named <preset>-<quant>-dense<N>")
    m.add_argument("--direct-store", action="store_true",
                   help="write the int8/int4 store straight from the seed, no bf16 checkpoint (for shapes too "
                        "large to write as one; no transformers comparison then; llama.cpp's GGUF of the same "
                        "weights: `bench gguf --preset P --from-seed`)")
    from .synthetic import EXPERT_DRAWS
    m.add_argument("--expert-draw", choices=EXPERT_DRAWS, default="exact",
                   help="--direct-store: 'codes' draws the experts' quantized codes directly (fast; the "
                        "default 'exact' quantizes the seeded bf16 draw, as the checkpoint mode does)")
    m.add_argument("--keep-free-gb", type=float, default=3.0,
                   help="refuse unless this much disk stays free afterwards (GB)")
    m.add_argument("--layers", type=int, default=0,
                   help="keep only the first N layers of the preset (its dense first layers included), for "
                        "shapes whose store would not fit the disk; the folders are named <preset>-<N>l-*")
    m.add_argument("--dense-layers", type=int, default=None,
                   help="with --layers: how many of the kept layers are dense (first_k_dense_replace)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--force", action="store_true")
    m.set_defaults(fn=cmd_make_synthetic)
