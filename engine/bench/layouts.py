"""``colibri bench layouts``: the same model in several stores (e.g. int4 experts stored
row-major and row-interleaved by 4, ``colibri convert --expert-layout``), every store open in
one process with every expert resident, arms alternated request by request.

Why one process: fresh processes per arm (``bench kernels``) see the shared machine at different
moments, and a 5-10% kernel change drowns in the 2x swings of its memory bandwidth. Here each
repetition runs one request per arm back to back (the order reversed every other repetition),
on the same seeded stream: a ``--prompt``-token prefill then ``--tokens`` teacher-forced decode
steps (``forced_stream``), and reports the engine's own prefill and decode tok/s. Before timing,
the stores must give the same logits, bit for bit, on a seeded prompt (a layout never changes
values); a pair that differs is refused (they are not the same model, or a kernel is wrong).

Reported per arm: median and best tok/s; per arm after the first: the median over repetitions
of each repetition's ratio to the first arm and how many repetitions it was faster in. RAM:
every store's experts at once (two OLMoE-1B-7B int4 stores: ~8 GB).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from .common import forced_stream, machine_info, md_table, run_forced, write_results


def _parse_arm(s: str) -> tuple[str, str]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"{s!r}: give LABEL=STORE, e.g. il=bench/work/olmoe-1b-7b-int4-il")
    label, path = s.split("=", 1)
    if not label or not label.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise argparse.ArgumentTypeError(f"{s!r}: the label before '=' must be letters, digits, '-', '_' or '.'")
    if not path:
        raise argparse.ArgumentTypeError(f"{s!r}: give the store folder after '='")
    return label, path


def _positive(name: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = 0
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} {s!r}: give a whole number of at least 1")
        return v
    return parse


def run(stores: list[tuple[str, str]], threads: int, reps: int, prompt: int, tokens: int, seed: int) -> dict:
    """Open every store (cap = num_experts, all loaded), check they agree bit for bit, then
    ``reps`` repetitions of one request per arm. Returns {"arms": {label: {...}}, "runs": [...]}.

    Raises:
        ValueError: fewer than two stores, a label given twice, fewer than 1 repetition, prompt
            token or decode step, or stores whose logits differ.
    """
    from ..config import EngineConfig, ModelArgs
    from ..errors import EngineError
    from ..events import Finished
    from ..generate import Engine
    import psutil
    if len(stores) < 2:
        raise ValueError("--stores: give at least two LABEL=STORE arms to compare")
    labels = [label for label, _ in stores]
    if len(set(labels)) < len(labels):
        raise ValueError(f"--stores: each arm needs its own label ({', '.join(labels)})")
    if min(reps, prompt, tokens) < 1:
        raise ValueError("--reps, --prompt and --tokens: give at least 1 each")
    ctx = -(-(prompt + tokens + 8) // 256) * 256
    engs = {}
    try:
        for label, path in stores:
            try:
                E = ModelArgs.from_hf_config(Path(path) / "config.json").num_experts
            except EngineError as e:
                raise ValueError(f"--stores {label}={path}: {e}") from None
            # every engine's RAM budget checks this process's RSS, which holds all the arms
            eng = Engine.open(EngineConfig(store=path, cap=E, pilot=0, pinning=False, history=False, o_direct=False,
                                           threads=threads, context_length=ctx,
                                           ram_budget_gb=0.9 * psutil.virtual_memory().total / 1e9))
            engs[label] = eng
            for layer in range(eng.args.num_moe_layers):
                eng.cache.load_experts(layer, np.arange(E))
        first = stores[0][0]
        vocab = engs[first].args.vocab_size
        probe = np.asarray(forced_stream(vocab, 24, seed + 4242))
        ref = engs[first].model.forward(probe, 0, all_logits=True)
        for label, eng in engs.items():
            if label != first and not np.array_equal(eng.model.forward(probe, 0, all_logits=True).view(np.uint32),
                                                     ref.view(np.uint32)):
                raise ValueError(f"{label} ({eng.store.path}) and {first} ({engs[first].store.path}) give "
                                 f"different logits: not the same model in two layouts")

        def request(eng, r: int) -> Finished:
            s = forced_stream(vocab, prompt + tokens, seed + r)
            return run_forced(eng, s[:prompt], s[prompt:])
        for eng in engs.values():
            request(eng, 10_000)  # warm-up (JIT of this prompt length), its own stream, not counted
        labels = [label for label, _ in stores]
        runs = []
        for r in range(reps):
            for label in (labels if r % 2 == 0 else labels[::-1]):
                t0 = time.time()
                fin = request(engs[label], r)
                runs.append({"arm": label, "rep": r, "pp": fin.prefill_tok_per_s, "tg": fin.decode_tok_per_s,
                             "wall_s": time.time() - t0})
        arms = {}
        for label, eng in engs.items():
            mine = [x for x in runs if x["arm"] == label]
            arms[label] = {"store": str(eng.store.path), "expert_layout": eng.store.expert_layout,
                           "quant": eng.store.quant, "dense_quant": eng.store.dense_quant}
            for k in ("pp", "tg"):
                v = [x[k] for x in mine]
                arms[label][f"{k}_median"] = statistics.median(v)
                arms[label][f"{k}_best"] = max(v)
            if label != first:
                base = {x["rep"]: x for x in runs if x["arm"] == first}
                for k in ("pp", "tg"):
                    ratios = [x[k] / base[x["rep"]][k] for x in mine]
                    arms[label][f"{k}_paired_ratio"] = statistics.median(ratios)
                    arms[label][f"{k}_faster_in"] = sum(q > 1 for q in ratios)
        return {"arms": arms, "runs": runs, "threads_used": engs[first].threads}
    finally:
        for eng in engs.values():
            eng.close()


def main(a) -> int:
    res = run(a.stores, a.threads, a.reps, a.prompt, a.tokens, a.seed)
    first = a.stores[0][0]
    rows = [{"arm": k, **v} for k, v in res["arms"].items()]
    for r in rows:
        for k in ("tg", "pp"):
            if f"{k}_faster_in" in r:
                r[f"{k}_faster_in"] = f"{r[f'{k}_faster_in']} / {a.reps}"
    th = res["threads_used"]
    table = (f"Same model, {len(a.stores)} stores in one process, every expert resident, {a.reps} "
             f"repetition{'s' if a.reps != 1 else ''} alternated (order reversed every other), {th} "
             f"thread{'s' if th != 1 else ''}; pp{a.prompt} = prefill of {a.prompt} tokens, tg{a.tokens} = "
             f"{a.tokens} teacher-forced decode steps; tok/s. \"paired\": the median over repetitions of "
             f"each one's arm / {first} ratio (above 1: faster than {first}); \"faster in\": repetitions "
             f"where it was\n\n"
             + md_table(rows, [("arm", "arm", ""), ("expert layout", "expert_layout", ""),
                               (f"tg{a.tokens} median tok/s", "tg_median", ".1f"), ("best", "tg_best", ".1f"),
                               (f"/ {first} paired", "tg_paired_ratio", ".3f"), ("faster in", "tg_faster_in", ""),
                               (f"pp{a.prompt} median tok/s", "pp_median", ".1f"), ("best", "pp_best", ".1f"),
                               (f"/ {first} paired", "pp_paired_ratio", ".3f"), ("faster in", "pp_faster_in", "")]))
    write_results(a.name, {"bench": "layouts", "machine": machine_info(), "threads": a.threads, "reps": a.reps,
                           "prompt": a.prompt, "tokens": a.tokens, "seed": a.seed, **res}, table, a.out_dir)
    return 0


def add_parser(subparsers) -> None:
    """Register `bench layouts` on the bench verb's subparsers."""
    k = subparsers.add_parser("layouts", help="the same model in several stores (e.g. --expert-layout row_major "
                                              "vs interleaved_4), one process, requests alternated")
    k.add_argument("--stores", type=_parse_arm, nargs="+", required=True, metavar="LABEL=STORE", default=argparse.SUPPRESS,
                   help="the arms, each label once; ratios are to the first, e.g. rm=.../olmoe-1b-7b-int4 "
                        "il=.../olmoe-1b-7b-int4-il (required)")
    k.add_argument("--threads", type=int, default=2, help="compute threads of every arm (0: automatic)")
    k.add_argument("--reps", type=_positive("--reps"), default=24, help="repetitions (one request per arm each)")
    k.add_argument("--prompt", type=_positive("--prompt"), default=128, help="prefill tokens of each request")
    k.add_argument("--tokens", type=_positive("--tokens"), default=32,
                   help="teacher-forced decode steps of each request")
    k.add_argument("--seed", type=int, default=0, help="seed of the token streams")
    k.add_argument("--name", default="layouts_olmoe_1b_7b_int4", help="result file name (.json and .md)")
    k.add_argument("--out-dir", default="bench/results", help="folder of the result files")
    k.set_defaults(fn=main)
