"""``colibri bench ...``: reproducible measurements, results as JSON plus a markdown table in
bench/results/. One module per verb, each with ``add_parser(bs)``; shared helpers in common.py.

Floor: above the core and the library, below the CLI (nothing in engine/ outside the CLI
imports this package).

Protocol (the seeds' and colibri's benchmarking.md): compare arms in one run, interleaved;
every streaming arm is cold (a fresh engine; O_DIRECT so the page cache cannot serve experts);
random-weight models decode a fixed seeded token stream by teacher forcing and report the
distinct (layer, expert) pairs touched; hit rate, MB/token and felt wait come before wall
clock. Verbs:

  make-synthetic  a seeded random model (presets: 1b, olmoe-1b-7b, qwen3-30b-a3b, mixtral-8x7b):
                  bf16 checkpoint + conversion, or --direct-store (the int8/int4 store from the seed)
  decode          our decode tok/s vs transformers (bf16 and f32), all experts resident
  cache           streaming at several caps: hit rate, MB/token, felt wait, read service, tok/s
  pilot           PILOT A/B: each arm a fresh process, frozen heat restored, reps reversed
  matrix          RAM budget x PILOT x workers with the I/O-bound ceiling
  overlap         forced vs realistic (recorded trained-model) routing in memory cgroups, vs the ceiling
  disk            O_DIRECT read bandwidth of expert slabs (QD1 and QD4)
  replay          a routing trace through LRU, LFRU, EMA, ours and Belady
  trace-heldout   a routing trace of the default model over its held-out text
  gguf, peers     llama.cpp (Q8_0 GGUF) and transformers beside our engine, in cgroup memory limits
  layouts         the same model in several stores (expert layouts), one process, requests alternated
  contention      decode tok/s of the compute-thread defaults with 0, 1, 2 busy background processes
  serve           the OpenAI-compatible server vs the engine called directly; multi-turn prefill
  grammar         constrained decoding: the token mask's cost per token, llguidance vs xgrammar
  spec            speculative decoding (prompt lookup) vs plain, bundled model, edit-this-code prompts
A new benchmark: add ``engine/bench/<verb>.py`` with ``cmd_<verb>(args) -> int`` and
``add_parser(bs)``, and list the module in VERBS.
"""

from __future__ import annotations

import argparse
import functools
import importlib

VERBS = ("make_synthetic", "decode", "cache", "pilot", "disk", "replay", "matrix", "trace_heldout", "arm",
         "cluster",
         "gguf", "peers", "kernels", "layouts", "contention", "overlap", "serve", "grammar", "spec")


INTERNAL_VERBS = ("arm", "decode-arm", "peer-arm", "contention-arm")  # run by the verbs themselves, one arm per process


def add_bench_parser(sub) -> None:
    """Add ``bench`` and every verb's subcommand to the ``colibri`` argparse subparsers ``sub``."""
    b = sub.add_parser("bench", help="benchmarks (JSON + markdown in bench/results/)")
    # every bench command shows its defaults in --help; type(b): the command line's parser class
    # (it takes -v after the verb too)
    bs = b.add_subparsers(dest="bench_cmd", required=True, parser_class=functools.partial(
        type(b), formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    for verb in VERBS:
        importlib.import_module(f"{__name__}.{verb}").add_parser(bs)
    # the per-arm subprocess entry points stay callable but out of the listed verbs
    bs.metavar = "{" + ",".join(v for v in bs.choices if v not in INTERNAL_VERBS) + "}"
